"""A watch-only run's compressed log, bytes a step, at sampler rates side by side (the log
keeps the highest reading of each quarter second, host/src/log_thinning.rs): the same loop
(a small matmul and a 2 ms sleep, then `run.report`) at each rate, twice, alternating.
docs/BENCHMARKS.md, "Telemetry cost".

    ./dev python py/bench/log_size.py [--steps 3000] [--rates 4,20]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import headroom


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rates", default="4,20")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    x = torch.randn(64, 64)
    for hz in rates * 2:
        log = os.path.join(tempfile.mkdtemp(), "run.jsonl.zst")
        run = headroom.Run(f"size-{hz:g}", log=log, listen=None, sample_hz=hz, device="cpu")
        t0 = time.perf_counter()
        for _ in range(args.steps):
            y = (x @ x).sum()
            time.sleep(0.002)
            run.report(y)
        took = time.perf_counter() - t0
        run.finish()
        size = os.path.getsize(log)
        print(
            f"{hz:5g} Hz: {args.steps} steps in {took:.1f} s ({args.steps / took:.0f} steps/s), "
            f"{size} B, {size / args.steps:.1f} B/step"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
