"""The benchmarks' model and data: a byte-level GPT shaped like headroom's default
config (configs/default.toml: 4 layers, 4 heads, n_embd 128, seq_len 64, vocab 256, head
tied to the token embedding; no dropout, as the Rust trainer's model has none): the
example's model (examples/python/nanogpt.py), and seeded random token batches."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

# The model is the example's own (examples/python/nanogpt.py), so what is measured is what
# a user runs.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "python"))
from nanogpt import GPT, VOCAB, evaluate  # noqa: E402, F401


def make_model(
    seed: int, seq_len: int = 64, n_layer: int = 4, n_head: int = 4, n_embd: int = 128
) -> GPT:
    torch.manual_seed(seed)
    return GPT(seq_len, n_layer, n_head, n_embd, dropout=0.0)


def make_hf_model(
    seed: int, seq_len: int = 64, n_layer: int = 4, n_head: int = 4, n_embd: int = 128
):
    """transformers' own GPT2LMHeadModel of the same shape, from a config (random
    weights, nothing downloaded), with the same `loss((inputs, targets))` for evaluation
    and warm-up; the Trainer computes its training loss from `labels`."""
    import transformers

    class HFGPT(transformers.GPT2LMHeadModel):
        def loss(self, batch):
            x, y = batch
            logits = self(input_ids=x).logits
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    return HFGPT(cfg)


def make_optimizer(model: nn.Module, lr: float = 3e-3) -> torch.optim.AdamW:
    # The default config's AdamW (no schedule, no clipping: the same in every mode).
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)


def token_batches(
    steps: int, n: int, seq_len: int = 64, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of `n` random byte sequences: (inputs, inputs shifted by one)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        w = torch.randint(0, VOCAB, (n, seq_len + 1), generator=g)
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out
