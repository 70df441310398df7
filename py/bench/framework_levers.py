"""The levers inside the frameworks, measured: an adapted HF Trainer (the model's own
`activation_checkpointing_enable`, the run's autocast) and a Lightning fit (named blocks,
the run's autocast), each switched at a step boundary as a viewer's command is, and the
lever decision's step peaks before and after, at the same shape. One process per run
under a roomy hard cap (so the resident set follows live tensors, as
py/tests/lever_peaks.py does). docs/BENCHMARKS.md, "The levers inside the frameworks".

    ./dev python py/bench/framework_levers.py [hf|lightning]   # the rows, a process each
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

ROWS = [
    ("hf", "checkpointing:blocks"),
    ("hf", "precision:bf16"),
    ("lightning", "checkpointing:blocks"),
    ("lightning", "precision:bf16"),
]
STEPS, SWITCH = 4, 2  # the lever goes on before step 3


def hf(lever: str, log: str) -> None:
    import capped
    import transformers
    from hf_models import Samples, tiny_gpt2, training_args

    import headroom.hf

    capped.one_thread()
    model = tiny_gpt2(vocab=256, ctx=512, d=128, layers=4)
    ds = Samples(16 * STEPS, t=512, vocab=256)
    args = training_args(
        Path(log).with_suffix(""), per_device_train_batch_size=16, max_steps=STEPS, optim="sgd"
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds)
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    model(**ds[0:2]).loss.backward()
    model.zero_grad(set_to_none=True)

    class Switch(transformers.TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step == SWITCH:
                trainer._headroom.run._carry_out(lever)

    headroom.hf.adapt(
        trainer,
        micro_batch=16,
        adaptive=False,
        memory_budget=str(capped.budget("3GiB")),
        hard_limit=True,
        log=log,
        name="hf-levers",
    )
    # After adapt's callback: its step has ended (measured) when the switch is made, as
    # at a viewer's command, which the run carries out at that boundary.
    trainer.add_callback(Switch())
    trainer.train()


def lightning(lever: str, log: str) -> None:
    import capped
    import lightning as L
    from lightning_models import TinyAdaptive, loader, trainer

    import headroom.lightning

    capped.one_thread()
    model = TinyAdaptive(vocab=256, d=128, t=512, layers=4)
    data = loader(STEPS, 16, t=512, vocab=256)
    model.net.loss(next(iter(loader(1, 2, t=512, vocab=256)))).backward()
    model.zero_grad(set_to_none=True)

    class Switch(L.Callback):
        def on_train_batch_end(self, tr, pl_module, outputs, batch, i):
            if tr.global_step == SWITCH:
                cb.run._carry_out(lever)

    cb = headroom.lightning.Adaptive(
        "pl-levers",
        micro_batch=16,
        adaptive=False,
        memory_budget=str(capped.budget("3GiB")),
        hard_limit=True,
        log=log,
        checkpoint_blocks=model.net.blocks,
    )
    trainer(Path(log).with_suffix(""), callbacks=[cb, Switch()], max_steps=STEPS).fit(model, data)


def decision(log: str) -> dict | None:
    for line in Path(log).read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "decision" and r["decision"]["decision"] == "lever":
            return r["decision"]
    return None


def main() -> int:
    if len(sys.argv) == 4:
        globals()[sys.argv[1]](sys.argv[2], sys.argv[3])
        return 0
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"framework-levers-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    print("| framework | lever | step before → after | peak before | peak after | freed |")
    print("|---|---|---|---|---|---|")
    for mode, lever in [r for r in ROWS if not sys.argv[1:] or r[0] in sys.argv[1:]]:
        log = out / f"{mode}-{lever.replace(':', '-')}.jsonl"
        p = subprocess.run(
            [sys.executable, __file__, mode, lever, str(log)],
            env=env,
            capture_output=True,
            text=True,
        )
        d = decision(str(log)) if log.exists() else None
        if p.returncode != 0 or d is None:
            print(f"| {mode} | {lever} | failed: {p.stderr.strip().splitlines()[-1:]} | | | |")
            continue
        b, a = d["before"], d["after"]
        mib = 1 << 20
        print(
            f"| {mode} | {d['change']} | {b['step']} → {a['step']} ({a['micro_batch']} × "
            f"{a['seq_len']} tokens) | {b['peak_bytes'] / mib:.0f} MiB | "
            f"{a['peak_bytes'] / mib:.0f} MiB | {d['freed_bytes'] / mib:.0f} MiB |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
