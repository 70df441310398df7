"""How a `headroom.Run` answers the signals that would end its process: a stop (the step in
progress given up at its next micro-batch, or a watched loop asked to end at the step's
end), the checkpoint a user signal may ask for instead, and the window in which a repeat
of the same signal is the same request (docs/RELIABILITY.md, "Signals")."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time

from . import _dist

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


class StopSignals:
    """`headroom.Run`'s signal handling (a part of the class, kept here): the handlers it
    installs and restores, what a signal asks, and where the loop carries that out."""

    def _start_signals(self, on_usr1: str, on_usr2: str) -> None:
        """The run's signal state, then its handlers."""
        self._signalled: int | None = None
        self._signalled_at = 0.0
        self._signal_boundaries = 0
        self._stop_checkpointed = False
        # A stop gave a step up mid-way: the stop's checkpoint is then taken inside the
        # step (the parameters are the last completed step's), where a framework's own
        # save must happen at once, not at its batch's end (headroom.hf, .lightning).
        self.stop_gave_up_a_step = False
        self._saved_handlers: dict = {}
        # The user signals that checkpoint and go on instead of stopping.
        self._checkpoint_signals = {
            sig
            for sig, action in (
                (getattr(signal, "SIGUSR1", None), on_usr1),
                (getattr(signal, "SIGUSR2", None), on_usr2),
            )
            if sig is not None and action == "checkpoint"
        }
        self._checkpoint_asked: str | None = None
        self._in_poll = False
        self._pending_signals: list[int] = []
        self._install_signal_handlers()

    def _install_signal_handlers(self) -> None:
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
                self._saved_handlers[sig] = signal.SIG_DFL
                signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._saved_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                if _same_request(self._signalled, self._signalled_at, sig):
                    handler = _RepeatGuard(sig, self._signalled_at)
                signal.signal(sig, handler)
        self._saved_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        if self._in_poll:
            # Inside the extension's poll (paused): acted on as soon as it returns.
            self._pending_signals.append(signum)
            return
        self._handle_signal(signum)

    def _handle_pending_signals(self) -> None:
        """The signals that arrived while the extension was waiting, in order."""
        while self._pending_signals:
            self._handle_signal(self._pending_signals.pop(0))

    def _handle_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if signum in self._checkpoint_signals:
            self._ask_checkpoint(name)
            return
        if signum == signal.SIGXCPU and self._signalled is not None:
            # The kernel repeats SIGXCPU every second past the soft limit: the same
            # warning, not someone insisting.
            return
        if _same_request(self._signalled, self._signalled_at, signum):
            # GNU timeout signals the child and then its process group, a supervisor the
            # group, a user `kill PID` then `kill -PGID`: one request delivered twice
            # within microseconds, said once, not someone insisting.
            return
        if self._signalled is not None or self._native.ended:
            # Asked twice (or the loop is stuck between steps): end now, the run's end
            # recorded, then the signal's own default action.
            self.fail(f"killed by a second {name} at step {self._step}")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signalled = signum
        self._signalled_at = time.monotonic()
        if self._job is not None:
            # Every rank stops at the same step: the job agrees on it at the next step.
            self._job.on_signal(name)
            self._native.notice_text(
                f"{name}: the job stops at the next step's agreement, every rank at the same "
                f"step ({name} again within {SAME_SIGNAL_WINDOW_S:g} s is the same request; a "
                "second signal later ends this process at once)",
                level="warn",
                source="signal",
            )
            return
        self._native.request_stop(name)
        # Said at once on stderr too (the log and the dashboard have the notice).
        what = (
            f"a step in progress in run.backward() is abandoned at its next micro-batch; "
            f"{self._stop_saves('will be')}"
            if self._adaptive
            else "the loop is asked to stop at the end of the step in progress; "
            f"{self._stop_saves('will be', mid_step=True)}"
        )
        # A signal that interrupted a write to stderr makes this one a reentrant call
        # (RuntimeError): the notice in the log still says it.
        with contextlib.suppress(RuntimeError):
            print(f"headroom: {name}: stopping: {what}", file=sys.stderr, flush=True)

    def _stop_saves(self, verb: str, mid_step: bool = False) -> str:
        """What a stop saves: the last completed step (a watch-only loop's step in
        progress, when asked mid-step: the loop finishes it), through on_checkpoint, or
        nothing, said as such (never a checkpoint that will not be taken)."""
        if self._on_checkpoint is not None and mid_step and not self._adaptive:
            return f"the checkpoint {verb} taken at the end of the step in progress"
        if self._on_checkpoint is not None:
            return f"the checkpoint {verb} of step {self._step}"
        return (
            "no checkpoint is taken: this run has no on_checkpoint (give "
            "headroom.Run(on_checkpoint=fn), fn(step) saving and returning the path)"
        )

    def _ask_checkpoint(self, name: str) -> None:
        """A user signal set to "checkpoint": on_checkpoint at the end of the step in
        progress, and the loop goes on (a repeat before then is the same request)."""
        if self._checkpoint_asked is not None:
            return
        self._checkpoint_asked = name
        what = f"a checkpoint at the end of step {self._step + 1}; the run goes on"
        self._native.notice_text(f"{name}: {what}", source="signal")
        with contextlib.suppress(RuntimeError):
            print(f"headroom: {name}: {what}", file=sys.stderr, flush=True)

    def _checkpoint_if_asked(self) -> None:
        """At a step's end: the checkpoint a user signal asked for."""
        name, self._checkpoint_asked = self._checkpoint_asked, None
        if name is not None:
            self.notice(f"{name}: {self._carry_out('checkpoint')}")

    def _abandon_step_requested(self) -> bool:
        """Whether the step in progress is to be given up at this micro-batch boundary
        (a stop signal arrived). Under a process group the rank leaves its micro-batches
        for the agreement, where every rank gives the step up together."""
        return self._signalled is not None

    def _stop_between_micro_batches(self, done: int, samples: int) -> None:
        """Called in run.backward() before each micro-batch. After a stop signal the step
        is given up here, not finished: its partial gradients are dropped, the parameters
        are still those of the last completed step, which on_checkpoint saves; the run is
        recorded as stopped and the process exits with 128 + the signal. A resumed loop
        redoes the step. `done` of the step's `samples` were through."""
        if not self._abandon_step_requested():
            return
        if self._job is not None:
            raise _dist.Abandon(done, samples)
        signum = self._signalled
        name = signal.Signals(signum).name
        self._clear_grads()
        self.stop_gave_up_a_step = True
        took = time.perf_counter() - self._boundary_t
        self._native.notice_text(
            f"{name}: step {self._step + 1} abandoned after {done} of {samples} samples "
            f"({took:.1f} s in): {dropped(done, samples)}; {self._stop_saves('is')}, "
            f"and a resume redoes step {self._step + 1}",
            level="warn",
            source="signal",
        )
        self.finish()
        # What is left is the interpreter's teardown, whose final collections walk every
        # object torch made (8.8 s under a load of 13 on 2 cores; 3.6 s frozen, the same
        # as a bare `import torch` script's exit): frozen, they are not walked.
        gc.freeze()
        raise SystemExit(128 + signum)

    def _after_signal_boundary(self) -> None:
        """At each step's end after a stop signal: the first leaves the loop to read
        should_stop; a loop that steps again is ended here, the run finished as stopped."""
        self._signal_boundaries += 1
        if self._signal_boundaries == 1:
            return
        signum = self._signalled
        self.finish()
        raise SystemExit(128 + signum)

    def _checkpoint_for_stop(self) -> None:
        """A stop (the dashboard's, or a signal's) checkpoints once, as `headroom train`'s
        does, through on_checkpoint; at the step's end, or at finish() when the loop
        ended first."""
        if self._stop_checkpointed or self._on_checkpoint is None:
            return
        if not self._native.stop_requested or self._accumulated is not None:
            return
        self._stop_checkpointed = True
        self.notice(f"stop: {self._carry_out('checkpoint')}")
