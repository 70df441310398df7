"""headroom.hf with the real transformers.Trainer (tiny models from a config, random
weights, nothing downloaded): the watch callback on the stream with the dashboard's
commands carried out the Trainer's way, the adaptive Trainer learning what a
fixed-batch Trainer learns, a real OOM under a hard cap recovered without a restart,
and `import headroom` with neither framework installed."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from hf_models import Samples, tiny_bert, tiny_gpt2, training_args  # noqa: E402

import headroom  # noqa: E402
import headroom.hf  # noqa: E402
from headroom import _torch  # noqa: E402

from conftest import (  # noqa: E402
    assert_params_close,
    finish,
    kinds,
    records,
    resume_from,
    sigterm_inside_a_step,
    spawn,
    steer,
    torchrun,
    wait,
)

HERE = Path(__file__).resolve().parent
REL = 1e-5
# A parameter's largest difference from the fixed-batch Trainer's: float32 rounding (BERT's
# attention key bias, whose gradient is zero in exact arithmetic, is that noise alone).
TOL = 1e-7


def test_import_headroom_needs_neither_framework():
    code = (
        "import sys\n"
        "for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate'):\n"
        "    sys.modules[m] = None  # an import of it now fails, as if not installed\n"
        "import headroom\n"
        "run = headroom.Run('bare'); run.report(1.0); run.finish()\n"
        "for mod in ('headroom.hf', 'headroom.lightning'):\n"
        "    try:\n"
        "        __import__(mod)\n"
        "    except ImportError as e:\n"
        "        print(mod, 'refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "headroom.hf refused: headroom.hf needs the transformers package" in out.stdout
    assert "headroom.lightning refused: headroom.lightning needs the lightning" in out.stdout


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize(
    "make, kind",
    [(tiny_gpt2, "lm"), (tiny_bert, "cls")],
    ids=["gpt2-token-normalised", "bert-mean"],
)
def test_the_adaptive_trainer_learns_what_a_fixed_batch_trainer_learns(tmp_path, make, kind):
    ds = Samples(48, kind=kind)
    # Its own accumulation (2 batches per optimizer step), clipping and the LR schedule
    # kept; 8 samples cut into micro-batches of 3 (an uneven last one), and two of the
    # forwards fail with a real allocator error.
    args = dict(gradient_accumulation_steps=2, max_grad_norm=0.5, max_steps=3)
    model_ref = make()
    model = copy.deepcopy(model_ref)
    ref = transformers.Trainer(
        model=model_ref, args=training_args(tmp_path / "ref", **args), train_dataset=ds
    )
    ref_out = ref.train()
    calls = {"n": 0}

    def fail_some(module, inputs):
        if not torch.is_grad_enabled():
            return  # adapt's one-sample probe of the loss's normalisation
        calls["n"] += 1
        if calls["n"] in (2, 9):
            _torch.provoke_oom(torch.device("cpu"))

    hook = model.get_input_embeddings().register_forward_pre_hook(fail_some)
    log = tmp_path / "adapt.jsonl"
    trainer = transformers.Trainer(
        model=model, args=training_args(tmp_path / "adapt", **args), train_dataset=ds
    )
    headroom.hf.adapt(trainer, micro_batch=3, log=log)
    out = trainer.train()
    hook.remove()
    assert trainer.state.global_step == 3
    assert len(kinds(log, "oom")) == 2
    sizes = {m["micro_batch"] for m in kinds(log, "step_memory")}
    assert min(sizes) < 8, "the batches were never cut"
    assert abs(out.training_loss - ref_out.training_loss) <= REL * abs(ref_out.training_loss)
    assert_params_close(_params(model), _params(model_ref), TOL)


@pytest.mark.parametrize("mode", ["watch", "adapt"])
def test_the_dashboards_checkpoint_and_stop_go_through_the_trainers_save_and_resume(tmp_path, mode):
    ds = Samples(400)
    log = tmp_path / "run.jsonl"
    out = tmp_path / "out"
    model = tiny_gpt2()
    args = training_args(out, max_steps=200, per_device_train_batch_size=4)
    if mode == "watch":
        cb = headroom.hf.Watch(log=log)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds)
        cb = headroom.hf.adapt(trainer, log=log)._headroom

    def slow(*a, **k):
        time.sleep(0.02)  # steps slow enough for the viewer to act mid-run

    trainer.add_callback(type("Slow", (transformers.TrainerCallback,), {"on_step_end": slow}))
    answers, errors = {}, []
    t = threading.Thread(
        target=steer, args=(lambda: cb.run, ["checkpoint", "stop"], answers, errors)
    )
    t.start()
    trainer.train()
    t.join(timeout=60)
    assert not errors, errors
    stopped_at = trainer.state.global_step
    assert 3 <= stopped_at < 200, "the stop did not end the Trainer's loop"
    recs = records(log)
    assert recs[-1]["kind"] == "finished" and recs[-1]["stopped_by_user"]
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    # The asked checkpoint, and the stop's save at the last step: the Trainer's own.
    assert len(saved) == 2 and saved[-1] == stopped_at, saved
    told = [r["path"] for r in recs if r["kind"] == "checkpoint_saved"]
    assert told == [str(out / f"checkpoint-{s}") for s in saved], told
    steps = kinds(log, "step")
    assert steps[-1]["loss"] > 0 and steps[-1]["lr"] is not None
    # The Trainer's own resume takes the stop's checkpoint up.
    again = transformers.Trainer(
        model=tiny_gpt2(seed=5),
        args=training_args(out, max_steps=stopped_at + 2, per_device_train_batch_size=4),
        train_dataset=ds,
    )
    again.train(resume_from_checkpoint=str(out / f"checkpoint-{stopped_at}"))
    assert again.state.global_step == stopped_at + 2


def test_watch_streams_the_trainers_figures(tmp_path):
    log = tmp_path / "watch.jsonl"
    ds = Samples(64)
    eval_ds = Samples(16, seed=1)
    args = training_args(
        tmp_path / "out",
        max_steps=6,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        eval_strategy="steps",
        eval_steps=3,
        logging_steps=2,
    )
    cb = headroom.hf.Watch("hf-watch", log=log)
    trainer = transformers.Trainer(
        model=tiny_gpt2(), args=args, train_dataset=ds, eval_dataset=eval_ds, callbacks=[cb]
    )
    trainer.train()
    steps = kinds(log, "step")
    assert [s["step"] for s in steps] == list(range(1, 7))
    # Two batches of 4 per optimizer step; the loss is the model's own, from its output.
    assert all(s["effective_batch"] == 8 and s["seq_len"] == 16 for s in steps)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    ours = [s["loss"] for s in steps]
    pairs = [(ours[0] + ours[1]) / 2, (ours[2] + ours[3]) / 2, (ours[4] + ours[5]) / 2]
    assert pairs == pytest.approx(logged, rel=1e-3)
    assert [e["step"] for e in kinds(log, "eval")] == [3, 6]
    assert all(m["peak_bytes"] > 0 for m in kinds(log, "step_memory"))
    assert any("trainer step 2: loss" in n["text"] for n in kinds(log, "notice"))
    assert records(log)[-1]["kind"] == "finished"


def test_the_adaptive_trainer_recovers_a_real_oom_under_a_hard_cap(tmp_path):
    log = tmp_path / "capped.jsonl"
    p = spawn([str(HERE / "hf_capped.py"), "--log", str(log), "--out", str(tmp_path / "o")])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    ooms = kinds(log, "oom")
    assert ooms and ooms[0]["micro_batch"] == result["per_device"], ooms
    assert "allocate" in ooms[0]["error"] or "primitive" in ooms[0]["error"]
    # One train() call reached its last step: the OOM cost no restart.
    assert result["global_step"] == result["max_steps"], "the Trainer did not finish"
    mem = kinds(log, "step_memory")
    assert all(m["usage"] < 1.0 for m in mem[-3:]), [m["usage"] for m in mem]
    assert records(log)[-1]["kind"] == "finished"


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_the_adaptive_trainer_under_torchrun_learns_what_one_process_with_the_global_batch_does(
    tmp_path, kind
):
    """Two ranks of the Trainer's own DDP (gloo), or its FSDP2 (accelerate's fully_shard:
    each block a unit, the tied embedding and head one unit of three modules, the model
    the root), each cutting its per-device batch of 8 into micro-batches, rank 1 running
    out of memory in forwards (inside the embedding's unit) and, under FSDP2, in a
    backward between two blocks' units: the (gathered) parameters equal a
    single-process Trainer's with the whole global batch (16) per device; under FSDP2 the
    Trainer's own sharded checkpoints are written during the adapted run and hold the
    model the job ends with."""
    from hf_ddp import ddp_args

    flags = ["--fsdp", "--oom-in-backward-at", "3"] if kind == "fsdp2" else []
    job = torchrun(2, "hf_ddp.py", "--out", str(tmp_path), *flags)
    finish(job, timeout=300)
    model_ref = tiny_gpt2()
    args = ddp_args(per_device=16)
    del args["ddp_backend"]
    ref = transformers.Trainer(
        model=model_ref, args=training_args(tmp_path / "ref", **args), train_dataset=Samples(96)
    )
    ref_out = ref.train()
    ooms = 3 if kind == "fsdp2" else 2
    for r in range(2):
        done = json.loads((tmp_path / f"done-rank{r}.json").read_text())
        assert done["steps"] == 3, done
        log = tmp_path / f"rank{r}.jsonl"
        assert len(kinds(log, "oom")) == (ooms if r == 1 else 0), kinds(log, "oom")
        assert kinds(log, "finished"), f"rank {r} did not finish"
    rows = kinds(tmp_path / "rank0.jsonl", "job_ranks")
    assert rows and all(len(r["ranks"]) == 2 for r in rows), rows
    assert rows[-1]["ranks"][1]["ooms"] == ooms, rows[-1]
    assert abs(done["loss"] - ref_out.training_loss) <= 1e-4 * abs(ref_out.training_loss)
    params = torch.load(tmp_path / "params.pt")
    assert_params_close(params, _params(model_ref), TOL)
    if kind == "fsdp2":
        started = kinds(tmp_path / "rank0.jsonl", "notice")
        assert any("FSDP2 with" in n["text"] for n in started), "the job's FSDP2 notice"
        assert not [n for n in started if "accelerate runs" in n["text"]], started
        assert_params_close(_dcp_model(tmp_path / "trainer" / "checkpoint-3"), params, 0.0)


def _dcp_model(checkpoint: Path) -> dict:
    """The model in a Trainer's FSDP checkpoint (DCP shards, one file a rank), loaded
    whole in this process, named as the model's parameters."""
    import torch.distributed.checkpoint as dcp

    folder = checkpoint / "pytorch_model_fsdp_0"
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    dcp.load(state, checkpoint_id=str(folder))
    # The state dict names the tied head's weight too; the parameters name it once.
    return {k.removeprefix("model."): v for k, v in state.items() if k != "model.lm_head.weight"}


def test_sigterm_mid_step_saves_the_trainers_checkpoint_and_its_resume_matches(tmp_path):
    """SIGTERM while the adapted Trainer is inside a step (its own accumulation of 2
    batches, each cut into micro-batches): the step is given up at the next micro-batch,
    the Trainer's own checkpoint of the last completed step is saved at once (before, the
    process left in run.backward with only a flag set for a save at the step's end that
    never came), with the random states of that step's start (before: none saved; a save
    then would have held the states the step's dropout had moved on), the process exits
    143; resume_from_checkpoint redoes the step given up and ends with the parameters of
    the same adapted Trainer never interrupted, dropout on."""
    from hf_signalled import adapted

    ref = adapted(tmp_path / "ref", tmp_path / "ref.jsonl")
    ref.train()
    out = tmp_path / "out"
    # Each batch is 4 micro-batches: the 14th is the second of the fourth batch (the
    # second of the Trainer's step 2); the step is given up before the 15th.
    _, saved = sigterm_inside_a_step(
        "hf_signalled.py", out, tmp_path / "run.jsonl", 14, "checkpoint-*"
    )
    assert saved.name == "checkpoint-1", saved
    # The Trainer's own resume, adapted again, redoes the step given up.
    resume_from("hf_signalled.py", out, tmp_path / "again.jsonl", saved)
    assert_params_close(torch.load(out / "params.pt"), _params(ref.model), 1e-6)


def test_sigterm_to_torchrun_inside_a_step_saves_the_fsdp2_trainers_checkpoint_on_every_rank(
    tmp_path,
):
    """SIGTERM to torchrun while the Trainer's FSDP2 job is inside a step: every rank gives
    the step up at the same agreement, saves the Trainer's own sharded checkpoint of the
    last completed step together (before: no checkpoint, and the Trainer's next batch
    called run.backward again and exited 143), computes nothing for the rest of that
    step, and returns from train(). The checkpoint holds what a single process with the
    global batch learns in that many steps."""
    import signal

    from hf_ddp import ddp_args

    job = torchrun(
        2,
        "hf_ddp.py",
        "--out",
        str(tmp_path),
        "--fsdp",
        "--oom-at",
        "",
        "--steps",
        "4",
        "--sleep",
        "0.3",
    )
    # 8 samples a batch in micro-batches of 3: 3 forwards a batch, 6 a Trainer step (its
    # accumulation of 2). Rank 0's 8th is the second of step 2's first batch.
    deadline = time.monotonic() + 120
    while (tmp_path / "out.txt").read_text().count("forward\n") < 8:
        assert time.monotonic() < deadline and job.poll() is None, wait(job, 60)
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    wait(job, 90)  # its code is torchrun's agent's own (it raises on SIGTERM)
    saved = tmp_path / "trainer" / "checkpoint-1"
    assert sorted(p.name for p in (tmp_path / "trainer").iterdir()) == ["checkpoint-1"]
    assert len(list((saved / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2
    assert json.loads((saved / "trainer_state.json").read_text())["global_step"] == 1
    for r in range(2):
        assert (tmp_path / f"done-rank{r}.json").exists(), f"rank {r} did not return"
        recs = records(tmp_path / f"rank{r}.jsonl")
        texts = [x["text"] for x in recs if x["kind"] == "notice"]
        assert any("given up by every rank" in t for t in texts), texts
        assert recs[-1]["kind"] == "finished" and recs[-1]["checkpoint"] == str(saved)
    ref = tiny_gpt2()
    args = dict(ddp_args(per_device=16), max_steps=1)
    del args["ddp_backend"]
    transformers.Trainer(
        model=ref, args=training_args(tmp_path / "ref", **args), train_dataset=Samples(96)
    ).train()
    assert_params_close(_dcp_model(saved), _params(ref), TOL)
