"""How a `headroom.Run` answers the signals that would end its process: a stop (the step in
progress given up at its next micro-batch, or a watched loop asked to end at the step's
end), the checkpoint a user signal may ask for instead, and the window in which a repeat
of the same signal is the same request (docs/RELIABILITY.md, "Signals").

The run owns one `Signals`; under torchrun its rank (`_job.JobRank`) takes a stop to the
job's agreement, so every rank stops at the same step."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from ._state import RunState

# Signals whose default action ends the process (where the platform has them).
_STOP_SIGNALS = tuple(
    getattr(signal, n)
    for n in (
        "SIGTERM",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGXCPU",
        "SIGPWR",
        "SIGVTALRM",
        "SIGPROF",
    )
    if hasattr(signal, n)
)
# A repeat of the stop signal within this many seconds of the first is the same request
# (GNU timeout, a supervisor or `kill -TERM -PGID` deliver it twice within microseconds);
# a different signal, or the same one later, is a deliberate second request. The binary
# keeps the same rule (docs/RELIABILITY.md).
SAME_SIGNAL_WINDOW_S = 1.0


def _same_request(first: int | None, first_at: float, signum: int) -> bool:
    """Whether `signum` repeats the stop signal `first` (taken at `first_at`, monotonic)
    closely enough to be the same request."""
    return first == signum and time.monotonic() - first_at < SAME_SIGNAL_WINDOW_S


class _RepeatGuard:
    """The handler a run leaves for its stop signal when it ends within the window: a
    repeat still on its way (the group's copy of a `timeout`'s SIGTERM) is ignored; after
    the window the signal does what its default does. A later run takes it over as it
    would the default."""

    def __init__(self, signum: int, at: float):
        self.signum, self.at = signum, at

    def __call__(self, signum, frame) -> None:
        if _same_request(self.signum, self.at, signum):
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def dropped(done: int, samples: int) -> str:
    """What a stop drops of a step given up after `done` of its `samples`: its gradients
    are partial only when some samples were through and some still to come."""
    if done == 0:
        return "nothing of it had been computed"
    if done >= samples:
        return "its gradients, complete but not yet applied, are dropped"
    return "its partial gradients are dropped"


class Signals:
    """A run's signal handling: the handlers it installs and restores, what a signal
    asks, and where the loop carries that out. `finish` and `fail` end the run (a second
    signal ends it at once); `rank` is the run's rank, which may take a stop to its job."""

    def __init__(
        self,
        s: RunState,
        on_usr1: str,
        on_usr2: str,
        finish: Callable[[], None],
        fail: Callable[[str], None],
    ):
        self.s = s
        self.finish = finish
        self.fail = fail
        self.rank: Any = None
        self.signalled: int | None = None
        self.signalled_at = 0.0
        self.boundaries = 0
        self.stop_checkpointed = False
        # A stop gave a step up mid-way: the stop's checkpoint is then taken inside the
        # step (the parameters are the last completed step's), where a framework's own
        # save must happen at once, not at its batch's end (headroom.hf, .lightning).
        self.gave_up_a_step = False
        self.saved_handlers: dict = {}
        # The user signals that checkpoint and go on instead of stopping.
        self.checkpoint_signals = {
            sig
            for sig, action in (
                (getattr(signal, "SIGUSR1", None), on_usr1),
                (getattr(signal, "SIGUSR2", None), on_usr2),
            )
            if sig is not None and action == "checkpoint"
        }
        self.checkpoint_asked: str | None = None
        self.pending: list[int] = []

    def install(self) -> None:
        """Every signal whose default ends the process would end it without atexit: the
        log without its end, the socket left behind, no checkpoint. Each is taken over only
        where its default is still in force (the program's own handlers stay; Python's own
        SIGINT handler, KeyboardInterrupt, stays too, and Python ignores SIGXFSZ, so a write
        past `ulimit -f` raises OSError where it happened). USR1/USR2 stop like SIGTERM: a
        scheduler's `--signal=USR1@T` means the time is almost up."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in _STOP_SIGNALS:
            held = signal.getsignal(sig)
            if held == signal.SIG_DFL or isinstance(held, _RepeatGuard):
                self.saved_handlers[sig] = signal.SIG_DFL
                signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self.saved_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                if _same_request(self.signalled, self.signalled_at, sig):
                    handler = _RepeatGuard(sig, self.signalled_at)
                signal.signal(sig, handler)
        self.saved_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        if self.s.in_poll:
            # Inside the extension's poll (paused): acted on as soon as it returns.
            self.pending.append(signum)
            return
        self._handle(signum)

    def handle_pending(self) -> None:
        """The signals that arrived while the extension was waiting, in order."""
        while self.pending:
            self._handle(self.pending.pop(0))

    def _handle(self, signum: int) -> None:
        s = self.s
        name = signal.Signals(signum).name
        if signum in self.checkpoint_signals:
            self._ask_checkpoint(name)
            return
        if signum == signal.SIGXCPU and self.signalled is not None:
            # The kernel repeats SIGXCPU every second past the soft limit: the same
            # warning, not someone insisting.
            return
        if _same_request(self.signalled, self.signalled_at, signum):
            # GNU timeout signals the child and then its process group, a supervisor the
            # group, a user `kill PID` then `kill -PGID`: one request delivered twice
            # within microseconds, said once, not someone insisting.
            return
        if self.signalled is not None or s.native.ended:
            # Asked twice (or the loop is stuck between steps): end now, the run's end
            # recorded, then the signal's own default action.
            self.fail(f"killed by a second {name} at step {s.step}")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signalled = signum
        self.signalled_at = time.monotonic()
        if self.rank is not None and self.rank.stop_signal(name):
            # A job's rank: every rank stops at the same step, agreed at the next step.
            return
        s.native.request_stop(name)
        # Said at once on stderr too (the log and the dashboard have the notice).
        what = (
            f"a step in progress in run.backward() is abandoned at its next micro-batch; "
            f"{s.stop_saves('will be')}"
            if s.adaptive
            else "the loop is asked to stop at the end of the step in progress; "
            f"{s.stop_saves('will be', mid_step=True)}"
        )
        # A signal that interrupted a write to stderr makes this one a reentrant call
        # (RuntimeError): the notice in the log still says it.
        with contextlib.suppress(RuntimeError):
            print(f"headroom: {name}: stopping: {what}", file=sys.stderr, flush=True)

    def _ask_checkpoint(self, name: str) -> None:
        """A user signal set to "checkpoint": on_checkpoint at the end of the step in
        progress, and the loop goes on (a repeat before then is the same request)."""
        if self.checkpoint_asked is not None:
            return
        self.checkpoint_asked = name
        what = f"a checkpoint at the end of step {self.s.step + 1}; the run goes on"
        self.s.notice(f"{name}: {what}", source="signal")
        with contextlib.suppress(RuntimeError):
            print(f"headroom: {name}: {what}", file=sys.stderr, flush=True)

    def checkpoint_if_asked(self) -> None:
        """At a step's end: the checkpoint a user signal asked for."""
        name, self.checkpoint_asked = self.checkpoint_asked, None
        if name is not None:
            self.s.notice(f"{name}: {self.s.carry_out('checkpoint')}")

    def abandon_requested(self) -> bool:
        """Whether the step in progress is to be given up at this micro-batch boundary
        (a stop signal arrived). Under a process group the rank leaves its micro-batches
        for the agreement, where every rank gives the step up together."""
        return self.signalled is not None

    def give_up_step(self, done: int, samples: int) -> None:
        """One process, a stop signal mid-step: the step is given up here, not finished:
        its partial gradients are dropped, the parameters are still those of the last
        completed step, which on_checkpoint saves; the run is recorded as stopped and the
        process exits with 128 + the signal. A resumed loop redoes the step. `done` of
        the step's `samples` were through."""
        s = self.s
        signum = self.signalled
        name = signal.Signals(signum).name
        s.clear_grads()
        self.gave_up_a_step = True
        took = time.perf_counter() - s.boundary_t
        s.notice(
            f"{name}: step {s.step + 1} abandoned after {done} of {samples} samples "
            f"({took:.1f} s in): {dropped(done, samples)}; {s.stop_saves('is')}, "
            f"and a resume redoes step {s.step + 1}",
            level="warn",
            source="signal",
        )
        self.finish()
        # What is left is the interpreter's teardown, whose final collections walk every
        # object torch made (8.8 s under a load of 13 on 2 cores; 3.6 s frozen, the same
        # as a bare `import torch` script's exit): frozen, they are not walked.
        gc.freeze()
        raise SystemExit(128 + signum)

    def after_boundary(self) -> None:
        """At each step's end after a stop signal: the first leaves the loop to read
        should_stop; a loop that steps again is ended here, the run finished as stopped."""
        if self.signalled is None or not self.s.native.stop_requested:
            return
        self.boundaries += 1
        if self.boundaries == 1:
            return
        signum = self.signalled
        self.finish()
        raise SystemExit(128 + signum)

    def checkpoint_for_stop(self) -> None:
        """A stop (the dashboard's, or a signal's) checkpoints once, as `headroom train`'s
        does, through on_checkpoint; at the step's end, or at finish() when the loop
        ended first."""
        s = self.s
        if self.stop_checkpointed or s.on_checkpoint is None:
            return
        if not s.native.stop_requested or s.accumulated is not None:
            return
        self.stop_checkpointed = True
        s.notice(f"stop: {s.carry_out('checkpoint')}")
