"""An ordinary PyTorch training loop, watched by headroom: a small CNN on synthetic images,
trained with a fixed batch size by the loop's own forward, backward and optimizer step.
headroom only watches (WATCH-ONLY mode): each step's loss, throughput and peak memory go to
the dashboard, whose stop key ends the loop cleanly. The lines marked `# headroom` are all
it takes to add that to an existing loop.

Run it from the repository root, in the environment that has your torch, after
`pip install ./py` (which also gives the `headroom` command):

    python examples/python/cnn_watch.py --steps 300

and in another terminal:

    headroom attach

The data: 3x32x32 images of noise, each quadrant brightened or darkened by a random
offset; an image's class (0-3) is the quadrant with the highest mean, a deterministic
function of the pixels, so the loss really falls (from ln 4 = 1.39 to about 0.1, some 95%
accuracy, within 50 steps; the errors left are images whose brightest quadrants nearly tie).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import headroom  # headroom

CLASSES = 4


def synthetic_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` images and their labels: the index of the brightest quadrant."""
    x = torch.randn(n, 3, 32, 32, generator=gen)
    offsets = 0.5 * torch.randn(n, 1, 2, 2, generator=gen)
    # Upsample the 2x2 offsets to one per quadrant (16x16 pixels each).
    x = x + offsets.repeat_interleave(16, dim=2).repeat_interleave(16, dim=3)
    quadrant_means = F.avg_pool2d(x.mean(dim=1, keepdim=True), 16).flatten(1)  # (n, 4)
    return x, quadrant_means.argmax(dim=1)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16x16
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),  # one feature vector per quadrant
        nn.Flatten(),
        nn.Linear(64 * 4, CLASSES),
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    ap.add_argument("--batch-size", type=int, default=64, help="images per step (default: 64)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (default: 3e-3)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model and the data")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)",
    )
    ap.add_argument("--log", default=None, help="write the run's JSONL log to this file")
    ap.add_argument(
        "--listen", default=None, help="also serve dashboards on TCP (PORT or HOST:PORT)"
    )
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    device = torch.device(args.device)
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # headroom: serve this run to the dashboard (`headroom attach cnn`).
    run = headroom.Run("cnn", model=model, total_steps=args.steps, log=args.log, listen=args.listen)

    last_t, last_step = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        if run.should_stop:  # headroom: the dashboard's stop key
            print(f"stop asked from the dashboard: ending after step {step - 1}")
            break
        x, y = synthetic_batch(args.batch_size, gen)
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        run.report(loss, samples=args.batch_size)  # headroom: the step's loss and peak memory

        if step % 10 == 0 or step == 1:
            accuracy = (logits.argmax(dim=1) == y).float().mean().item()
            now = time.perf_counter()
            rate = (step - last_step) / (now - last_t)
            last_t, last_step = now, step
            print(
                f"step {step:4d}  loss {loss.item():.4f}  accuracy {accuracy:5.1%}  "
                f"{rate:.1f} steps/s"
            )
    run.finish()  # headroom: the dashboard shows the run finished (also done at exit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
