"""A watch-only run that a test signals (test_signals.py). --mode: `check` reads
run.should_stop, `ignore` never does, `stuck` stops calling report altogether."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import headroom


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["check", "ignore", "stuck"], required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--checkpoints", required=True)
    args = ap.parse_args()
    saved = Path(args.checkpoints)

    def on_checkpoint(step: int) -> Path:
        path = saved / f"step-{step}.txt"
        path.write_text(str(step))
        return path

    run = headroom.Run("signalled", log=args.log, on_checkpoint=on_checkpoint)
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        if args.mode == "stuck" and step > 3:
            time.sleep(3600)
        run.report(1.0 / step)
        time.sleep(0.05)
        if args.mode == "check" and run.should_stop:
            break
    run.finish()
    print("finished cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
