"""A run that a test signals (test_signals.py). --mode: `check` reads run.should_stop,
`ignore` never does, `stuck` stops calling report altogether (all three watch-only);
`long` is an adaptive loop whose second step is --samples long, split in micro-batches of
--micro-batch, checkpointing through on_checkpoint and resumable with --resume.
--on-usr: the run's on_usr1 and on_usr2 ("stop" or "checkpoint")."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import headroom


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["check", "ignore", "stuck", "long"], required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--checkpoints", required=True)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--resume")
    ap.add_argument("--out")
    ap.add_argument("--on-usr", default="stop")
    args = ap.parse_args()
    if args.mode == "long":
        return long_run(args)
    saved = Path(args.checkpoints)

    def on_checkpoint(step: int) -> Path:
        path = saved / f"step-{step}.txt"
        path.write_text(str(step))
        return path

    run = headroom.Run(
        "signalled",
        log=args.log,
        on_checkpoint=on_checkpoint,
        on_usr1=args.on_usr,
        on_usr2=args.on_usr,
    )
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        if args.mode == "stuck" and step > 3:
            time.sleep(3600)
        run.report(1.0 / step)
        time.sleep(0.05)
        if args.mode == "check" and run.should_stop:
            break
    run.finish()
    print("finished cleanly", flush=True)
    return 0


def batch_for(step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 is one sample (it completes at once, in one micro-batch whatever the split);
    step 2 holds `samples`."""
    g = torch.Generator().manual_seed(step)
    n = 1 if step == 1 else samples
    x = torch.randint(0, 64, (n, 8), generator=g)
    return x, torch.roll(x, -1, dims=1)


def long_run(args) -> int:
    from conftest import TinyGPT

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyGPT(t=8, layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = 1
    if args.resume:
        state = torch.load(args.resume)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = state["step"] + 1
    saved = Path(args.checkpoints)

    def on_checkpoint(step: int) -> Path:
        path = saved / f"step-{step}.pt"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path)
        return path

    run = headroom.Run(
        "long",
        model=model,
        log=args.log,
        on_checkpoint=on_checkpoint,
        effective_batch=args.samples,
        micro_batch=args.micro_batch,
        adaptive=False,
    )
    print("ready", flush=True)
    for step in range(first, 3):
        run.backward(batch_for(step, args.samples), model.loss)
        run.step(opt)
        if run.should_stop:
            break
    run.finish()
    if args.out:
        torch.save(model.state_dict(), args.out)
    print("finished cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
