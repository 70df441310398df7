"""One rank of a Lightning fit with headroom.lightning.Adaptive under torchrun
(test_lightning.py): strategy="ddp" on gloo, a distributed sampler in order (rank r gets
every other sample of each global batch), out-of-memory errors from the real allocator
on one rank. Saves each rank's parameters."""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import lightning_models
import torch
from lightning_models import FixedGPT, TinyAdaptive, loader

import headroom.lightning
from headroom import _torch

from conftest import die_with_parent


def main() -> int:
    die_with_parent()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--oom-rank", type=int, default=1)
    args = ap.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    ref = FixedGPT()  # the test's reference starts from the same weights
    model = TinyAdaptive()
    model.load_state_dict(copy.deepcopy(ref.state_dict()))
    calls = {"n": 0}

    def fail_some(h):
        calls["n"] += 1
        if rank == args.oom_rank and calls["n"] in (2, 6):
            _torch.provoke_oom(h.device)
        return h

    model.net.hook = fail_some
    cb = headroom.lightning.Adaptive(log=out / f"rank{rank}.jsonl", micro_batch=3)
    trainer = lightning_models.trainer(
        out / "fit",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        callbacks=[cb],
        use_distributed_sampler=False,
    )
    # Rank r takes every other sample of each global batch of 16, in order (Lightning's
    # own sampler would shuffle them).
    data = loader(4, 16).dataset
    world = int(os.environ["WORLD_SIZE"])
    sampler = torch.utils.data.DistributedSampler(data, world, rank, shuffle=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler))
    torch.save(model.state_dict(), out / ("params.pt" if rank == 0 else f"params-rank{rank}.pt"))
    (out / f"done-rank{rank}.json").write_text(json.dumps({"steps": trainer.global_step}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
