"""A Trainer + headroom.hf.adapt run for test_hf.py's stop signal: the Trainer's own
accumulation (2 batches a step), each batch cut into micro-batches of 2, dropout on, a
sleep before each micro-batch's forward (--sleep) so a signal lands inside a step; or,
with --resume, the same run taken up from a checkpoint, fast. Saves the parameters when
it completes."""

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


def adapted(out: Path, log: Path) -> transformers.Trainer:
    """The adapted Trainer: a GPT-2 with dropout (so what a resume learns depends on the
    random states its checkpoint holds), micro-batches of at most 2 samples: 4 a batch,
    so a signal lands between two of them."""
    model = tiny_gpt2(dropout=0.1)
    trainer = transformers.Trainer(model=model, args=args_for(out), train_dataset=Samples(96))
    return headroom.hf.adapt(trainer, micro_batch=2, max_micro_batch=2, log=log)


def main() -> int:
    die_with_parent()
    a = signalled_args()
    torch.set_num_threads(1)
    trainer = adapted(Path(a.out), Path(a.log))

    def slow(module, inputs):
        if torch.is_grad_enabled() and a.sleep:
            print("forward", flush=True)  # the test counts these to signal mid-step
            time.sleep(a.sleep)

    trainer.model.get_input_embeddings().register_forward_pre_hook(slow)
    trainer.train(resume_from_checkpoint=a.resume)
    params = {k: v.detach() for k, v in trainer.model.named_parameters()}
    torch.save(params, Path(a.out) / "params.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
