"""A Python run under a real cap (headroom's hard_limit) that not even one sample fits:
run by test_hard_cap.py in its own process, since the cap is process-wide. Two steps of
short sequences train, then a batch of long ones gives up at micro-batch 1. With
HEADROOM_INJECT_FULL_CAP=1 the cap is filled at that moment, so the give-up's record,
message and checkpoint are made while the kernel gives no new memory at all."""

from __future__ import annotations

import capped
import torch

import headroom

from conftest import TinyGPT, gpt_batches


def main() -> int:
    ap = capped.arguments(room="96MiB")
    ap.add_argument("--ckpt", required=True, help="the file on_checkpoint writes")
    args = ap.parse_args()
    capped.one_thread()
    t = 4096
    model = TinyGPT(vocab=256, d=64, t=t, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The optimizer's state exists before the cap is measured against the process.
    model.loss(gpt_batches(1, 2, t=16, vocab=256)[0]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    budget = capped.budget(args.room)

    def save(step: int) -> None:
        torch.save({"step": step, "model": model.state_dict()}, args.ckpt)

    with headroom.Run(
        "giveup",
        model=model,
        effective_batch=2,
        micro_batch=2,
        memory_budget=str(budget),
        hard_limit=True,
        log=args.log,
        on_checkpoint=save,
    ) as run:
        # Short sequences fit; 4096 tokens do not at any size (the causal mask alone is 64
        # MiB, each head's attention as much again).
        for batch in gpt_batches(2, 2, t=16, vocab=256) + gpt_batches(1, 2, t=t, vocab=256):
            run.backward(batch, model.loss)
            run.step(opt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
