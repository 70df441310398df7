"""Adaptive micro-batching under FSDP2 (fully_shard per block and at the root) on CPU
with gloo under a real torchrun: an out-of-memory error on one rank at each point of a
step (the optimizer's first step, a middle forward inside a unit, the first and the last
backward) has every rank leave the step at its next collective's gate and redo it, no
rank waits on a collective, and the gathered parameters equal one process's training
on the global batch."""

from __future__ import annotations

import json

import pytest
import torch
from test_ddp import TOL, reference

from conftest import TinyGPT, assert_params_close, finish, kinds, torchrun

pytest.importorskip("torch.distributed.fsdp")


@pytest.mark.parametrize(("world", "rank"), [(2, 1), (4, 2)], ids=["2-ranks", "4-ranks"])
def test_ooms_on_one_rank_at_every_point_are_recovered_by_every_rank(tmp_path, world, rank):
    steps, per_rank = 5, 12
    inject = f"{rank}:optimizer-state@1,forward-middle@2,backward-first@3,backward-last@4"
    job = torchrun(
        world,
        "fsdp_adaptive.py",
        "--steps",
        str(steps),
        "--per-rank",
        str(per_rank),
        "--micro",
        "4",
        "--inject",
        inject,
        "--out",
        str(tmp_path),
    )
    finish(job)
    for r in range(world):
        done = json.loads((tmp_path / f"done-rank{r}.json").read_text())
        assert done["steps"] == steps, (r, done)
        log = tmp_path / f"rank{r}.jsonl"
        assert [s["step"] for s in kinds(log, "step")] == list(range(1, steps + 1))
        assert kinds(log, "finished"), f"rank {r} did not finish"
        texts = [n["text"] for n in kinds(log, "notice")]
        assert any("FSDP2 with 3 units" in t for t in texts), texts
        if r == rank:
            assert done["fired"] == [1, 2, 3, 4], done
            # The optimizer's is undone and retried in place; the other three redo the step.
            assert [o["step"] for o in kinds(log, "oom")] == [2, 3, 4], kinds(log, "oom")
            assert any("optimizer.step() before it changed anything" in t for t in texts)
            assert sum("every rank of the job redoes" in t for t in texts) == 3, texts
        else:
            assert not kinds(log, "oom")
            assert sum("another rank of the job ran out of memory" in t for t in texts) == 3
        # Every rank ran the same micro-batch count each step: the step records agree.
        assert done["gates"] > 0
    # The controller counts what this rank holds: its shards of the parameters, their
    # gradients and SGD's momentum, a world-th of the model's.
    n_params = sum(p.numel() for p in TinyGPT().parameters())
    for r in range(world):
        splits = kinds(tmp_path / f"rank{r}.jsonl", "plan_split")
        assert splits, f"rank {r} logged no split"
        assert splits[0]["model_bytes"] == 3 * 4 * n_params // world, splits[0]
    counts = {
        r: [s["accum_steps"] for s in kinds(tmp_path / f"rank{r}.jsonl", "step")]
        for r in range(world)
    }
    assert len({tuple(c) for c in counts.values()}) == 1, counts
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(got, reference(steps, per_rank * world), TOL)
