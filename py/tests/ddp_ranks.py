"""One rank of a torchrun job (test_torchrun.py): watches its own steps on its own
stream (each report joins the job's agreement, so rank 0 serves every rank's row), holds
until told, then tries adaptive mode with a model it cannot make safe (refused: one not
wrapped in DDP nor sharded with FSDP2, and an FSDP2 unit below a plain module) and with
FSDP2 given at its root (trained)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import headroom

from conftest import TinyCNN, cnn_batches, die_with_parent, say


def main() -> int:
    die_with_parent()  # a rank never outlives its torchrun
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", required=True, help="a file whose existence ends the hold")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(TinyCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = Path(args.release).parent / f"watch-rank{rank}.jsonl"
    with headroom.Run("ddp", model=model.module, log=log) as run:
        for b in cnn_batches(3, 8, seed=rank):
            loss = torch.nn.functional.cross_entropy(model(b[0]), b[1])
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.report(loss, samples=8)
        say(f"rank {rank} serving {run.name}")
        deadline = time.monotonic() + 120
        while not Path(args.release).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    try:
        with headroom.Run("ddp-adaptive", model=model.module, effective_batch=8) as run:
            run.backward(cnn_batches(1, 8)[0], model.module.loss)
    except headroom.RunError as e:
        say(f"rank {rank} refused plain: {e}")
    try:
        from torch.distributed.fsdp import fully_shard

        sharded = TinyCNN()
        fully_shard(sharded)
    except Exception as e:  # an FSDP2 this torch cannot build on a CPU: nothing to refuse
        say(f"rank {rank} no fsdp: {type(e).__name__}: {e}")
    else:
        # FSDP2 given at its root trains (its collectives gated); a unit below a model
        # that is not one is refused, naming the root.
        sharded_opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
        with headroom.Run("fsdp-adaptive", model=sharded, effective_batch=8) as run:
            run.backward(cnn_batches(1, 8)[0], sharded.loss)
            run.step(sharded_opt)
        say(f"rank {rank} trained fsdp: {run.step_count} step")
        try:
            headroom.Run("fsdp-inner", model=torch.nn.Sequential(sharded), effective_batch=8)
        except headroom.RunError as e:
            say(f"rank {rank} refused fsdp: {e}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
