"""Tiny LightningModules over conftest's TinyGPT: one trained the stock way (automatic
optimization, the whole batch at once) and one adaptive (headroom.lightning's
AdaptiveModule), with the same optimizer; and their data."""

from __future__ import annotations

import lightning as L
import torch

import headroom.lightning

from conftest import TinyGPT, gpt_batches


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class FixedGPT(L.LightningModule):
    def __init__(self, **gpt):
        super().__init__()
        self.net = TinyGPT(**gpt)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.net.loss(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net.loss(batch))

    def configure_optimizers(self):
        return _optimizer(self.parameters())


class TinyAdaptive(headroom.lightning.AdaptiveModule):
    def __init__(self, **gpt):
        super().__init__()
        self.net = TinyGPT(**gpt)

    def micro_batch_loss(self, batch):
        return self.net.loss(batch)

    def configure_optimizers(self):
        return _optimizer(self.parameters())


class _Batches(torch.utils.data.Dataset):
    def __init__(self, batches):
        self.x = torch.cat([x for x, _ in batches])
        self.y = torch.cat([y for _, y in batches])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def loader(steps: int, n: int, seed: int = 0, t: int = 16, vocab: int = 64):
    """`steps` batches of `n` sequences, in order (the same batches every run)."""
    data = _Batches(gpt_batches(steps, n, t=t, vocab=vocab, seed=seed))
    return torch.utils.data.DataLoader(data, batch_size=n, shuffle=False)


def trainer(root, **kw) -> L.Trainer:
    """A quiet CPU Trainer writing under `root`; keyword arguments override."""
    base = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
    )
    base.update(kw)
    return L.Trainer(**base)
