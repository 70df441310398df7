"""A LightningModule trained with headroom choosing its micro-batches: a byte-level
causal transformer on the bundled Tiny Shakespeare. The module subclasses
`headroom.lightning.AdaptiveModule` and defines `micro_batch_loss` (a micro-batch's mean
loss) where a stock module defines `training_step`; the Trainer gets the
`headroom.lightning.Adaptive()` callback. Each loader batch is one optimizer step, cut
into micro-batches that grow while memory allows, shrink before it runs out, and are
retried smaller after an out-of-memory error, without restarting the fit.

Run it from the repository root, in the environment that has your torch and lightning,
after `pip install ./py`:

    python examples/python/lightning_module.py --steps 30
    headroom attach                           # in another terminal

    python examples/python/lightning_module.py --memory-budget 1.2GiB --hard-limit \\
        --batch 128 --steps 10 --log /tmp/pl.jsonl     # a real capped run on the CPU

--watch-only trains the same model the stock way (automatic optimization) with
`headroom.lightning.Watch()`: watched and steered, its batches its own. The dashboard's
checkpoint and stop save through `trainer.save_checkpoint` (resume with --resume PATH).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import headroom
import headroom.lightning

CORPUS = Path(__file__).resolve().parents[2] / "assets" / "tinyshakespeare.txt"


class ByteGPT(nn.Module):
    def __init__(self, seq_len: int, d: int, layers: int, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 256)

    def forward(self, x):
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        h = self.blocks(self.tok(x) + self.pos[:t], mask=mask, is_causal=True)
        return self.head(h)


def loss_of(net, batch):
    x, y = batch
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten())


def optimizer_of(module, lr):
    return torch.optim.AdamW(module.parameters(), lr=lr, fused=True)


class Adaptive(headroom.lightning.AdaptiveModule):
    def __init__(self, seq_len=128, d=128, layers=4, lr=1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = ByteGPT(seq_len, d, layers)

    def micro_batch_loss(self, batch):  # in place of training_step
        return loss_of(self.net, batch)

    def configure_optimizers(self):
        return optimizer_of(self, self.hparams.lr)


class Stock(L.LightningModule):
    def __init__(self, seq_len=128, d=128, layers=4, lr=1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = ByteGPT(seq_len, d, layers)

    def training_step(self, batch, batch_idx):
        return loss_of(self.net, batch)

    def configure_optimizers(self):
        return optimizer_of(self, self.hparams.lr)


def windows(n: int, seq_len: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq_len - 1, (n,), generator=g)
    w = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return torch.utils.data.TensorDataset(w[:, :-1], w[:, 1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32, help="samples per optimizer step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=None, help="where headroom starts")
    ap.add_argument("--memory-budget", default=None)
    ap.add_argument("--hard-limit", action="store_true")
    ap.add_argument("--log", default=None)
    ap.add_argument("--out", default="runs/lightning_module")
    ap.add_argument("--resume", default=None, help="a .ckpt to resume from")
    ap.add_argument("--watch-only", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(0)
    kw = dict(log=args.log, memory_budget=args.memory_budget, hard_limit=args.hard_limit)
    if args.watch_only:
        module, callback = Stock(args.seq_len), headroom.lightning.Watch(**kw)
    else:
        module = Adaptive(args.seq_len)
        callback = headroom.lightning.Adaptive(micro_batch=args.micro_batch, **kw)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=args.out,
        callbacks=[callback],
    )
    data = windows(args.batch * args.steps, args.seq_len)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True)
    trainer.fit(module, loader, ckpt_path=args.resume)
    print(f"trained {trainer.global_step} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
