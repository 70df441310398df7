"""Per-step overhead of headroom's Python layer against a bare PyTorch loop, side by side.

The model is a byte-level GPT of headroom's default config (4 layers, 4 heads, n_embd
128, seq_len 64, vocab 256, tied head), trained on seeded random token batches with an
effective batch of 128 cut into micro-batches of 8 (16 micro-batches of gradient
accumulation per optimizer step), AdamW at lr 3e-3. Modes, each with its own model and
optimizer built from the same seed, fed the same batches:

  bare      the manual accumulation loop: slice the batch into 8-sample micro-batches,
            (loss * len / N).backward(), then optimizer.step() and zero_grad()
  watch     the bare loop plus run.report(loss, samples=128, seq_len=64) once per step
  adaptive  loss = run.backward(batch, loss_fn); run.step(optimizer), with micro_batch=8
            and adaptive=False: the size is held at 8, so the work is the bare loop's
  grow      (not part of the ratios) the same with adaptive=True: the controller picks
            the micro-batch, which changes the work, not the overhead

The modes alternate (bare, watch, adaptive, grow, then watch, adaptive, grow, bare, ...:
each round starts one mode later): several rounds of --steps steps each, after a
warm-up, so that a slow spell of the machine hits every mode alike.
Each round of a headroom mode makes a new Run and finish()es it (one active run per
process). The table gives each mode's median step time, the spread of its per-round
medians, and the ratios to the bare loop of the same round (median and range over the
rounds): a ratio whose range straddles 1.0 is noise.

A step-time ratio cannot show an overhead smaller than the machine's noise, so the time
spent inside headroom's own code is also measured directly:

  watch     the whole of each run.report() call
  adaptive  run.backward() + run.step() minus the user's work they call: the loss
            function (timed by a wrapper), Tensor.backward (a timing wrapper patched onto
            torch.Tensor for every mode alike), optimizer.step() and zero_grad() (timing
            wrappers on the optimizer, in every mode alike). What is left is headroom's
            Python and Rust code plus the few scalar tensor ops of the accumulation
            (loss * weight, total += loss), which the bare loop does too: an upper bound.

--cprofile profiles one extra round of watch and adaptive and prints headroom's
functions by their own time.

Threads: torch.set_num_threads(1) by default. The benchmark machine has 2 shared, noisy
cores; with one intra-op thread torch's work stays on one core and headroom's sampler
thread (and the rest of the machine) has the other, so step times are far steadier than
with two threads fighting over both cores and the OS. --threads changes it.

Run it from the repository root:

    HEADROOM_STAGE=/work/stage-bench ./dev bench-python py/bench/overhead.py
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
from _gpt import make_model, make_optimizer, token_batches

import headroom

EFFECTIVE = 128
MICRO = 8
SEQ = 64

# ---- timing wrappers (installed for every mode alike) ------------------------------------


class Clock:
    """Seconds spent inside the wrapped user-side calls since the last take()."""

    def __init__(self):
        self.user = 0.0

    def take(self) -> float:
        u, self.user = self.user, 0.0
        return u


CLOCK = Clock()
_tensor_backward = torch.Tensor.backward


def _timed_backward(self, *args, **kwargs):
    t = time.perf_counter()
    try:
        return _tensor_backward(self, *args, **kwargs)
    finally:
        CLOCK.user += time.perf_counter() - t


torch.Tensor.backward = _timed_backward


def timed(fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK.user += time.perf_counter() - t

    return wrapper


class Contender:
    """One mode's model, optimizer and (timed) loss function."""

    def __init__(self, mode: str, seed: int):
        self.mode = mode
        self.model = make_model(seed)
        self.opt = make_optimizer(self.model)
        self.opt.step = timed(self.opt.step)
        self.opt.zero_grad = timed(self.opt.zero_grad)
        self.loss_fn = timed(self.model.loss)
        self.run: headroom.Run | None = None
        self.sizes: list[int] = []  # micro-batch after each step (headroom modes)
        self.glue: list[float] = []  # bare/watch: the loop's code between user calls

    # -- a round ----------------------------------------------------------------------

    def open(self, rnd: int) -> None:
        if self.mode == "watch":
            self.run = headroom.Run(f"bench-watch-{rnd}", device="cpu")
        elif self.mode in ("adaptive", "grow"):
            self.run = headroom.Run(
                f"bench-{self.mode}-{rnd}",
                model=self.model,
                device="cpu",
                effective_batch=EFFECTIVE,
                micro_batch=MICRO,
                adaptive=self.mode == "grow",
            )
        self.sizes = []

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

    def step(self, batch) -> tuple[float, float, float, float]:
        """One optimizer step: (wall seconds, seconds inside headroom's calls net of the
        user's work they ran, seconds in the user's work, the loss)."""
        CLOCK.take()
        if self.mode in ("bare", "watch"):
            t0 = time.perf_counter()
            x, y = batch
            n = len(x)
            total = torch.zeros(())
            for i in range(0, n, MICRO):
                mb = (x[i : i + MICRO], y[i : i + MICRO])
                loss = self.loss_fn(mb)
                w = len(mb[0]) / n
                (loss * w).backward()
                total += loss.detach() * w
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            value = float(total)
            own = 0.0
            if self.run is not None:
                t = time.perf_counter()
                self.run.report(value, samples=n, seq_len=SEQ)
                own = time.perf_counter() - t
            wall = time.perf_counter() - t0
            user = CLOCK.take()
            # The loop's own glue (slicing, weighting, accumulating, float) beside the
            # user's calls: the reference for the adaptive row, which includes the same.
            self.glue.append(wall - own - user)
            return wall, own, user, value
        t0 = time.perf_counter()
        value = self.run.backward(batch, self.loss_fn)
        self.run.step(self.opt)
        wall = time.perf_counter() - t0
        user = CLOCK.take()
        self.sizes.append(self.run.micro_batch)
        return wall, wall - user, user, value


# ---- statistics and the table -----------------------------------------------------------


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def ms(x: float) -> str:
    return f"{x * 1e3:8.1f}"


def us(x: float) -> str:
    return f"{x * 1e6:9.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12, help="rounds per mode (default 12)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per round (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--no-grow", action="store_true", help="skip the adaptive=True variant")
    ap.add_argument("--cprofile", action="store_true", help="profile one extra round")
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    # Runs serve their sockets in a private directory, not the user's.
    os.environ["HEADROOM_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="headroom-bench-")
    modes = ["bare", "watch", "adaptive"] + ([] if args.no_grow else ["grow"])
    batches = token_batches(args.steps, EFFECTIVE, SEQ, seed=args.seed)
    warm = token_batches(args.warmup, EFFECTIVE, SEQ, seed=args.seed + 1)
    cont = {m: Contender(m, args.seed) for m in modes}
    print(
        f"headroom {headroom.__file__}\ntorch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), {os.cpu_count()} CPUs; "
        f"{sum(p.numel() for p in cont['bare'].model.parameters()):,} parameters; "
        f"effective batch {EFFECTIVE}, micro-batch {MICRO}, seq_len {SEQ}; "
        f"{args.rounds} rounds x {args.steps} steps per mode after {args.warmup} warm-up",
        flush=True,
    )

    for m in modes:
        c = cont[m]
        c.open(-1)
        for b in warm:
            c.step(b)
        c.close()

    wall = {m: [] for m in modes}  # per round: list of step seconds
    own = {m: [] for m in modes}
    user = {m: [] for m in modes}
    losses = {m: [] for m in modes}  # the first round's losses (same data, same start)
    grow_sizes: list[list[int]] = []
    held = []
    for r in range(args.rounds):
        # Each round starts at the next mode: no mode always follows the same one.
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for m in order:
            c = cont[m]
            gc.collect()
            c.open(r)
            ws, os_, us_ = [], [], []
            for b in batches:
                w, o, u, v = c.step(b)
                ws.append(w)
                os_.append(o)
                us_.append(u)
                if r == 0:
                    losses[m].append(v)
            if m == "adaptive":
                held.append(set(c.sizes))
            if m == "grow":
                grow_sizes.append(list(c.sizes))
            c.close()
            wall[m].append(ws)
            own[m].append(os_)
            user[m].append(us_)
        line = "  ".join(f"{m} {ms(med(wall[m][-1])).strip()}" for m in modes)
        print(f"round {r + 1}/{args.rounds} (ms, median step): {line}", flush=True)

    # ---- the tables ----
    def ratios(series, m):
        a = [med(x) for x in series[m]]
        b = [med(x) for x in series["bare"]]
        rs = [x / y for x, y in zip(a, b)]
        return med(rs), min(rs), max(rs)

    print()
    print(
        f"Step time, ms: median over all {args.rounds * args.steps} steps; the per-round "
        "medians' min, max and spread ((max-min)/median); x bare: the ratio to the same "
        "round's bare median, median [min..max] over the rounds; compute: the same for the "
        "time inside the user's calls only (loss_fn, Tensor.backward, optimizer.step, "
        "zero_grad), which headroom does not change"
    )
    print(
        f"{'mode':<10}{'median':>9}{'min':>9}{'max':>9}{'spread':>8}"
        f"{'x bare':>8}{'range':>16}{'compute':>9}{'x bare':>8}{'range':>16}"
    )
    for m in modes:
        rm = [med(x) for x in wall[m]]
        allsteps = [s for x in wall[m] for s in x]
        comp = [s for x in user[m] for s in x]
        spread = (max(rm) - min(rm)) / med(rm)
        if m == "bare":
            cols = f"{'1.000':>8}{'':>16}{ms(med(comp)):>9}{'1.000':>8}{'':>16}"
        else:
            w, wl, wh = ratios(wall, m)
            c, cl, ch = ratios(user, m)
            cols = (
                f"{w:8.3f}{f'[{wl:.3f}..{wh:.3f}]':>16}"
                f"{ms(med(comp)):>9}{c:8.3f}{f'[{cl:.3f}..{ch:.3f}]':>16}"
            )
        print(
            f"{m:<10}{ms(med(allsteps)):>9}{ms(min(rm)):>9}{ms(max(rm)):>9}"
            f"{spread * 100:7.1f}%{cols}"
        )
    bare_r = [med(x) for x in wall["bare"]]
    if len(bare_r) > 1:
        moves = [abs(a / b - 1) for a, b in zip(bare_r[1:], bare_r[:-1])]
        print(
            f"noise: the bare loop's median moves {med(moves) * 100:.1f}% (median) and up "
            f"to {max(moves) * 100:.1f}% from one round to the next"
        )

    print()
    print(
        "Time inside headroom's own calls per step, µs: watch, the run.report() call; "
        "adaptive/grow, run.backward() + run.step() minus the user's calls they made"
    )
    print(f"{'mode':<10}{'median':>9}{'mean':>9}{'p90':>9}{'max':>9}{'% of bare step':>16}")
    bare_med = med([s for x in wall["bare"] for s in x])
    glue = med(cont["bare"].glue)
    for m in modes:
        if m == "bare":
            xs = sorted(cont["bare"].glue)
            label = "bare glue"
        else:
            xs = sorted(s for x in own[m] for s in x)
            label = m
        p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        print(
            f"{label:<10}{us(med(xs))}{us(statistics.fmean(xs))}{us(p90)}{us(xs[-1])}"
            f"{med(xs) / bare_med * 100:15.3f}%"
        )
        if m == "adaptive":
            net = med(xs) - glue
            print(f"{'  - glue':<10}{us(net)}{'':27}{net / bare_med * 100:15.3f}%")
    print(
        "bare glue: the bare loop's own code between the user's calls (slicing, loss * w, "
        "total +=, float, freeing each micro-batch's graph); adaptive's figure includes the "
        "same work done inside run.backward, so adaptive - glue is headroom's own cost. "
        "grow runs 1 micro-batch of 128 instead of 16 of 8: less glue, not comparable."
    )
    print()
    same = all(s == {MICRO} for s in held)
    print(
        f"adaptive (adaptive=False): micro-batch after each step {sorted(set().union(*held))}"
        + (" (held at 8, as asked)" if same else "  <-- NOT held at 8")
    )
    if grow_sizes:
        print(f"grow (adaptive=True): micro-batch after each step, round 1: {grow_sizes[0]}")
        print(f"  final micro-batch per round: {[s[-1] for s in grow_sizes]}")
    print("first round's losses (same data and start in every mode):")
    for m in modes:
        print(f"  {m:<9} " + " ".join(f"{v:.4f}" for v in losses[m]))

    if args.cprofile:
        pkg = os.path.dirname(os.path.abspath(headroom.__file__))
        for m in ("watch", "adaptive"):
            c = cont[m]
            c.open(10_000)
            prof = cProfile.Profile()
            prof.enable()
            for b in batches:
                c.step(b)
            prof.disable()
            c.close()
            print(f"\ncProfile, one round of {args.steps} steps, {m}: headroom's functions")
            st = pstats.Stats(prof)
            rows = []
            for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
                if file.startswith(pkg):
                    rows.append((ct, tt, nc, f"{os.path.basename(file)}:{line}({fn})"))
            rows.sort(reverse=True)
            print(f"{'cumulative ms/step':>19}{'own ms/step':>13}{'calls':>8}  function")
            for ct, tt, nc, name in rows[:14]:
                print(f"{ct / args.steps * 1e3:19.3f}{tt / args.steps * 1e3:13.3f}{nc:8d}  {name}")
            st2 = pstats.Stats(prof)
            natives = [
                (v[2], k[2])
                for k, v in st2.stats.items()
                if k[0] == "~" and ("NativeRun" in k[2] or "_native" in k[2])
            ]
            natives.sort(reverse=True)
            for tt, name in natives[:8]:
                print(f"{'':19}{tt / args.steps * 1e3:13.3f}{'':8}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
