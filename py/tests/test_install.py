"""`pip install` gives the viewer: the wheel built from ./py, installed into a
fresh venv that has no torch and no libtorch on the library path, runs `headroom ls` and
`headroom replay --end` of a shipped run log from the venv's own console script, and
`headroom train` there says it needs the full build.

The wheel is built once per test session (conftest's `wheel`: maturin, into the
workspace's target/, so cargo reuses what `./dev test` already compiled) and installed with
pip from the file."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import venv
from pathlib import Path

import pytest

from conftest import ROOT, Screen, spawn_on_pty

LOG = ROOT / "tests" / "fixtures" / "tiny-run.jsonl"


@pytest.fixture(scope="session")
def viewer_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv (no torch in it, none reachable) with the wheel installed."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    subprocess.run(
        [env_dir / "bin" / "python", "-m", "pip", "install", "-q", "--no-index", str(wheel)],
        check=True,
    )
    return env_dir


def _clean_env(venv_dir: Path, runtime_dir: Path) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_LIBRARY_PATH", "PYTHONPATH", "LIBTORCH", "VIRTUAL_ENV")
    }
    env["PATH"] = f"{venv_dir / 'bin'}:/usr/bin:/bin"
    env["HEADROOM_RUNTIME_DIR"] = str(runtime_dir)
    return env


def test_the_wheels_headroom_command_lists_replays_and_points_train_at_the_full_build(
    viewer_venv, runtime_dir
):
    script = viewer_venv / "bin" / "headroom"
    assert script.exists(), "the wheel installs a headroom console script"
    env = _clean_env(viewer_venv, runtime_dir)
    probe = subprocess.run(
        [viewer_venv / "bin" / "python", "-c", "import torch"], env=env, capture_output=True
    )
    assert probe.returncode != 0, "the venv must not reach a torch: the viewer needs none"

    ls = subprocess.run([script, "ls"], env=env, capture_output=True, text=True, timeout=30)
    assert ls.returncode == 0, ls.stderr
    assert "no runs are running" in ls.stderr, ls.stderr

    train = subprocess.run([script, "train"], env=env, capture_output=True, text=True)
    assert train.returncode == 2
    assert "needs the full build" in train.stderr and "./dev train" in train.stderr

    # The replay draws the dashboard on a terminal: a pty, as a user's.
    started = time.monotonic()
    pid, fd = spawn_on_pty([str(script), "replay", "--end", str(LOG)], env=env)
    screen = Screen(fd)
    try:
        # The replay's last step and its end, drawn from the log's final state.
        assert screen.wait_for("\x1b[?1049h", 30), screen.text()
        assert screen.wait_for("replay", 30), screen.text()
        assert screen.wait_for("completed", 30), screen.text()
        drawn = time.monotonic() - started
        screen.send(b"q")
        screen.pump(20)  # to the end of its output: the pty closes when it exits
        _, status = os.waitpid(pid, 0)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, screen.text()
    assert b"\x1b[?1049l" in screen.data, "the screen was given back"
    print(f"replay --end drawn {drawn * 1000:.0f} ms after the start")
