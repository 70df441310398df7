"""What one `run.report(loss)` costs the training thread, against a plain logger's record
(`json.dumps` of a step-sized dict and a buffered write), side by side: alternating
blocks of --calls calls of each, --rounds rounds, medians of the per-call times (issue
34: a report in microseconds). docs/BENCHMARKS.md, "What a report costs".

    ./dev python py/bench/report_cost.py [--calls 5000] [--rounds 7]
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
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=7)
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

    def per_call(fn) -> float:
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        return (time.perf_counter() - t) / args.calls * 1e6

    times: dict[str, list[float]] = {"empty": [], "logger": [], "float": [], "tensor": []}
    fns = {"empty": empty, "logger": logger, "float": report_float, "tensor": report_tensor}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(per_call(fn))
    run.finish()
    plain.close()
    base = statistics.median(times["empty"])
    med = {k: statistics.median(v) - base for k, v in times.items() if k != "empty"}
    print(f"per call, median of {args.rounds} rounds of {args.calls} (an empty call subtracted):")
    for k in ("logger", "float", "tensor"):
        ratio = "" if k == "logger" else f"  ({med[k] / med['logger']:.1f}× the logger's record)"
        print(f"  {k:<7} {med[k]:7.1f} µs{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
