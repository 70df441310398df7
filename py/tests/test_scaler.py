"""PyTorch's own mixed precision through an adaptive run: a torch.amp.GradScaler given
to run.backward / run.step keeps its semantics (each micro-batch's loss scaled, one
unscale before clipping, a step skipped on inf/NaN gradients), and the run learns what
the same loop without headroom learns; a backward of the user's choosing is called for
every micro-batch."""

from __future__ import annotations

import copy

import pytest
import torch

import headroom
from headroom import _torch

from conftest import TinyGPT, assert_params_close, gpt_batches, kinds

REL = 1e-5
# A parameter's largest difference from the reference loop's (float32 rounding).
TOL = 1e-6


class _Poison(torch.autograd.Function):
    """Identity whose backward turns the gradient to inf during chosen steps (an
    overflow, as fp16 gives), and asks the allocator for the impossible on chosen calls
    (a real out-of-memory error in backward, after later layers' gradients were added)."""

    step = 0
    inf_steps: set = set()
    calls = 0
    oom_calls: set = set()

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Poison.calls += 1
        if _Poison.calls in _Poison.oom_calls:
            _torch.provoke_oom(g.device)
        if _Poison.step in _Poison.inf_steps:
            return g * float("inf")
        return g


def _poisoned(inf_steps=(), oom_calls=()):
    _Poison.step, _Poison.calls = 0, 0
    _Poison.inf_steps, _Poison.oom_calls = set(inf_steps), set(oom_calls)
    torch.manual_seed(0)
    model = TinyGPT()
    model.hook = _Poison.apply
    return model


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def reference(model, batches, micro, autocast=None):
    """The loop without headroom: micro-batches of `micro`, each loss weighted by its
    share and scaled, unscale once, clip, scaler.step, scaler.update."""
    opt = _sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    losses, scales = [], []
    for step, (x, y) in enumerate(batches, 1):
        _Poison.step = step
        n, total = x.shape[0], 0.0
        for i in range(0, n, micro):
            with autocast or _nothing():
                loss = model.loss((x[i : i + micro], y[i : i + micro]))
            w = min(micro, n - i) / n
            scaler.scale(loss * w).backward()
            total += float(loss.detach()) * w
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        scales.append(scaler.get_scale())
    return losses, scales


def with_headroom(model, batches, micro, log, autocast=None, **kw):
    opt = _sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    losses, scales = [], []

    def loss_fn(mb):
        with autocast or _nothing():
            return model.loss(mb)

    n = batches[0][0].shape[0]
    with headroom.Run(
        "scaler", model=model, effective_batch=n, micro_batch=micro, log=log, **kw
    ) as run:
        for step, b in enumerate(batches, 1):
            _Poison.step = step
            losses.append(run.backward(b, loss_fn, scaler=scaler))
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            run.step(opt, scaler=scaler)
            scales.append(scaler.get_scale())
    return losses, scales


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_a_step_the_scaler_skips_is_skipped_said_and_kept_from_the_controller(tmp_path):
    batches = gpt_batches(4, 12)
    ref = _poisoned(inf_steps={2})
    model = copy.deepcopy(ref)
    ref_losses, ref_scales = reference(ref, batches, micro=12)
    _Poison.step, _Poison.calls = 0, 0
    log = tmp_path / "run.jsonl"
    # Micro-batches of 5 against one full-batch backward: the same gradients, scaled.
    losses, scales = with_headroom(model, batches, micro=5, log=log, adaptive=False)
    assert scales == ref_scales and scales[1] == scales[0] / 2, scales
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= REL * abs(a)
    assert_params_close(model, ref, TOL)
    skipped = [n for n in kinds(log, "notice") if "skipped the optimizer step" in n["text"]]
    assert len(skipped) == 1 and skipped[0]["text"].startswith("step 2:"), skipped
    # The skipped step is sent (its loss is real) but its peak is not the controller's.
    assert [s["step"] for s in kinds(log, "step")] == [1, 2, 3, 4]
    assert [m["step"] for m in kinds(log, "step_memory")] == [1, 3, 4]


def test_an_oom_mid_step_under_the_scaler_learns_what_the_loop_without_one_learns(tmp_path):
    batches = gpt_batches(4, 12)
    ref = _poisoned(inf_steps={3})
    model = copy.deepcopy(ref)
    ref_losses, ref_scales = reference(ref, batches, micro=12)
    # Backward calls 2 and 7 fail: each after the head's gradients were already added,
    # so the step's samples start over with a smaller micro-batch.
    _Poison.step, _Poison.calls, _Poison.oom_calls = 0, 0, {2, 7}
    log = tmp_path / "run.jsonl"
    losses, scales = with_headroom(model, batches, micro=6, log=log)
    assert _Poison.calls > 7
    assert len(kinds(log, "oom")) == 2
    assert scales == ref_scales
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= REL * abs(a)
    assert_params_close(model, ref, TOL)


def _cpu_fp16_autocast():
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
    except (RuntimeError, AssertionError) as e:  # pragma: no cover - old torch
        pytest.skip(f"this torch has no float16 autocast on the CPU: {e}")
    return torch.autocast("cpu", dtype=torch.float16)


def test_fp16_autocast_with_the_scaler_matches_the_same_loop_without_headroom(tmp_path):
    autocast = _cpu_fp16_autocast()
    batches = gpt_batches(3, 12)
    ref = _poisoned(inf_steps={2})
    model = copy.deepcopy(ref)
    # The same micro-batches (adaptive=False keeps 4): fp16 rounds the same way.
    ref_losses, ref_scales = reference(ref, batches, micro=4, autocast=autocast)
    _Poison.step = 0
    losses, scales = with_headroom(
        model, batches, micro=4, log=tmp_path / "run.jsonl", autocast=autocast, adaptive=False
    )
    assert scales == ref_scales and scales[1] < scales[0]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_params_close(model, ref, TOL / 10)


def test_a_backward_of_the_users_choosing_runs_for_every_micro_batch():
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    batches = gpt_batches(2, 10)
    seen = []

    def backward(weighted):
        seen.append(float(weighted.detach()))
        (weighted * 2).backward()  # a backward that does something of its own

    opt_ref, opt = _sgd(ref), _sgd(model)
    for x, y in batches:
        (ref.loss((x, y)) * 2).backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
    with headroom.Run("hook", model=model, effective_batch=10, micro_batch=4) as run:
        for b in batches:
            run.backward(b, model.loss, backward=backward)
            run.step(opt)
    assert len(seen) == 6, seen  # 4 + 4 + 2 per step, two steps
    assert_params_close(model, ref, TOL)
