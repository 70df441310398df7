#!/usr/bin/env python3
"""Start to first frame of a viewer command, on a pseudo-terminal as a user runs it.

    python3 scripts/viewer_start.py N MARKER -- CMD... [-- CMD...]

Each command runs N times, alternating with the others; each run is timed from the fork
to the first output holding MARKER (text the first full frame draws, e.g. "completed"
for `headroom replay --end` of a finished run's log), then sent `q`. Prints the median
and the range per command, side by side."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import statistics
import struct
import sys
import termios
import time


def once(argv: list[str], marker: bytes, timeout: float = 30.0) -> float:
    started = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
        os.execvpe(argv[0], argv, dict(os.environ, TERM="xterm-256color"))
    seen, took = b"", None
    while time.perf_counter() - started < timeout:
        r, _, _ = select.select([fd], [], [], 0.01)
        if r:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
            if took is None and marker in seen:
                took = time.perf_counter() - started
                os.write(fd, b"q")
                break
    os.waitpid(pid, 0)
    os.close(fd)
    if took is None:
        raise SystemExit(f"{argv}: no {marker!r} within {timeout} s: {seen[-500:]!r}")
    return took


def main() -> None:
    args = sys.argv[1:]
    n, marker = int(args[0]), args[1].encode()
    cmds, cur = [], None
    for a in args[2:]:
        if a == "--":
            cur = []
            cmds.append(cur)
        else:
            cur.append(a)
    times: list[list[float]] = [[] for _ in cmds]
    # The machine's load: a start time is only comparable at the same load.
    before = os.getloadavg()
    for _ in range(n):
        for i, c in enumerate(cmds):
            times[i].append(once(c, marker))
    for c, t in zip(cmds, times):
        print(
            f"{statistics.median(t) * 1000:7.1f} ms median  "
            f"({min(t) * 1000:.1f}–{max(t) * 1000:.1f}, n={n})  {' '.join(c)}"
        )
    after = os.getloadavg()
    print(
        f"load average (1, 5, 15 min): {before[0]:.2f} {before[1]:.2f} {before[2]:.2f} before, "
        f"{after[0]:.2f} {after[1]:.2f} {after[2]:.2f} after; {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
