"""headroom's adaptive mode under DDP against a plain DDP loop, side by side in one job.

Run under torchrun (gloo on CPU), from the repository root:

    ./dev bench-python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        py/bench/ddp.py

Every rank trains the benchmarks' GPT (py/bench/_gpt.py: headroom's default shape) on
its own seeded batches of --per-rank samples per step, cut into micro-batches of --micro.
Two modes alternate round by round on the same DDP model and optimizer, so a slow spell
of the machine hits both alike:

  plain     the nanoGPT way: the micro-batches under no_sync() but the last, whose
            backward carries DDP's bucketed all-reduce (overlapped with that backward)
  headroom  run.backward(batch, loss_fn) + run.step(optimizer) with micro_batch=--micro
            and adaptive=False (the size is held, so the work is the plain loop's):
            every micro-batch under no_sync(), one agreement collective before the last
            backward, during which headroom launches the buckets' all-reduces as their
            gradients are ready (as DDP does), then one small verdict
  serial    the same with the all-reduce after the last backward instead (headroom's
            design before the overlap, now its fallback, and its default for gloo on
            CPUs whose cores the ranks fill): one agreement collective, then the
            gradients through a preallocated bucket

Printed: each mode's median step time (rank 0's wall clock, which waits for the slowest
rank in the collectives), the ratios headroom/plain and serial/plain per round (median and
range), and the cost per step of headroom's collectives in microseconds: the agreement as
the job saw it (waiting for the slowest rank included) and as a bare all-gather of the
same record in a tight loop, and the serial mode's gradient all-reduce through the bucket.
--bucket-kib sets DDP's bucket_cap_mb (the benchmarks' GPT has two buckets by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpt import make_model, make_optimizer, token_batches  # noqa: E402

import headroom  # noqa: E402
from headroom import _dist  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-rank", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="steps per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-kib", type=int, default=0, help="DDP's bucket_cap_mb, in KiB")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(0)
    caps = {"bucket_cap_mb": args.bucket_kib / 1024} if args.bucket_kib else {}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **caps)
    opt = make_optimizer(ddp)
    batches = token_batches(args.steps * args.rounds * 3 + 3, args.per_rank, seed=rank)
    feed = iter(batches)

    def loss_fn(mb):
        x, y = mb
        logits = ddp(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def plain_step():
        x, y = next(feed)
        n = len(x)
        starts = list(range(0, n, args.micro))
        for i, s in enumerate(starts):
            mb = (x[s : s + args.micro], y[s : s + args.micro])
            last = i == len(starts) - 1
            ctx = ddp.no_sync() if not last else _null()
            with ctx:
                (loss_fn(mb) * (len(mb[0]) / n)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    run = headroom.Run(
        "bench-ddp",
        model=ddp,
        effective_batch=args.per_rank,
        micro_batch=args.micro,
        adaptive=False,
    )
    # What the run chose by default (HEADROOM_DDP_OVERLAP=auto): the modes below set it.
    default = "headroom (overlapped)" if run._rank.job.overlap is not None else "serial"
    reduce_us: list[float] = []
    real_reduce = run._rank.job.reduce

    def timed_reduce(step, agree):
        t = time.perf_counter()
        real_reduce(step, agree)
        reduce_us.append((time.perf_counter() - t) * 1e6)

    run._rank.job.reduce = timed_reduce

    early: list[int] = []
    layout = {"buckets": 0}

    def headroom_step():
        run._rank.job.set_overlap(True)
        run.backward(next(feed), loss_fn)
        early.append(run._rank.job.overlap.launched_in_backward)
        layout["buckets"] = len(run._rank.job.overlap.buckets)
        run.step(opt)

    def serial_step():
        run._rank.job.set_overlap(False)
        run.backward(next(feed), loss_fn)
        run.step(opt)

    modes = {"plain": plain_step, "headroom": headroom_step, "serial": serial_step}
    for f in modes.values():  # warm-up
        f()
    times: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {"headroom": [], "serial": []}
    for r in range(args.rounds):
        order = list(modes)[r % 3 :] + list(modes)[: r % 3]
        order = order if r % 2 == 0 else list(reversed(order))
        medians = {}
        for m in order:
            per = []
            for _ in range(args.steps):
                dist.barrier()
                t = time.perf_counter()
                modes[m]()
                per.append(time.perf_counter() - t)
            times[m].extend(per)
            medians[m] = statistics.median(per)
        for m in ratios:
            ratios[m].append(medians[m] / medians["plain"])
    job = run._rank.job
    agree_seen = job.agree_us_total / max(1, job.agreements)
    # The agreement's own cost: the same all-gather in a tight loop (every rank in step).
    rec = job.record(_dist.OK, [])
    out = [torch.empty_like(rec) for _ in range(world)]
    dist.barrier()
    t = time.perf_counter()
    reps = 200
    for _ in range(reps):
        dist.all_gather(out, rec, group=job.meta)
    bare = (time.perf_counter() - t) / reps * 1e6
    run.finish()
    if rank == 0:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print(
            f"DDP on {world} ranks (gloo, {args.threads} thread each), {grad_bytes / 2**20:.1f} "
            f"MiB of gradients; {args.per_rank} samples per rank per step in micro-batches of "
            f"{args.micro}; {args.rounds} rounds of {args.steps} steps per mode"
        )
        for m in modes:
            print(f"  {m:9s} median step {statistics.median(times[m]) * 1e3:8.1f} ms")
        print(f"  the run's default here: {default} ({os.cpu_count()} cores)")
        for m, rs in ratios.items():
            print(
                f"  {m}/plain per round: median {statistics.median(rs):.3f} "
                f"(range {min(rs):.3f}-{max(rs):.3f})"
            )
        print(
            f"  headroom's layout: {layout['buckets']} buckets, of which "
            f"{statistics.median(early):.0f} (median per step) were launched while the last "
            "backward ran"
        )
        print(
            f"  agreement: {agree_seen:.0f} us per step as the job saw it (waiting for the "
            f"slowest rank included), {bare:.0f} us as a bare all-gather of the record"
        )
        print(
            f"  gradient all-reduce through the bucket: median "
            f"{statistics.median(reduce_us):.0f} us per step"
        )
    dist.destroy_process_group()
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
