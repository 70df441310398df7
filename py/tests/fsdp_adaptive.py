"""One rank of an adaptive FSDP2 job (test_fsdp.py): conftest's small transformer with
``fully_shard`` on each block and at the root, trained by run.backward/run.step on its
share of each global batch, with out-of-memory errors injected on one rank through the
real allocator at a middle forward, the first and the last backward, or the optimizer
step. Rank 0 saves the gathered parameters for the test to compare with one process."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import headroom
from headroom import _fsdp, _native, _torch

from conftest import FailInBackward, TinyGPT, die_with_parent, injection_plan, leave, say


def main() -> int:
    die_with_parent()  # a rank never outlives its torchrun
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--per-rank", type=int, default=12, help="samples per rank per step")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument(
        "--inject",
        default="",
        help="RANK:POINT@STEP,... (points: forward-middle, backward-first, backward-last, "
        "optimizer-state; the optimizer's state exists after step 1)",
    )
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--out", required=True, help="a directory for params and logs")
    ap.add_argument("--listen", default=None, help="rank 0 also serves on TCP here")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to idle per step")
    ap.add_argument(
        "--micro-sleep", type=float, default=0.0, help="seconds to idle per micro-batch"
    )
    ap.add_argument("--budget-rank", type=int, default=-1, help="the rank given a hard cap")
    ap.add_argument(
        "--budget-extra-mib", type=int, default=0, help="its cap: what it holds plus this"
    )
    ap.add_argument(
        "--checkpoint", action="store_true", help="on_checkpoint saves the sharded state (DCP)"
    )
    ap.add_argument("--fixed", action="store_true", help="adaptive=False: the size is held")
    ap.add_argument("--sharded-accumulation", default="auto", help="the Run's argument")
    ap.add_argument(
        "--compile",
        choices=["", "blocks", "outer"],
        default="",
        help="each block compiled before it is sharded (blocks), or torch.compile of the "
        "sharded root (outer)",
    )
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    torch.manual_seed(0)
    model = TinyGPT(d=args.width, t=args.seq)
    for block in model.blocks:
        if args.compile == "blocks":
            block.compile()
        fully_shard(block)
    fully_shard(model)
    root = model
    if args.compile == "outer":
        model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)

    def batches():
        for _ in range(args.steps):
            x = torch.randint(0, 64, (args.per_rank * world, args.seq), generator=gen)
            yield x, torch.roll(x, -1, dims=1)

    plan = injection_plan(args.inject, rank)
    state = {"step": 0, "done": 0, "fired": []}

    def armed(point: str) -> bool:
        step = state["step"]
        return plan.get(step) == point and step not in state["fired"]

    def middle_block(module, inputs):
        # Inside a unit: FSDP's pre-forward has all-gathered this block's parameters.
        if armed("forward-middle") and state["done"] > 0:
            state["fired"].append(state["step"])
            _torch.provoke_oom(torch.device("cpu"))

    root.blocks[len(root.blocks) // 2].register_forward_pre_hook(middle_block)

    def loss_fn(mb):
        x, y = mb
        last = state["done"] + x.shape[0] >= args.per_rank
        time.sleep(args.micro_sleep)  # a long step, whatever the machine's speed
        # The first backward (before any unit's), or the last (the embeddings' gradient,
        # after every block's reduce-scatter in the micro-batch that syncs).
        first = armed("backward-first") and state["done"] == 0
        root.hook = FailInBackward.apply if armed("backward-last") else None
        if first or (armed("backward-last") and last and state["done"] > 0):
            state["fired"].append(state["step"])
            FailInBackward.armed = True
        logits = model(x)
        if first:
            logits = FailInBackward.apply(logits)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        state["done"] += x.shape[0]
        return loss

    real_clone = torch.Tensor.clone

    def failing_clone(t, *a, **k):
        # SGD's first step creates each momentum buffer with grad.clone() before it
        # updates that parameter (a DTensor's shard here): the first one fails, with
        # nothing changed yet.
        torch.Tensor.clone = real_clone
        state["fired"].append(state["step"])
        _torch.provoke_oom(t.device)

    def on_checkpoint(step):
        # Collective: every rank saves its shards at the same step (the job agrees on it).
        import torch.distributed.checkpoint as dcp

        path = out / f"ckpt-step{step}"
        dcp.save({"model": root.state_dict()}, checkpoint_id=str(path))
        return path

    groups_before = len(dist.distributed_c10d._world.pg_map)
    capped = rank == args.budget_rank and args.budget_extra_mib > 0
    budget = (_native.rss() + (args.budget_extra_mib << 20)) if capped else None
    with headroom.Run(
        "fsdp",
        memory_budget=None if budget is None else str(budget),
        hard_limit=bool(capped),
        on_checkpoint=on_checkpoint if args.checkpoint else None,
        model=model,
        effective_batch=args.per_rank,
        micro_batch=args.micro,
        total_steps=args.steps,
        log=out / f"rank{rank}.jsonl",
        listen=args.listen if rank == 0 else None,
        adaptive=not args.fixed,
        sharded_accumulation=args.sharded_accumulation,
    ) as run:
        say(f"rank {rank} pid {os.getpid()} serving {run.name}")
        if run.tcp:
            say(f"rank {rank} tcp {run.tcp} token {run.token_file}")
        for step, (x, y) in enumerate(batches(), 1):
            if run.should_stop:
                break
            state.update(step=step, done=0)
            lo, hi = rank * args.per_rank, (rank + 1) * args.per_rank
            run.backward((x[lo:hi], y[lo:hi]), loss_fn)
            if armed("optimizer-state"):
                torch.Tensor.clone = failing_clone
            run.step(opt)
            torch.Tensor.clone = real_clone
            time.sleep(args.step_sleep)
        steps_done = run.step_count
        # At world size 1 the run joins no job: no gates (FSDP2's collectives are local).
        gates = getattr(run._rank, "gates", None) or _fsdp.Gates(None, None)
    # A unit left half run by an out-of-memory error keeps plain unsharded parameters.
    sharded = all(hasattr(p, "full_tensor") for p in root.parameters())
    full = {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for n, p in root.named_parameters()
    }
    if rank == 0:
        torch.save(full, out / "params.pt")
    # The run has ended: its groups are gone and FSDP collects ungated (a forward after
    # training, as an evaluation or an export would).
    gated = gates.passed
    with torch.no_grad():
        model(next(iter(batches()))[0][:2])
    (out / f"done-rank{rank}.json").write_text(
        json.dumps(
            {
                "steps": steps_done,
                "fired": state["fired"],
                "gates": gated,
                "reduce_scatters": gates.reduce_scatters,
                "sharded": sharded,
                "gates_after_run": gates.passed - gated,
                "groups_before": groups_before,
                "groups_after": len(dist.distributed_c10d._world.pg_map),
                "gate_us": gates.us,
            }
        )
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    leave(main())
