"""headroom's adaptive mode under FSDP2 against a plain FSDP2 loop, side by side in one job.

Run under torchrun (gloo on CPU), from the repository root:

    ./dev bench-python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        py/bench/fsdp.py

Every rank trains the benchmarks' GPT (py/bench/_gpt.py: headroom's default shape) with
``fully_shard`` on each block and at the root, on its own seeded batches of --per-rank
samples per step, cut into micro-batches of --micro. Two copies of the model (the same
initial weights, each sharded, each with its own optimizer) alternate round by round, so
a slow spell of the machine hits both alike:

  plain     the fixed accumulation: gradient reduce-scatter off
            (set_requires_gradient_sync(False)) for all micro-batches but the last
  plain-rs-each  the other accumulation choice, timed beside them: a reduce-scatter
            after every micro-batch's backward
  headroom  run.backward(batch, loss_fn) + run.step(optimizer), micro_batch=--micro and
            max_micro_batch=--micro (the size is held, so the work is the plain loop's):
            the micro-batch count agreed, every all-gather and reduce-scatter gated

Printed: each mode's median step time (rank 0's wall clock), the ratio headroom/plain per
round (median and range); the gates: how many per step and per unit, their cost as the job
saw it (waiting for the slowest rank included) and as a bare gate in a tight loop; and
the two accumulation choices' peaks on the plain model (the resident set above what the
process held before the step): reduce-scatter on the last micro-batch only (each rank
holds its units' unsharded gradients meanwhile) against on every micro-batch.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpt import make_model, token_batches  # noqa: E402

import headroom  # noqa: E402
from headroom import _fsdp, _native  # noqa: E402


def sharded(seed: int, layers: int, width: int):
    model = make_model(seed, n_layer=layers, n_embd=width)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-rank", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="steps per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plain_model, gated_model = (sharded(0, args.layers, args.width) for _ in range(2))
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=3e-4)
    gated_opt = torch.optim.AdamW(gated_model.parameters(), lr=3e-4)
    # Cycled: the warm-up, every mode's rounds and the peaks' steps draw from it.
    feed = itertools.cycle(token_batches(args.steps * args.rounds + 8, args.per_rank, seed=rank))

    def loss_of(model, mb):
        x, y = mb
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def plain_step(sync_each: bool = False):
        x, y = next(feed)
        n = len(x)
        starts = list(range(0, n, args.micro))
        for i, s in enumerate(starts):
            mb = (x[s : s + args.micro], y[s : s + args.micro])
            plain_model.set_requires_gradient_sync(sync_each or i == len(starts) - 1)
            (loss_of(plain_model, mb) * (len(mb[0]) / n)).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    run = headroom.Run(
        "bench-fsdp",
        model=gated_model,
        effective_batch=args.per_rank,
        micro_batch=args.micro,
        max_micro_batch=args.micro,
    )
    gates = run._rank.gates

    def headroom_step():
        run.backward(next(feed), lambda mb: loss_of(gated_model, mb))
        run.step(gated_opt)

    modes = {
        "plain": plain_step,
        "headroom": headroom_step,
        # The other accumulation choice: a reduce-scatter after every micro-batch.
        "plain-rs-each": lambda: plain_step(sync_each=True),
    }
    for f in modes.values():  # warm-up: the optimizers' state, FSDP's lazy init
        f()
        f()
    passed0, us0 = gates.passed, gates.us
    times: dict[str, list[float]] = {m: [] for m in modes}
    ratios = []
    for r in range(args.rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(list(modes)))
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
        ratios.append(medians["headroom"] / medians["plain"])
    timed_steps = args.rounds * args.steps
    per_step = (gates.passed - passed0) / timed_steps
    seen_us = (gates.us - us0) / max(1, gates.passed - passed0)
    # A gate's own cost: the same all-reduce in a tight loop (every rank in step).
    dist.barrier()
    reps = 500
    t = time.perf_counter()
    for _ in range(reps):
        gates.gate()
    bare_us = (time.perf_counter() - t) / reps * 1e6
    # The machine's floor: the same all-reduce without headroom around it.
    flag = torch.zeros(2, dtype=torch.float64)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=gates.group)
    floor_us = (time.perf_counter() - t) / reps * 1e6
    run.finish()
    # The accumulation choices' peaks, on the plain model (each measured twice, the last
    # counted: the first warms the heap).
    peaks = {}
    for sync_each in (False, True):
        for _ in range(2):
            _native.trim_heap()
            dist.barrier()
            base = _native.rss()
            _native.reset_peak_rss()
            plain_step(sync_each)
            peaks[sync_each] = _native.peak_rss() - base
    units = len(_fsdp.units(gated_model))
    if rank == 0:
        params = sum(p.numel() for p in gated_model.parameters())
        print(
            f"FSDP2 on {world} ranks (gloo, {args.threads} thread each), {units} units, "
            f"{params * 4 / 2**20:.1f} MiB of parameters; {args.per_rank} samples per rank "
            f"per step in micro-batches of {args.micro}; {args.rounds} rounds of "
            f"{args.steps} steps per mode"
        )
        for m in modes:
            print(f"  {m:13s} median step {statistics.median(times[m]) * 1e3:8.1f} ms")
        print(
            f"  headroom/plain per round: median {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f})"
        )
        micro = -(-args.per_rank // args.micro)
        print(
            f"  gates: {per_step:.0f} per step ({per_step / micro:.1f} per micro-batch, "
            f"{per_step / micro / units:.2f} per unit and micro-batch); {seen_us:.0f} us each "
            f"as the job saw it (waiting for the slowest rank included), {bare_us:.0f} us as "
            f"a bare gate ({floor_us:.0f} us the same gloo all-reduce alone); "
            f"{per_step * bare_us / 1e3:.1f} ms of bare gates per step"
        )
        print(
            f"  plain accumulation peaks above the step's start: reduce-scatter on the last "
            f"micro-batch {peaks[False] / 2**20:.1f} MiB, on every micro-batch "
            f"{peaks[True] / 2**20:.1f} MiB"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
