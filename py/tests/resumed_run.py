"""An adaptive loop whose memory has a ceiling: a micro-batch above --ceiling samples
fails with the CPU allocator's own out-of-memory error, which teaches the controller the
ceiling (test_resume.py). --save-after K saves a checkpoint (model, optimizer and
run.state_dict()) after step K and goes on; --resume continues from one (--no-state: without
the run's state, as the package did before it had one). Writes each step's micro-batch
sizes and the final parameters to --out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import headroom
from headroom import _torch

from conftest import TinyGPT, gpt_batches


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ceiling", type=int, required=True)
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--save-after", type=int)
    ap.add_argument("--resume")
    ap.add_argument("--no-state", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyGPT(t=8, layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = gpt_batches(args.steps, args.samples, t=8)
    splits: dict[int, list[int]] = {}
    step = 0

    def loss_fn(batch):
        n = batch[0].shape[0]
        splits.setdefault(step, []).append(n)
        if n > args.ceiling:
            _torch.provoke_oom(torch.device("cpu"))
        return model.loss(batch)

    run = headroom.Run(
        "resumed", model=model, effective_batch=args.samples, micro_batch=args.samples
    )
    if args.resume:
        saved = torch.load(args.resume)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if not args.no_state:
            run.load_state_dict(saved["headroom"])
    # Without the run's state the loop knows where it was from its own checkpoint.
    first = saved["step"] + 1 if args.no_state else run.step_count + 1
    for step in range(first, args.steps + 1):
        run.backward(batches[step - 1], loss_fn)
        run.step(opt)
        if step == args.save_after:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
            torch.save({**state, "headroom": run.state_dict()}, Path(args.out).with_suffix(".ck"))
    run.finish()
    torch.save(model.state_dict(), args.out)
    Path(args.out).with_suffix(".json").write_text(json.dumps(splits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
