"""Real out-of-memory errors: a Python run under a hard cap below its starting
micro-batch recovers, settles under target and completes; `headroom attach` on a pty
shows the OOM and the decisions, and its keys reach the Python loop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import Screen, headroom_bin, records, spawn, spawn_on_pty

HERE = Path(__file__).resolve().parent
TARGET = 0.9


def start_capped(log: Path, *args: str) -> subprocess.Popen:
    return spawn([str(HERE / "capped_run.py"), "--log", str(log), *args])


def test_a_run_capped_below_its_start_recovers_settles_and_completes(tmp_path):
    log = tmp_path / "capped.jsonl"
    p = start_capped(log, "--steps", "10")
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    recs = records(log)
    ooms = [r for r in recs if r["kind"] == "oom"]
    assert ooms, "the cap never bit: no oom record"
    assert ooms[0]["micro_batch"] == 256 and ooms[0]["retry_with"] < 256
    assert "allocate" in ooms[0]["error"]
    resizes = [
        r["decision"]
        for r in recs
        if r["kind"] == "decision" and r["decision"]["decision"] == "resize"
    ]
    assert any(d["reason"] == "oom" for d in resizes)
    mem = [r for r in recs if r["kind"] == "step_memory"]
    assert [m["step"] for m in mem] == list(range(1, 11)), "a step was lost or repeated"
    # Settled under target: the last steps' peaks against the budget.
    assert all(m["usage"] < TARGET for m in mem[-5:]), [m["usage"] for m in mem]
    assert max(m["usage"] for m in mem[-5:]) > 0.5, "settled far below what fits"
    finished = [r for r in recs if r["kind"] == "finished"]
    assert finished and finished[0]["steps_done"] == 10
    assert finished[0]["memory"]["ooms"] == len(ooms)
    losses = result["losses"]
    assert len(losses) == 10 and losses[-1] < losses[0]


def _wait_log(log: Path, pred, timeout: float = 60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log.exists():
            recs = records(log)
            if pred(recs):
                return recs
        time.sleep(0.1)
    raise AssertionError(f"never logged; last records: {records(log)[-5:] if log.exists() else []}")


def test_attach_shows_the_python_runs_oom_and_its_keys_reach_the_loop(tmp_path, runtime_dir):
    log = tmp_path / "capped.jsonl"
    # Far more steps than the test takes: it stops the run itself, however long the viewer
    # took to attach and each key to be answered on this machine.
    steps = 100_000
    p = start_capped(log, "--steps", str(steps), "--hold", "0.1")
    try:
        _wait_log(log, lambda rs: any(r["kind"] == "step" for r in rs), timeout=120)
        pid, fd = spawn_on_pty([headroom_bin(), "attach", "capped"])
        screen = Screen(fd)
        try:
            assert screen.wait_for("attached to"), screen.text()
            # The OOM at step 1 came before the viewer: the catch-up brings it to screen.
            assert screen.wait_for("out of memory at micro-batch 256"), screen.text()
            # And the controller's decision it led to.
            assert screen.wait_for("shrink 256 → "), screen.text()
            assert screen.wait_for("after out of memory"), screen.text()
            screen.send(b"p")
            recs = _wait_log(
                log,
                lambda rs: any(
                    r["kind"] == "command_applied" and r["command"]["command"] == "pause"
                    for r in rs
                ),
            )
            assert screen.wait_for("paused")
            paused_steps = sum(r["kind"] == "step" for r in recs)
            time.sleep(1.5)
            now = sum(r["kind"] == "step" for r in records(log))
            assert now <= paused_steps + 1, "the Python loop kept stepping while paused"
            screen.send(b"p")
            _wait_log(
                log,
                lambda rs: any(
                    r["kind"] == "command_applied" and r["command"]["command"] == "resume"
                    for r in rs
                ),
            )
            # Stop from the dashboard: the loop reads run.should_stop and ends early.
            screen.send(b"S")
            assert screen.wait_for("stop the run?"), screen.text()
            screen.send(b"y")
            _wait_log(log, lambda rs: rs[-1]["kind"] == "finished", timeout=120)
            screen.send(b"q")
            _, status = os.waitpid(pid, 0)
            assert os.WEXITSTATUS(status) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.close(fd)
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        finished = records(log)[-1]
        assert finished["kind"] == "finished" and finished["stopped_by_user"]
        assert finished["steps_done"] < steps
    finally:
        if p.poll() is None:
            p.kill()
