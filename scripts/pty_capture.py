#!/usr/bin/env python3
"""Run a command on a pseudo-terminal of a given size and keep what it drew.

    python3 scripts/pty_capture.py COLS ROWS SECONDS OUT.raw -- CMD [ARGS...]

After SECONDS it writes OUT.raw (every byte the program drew so far), sends `q`, and
waits for the program to exit (SIGTERM after 60 s more). Replay OUT.raw in a terminal of
the same size to see the screen, e.g. for a screenshot:

    tmux new-session -d -s cap -x COLS -y ROWS "cat OUT.raw; sleep 30"
    tmux capture-pane -e -p -t cap > screen.ansi
    python3 scripts/ansi2png.py screen.ansi shot.png

Used on the lent GPU machine, which has Python but maybe not tmux or a terminal.
"""
import fcntl
import os
import pty
import select
import signal
import struct
import sys
import termios
import time


def main():
    cols, rows, seconds, out = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    cmd = sys.argv[sys.argv.index("--") + 1:]
    pid, fd = pty.fork()
    if pid == 0:
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        os.environ["TERM"] = "xterm-256color"
        os.execvp(cmd[0], cmd)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    data = bytearray()
    start = time.time()
    sent_q = False
    status = None
    while status is None:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            data += chunk
        elapsed = time.time() - start
        if not sent_q and elapsed >= seconds:
            with open(out, "wb") as f:
                f.write(data)
            os.write(fd, b"q")
            sent_q = True
        if sent_q and elapsed >= seconds + 60:
            os.kill(pid, signal.SIGTERM)
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
    if not sent_q:
        with open(out, "wb") as f:
            f.write(data)
    with open(out + ".all", "wb") as f:
        f.write(data)
    code = os.waitstatus_to_exitcode(status)
    print(f"pty_capture: exit {code} after {time.time() - start:.1f} s, {len(data)} bytes")
    sys.exit(0 if code == 0 else 1)


if __name__ == "__main__":
    main()
