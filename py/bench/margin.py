"""The margin against the peers (issue 34): what headroom's 90% target costs in samples/s
against the sizes the peers' searches end at, and what it buys in OOMs over a long run with
varying lengths, all under one real CPU memory cap.

The model, the data, each process's preparation and the cap are py/bench/peers.py's
(imported, not copied): the byte-level GPT of py/bench/_gpt.py (here at --seq-len 256, so
that a sample costs megabytes and the sizes land in the low double digits), seeded windows
of the bundled corpus, a warm AdamW; budget = what the process holds once warm + --room;
the cap is headroom's `set_hard_limit` (glibc's mmap threshold 64 KiB, then RLIMIT_DATA =
VmData + budget - VmRSS); headroom gets `memory_budget=<the same bytes>, hard_limit=True`.
Every worker runs in its own process (the cap is process-wide) and builds the same data
(all --steps batches, so every process holds the same), so the budgets agree to a MiB.

Three phases, one process per contender and phase, one after another:

  find    Each contender's settled micro-batch on fixed-length data (every window
          --seq-len tokens), effective batch --effective:
            headroom, headroom-aggressive  Run(effective_batch=E, micro_batch=E,
                     profile="balanced"/"aggressive"), --find-steps steps; its last size.
            accelerate   peers.py's worker: find_executable_batch_size(starting_batch_size=E),
                     ×0.9 after each OOM; its last size.
            lightning-power, lightning-binsearch  peers.py's worker:
                     Tuner.scale_batch_size(mode=..., init_val=2); the size it found.
            hf-auto  the HF Trainer's auto_find_batch_size (per-device E, ×0.9 after each
                     OOM, the loop started over) around the same GPT (a wrapper returning
                     {"loss"}); its last per-device batch.
  speed   One process, the cap set, every distinct size found: a plain loop (fixed
          micro-batch, ceil(E / size) micro-batches per optimizer step, the last smaller,
          each loss weighted by its share: the same effective batch) at --seq-len, the
          sizes alternating in --rounds rounds of --block steps on the same batches.
          Samples/s per size, and per round the ratio to headroom's size.
  long    --steps optimizer steps of E samples whose length varies: step k's windows cut
          to a seeded random length between --seq-len/4 and --seq-len (the same lengths
          and samples for every contender). The peers hold the size their search found
          (on fixed-length data, so at the longest length of the run), in the same plain
          loop, and meet an OOM as the peer does: accelerate resumes at the failed step
          with the size ×0.9 (the step's finished micro-batches lost); the HF Trainer does
          the same but starts its loop over (counted: the steps it would redo; they are
          not rerun); Lightning has no recovery, the fit crashes: counted, and credited
          with a restart at the failed step at the same size (a second crash at the same
          step: the size its finder steps down to, half). One more row, accelerate as it
          is used, searching on this data from E. headroom (both profiles) runs the same
          steps through Run(effective_batch=E, micro_batch=E, max_seq_len=--seq-len),
          recovering an OOM inside the step. Per contender: OOMs, restarts, the final
          size, samples/s over all steps (settling and failed attempts included), the
          highest step peak / budget and the steps at or over 95% of it.

    ./dev bench-python py/bench/margin.py
    ./dev bench-python py/bench/margin.py --phases speed,long --sizes headroom=12,accelerate=21
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import peers
import torch
from peers import MIB, Bench, hwm, oom_text, reset_hwm

FIND = (
    "headroom",
    "headroom-aggressive",
    "accelerate",
    "lightning-power",
    "lightning-binsearch",
    "hf-auto",
)
# long-phase rows: (name, what it runs, the find result whose size it holds)
LONG = (
    ("headroom", "headroom:balanced", None),
    ("headroom-aggressive", "headroom:aggressive", None),
    ("accelerate", "accelerate", "accelerate"),
    ("hf-auto", "hf", "hf-auto"),
    ("lightning-power", "lightning", "lightning-power"),
    ("lightning-binsearch", "lightning", "lightning-binsearch"),
    ("accelerate-search", "accelerate", None),  # searching on this data from E
)


def is_oom(e: BaseException) -> bool:
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(e, MemoryError) or should_reduce_batch_size(e)


def lengths(args) -> list[int]:
    """Each long-phase step's sequence length, seeded: the same for every contender."""
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(args.seq_len // 4, args.seq_len + 1, (args.steps,), generator=g).tolist()


def plain_step(b: Bench, size: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step of the whole batch in micro-batches of `size` (the last one
    smaller), each loss weighted by its share: the gradients of one full-batch step."""
    E = len(x)
    b.opt.zero_grad(set_to_none=True)
    total = 0.0
    for i in range(0, E, size):
        mb = (x[i : i + size], y[i : i + size])
        loss = b.model.loss(mb)
        w = len(mb[0]) / E
        (loss * w).backward()
        total += float(loss) * w
        loss = None
    b.opt.step()
    b.opt.zero_grad(set_to_none=True)
    return total


# ---- find ---------------------------------------------------------------------------------


def find_headroom(b: Bench, profile: str) -> None:
    import headroom

    log = Path(tempfile.mkdtemp(prefix="headroom-margin-")) / "run.jsonl"
    with headroom.Run(
        f"margin-find-{profile}",
        model=b.model,
        device="cpu",
        effective_batch=b.E,
        micro_batch=b.E,
        memory_budget=str(b.budget),
        hard_limit=True,
        profile=profile,
        log=log,
        total_steps=b.args.steps,
    ) as run:
        for batch in b.train[: b.args.steps]:
            b.res["losses"].append(run.backward(batch, b.model.loss))
            run.step(b.opt)
            b.res["step_end"].append(time.perf_counter())
    peers._headroom_from_log(b, log)
    b.res["size"] = b.res["sizes"][-1]


class _LossOf(torch.nn.Module):
    """The GPT as the HF Trainer calls it: model(input_ids=, labels=) -> {"loss"}."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, labels):
        return {"loss": self.gpt.loss((input_ids, labels))}


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, batches):
        self.x = torch.cat([x for x, _ in batches])
        self.y = torch.cat([y for _, y in batches])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def find_hf(b: Bench) -> None:
    """The Trainer's auto_find_batch_size around the same GPT: per-device E, ×0.9 and the
    loop started over after each OOM; the size is its last per-device batch."""
    import transformers

    transformers.logging.set_verbosity_error()
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-margin-"),
        per_device_train_batch_size=b.E,
        auto_find_batch_size=True,
        max_steps=b.args.steps,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=b.args.seed,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=_LossOf(b.model),
        args=args,
        train_dataset=_Pairs(b.train[: b.args.steps]),
        optimizers=(b.opt, None),
    )
    attempts: list[int] = []
    inner = trainer._inner_training_loop

    def counted(batch_size=None, *a, **k):
        attempts.append(batch_size)
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
    b.res["size"] = attempts[-1]
    b.res["peak"] = hwm()


def work_find(b: Bench, name: str) -> None:
    if name.startswith("headroom"):
        find_headroom(b, "aggressive" if name.endswith("aggressive") else "balanced")
    elif name == "accelerate":
        b.args.start = b.E
        peers.work_accelerate(b)
        b.res["size"] = b.res["sizes"][-1]
    elif name.startswith("lightning"):
        b.args.lightning_mode = name.split("-")[1]
        b.args.steps = 2  # the fit after the search: its size is all we need
        peers.work_lightning(b)
        b.res["size"] = int(b.res["found"])
    elif name == "hf-auto":
        find_hf(b)
    else:
        raise ValueError(name)


# ---- speed --------------------------------------------------------------------------------


def work_speed(b: Bench, sizes: list[int]) -> None:
    b.cap_now()
    batches = b.train[: b.args.block]
    plain_step(b, sizes[0], *batches[0])  # warm at the cap
    rounds = []
    for r in range(b.args.rounds):
        order = sizes if r % 2 == 0 else sizes[::-1]
        row = {}
        for size in order:
            gc.collect()
            t = time.perf_counter()
            try:
                for x, y in batches:
                    plain_step(b, size, x, y)
                row[size] = len(batches) * b.E / (time.perf_counter() - t)
            except RuntimeError as e:
                if not is_oom(e):
                    raise
                b.opt.zero_grad(set_to_none=True)
                row[size] = None
                b.res["oom_errors"].append(f"round {r} size {size}: {oom_text(e)}")
        rounds.append(row)
        print(f"round {r}: {row}", file=sys.stderr, flush=True)
    b.res["rounds"] = rounds


# ---- long ---------------------------------------------------------------------------------


def long_batches(b: Bench) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[:, :n].contiguous(), y[:, :n].contiguous()) for (x, y), n in zip(b.train, b.lens)]


def long_headroom(b: Bench, profile: str) -> None:
    import headroom

    log = Path(tempfile.mkdtemp(prefix="headroom-margin-")) / "run.jsonl"
    data = long_batches(b)
    t0 = time.perf_counter()
    with headroom.Run(
        f"margin-long-{profile}",
        model=b.model,
        device="cpu",
        effective_batch=b.E,
        micro_batch=b.E,
        max_seq_len=b.args.seq_len,
        memory_budget=str(b.budget),
        hard_limit=True,
        profile=profile,
        log=log,
        total_steps=len(data),
    ) as run:
        for batch in data:
            b.res["losses"].append(run.backward(batch, b.model.loss))
            run.step(b.opt)
    b.res["run_s"] = time.perf_counter() - t0
    recs = peers._log_records(log)
    mem = [r for r in recs if r["kind"] == "step_memory"]
    b.res["sizes"] = [r["micro_batch"] for r in mem]
    b.res["step_peaks"] = [r["peak_bytes"] for r in mem]
    b.res["ooms"] = sum(1 for r in recs if r["kind"] == "oom")
    b.res["oom_errors"] = [
        f"step {r['step']} mb {r['micro_batch']} -> {r['retry_with']}: {r['error'][:100]}"
        for r in recs
        if r["kind"] == "oom"
    ]


def long_peer(b: Bench, policy: str, size: int) -> None:
    """The peer's size held in the plain loop; an OOM met as the peer meets it."""
    b.cap_now()
    data = long_batches(b)
    res = b.res
    res["sizes"], res["step_peaks"], res["redo_steps"] = [], [], 0
    failed_at: dict[int, int] = {}
    t0 = time.perf_counter()
    k = 0
    while k < len(data):
        x, y = data[k]
        reset_hwm()
        try:
            res["losses"].append(plain_step(b, size, x, y))
        except RuntimeError as e:
            if not is_oom(e):
                raise
            b.opt.zero_grad(set_to_none=True)
            gc.collect()
            res["ooms"] += 1
            res["restarts"] += 1
            failed_at[k] = failed_at.get(k, 0) + 1
            before = size
            if policy == "accelerate":
                size = max(1, int(size * 0.9))
            elif policy == "hf":
                size = max(1, int(size * 0.9))
                res["redo_steps"] += k  # the Trainer's loop starts over (not rerun here)
            elif policy == "lightning" and failed_at[k] > 1:
                size = max(1, size // 2)
            res["oom_errors"].append(
                f"step {k + 1} (len {x.shape[1]}) size {before} -> {size}: {oom_text(e)}"
            )
            continue
        res["step_peaks"].append(hwm())
        res["sizes"].append(size)
        k += 1
    res["run_s"] = time.perf_counter() - t0


def work_long(b: Bench, what: str, size: int | None) -> None:
    b.lens = lengths(b.args)
    if what.startswith("headroom"):
        long_headroom(b, what.split(":")[1])
    else:
        long_peer(b, what, size or b.E)
    res = b.res
    res["samples"] = len(res["sizes"]) * b.E
    res["tokens"] = sum(n * b.E for n in b.lens[: len(res["sizes"])])


# ---- the worker and the parent ---------------------------------------------------------------


def worker(args) -> int:
    out: dict = {"worker": args.worker}
    try:
        bargs = copy.copy(args)
        bargs.model, bargs.peak_steps, bargs.start = "gpt", 1, args.effective
        bargs.lightning_mode, bargs.lightning_init = "power", 2
        b = Bench(bargs)  # all --steps batches, in every process: the same held memory
        out = b.res
        out["worker"] = args.worker
        out["load_start"] = os.getloadavg()
        phase, _, name = args.worker.partition(":")
        if phase == "find":
            b.args.steps = args.find_steps
            b.args.peak_steps = min(3, args.find_steps)
            work_find(b, name)
        elif phase == "speed":
            work_speed(b, [int(s) for s in name.split(",")])
        elif phase == "long":
            what, _, size = name.partition("@")
            work_long(b, what, int(size) if size else None)
        out["wall_s"] = time.perf_counter() - b.t0
        out["load_end"] = os.getloadavg()
        out["ok"] = True
    except BaseException as e:  # a finding, reported as it is
        out["ok"] = False
        out["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-2500:]
    Path(args.out).write_text(json.dumps(out))
    return 0


def spawn(args, name: str, tmp: Path, env: dict) -> dict:
    out = tmp / f"{name.replace(':', '_').replace(',', '-').replace('@', '_')}.json"
    cmd = [sys.executable, __file__, "--worker", name, "--out", str(out)]
    for k in ("room", "steps", "effective", "find_steps", "rounds", "block", "threads"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    for k in ("seq_len", "n_layer", "n_embd", "seed"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", (e.stderr or b"").decode(errors="replace")
    r = json.loads(out.read_text()) if out.exists() else {"ok": False, "error": f"rc {rc}"}
    r["process_s"] = time.perf_counter() - t
    r["stderr_tail"] = err[-1500:]
    load = os.getloadavg()[0]
    print(
        f"  {name}: {'ok' if r.get('ok') else 'FAILED'}, {r['process_s']:.0f} s, load {load:.2f}",
        flush=True,
    )
    if not r.get("ok"):
        print("    " + "\n    ".join((r.get("error") or err).strip().splitlines()[-8:]))
    return r


def median(v: list[float]) -> float:
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def main() -> int:
    # --steps: the long phase's optimizer steps.
    ap = peers.bench_args(__doc__, room=200, steps=200, effective=24, seq_len=256)
    ap.add_argument("--find-steps", type=int, default=8, help="steps of the find phase")
    ap.add_argument("--rounds", type=int, default=3, help="speed phase: rounds")
    ap.add_argument("--block", type=int, default=3, help="speed phase: steps per size a round")
    ap.add_argument("--phases", default="find,speed,long")
    ap.add_argument("--find", default=",".join(FIND), help="find-phase contenders")
    ap.add_argument("--long", default=",".join(n for n, _, _ in LONG), help="long-phase rows")
    ap.add_argument("--sizes", default="", help="name=size,... in place of the find phase")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per process")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    env = dict(os.environ)
    env["HEADROOM_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="headroom-margin-rt-")
    tmp = Path(tempfile.mkdtemp(prefix="margin-"))
    phases = args.phases.split(",")
    print(
        f"torch {torch.__version__}; {args.threads} thread(s); GPT n_layer {args.n_layer}, "
        f"n_embd {args.n_embd}, seq_len {args.seq_len}; effective batch {args.effective}; "
        f"budget = RSS once warm + {args.room} MiB; load {os.getloadavg()}",
        flush=True,
    )
    everything: dict = {"args": vars(args)}
    sizes: dict[str, int] = {}
    for kv in filter(None, args.sizes.split(",")):
        k, v = kv.split("=")
        sizes[k] = int(v)

    if "find" in phases:
        print("find (fixed length):", flush=True)
        found = {}
        for name in args.find.split(","):
            r = spawn(args, f"find:{name}", tmp, env)
            found[name] = r
            if r.get("ok"):
                sizes[name] = r["size"]
        everything["find"] = found
        print()
        print(f"{'contender':<21}{'size':>6}{'OOMs':>6}{'peak/budget':>13}{'budget MiB':>12}")
        for name, r in found.items():
            peak = r.get("peak")
            share = f"{peak / r['budget'] * 100:.1f}%" if peak and r.get("budget") else "-"
            print(
                f"{name:<21}{r.get('size', '-'):>6}{r.get('ooms', '-'):>6}{share:>13}"
                f"{r.get('budget', 0) / MIB:>12.1f}"
            )
            for key in ("sizes", "attempts", "trials", "found"):
                if key in r:
                    print(f"    {key}: {r[key]}")
        print(flush=True)

    if "speed" in phases:
        distinct = sorted(set(sizes.values()))
        print(f"speed (fixed length, sizes {distinct}):", flush=True)
        r = spawn(args, "speed:" + ",".join(map(str, distinct)), tmp, env)
        everything["speed"] = r
        if r.get("ok"):
            base = sizes.get("headroom", distinct[0])
            print(f"{'size':>6}{'samples/s, per round':>36}{'median':>9}{'× headroom':>22}")
            for s in distinct:
                per = [row.get(str(s)) for row in r["rounds"]]
                ratios = [
                    row[str(base)] / row[str(s)]
                    for row in r["rounds"]
                    if row.get(str(s)) and row.get(str(base))
                ]
                got = [p for p in per if p]
                shown = " ".join(f"{p:.1f}" if p else "OOM" for p in per)
                rr = (
                    f"{median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}]"
                    if ratios
                    else "-"
                )
                print(f"{s:>6}{shown:>36}{(median(got) if got else float('nan')):>9.1f}{rr:>22}")
            print(
                "× headroom: headroom's size's samples/s over this size's, per round (the "
                "median [range]); under 1: headroom's size is slower"
            )
            for e in r.get("oom_errors", []):
                print(f"  oom: {e}")
        print(flush=True)

    if "long" in phases:
        print(f"long ({args.steps} steps, lengths {args.seq_len // 4}..{args.seq_len}):")
        rows = {}
        wanted = args.long.split(",")
        for name, what, src in LONG:
            if name not in wanted:
                continue
            if src is not None and src not in sizes:
                print(f"  {name}: no size found, skipped")
                continue
            spec = f"long:{what}" + (f"@{sizes[src]}" if src else "")
            rows[name] = spawn(args, spec, tmp, env)
        everything["long"] = rows
        print()
        head = (
            f"{'contender':<21}{'start':>6}{'final':>6}{'OOMs':>5}{'restarts':>9}{'redo':>6}"
            f"{'samples/s':>10}{'tokens/s':>9}{'max peak':>9}{'≥95%':>6}{'run s':>7}"
        )
        print(head)
        print("-" * len(head))
        for name, r in rows.items():
            if not r.get("ok"):
                print(f"{name:<21} FAILED")
                continue
            b = r["budget"]
            pk = r["step_peaks"]
            over = sum(1 for p in pk if p >= 0.95 * b)
            start = sizes.get(dict((n, s) for n, _, s in LONG)[name] or "", args.effective)
            print(
                f"{name:<21}{start:>6}{r['sizes'][-1]:>6}{r['ooms']:>5}"
                f"{r.get('restarts', 0):>9}{r.get('redo_steps', 0):>6}"
                f"{r['samples'] / r['run_s']:>10.1f}{r['tokens'] / r['run_s']:>9.0f}"
                f"{max(pk) / b * 100:>8.1f}%{over:>6}{r['run_s']:>7.0f}"
            )
        print(
            "start: the size held (the peers': the find phase's) or started from (headroom, "
            "accelerate-search: E). redo: steps the HF Trainer's restarted loop would run "
            "again (not rerun). samples/s, tokens/s: over the whole run, settling and failed "
            "attempts included. max peak: the highest step peak / budget; ≥95%: steps whose "
            "peak reached 95% of the budget."
        )
        for name, r in rows.items():
            print(f"  {name}: budget {r.get('budget', 0) / MIB:.1f} MiB, load {r.get('load_end')}")
            for e in r.get("oom_errors", [])[:12]:
                print(f"    oom: {e}")
            if r.get("sizes"):
                changes = [
                    (i + 1, s) for i, s in enumerate(r["sizes"]) if i == 0 or r["sizes"][i - 1] != s
                ]
                print(f"    size from step: {changes[:20]}")
    if args.json:
        Path(args.json).write_text(json.dumps(everything))
    print(f"load at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
