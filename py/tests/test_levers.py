"""The levers a hand-written loop hands to its run (`checkpoint_blocks=`, `precision=`):
switched by a viewer's command at a step boundary with the lever decision the built-in
trainer gives, checkpointing changing nothing learned, and the last resort under a real
cap where one sample fits only with its activations recomputed."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import headroom

from conftest import assert_params_close, kinds, steer

HERE = Path(__file__).parent


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Net(torch.nn.Module):
    def __init__(self, d: int = 32, layers: int = 4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1).mean(-1)


def _batches():
    """The same batches for every run, as many as it takes: a loop trains until the
    viewer's answer came, however fast the machine steps."""
    g = torch.Generator().manual_seed(1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        yield torch.randn(8, 64, 32, generator=g), torch.randn(8, generator=g)


def test_a_viewer_switches_checkpointing_mid_run_and_nothing_learned_changes(tmp_path):
    # The switched run trains until the answer came (at least seven steps); the plain one
    # then trains as many steps on the same batches.
    steps_of = {}

    def train(name, commands):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        answers: dict = {}
        errors: list = []
        log = tmp_path / f"{name}.jsonl"
        run = headroom.Run(
            name,
            model=model,
            effective_batch=8,
            micro_batch=4,
            adaptive=False,
            log=log,
            checkpoint_blocks=model.blocks,
            precision="fp32",
        )
        viewer = threading.Thread(target=steer, args=(lambda: run, commands, answers, errors))
        viewer.start()
        with run:
            for i, (x, y) in enumerate(_batches()):
                run.backward((x, y), lambda mb: (model(mb[0]) - mb[1]).pow(2).mean())
                run.step(opt)
                if answers and i >= 6:
                    break
        viewer.join(30)
        assert not errors, errors
        steps_of[name] = run.step_count
        return model, log, answers

    switched, log, answers = train("switched", [("set_checkpointing", {"checkpoint": "blocks"})])
    started = kinds(log, "run_started")[0]
    assert started["levers"] == {"precision": "fp32", "checkpointing": "none", "half": "bf16"}
    answer = answers["set_checkpointing"]["applied"]
    assert answer.startswith("activation checkpointing none → blocks from step "), answer
    lever = [r["decision"] for r in kinds(log, "decision") if r["decision"]["decision"] == "lever"]
    assert len(lever) == 1 and lever[0]["source"] == "command", lever
    assert lever[0]["change"] == "activation checkpointing none → blocks"
    # The unswitched run, for as many steps: checkpointing recomputes, it learns the same.
    torch.manual_seed(0)
    plain = Net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    with headroom.Run(
        "plain", model=plain, effective_batch=8, micro_batch=4, adaptive=False
    ) as run:
        for x, y in itertools.islice(_batches(), steps_of["switched"]):
            run.backward((x, y), lambda mb: (plain(mb[0]) - mb[1]).pow(2).mean())
            run.step(opt)
    assert_params_close(switched, plain, 1e-6)


def test_bf16_from_a_viewer_is_a_stated_change(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    answers: dict = {}
    errors: list = []
    log = tmp_path / "bf16.jsonl"
    run = headroom.Run(
        "bf16", model=model, effective_batch=8, micro_batch=4, log=log, precision="fp32"
    )
    commands = [("set_precision", {"precision": "bf16"})]
    viewer = threading.Thread(target=steer, args=(lambda: run, commands, answers, errors))
    viewer.start()
    dtypes = []

    def loss(mb):
        out = model(mb[0])
        dtypes.append(out.dtype)
        return (out.float() - mb[1]).pow(2).mean()

    with run:
        for i, (x, y) in enumerate(_batches()):
            run.backward((x, y), loss)
            run.step(opt)
            if answers and i >= 6:
                break
    viewer.join(30)
    assert not errors, errors
    assert answers["set_precision"]["applied"].startswith("precision fp32 → bf16 from step ")
    # The forward ran under the run's autocast from then on.
    assert dtypes[0] == torch.float32 and dtypes[-1] == torch.bfloat16, dtypes
    lever = [r["decision"] for r in kinds(log, "decision") if r["decision"]["decision"] == "lever"]
    assert [d["change"] for d in lever] == ["precision fp32 → bf16"]


def _fp16_step(model, opt, scaler, batch, parts: int) -> None:
    """A hand-written fp16 step: float16 autocast, the batch in `parts` micro-batches,
    each weighted loss scaled by the GradScaler, then its step and update."""
    x, y = batch
    for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(xs).float() - ys).pow(2).mean()
        scaler.scale(loss * (1 / parts)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def test_fp16_from_a_viewer_learns_what_autocast_with_a_gradscaler_learns(tmp_path):
    """half_precision="fp16": the viewer's m puts the forward in float16 autocast with a
    GradScaler the run keeps (run.backward scales, run.step steps and updates through it);
    the steps learn what a hand-written fp16 loop with torch.amp.GradScaler learns from the
    same step on; back at fp32 the scaler goes."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    answers: dict = {}
    errors: list = []
    log = tmp_path / "fp16.jsonl"
    run = headroom.Run(
        "fp16",
        model=model,
        effective_batch=8,
        micro_batch=4,
        adaptive=False,
        log=log,
        precision="fp32",
        half_precision="fp16",
    )
    commands = [("set_precision", {"precision": "fp16"})]
    viewer = threading.Thread(target=steer, args=(lambda: run, commands, answers, errors))
    viewer.start()
    scalers = []
    with run:
        for i, (x, y) in enumerate(_batches()):
            run.backward((x, y), lambda mb: (model(mb[0]).float() - mb[1]).pow(2).mean())
            scalers.append(run.scaler)
            run.step(opt)
            if answers and i >= 8:
                break
    viewer.join(30)
    assert not errors, errors
    assert kinds(log, "run_started")[0]["levers"]["half"] == "fp16"
    applied = answers["set_precision"]["applied"]
    assert applied.startswith("precision fp32 → fp16 from step "), applied
    first = int(applied.rsplit(" ", 1)[1])
    assert scalers[first - 2] is None and isinstance(scalers[first - 1], torch.amp.GradScaler)
    # The same steps by hand: fp32 up to the switch, fp16 with a fresh scaler from it.
    torch.manual_seed(0)
    hand = Net()
    hand_opt = torch.optim.SGD(hand.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for step, batch in enumerate(itertools.islice(_batches(), len(scalers)), start=1):
        if step < first:
            x, y = batch
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                ((hand(xs) - ys).pow(2).mean() * 0.5).backward()
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)
        else:
            _fp16_step(hand, hand_opt, scaler, batch, 2)
    assert_params_close(model, hand, 1e-6)
    assert run.scaler.get_scale() == scaler.get_scale()
    # Back to fp32 at a step boundary: no scaler, the forward in float32 again.
    assert run._switch_lever("precision", "fp32", "command").startswith("precision fp16 → fp32")
    assert run.scaler is None


def test_a_lever_the_script_did_not_hand_over_is_refused_by_name(tmp_path):
    model = Net()
    log = tmp_path / "none.jsonl"
    run = headroom.Run(
        "none", model=model, effective_batch=8, checkpoint_blocks=model.blocks, log=log
    )
    with run:
        answers = dict(
            run._native.apply_commands(
                [json.dumps({"command": "set_precision", "precision": "bf16"})]
            )
        )
    assert answers == {}, "the session answers a refusal itself"
    # A run whose half precision is bf16 refuses fp16 by name (it has no scaler).
    log = tmp_path / "bf16.jsonl"
    with headroom.Run("b", model=model, effective_batch=8, precision="fp32", log=log) as run:
        run._native.apply_commands([json.dumps({"command": "set_precision", "precision": "fp16"})])
    [refused] = kinds(log, "command_applied")
    assert refused["applied"].startswith("refused: this run switches between fp32 and bf16")
    with pytest.raises(ValueError, match="precision='fp8'"):
        headroom.Run("bad", model=model, effective_batch=8, precision="fp8")
    with pytest.raises(ValueError, match='give the lever too, precision="fp32"'):
        headroom.Run("bad", model=model, effective_batch=8, half_precision="fp16")
    with pytest.raises(ValueError, match="between fp32 and one half precision"):
        headroom.Run("bad", model=model, effective_batch=8, precision="bf16", half_precision="fp16")
    # A framework steps its own optimizer: a run's GradScaler would go unapplied.
    adaptive = pytest.importorskip("headroom.lightning").Adaptive
    with pytest.raises(ValueError, match="fp16 needs the run's GradScaler"):
        adaptive(half_precision="fp16")
    with pytest.raises(TypeError, match="checkpoint_blocks"):
        headroom.Run("bad", model=model, effective_batch=8, checkpoint_blocks=[1, 2])
    with pytest.raises(headroom.RunError, match="adaptive run"):
        headroom.Run("bad", model=model, checkpoint_blocks=model.blocks)


@pytest.mark.parametrize(
    "framework",
    ["loop", "loop-without-blocks", "hf", "lightning"],
)
def test_under_a_real_cap_checkpointing_is_the_last_resort_at_micro_batch_one(tmp_path, framework):
    """One long sample that fits under the cap only with its activations recomputed: a
    hand-written loop that named its blocks, an adapted Trainer (the model's own
    gradient_checkpointing_enable) and a Lightning module's hook each switch it on when
    micro-batch 1 runs out of memory and complete; a loop with no lever gives up."""
    if framework in ("hf", "lightning"):
        pytest.importorskip("transformers" if framework == "hf" else "lightning")
    log = tmp_path / "run.jsonl"
    argv = [sys.executable, str(HERE / "lever_capped.py"), "--log", str(log)]
    argv += ["--framework", framework.split("-")[0], "--out", str(tmp_path / "out")]
    p = subprocess.run(
        argv + (["--blocks"] if framework == "loop" else []),
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    ooms = [r for r in records if r["kind"] == "oom"]
    assert ooms and ooms[-1]["micro_batch"] == 1 and ooms[-1]["retry_with"] is None, ooms
    if framework == "loop-without-blocks":
        # Nothing left to switch: the run gives up where a run without levers always did.
        assert p.returncode == 1 and "OutOfMemory" in p.stderr, p.stderr[-2000:]
        return
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"steps": 5, "checkpointing": True}
    said = [r["text"] for r in records if r["kind"] == "notice"]
    assert any("activation checkpointing is now on" in t for t in said), said
    lever = [
        r["decision"]
        for r in records
        if r["kind"] == "decision" and r["decision"]["decision"] == "lever"
    ]
    assert [(d["change"], d["source"]) for d in lever] == [
        ("activation checkpointing none → blocks", "controller")
    ]
    # The long sample's step is the one that switched, and every step after it completed.
    assert lever[0]["after"]["step"] == 3, lever
    assert [r["step"] for r in records if r["kind"] == "step"][-3:] == [3, 4, 5]
    assert records[-1]["kind"] == "finished"


def test_an_adapted_trainer_switches_checkpointing_and_precision_from_a_viewer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_models import Samples, tiny_gpt2, training_args

    ds = Samples(200)

    def train(name, commands, dtypes=None):
        model = tiny_gpt2()
        if dtypes is not None:
            model.lm_head.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
        args = training_args(tmp_path / name, max_steps=12, per_device_train_batch_size=4)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds)
        cb = headroom.hf.adapt(trainer, log=tmp_path / f"{name}.jsonl")._headroom

        def slow(*a, **k):
            time.sleep(0.25)  # steps slow enough for the viewer to act mid-run

        if commands:
            slowed = type("Slow", (transformers.TrainerCallback,), {"on_step_end": slow})
            trainer.add_callback(slowed)
        answers, errors = {}, []
        t = threading.Thread(target=steer, args=(lambda: cb.run, commands, answers, errors))
        if commands:
            t.start()
        trainer.train()
        if commands:
            t.join(timeout=60)
        assert not errors, errors
        return model, answers

    switched, answers = train("switched", [("set_checkpointing", {"checkpoint": "blocks"})])
    assert answers["set_checkpointing"]["applied"].startswith(
        "activation checkpointing none → blocks from step "
    ), answers
    assert _checkpointing(switched)
    log = tmp_path / "switched.jsonl"
    lever = [r["decision"] for r in kinds(log, "decision") if r["decision"]["decision"] == "lever"]
    assert [d["change"] for d in lever] == ["activation checkpointing none → blocks"]
    plain, _ = train("plain", [])
    assert not _checkpointing(plain)
    assert_params_close(switched, plain, 1e-6)
    # The Trainer in float32: the precision lever is the run's autocast around its forward.
    dtypes: list = []
    _, answers = train("bf16", [("set_precision", {"precision": "bf16"})], dtypes)
    assert answers["set_precision"]["applied"].startswith("precision fp32 → bf16 from step ")
    assert dtypes[0] == torch.float32 and dtypes[-1] == torch.bfloat16, dtypes
    lever = kinds(tmp_path / "bf16.jsonl", "decision")
    assert [r["decision"]["change"] for r in lever if r["decision"]["decision"] == "lever"] == [
        "precision fp32 → bf16"
    ]


def _checkpointing(model) -> bool:
    """Whether a transformers model checkpoints its layers (5 and 4 name it apart)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def test_a_lightning_fit_switches_the_named_blocks_and_precision_from_a_viewer(tmp_path):
    L = pytest.importorskip("lightning")
    from lightning_models import TinyAdaptive, loader, trainer

    import headroom.lightning

    def fit(name, commands):
        torch.manual_seed(0)
        model = TinyAdaptive()
        cb = headroom.lightning.Adaptive(
            log=tmp_path / f"{name}.jsonl", checkpoint_blocks=model.net.blocks
        )
        answers, errors = {}, []
        th = threading.Thread(target=steer, args=(lambda: cb.run, commands, answers, errors))
        if commands:
            th.start()
        slow = type(
            "Slow", (L.pytorch.Callback,), {"on_train_batch_end": lambda *a: time.sleep(0.25)}
        )
        callbacks = [cb, slow()] if commands else [cb]
        trainer(tmp_path / name, callbacks=callbacks, max_steps=12).fit(model, loader(12, 8))
        if commands:
            th.join(timeout=60)
        assert not errors, errors
        return model, answers

    switched, answers = fit("switched", [("set_checkpointing", {"checkpoint": "blocks"})])
    assert answers["set_checkpointing"]["applied"].startswith(
        "activation checkpointing none → blocks from step "
    ), answers
    plain, _ = fit("plain", [])
    assert_params_close(switched, plain, 1e-6)
    _, answers = fit("bf16", [("set_precision", {"precision": "bf16"})])
    assert answers["set_precision"]["applied"].startswith("precision fp32 → bf16 from step ")


def test_a_lightning_module_hands_over_its_checkpointing_by_a_hook_it_defines(tmp_path):
    L = pytest.importorskip("lightning")
    from lightning_models import TinyAdaptive, loader, trainer

    import headroom.lightning

    calls = []

    class Hooked(TinyAdaptive):
        def activation_checkpointing(self, on: bool) -> None:
            calls.append(on)

    model = Hooked()
    cb = headroom.lightning.Adaptive(log=tmp_path / "hook.jsonl")
    answers, errors = {}, []
    th = threading.Thread(
        target=steer,
        args=(lambda: cb.run, [("set_checkpointing", {"checkpoint": "blocks"})], answers, errors),
    )
    th.start()
    slow = type("Slow", (L.pytorch.Callback,), {"on_train_batch_end": lambda *a: time.sleep(0.25)})
    trainer(tmp_path / "h", callbacks=[cb, slow()], max_steps=12).fit(model, loader(12, 8))
    th.join(timeout=60)
    assert not errors, errors
    assert answers["set_checkpointing"]["applied"].startswith(
        "activation checkpointing none → blocks from step "
    ), answers
    assert calls == [True]
    # A module without the hook has no checkpointing lever: the key is refused by name.
    plain = headroom.lightning.Adaptive(log=tmp_path / "plain.jsonl")
    trainer(tmp_path / "p", callbacks=[plain], max_steps=1).fit(TinyAdaptive(), loader(1, 8))
    assert plain.run._levers.checkpointing is None


@pytest.mark.parametrize("lever", ["checkpointing:blocks", "precision:bf16"])
def test_a_switched_lever_lowers_the_next_steps_peak_and_says_by_how_much(tmp_path, lever):
    p = subprocess.run(
        [sys.executable, str(HERE / "lever_peaks.py"), "--log", str(tmp_path / "run.jsonl")]
        + ["--lever", lever],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    [decision] = json.loads(p.stdout.strip().splitlines()[-1])
    before, after = decision["before"], decision["after"]
    assert (before["step"], after["step"]) == (2, 3)
    assert decision["freed_bytes"] == before["peak_bytes"] - after["peak_bytes"]
    # Eight blocks' activations of two 4,096-token sequences: about 100 MiB recomputed
    # (checkpointing) or halved (bf16) out of a step's peak.
    assert decision["freed_bytes"] > 32 << 20, decision


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_checkpointing_switched_inside_a_framework_lowers_the_next_steps_peak(tmp_path, framework):
    """The frameworks' checkpointing lever (an adapted Trainer's GPT-2 through its own
    activation_checkpointing_enable, a Lightning fit's named blocks) switched at a step
    boundary, as a viewer's command is: the lever decision's peak after is lower than
    before at the same shape (py/bench/framework_levers.py, one row of its table)."""
    pytest.importorskip("transformers" if framework == "hf" else "lightning")
    log = tmp_path / "run.jsonl"
    bench = HERE.parent / "bench" / "framework_levers.py"
    p = subprocess.run(
        [sys.executable, str(bench), framework, "checkpointing:blocks", str(log)],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    [d] = [r["decision"] for r in kinds(log, "decision") if r["decision"]["decision"] == "lever"]
    before, after = d["before"], d["after"]
    assert (before["step"], after["step"]) == (2, 3), d
    assert (before["micro_batch"], before["seq_len"]) == (after["micro_batch"], after["seq_len"])
    assert d["freed_bytes"] == before["peak_bytes"] - after["peak_bytes"]
    # Four GPT-2 layers' (two blocks') activations of 16 × 512 tokens: over a hundred MiB
    # recomputed instead of held.
    assert d["freed_bytes"] > 32 << 20, d
