"""The adaptive LightningModule under a real cap (headroom's hard_limit) that its batch
cannot fit in one piece: run by test_lightning.py in its own process (the cap is
process-wide). Prints one JSON line with what happened."""

from __future__ import annotations

import json
import sys

import capped
import lightning as L
from lightning_models import TinyAdaptive, loader

import headroom
import headroom.lightning


def main() -> int:
    ap = capped.arguments(room="128MiB")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    capped.one_thread()
    gpt = dict(vocab=256, d=64, t=128, layers=2)
    model = TinyAdaptive(**gpt)
    data = loader(args.steps, args.batch, t=128, vocab=256)
    # Lightning and the model are loaded before the cap is measured against the process.
    model.net.loss(next(iter(loader(1, 2, t=128, vocab=256)))).backward()
    model.zero_grad(set_to_none=True)
    budget = capped.budget(args.room)
    cb = headroom.lightning.Adaptive(
        "pl-capped", memory_budget=str(budget), hard_limit=True, log=args.log
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        callbacks=[cb],
    )
    trainer.fit(model, data)
    print(
        json.dumps({"global_step": trainer.global_step, "steps": args.steps, "batch": args.batch})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
