"""Adaptive accumulation learns what one full-batch step learns: same loss, same
parameters, with and without out-of-memory errors on the way."""

from __future__ import annotations

import copy

import pytest
import torch

import headroom
from headroom import _torch

from conftest import TinyCNN, TinyGPT, assert_params_close, cnn_batches, gpt_batches

REL = 1e-5
# A parameter's largest difference from the full-batch step's: float32 rounding of sums
# taken in another order, about 1e-7 here.
TOL = 1e-6


def sgd(params, lr=1e-2):
    # Parameters are compared after SGD with momentum: Adam divides each gradient by its
    # own running scale, so a gradient that is zero in exact arithmetic (the attention's
    # key bias: softmax ignores it) turns its rounding noise into full-size steps, and
    # two exact-to-1e-7 gradient sums give parameters apart by 1%.
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def full_batch_run(model, batches, make_opt=sgd):
    """The reference: one forward and backward over the whole batch per step."""
    opt = make_opt(model.parameters())
    losses = []
    for b in batches:
        loss = model.loss(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def adaptive_run(model, batches, micro, make_opt=sgd, loss_fn=None, name="fidelity", **kw):
    opt = make_opt(model.parameters())
    losses = []
    n = batches[0][0].shape[0]
    with headroom.Run(name, model=model, effective_batch=n, micro_batch=micro, **kw) as run:
        for b in batches:
            losses.append(run.backward(b, loss_fn or model.loss))
            run.step(opt)
    return losses


def assert_same(ref_model, model, ref_losses, losses):
    assert len(ref_losses) == len(losses)
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert abs(a - b) <= REL * abs(a), f"step {i + 1}: loss {b} vs full batch {a}"
    assert_params_close(model, ref_model, TOL)


@pytest.mark.parametrize(
    "make, batches",
    [
        (lambda: TinyGPT(), lambda: gpt_batches(4, 16)),
        (lambda: TinyCNN(), lambda: cnn_batches(4, 18)),
    ],
    ids=["transformer", "cnn"],
)
def test_accumulation_equals_one_full_batch_step(make, batches):
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    bs = batches()
    ref_losses = full_batch_run(ref, bs)
    # 16 and 18 samples in micro-batches of 5: an uneven last micro-batch every step.
    losses = adaptive_run(model, bs, micro=5)
    assert_same(ref, model, ref_losses, losses)


def test_injected_forward_ooms_keep_the_trajectory_and_train_every_sample_once():
    torch.manual_seed(1)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    bs = gpt_batches(5, 16)
    ref_losses = full_batch_run(ref, bs)

    # Batches carry each sample's index; the loss function records the samples whose
    # forward completed, and fails (through the allocator) on chosen calls.
    indexed = [(x, y, torch.arange(x.shape[0])) for x, y in bs]
    calls = {"n": 0}
    fail_on = {2, 3, 9}
    trained: list[list[int]] = []

    def loss_fn(mb):
        calls["n"] += 1
        if calls["n"] in fail_on:
            _torch.provoke_oom(torch.device("cpu"))
        x, y, idx = mb
        loss = model.loss((x, y))
        trained[-1].extend(idx.tolist())
        return loss

    opt = sgd(model.parameters())
    losses = []
    with headroom.Run("oom-forward", model=model, effective_batch=16, micro_batch=6) as run:
        for b in indexed:
            trained.append([])
            losses.append(run.backward(b, loss_fn))
            run.step(opt)
    assert calls["n"] > len(bs) * 3, "the injected failures were not reached"
    for step, ids in enumerate(trained, 1):
        assert sorted(ids) == list(range(16)), f"step {step} trained {sorted(ids)}"
    assert_same(ref, model, ref_losses, losses)


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward asks the allocator for the impossible on chosen calls:
    placed at the input side, the later layers' gradients are already accumulated."""

    calls = 0
    fail_on: set = set()

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _FailInBackward.calls += 1
        if _FailInBackward.calls in _FailInBackward.fail_on:
            _torch.provoke_oom(g.device)
        return g


def test_an_oom_in_backward_after_partial_accumulation_restarts_the_step_exactly(tmp_path):
    torch.manual_seed(2)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    bs = gpt_batches(4, 16)
    ref_losses = full_batch_run(ref, bs)
    _FailInBackward.calls = 0
    _FailInBackward.fail_on = {3, 6}
    model.hook = _FailInBackward.apply
    log = tmp_path / "run.jsonl"
    losses = adaptive_run(model, bs, micro=4, name="oom-backward", log=log)
    assert _FailInBackward.calls > 6
    assert_same(ref, model, ref_losses, losses)
    from conftest import kinds

    ooms = kinds(log, "oom")
    assert len(ooms) == 2, ooms
    restarts = [n for n in kinds(log, "notice") if "start over" in n["text"]]
    assert len(restarts) == 2, restarts


@pytest.mark.parametrize("fused", [False, True], ids=["for-loop", "fused"])
def test_an_oom_while_the_optimizer_creates_its_state_is_undone_and_retried(monkeypatch, fused):
    torch.manual_seed(3)
    ref = TinyCNN()
    model = copy.deepcopy(ref)
    bs = cnn_batches(3, 12)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=fused)  # noqa: E731
    ref_losses = full_batch_run(ref, bs, adamw)
    real = torch.zeros_like
    calls = {"n": 0}

    def failing_zeros_like(*a, **k):
        # AdamW's first step creates exp_avg and exp_avg_sq with zeros_like: the fifth
        # allocation fails, after some parameters' state exists.
        calls["n"] += 1
        if calls["n"] == 5:
            _torch.provoke_oom(torch.device("cpu"))
        return real(*a, **k)

    monkeypatch.setattr(torch, "zeros_like", failing_zeros_like)
    losses = adaptive_run(model, bs, micro=5, make_opt=adamw, name="oom-optimizer")
    assert calls["n"] >= 5
    assert_same(ref, model, ref_losses, losses)


def test_an_oom_after_the_optimizer_changed_parameters_is_refused_loudly(monkeypatch):
    torch.manual_seed(4)
    model = TinyCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    b = cnn_batches(1, 8)[0]
    real_sqrt = torch.Tensor.sqrt
    calls = {"n": 0}

    def failing_sqrt(self, *a, **k):
        # The single-tensor AdamW takes one sqrt per parameter after updating its
        # moments: the second fails with the first parameter already updated.
        calls["n"] += 1
        if calls["n"] == 2:
            _torch.provoke_oom(self.device)
        return real_sqrt(self, *a, **k)

    with headroom.Run("oom-partial", model=model, effective_batch=8) as run:
        run.backward(b, model.loss)
        monkeypatch.setattr(torch.Tensor, "sqrt", failing_sqrt)
        with pytest.raises(headroom.OptimizerStepFailed, match="cannot be undone"):
            run.step(opt)
