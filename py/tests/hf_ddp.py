"""One rank of a Trainer + headroom.hf.adapt job under torchrun (test_hf.py): the
Trainer's own DDP on gloo, its own accumulation and clipping, a sequential sampler (so
a single process with the whole global batch sees the same samples), and out-of-memory
errors from the real allocator on one rank. Saves rank 0's parameters."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import transformers
from hf_models import Samples, tiny_gpt2, training_args

import headroom
import headroom.hf
from headroom import _torch

from conftest import die_with_parent


def main() -> int:
    die_with_parent()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--oom-rank", type=int, default=1)
    ap.add_argument("--oom-at", default="2,5", help="forward calls (with grad) that fail")
    args = ap.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    model = tiny_gpt2()
    targs = training_args(out / "trainer", **ddp_args())
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=Samples(96))
    fail_at = {int(n) for n in args.oom_at.split(",")} if rank == args.oom_rank else set()
    calls = {"n": 0}

    def fail_some(module, inputs):
        if not torch.is_grad_enabled():
            return  # adapt's one-sample probe of the loss's normalisation
        calls["n"] += 1
        if calls["n"] in fail_at:
            _torch.provoke_oom(torch.device("cpu"))

    model.get_input_embeddings().register_forward_pre_hook(fail_some)
    headroom.hf.adapt(trainer, micro_batch=3, log=out / f"rank{rank}.jsonl")
    result = trainer.train()
    if rank == 0:
        torch.save({k: v.detach() for k, v in model.named_parameters()}, out / "params.pt")
    (out / f"done-rank{rank}.json").write_text(
        json.dumps({"steps": trainer.state.global_step, "loss": result.training_loss})
    )
    return 0


def ddp_args(per_device: int = 8) -> dict:
    """The job's Trainer settings; the single-process reference uses the same with the
    whole global batch per device."""
    return dict(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        max_steps=3,
        train_sampling_strategy="sequential",
        ddp_backend="gloo",
    )


if __name__ == "__main__":
    raise SystemExit(main())
