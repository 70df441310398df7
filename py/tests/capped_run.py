"""A Python run under a real cap (RLIMIT_DATA through headroom's hard_limit) that starts
at a micro-batch which cannot fit: run by test_real_oom.py in its own process, since the
cap is process-wide. Prints one JSON line with what happened."""

from __future__ import annotations

import json
import sys

import capped
import torch

import headroom

from conftest import TinyGPT, gpt_batches


def batches(steps: int, n: int):
    """`gpt_batches(steps, n, t=128, vocab=256)`, the same batches, made one at a time:
    a run of many steps (stopped by its test) holds one under the cap, not all of them."""
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (n, 128), generator=g)
        yield x, torch.roll(x, -1, dims=1)


def main() -> int:
    ap = capped.arguments(room="160MiB")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--hold", type=float, default=0.0, help="seconds to wait per step")
    args = ap.parse_args()
    capped.one_thread()
    model = TinyGPT(vocab=256, d=64, t=128, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The optimizer's state exists before the cap is measured against the process.
    model.loss(gpt_batches(1, 2, t=128, vocab=256)[0]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    budget = capped.budget(args.room)
    losses = []
    with headroom.Run(
        "capped",
        model=model,
        effective_batch=args.batch,
        micro_batch=args.batch,
        memory_budget=str(budget),
        hard_limit=True,
        log=args.log,
        total_steps=args.steps,
    ) as run:
        for b in batches(args.steps, args.batch):
            if run.should_stop:
                break
            losses.append(run.backward(b, model.loss))
            run.step(opt)
            if args.hold:
                import time

                time.sleep(args.hold)
        print(json.dumps({"losses": losses, "micro_batch": run.micro_batch, "budget": budget}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
