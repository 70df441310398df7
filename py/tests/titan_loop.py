"""One rank of a training loop written the way torchtitan writes one (test_titan.py): a
small Llama (llama.py) with ``fully_shard`` on each block and on the root (the root kept
gathered after forward), a MixedPrecisionPolicy, AdamW with a warm-up and cosine LR,
``clip_grad_norm_`` over the DTensor gradients between the backward and the optimizer
step, an evaluation forward between steps, DCP checkpoints.

``--plain`` is the same loop without headroom (each rank's batch in one backward): the
job headroom's must equal. Otherwise ``headroom.Run(model=root, effective_batch=N)`` per
rank, a real hard cap on one rank (``--cap-rank``, what it holds plus
``--cap-extra-mib``), and out-of-memory errors injected through the real allocator at
named points (``--inject RANK:POINT@STEP,...``; points below). Rank 0 saves the gathered
parameters for the test to compare."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from llama import LlamaConfig, build, clip_grad_norm_, cosine_schedule, loss_of, shard

from conftest import FailInBackward, die_with_parent, injection_plan, leave, say

# Where an out-of-memory error can be injected (each through the allocator's own error):
#   fwd-<i>      inside block i's forward, after FSDP gathered its parameters
#   fwd-head     inside the root's own modules' forward (the final norm)
#   bwd-<i>      block i's backward, before any of its gradients
#   bwd-in-<i>   after block i's backward (its gradients made, its reduce-scatter due)
#   bwd-embed    the embedding's backward (the last of the step)
#   clip         the gradient clipping's local norms, before its collective
#   optimizer    the optimizer's first state allocation (nothing changed yet)
#   eval         the evaluation forward between steps
#   cap-full     the cap full from the end of the step's first forward to the next
#                micro-batch's (the first backward must start the autograd engine's
#                threads: their stacks are memory the cap counts)
#   all-gather, reduce-scatter
#                the cap filled between a gate every rank passed and FSDP's collective
#                behind it (the collective's own allocations then fail for real)


def parse_reshard(text: str) -> bool | int:
    if text in ("True", "true", "1"):
        return True
    if text in ("False", "false", "0"):
        return False
    return int(text)


def main() -> int:
    die_with_parent()
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true", help="no headroom: the reference job")
    ap.add_argument(
        "--plain-split",
        default="",
        help="with --plain: a headroom rank's log; each step is cut into as many "
        "micro-batches as that run's (the same split, so the same float sums)",
    )
    ap.add_argument(
        "--then-plain",
        action="store_true",
        help="after headroom's run, the plain loop with its split in the same job "
        "(params-plain.pt): one job's start instead of two",
    )
    ap.add_argument(
        "--accumulation", default="", help="RANK:hold|reduce, that rank's sharded_accumulation"
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--per-rank", type=int, default=16)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--block-reshard", default="True")
    ap.add_argument("--root-reshard", default="False")
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters in compute")
    ap.add_argument("--clip", type=float, default=1.0, help="0: no clipping")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--cap-rank", type=int, default=-1)
    ap.add_argument("--cap-extra-mib", type=int, default=0)
    ap.add_argument("--inject", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    c = LlamaConfig(
        vocab=args.vocab,
        dim=args.dim,
        layers=args.layers,
        heads=4,
        hidden=(8 * args.dim // 3 + 7) // 8 * 8,
        seq=args.seq,
        tied=args.tied,
    )

    def fresh():
        """The model, its optimizer and schedule, as every job starts them."""
        model = shard(
            build(c),
            parse_reshard(args.block_reshard),
            parse_reshard(args.root_reshard),
            param_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        )
        # foreach=False: the same update whatever a rank's memory (the fused and foreach
        # kernels group tensors differently).
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
        return model, opt, cosine_schedule(opt, warmup=1, total=args.steps)

    model, opt, sched = fresh()
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps):
        x = torch.randint(0, c.vocab, (args.per_rank * world, c.seq), generator=gen)
        batches.append((x, torch.roll(x, -1, dims=1)))
    held = torch.randint(0, c.vocab, (4, c.seq), generator=gen)

    plan = injection_plan(args.inject, rank)
    state = {"step": 0, "fired": []}

    def armed(point: str) -> bool:
        step = state["step"]
        if plan.get(step) == point and step not in state["fired"]:
            state["fired"].append(step)
            return True
        return False

    from headroom import _torch

    def oom() -> None:
        _torch.provoke_oom(torch.device("cpu"))

    @contextlib.contextmanager
    def cap_full():
        # Meanwhile every allocation that needs new memory from the kernel fails, as when
        # training holds the cap full (headroom's own cap is in force: lifting it is what
        # lets a collective through); afterwards the cap is as it was.
        import resource

        data = next(
            int(line.split()[1]) << 10
            for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("VmData:")
        )
        was = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (data, was[1]))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, was)

    for i, layer in model.layers.items():
        layer.register_forward_pre_hook(lambda m, a, i=i: oom() if armed(f"fwd-{i}") else None)

        def wrap_out(m, a, y, i=i):
            # At a block's output: its backward's first act, before its gradients.
            if plan.get(state["step"]) == f"bwd-{i}" and state["step"] not in state["fired"]:
                state["fired"].append(state["step"])
                FailInBackward.armed = True
                return FailInBackward.apply(y)
            return y

        def wrap_in(m, a, i=i):
            # At a block's input: after its backward, its gradients made.
            if plan.get(state["step"]) == f"bwd-in-{i}" and state["step"] not in state["fired"]:
                state["fired"].append(state["step"])
                FailInBackward.armed = True
                return (FailInBackward.apply(a[0]), *a[1:])
            return None

        layer.register_forward_hook(wrap_out)
        layer.register_forward_pre_hook(wrap_in)
    model.norm.register_forward_pre_hook(lambda m, a: oom() if armed("fwd-head") else None)

    def embed_out(m, a, y):
        if plan.get(state["step"]) == "bwd-embed" and state["step"] not in state["fired"]:
            state["fired"].append(state["step"])
            FailInBackward.armed = True
            return FailInBackward.apply(y)
        return y

    model.tok_embeddings.register_forward_hook(embed_out)

    def clip(model) -> float:
        if args.clip <= 0:
            return 0.0
        if armed("clip"):
            oom()
        return float(clip_grad_norm_(model.parameters(), args.clip))

    def evaluate(model) -> float | None:
        if not args.eval_every or state["step"] % args.eval_every:
            return None
        with torch.no_grad():
            if armed("eval"):
                oom()
            return float(loss_of(model, (held, torch.roll(held, -1, dims=1))))

    def plain(model, opt, sched, split_log: Path | None) -> tuple[list[float], list[float]]:
        """The loop without headroom; with `split_log` (a headroom rank's log) each step
        is cut into as many micro-batches as that run's, accumulated as FSDP2 does."""
        norms, evals = [], []
        counts = [1] * args.steps
        hold = True
        if split_log is not None:
            lines = split_log.read_text().splitlines()
            records = [json.loads(line) for line in lines if line.strip()]
            counts = [r["accum_steps"] for r in records if r["kind"] == "step"]
            hold = not any(
                "reduce-scatters its gradients after every" in r.get("text", "") for r in records
            )
        for step, (x, y) in enumerate(batches, 1):
            state["step"] = step
            n, count = args.per_rank, counts[step - 1]
            sizes = [n // count + (i < n % count) for i in range(count)]
            start = rank * n
            for i, size in enumerate(sizes):
                model.set_requires_gradient_sync(i == count - 1 or not hold)
                mb = (x[start : start + size], y[start : start + size])
                (loss_of(model, mb) * (size / n)).backward()
                start += size
            norms.append(clip(model))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            e = evaluate(model)
            if e is not None:
                evals.append(e)
        return norms, evals

    def on_checkpoint(step):
        import torch.distributed.checkpoint as dcp

        path = out / f"ckpt-step{step}"
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(path))
        return path

    norms: list[float] = []
    evals: list[float] = []
    run = None
    if args.plain:
        norms, evals = plain(
            model, opt, sched, Path(args.plain_split) if args.plain_split else None
        )
    else:
        import headroom
        from headroom import _native

        capped = rank == args.cap_rank and args.cap_extra_mib > 0
        budget = _native.rss() + (args.cap_extra_mib << 20) if capped else None
        real_zeros_like = torch.zeros_like

        def failing_zeros_like(*a, **k):
            # AdamW's first step makes each state tensor with zeros_like before it
            # updates anything: the first one fails, nothing changed yet.
            torch.zeros_like = real_zeros_like
            oom()

        full = contextlib.ExitStack()

        def capped_loss(mb):
            full.close()
            loss = loss_of(model, mb)
            if armed("cap-full"):
                full.enter_context(cap_full())
            return loss

        accumulation = "auto"
        if args.accumulation and int(args.accumulation.split(":")[0]) == rank:
            accumulation = args.accumulation.split(":")[1]
        run = headroom.Run(
            "titan",
            model=model,
            effective_batch=args.per_rank,
            micro_batch=args.micro,
            total_steps=args.steps,
            memory_budget=None if budget is None else str(budget),
            hard_limit=capped,
            on_checkpoint=on_checkpoint if args.checkpoint else None,
            log=out / f"rank{rank}.jsonl",
            sharded_accumulation=accumulation,
        )
        if getattr(getattr(run._rank, "gates", None), "enter", None) is not None:
            gates = run._rank.gates
            real_enter = gates.enter

            def enter(what, *a, **k):
                with cap_full() if armed(what) else contextlib.nullcontext():
                    return real_enter(what, *a, **k)

            gates.enter = enter
        with run:
            say(f"rank {rank} pid {os.getpid()} serving {run.name}")
            for step, (x, y) in enumerate(batches, 1):
                state["step"] = step
                lo, hi = rank * args.per_rank, (rank + 1) * args.per_rank
                run.backward((x[lo:hi], y[lo:hi]), capped_loss)
                norms.append(clip(model))
                if plan.get(step) == "optimizer" and step not in state["fired"]:
                    state["fired"].append(step)
                    torch.zeros_like = failing_zeros_like
                full.close()
                run.step(opt)
                torch.zeros_like = real_zeros_like
                sched.step()
                e = evaluate(model)
                if e is not None:
                    evals.append(e)
                if run.should_stop:
                    break

    def save(model, name: str) -> None:
        full = {
            n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in model.named_parameters()
        }
        if rank == 0:
            torch.save(full, out / name)

    save(model, "params.pt")
    plain_norms = None
    if args.then_plain and run is not None:
        # A fresh model, optimizer and schedule, as the job started; no injection.
        plan.clear()
        model2, opt2, sched2 = fresh()
        plain_norms, _ = plain(model2, opt2, sched2, out / f"rank{rank}.jsonl")
        save(model2, "params-plain.pt")
    (out / f"done-rank{rank}.json").write_text(
        json.dumps(
            {
                "steps": len(norms),
                "fired": state["fired"],
                "norms": norms,
                "plain_norms": plain_norms,
                "evals": evals,
                "sharded": all(hasattr(p, "full_tensor") for p in model.parameters()),
                "time": time.time(),
            }
        )
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    leave(main())
