"""An AdaptiveModule fit for test_lightning.py's stop signal: 5 batches of 8, cut into
micro-batches of at most 2, a sleep in each (--sleep) so a signal lands inside a batch;
or, with --resume, the same fit taken up from a checkpoint, fast. Saves the parameters
when it completes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from lightning_models import TinyAdaptive, loader, trainer

import headroom.lightning

from conftest import die_with_parent, signalled_args


class Slow(TinyAdaptive):
    sleep = 0.0

    def micro_batch_loss(self, batch):
        if self.sleep:
            print("forward", flush=True)  # the test counts these to signal mid-batch
            time.sleep(self.sleep)
        return super().micro_batch_loss(batch)


def main() -> int:
    die_with_parent()
    a = signalled_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Slow()
    model.sleep = a.sleep
    cb = headroom.lightning.Adaptive(log=a.log, micro_batch=2, max_micro_batch=2)
    trainer(a.out, callbacks=[cb]).fit(model, loader(5, 8), ckpt_path=a.resume)
    torch.save(model.state_dict(), Path(a.out) / "params.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
