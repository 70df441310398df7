"""What headroom costs a step inside the frameworks: the Hugging Face Trainer alone,
with `headroom.hf.Watch()`, and with `headroom.hf.adapt(trainer)`; Lightning alone (a
stock module, automatic optimization), with `headroom.lightning.Watch()`, and an
`AdaptiveModule` with the `Adaptive()` callback. The same model (transformers'
GPT2LMHeadModel from a config for the Trainer, the example's byte-level GPT for
Lightning; n_layer 4, n_embd 128, seq_len 64), the same data, one CPU thread. Adaptive
runs start at the whole batch (micro-batch = batch), so nothing is split and what is
measured is headroom's own work per step; all grow no further than the batch.

Each round trains every contender for --steps steps in a fresh Trainer, in a rotating
order; a step's time is the wall time between the framework's step-end hooks; the first
--skip steps of each round are dropped (warm-up). Reported: the median step time per
contender over all rounds, and its difference from the framework alone; and headroom's
own time per step measured inside the run (see `Own`), against the framework alone's step.

    HEADROOM_STAGE=/work/stage-bench ./dev bench-python py/bench/framework_overhead.py
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

from _gpt import make_hf_model, make_model, make_optimizer, token_batches  # noqa: E402


class Own:
    """headroom's own time, measured inside the run: the time in headroom's entry points
    (its callbacks' hooks, the adaptive training_step) less the time they spend in the
    framework's and the user's work they call (forward and loss, backward, the optimizer
    step, the Trainer's input preparation). Kept on two clocks: wall time (what the step
    waits, including any time the thread is descheduled on a busy machine) and the main
    thread's CPU time (what headroom's code costs, which the machine's load does not
    inflate). Sampled at each step's end, so warm-up steps can be dropped."""

    CLOCKS = (time.perf_counter, time.thread_time)

    def __init__(self):
        self.outer = [0.0, 0.0]
        self.inner = [0.0, 0.0]
        self.depth = 0
        self.marks: list[tuple[float, float]] = []

    def _timed(self, fn, totals: list[float], only_inside: bool):
        def timed(*a, **k):
            if only_inside and not self.depth:
                return fn(*a, **k)
            self.depth += 1
            t = [c() for c in self.CLOCKS]
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
                if only_inside or not self.depth:
                    for i, c in enumerate(self.CLOCKS):
                        totals[i] += c() - t[i]

        return timed

    def entry(self, fn):
        return self._timed(fn, self.outer, only_inside=False)

    def work(self, fn):
        return self._timed(fn, self.inner, only_inside=True)

    def hooks(self, callback) -> None:
        """Times every per-step hook of a headroom callback (not the run's creation)."""
        for name in dir(callback):
            if name.startswith("on_") and name not in ("on_train_begin", "on_train_start"):
                setattr(callback, name, self.entry(getattr(callback, name)))

    def mark(self) -> None:
        self.marks.append(tuple(o - i for o, i in zip(self.outer, self.inner)))

    def per_step(self, skip: int) -> list[tuple[float, float]]:
        pairs = zip(self.marks, self.marks[1:])
        return [(b[0] - a[0], b[1] - a[1]) for a, b in pairs][skip - 1 :]


def hf_contender(kind: str, batches, args, own: Own) -> list[float]:
    import transformers

    import headroom.hf

    transformers.logging.set_verbosity_error()
    ends: list[float] = []

    class Meter(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())
            own.mark()

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.cat([x for x, _ in batches])

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    model = make_hf_model(0, seq_len=args.seq_len)
    targs = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-overhead-"),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        lr_scheduler_type="constant",
        logging_steps=args.steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callbacks = [Meter()]
    if kind == "watch":
        watch = headroom.hf.Watch("overhead-hf")
        own.hooks(watch)
        callbacks.append(watch)
        # The loss tap's forward hook is bound when the run starts: time it from its class.
        headroom.hf._LossTap._hook = own.entry(_LOSS_TAP_HOOK)
    trainer = transformers.Trainer(
        model=model,
        args=targs,
        train_dataset=Data(),
        optimizers=(make_optimizer(model), None),
        callbacks=callbacks,
    )
    if kind == "adapt":
        headroom.hf.adapt(trainer, name="overhead-hf", micro_batch=args.batch)
        own.hooks(trainer._headroom)
        trainer.training_step = own.entry(trainer.training_step)
        for name in ("compute_loss", "_prepare_inputs"):
            setattr(trainer, name, own.work(getattr(trainer, name)))
        trainer.accelerator.backward = own.work(trainer.accelerator.backward)
    trainer.train()
    headroom.hf._LossTap._hook = _LOSS_TAP_HOOK
    return [b - a for a, b in zip(ends, ends[1:])][args.skip - 1 :]


def lightning_contender(kind: str, batches, args, own: Own) -> list[float]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import headroom.lightning

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    ends: list[float] = []

    class Meter(pl.Callback):
        def on_train_batch_end(self, *a):
            ends.append(time.perf_counter())
            own.mark()

    class Stock(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model(0, seq_len=args.seq_len)

        def training_step(self, batch, i):
            return self.model.loss(batch)

        def configure_optimizers(self):
            return make_optimizer(self.model)

    class Adaptive(headroom.lightning.AdaptiveModule):
        def __init__(self):
            super().__init__()
            self.model = make_model(0, seq_len=args.seq_len)

        def micro_batch_loss(self, batch):
            return self.model.loss(batch)

        def configure_optimizers(self):
            opt = make_optimizer(self.model)
            opt.step = own.work(opt.step)
            return opt

    callbacks = [Meter()]
    module = Stock()
    if kind == "watch":
        callbacks.append(headroom.lightning.Watch("overhead-pl"))
        own.hooks(callbacks[-1])
    elif kind == "adapt":
        module = Adaptive()
        callbacks.append(headroom.lightning.Adaptive("overhead-pl", micro_batch=args.batch))
        own.hooks(callbacks[-1])
        module.training_step = own.entry(module.training_step)
        module.micro_batch_loss = own.work(module.micro_batch_loss)
        module.manual_backward = own.work(module.manual_backward)
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    trainer = pl.Trainer(
        max_steps=args.steps,
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(prefix="pl-overhead-"),
    )
    trainer.fit(module, DataLoader(TensorDataset(xs, ys), batch_size=args.batch))
    return [b - a for a, b in zip(ends, ends[1:])][args.skip - 1 :]


_LOSS_TAP_HOOK = None


def main() -> int:
    global _LOSS_TAP_HOOK
    import headroom.hf

    _LOSS_TAP_HOOK = headroom.hf._LossTap._hook
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--frameworks", default="hf,lightning")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = token_batches(args.steps, args.batch, seq_len=args.seq_len)
    runners = {"hf": hf_contender, "lightning": lightning_contender}
    kinds = ("alone", "watch", "adapt")
    print(
        f"torch {torch.__version__}; {args.threads} thread(s); batch {args.batch} x "
        f"{args.seq_len}; {args.rounds} rounds x {args.steps} steps (first {args.skip} "
        "dropped), contenders in rotating order",
        flush=True,
    )
    for fw in args.frameworks.split(","):
        times: dict[str, list[float]] = {k: [] for k in kinds}
        owns: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            order = kinds[r % 3 :] + kinds[: r % 3]
            for k in order:
                own = Own()
                times[k] += runners[fw](k, batches, args, own)
                owns[k] += own.per_step(args.skip)
        base = statistics.median(times["alone"])
        print(f"\n{fw}: median step time over {len(times['alone'])} steps each")
        print(
            f"  {'':<6} {'step':>11}   {'vs alone':>8}   {'own, wall':>10}   {'of alone':>8}"
            f"   {'own, CPU':>9}   {'of alone':>8}"
        )
        for k in kinds:
            m = statistics.median(times[k])
            wall = statistics.median(w for w, _ in owns[k]) if k != "alone" else 0.0
            cpu = statistics.median(c for _, c in owns[k]) if k != "alone" else 0.0
            print(
                f"  {k:<6} {m * 1e3:8.2f} ms   {(m - base) / base * 100:+7.2f}%   "
                f"{wall * 1e3:7.3f} ms   {wall / base * 100:7.3f}%   "
                f"{cpu * 1e3:6.3f} ms   {cpu / base * 100:7.3f}%"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
