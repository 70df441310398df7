"""Why a fused optimizer makes run.step all-or-nothing: measured, not assumed.

An out-of-memory error can only come from an allocation. The profiler records every
allocation a step makes: a fused optimizer's update allocates no parameter-sized memory
once its state exists (only a few scalars before the kernel, which headroom's undo
covers), while the for-loop and foreach paths allocate temporaries the size of the
parameters after they have begun changing them."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import headroom
from headroom import _torch

from conftest import TinyCNN, cnn_batches


def step_allocations(make_opt) -> list[int]:
    """Bytes of every allocation the third optimizer step makes (state exists by then)."""
    torch.manual_seed(0)
    model = TinyCNN()
    opt = make_opt(model.parameters())
    for i, (x, y) in enumerate(cnn_batches(3, 8)):
        model.loss((x, y)).backward()
        if i < 2:
            opt.step()
        else:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                opt.step()
        opt.zero_grad(set_to_none=True)
    return [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]


SMALLEST_PARAM = min(p.numel() * 4 for p in TinyCNN().parameters())


@pytest.mark.parametrize(
    "name, make",
    [
        ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
        ("Adam", lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True)),
        ("SGD", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True)),
    ],
)
def test_a_fused_update_allocates_nothing_the_size_of_a_parameter(name, make):
    allocs = step_allocations(make)
    assert all(a < SMALLEST_PARAM for a in allocs), (name, allocs)
    assert sum(allocs) <= 256, (name, sum(allocs))


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_the_unfused_adamw_allocates_parameter_sized_temporaries(foreach):
    allocs = step_allocations(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=foreach))
    assert max(allocs) >= SMALLEST_PARAM and sum(allocs) > 10_000, allocs


def test_run_step_says_once_when_the_optimizer_is_not_all_or_nothing(tmp_path):
    from conftest import kinds

    log = tmp_path / "run.jsonl"
    model = TinyCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with headroom.Run("advice", model=model, effective_batch=8, log=log) as run:
        for b in cnn_batches(3, 8):
            run.backward(b, model.loss)
            run.step(opt)
    said = [n["text"] for n in kinds(log, "notice") if "fused=True" in n["text"]]
    assert len(said) == 1 and "all-or-nothing" in said[0], said
    assert _torch.optimizer_advice(torch.optim.AdamW(model.parameters(), fused=True)) is None
