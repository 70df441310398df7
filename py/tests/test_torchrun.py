"""Under torchrun every rank serves its own stream, named by job and rank; `headroom ls`
lists a job's ranks together; rank 0 of a watched job logs every rank's row; adaptive mode
refuses what it cannot make safe (a model neither in DDP nor sharded by FSDP2 at its
root), never hangs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from conftest import headroom_bin, kinds, spawn

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
    rows = kinds(tmp_path / "watch-rank0.jsonl", "job_ranks")
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    assert [[row["rank"] for row in r["ranks"]] for r in rows] == [[0, 1]] * 3
    assert rows[-1]["ranks"][1]["step"] == 3 and rows[-1]["ranks"][1]["loss"] is not None
    assert not kinds(tmp_path / "watch-rank1.jsonl", "job_ranks")
    for rank in (0, 1):
        assert f"rank {rank} refused plain: adaptive mode under a process group" in out, out
        assert "DistributedDataParallel" in out
        if f"rank {rank} no fsdp" not in out:
            assert f"rank {rank} trained fsdp: 1 step" in out, out
            assert f"rank {rank} refused fsdp: adaptive mode under a process group" in out, out
            assert "give the Run that root" in out
