"""What the telemetry stream costs at each rate (issue 34: 20 Hz for ≤ 1% of a core): a
watch-only run with a log sits idle for --seconds while its sampler reads host memory
(and NVML and the allocator on a GPU) and the log writer writes the samples; the
process's CPU time over that window, less an idle window without a run, per second and
per sample. docs/BENCHMARKS.md, "Telemetry".

    ./dev python py/bench/telemetry_cost.py [--seconds 5] [--rates 4,10,20,50]
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


def cpu_over(seconds: float) -> float:
    """The process's CPU seconds over `seconds` of the main thread sleeping."""
    t = time.process_time()
    time.sleep(seconds)
    return time.process_time() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rates", default="4,10,20,50")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rates = [float(r) for r in args.rates.split(",")]
    rows: dict[float, list[tuple[float, int]]] = {r: [] for r in rates}
    idle = []
    for _ in range(args.rounds):
        idle.append(cpu_over(args.seconds))
        for hz in rates:
            log = os.path.join(tempfile.mkdtemp(), "run.jsonl")
            run = headroom.Run(
                f"telemetry-{hz:g}", log=log, listen=None, sample_hz=hz, device=device
            )
            time.sleep(0.5)  # the sampler's first reads (NVML's open) are not the rate's
            with open(log) as f:
                before = sum(1 for line in f if '"kind":"sample"' in line)
            cpu = cpu_over(args.seconds)
            run.finish()
            with open(log) as f:
                samples = [json.loads(line) for line in f if '"kind":"sample"' in line]
            rows[hz].append((cpu, len(samples) - before))
    base = statistics.median(idle)
    print(
        f"{device}: CPU over {args.seconds:g} s idle windows ({args.rounds} rounds; an idle "
        f"window without a run, {base * 1e3 / args.seconds:.2f} ms/s, subtracted):"
    )
    for hz in rates:
        cpu = statistics.median(c for c, _ in rows[hz]) - base
        got = statistics.median(n for _, n in rows[hz]) / args.seconds
        per_s = cpu / args.seconds
        print(
            f"  {hz:5g} Hz: {got:5.1f} samples/s written, {per_s * 1e3:6.2f} ms CPU a second "
            f"({per_s * 100:.2f}% of a core), {per_s / max(got, 1e-9) * 1e6:6.0f} µs a sample"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
