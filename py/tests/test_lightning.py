"""headroom.lightning with the real Lightning: the watch callback on the stream with the
dashboard's commands carried out Lightning's way (trainer.save_checkpoint, a resume
through fit(ckpt_path=)), the adaptive module learning what a fixed-batch module
learns, a real OOM under a hard cap recovered without a restart, and Fabric's own
backward through run.backward."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning_models import FixedGPT, TinyAdaptive, loader, trainer  # noqa: E402

import headroom  # noqa: E402
import headroom.lightning  # noqa: E402
from headroom import _torch  # noqa: E402

from conftest import (  # noqa: E402
    TinyGPT,
    assert_params_close,
    finish,
    gpt_batches,
    kinds,
    records,
    resume_from,
    sigterm_inside_a_step,
    spawn,
    steer,
    torchrun,
)

HERE = Path(__file__).resolve().parent
# A parameter's largest difference from the fixed-batch fit's (float32 rounding).
TOL = 1e-6


def test_the_adaptive_module_learns_what_a_fixed_batch_module_learns(tmp_path):
    torch.manual_seed(0)
    ref = FixedGPT()
    model = TinyAdaptive()
    model.load_state_dict(copy.deepcopy(ref.state_dict()))
    trainer(tmp_path / "ref").fit(ref, loader(4, 16))
    calls = {"n": 0}

    def fail_some(h):
        calls["n"] += 1
        if calls["n"] in (2, 6):
            _torch.provoke_oom(h.device)
        return h

    model.net.hook = fail_some
    log = tmp_path / "adapt.jsonl"
    cb = headroom.lightning.Adaptive(log=log, micro_batch=5)
    t = trainer(tmp_path / "adapt", callbacks=[cb])
    t.fit(model, loader(4, 16))
    assert t.global_step == 4
    assert len(kinds(log, "oom")) == 2
    assert min(m["micro_batch"] for m in kinds(log, "step_memory")) < 16
    assert_params_close(model, ref, TOL)


class _Slow(L.pytorch.Callback):
    def on_train_batch_end(self, *a):
        time.sleep(0.02)  # batches slow enough for the viewer to act mid-run


@pytest.mark.parametrize("mode", ["watch", "adaptive"])
def test_the_dashboards_checkpoint_and_stop_go_through_lightnings_save_and_resume(tmp_path, mode):
    log = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    if mode == "watch":
        model, cb = FixedGPT(), headroom.lightning.Watch(log=log)
    else:
        model, cb = TinyAdaptive(), headroom.lightning.Adaptive(log=log)
    answers, errors = {}, []
    th = threading.Thread(
        target=steer, args=(lambda: cb.run, ["checkpoint", "stop"], answers, errors)
    )
    th.start()
    t = trainer(tmp_path, callbacks=[cb, _Slow()], max_steps=300)
    t.fit(model, loader(300, 8))
    th.join(timeout=60)
    assert not errors, errors
    stopped_at = t.global_step
    assert 3 <= stopped_at < 300, "the stop did not end the fit"
    recs = records(log)
    assert recs[-1]["kind"] == "finished" and recs[-1]["stopped_by_user"]
    saved = sorted(tmp_path.glob("headroom-step=*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert len(saved) == 2, saved
    assert saved[-1].name == f"headroom-step={stopped_at}.ckpt"
    told = [r["path"] for r in recs if r["kind"] == "checkpoint_saved"]
    assert told == [str(p) for p in saved]
    assert str(saved[0]) in answers["checkpoint"]["applied"] or answers["checkpoint"]
    # Lightning's own resume takes the stop's checkpoint up.
    again = type(model)()
    cb2 = (headroom.lightning.Watch if mode == "watch" else headroom.lightning.Adaptive)()
    t2 = trainer(tmp_path / "again", callbacks=[cb2], max_steps=stopped_at + 2)
    t2.fit(again, loader(300, 8), ckpt_path=str(saved[-1]))
    assert t2.global_step == stopped_at + 2


def test_watch_streams_each_batch_with_lightnings_figures(tmp_path):
    log = tmp_path / "watch.jsonl"
    torch.manual_seed(0)
    model = FixedGPT()
    cb = headroom.lightning.Watch("pl-watch", log=log)
    t = trainer(tmp_path, callbacks=[cb], limit_val_batches=2, val_check_interval=3)
    t.fit(model, loader(6, 8), loader(2, 8, seed=1))
    steps = kinds(log, "step")
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert all(s["effective_batch"] == 8 and s["seq_len"] == 16 for s in steps)
    assert [round(s["loss"], 5) for s in steps] == [round(x, 5) for x in model.losses]
    assert steps[0]["lr"] == pytest.approx(0.05)
    assert [e["step"] for e in kinds(log, "eval")] == [3, 6]
    assert records(log)[-1]["kind"] == "finished"


def test_the_adaptive_module_recovers_a_real_oom_under_a_hard_cap(tmp_path):
    log = tmp_path / "capped.jsonl"
    p = spawn([str(HERE / "lightning_capped.py"), "--log", str(log), "--out", str(tmp_path)])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    ooms = kinds(log, "oom")
    assert ooms and ooms[0]["micro_batch"] == result["batch"], ooms
    # One fit() reached its last step: the OOM cost no restart.
    assert result["global_step"] == result["steps"]
    mem = kinds(log, "step_memory")
    assert all(m["usage"] < 1.0 for m in mem[-3:]), [m["usage"] for m in mem]


def test_fabric_users_get_their_own_backward_through_run_backward(tmp_path):
    from lightning.fabric import Fabric

    def fabric_loop(model, use_headroom):
        fabric = Fabric(accelerator="cpu", devices=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = fabric.setup(model, opt)
        called = {"n": 0}

        def backward(loss):
            called["n"] += 1
            fabric.backward(loss)

        batches = gpt_batches(3, 12)
        if not use_headroom:
            for b in batches:
                backward(model.loss(b))
                opt.step()
                opt.zero_grad()
            return called["n"]
        with headroom.Run(
            "fabric", model=model, effective_batch=12, micro_batch=5, adaptive=False
        ) as run:
            for b in batches:
                run.backward(b, model.loss, backward=backward)
                run.step(opt)
        return called["n"]

    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    assert fabric_loop(ref, False) == 3
    assert fabric_loop(model, True) == 9  # 5 + 5 + 2 per step, through fabric.backward
    assert_params_close(model, ref, TOL)


def test_the_adaptive_module_under_torchrun_learns_what_one_process_with_the_global_batch_does(
    tmp_path,
):
    """Two ranks of strategy="ddp" (gloo), each cutting its 8 samples of every global
    batch of 16 into micro-batches, rank 1 running out of memory twice: rank 0's
    parameters equal a single fixed-batch fit's on the global batches."""
    job = torchrun(2, "lightning_ddp.py", "--out", str(tmp_path))
    finish(job, timeout=300)
    torch.manual_seed(0)
    ref = FixedGPT()
    trainer(tmp_path / "ref").fit(ref, loader(4, 16))
    for r in range(2):
        assert json.loads((tmp_path / f"done-rank{r}.json").read_text())["steps"] == 4
        log = tmp_path / f"rank{r}.jsonl"
        assert len(kinds(log, "oom")) == (2 if r == 1 else 0), kinds(log, "oom")
    rows = kinds(tmp_path / "rank0.jsonl", "job_ranks")
    assert len(rows) == 4 and all(len(r["ranks"]) == 2 for r in rows), rows
    got = TinyAdaptive()
    got.load_state_dict(torch.load(tmp_path / "params.pt"))
    assert_params_close(got, ref, TOL)


def test_the_adaptive_module_under_fsdp2_learns_what_one_process_with_the_global_batch_does(
    tmp_path,
):
    """Two ranks of ModelParallelStrategy (FSDP2 in configure_model, gloo): the run gates
    the module's FSDP root; rank 1 runs out of memory twice inside the root's forward and
    every rank redoes those steps; the gathered parameters equal a single fixed-batch
    fit's on the global batches."""
    job = torchrun(2, "lightning_fsdp.py", "--out", str(tmp_path))
    finish(job, timeout=300)
    torch.manual_seed(0)
    ref = FixedGPT()
    trainer(tmp_path / "ref").fit(ref, loader(4, 16))
    for r in range(2):
        assert json.loads((tmp_path / f"done-rank{r}.json").read_text())["steps"] == 4
        log = tmp_path / f"rank{r}.jsonl"
        assert len(kinds(log, "oom")) == (2 if r == 1 else 0), kinds(log, "oom")
        texts = [n["text"] for n in kinds(log, "notice")]
        assert any("FSDP2 with" in t for t in texts), texts
    got = TinyAdaptive()
    got.load_state_dict(torch.load(tmp_path / "params.pt"))
    assert_params_close(got, ref, TOL)


def test_sigterm_mid_batch_saves_lightnings_checkpoint_of_the_last_completed_batch(tmp_path):
    """SIGTERM while an AdaptiveModule's batch is in run.backward: the run handles it, not
    Lightning's notifier (which raised at the next batch: no checkpoint, the run's log
    without its end); the batch is given up at the next micro-batch, Lightning's own
    checkpoint of the last completed batch is saved at once (before, only a flag was set
    for a save at the batch's end that never came), the process exits 143. The
    checkpoint holds the parameters and momentum of a fixed-batch fit stopped after that
    batch, and fit(ckpt_path=) takes it up."""
    torch.manual_seed(0)
    ref = FixedGPT()
    ref_trainer = trainer(tmp_path / "ref", max_steps=2)
    ref_trainer.fit(ref, loader(5, 8))
    out = tmp_path / "out"
    # Each batch is 4 micro-batches: the 10th is the second of the third batch.
    _, saved = sigterm_inside_a_step(
        "lightning_signalled.py", out, tmp_path / "run.jsonl", 10, "headroom-step=*.ckpt"
    )
    assert saved.name == "headroom-step=2.ckpt", saved
    ckpt = torch.load(saved, weights_only=False)
    model = TinyAdaptive()
    model.load_state_dict(ckpt["state_dict"])
    assert_params_close(model, ref, TOL)
    mine = ckpt["optimizer_states"][0]["state"]
    theirs = ref_trainer.optimizers[0].state_dict()["state"]
    for i, st in theirs.items():
        diff = float((mine[i]["momentum_buffer"] - st["momentum_buffer"]).abs().max())
        assert diff <= TOL, (i, diff)
    resume_from("lightning_signalled.py", out, tmp_path / "again.jsonl", saved)
    assert (out / "params.pt").exists()
