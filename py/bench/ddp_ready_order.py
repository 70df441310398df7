"""How much of a DDP job's gradient all-reduce can start before the last backward ends,
with headroom's first bucket layout (reverse registration order) and with the layout
redone in the order the gradients came (headroom._overlap.Overlap.relayout, after the
first step, as DDP rebuilds its buckets after its first iteration).

Run from the repository root (CPU, one process; transformers' models are built from a
config with random weights, nothing is downloaded):

    ./dev bench-python py/bench/ddp_ready_order.py

For each model, one backward records the order its parameters' gradients are ready in
(``register_post_accumulate_grad_hook``, the hook headroom launches buckets from). Each
layout at DDP's 25 MiB buckets (the first up to 1 MiB) is then replayed against that
order: a bucket goes once all of its gradients are ready, and in order. Printed per
model and layout: the buckets, and the share of the gradients' bytes whose all-reduce
is launched before the last gradient comes (what can hide inside the backward; the rest
is paid after it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "python"))

from headroom import _overlap  # noqa: E402

CAP = 25 << 20


def ready_order(model: nn.Module, loss) -> list[int]:
    params = [p for p in model.parameters() if p.requires_grad]
    order: list[int] = []
    hooks = [
        p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))
        for i, p in enumerate(params)
    ]
    try:
        loss().backward()
    finally:
        for h in hooks:
            h.remove()
    return order


def early_share(buckets: list[_overlap.Bucket], order: list[int], params) -> float:
    """The bytes launched before the last gradient comes, over all of them."""
    arrived = {i: k for k, i in enumerate(order)}
    last = len(order) - 1
    early = total = 0
    nxt = 0
    # The arrival at which each bucket can go: its last gradient's, and not before the
    # bucket ahead of it (launched in order).
    for b in buckets:
        at = max(arrived.get(i, last) for i in b.params)
        nxt = max(nxt, at)
        nbytes = b.numel * params[b.params[0]].element_size()
        total += nbytes
        if nxt < last:
            early += nbytes
    return early / total


class EmbeddingLast(nn.Module):
    """Eight 1024-wide blocks, then the embedding they read, registered after them (as
    some code bases do): reverse registration order puts it first, its gradient comes
    last."""

    def __init__(self, vocab: int = 32000, d: int = 1024, layers: int = 8):
        super().__init__()
        self.blocks = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                for _ in range(layers)
            )
        )
        self.head = nn.Linear(d, vocab)
        self.emb = nn.Embedding(vocab, d)

    def loss(self, batch):
        x, y = batch
        logits = self.head(self.blocks(self.emb(x)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def models():
    from nanogpt import GPT

    yield "embedding registered last", EmbeddingLast(), "gpt"

    torch.manual_seed(0)
    yield "nanoGPT example (4 x 128)", GPT(64, 4, 4, 128, dropout=0.0), "gpt"
    import transformers as tf

    yield (
        "GPT-2 124M",
        tf.GPT2LMHeadModel(tf.GPT2Config(n_positions=64)),
        "hf",
    )
    yield (
        "BERT base (MLM)",
        tf.BertForMaskedLM(tf.BertConfig(max_position_embeddings=64)),
        "hf",
    )
    yield (
        "T5 small",
        tf.T5ForConditionalGeneration(tf.T5Config(decoder_start_token_id=0, pad_token_id=0)),
        "hf",
    )
    yield (
        "Llama (8 x 1024, GQA)",
        tf.LlamaForCausalLM(
            tf.LlamaConfig(
                hidden_size=1024,
                intermediate_size=2816,
                num_hidden_layers=8,
                num_attention_heads=16,
                num_key_value_heads=4,
                vocab_size=32000,
                max_position_embeddings=64,
            )
        ),
        "hf",
    )


def loss_of(model, kind: str):
    x = torch.randint(0, 200, (1, 32))
    if kind == "gpt":
        return lambda: model.loss((x, x))
    return lambda: model(input_ids=x, labels=x).loss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="models whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"{'model':28} {'MB':>6}  {'layout':24} {'buckets':>7} {'launched early':>14}")
    for name, model, kind in models():
        if args.only and args.only.lower() not in name.lower():
            continue
        params = [p for p in model.parameters() if p.requires_grad]
        order = ready_order(model, loss_of(model, kind))
        mb = sum(p.numel() * p.element_size() for p in params) / 1e6
        first = _overlap.layout(params, CAP)
        slot, _ = _overlap.ring_sizes(params, first, CAP)
        again = _overlap.relaid(params, CAP, _overlap.full_order(order, len(params)), slot)
        for label, buckets in (("reverse registration", first), ("ready order (relaid)", again)):
            share = early_share(buckets, order, params)
            print(f"{name:28} {mb:6.0f}  {label:24} {len(buckets):7d} {share:13.1%}")
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
