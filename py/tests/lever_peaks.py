"""A hand-written loop's levers measured: four steps of lever_capped.py's blocks under a
hard cap well above what they need (so the resident set follows live tensors), a lever
switched before the third. Run by test_levers.py in its own process (the cap is
process-wide); prints the lever decision (the step before the switch against the one
after, at the same shape) as one JSON line."""

from __future__ import annotations

import json

import capped
import torch
from lever_capped import Stack

import headroom


def main() -> int:
    ap = capped.arguments(room="2GiB")
    ap.add_argument("--lever", choices=["checkpointing:blocks", "precision:bf16"], required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    capped.one_thread()
    model = Stack(layers=args.layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, args.seq, 64)
    run = headroom.Run(
        "lever-peaks",
        model=model,
        effective_batch=2,
        micro_batch=2,
        adaptive=False,
        memory_budget=str(capped.budget(args.room)),
        hard_limit=True,
        log=args.log,
        checkpoint_blocks=model.blocks,
        precision="fp32",
    )
    with run:
        for i in range(4):
            if i == 2:
                run._carry_out(args.lever)  # what a viewer's command does at a boundary
            run.backward(x, model.loss, seq_len=args.seq)
            run.step(opt)
    with open(args.log, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    lever = [r["decision"] for r in records if r["kind"] == "decision"]
    print(json.dumps([d for d in lever if d["decision"] == "lever"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
