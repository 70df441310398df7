"""One rank of an adaptive DDP job (test_ddp.py): a small transformer wrapped in DDP,
trained by run.backward/run.step on its share of each global batch, with out-of-memory
errors injected on one rank through the real allocator, or a real cap on one rank."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import headroom
from headroom import _native, _torch

from conftest import (
    FailInBackward,
    TinyGPT,
    branch_batch,
    die_with_parent,
    injection_plan,
    leave,
    say,
)


def main() -> int:
    die_with_parent()  # a rank never outlives its torchrun
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--per-rank", type=int, default=12, help="samples per rank per step")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument(
        "--inject",
        default="",
        help="RANK:POINT@STEP,POINT@STEP... (points: forward-middle, backward-first, "
        "backward-last, optimizer-state, zero-fill; the optimizer's state exists after step "
        "1; zero-fill: headroom's zeros for the --branch gradients this rank lacks, for as "
        "long as the step's attempt lasts)",
    )
    ap.add_argument("--budget-rank", type=int, default=-1, help="the rank given a hard cap")
    ap.add_argument(
        "--budget-extra-mib", type=int, default=0, help="its cap: what it holds plus this"
    )
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--out", required=True, help="a directory for params and logs")
    ap.add_argument("--listen", default=None, help="rank 0 also serves on TCP here")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to idle per step")
    ap.add_argument(
        "--micro-sleep", type=float, default=0.0, help="seconds to idle per micro-batch"
    )
    ap.add_argument("--raise-at", default="", help="RANK@STEP: loss_fn raises ValueError there")
    ap.add_argument(
        "--raise-in-backward",
        action="store_true",
        help="--raise-at's ValueError comes from the step's last backward instead",
    )
    ap.add_argument(
        "--bucket-kib", type=int, default=0, help="DDP's bucket_cap_mb in KiB (0: its default)"
    )
    ap.add_argument("--checkpoint", action="store_true", help="on_checkpoint writes a file")
    ap.add_argument("--fixed", action="store_true", help="adaptive=False: the size is held")
    ap.add_argument(
        "--branch", action="store_true", help="a layer only rank 0's samples go through"
    )
    ap.add_argument(
        "--compile",
        choices=["", "outer", "inner"],
        default="",
        help="torch.compile(DDP(model)) (outer, DDP's optimizer splits the graph at its "
        "buckets) or DDP(torch.compile(model)) (inner)",
    )
    ap.add_argument(
        "--overlap",
        choices=["on", "off", "auto"],
        default="on",
        help="HEADROOM_DDP_OVERLAP for the run (on: these tests' all-reduce during the last "
        "backward, whatever the machine's cores)",
    )
    ap.add_argument(
        "--reduce-after-from",
        type=int,
        default=0,
        help="from this step on, the gradients are all-reduced after the last backward",
    )
    args = ap.parse_args()
    os.environ["HEADROOM_DDP_OVERLAP"] = args.overlap
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    torch.manual_seed(0)
    inner = TinyGPT(d=args.width, t=args.seq, branch=args.branch)
    caps = {"bucket_cap_mb": args.bucket_kib / 1024} if args.bucket_kib else {}
    if args.compile == "inner":
        model = torch.nn.parallel.DistributedDataParallel(torch.compile(inner), **caps)
    else:
        model = torch.nn.parallel.DistributedDataParallel(inner, **caps)
        if args.compile == "outer":
            model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Drawn step by step from conftest's generator (the same batches as gpt_batches, which
    # would build every step's batch up front: gigabytes for a run of 100000 steps).
    gen = torch.Generator().manual_seed(0)

    def batches():
        for _ in range(args.steps):
            x = torch.randint(0, 64, (args.per_rank * world, args.seq), generator=gen)
            if args.branch:
                branch_batch(x, args.per_rank)
            yield x, torch.roll(x, -1, dims=1)

    plan = injection_plan(args.inject, rank)
    state = {"step": 0, "calls": 0, "done": 0, "fired": []}
    raise_rank, raise_step = (
        (int(v) for v in args.raise_at.split("@")) if args.raise_at else (-1, -1)
    )

    def loss_fn(mb):
        x, y = mb
        state["calls"] += 1
        time.sleep(args.micro_sleep)  # a long step, whatever the machine's speed
        step = state["step"]
        last = state["done"] + x.shape[0] >= args.per_rank
        if rank == raise_rank and step == raise_step:
            error = ValueError(f"a bad sample on rank {rank} at step {step}")
            if not args.raise_in_backward:
                raise error
            if last:
                FailInBackward.armed, FailInBackward.error = True, error
        point = plan.get(step) if step not in state["fired"] else None
        if point == "forward-middle" and state["done"] > 0 and not last:
            state["fired"].append(step)
            _torch.provoke_oom(torch.device("cpu"))
        if (point == "backward-first" and state["done"] == 0) or (
            point == "backward-last" and last and state["done"] > 0
        ):
            state["fired"].append(step)
            FailInBackward.armed = True
        if point == "zero-fill":
            torch.zeros_like = failing_zeros_like
        elif torch.zeros_like is failing_zeros_like:
            # The step's redo: the shortage is over.
            torch.zeros_like = real_zeros_like
        inner.hook = FailInBackward.apply
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        state["done"] += x.shape[0]
        return loss

    real_clone = torch.Tensor.clone

    def failing_clone(self, *a, **k):
        # SGD's first step creates each momentum buffer with grad.clone() before it
        # updates that parameter: the first one fails, with nothing changed yet.
        torch.Tensor.clone = real_clone
        state["fired"].append(state["step"])
        _torch.provoke_oom(self.device)

    real_zeros_like = torch.zeros_like
    branch_params = list(inner.branch.parameters()) if args.branch else []

    def failing_zeros_like(t, *a, **k):
        # Zeros for a gradient of the branch, which this rank's data never takes: they do
        # not fit until the step's attempt ends, headroom's relaunch of the buckets after
        # the first failure included (a real shortage would not pass either).
        if any(t is p for p in branch_params):
            if state["step"] not in state["fired"]:
                state["fired"].append(state["step"])
            _torch.provoke_oom(t.device)
        return real_zeros_like(t, *a, **k)

    def on_checkpoint(step):
        p = out / f"ckpt-rank{rank}-step{step}.pt"
        torch.save(inner.state_dict(), p)
        return p

    capped = rank == args.budget_rank and args.budget_extra_mib > 0
    budget = (_native.rss() + (args.budget_extra_mib << 20)) if capped else None
    with headroom.Run(
        "ddp",
        model=model,
        effective_batch=args.per_rank,
        micro_batch=args.micro,
        total_steps=args.steps,
        log=out / f"rank{rank}.jsonl",
        listen=args.listen if rank == 0 else None,
        memory_budget=None if budget is None else str(budget),
        hard_limit=bool(capped),
        on_checkpoint=on_checkpoint if args.checkpoint else None,
        adaptive=not args.fixed,
    ) as run:
        say(f"rank {rank} pid {os.getpid()} serving {run.name}")
        if run.tcp:
            say(f"rank {rank} tcp {run.tcp} token {run.token_file}")
        for step, (x, y) in enumerate(batches(), 1):
            if run.should_stop:
                break
            state.update(step=step, done=0)
            if step == args.reduce_after_from:
                run._rank.job.set_overlap(False)
            lo, hi = rank * args.per_rank, (rank + 1) * args.per_rank
            run.backward((x[lo:hi], y[lo:hi]), loss_fn)
            if plan.get(step) == "optimizer-state":
                torch.Tensor.clone = failing_clone
            run.step(opt)
            torch.Tensor.clone = real_clone
            torch.zeros_like = real_zeros_like
            time.sleep(args.step_sleep)
        steps_done = run.step_count
        overlap = getattr(run._rank.job, "overlap", None)
        early = overlap.early_total if overlap is not None else 0
        # The buckets as laid out now, and as first guessed (reverse registration).
        layouts = {}
        if overlap is not None:
            from headroom import _overlap

            layouts = {
                "layout": [b.params for b in overlap.buckets],
                "first_layout": [b.params for b in _overlap.layout(overlap.params, overlap.cap)],
            }
    if rank == 0:
        torch.save(inner.state_dict(), out / "params.pt")
    (out / f"done-rank{rank}.json").write_text(
        json.dumps(
            {
                "steps": steps_done,
                "fired": state["fired"],
                "calls": state["calls"],
                "early_buckets": early,
                **layouts,
            }
        )
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    leave(main())
