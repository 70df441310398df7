"""The package's `headroom` command: the dashboard viewer (`headroom ls`, `attach`,
`replay`), the Rust viewer compiled into the extension. It imports no torch, so it starts
in milliseconds; `headroom train` belongs to the full build and says how to get it."""

from __future__ import annotations

# `signal` itself imports `enum` (a tenth of the command's start); `_signal` is its C core.
import _signal
import sys


def main() -> int:
    # As a native command: Ctrl-C ends `ls` or a question at once (Python's handler would
    # only set a flag the viewer never reads); raw mode takes Ctrl-C as a key anyway.
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    from ._native import viewer_main

    return viewer_main(["headroom", *sys.argv[1:]])


if __name__ == "__main__":  # python -m headroom._cli
    sys.exit(main())
