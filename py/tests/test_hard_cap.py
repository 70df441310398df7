"""A hard-capped Python run that gives up at micro-batch 1 ends with its record, its
message and its checkpoint, never with an abort: headroom's own allocations are never
what the cap refuses, and the give-up's on_checkpoint runs with the cap lifted. Run in
processes of their own (the cap is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.mark.parametrize("full_cap", [False, True], ids=["cap", "full-cap"])
def test_a_capped_run_that_gives_up_writes_its_record_message_and_checkpoint(tmp_path, full_cap):
    env = dict(os.environ)
    if full_cap:
        env["HEADROOM_INJECT_FULL_CAP"] = "1"
    log, ckpt = tmp_path / "run.jsonl", tmp_path / "last.pt"
    p = subprocess.run(
        [sys.executable, str(HERE / "giveup_capped.py"), "--log", str(log), "--ckpt", str(ckpt)],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # An uncaught OutOfMemory: Python's exit 1, not SIGABRT's -6.
    assert p.returncode == 1, p.stderr[-3000:]
    assert "OutOfMemory" in p.stderr and "ran out of memory" in p.stderr, p.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    assert records[-1]["kind"] == "failed", records[-1]
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == [1, 2]
    saved = torch.load(ckpt, weights_only=True)
    assert saved["step"] == 2, "the last completed step is saved"
    assert any(
        r["kind"] == "notice" and "saved by on_checkpoint" in r.get("text", "") for r in records
    ), [r.get("text") for r in records if r["kind"] == "notice"]
