"""headroom's adaptive mode against the batch-size finders of accelerate and Lightning,
each under the same real CPU memory cap, each in its own process (the cap is
process-wide).

The model is the byte-level GPT of headroom's default config (py/bench/_gpt.py; --n-embd,
--n-layer, --seq-len make it bigger), trained for --steps optimizer steps of an effective
batch of 256 sequences from the bundled Tiny Shakespeare corpus (seeded random windows:
the same samples, in the same steps, for every contender), AdamW at lr 3e-3. Every worker
process does the same preparation: it imports torch, headroom, accelerate and lightning
(so each holds the same libraries), builds the model and optimizer from one seed, takes
one warm-up optimizer step on 2 fixed samples (so AdamW's state exists before the cap, as
py/tests/capped_run.py does), and then measures what it holds (VmRSS). The budget is that
plus --room; the cap is set the way headroom's host/src/procmem.rs `set_hard_limit` sets
it: glibc's mmap threshold to 64 KiB (mallopt), then RLIMIT_DATA = VmData now + (budget -
VmRSS now). headroom gets `memory_budget=<the same bytes>, hard_limit=True` and sets it
itself.

Contenders:

  headroom    Run(effective_batch=256, micro_batch=256, memory_budget=B, hard_limit=True);
              loss = run.backward(batch, model.loss); run.step(opt). A micro-batch of 256
              does not fit: the OOM is caught mid-step and the rest retried smaller.
  accelerate  accelerate.utils.find_executable_batch_size(starting_batch_size=256)
              around a training function taking `batch_size`; after an OOM it calls the
              function again with batch_size * 0.9 (its default). The function keeps the
              effective batch at 256: each step cuts the step's 256 samples into
              ceil(256 / batch_size) micro-batches (the last one smaller when batch_size
              does not divide 256), each loss weighted by its share. On entry it clears
              the gradients and resumes at the first step not yet completed (completed
              optimizer steps are kept; a step an OOM interrupted starts over).
  lightning   lightning.pytorch.tuner.Tuner(trainer).scale_batch_size(module, mode=M,
              init_val=2): trial runs of 3 micro-batches each, the size doubling until an
              OOM (power: then halved; binsearch: then bisected, minus its 5% margin); the
              tuner restores the model and optimizer from the checkpoint it took before the
              trials. Then a new Trainer fits --steps optimizer steps at the found size with
              accumulate_grad_batches = 256 // size (exact when the size divides 256, as
              power mode's powers of two do; the table says the effective batch it got).
  lightning-headroom
              The same Lightning fit with headroom.lightning: an AdaptiveModule (manual
              optimization; run.backward with manual_backward, run.step with Lightning's
              optimizer) and the Adaptive(micro_batch=256, memory_budget=B,
              hard_limit=True) callback; one loader batch of 256 per optimizer step.

With --model gpt2 (transformers' GPT2LMHeadModel of the same shape, from a config), the
Hugging Face Trainer's contenders (constant LR, no clipping, the warm AdamW passed in):

  hf-auto     TrainingArguments(per_device_train_batch_size=256,
              auto_find_batch_size=True): accelerate's find_executable_batch_size around
              the Trainer's inner loop; after an OOM the per-device batch is cut (×0.9)
              and the loop starts over; the effective batch is the smaller batch.
  hf-headroom The same Trainer with headroom.hf.adapt(trainer, micro_batch=256,
              memory_budget=B, hard_limit=True): 256 per step, cut into micro-batches.

Per contender: OOMs caught, restarts (accelerate: calls of the training function after
the first; lightning: trial runs; headroom: none, the step goes on), the optimizer step
from which the micro-batch never changed again, the final micro-batch, the peak RSS of
the last --peak-steps steps (VmHWM, reset by writing 5 to /proc/self/clear_refs) as a
share of the budget, samples/s over the steps after settling, wall time of the whole run,
and the training loss of the last step and a held-out loss after it. A contender that
fails is reported with its traceback's last lines.

    HEADROOM_STAGE=/work/stage-bench ./dev bench-python py/bench/peers.py
    ./dev bench-python py/bench/peers.py --contenders lightning,lightning-headroom
    ./dev bench-python py/bench/peers.py --model gpt2 --contenders hf-auto,hf-headroom
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from _gpt import evaluate, make_hf_model, make_model, make_optimizer

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "assets" / "tinyshakespeare.txt"
MIB = 1 << 20

# ---- /proc/self/status, the cap -----------------------------------------------------------


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def rss() -> int:
    return status_kib("VmRSS:") * 1024


def hwm() -> int:
    return status_kib("VmHWM:") * 1024


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 64 << 10  # host/src/procmem.rs MMAP_THRESHOLD
HARD_LIMIT_ROOM = 32 << 20  # host/src/procmem.rs HARD_LIMIT_ROOM


def set_hard_limit(budget: int) -> int:
    """host/src/procmem.rs `set_hard_limit`, line for line: returns the cap."""
    libc = ctypes.CDLL(None)
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        raise RuntimeError("cannot set glibc's mmap threshold")
    now = rss()
    data = status_kib("VmData:") * 1024
    if budget < now + HARD_LIMIT_ROOM:
        raise RuntimeError(f"budget {budget} leaves less than 32 MiB above the RSS {now}")
    cap = data + (budget - now)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.RLIM_INFINITY))
    return cap


# ---- data ------------------------------------------------------------------------------


def corpus_batches(steps: int, n: int, seq_len: int, seed: int):
    """`steps` batches of `n` random windows from the first 90% of the corpus, and 128
    held-out windows from the last 10%."""
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8)
    split = int(len(data) * 0.9)
    g = torch.Generator().manual_seed(seed)

    def windows(src, k):
        starts = torch.randint(0, len(src) - seq_len - 1, (k,), generator=g)
        w = src[starts[:, None] + torch.arange(seq_len + 1)].long()
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    train = [windows(data[:split], n) for _ in range(steps)]
    warm = windows(data[:split], 2)
    val = windows(data[split:], 128)
    return train, warm, val


# ---- the workers -------------------------------------------------------------------------


class Bench:
    """What every worker shares: the same preparation, then the measurements."""

    def __init__(self, args):
        import accelerate  # noqa: F401  (every worker holds the same libraries)
        import lightning  # noqa: F401
        import transformers  # noqa: F401

        import headroom  # noqa: F401

        torch.set_num_threads(args.threads)
        self.args = args
        self.E = args.effective
        self.train, warm, self.val = corpus_batches(args.steps, self.E, args.seq_len, args.seed)
        make = make_hf_model if args.model == "gpt2" else make_model
        self.model = make(args.seed, seq_len=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd)
        self.opt = make_optimizer(self.model)
        self.model.loss(warm).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        self.held = rss()
        self.budget = self.held + args.room * MIB
        self.cap = None
        self.res: dict = {
            "held": self.held,
            "budget": self.budget,
            "params": sum(p.numel() for p in self.model.parameters()),
            "ooms": 0,
            "restarts": 0,
            "oom_errors": [],
            "sizes": [],  # the micro-batch each optimizer step completed at
            "step_end": [],  # perf_counter at each optimizer step's end
            "losses": [],
            "peak": None,
        }
        self.t0 = time.perf_counter()
        self.res["t0"] = self.t0

    def cap_now(self) -> None:
        self.cap = set_hard_limit(self.budget)
        self.res["cap"] = self.cap

    def peak_window(self, step: int) -> bool:
        """True at the first of the last --peak-steps steps (0-based `step`)."""
        return step == self.args.steps - self.args.peak_steps

    def finish(self) -> dict:
        r = self.res
        r["wall_s"] = time.perf_counter() - self.t0
        r["t0"] = self.t0
        r["val_loss"] = evaluate(self.model, self.val, 16)
        return r


def oom_text(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:160] if s else type(e).__name__


def work_headroom(b: Bench) -> None:
    import headroom

    log = Path(tempfile.mkdtemp(prefix="headroom-peers-")) / "run.jsonl"
    own_peaks = []
    with headroom.Run(
        "peers-headroom",
        model=b.model,
        device="cpu",
        effective_batch=b.E,
        micro_batch=b.args.start,
        memory_budget=str(b.budget),
        hard_limit=True,
        log=log,
        total_steps=b.args.steps,
    ) as run:
        b.res["cap"] = None  # headroom sets it; read back below
        for batch in b.train:
            loss = run.backward(batch, b.model.loss)
            # headroom resets VmHWM when backward starts: this is the forward/backward peak.
            own_peaks.append(hwm())
            run.step(b.opt)
            b.res["step_end"].append(time.perf_counter())
            b.res["losses"].append(loss)
        b.res["limit_bytes"] = run.limit_bytes
    b.res["cap"] = resource.getrlimit(resource.RLIMIT_DATA)[0]
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    mem = [r for r in recs if r["kind"] == "step_memory"]
    ooms = [r for r in recs if r["kind"] == "oom"]
    b.res["sizes"] = [r["micro_batch"] for r in mem]
    b.res["ooms"] = len(ooms)
    b.res["oom_errors"] = [
        f"step {r['step']} mb {r['micro_batch']} -> {r['retry_with']}: {r['error'][:120]}"
        for r in ooms
    ]
    b.res["resizes"] = [
        (r["step"], r["decision"]["from"], r["decision"]["to"], r["decision"].get("reason"))
        for r in recs
        if r["kind"] == "decision" and r["decision"]["decision"] == "resize"
    ]
    k = b.args.peak_steps
    # The log's step peak covers the whole step (optimizer included); ours the backward.
    b.res["peak"] = max(max(r["peak_bytes"] for r in mem[-k:]), max(own_peaks[-k:]))
    b.res["log"] = str(log)


def work_accelerate(b: Bench) -> None:
    from accelerate.utils import find_executable_batch_size

    b.cap_now()
    progress = {"step": 0}
    attempts: list[tuple[int, int]] = []  # (batch_size, the step it started at)
    E = b.E

    @find_executable_batch_size(starting_batch_size=b.args.start)
    def train(batch_size):
        attempts.append((batch_size, progress["step"]))
        b.res["final_attempt_t"] = time.perf_counter()
        b.opt.zero_grad(set_to_none=True)
        try:
            while progress["step"] < b.args.steps:
                k = progress["step"]
                if b.peak_window(k):
                    reset_hwm()
                x, y = b.train[k]
                total = 0.0
                for i in range(0, E, batch_size):
                    mb = (x[i : i + batch_size], y[i : i + batch_size])
                    loss = b.model.loss(mb)
                    w = len(mb[0]) / E
                    (loss * w).backward()
                    total += float(loss) * w
                    loss = None
                b.opt.step()
                b.opt.zero_grad(set_to_none=True)
                b.res["sizes"].append(batch_size)
                b.res["step_end"].append(time.perf_counter())
                b.res["losses"].append(total)
                progress["step"] += 1
        except Exception as e:
            k = progress["step"] + 1
            b.res["oom_errors"].append(f"step {k} bs {batch_size}: {oom_text(e)}")
            raise
        return batch_size

    train()
    b.res["attempts"] = attempts
    b.res["ooms"] = len(attempts) - 1
    b.res["restarts"] = len(attempts) - 1
    b.res["peak"] = hwm()


def work_lightning(b: Bench) -> None:
    import logging
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner
    from lightning.pytorch.tuner import batch_size_scaling as bss
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    E = b.E
    xs = torch.cat([x for x, _ in b.train])
    ys = torch.cat([y for _, y in b.train])
    dataset = TensorDataset(xs, ys)
    res = b.res

    class Module(pl.LightningModule):
        def __init__(self, model, opt):
            super().__init__()
            self.model = model
            self.opt = opt
            self.batch_size = 2
            self.micro_losses: list[float] = []

        def train_dataloader(self):
            return DataLoader(dataset, batch_size=self.batch_size, shuffle=False)

        def training_step(self, batch, batch_idx):
            loss = self.model.loss(batch)
            self.micro_losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return self.opt

    class Meter(pl.Callback):
        """Step ends, the step's loss (mean of its micro-batches), the peak window."""

        def __init__(self, accumulate: int):
            self.accumulate = accumulate

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx % self.accumulate == 0 and b.peak_window(batch_idx // self.accumulate):
                reset_hwm()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % self.accumulate == 0:
                res["step_end"].append(time.perf_counter())
                ls = module.micro_losses[-self.accumulate :]
                res["losses"].append(sum(ls) / len(ls))
                res["sizes"].append(module.batch_size)

    trials: list[tuple[int, str]] = []
    real_try = bss._try_loop_run

    def counted_try(trainer, params):
        size = trainer.lightning_module.batch_size
        try:
            real_try(trainer, params)
        except BaseException as e:
            trials.append((size, f"failed: {oom_text(e)}"))
            raise
        trials.append((size, "ok"))

    bss._try_loop_run = counted_try  # counts the trials; their behaviour is untouched

    module = Module(b.model, b.opt)
    root = tempfile.mkdtemp(prefix="lightning-peers-")
    common = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
    )
    b.cap_now()
    tuner_trainer = pl.Trainer(max_steps=b.args.steps, **common)
    t = time.perf_counter()
    found = Tuner(tuner_trainer).scale_batch_size(
        module, mode=b.args.lightning_mode, init_val=b.args.lightning_init
    )
    res["search_s"] = time.perf_counter() - t
    res["trials"] = trials
    res["restarts"] = len(trials)
    res["ooms"] = sum(1 for _, s in trials if s != "ok")
    res["oom_errors"] = [f"trial bs {n}: {s}" for n, s in trials if s != "ok"]
    res["found"] = found
    bs = min(int(found), E)
    accumulate = max(1, E // bs)
    module.batch_size = bs
    module.micro_losses = []
    res["effective_got"] = bs * accumulate
    res["accumulate"] = accumulate
    res["fit_t0"] = time.perf_counter()
    trainer = pl.Trainer(
        max_steps=b.args.steps,
        accumulate_grad_batches=accumulate,
        callbacks=[Meter(accumulate)],
        **common,
    )
    trainer.fit(module)
    res["peak"] = hwm()


def _log_records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _headroom_from_log(b: Bench, log: Path) -> None:
    """OOMs, the micro-batch of each step and the last steps' peak, from headroom's log
    (headroom resets VmHWM every step, so its own step peaks are the ones to read)."""
    recs = _log_records(log)
    mem = [r for r in recs if r["kind"] == "step_memory"]
    ooms = [r for r in recs if r["kind"] == "oom"]
    b.res["sizes"] = [r["micro_batch"] for r in mem]
    b.res["ooms"] = len(ooms)
    b.res["oom_errors"] = [
        f"step {r['step']} mb {r['micro_batch']} -> {r['retry_with']}: {r['error'][:120]}"
        for r in ooms
    ]
    b.res["peak"] = max(r["peak_bytes"] for r in mem[-b.args.peak_steps :])
    b.res["log"] = str(log)


def work_lightning_headroom(b: Bench) -> None:
    """The same Lightning fit with headroom adaptive: an AdaptiveModule (manual
    optimization, run.backward with manual_backward) and the Adaptive callback, one
    loader batch of --effective samples per optimizer step."""
    import logging
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import headroom.lightning

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    xs = torch.cat([x for x, _ in b.train])
    ys = torch.cat([y for _, y in b.train])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=b.E, shuffle=False)

    class Module(headroom.lightning.AdaptiveModule):
        def __init__(self, model, opt):
            super().__init__()
            self.model = model
            self.opt = opt

        def micro_batch_loss(self, batch):
            return self.model.loss(batch)

        def configure_optimizers(self):
            return self.opt

    class Meter(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            b.res["step_end"].append(time.perf_counter())
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            b.res["losses"].append(float(loss))

    log = Path(tempfile.mkdtemp(prefix="headroom-peers-")) / "run.jsonl"
    cb = headroom.lightning.Adaptive(
        "peers-lightning-headroom",
        micro_batch=b.args.start,
        memory_budget=str(b.budget),
        hard_limit=True,
        log=log,
    )
    trainer = pl.Trainer(
        max_steps=b.args.steps,
        callbacks=[cb, Meter()],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(prefix="lightning-peers-"),
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(b.model, b.opt), loader)
    _headroom_from_log(b, log)


class _HFWindows(torch.utils.data.Dataset):
    """The steps' windows in order, as the Trainer takes them (the model shifts the
    labels itself)."""

    def __init__(self, batches):
        self.x = torch.cat([x for x, _ in batches])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _hf_trainer(b: Bench, per_device: int, **kw):
    import transformers

    transformers.logging.set_verbosity_error()

    class Meter(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **k):
            if b.peak_window(state.global_step):
                reset_hwm()

        def on_step_end(self, args, state, control, **k):
            b.res["step_end"].append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                b.res["losses"].append(float(logs["loss"]))

    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-peers-"),
        per_device_train_batch_size=per_device,
        max_steps=b.args.steps,
        lr_scheduler_type="constant",  # the optimizer's own lr, as every contender
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=b.args.seed,
        disable_tqdm=True,
        **kw,
    )
    return transformers.Trainer(
        model=b.model,
        args=args,
        train_dataset=_HFWindows(b.train),
        optimizers=(b.opt, None),
        callbacks=[Meter()],
    )


def work_hf_auto(b: Bench) -> None:
    """transformers.Trainer(auto_find_batch_size=True): accelerate's
    find_executable_batch_size around the Trainer's inner loop, which cuts the
    per-device batch (×0.9, accelerate's default) after an OOM and starts the loop over
    (the completed steps' updates stay in the model; the step count and the data order
    start again; the effective batch is the smaller per-device batch)."""
    trainer = _hf_trainer(b, b.args.start, auto_find_batch_size=True)
    attempts: list[int] = []
    inner = trainer._inner_training_loop

    def counted(batch_size=None, *a, **k):
        attempts.append(batch_size)
        b.res["final_attempt_t"] = time.perf_counter()
        for key in ("step_end", "losses"):
            b.res[key].clear()
        try:
            return inner(batch_size, *a, **k)
        except Exception as e:
            b.res["oom_errors"].append(f"bs {batch_size}: {oom_text(e)}")
            raise

    trainer._inner_training_loop = counted
    b.cap_now()
    trainer.train()
    b.res["attempts"] = attempts
    b.res["ooms"] = b.res["restarts"] = len(attempts) - 1
    b.res["sizes"] = [attempts[-1]] * len(b.res["step_end"])
    b.res["effective_got"] = attempts[-1]
    b.res["peak"] = hwm()


def work_hf_headroom(b: Bench) -> None:
    """The same Trainer with headroom.hf.adapt: the per-device batch is the effective
    batch, cut into micro-batches that grow and shrink; an OOM is retried mid-step."""
    import headroom.hf

    trainer = _hf_trainer(b, b.E)
    log = Path(tempfile.mkdtemp(prefix="headroom-peers-")) / "run.jsonl"
    headroom.hf.adapt(
        trainer,
        name="peers-hf-headroom",
        micro_batch=b.args.start,
        memory_budget=str(b.budget),
        hard_limit=True,
        log=log,
    )
    trainer.train()
    _headroom_from_log(b, log)


WORKERS = {
    "headroom": work_headroom,
    "accelerate": work_accelerate,
    "lightning": work_lightning,
    "lightning-headroom": work_lightning_headroom,
    "hf-auto": work_hf_auto,
    "hf-headroom": work_hf_headroom,
}


def worker(args) -> int:
    out = {"contender": args.worker}
    try:
        b = Bench(args)
        out = b.res
        out["contender"] = args.worker
        WORKERS[args.worker](b)
        out.update(b.finish())
        out["ok"] = True
    except BaseException as e:  # a finding, reported as it is
        out["ok"] = False
        out["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-2500:]
    Path(args.out).write_text(json.dumps(out))
    return 0


# ---- the parent ---------------------------------------------------------------------------


def settled_step(sizes: list[int]) -> int | None:
    """The first optimizer step (1-based) from which the micro-batch never changed."""
    if not sizes:
        return None
    s = len(sizes)
    while s > 1 and sizes[s - 2] == sizes[-1]:
        s -= 1
    return s


def summarise(r: dict, steps: int) -> dict:
    sizes = r.get("sizes", [])
    ends = r.get("step_end", [])
    s = settled_step(sizes)
    out = {"settled": s, "final_mb": sizes[-1] if sizes else None, "sps": None, "settle_s": None}
    if s is not None and "t0" in r:
        # Wall time until the settled step's (last) attempt began: accelerate, its final
        # call of the training function; lightning, the fit after the search; headroom,
        # the end of the step before (its earlier steps trained, at other sizes).
        if "fit_t0" in r:
            out["settle_s"] = r["fit_t0"] - r["t0"]
        elif "final_attempt_t" in r:
            out["settle_s"] = r["final_attempt_t"] - r["t0"]
        else:
            out["settle_s"] = ends[s - 2] - r["t0"] if s > 1 else 0.0
    if s is not None and len(ends) > s and len(ends) == len(sizes):
        # Samples/s over the steps after the settling step (ends[s-1] is its end).
        n = len(ends) - s
        out["sps"] = n * r["effective"] / (ends[-1] - ends[s - 1])
        out["sps_steps"] = n
    return out


def bench_args(doc: str, *, room: int, steps: int, effective: int, seq_len: int):
    """The argument parser's common part: the cap's room, the run's length, the model."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--room", type=int, default=room, help="MiB above what each process holds")
    ap.add_argument("--steps", type=int, default=steps, help="optimizer steps per run")
    ap.add_argument("--effective", type=int, default=effective, help="samples per step")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1337)
    return ap


def main() -> int:
    ap = bench_args(__doc__, room=250, steps=30, effective=256, seq_len=64)
    ap.add_argument("--start", type=int, default=256, help="headroom's/accelerate's first size")
    ap.add_argument("--peak-steps", type=int, default=10, help="steps the peak is read over")
    ap.add_argument(
        "--model",
        default="gpt",
        choices=("gpt", "gpt2"),
        help="gpt: the example's GPT; gpt2: transformers' GPT2LMHeadModel of the same shape",
    )
    ap.add_argument("--lightning-mode", default="power", choices=("power", "binsearch"))
    ap.add_argument("--lightning-init", type=int, default=2)
    ap.add_argument("--contenders", default="headroom,accelerate,lightning")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per contender")
    ap.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    env = dict(os.environ)
    env["HEADROOM_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="headroom-peers-rt-")
    tmp = Path(tempfile.mkdtemp(prefix="peers-"))
    passthrough = []
    for k, v in vars(args).items():
        if k in ("worker", "out", "contenders", "timeout"):
            continue
        passthrough += [f"--{k.replace('_', '-')}", str(v)]
    print(
        f"torch {torch.__version__}; {args.threads} thread(s); GPT n_layer {args.n_layer}, "
        f"n_embd {args.n_embd}, seq_len {args.seq_len}; effective batch {args.effective}, "
        f"{args.steps} steps; budget = RSS after model+optimizer + {args.room} MiB",
        flush=True,
    )
    results = []
    for name in args.contenders.split(","):
        out = tmp / f"{name}.json"
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--worker", name, "--out", str(out), *passthrough]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            rc, stderr = p.returncode, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, stderr = "timeout", (e.stderr or b"").decode(errors="replace")
        wall = time.perf_counter() - t
        if out.exists():
            r = json.loads(out.read_text())
        else:
            r = {"contender": name, "ok": False, "error": f"the worker died (rc {rc})"}
        r["rc"] = rc
        r["process_s"] = wall
        r["stderr_tail"] = stderr[-1500:]
        r["effective"] = r.get("effective_got", args.effective)
        results.append(r)
        print(
            f"{name}: rc {rc}, {wall:.0f} s, {'ok' if r.get('ok') else 'FAILED'}",
            flush=True,
        )

    print()
    head = (
        f"{'contender':<19}{'OOMs':>5}{'restarts':>9}{'settled@':>9}{'settle s':>9}{'final mb':>9}"
        f"{'eff.':>6}{'peak/budget':>12}{'samples/s':>10}{'wall s':>8}"
        f"{'loss@' + str(args.steps):>9}{'val loss':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        sm = summarise(r, args.steps)
        peak = r.get("peak")
        share = f"{peak / r['budget'] * 100:.1f}%" if peak and r.get("budget") else "-"
        losses = r.get("losses") or []
        done = len(losses)
        last = f"{losses[-1]:.4f}" if losses else "-"
        vl = f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else "-"
        sps = f"{sm['sps']:.1f}" if sm["sps"] else "-"
        settle = f"{sm['settle_s']:.1f}" if sm["settle_s"] is not None else "-"
        print(
            f"{r['contender']:<19}{r.get('ooms', '-'):>5}{r.get('restarts', '-'):>9}"
            f"{sm['settled'] if sm['settled'] else '-':>9}{settle:>9}{sm['final_mb'] or '-':>9}"
            f"{r['effective']:>6}{share:>12}{sps:>10}{r.get('wall_s', r['process_s']):>8.1f}"
            f"{last:>9}{vl:>9}" + ("" if r.get("ok") else f"   FAILED after {done} steps")
        )
    print(
        "OOMs: out-of-memory errors caught. restarts: accelerate, calls of the training "
        "function after the first; lightning, trial runs of the tuner (3 micro-batches each, "
        "then undone); headroom has none (the step goes on). settled@: the optimizer step "
        "from which the micro-batch never changed; settle s: wall seconds until that step's "
        "successful attempt began (headroom's earlier steps trained; the peers' attempts and "
        "trials did not count). final mb: the last micro-batch; eff.: samples per optimizer "
        f"step. peak/budget: VmHWM over the last {args.peak_steps} steps / the budget. "
        "samples/s: over the steps after the settled one. wall s: the whole run after the "
        f"preparation. loss@{args.steps}: the training loss of the last step; val loss: "
        "128 held-out windows after it."
    )
    print()
    for r in results:
        name = r["contender"]
        if r.get("budget"):
            cap = f", RLIMIT_DATA {r['cap'] / MIB:.1f} MiB" if r.get("cap") else ""
            print(
                f"{name}: held {r['held'] / MIB:.1f} MiB, budget {r['budget'] / MIB:.1f} MiB{cap}"
            )
        if r.get("peak"):
            print(f"  peak RSS over the last {args.peak_steps} steps {r['peak'] / MIB:.1f} MiB")
        sizes = r.get("sizes") or []
        if sizes:
            print(f"  micro-batch per step: {sizes}")
        for key in ("attempts", "trials", "found", "accumulate", "search_s", "resizes"):
            if key in r:
                v = r[key]
                print(f"  {key}: {round(v, 1) if isinstance(v, float) else v}")
        for e in r.get("oom_errors", [])[:20]:
            print(f"  oom: {e}")
        if r.get("losses"):
            print("  losses: " + " ".join(f"{v:.3f}" for v in r["losses"]))
        if not r.get("ok"):
            print("  ERROR:")
            for line in (r.get("error") or "").strip().splitlines()[-12:]:
                print(f"    {line}")
            tail = r.get("stderr_tail", "").strip().splitlines()[-8:]
            if tail:
                print("  stderr tail:")
                for line in tail:
                    print(f"    {line}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
