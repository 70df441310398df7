"""Under torchrun every rank serves its own stream, named by job and rank; `headroom ls`
lists a job's ranks together; adaptive mode under a process group refuses, never hangs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from conftest import headroom_bin, spawn

HERE = Path(__file__).resolve().parent


def test_each_rank_serves_and_ls_groups_the_job(tmp_path, runtime_dir):
    release = tmp_path / "release"
    job = spawn(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--rdzv-id",
            "pytestjob",
            str(HERE / "ddp_ranks.py"),
            "--release",
            str(release),
        ]
    )
    try:
        deadline = time.monotonic() + 120
        listed = ""
        while time.monotonic() < deadline:
            ls = subprocess.run([headroom_bin(), "ls"], capture_output=True, text=True)
            listed = ls.stdout
            if "2 of 2 ranks serving here" in listed:
                break
            assert job.poll() is None, job.communicate()
            time.sleep(0.3)
        else:
            raise AssertionError(f"the job's ranks were never both listed:\n{listed}")
        rows = [line for line in listed.splitlines() if line.startswith("ddp.")]
        assert len(rows) == 2, listed
        assert ".rank0" in rows[0] and ".rank1" in rows[1], listed
        assert "rank 0/2" in rows[0] and "rank 1/2" in rows[1], listed
        release.touch()
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    for rank in (0, 1):
        assert f"rank {rank} refused: run.backward() under an initialised process group" in out
        assert "deadlock" in out
