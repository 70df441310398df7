"""The nanoGPT example under torchrun with DDP, in headroom's ADAPTIVE mode: every rank's
micro-batch is steered by its own memory controller, an out-of-memory error on any rank is
recovered without the others waiting on it, and `headroom attach nanogpt-ddp` shows every
rank's row on one screen (and pauses, stops or checkpoints the whole job at one step).

Run it on a CPU from the repository root (gloo, two processes), in the environment that
has your torch, after `pip install ./py`:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/python/ddp.py --steps 50            # torchrun, by its module

and in another terminal:

    headroom attach nanogpt-ddp     # the job: a row per rank

On GPUs (one per process): `--device cuda` picks `cuda:LOCAL_RANK` and NCCL.

What changes from a single-process loop (examples/python/nanogpt.py):
- `dist.init_process_group` first, then `headroom.Run` on EVERY rank (its creation is a
  collective), with `model=` the DDP-wrapped model;
- `effective_batch` is per rank: the global batch is that times the world size;
- each rank draws its own samples (here: its own generator seeded by its rank);
- the loss function calls the DDP model; headroom runs every micro-batch under DDP's
  `no_sync()` and all-reduces the gradients once per step, bucket by bucket during each
  rank's last backward after the ranks have agreed (docs/PYTHON.md, "torchrun");
- only rank 0 writes checkpoints (every rank's `on_checkpoint` is called at the same step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import headroom

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nanogpt import DEFAULT_CORPUS, GPT, checkpointer, windows  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--effective-batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--micro-batch", type=int, default=4, help="where each controller starts")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:LOCAL_RANK per rank)")
    ap.add_argument("--memory-budget", default=None, help="per rank, e.g. 2GiB (CPU: hard cap)")
    ap.add_argument("--log-dir", type=Path, default=None, help="one JSONL log per rank here")
    ap.add_argument("--checkpoint-dir", type=Path, default=None, help="rank 0 saves here")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    cuda = args.device.startswith("cuda")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(1337)  # the same initial weights on every rank (DDP checks)
    data = torch.frombuffer(bytearray(args.corpus.read_bytes()), dtype=torch.uint8)
    model = GPT(args.seq_len, args.n_layer, args.n_head, args.n_embd, 0.0).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[local_rank] if cuda else None
    )
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, fused=cuda)
    gen = torch.Generator().manual_seed(1337 + rank)  # each rank its own samples

    def loss_of(mb):
        x, y = mb
        logits = ddp(x)  # through DDP: headroom keeps it under no_sync()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )

    save = None
    if args.checkpoint_dir is not None:
        rank0_save = checkpointer(args.checkpoint_dir, model, optimizer)

        def save(step: int):
            return rank0_save(step) if rank == 0 else None

    log = args.log_dir / f"rank{rank}.jsonl" if args.log_dir else None
    if log is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    with headroom.Run(
        "nanogpt-ddp",
        model=ddp,
        total_steps=args.steps,
        effective_batch=args.effective_batch,
        micro_batch=args.micro_batch,
        memory_budget=args.memory_budget,
        hard_limit=bool(args.memory_budget) and not cuda,
        log=log,
        on_checkpoint=save,
    ) as run:
        if rank == 0:
            print(f"headroom: attach with `headroom attach {run.name.split('.')[0]}`", flush=True)
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            if run.should_stop:
                break
            batch = windows(data, args.effective_batch, args.seq_len, gen, device)
            loss = run.backward(batch, loss_of)
            run.step(optimizer)
            if rank == 0 and (step % 10 == 0 or step == 1):
                print(
                    f"step {step:4d}  loss {loss:.4f}  micro-batch {run.micro_batch} "
                    f"({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
        done = run.step_count
    print(f"rank {rank}: {done} steps, micro-batch {run.micro_batch}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
