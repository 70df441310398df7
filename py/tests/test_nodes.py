"""Beyond one machine, simulated on one (issue 31): two torchrun agents as two nodes of 2
ranks each (c10d rendezvous on localhost), DDP and FSDP2. The job trains; `headroom
attach HOST:PORT --token-file` to rank 0 over TCP shows all four ranks' rows; a kill -9 of
a rank on the node that does not hold rank 0 ends the job within 30 s, rank 0 naming
the rank it lost."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

import conftest
from conftest import Screen, headroom_bin, kinds, live_records, spawn, spawn_on_pty

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(node: int, port: int, script: str, out: Path, *args: str) -> subprocess.Popen:
    """One node's torchrun agent: 2 ranks, rendezvous through the c10d store on localhost
    (whichever agent comes first hosts it; the ranks are numbered as the agents join)."""
    job = spawn(
        [
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"twonodes{port}",
            str(HERE / script),
            *args,
            "--out",
            str(out),
        ],
        new_session=True,
        output=out / f"node{node}",
    )
    job.out = out / f"node{node}"
    conftest._jobs.append(job)
    return job


def _said(agent: subprocess.Popen) -> str:
    return (agent.out / "out.txt").read_text()


@pytest.mark.parametrize("script", ["ddp_adaptive.py", "fsdp_adaptive.py"], ids=["ddp", "fsdp2"])
def test_two_nodes_train_show_four_ranks_over_tcp_and_a_kill_on_the_second_ends_the_job(
    tmp_path, script, runtime_dir
):
    port = _free_port()
    args = ("--steps", "100000", "--per-rank", "8", "--step-sleep", "0.05")
    args += ("--listen", "127.0.0.1:0")
    agents = [_agent(n, port, script, tmp_path, *args) for n in (0, 1)]
    pid = fd = None
    try:
        # Every rank says its pid once it serves; rank 0 also its TCP address and token.
        deadline = time.monotonic() + 180
        while True:
            said = [_said(a) for a in agents]
            ranks = [dict(re.findall(r"rank (\d+) pid (\d+) serving", s)) for s in said]
            tcp = re.search(r"rank 0 tcp (\S+) token (\S+)", "".join(said))
            if sum(len(r) for r in ranks) == 4 and tcp:
                break
            for a in agents:
                assert a.poll() is None, (a.out / "err.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, f"not every rank served: {said}"
            time.sleep(0.2)
        deadline = time.monotonic() + 120
        while len(live_records(tmp_path / "rank0.jsonl", "step")) < 3:
            assert time.monotonic() < deadline, "rank 0 never reached step 3"
            time.sleep(0.2)
        # The dashboard over TCP, with the token rank 0 wrote beside its socket.
        address, token = tcp.group(1), tcp.group(2)
        pid, fd = spawn_on_pty([headroom_bin(), "attach", address, "--token-file", token])
        screen = Screen(fd)
        assert screen.wait_for("4 ranks", timeout=60), screen.text()
        # A row per rank: its number, then its host (both nodes are this machine).
        host = re.escape(socket.gethostname()[:10])
        deadline = time.monotonic() + 30
        while True:
            shown = {int(m) for m in re.findall(rf"(?m)^\W*([0-3]) +{host}", screen.text())}
            if shown == {0, 1, 2, 3}:
                break
            assert time.monotonic() < deadline, f"rows {shown}:\n{screen.text()}"
            screen.pump(0.3)
        # A rank of the node without rank 0.
        second = next(i for i, r in enumerate(ranks) if "0" not in r)
        victim, victim_pid = next(iter(ranks[second].items()))
        t0 = time.monotonic()
        os.kill(int(victim_pid), signal.SIGKILL)
        for a in agents:
            a.wait(60)
        ended = time.monotonic() - t0
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        if fd is not None:
            os.close(fd)
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    assert ended < 30, f"the two agents took {ended:.1f} s to end the job"
    assert all(a.returncode != 0 for a in agents), [a.returncode for a in agents]
    failed = kinds(tmp_path / "rank0.jsonl", "failed")
    assert failed, "rank 0's run did not end as failed"
    # Rank 0 names the ranks missing at its agreement: the one killed is among them (its
    # node's agent ends the other; a rank of rank 0's node can be caught mid-collective).
    lost = re.search(r"the job lost ranks? ([\d, ]+)", failed[0]["reason"])
    assert lost and int(victim) in [int(r) for r in lost.group(1).split(", ")], failed
    rows = kinds(tmp_path / "rank0.jsonl", "job_ranks")
    assert rows and [row["rank"] for row in rows[-1]["ranks"]] == [0, 1, 2, 3], rows[-1:]
