"""SIGTERM or SIGHUP to a Python run never loses its record: the loop is asked to stop,
a checkpoint is taken at the step's end, and the log and socket are closed properly."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import records, spawn

HERE = Path(__file__).resolve().parent


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    log = tmp_path / "run.jsonl"
    ck = tmp_path / "ck"
    ck.mkdir()
    p = spawn(
        [
            str(HERE / "signalled_run.py"),
            "--mode",
            mode,
            "--log",
            str(log),
            "--checkpoints",
            str(ck),
        ]
    )
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    return p, log, ck


@pytest.mark.parametrize("mode, code", [("check", 0), ("ignore", 128 + signal.SIGTERM)])
def test_sigterm_stops_at_a_step_end_with_a_checkpoint_and_a_complete_log(
    tmp_path, runtime_dir, mode, code
):
    p, log, ck = start(tmp_path, mode)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == code, err
    recs = records(log)
    assert recs[-1]["kind"] == "finished" and recs[-1]["stopped_by_user"], recs[-3:]
    assert any(r["kind"] == "notice" and "SIGTERM" in r["text"] for r in recs)
    saved = [r for r in recs if r["kind"] == "checkpoint_saved"]
    assert saved and (ck / f"step-{saved[0]['step']}.txt").exists()
    assert list(runtime_dir.iterdir()) == [], "the socket was left behind"


def test_a_second_signal_ends_a_stuck_loop_at_once_and_records_it(tmp_path, runtime_dir):
    p, log, _ = start(tmp_path, "stuck")
    p.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert p.poll() is None, "one signal must only ask the loop to stop"
    p.send_signal(signal.SIGHUP)
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGHUP
    recs = records(log)
    assert recs[-1]["kind"] == "failed", recs[-3:]
    assert "second SIGHUP" in recs[-1]["reason"]
    assert list(runtime_dir.iterdir()) == []


def test_sigterm_while_paused_from_the_dashboard_stops_cleanly(tmp_path, runtime_dir):
    from conftest import Viewer

    p, log, ck = start(tmp_path, "check")
    sock = next(runtime_dir.glob("*.sock"))
    v = Viewer(str(sock))
    v.command("pause")
    v.until(lambda r: r["kind"] == "status" and r["status"] == "paused")
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    v.close()
    assert p.returncode == 0, err
    assert "finished cleanly" in out
    recs = records(log)
    assert recs[-1]["kind"] == "finished" and recs[-1]["stopped_by_user"], recs[-3:]
    assert any(r["kind"] == "checkpoint_saved" for r in recs)
