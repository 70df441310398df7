"""Evaluation that never runs out of memory: evaluation batches far above what a real
cap allows (eval_capped.py, in processes of their own) complete in a hand-written loop
(`run.evaluate`), the HF Trainer (`headroom.hf.adapt`: evaluation during `train()` and
`trainer.evaluate()` after it) and Lightning (`Adaptive`'s validation), with the results
of an unsplit evaluation; the size learned in the first pass is where the next starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import headroom

from conftest import kinds, records, spawn

HERE = Path(__file__).resolve().parent


def _evaluate(tmp_path, mode: str) -> dict:
    """The same script capped and with room to spare, side by side (one thread each)."""
    procs = {}
    for how in ("headroom", "uncapped"):
        log = tmp_path / f"{how}.jsonl"
        argv = [str(HERE / "eval_capped.py"), "--mode", mode, "--how", how, "--log", str(log)]
        procs[how] = (spawn([*argv, "--out", str(tmp_path / how)]), log)
    out = {}
    for how, (p, log) in procs.items():
        stdout, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{how}: {stdout[-2000:]} {err[-3000:]}"
        out[how] = (json.loads(stdout.strip().splitlines()[-1])["results"], log)
    return out


def _close(a, b, path="result"):
    if isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    else:
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9), f"{path}: {a} vs {b}"


@pytest.mark.parametrize("mode", ["loop", "hf", "lightning"])
def test_evaluation_batches_a_cap_cannot_hold_complete_with_the_unsplit_results(tmp_path, mode):
    out = _evaluate(tmp_path, mode)
    (capped, log), (free, free_log) = out["headroom"], out["uncapped"]
    # Every evaluation, equal to the one that ran each batch whole.
    assert len(capped) == {"loop": 2, "hf": 3, "lightning": 2}[mode], capped
    _close(capped, free)
    # With room, nothing was split.
    for m in kinds(free_log, "eval_memory"):
        assert (m["size"], m["ooms"], m["chunks"]) == (m["asked"], 0, m["batches"]), m
    # Under the cap: real out-of-memory errors in the first pass, its chunks retried
    # smaller, said as the controller's decisions.
    passes = kinds(log, "eval_memory")
    first, later = passes[0], passes[1:]
    assert first["ooms"] >= 1 and first["size"] < first["asked"], first
    ooms = kinds(log, "eval_oom")
    assert len(ooms) == first["ooms"]
    for o in ooms:
        assert o["retry_with"] < o["size"] and "allocate" in o["error"], o
    sized = [
        d["decision"] for d in kinds(log, "decision") if d["decision"]["decision"] == "eval_size"
    ]
    assert [d["to"] for d in sized if d["reason"] == "oom"] == [o["retry_with"] for o in ooms]
    # The next pass starts at the learned size: no error, not the asked size again.
    assert later
    for m in later:
        assert m["ooms"] == 0 and m["size"] <= first["size"], m
    # Training's micro-batch is its own: what the steps after an evaluation ran at is
    # what the steps before it did.
    steps = kinds(log, "step")
    assert len({s["micro_batch"] for s in steps}) == 1, [s["micro_batch"] for s in steps]
    if mode == "hf":
        # trainer.evaluate() after train() went on from the fit's run: its own log, the
        # learned size kept (no error).
        after = sorted(tmp_path.glob("headroom-*.jsonl"))
        assert after, list(tmp_path.iterdir())
        own = kinds(after[-1], "eval_memory")
        assert len(own) == 1 and own[0]["ooms"] == 0 and own[0]["size"] == first["size"], own
        assert records(after[-1])[-1]["kind"] == "finished"
    assert records(log)[-1]["kind"] == "finished"


def test_chunks_combine_as_the_whole_batch_would(tmp_path):
    """`run.evaluate`'s combine rules, on a batch split by a real out-of-memory error's
    path (the controller told a chunk of 8 ran out of memory)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(8, 4)
    whole = model(x)
    with headroom.Run(
        "combine", model=model, effective_batch=8, log=str(tmp_path / "c.jsonl")
    ) as run:
        run._native.eval_begin("eval")
        assert run._native.eval_oom(8, 1, "injected") == 4

        def result(b):
            out = model(b)
            return {
                "mean": out.mean(),
                "rows": out,
                "count": int(b.shape[0]),
                "pair": (out.max(), None),
            }

        r = run.evaluate(x, result)
        assert torch.allclose(r["mean"], whole.mean(), rtol=1e-6)
        assert torch.equal(r["rows"], whole)
        assert r["count"] == 8
        # A float scalar is taken for a mean: a max is not one, and comes out averaged;
        # combine= says how instead.
        assert not torch.allclose(r["pair"][0], whole.max()) and r["pair"][1] is None
        top = run.evaluate(
            x, lambda b: model(b).max(), combine=lambda parts: max(v for _, v in parts)
        )
        assert torch.equal(top, whole.max())
        with pytest.raises(TypeError, match="give combine=fn"):
            run.evaluate(x, lambda b: object())
        with pytest.raises(TypeError, match="not per sample"):
            run.evaluate(x, lambda b: model(b)[:1], combine="cat")
    memory = kinds(tmp_path / "c.jsonl", "eval_memory")
    assert memory and memory[0]["ooms"] == 1 and memory[0]["asked"] == 8 and memory[0]["size"] == 4


def test_evaluate_between_backward_and_step_is_refused(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 4)
    with headroom.Run(
        "order", model=model, effective_batch=4, log=str(tmp_path / "o.jsonl")
    ) as run:
        run.backward(x, lambda b: model(b).pow(2).mean())
        with pytest.raises(headroom.RunError, match="between run.backward"):
            run.evaluate(x, lambda b: model(b).mean())
        run.step(opt)
        assert float(run.evaluate(x, lambda b: model(b).mean())) == pytest.approx(
            float(model(x).mean().detach())
        )
