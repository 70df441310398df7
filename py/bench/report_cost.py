"""What one `run.report(loss)` costs the training thread, against a plain logger's record
(`json.dumps` of a step-sized dict and a buffered write), side by side (issue 34: a
report in microseconds). docs/BENCHMARKS.md, "What a report costs".

Each call is timed on its own, a --gap-us spin between calls standing for the step's
work (a report comes once a step; back to back, the reporter thread would be measured
catching up, not the step). Alternating blocks of --calls calls of each, --rounds rounds:
the median and 99th percentile of the per-call times, and the CPU the other threads (the
reporter, the log writer, the sampler) spent per call.

    ./dev python py/bench/report_cost.py [--calls 3000] [--rounds 5] [--gap-us 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import headroom


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gap-us", type=float, default=200.0)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    run = headroom.Run("report-cost", log=os.path.join(d, "run.jsonl"), listen=None)
    plain = open(os.path.join(d, "plain.jsonl"), "w", buffering=1 << 16)  # noqa: SIM115
    loss_t = torch.tensor(2.5)
    step = [0]

    def report_float():
        run.report(2.5)

    def report_tensor():
        run.report(loss_t)

    def logger():
        step[0] += 1
        record = {"kind": "step", "step": step[0], "loss": 2.5, "lr": 3e-4, "t": time.time()}
        plain.write(json.dumps(record) + "\n")

    def empty():
        pass

    gap = args.gap_us / 1e6
    clock = time.perf_counter

    def block(fn) -> tuple[list[float], float]:
        """Per-call times (µs) and the other threads' CPU per call (µs)."""
        out = []
        cpu0, own0 = time.process_time(), time.thread_time()
        for _ in range(args.calls):
            until = clock() + gap
            while clock() < until:
                pass
            t = clock()
            fn()
            out.append((clock() - t) * 1e6)
        others = (time.process_time() - cpu0) - (time.thread_time() - own0)
        return out, others / args.calls * 1e6

    names = ("empty", "logger", "float", "tensor")
    fns = {"empty": empty, "logger": logger, "float": report_float, "tensor": report_tensor}
    times: dict[str, list[float]] = {k: [] for k in names}
    others: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(args.rounds):
        for name in names:
            t, o = block(fns[name])
            times[name] += t
            others[name].append(o)
    run.finish()
    plain.close()
    base = statistics.median(times["empty"])
    print(
        f"per call ({args.rounds} rounds of {args.calls}, {args.gap_us:.0f} µs of work between "
        f"calls; an empty call, {base:.2f} µs, subtracted):"
    )
    med = {k: statistics.median(v) - base for k, v in times.items()}
    for k in ("logger", "float", "tensor"):
        p99 = statistics.quantiles(times[k], n=100)[98] - base
        ratio = "" if k == "logger" else f"  {med[k] / med['logger']:.2f}× the logger's record"
        print(
            f"  {k:<7} median {med[k]:6.2f} µs  p99 {p99:6.1f} µs  other threads' CPU "
            f"{statistics.median(others[k]):6.1f} µs{ratio}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
