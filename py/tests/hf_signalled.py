"""A Trainer + headroom.hf.adapt run for test_hf.py's stop signal: the Trainer's own
accumulation (2 batches a step), each batch cut into micro-batches of 2, a sleep before
each micro-batch's forward (--sleep) so a signal lands inside a step; or, with --resume,
the same run taken up from a checkpoint, fast. Saves the parameters when it completes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import transformers
from hf_models import Samples, tiny_gpt2, training_args

import headroom.hf

from conftest import die_with_parent, signalled_args


def args_for(out: Path) -> transformers.TrainingArguments:
    return training_args(
        out,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=5,
        train_sampling_strategy="sequential",
    )


def main() -> int:
    die_with_parent()
    a = signalled_args()
    torch.set_num_threads(1)
    model = tiny_gpt2()
    trainer = transformers.Trainer(
        model=model, args=args_for(Path(a.out)), train_dataset=Samples(96)
    )

    def slow(module, inputs):
        if torch.is_grad_enabled() and a.sleep:
            print("forward", flush=True)  # the test counts these to signal mid-step
            time.sleep(a.sleep)

    model.get_input_embeddings().register_forward_pre_hook(slow)
    # At most 2 samples a micro-batch: 4 a batch, so a signal lands between two of them.
    headroom.hf.adapt(trainer, micro_batch=2, max_micro_batch=2, log=a.log)
    trainer.train(resume_from_checkpoint=a.resume)
    torch.save({k: v.detach() for k, v in model.named_parameters()}, Path(a.out) / "params.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
