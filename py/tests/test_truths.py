"""What a Python run says is true: its warnings name the user's optimizer and
are true of it, its threshold profile is the one in force, a batch of another size or a
micro-batch out of range is said, a stop promises no checkpoint it will not take, a moved
log is said on stderr, a type mistake names the argument, what it got and what it takes,
and a junk loss is refused by one rule in both modes."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import headroom

from conftest import (
    Screen,
    TinyGPT,
    Viewer,
    gpt_batches,
    headroom_bin,
    kinds,
    records,
    spawn_on_pty,
)


def notices(log: Path) -> list[str]:
    return [r["text"] for r in kinds(log, "notice")]


# ---- item 1: optimizer warnings name the user's optimizer, and only when true ----------


def test_a_fused_optimizer_under_lightning_gets_no_warning_and_a_plain_one_is_named(tmp_path):
    import lightning as L
    import torch.nn.functional as F

    class LM(headroom.lightning.AdaptiveModule):
        def __init__(self, fused):
            super().__init__()
            self.net = torch.nn.Linear(8, 4)
            self.fused = fused

        def forward(self, x):
            return self.net(x)

        def micro_batch_loss(self, batch):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused)

    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,)))
    said = {}
    for fused in (True, False):
        log = tmp_path / f"pl-{fused}.jsonl"
        trainer = L.Trainer(
            max_steps=2,
            callbacks=[headroom.lightning.Adaptive(log=str(log))],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(LM(fused), torch.utils.data.DataLoader(data, batch_size=16))
        said[fused] = [r for r in kinds(log, "notice") if r["level"] == "warn"]
    texts = " ".join(r["text"] for r in said[True])
    assert "step()" not in texts and "Lightning" not in texts, said[True]
    (plain,) = [r["text"] for r in said[False] if "fused" in r["text"]]
    assert plain.startswith("torch.optim.AdamW without fused=True"), plain
    assert "Lightning" not in plain


def test_the_hf_trainers_optimizer_step_is_said_as_the_trainers_not_as_headrooms(tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    )
    ids = torch.randint(0, 64, (16, 16))
    ds = [{"input_ids": x, "labels": x} for x in ids]
    log = tmp_path / "hf.jsonl"
    args = TrainingArguments(
        str(tmp_path / "out"),
        per_device_train_batch_size=8,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        optim="adamw_torch_fused",
    )
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    headroom.hf.adapt(trainer, log=str(log))
    trainer.train()
    texts = notices(log)
    assert not any("_SteppedByFramework" in t for t in texts), texts
    assert not any("undoes an out-of-memory" in t for t in texts), texts
    (said,) = [t for t in texts if "optimizer step is the Trainer's" in t]
    assert "torch.optim.AdamW, fused" in said and "not retried" in said, said
    # Item 7: named after the script (pytest here), never output_dir's folder ("out").
    assert kinds(log, "run_started")[0]["run_name"] != "out"


def test_an_hf_run_is_named_after_the_script_or_run_name_never_output_dir(tmp_path):
    from transformers import TrainingArguments

    from headroom.hf import _run_name

    args = TrainingArguments(str(tmp_path / "out"), report_to=[])
    assert _run_name(None, args) == headroom._run._default_name() != "out"
    args = TrainingArguments(str(tmp_path / "out"), report_to=[], run_name="sweep-3")
    assert _run_name(None, args) == "sweep-3"
    assert _run_name("mine", args) == "mine"


# ---- item 2: the profile in force reaches the log, the `t` editor and `P` --------------


def test_the_runs_profile_is_logged_as_the_built_in_runs_is(tmp_path):
    """As `headroom train` says it: the profile whose values are in force, given by name
    or by value; custom values are custom (null)."""
    cases = [
        ({}, "balanced"),
        ({"profile": "balanced"}, "balanced"),
        ({"profile": "conservative"}, "conservative"),
        ({"thresholds": "0.92,0.94,0.96,0.98"}, "aggressive"),
        ({"thresholds": "0.9,0.93,0.95,0.97"}, None),
    ]
    for i, (kwargs, profile) in enumerate(cases):
        log = tmp_path / f"p{i}.jsonl"
        headroom.Run("profiled", log=log, **kwargs).finish()
        (first,) = kinds(log, "thresholds_changed")
        assert first["profile"] == profile and first["source"] == "config", (kwargs, first)


def _wait_text(screen: Screen, text: str, timeout: float = 30, run=None) -> bool:
    """Whether the screen comes to show `text`, the run reporting meanwhile if given."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if screen.wait_for(text, timeout=0):
            return True
        if run is not None:
            run.report(1.0)
        screen.pump(0.1)
    return False


def test_the_dashboard_shows_the_runs_profile_and_p_cycles_from_it(tmp_path, runtime_dir):
    log = tmp_path / "p.jsonl"
    run = headroom.Run("profiled", log=log, profile="conservative")
    pid, fd = spawn_on_pty([headroom_bin(), "attach", "profiled"])
    screen = Screen(fd)
    try:
        assert _wait_text(screen, "(conservative) in force, from config"), screen.text()
        screen.send(b"t")  # the editor names the profile in force
        assert _wait_text(screen, "profile conservative, from config"), screen.text()
        screen.send(b"\x1b")
        screen.pump(0.5)
        screen.send(b"P")  # the next profile after the one in force: aggressive
        deadline = time.monotonic() + 30
        changed = []
        while time.monotonic() < deadline and len(changed) < 2:
            run.report(1.0)
            screen.pump(0.1)
            changed = kinds(log, "thresholds_changed")
        assert changed[-1]["profile"] == "aggressive", changed
        screen.send(b"q")
        screen.pump(3)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        os.close(fd)
        run.finish()


# ---- item 3: the effective batch and the micro-batch are never changed silently --------


def test_a_batch_larger_than_effective_batch_is_said_once_on_stderr_and_in_the_log(tmp_path, capfd):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "eff.jsonl"
    run = headroom.Run("eff", model=model, effective_batch=8, log=log)
    for batch in gpt_batches(3, 16):
        run.backward(batch, model.loss)
        run.step(opt)
    run.finish()
    err = capfd.readouterr().err
    assert err.count("got a batch of 16 samples where effective_batch=8") == 1, err
    assert "its effective batch is 16" in err and "micro-batches of at most 8" in err
    said = [t for t in notices(log) if "got a batch of 16" in t]
    assert len(said) == 1
    assert {s["effective_batch"] for s in kinds(log, "step")} == {16}


def test_a_micro_batch_above_the_effective_batch_is_said_with_where_it_starts(tmp_path, capfd):
    model = TinyGPT()
    log = tmp_path / "mb.jsonl"
    run = headroom.Run("mb", model=model, effective_batch=8, micro_batch=32, log=log)
    assert run.micro_batch == 8
    run.finish()
    err = capfd.readouterr().err
    assert "micro_batch=32 is outside 1..8: the run starts at 8" in err, err
    assert any("micro_batch=32" in t for t in notices(log))


# ---- item 4: a stop promises no checkpoint it will not take ----------------------------


def test_a_stop_of_a_run_without_on_checkpoint_says_no_checkpoint_will_be_taken(tmp_path):
    run = headroom.Run("nocb")
    v = Viewer(run.socket)
    v.until(lambda r: r["kind"] == "caught_up")
    v.command("stop")
    deadline = time.monotonic() + 10
    while not run.should_stop and time.monotonic() < deadline:
        run.report(1.0)
        time.sleep(0.05)
    applied = v.until(lambda r: r["kind"] == "command_applied")
    assert "no checkpoint will be taken" in applied["applied"], applied
    assert "on_checkpoint" in applied["applied"]
    run.finish()


def test_a_user_signal_set_to_checkpoint_without_a_callback_is_refused():
    with pytest.raises(ValueError, match='on_usr1="checkpoint" needs on_checkpoint'):
        headroom.Run("x", on_usr1="checkpoint")


# ---- item 5: a moved log is said on stderr too -----------------------------------------


def test_a_log_that_holds_an_earlier_run_is_kept_and_the_new_name_said_on_stderr(tmp_path, capfd):
    log = tmp_path / "gpt.jsonl"
    headroom.Run("gpt", log=log).finish()
    capfd.readouterr()
    run = headroom.Run("gpt", log=log)
    run.finish()
    err = capfd.readouterr().err
    assert (
        f"{log} holds an earlier run's log, kept; this run logs to {tmp_path / 'gpt-2.jsonl'}"
        in err
    )
    assert run.log_path == str(tmp_path / "gpt-2.jsonl")


# ---- item 8: a type mistake names the argument, what it got and what it takes ----------


@pytest.mark.parametrize(
    "call, kind, says",
    [
        (
            lambda m: headroom.Run("x", effective_batch="64", model=m),
            TypeError,
            [r"effective_batch: got '64' \(a str\)", "whole number", "effective_batch=64"],
        ),
        (
            lambda m: headroom.Run("x", thresholds=(0.9, 0.92)),
            TypeError,
            ["thresholds: got", "tuple", '"0.9,0.92,0.95,0.97"'],
        ),
        (
            lambda m: headroom.Run(m),
            TypeError,
            [
                "first argument is the run's name",
                "Sequential",
                'headroom.Run\\("my-run", model=model\\)',
            ],
        ),
        (
            lambda m: headroom.Run("x", device="gpu"),
            ValueError,
            ["device='gpu'", '"cpu", "cuda", "cuda:N"'],
        ),
        (
            lambda m: headroom.Run("x", memory_budget=2.5e9),
            TypeError,
            ["memory_budget: got 2500000000.0", '"2GiB"'],
        ),
        (
            lambda m: headroom.Run("x", hard_limit="no"),
            TypeError,
            ["hard_limit: got 'no'", "True or False"],
        ),
        (
            lambda m: headroom.Run("x", model="gpt"),
            TypeError,
            ["model: got 'gpt'", "torch.nn.Module"],
        ),
        (
            lambda m: headroom.Run("x", on_checkpoint="ck/"),
            TypeError,
            ["on_checkpoint: got", "fn\\(step\\)"],
        ),
        (lambda m: headroom.Run("x", sample_hz="4"), TypeError, ["sample_hz: got '4'"]),
        (
            lambda m: headroom.Run("x", total_steps=10.0),
            TypeError,
            ["total_steps: got 10.0 \\(a float\\)"],
        ),
    ],
)
def test_a_wrong_argument_names_itself_what_it_got_and_what_it_takes(call, kind, says):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(kind) as e:
        call(model)
    for s in says:
        assert __import__("re").search(s, str(e.value)), (s, str(e.value))


def test_thresholds_as_a_tuple_are_taken_as_run_thresholds_gives_them():
    run = headroom.Run("x", thresholds=(0.85, 0.88, 0.92, 0.95))
    assert run.thresholds == (0.85, 0.88, 0.92, 0.95)
    run.finish()


def test_a_bad_argument_finishes_no_previous_run():
    first = headroom.Run("first")
    with pytest.raises(TypeError):
        headroom.Run("second", effective_batch="8")
    assert not first.ended
    first.finish()


def test_step_and_backward_name_what_they_were_given():
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    run = headroom.Run("x", model=model, effective_batch=4)
    with pytest.raises(TypeError, match=r"loss_fn: got 'loss' \(a str\)"):
        run.backward(torch.randn(4, 4), "loss")
    run.backward(torch.randn(4, 4), lambda mb: model(mb).pow(2).mean())
    with pytest.raises(
        TypeError,
        match=r"run.step\(optimizer\): got a Sequential .*the model, not its optimizer.*"
        r"torch.optim.AdamW",
    ):
        run.step(model)
    run.step(torch.optim.SGD(model.parameters(), lr=0.1))
    run.finish()


# ---- item 9: one rule for junk losses in both modes ------------------------------------


@pytest.mark.parametrize("junk", ["nan", "0.5"])
def test_a_loss_that_is_not_a_number_is_refused_by_report(junk):
    run = headroom.Run("x")
    with pytest.raises(headroom.LossError, match="give a number"):
        run.report(junk)
    assert run.step_count == 0
    run.finish()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), torch.tensor(float("nan"))])
def test_a_nan_or_inf_loss_raises_in_watch_only_as_in_adaptive_after_the_step_is_recorded(
    tmp_path, bad
):
    log = tmp_path / "nan.jsonl"
    run = headroom.Run("x", log=log)
    run.report(1.0)
    with pytest.raises(headroom.LossError, match="step 2: the loss given to run.report"):
        run.report(bad)
    assert run.step_count == 2
    run.report(None)  # a step that has no loss is not junk
    run.finish()
    steps = kinds(log, "step")
    assert [s["loss"] for s in steps] == [1.0, None, None]
    assert any(
        r["kind"] == "notice" and r["level"] == "error" and "step 2" in r["text"]
        for r in records(log)
    )
    # The adaptive half of the rule: run.backward raises on the same loss.
    model = torch.nn.Linear(2, 1)
    run = headroom.Run("y", model=model, effective_batch=2)
    with pytest.raises(headroom.LossError, match="nan|inf"):
        run.backward(torch.randn(2, 2), lambda mb: model(mb).sum() * math.inf)
    run.finish()


def test_the_screen_reader_reads_the_grid_a_redraw_left_not_the_bytes():
    """The dashboard tests read what a terminal shows: a redraw writes only the cells that
    changed, so a line moved down one row arrives with the cells it shares with the old
    row left out ("in f rce" for "in force"). The raw bytes never hold it whole."""
    master, slave = os.openpty()
    try:
        screen = Screen(master, cols=40, rows=3)
        os.write(slave, b"\x1b[2J\x1b[1;1Hin force, from config\x1b[2;1Hin forge, from conpig")
        screen.pump(0.3)
        # Row 1 moves to row 2: only the two cells that differ are written.
        os.write(slave, b"\x1b[1;1Hstatus: running     \x1b[2;7Hc\x1b[2;19Hf")
        screen.pump(0.3)
        assert screen.shows("in force, from config")
        assert b"in force, from config" not in screen.data[screen.data.index(b"status") :]
        assert not screen.shows("in forge")
    finally:
        os.close(master)
        os.close(slave)
