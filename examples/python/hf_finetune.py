"""A stock Hugging Face Trainer script (a GPT-2-shaped model built from a config, random
weights, nothing downloaded; byte-level windows of the bundled Tiny Shakespeare), with
ONE line added: `headroom.hf.adapt(trainer)`. headroom's controller then cuts each
per-device batch into micro-batches that grow while memory allows and shrink before it
runs out; an out-of-memory error mid-step is retried smaller, without restarting the
Trainer. Everything else is the Trainer's: its gradient accumulation, clipping, LR
schedule, logging and checkpoints (`checkpoint-N`, resumable with --resume).

Run it from the repository root, in the environment that has your torch and
transformers, after `pip install ./py`:

    python examples/python/hf_finetune.py --steps 30
    headroom attach                           # in another terminal: watch, pause, stop

A real capped run on the CPU (the whole process may hold --memory-budget; a batch of 64
windows of 256 bytes does not fit in one piece):

    python examples/python/hf_finetune.py --memory-budget 1.3GiB --hard-limit \\
        --batch 64 --steps 10 --log /tmp/hf.jsonl

--watch-only adds `callbacks=[headroom.hf.Watch()]` instead: the dashboard shows the run
and its commands reach the Trainer, but the Trainer's batches are its own.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built here, never downloaded

import torch  # noqa: E402
import transformers  # noqa: E402

import headroom  # noqa: E402
import headroom.hf  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "assets" / "tinyshakespeare.txt"


class Windows(torch.utils.data.Dataset):
    """Random byte windows of the corpus (seeded): input_ids and labels alike; the model
    shifts the labels itself."""

    def __init__(self, n: int, seq_len: int, seed: int = 0):
        data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8)
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(data) - seq_len, (n,), generator=g)
        self.ids = data[starts[:, None] + torch.arange(seq_len)].long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32, help="per-device batch (the effective one)")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=None, help="where headroom starts")
    ap.add_argument("--memory-budget", default=None)
    ap.add_argument("--hard-limit", action="store_true")
    ap.add_argument("--log", default=None)
    ap.add_argument("--out", default="runs/hf_finetune")
    ap.add_argument("--resume", default=None, help="a checkpoint-N directory to resume from")
    ap.add_argument("--watch-only", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=4,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    training_args = transformers.TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=1e-3,
        warmup_steps=max(1, args.steps // 10),
        logging_steps=5,
        save_steps=max(10, args.steps // 2),
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    headroom_kw = dict(log=args.log, memory_budget=args.memory_budget, hard_limit=args.hard_limit)
    callbacks = [headroom.hf.Watch(**headroom_kw)] if args.watch_only else []
    trainer = transformers.Trainer(
        model=model,
        args=training_args,
        train_dataset=Windows(args.batch * args.grad_accum * args.steps, args.seq_len),
        callbacks=callbacks,
    )
    if not args.watch_only:
        headroom.hf.adapt(trainer, micro_batch=args.micro_batch, **headroom_kw)  # the one line
    out = trainer.train(resume_from_checkpoint=args.resume)
    print(f"trained {trainer.state.global_step} steps, loss {out.training_loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
