"""The adaptive Trainer under a real cap (headroom's hard_limit) that its per-device
batch cannot fit in one piece: run by test_hf.py in its own process (the cap is
process-wide). Prints one JSON line with what happened."""

from __future__ import annotations

import json
import sys

import capped
import transformers
from hf_models import Samples, tiny_gpt2, training_args

import headroom
import headroom.hf


def main() -> int:
    ap = capped.arguments(room="96MiB")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=192)
    args = ap.parse_args()
    capped.one_thread(seed=None)
    model = tiny_gpt2(vocab=256, ctx=128, d=64)
    ds = Samples(args.batch * args.steps, t=128, vocab=256)
    targs = training_args(
        args.out, per_device_train_batch_size=args.batch, max_steps=args.steps, optim="adamw_torch"
    )
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=ds)
    # The optimizer's state exists before the cap is measured against the process.
    trainer.create_optimizer_and_scheduler(num_training_steps=args.steps)
    model(**ds[0:2]).loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    budget = capped.budget(args.room)
    headroom.hf.adapt(
        trainer, memory_budget=str(budget), hard_limit=True, log=args.log, name="hf-capped"
    )
    trainer.train()
    print(
        json.dumps(
            {
                "global_step": trainer.state.global_step,
                "max_steps": args.steps,
                "per_device": args.batch,
                "budget": budget,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
