"""Bad use gets one clear error naming the problem and the fix."""

from __future__ import annotations

import math

import pytest
import torch

import headroom

from conftest import TinyCNN, Viewer, cnn_batches, kinds


def adaptive(name="errors", **kw):
    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = headroom.Run(name, model=model, effective_batch=8, **kw)
    return model, opt, run


def test_tensors_that_disagree_on_dim_0_are_refused_by_name():
    model, opt, run = adaptive()
    x, y = cnn_batches(1, 8)[0]
    with pytest.raises(headroom.BatchError, match=r"batch\[0\] has 8 samples, batch\[1\] has 7"):
        run.backward((x, y[:7]), model.loss)
    with pytest.raises(headroom.BatchError, match=r"batch\['y'\] has 6"):
        run.backward({"x": x, "y": y[:6]}, lambda b: model.loss((b["x"], b["y"])))
    with pytest.raises(headroom.BatchError, match="holds no tensor"):
        run.backward([1, 2, 3], model.loss)
    # Nothing was accumulated by the refusals: a good batch goes through.
    run.backward((x, y), model.loss)
    run.step(opt)
    run.finish()


def test_a_loss_that_is_not_a_scalar_with_a_graph_is_refused():
    model, opt, run = adaptive()
    b = cnn_batches(1, 8)[0]
    per_sample = lambda mb: torch.nn.functional.cross_entropy(  # noqa: E731
        model(mb[0]), mb[1], reduction="none"
    )
    with pytest.raises(headroom.LossError, match=r"shape \(\d+,\).*\.mean\(\)"):
        run.backward(b, per_sample)
    with pytest.raises(headroom.LossError, match="returned float"):
        run.backward(b, lambda mb: model.loss(mb).item())
    with pytest.raises(headroom.LossError, match="does not require grad"):
        run.backward(b, lambda mb: model.loss(mb).detach())
    run.finish()


def test_a_nan_loss_stops_the_step_before_the_optimizer_sees_it():
    model, opt, run = adaptive()
    x, y = cnn_batches(1, 8)[0]
    x[3, 0, 0, 0] = math.nan
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(headroom.LossError, match="nan"):
        run.backward((x, y), model.loss)
    assert all(p.grad is None for p in model.parameters()), "the NaN gradients were kept"
    # The user's step never ran; the parameters are untouched; the run can go on.
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)
    run.backward(cnn_batches(1, 8)[0], model.loss)
    run.step(opt)
    run.finish()


def test_backward_twice_or_step_without_backward_is_refused():
    model, opt, run = adaptive()
    b = cnn_batches(1, 8)[0]
    with pytest.raises(headroom.RunError, match=r"without run.backward"):
        run.step(opt)
    run.backward(b, model.loss)
    with pytest.raises(headroom.RunError, match="called twice without run.step"):
        run.backward(b, model.loss)
    run.step(opt)
    with pytest.raises(headroom.RunError, match="adaptive: its steps end with run.step"):
        run.report(1.0)
    run.finish()


def test_watch_only_runs_refuse_backward_and_adaptive_ones_need_a_model():
    run = headroom.Run("watch")
    with pytest.raises(headroom.RunError, match="needs an adaptive run"):
        run.backward(torch.zeros(4, 2), lambda mb: mb.sum())
    run.finish()
    with pytest.raises(headroom.RunError, match="needs model="):
        headroom.Run("no-model", effective_batch=8)


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="thresholds"):
        headroom.Run("t", thresholds="0.9,0.5,0.95,0.99")
    with pytest.raises(ValueError, match="profile"):
        headroom.Run("t", profile="reckless")
    with pytest.raises(
        ValueError, match="memory_budget 1.00 MiB is below what this process already holds"
    ):
        headroom.Run("t", memory_budget="1MiB")
    with pytest.raises(ValueError, match="needs a memory_budget"):
        headroom.Run("t", hard_limit=True)
    with pytest.raises(ValueError, match="listen"):
        headroom.Run("t", listen="not-a-port")
    with pytest.raises(ValueError, match="effective_batch=0"):
        headroom.Run("t", model=TinyCNN(), effective_batch=0)
    with pytest.raises(ValueError, match="sharded_accumulation='each': give \"hold\""):
        headroom.Run("t", sharded_accumulation="each")
    # None of the refusals left a run active.
    headroom.Run("after").finish()


def test_a_dashboard_that_dies_does_not_stop_training(runtime_dir, tmp_path):
    log = tmp_path / "run.jsonl"
    model, opt, run = adaptive(name="dead-viewer", log=log)
    batches = cnn_batches(30, 8)
    v = Viewer(run.socket)
    v.until(lambda r: r["kind"] == "caught_up")
    for i, b in enumerate(batches):
        run.backward(b, model.loss)
        run.step(opt)
        if i == 5:
            # The viewer vanishes without a word (a killed `headroom attach`).
            v.sock.shutdown(2)
            v.close()
    # A viewer that says hello and then never reads is no trouble either.
    stuck = Viewer(run.socket)
    for b in batches[:5]:
        run.backward(b, model.loss)
        run.step(opt)
    run.finish()
    stuck.close()
    assert run.step_count == 35
    assert kinds(log, "finished")[0]["steps_done"] == 35


def test_an_error_mid_step_leaves_no_gradient_behind():
    model, opt, run = adaptive(micro_batch=2)
    b = cnn_batches(1, 8)[0]
    calls = {"n": 0}

    def flaky(mb):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("a bad sample")
        return model.loss(mb)

    with pytest.raises(ValueError, match="a bad sample"):
        run.backward(b, flaky)
    assert calls["n"] == 3, "two micro-batches had completed"
    assert all(p.grad is None for p in model.parameters()), "half a step's gradients kept"
    run.backward(b, model.loss)
    run.step(opt)
    run.finish()
