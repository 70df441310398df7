"""Adaptive micro-batching under real torchrun jobs (gloo, CPU): out-of-memory errors on
one rank at every point of a step are recovered by the job without a deadlock, and the
parameters equal a single process's full-global-batch training."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    TinyGPT,
    assert_params_close,
    branch_batch,
    finish,
    gpt_batches,
    kinds,
    live_records,
    output,
    torchrun,
    wait,
)

HERE = Path(__file__).resolve().parent
SEQ, WIDTH = 16, 32


def reference(
    steps: int, global_batch: int, seq: int = SEQ, width: int = WIDTH, branch: int = 0
) -> dict[str, torch.Tensor]:
    """One process, the whole global batch in one backward per step. `branch`: the model
    has TinyGPT's branch, which the batch's first `branch` samples take (rank 0's)."""
    torch.manual_seed(0)
    model = TinyGPT(d=width, t=seq, branch=branch > 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for b in gpt_batches(steps, global_batch, t=seq, seed=0):
        if branch:
            x = b[0]
            branch_batch(x, branch)
            b = (x, torch.roll(x, -1, dims=1))
        model.loss(b).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


# An out-of-memory error at every point of a step, one step each (the rank scripts'
# --inject points; the optimizer's state exists after step 1).
EVERY_POINT = "optimizer-state@1,forward-middle@2,backward-first@3,backward-last@4"

# A parameter's largest difference from the one-process reference's (float32 rounding of
# the all-reduce's sums and the micro-batches').
TOL = 1e-6


@pytest.mark.parametrize(
    ("world", "rank", "bucket_kib"),
    [(2, 1, 8), (4, 2, 0)],
    ids=["2-ranks-small-buckets", "4-ranks"],
)
def test_ooms_on_one_rank_at_every_point_are_recovered_by_the_job(
    tmp_path, world, rank, bucket_kib
):
    """With 8 KiB buckets the model's gradients go in a dozen all-reduces, most of them
    launched while the last backward still runs (the out-of-memory error in it strikes
    after some have gone), laid out again after step 1 in the order rank 0's gradients
    came (not quite reverse registration's: a layer norm's weight before its bias); with
    DDP's default, in one after it."""
    steps, per_rank = 5, 12
    inject = f"{rank}:{EVERY_POINT}"
    job = torchrun(
        world,
        "ddp_adaptive.py",
        "--bucket-kib",
        str(bucket_kib),
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
    # The job ends: finish() calls it hung at 240 s, the only bound on its wall time (how
    # long torchrun and gloo take to start is the machine's).
    finish(job)
    layouts = []
    for r in range(world):
        done = json.loads((tmp_path / f"done-rank{r}.json").read_text())
        assert done["steps"] == steps, (r, done)
        layouts.append(done["layout"])
        if bucket_kib:
            assert done["layout"] != done["first_layout"], done
        # Buckets launched during a backward: at least two a step with small buckets.
        assert (done["early_buckets"] >= 2 * steps) == bool(bucket_kib), done
        log = tmp_path / f"rank{r}.jsonl"
        assert [s["step"] for s in kinds(log, "step")] == list(range(1, steps + 1))
        assert kinds(log, "finished"), f"rank {r} did not finish"
        if r == rank:
            assert done["fired"] == [1, 2, 3, 4], done
            assert len(kinds(log, "oom")) == 3, kinds(log, "oom")
            texts = [n["text"] for n in kinds(log, "notice")]
            assert any("optimizer.step() before it changed anything" in t for t in texts)
            assert sum("start over" in t for t in texts) == 2, texts
            assert any("in this rank's last backward" in t for t in texts), texts
        else:
            assert not kinds(log, "oom")
            # The OOM in the other rank's last backward (step 4), with the gradients'
            # all-reduce under way: this rank dropped its step too and redid it.
            texts = [n["text"] for n in kinds(log, "notice")]
            assert sum("ran out of memory in its last backward" in t for t in texts) == 1, texts
    # Rank 0's rows: every rank's at every step (step 4's twice: it was redone after the
    # agreement before its last backward), the agreement never a long wait.
    assert all(lay == layouts[0] for lay in layouts), "every rank lays its buckets out alike"
    rows = kinds(tmp_path / "rank0.jsonl", "job_ranks")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4, 5], [r["step"] for r in rows]
    assert all(len(r["ranks"]) == world for r in rows)
    assert rows[-1]["ranks"][rank]["ooms"] == 3
    # Rank 0 waits at the agreement for the slowest rank to end its step (a retry after an
    # OOM makes it longer), never longer than that rank's step and a second. Step 1's is
    # left out: the ranks start it when each is up, the first collective sets gloo up.
    for r in rows[1:]:
        slowest = max(k["step_time_s"] for k in r["ranks"])
        assert r["agree_us"] / 1e6 < slowest + 1.0, (r["step"], r["agree_us"], r["ranks"])
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(got, reference(steps, per_rank * world), TOL)


def test_an_oom_in_the_zeros_for_a_gradient_a_rank_lacks_is_that_ranks_own(tmp_path):
    """Only rank 0's samples take the model's branch, so rank 1 reduces zeros for its
    gradients; at steps 2 and 3 those zeros do not fit (every try, until the step starts
    over). Every rank redoes the step, rank 1 as after its own OOM (said so, and smaller:
    its controller was told), rank 0 saying another rank ran out; the parameters stay
    exact. Step 2 with the all-reduce overlapped (8 KiB buckets, the branch's first), step
    3 after the last backward (the fallback). The branch's weights are larger than two
    buckets (all-reduced alone, in two chunks): after its zeros did not fit, rank 1
    relaunches its buckets in abort mode while the shortage lasts, which must allocate
    nothing (zeros there would not fit either: rank 1 would leave for the agreement
    while rank 0 waits in the verdict)."""
    steps, per_rank = 3, 8
    branch = TinyGPT(d=WIDTH, t=SEQ, branch=True).branch
    assert max(p.numel() * p.element_size() for p in branch.parameters()) > 16 << 10
    job = torchrun(
        2,
        "ddp_adaptive.py",
        "--branch",
        "--bucket-kib",
        "8",
        "--reduce-after-from",
        "3",
        "--steps",
        str(steps),
        "--per-rank",
        str(per_rank),
        "--micro",
        "4",
        "--inject",
        "1:zero-fill@2,zero-fill@3",
        "--out",
        str(tmp_path),
    )
    finish(job, timeout=120)
    logs = [tmp_path / f"rank{r}.jsonl" for r in range(2)]
    for r, log in enumerate(logs):
        assert [s["step"] for s in kinds(log, "step")] == list(range(1, steps + 1)), r
    assert json.loads((tmp_path / "done-rank1.json").read_text())["fired"] == [2, 3]
    ooms = kinds(logs[1], "oom")
    assert [o["step"] for o in ooms] == [2, 3], ooms
    for o in ooms:
        assert o["retry_with"] < o["micro_batch"], o
        assert kinds(logs[1], "step")[o["step"] - 1]["micro_batch"] == o["retry_with"], o
    assert not kinds(logs[0], "oom")
    for step in (2, 3):
        own = [n["text"] for n in kinds(logs[1], "notice") if f"step {step}:" in n["text"]]
        assert len(own) == 1 and "out of memory on this rank" in own[0], own
        other = [n["text"] for n in kinds(logs[0], "notice") if f"step {step}:" in n["text"]]
        assert len(other) == 1, other
        assert "another rank of the job ran out of memory" in other[0], other
    # Each of those steps agreed twice: every rank redid it.
    rows = kinds(logs[0], "job_ranks")
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 3], [r["step"] for r in rows]
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(got, reference(steps, per_rank * 2, branch=per_rank), TOL)


@pytest.fixture
def one_process_group():
    """torch.distributed's default group in this process alone (gloo, world size 1)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


class Recorded:
    """torch.distributed, with each all-reduce's element count recorded."""

    def __init__(self, dist):
        self.dist = dist
        self.sizes: list[int] = []

    def __getattr__(self, name):
        return getattr(self.dist, name)

    def all_reduce(self, t, **kw):
        self.sizes.append(t.numel())
        return self.dist.all_reduce(t, **kw)


def _overlap_of(dist):
    """Three parameters under 64-byte buckets: the middle one (72 floats) larger than a
    bucket, all-reduced alone in chunks of the ring's 2 x 16 floats (32, 32 and 8),
    launched first (the order is reversed); the other two share a bucket of 12. `world`
    2 over a group of one: the sum is each gradient itself and the average halves it, so
    an element reduced twice, or not at all, shows."""
    from headroom import _overlap

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in ((5,), (8, 9), (7,))]
    rec = Recorded(dist)
    ov = _overlap.Overlap(rec, params, None, world=2, cap=64)
    assert [(b.solo, b.numel) for b in ov.buckets] == [(True, 72), (False, 12)]
    return ov, rec, params


CHUNKS = [32, 32, 8, 12]


def test_a_gradient_larger_than_a_bucket_is_all_reduced_in_place_in_chunks(
    one_process_group,
):
    """Chunk after chunk, views of the gradient: every element averaged once, as the
    whole all-reduce did, in the backward (each bucket as it fills) and after it."""
    ov, rec, params = _overlap_of(one_process_group)
    try:
        # In the backward, each bucket as its gradients are ready.
        w = [torch.randn_like(p) for p in params]
        ov.arm()
        sum((p * x).sum() for p, x in zip(params, w)).backward()
        assert ov.launched_in_backward == 2
        ov.launch_rest(abort=False)
        ov.drain()
        assert rec.sizes == CHUNKS
        for p, x in zip(params, w):
            assert torch.equal(p.grad, x / 2)
        # After it: in place; a gradient laid out otherwise (transposed) in its elements'
        # order, as a rank with it laid out as usual would send it.
        for solo in (torch.randn(8, 9), torch.randn(9, 8).t()):
            grads = [torch.randn(5), solo, torch.randn(7)]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            held = [p.grad.data_ptr() for p in params]
            rec.sizes.clear()
            ov.arm()
            ov.launch_rest(abort=False)
            ov.drain()
            assert rec.sizes == CHUNKS
            for p, g, ptr in zip(params, grads, held):
                assert torch.equal(p.grad, g / 2)
                assert p.grad.data_ptr() == ptr or not g.is_contiguous()
    finally:
        ov.close()


def test_a_rank_without_memory_for_a_large_gradients_zeros_relaunches_allocating_nothing(
    one_process_group, monkeypatch
):
    """The rank lacks the gradient larger than a bucket (a branch its data did not take),
    and its zeros do not fit, nor would anything else: the relaunch in abort mode issues
    the same collectives as a rank with every gradient and allocates nothing."""
    from torch.profiler import ProfilerActivity, profile

    from headroom import _torch

    ov, rec, params = _overlap_of(one_process_group)
    try:
        for p in params:
            p.grad = None if p.dim() == 2 else torch.ones_like(p)

        def short(t, *a, **k):
            _torch.provoke_oom(t.device)

        monkeypatch.setattr(torch, "zeros_like", short)
        ov.arm()
        with pytest.raises(RuntimeError) as e:
            ov.launch_rest(abort=False)
        assert _torch.is_oom(e.value)
        assert rec.sizes == []
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            ov.launch_rest(abort=True)
            ov.drain()
        allocated = [(ev.name, ev.cpu_memory_usage) for ev in prof.events() if ev.cpu_memory_usage]
        assert allocated == []
        assert rec.sizes == CHUNKS
        assert ov.verdict_record(True, False)[3:6].tolist() == [1.0, 0.0, 1.0]
        # Abort mode leaves the gradients as they were.
        assert params[1].grad is None
        assert all(torch.equal(params[i].grad, torch.ones_like(params[i])) for i in (0, 2))
    finally:
        ov.close()


def short_job(tmp_path, script: str, *flags: str):
    """Two ranks of a rank script for 3 steps of 12 samples per rank."""
    return torchrun(2, script, *flags, "--steps", "3", "--per-rank", "12", "--out", str(tmp_path))


@pytest.mark.parametrize("compiled", ["outer", "inner"])
def test_a_compiled_ddp_model_trains_adaptively_and_stays_exact(tmp_path, compiled):
    """`torch.compile(DDP(model))`, the way PyTorch documents compiling DDP (its
    optimizer splits the graph at DDP's buckets), was refused as not DDP; and
    `DDP(torch.compile(model))`. Both train through the overlapped all-reduce (hooks on
    the parameters, which a compiled backward still accumulates into), the parameters
    those of one process."""
    steps, per_rank = 3, 12
    job = short_job(tmp_path, "ddp_adaptive.py", "--compile", compiled, "--bucket-kib", "1024")
    finish(job, timeout=180)
    for r in range(2):
        done = json.loads((tmp_path / f"done-rank{r}.json").read_text())
        assert done["steps"] == steps, (r, done)
        assert done["early_buckets"] >= steps, done
        assert kinds(tmp_path / f"rank{r}.jsonl", "finished"), r
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(got, reference(steps, per_rank * 2), TOL)


def test_the_overlap_is_chosen_alike_on_every_rank_from_the_jobs_cores():
    """gloo on the CPU with a host's cores full (each rank's compute threads and one for
    its communication): after the backward; a core to spare on every host, NCCL, or CUDA
    tensors: during it. HEADROOM_DDP_OVERLAP on any rank decides, off first. Each rank:
    (host, asked, gloo on the CPU, threads, cores)."""
    from headroom._dist import overlap_pays

    assert not overlap_pays([("a", "auto", True, 1, 2), ("a", "auto", True, 1, 2)])
    assert overlap_pays([("a", "auto", True, 1, 4), ("a", "auto", True, 1, 4)])
    assert not overlap_pays([("a", "auto", True, 2, 4), ("a", "auto", True, 1, 4)])
    # Two hosts: each judged by its own ranks; one full host is enough to lose the overlap.
    assert overlap_pays([("a", "auto", True, 1, 2), ("b", "auto", True, 1, 2)])
    full_a = [("a", "auto", True, 1, 2), ("a", "auto", True, 1, 2), ("b", "auto", True, 1, 64)]
    assert not overlap_pays(full_a)
    # The fewest cores a rank of a host reports (a rank pinned to fewer).
    assert not overlap_pays([("a", "auto", True, 1, 16), ("a", "auto", True, 1, 3)])
    # NCCL (or gloo over CUDA tensors) on any rank.
    assert overlap_pays([("a", "auto", False, 1, 2), ("a", "auto", True, 1, 2)])
    assert overlap_pays([("a", "on", True, 1, 2), ("a", "auto", True, 1, 2)])
    assert not overlap_pays([("a", "on", False, 1, 64), ("a", "off", False, 1, 64)])


def test_an_unreadable_overlap_setting_is_refused_naming_the_fix(monkeypatch, one_process_group):
    from headroom._dist import overlap_facts
    from headroom._run import RunError

    monkeypatch.setenv("HEADROOM_DDP_OVERLAP", "yes")
    with pytest.raises(RunError, match=r"HEADROOM_DDP_OVERLAP='yes': say on .* off .* or auto"):
        overlap_facts(None, [])
    monkeypatch.setenv("HEADROOM_DDP_OVERLAP", " Off ")
    asked, gloo, threads, cores = overlap_facts(None, [torch.nn.Parameter(torch.ones(2))])
    assert (asked, gloo, threads) == ("off", True, torch.get_num_threads()) and cores >= 1


def test_the_default_overlap_follows_the_cores_and_the_job_says_which(tmp_path):
    """Two ranks of one thread: on this machine's cores (2 in CI) every core is taken, so
    the gradients go after the last backward; with two to spare, during it. Either way
    the notice says which, and the parameters are one process's."""
    steps, per_rank = 3, 12
    job = short_job(tmp_path, "ddp_adaptive.py", "--overlap", "auto", "--bucket-kib", "8")
    finish(job)
    # Each rank: one compute thread and one for gloo.
    overlapped = len(os.sched_getaffinity(0)) >= 2 * (1 + 1)
    for r in range(2):
        done = json.loads((tmp_path / f"done-rank{r}.json").read_text())
        assert (done["early_buckets"] > 0) == overlapped, done
        texts = [n["text"] for n in kinds(tmp_path / f"rank{r}.jsonl", "notice")]
        said = (
            "runs during that backward"
            if overlapped
            else "all-reduced once (gloo on a CPU whose cores the ranks' threads fill"
        )
        assert any(said in t for t in texts), texts
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(got, reference(steps, per_rank * 2), TOL)


class EmbeddingLast(torch.nn.Module):
    """Three layers, then the embedding they read: registered last, so the first guess
    at the order gradients come in (reverse registration) puts it in the first bucket,
    and its gradient comes last."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
        self.emb = torch.nn.Embedding(10, 16)

    def forward(self, x):
        return self.layers(self.emb(x)).square().mean()


def test_buckets_are_laid_out_again_in_the_order_the_gradients_came(one_process_group):
    """The first guess launches every bucket only when the embedding's gradient, the
    last, comes; the first verdict carries rank 0's order and the layout is redone in it
    (within the ring already allocated): each bucket then goes as its layer's gradients
    are ready. Every gradient is still averaged once."""
    from headroom import _overlap

    torch.manual_seed(0)
    model = EmbeddingLast()
    params = list(model.parameters())
    n = len(params)

    class Arrivals(Recorded):
        """Each all-reduce's launch, as the number of gradients ready by then."""

        def all_reduce(self, t, **kw):
            self.sizes.append(sum(ov.fired))
            return self.dist.all_reduce(t, **kw)

    rec = Arrivals(one_process_group)
    # A layer's weight and bias (1088 bytes) to a bucket.
    ov = _overlap.Overlap(rec, params, None, world=2, cap=1088)
    ring = {k: t.data_ptr() for k, t in ov.ring.items()}
    x = torch.randint(0, 10, (4, 3))
    try:
        launches = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            rec.sizes.clear()
            ov.arm()
            model(x).backward()
            ov.launch_rest(abort=False)
            v = ov.read(ov.verdict_record(False, False), n)
            ov.drain()
            grads = [p.grad.clone() for p in params]
            if v.order is not None:
                assert sorted(v.order) == list(range(n))
                assert v.order[-1] == n - 1, "the embedding's gradient comes last"
                assert ov.relayout(v.order)
            launches.append(list(rec.sizes))
            # Averaged once: the group of one sums, world 2 halves.
            model.zero_grad(set_to_none=True)
            model(x).backward()
            for p, g in zip(params, grads):
                assert torch.equal(g, p.grad / 2)
        first, *after = launches
        assert set(first) == {n}, first
        assert after[0] == after[1]
        assert sorted(after[0]) == after[0] and after[0][0] <= 2 and after[0][-2] < n, after
        assert len(after[0]) == len(ov.buckets) >= 4
        assert {k: t.data_ptr() for k, t in ov.ring.items()} == ring, "no new ring"
        # Once: a later verdict carries no order.
        assert ov.verdict_record(False, False).numel() == 3 + n
    finally:
        ov.close()


def test_a_rank_with_a_tighter_cap_splits_finer_and_the_job_trains(tmp_path):
    """Rank 1 alone under a real hard cap: it runs out of memory for real, settles under
    target at a smaller micro-batch than rank 0, and the job's parameters stay exact."""
    steps, per_rank, seq, width = 6, 128, 128, 64
    job = torchrun(
        2,
        "ddp_adaptive.py",
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
    capped = tmp_path / "rank1.jsonl"
    free = tmp_path / "rank0.jsonl"
    assert kinds(capped, "oom"), "the cap never bit"
    assert not kinds(free, "oom")
    mem = kinds(capped, "step_memory")
    assert mem[-1]["usage"] < 0.95, mem[-1]
    rows = kinds(free, "job_ranks")[-1]["ranks"]
    assert rows[1]["micro_batch"] < rows[0]["micro_batch"], rows
    decisions = kinds(capped, "decision")
    assert decisions, "the capped rank's decisions are not logged"
    got = torch.load(tmp_path / "params.pt")
    assert_params_close(got, reference(steps, per_rank * 2, seq, width), TOL)


def _wait_for_steps(log: Path, n: int, job: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(live_records(log, "step")) >= n:
            return
        assert job.poll() is None, output(job)
        time.sleep(0.1)
    raise AssertionError(f"{log} never reached step {n}")


def _pids(job: subprocess.Popen, world: int, timeout: float = 120) -> dict[int, int]:
    """Each rank prints `rank R pid P serving NAME` once its run serves. Read as a pattern,
    not line by line: two ranks' prints interleave in the shared output (print writes the
    text and its newline apart), e.g. `rank 1 … rank1rank 0 … rank0` then two newlines."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.findall(r"rank (\d+) pid (\d+) serving", output(job)[0])
        pids = {int(r): int(p) for r, p in found}
        if len(pids) == world:
            return pids
        assert job.poll() is None, f"the job ended before every rank served: {output(job)}"
        assert time.monotonic() < deadline, f"not every rank served within {timeout} s"
        time.sleep(0.1)


def test_a_rank_killed_mid_run_ends_the_job_through_torchrun_and_the_others_say_why(tmp_path):
    job = torchrun(
        2, "ddp_adaptive.py", "--steps", "100000", "--per-rank", "8", "--out", str(tmp_path)
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
    assert not kinds(tmp_path / "rank0.jsonl", "finished")


def test_sigterm_to_torchrun_checkpoints_every_rank_at_one_step_and_each_exits_0(tmp_path):
    job = torchrun(
        2,
        "ddp_adaptive.py",
        "--steps",
        "100000",
        "--per-rank",
        "8",
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
        assert len(saved) == 1, saved
        assert saved[0]["step"] == done["steps"]
        assert (tmp_path / f"ckpt-rank{r}-step{done['steps']}.pt").exists()
        steps.append(done["steps"])
    assert steps[0] == steps[1], f"the ranks stopped at different steps: {steps}"


def test_commands_sent_to_rank_0_reach_every_rank_at_the_same_step(tmp_path, runtime_dir):
    """A pause sent to rank 0's socket pauses every rank after the same step, a resume
    resumes them together, and a stop ends every rank at one step, each confirming."""
    from conftest import Viewer

    job = torchrun(
        2,
        "ddp_adaptive.py",
        "--steps",
        "100000",
        "--per-rank",
        "8",
        "--step-sleep",
        "0.05",
        "--out",
        str(tmp_path),
    )
    try:
        _pids(job, 2)
        _wait_for_steps(tmp_path / "rank1.jsonl", 2, job)
        serving = [
            n["text"] for n in kinds(tmp_path / "rank0.jsonl", "notice") if n["source"] == "serve"
        ]
        viewer = Viewer(serving[0].split("serving on ")[1].split(" (attach")[0])
        viewer.command("pause")
        for r in range(2):
            log = tmp_path / f"rank{r}.jsonl"
            deadline = time.monotonic() + 60
            while not any("paused" in c["applied"] for c in live_records(log, "command_applied")):
                assert time.monotonic() < deadline, f"rank {r} never paused"
                time.sleep(0.1)
        time.sleep(1.0)
        held = [len(live_records(tmp_path / f"rank{r}.jsonl", "step")) for r in range(2)]
        time.sleep(1.0)
        assert [len(live_records(tmp_path / f"rank{r}.jsonl", "step")) for r in range(2)] == held
        paused_at = [
            next(
                c["applied"]
                for c in kinds(tmp_path / f"rank{r}.jsonl", "command_applied")
                if "paused" in c["applied"]
            )
            for r in range(2)
        ]
        assert paused_at[0] == paused_at[1], paused_at
        assert held[0] == held[1], held
        viewer.command("resume")
        _wait_for_steps(tmp_path / "rank1.jsonl", held[1] + 2, job)
        viewer.command("stop")
        wait(job, 120)
        viewer.close()
    finally:
        if job.poll() is None:
            job.kill()
    done = [json.loads((tmp_path / f"done-rank{r}.json").read_text()) for r in range(2)]
    assert done[0]["steps"] == done[1]["steps"], done
    notes = [n["text"] for n in kinds(tmp_path / "rank0.jsonl", "notice")]
    assert any("carried out by every rank (2 of 2)" in t for t in notes), notes


def _paused_at(log: Path) -> str | None:
    for c in kinds(log, "command_applied"):
        if "paused after step" in c["applied"]:
            return c["applied"]
    return None


def _shows(screen, text: str, timeout: float = 60) -> bool:
    """Whether the screen comes to show `text` now (not on a row drawn before the key)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        screen.pump(0.2)
        if screen.shows(text):
            return True
    return False


def test_attach_to_the_job_shows_a_row_per_rank_and_pauses_every_rank_at_one_step(
    tmp_path, runtime_dir
):
    from conftest import Screen, headroom_bin, spawn_on_pty

    job = torchrun(
        2,
        "ddp_adaptive.py",
        "--steps",
        "100000",
        "--per-rank",
        "8",
        "--step-sleep",
        "0.1",
        "--out",
        str(tmp_path),
    )
    logs = [tmp_path / f"rank{r}.jsonl" for r in range(2)]
    try:
        _pids(job, 2)
        _wait_for_steps(logs[1], 2, job)
        pid, fd = spawn_on_pty([headroom_bin(), "attach", "ddp"])
        screen = Screen(fd)
        try:
            assert screen.wait_for("attached to"), screen.text()
            assert screen.wait_for("2 ranks"), screen.text()
            assert screen.wait_for("panels show rank 0"), screen.text()
            # ] shows rank 1's panels (its own stream); [ goes back to rank 0's.
            for key, rank in ((b"]", 1), (b"[", 0)):
                screen.send(key)
                assert _shows(screen, f"panels show rank {rank}"), screen.text()
            screen.send(b"p")
            deadline = time.monotonic() + 60
            while not all(_paused_at(log) for log in logs):
                assert time.monotonic() < deadline, "a rank never paused"
                screen.pump(0.2)
            assert _paused_at(logs[0]) == _paused_at(logs[1])
            held = [len(kinds(log, "step")) for log in logs]
            screen.pump(1.5)
            assert [len(kinds(log, "step")) for log in logs] == held, "a paused rank stepped"
            assert held[0] == held[1]
            assert screen.wait_for("paused")
            screen.send(b"p")
            _wait_for_steps(logs[1], held[1] + 2, job)
            screen.send(b"S")
            assert screen.wait_for("stop the run?"), screen.text()
            screen.send(b"y")
            wait(job, 120)
            screen.send(b"q")
            _, status = os.waitpid(pid, 0)
            assert os.WEXITSTATUS(status) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.close(fd)
    finally:
        if job.poll() is None:
            job.kill()
    done = [json.loads((tmp_path / f"done-rank{r}.json").read_text()) for r in range(2)]
    assert done[0]["steps"] == done[1]["steps"], done

    # The job's logs replayed together (in any order): rank 0's rows, and ] moves the
    # panels to rank 1's log as it moved them to rank 1's stream.
    pid, fd = spawn_on_pty([headroom_bin(), "replay", "--end", str(logs[1]), str(logs[0])])
    screen = Screen(fd)
    try:
        assert screen.wait_for("2 ranks"), screen.text()
        assert screen.wait_for("panels show rank 0"), screen.text()
        screen.send(b"]")
        assert _shows(screen, "panels show rank 1"), screen.text()
        screen.send(b"q")
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.close(fd)


@pytest.mark.parametrize(
    "where",
    [(), ("--raise-in-backward", "--bucket-kib", "8")],
    ids=["in-a-forward", "in-the-last-backward"],
)
def test_a_rank_that_raises_ends_every_rank_naming_it_and_why(tmp_path, where):
    """A ValueError on rank 1 at step 3: in its first forward (before the agreement), or
    inside its last backward after some of its buckets' all-reduces have gone (8 KiB
    buckets: it launches the rest, the verdict tells rank 0). Both ranks end, rank 0
    naming rank 1 and its error."""
    job = torchrun(
        2, "ddp_adaptive.py", "--steps", "6", "--raise-at", "1@3", *where, "--out", str(tmp_path)
    )
    wait(job, 240)
    assert job.returncode != 0
    failed = kinds(tmp_path / "rank0.jsonl", "failed")
    assert failed, "rank 0's run did not end as failed"
    reason = failed[0]["reason"]
    assert "RankFailed" in reason and "rank 1" in reason, reason
    assert "ValueError: a bad sample on rank 1 at step 3" in reason, reason
    own = kinds(tmp_path / "rank1.jsonl", "failed")
    assert own and "ValueError" in own[0]["reason"], own
    for r in range(2):
        assert len(kinds(tmp_path / f"rank{r}.jsonl", "step")) == 2


def test_sigterm_in_a_long_step_gives_it_up_on_every_rank_and_saves_the_last_completed(
    tmp_path,
):
    """Steps of many seconds (micro-batches of 1): SIGTERM to torchrun mid-step; each rank
    leaves its micro-batches at the next boundary, the job gives the step up at one
    agreement, every rank checkpoints the last completed step and exits, within seconds."""
    sigterm_in_a_long_step(tmp_path, "ddp_adaptive.py")
    for r in range(2):
        assert (tmp_path / f"ckpt-rank{r}-step1.pt").exists()


def sigterm_in_a_long_step(tmp_path: Path, script: str) -> None:
    """SIGTERM to a job of `script` in its second step, of 12 s and more: every rank
    gives the step up, saves step 1 and ends as stopped, well before the step would have
    ended (the checkpoint's files are the caller's to check)."""
    # 200 micro-batches of one sample, each idling 60 ms besides its work: a step of 12 s
    # on any machine (giving one up takes a micro-batch, the save and the exits: 2-4 s).
    job = torchrun(
        2,
        script,
        "--steps",
        "100000",
        "--per-rank",
        "200",
        "--micro",
        "1",
        "--micro-sleep",
        "0.06",
        "--fixed",
        "--checkpoint",
        "--out",
        str(tmp_path),
    )
    try:
        _pids(job, 2)
        _wait_for_steps(tmp_path / "rank1.jsonl", 1, job, timeout=240)
        _wait_for_steps(tmp_path / "rank0.jsonl", 1, job, timeout=240)
        step_s = kinds(tmp_path / "rank0.jsonl", "step")[0]["step_time_s"]
        time.sleep(min(2.0, step_s / 4))
        t0 = time.monotonic()
        job.send_signal(signal.SIGTERM)
        wait(job, 120)
        took = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
    for r in range(2):
        log = tmp_path / f"rank{r}.jsonl"
        steps = kinds(log, "step")
        assert len(steps) == 1, f"rank {r} completed {len(steps)} steps"
        saved = kinds(log, "checkpoint_saved")
        assert [c["step"] for c in saved] == [1], saved
        texts = [n["text"] for n in kinds(log, "notice")]
        assert any("step 2 given up by every rank of the job" in t for t in texts), texts
        assert kinds(log, "finished")[0]["stopped_by_user"]
    # A step took step_s; giving it up takes one micro-batch, the save and the exits: well
    # under the rest of the step, which finishing it would have taken.
    assert took < step_s / 2, f"{took:.1f} s to stop (a step takes {step_s:.1f} s)"


def test_ranks_missing_different_gradients_never_agree_they_miss_the_same():
    """The agreement's key for the parameters without a gradient: equal only for equal
    sets. The sum it replaced was equal for {0, 3} and {1, 2} (any two sets of one size
    and one index sum), and ranks then all-reduced different tensors."""
    from headroom._dist import missing_key

    sets = [[], [0], [1], [0, 3], [1, 2], [0, 1, 2], [3, 0, 0], list(range(200))]
    sets += [list(range(200))[:i] + list(range(200))[i + 1 :] for i in range(200)]
    keys = [missing_key(s) for s in sets]
    assert len(set(keys)) == len(keys)
    assert missing_key([1, 2]) == missing_key([1, 2])
    assert all(k == int(k) and 0 <= k < 2**53 for k in keys), "exact in a float64"
