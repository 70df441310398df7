"""Compiled and wrapped models: `headroom.Run(model=torch.compile(model))` takes the
compiled module (which has no `len()`) as its model; a compiled model in adaptive mode
trains through micro-batches of several sizes with the batch dimension marked dynamic, so
the sizes share one compiled graph (counted)."""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters

import headroom

from conftest import TinyGPT, gpt_batches, kinds


def _parameters_logged(log) -> int:
    (started,) = kinds(log, "run_started")
    return started["parameters"]


class NoLen(torch.nn.Module):
    """A wrapper like torch.compile's or DDP's: the module is inside, and len() fails."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner

    def __len__(self):
        raise TypeError(f"{type(self).__name__} does not support len()")

    def forward(self, x):
        return self.module(x)


@pytest.mark.parametrize(
    "wrap",
    [
        torch.compile,  # lazy: nothing compiles until it is called
        NoLen,
        lambda m: torch.nn.Sequential(m),
        lambda m: torch.nn.ModuleDict({"gpt": m}),
        lambda m: torch.nn.ModuleList([m]),
    ],
    ids=["compiled", "no-len wrapper", "Sequential", "ModuleDict", "ModuleList"],
)
def test_wrapped_models_are_counted_not_asked_their_length(wrap, tmp_path):
    model = TinyGPT()
    total = sum(p.numel() for p in model.parameters())
    log = tmp_path / "run.jsonl"
    with headroom.Run("wrapped", model=wrap(model), effective_batch=8, log=log) as run:
        assert len(run._params) == len(list(model.parameters()))
    assert _parameters_logged(log) == total


@pytest.mark.skipif(os.environ.get("HEADROOM_SKIP_COMPILE") == "1", reason="asked to skip")
def test_a_compiled_model_trains_adaptively_across_sizes_on_one_graph(tmp_path):
    torch.manual_seed(0)
    torch._dynamo.reset()
    # Small enough that inductor's C++ compile stays a few seconds on a busy CPU.
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    compiled = torch.compile(model, backend="inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sizes = []

    def loss_of(mb):
        x, y = mb
        sizes.append(x.shape[0])
        logits = compiled(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    before = counters["stats"]["unique_graphs"]
    # 12 per step from micro-batch 5: 5, 5, 2, then whatever the controller grows to.
    with headroom.Run(
        "compiled", model=compiled, effective_batch=12, micro_batch=5, min_micro_batch=2
    ) as run:
        for batch in gpt_batches(4, 12):
            run.backward(batch, loss_of)
            run.step(opt)
    graphs = counters["stats"]["unique_graphs"] - before
    distinct = sorted(set(sizes))
    assert len(distinct) >= 2, sizes
    # One graph for every size ≥ 2; a micro-batch of 1 (an uneven remainder) would be
    # specialised by dynamo and compile its own.
    assert graphs == 1 + (1 in distinct), (graphs, sizes)
