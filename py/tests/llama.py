"""A small Llama written the way torchtitan's is (RMSNorm, rotary position embeddings,
SwiGLU feed-forward, scaled-dot-product attention, an untied output head), sharded the way
torchtitan's ``parallelize`` shards it: ``fully_shard`` on each block and on the root, with
the root's parameters kept gathered after forward. Random weights from a config; nothing
is downloaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    hidden: int = 172  # SwiGLU's: about 8/3 of dim, as Llama's
    seq: int = 32
    eps: float = 1e-5
    tied: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq: int, theta: float = 10000.0) -> tuple[torch.Tensor, ...]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, heads, seq, head_dim), pairs interleaved as Llama's."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads = c.heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.dim, bias=False)
        self.wv = nn.Linear(c.dim, c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = (
            w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        # A ModuleDict keyed by layer number, as torchtitan's (its checkpoints' keys).
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.layers)})
        self.norm = RMSNorm(c.dim, c.eps)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        if c.tied:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(c.dim // c.heads, c.seq)
        # Not persistent, as torchtitan's freqs_cis: not in the checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def build(c: LlamaConfig, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(c)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                nn.init.trunc_normal_(p, std=0.02)
    return model


def shard(
    model: Llama,
    block_reshard: bool | int = True,
    root_reshard: bool | int = False,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> Llama:
    """torchtitan's FSDP2 layout: each block its own unit (``reshard_after_forward`` per
    policy), then the root (the embedding, the final norm and the head) kept gathered
    after forward, both under one MixedPrecisionPolicy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.layers.values():
        fully_shard(layer, mp_policy=mp, reshard_after_forward=block_reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=root_reshard)
    return model


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """torchtitan's clipping: the total norm over the DTensor gradients (a collective:
    each rank's shards' norms reduced), made a plain tensor, then every gradient scaled."""
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, False, True)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, True)
    return total


def cosine_schedule(optimizer, warmup: int, total: int):
    """A linear warm-up then a cosine decay to a tenth, as torchtitan's default."""
    import math

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
