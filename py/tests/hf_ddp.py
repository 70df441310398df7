"""One rank of a Trainer + headroom.hf.adapt job under torchrun (test_hf.py): the
Trainer's own DDP on gloo (or, with --fsdp, accelerate's FSDP2), its own accumulation and
clipping, a sequential sampler (so a single process with the whole global batch sees the
same samples), and out-of-memory errors from the real allocator on one rank. Saves rank
0's parameters (gathered, under FSDP2)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from hf_models import Samples, fsdp_on_the_cpu, tiny_gpt2, training_args

import headroom
import headroom.hf
from headroom import _torch

from conftest import die_with_parent, leave


def main() -> int:
    die_with_parent()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--oom-rank", type=int, default=1)
    ap.add_argument("--oom-at", default="2,5", help="forward calls (with grad) that fail")
    ap.add_argument(
        "--oom-in-backward-at",
        default="",
        help="forward calls (with grad) whose backward fails, between the two blocks' units",
    )
    ap.add_argument("--fsdp", action="store_true", help="the Trainer's FSDP2 (accelerate's)")
    ap.add_argument("--steps", type=int, default=3, help="the Trainer's max_steps")
    ap.add_argument("--compile", action="store_true", help="the Trainer's torch_compile")
    ap.add_argument(
        "--sleep",
        type=float,
        default=0.0,
        help="seconds before each micro-batch's forward, micro-batches of at most 3 (rank 0 "
        "prints a line for each: the stop test counts them)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    model = tiny_gpt2()
    extra = {}
    if args.fsdp:
        fsdp_on_the_cpu()
        # The Trainer's own FSDP2 checkpoint (accelerate's, through DCP) at step 2.
        extra = dict(fsdp_args(), save_strategy="steps", save_steps=2)
    if args.compile:
        extra["torch_compile"] = True
    targs = training_args(out / "trainer", **dict(ddp_args(), max_steps=args.steps), **extra)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=Samples(96))
    mine = rank == args.oom_rank
    fail_at = {int(n) for n in args.oom_at.split(",") if n} if mine else set()
    fail_back = {int(n) for n in args.oom_in_backward_at.split(",") if n} if mine else set()
    calls = {"n": 0}

    def fail_some(module, inputs):
        if not torch.is_grad_enabled():
            return  # adapt's one-sample probe of the loss's normalisation
        if args.sleep:
            if rank == 0:
                print("forward", flush=True)
            time.sleep(args.sleep)
        calls["n"] += 1
        if calls["n"] in fail_at:
            _torch.provoke_oom(torch.device("cpu"))

    def fail_in_backward(module, inputs, output):
        if torch.is_grad_enabled() and calls["n"] in fail_back:
            fail_back.discard(calls["n"])
            hidden = output[0] if isinstance(output, tuple) else output
            hidden.register_hook(lambda g: _torch.provoke_oom(torch.device("cpu")))

    model.get_input_embeddings().register_forward_pre_hook(fail_some)
    model.transformer.h[0].register_forward_hook(fail_in_backward)
    most = {"max_micro_batch": 3} if args.sleep else {}
    headroom.hf.adapt(trainer, micro_batch=3, log=out / f"rank{rank}.jsonl", **most)
    result = trainer.train()
    # Under FSDP2 `model` is the root accelerate sharded in place (DTensor parameters).
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.named_parameters()
    }
    if rank == 0:
        torch.save(full, out / "params.pt")
    (out / f"done-rank{rank}.json").write_text(
        json.dumps({"steps": trainer.state.global_step, "loss": result.training_loss})
    )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    leave(0)


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


def fsdp_args() -> dict:
    """The Trainer's FSDP2: each GPT-2 block a unit, the model the root."""
    return dict(
        fsdp="full_shard",
        fsdp_config={
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": ["GPT2Block"],
            # The full state dict fails on the CPU in the Trainer without headroom too
            # (safetensors reads a DTensor's storage); DCP shards are what FSDP saves.
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    )


if __name__ == "__main__":
    raise SystemExit(main())
