"""A resumed adaptive loop continues the controller the run had (run.state_dict() carries
its journal, load_state_dict() replays it): the same micro-batch splits as the loop that
was never interrupted, and bit-identical parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import headroom

from conftest import TinyGPT, spawn

HERE = Path(__file__).resolve().parent
# A micro-batch above 6 samples fails with the allocator's out-of-memory error: the
# ceiling the controller learns in steps 1 and 3, and keeps probing below after them.
ARGS = ["--steps", "10", "--ceiling", "6"]


def loop(tmp_path: Path, out: str, *extra: str) -> tuple[dict, dict]:
    p = spawn([str(HERE / "resumed_run.py"), *ARGS, "--out", str(tmp_path / out), *extra])
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    splits = json.loads((tmp_path / out).with_suffix(".json").read_text())
    return {int(k): v for k, v in splits.items()}, torch.load(tmp_path / out)


def test_a_resumed_adaptive_loop_splits_its_steps_as_the_uninterrupted_one(tmp_path):
    # Never interrupted; it writes a checkpoint after step 4 on its way.
    full, full_params = loop(tmp_path, "full.pt", "--save-after", "4")
    checkpoint = str(tmp_path / "full.ck")
    resumed, params = loop(tmp_path, "resumed.pt", "--resume", checkpoint)
    later = {s: full[s] for s in range(5, 11)}
    print(f"uninterrupted steps 5-10: {later}\nresumed: {resumed}")
    assert resumed == later
    for k in full_params:
        assert torch.equal(params[k], full_params[k]), k
    # The test's power: a resume without the run's state (what the package did before it
    # had one) starts a fresh controller, which relearns the ceiling with other splits.
    fresh, fresh_params = loop(tmp_path, "fresh.pt", "--resume", checkpoint, "--no-state")
    print(f"resumed without the run's state: {fresh}")
    assert fresh != later
    assert not all(torch.equal(fresh_params[k], full_params[k]) for k in full_params)


def test_load_state_dict_is_refused_after_a_step_and_for_what_is_not_a_run_state():
    torch.manual_seed(0)
    model = TinyGPT(t=8, layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randint(0, 64, (4, 8))
    with headroom.Run("state", model=model, effective_batch=4) as run:
        state = run.state_dict()
        with pytest.raises(headroom.RunError, match="what run.state_dict\\(\\) returned"):
            run.load_state_dict({"step": 3})
        run.backward((x, torch.roll(x, -1, 1)), model.loss)
        run.step(opt)
        with pytest.raises(headroom.RunError, match="before its first step"):
            run.load_state_dict(state)
