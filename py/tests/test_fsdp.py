"""Adaptive micro-batching under FSDP2 (fully_shard per block and at the root) on CPU
with gloo under a real torchrun: an out-of-memory error on one rank at each point of a
step (the optimizer's first step, a middle forward inside a unit, the first and the last
backward) has every rank leave the step at its next collective's gate and redo it, no
rank waits on a collective, and the gathered parameters equal one process's training
on the global batch."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from test_ddp import (
    EVERY_POINT,
    TOL,
    _pids,
    _wait_for_steps,
    reference,
    short_job,
    sigterm_in_a_long_step,
)

from conftest import TinyGPT, assert_params_close, finish, kinds, torchrun, wait

pytest.importorskip("torch.distributed.fsdp")


def test_auto_holds_the_unsharded_gradients_while_they_take_a_tenth_of_the_limit():
    from headroom._fsdp import holds_unsharded

    assert holds_unsharded("auto", 100 << 20, 1000 << 20)
    assert not holds_unsharded("auto", (100 << 20) + 1, 1000 << 20)
    assert holds_unsharded("hold", 1 << 40, 1 << 30)
    assert not holds_unsharded("reduce", 1, 1 << 30)


@pytest.mark.parametrize(
    ("world", "rank", "accumulation"),
    [(2, 1, "reduce"), (4, 2, "auto")],
    ids=["2-ranks-reduce-each", "4-ranks-hold"],
)
def test_ooms_on_one_rank_at_every_point_are_recovered_by_every_rank(
    tmp_path, world, rank, accumulation
):
    """With the unsharded gradients held until the last micro-batch (what "auto" chooses
    for this small model) and with a reduce-scatter after every micro-batch."""
    steps, per_rank = 5, 12
    inject = f"{rank}:{EVERY_POINT}"
    job = torchrun(
        world,
        "fsdp_adaptive.py",
        "--sharded-accumulation",
        accumulation,
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
        said = {
            "reduce": "reduce-scatters its gradients after every micro-batch",
            "auto": "holds its units' unsharded gradients",
        }[accumulation]
        assert any(said in t for t in texts), texts
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
        # 3 units, 3 micro-batches a step: a reduce-scatter per unit and micro-batch, or
        # per unit and step (a redone step's attempt adds its own).
        if accumulation == "reduce":
            assert done["reduce_scatters"] >= 3 * 3 * steps, done
        else:
            assert done["reduce_scatters"] <= 3 * (steps + 3), done
        # The run took its gloo groups with it, and a forward after it passed no gate.
        assert done["groups_after"] == done["groups_before"], done
        assert done["gates_after_run"] == 0, done
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


def test_torch_compile_of_the_sharded_root_runs_through_its_gates(tmp_path):
    """`torch.compile(root)` after fully_shard: headroom looks through the compile
    wrapper to the FSDP2 root (it was refused, told to give the Run that root, which it
    had been), gates its units, and the job learns one process's parameters. (This
    torch's dynamo traces no graph through FSDP2's hooks here: what runs is eager.)"""
    steps, per_rank = 3, 12
    finish(short_job(tmp_path, "fsdp_adaptive.py", "--compile", "outer"))
    for r in range(2):
        done = json.loads((tmp_path / f"done-rank{r}.json").read_text())
        assert done["steps"] == steps and done["gates"] > 0, (r, done)
        texts = [n["text"] for n in kinds(tmp_path / f"rank{r}.jsonl", "notice")]
        assert any("FSDP2 with 3 units" in t for t in texts), texts
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(got, reference(steps, per_rank * 2), TOL)


def test_one_process_with_fsdp2_recovers_ooms_at_every_point_and_learns_the_same(tmp_path):
    """World size 1 (the run joins no job, no gates): an out-of-memory error inside a unit
    used to leave it half run (its parameters gathered for good), and the run then learned
    something else. Now every unit is put back and the step's samples start over."""
    steps, per_rank = 5, 12
    job = torchrun(
        1,
        "fsdp_adaptive.py",
        "--steps",
        str(steps),
        "--per-rank",
        str(per_rank),
        "--micro",
        "4",
        "--inject",
        f"0:{EVERY_POINT}",
        "--out",
        str(tmp_path),
    )
    finish(job)
    done = json.loads((tmp_path / "done-rank0.json").read_text())
    assert done["steps"] == steps and done["fired"] == [1, 2, 3, 4], done
    assert done["sharded"], "a unit was left with its parameters gathered"
    assert [o["step"] for o in kinds(tmp_path / "rank0.jsonl", "oom")] == [2, 3, 4]
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(got, reference(steps, per_rank), TOL)


def test_a_rank_killed_mid_run_ends_the_job_and_the_others_name_it(tmp_path):
    """kill -9 of a rank under FSDP2: the others, at a gate or inside a collective, see
    its connection close and end as failed naming it, well before torchrun's 30 s."""
    job = torchrun(
        2, "fsdp_adaptive.py", "--steps", "100000", "--per-rank", "8", "--out", str(tmp_path)
    )
    try:
        pids = _pids(job, 2)
        _wait_for_steps(tmp_path / "rank0.jsonl", 3, job)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        wait(job, 60)
        ended = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert ended < 30, f"torchrun took {ended:.1f} s to end the job"
    failed = kinds(tmp_path / "rank0.jsonl", "failed")
    assert failed, "rank 0's run did not end as failed"
    assert "rank 1" in failed[0]["reason"], failed


def test_sigterm_to_torchrun_saves_every_ranks_shards_at_one_step(tmp_path):
    """SIGTERM to torchrun: the job agrees on a step, every rank's on_checkpoint saves its
    shards there (torch.distributed.checkpoint, a collective), each run finishes as
    stopped, and the checkpoint loads into an unsharded model in one process."""
    import torch.distributed.checkpoint as dcp

    job = torchrun(
        2,
        "fsdp_adaptive.py",
        "--steps",
        "100000",
        "--per-rank",
        "8",
        "--step-sleep",
        "0.1",
        "--checkpoint",
        "--out",
        str(tmp_path),
    )
    try:
        _pids(job, 2)
        _wait_for_steps(tmp_path / "rank1.jsonl", 3, job)
        job.send_signal(signal.SIGTERM)
        wait(job, 60)
    finally:
        if job.poll() is None:
            job.kill()
    steps = []
    for r in range(2):
        done = json.loads((tmp_path / f"done-rank{r}.json").read_text())
        finished = kinds(tmp_path / f"rank{r}.jsonl", "finished")
        assert finished and finished[0]["stopped_by_user"], (r, finished)
        saved = kinds(tmp_path / f"rank{r}.jsonl", "checkpoint_saved")
        assert [c["step"] for c in saved] == [done["steps"]], saved
        steps.append(done["steps"])
    assert steps[0] == steps[1], f"the ranks stopped at different steps: {steps}"
    model = TinyGPT()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / f"ckpt-step{steps[0]}"))
    model.load_state_dict(state["model"])
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(dict(model.named_parameters()), got, 0.0)


def test_sigterm_in_a_long_step_gives_it_up_on_every_rank_and_saves_the_last_completed(
    tmp_path,
):
    """Under FSDP2 a rank with a stop signal leaves the step at its next gate (a unit's
    all-gather or reduce-scatter) or micro-batch, the others at theirs, FSDP is reset and
    the step given up on every rank; the shards of step 1 are saved, loadable."""
    import torch.distributed.checkpoint as dcp

    sigterm_in_a_long_step(tmp_path, "fsdp_adaptive.py")
    model = TinyGPT()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt-step1"))


def test_a_rank_under_a_real_cap_sets_every_ranks_count_and_the_job_trains(tmp_path):
    """Rank 1 alone under a real hard cap: it runs out of memory for real (every rank
    redoes those steps), settles under target, every rank runs its count of micro-batches,
    and the job's parameters stay exact."""
    steps, per_rank, seq, width = 6, 128, 128, 64
    job = torchrun(
        2,
        "fsdp_adaptive.py",
        "--steps",
        str(steps),
        "--per-rank",
        str(per_rank),
        "--micro",
        str(per_rank),
        "--seq",
        str(seq),
        "--width",
        str(width),
        "--budget-rank",
        "1",
        "--budget-extra-mib",
        "160",
        "--out",
        str(tmp_path),
    )
    finish(job)
    capped, free = tmp_path / "rank1.jsonl", tmp_path / "rank0.jsonl"
    assert kinds(capped, "oom"), "the cap never bit"
    assert not kinds(free, "oom")
    assert kinds(capped, "step_memory")[-1]["usage"] < 0.95, kinds(capped, "step_memory")[-1]
    # The capped rank's need is every rank's count.
    counts = [[s["accum_steps"] for s in kinds(log, "step")] for log in (free, capped)]
    assert counts[0] == counts[1] and counts[0][-1] > 1, counts
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(got, reference(steps, per_rank * 2, seq, width), TOL)
