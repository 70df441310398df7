"""A hand-written loop under a real cap (headroom's hard_limit) where one long sample fits
only with its blocks' activations recomputed: run by test_levers.py in its own process,
since the cap is process-wide. With `--blocks` the run holds the checkpointing lever and
switches it on when micro-batch 1 runs out of memory (the last resort); without, it gives
up there. Prints one JSON line: the steps done and the lever's state at the end."""

from __future__ import annotations

import json

import capped
import torch

import headroom


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(torch.nn.Module):
    """Blocks whose activations (ten floats per token and block) outweigh everything
    else: a long sequence's are what the cap refuses."""

    def __init__(self, d: int = 64, layers: int = 16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def loss(self, x):
        return self(x).pow(2).mean()


def main() -> int:
    ap = capped.arguments(room="160MiB")
    ap.add_argument("--blocks", action="store_true", help="hand the run its blocks")
    args = ap.parse_args()
    capped.one_thread()
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    short = [torch.randn(2, 16, 64, generator=g) for _ in range(2)]
    long = [torch.randn(2, 8192, 64, generator=g)]
    model.loss(short[0]).backward()
    opt.zero_grad(set_to_none=True)
    budget = capped.budget(args.room)
    run = headroom.Run(
        "lever-capped",
        model=model,
        effective_batch=2,
        micro_batch=2,
        memory_budget=str(budget),
        hard_limit=True,
        log=args.log,
        checkpoint_blocks=model.blocks if args.blocks else None,
    )
    with run:
        for x in short + long + short:
            run.backward(x, model.loss, seq_len=x.shape[1])
            run.step(opt)
    print(json.dumps({"steps": run.step_count, "checkpointing": run._levers.checkpointing}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
