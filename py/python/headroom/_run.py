"""`headroom.Run`: a PyTorch training loop on headroom's stream, watched or steered."""

from __future__ import annotations

import atexit
import contextlib
import gc
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import _args, _batch, _dist, _native, _torch

LossFn = Callable[[Any], torch.Tensor]


class RunError(RuntimeError):
    """headroom was used in a way it cannot honour (the message says how to fix it)."""


class OutOfMemory(RuntimeError):
    """A step ran out of memory even at the smallest micro-batch."""


class OptimizerStepFailed(RuntimeError):
    """An out-of-memory error inside optimizer.step() after it had changed parameters or
    optimizer state, which cannot be undone: the parameters are not those of any step."""


class LossError(ValueError):
    """A loss function returned something that is not a finite scalar."""


_current: Run | None = None
# run.backward's answer to run.step when a torchrun job gave the step up (a stop).
_GIVEN_UP = ("given up",)
_current_lock = threading.Lock()
_uncaught: list[BaseException] = []


def _dropped(done: int, samples: int) -> str:
    """What a stop drops of a step given up after `done` of its `samples`: its gradients
    are partial only when some samples were through and some still to come."""
    if done == 0:
        return "nothing of it had been computed"
    if done >= samples:
        return "its gradients, complete but not yet applied, are dropped"
    return "its partial gradients are dropped"


def _excepthook(kind, value, tb):
    _uncaught.append(value)
    _previous_excepthook(kind, value, tb)


_previous_excepthook = sys.excepthook
sys.excepthook = _excepthook


def _default_name() -> str:
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") else ""
    return script or "python"


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


# What SIGUSR1/SIGUSR2 may mean (`on_usr1=`, `on_usr2=`; the binary's `run.on_usr1`).
_USER_SIGNAL_ACTIONS = ("stop", "checkpoint")
# The version of what state_dict() returns.
_STATE_VERSION = 1


class Run:
    """One training run on headroom's stream.

    Watch-only (no ``effective_batch``): call :meth:`report` once per step. Adaptive
    (``effective_batch=N`` and ``model=``): hand each batch to :meth:`backward` with a
    function computing a micro-batch's loss, then call :meth:`step` with the optimizer.
    See docs/PYTHON.md.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        model: torch.nn.Module | None = None,
        device: Any = None,
        total_steps: int = 0,
        effective_batch: int | None = None,
        micro_batch: int | None = None,
        min_micro_batch: int = 1,
        max_micro_batch: int | None = None,
        max_seq_len: int | None = None,
        adaptive: bool = True,
        memory_budget: str | int | None = None,
        hard_limit: bool = False,
        thresholds: str | None = None,
        profile: str | None = None,
        log: str | os.PathLike | None = None,
        listen: str | int | None = None,
        on_checkpoint: Callable[[int], Any] | None = None,
        sample_hz: float = 4.0,
        job_view: bool = True,
        finish_previous: bool = True,
        plan: Any = None,
        oom_snapshot: bool = False,
        on_usr1: str = "stop",
        on_usr2: str = "stop",
    ):
        global _current
        # Every argument is checked before anything happens: a mistake finishes no
        # previous run, opens no socket and sets no cap.
        name = _args.name(name)
        _args.model(model)
        device = _args.device(device)
        total_steps = _args.whole("total_steps", total_steps, 0, 1000)
        effective_batch = _args.optional_whole("effective_batch", effective_batch, 1)
        micro_batch = _args.optional_whole("micro_batch", micro_batch, 1, 8)
        min_micro_batch = _args.whole("min_micro_batch", min_micro_batch, 0, 1)
        max_micro_batch = _args.optional_whole("max_micro_batch", max_micro_batch, 1)
        max_seq_len = _args.optional_whole("max_seq_len", max_seq_len, 0, 1024)
        for what, v in (
            ("adaptive", adaptive),
            ("hard_limit", hard_limit),
            ("job_view", job_view),
            ("finish_previous", finish_previous),
            ("oom_snapshot", oom_snapshot),
        ):
            _args.flag(what, v)
        memory_budget = _args.memory_budget(memory_budget)
        thresholds = _args.thresholds(thresholds)
        profile = _args.profile(profile)
        log = _args.path("log", log)
        listen = _args.listen(listen)
        _args.callback(
            "on_checkpoint", on_checkpoint, "a function fn(step) that saves and returns the path"
        )
        sample_hz = _args.number("sample_hz", sample_hz, positive=True)
        for what, v in (("on_usr1", on_usr1), ("on_usr2", on_usr2)):
            if v not in _USER_SIGNAL_ACTIONS:
                raise ValueError(
                    f'{what}={v!r} is not an action; use "stop" (checkpoint and stop, the '
                    'default) or "checkpoint" (checkpoint at the step\'s end and go on)'
                )
            if v == "checkpoint" and on_checkpoint is None:
                raise ValueError(
                    f'{what}="checkpoint" needs on_checkpoint=fn (fn(step) saving and '
                    "returning the path): without it the signal would save nothing"
                )
        previous = _finish_previous(name, finish_previous)
        with _current_lock:
            if _current is not None and not _current.ended:
                raise RunError(
                    f"a headroom run ({_current.name!r}) is already active in this process; "
                    "finish() it, or use `with headroom.Run(...) as run:`, before creating "
                    "another (one process serves one run)"
                )
            _current = self
        try:
            if effective_batch is not None and model is None:
                raise RunError(
                    "an adaptive run (effective_batch=…) needs model=: headroom keeps or clears "
                    "its parameters' gradients across an out-of-memory error"
                )
            self.device = _torch.resolve_device(device, model)
            cuda = self.device.type == "cuda"
            ranks = _torch.rank_info()
            name = name or _default_name()
            job = None
            if ranks is not None:
                job_id = ranks["TORCHELASTIC_RUN_ID"] or "job"
                name = f"{name}.{job_id}.rank{ranks['RANK']}"
                job = (
                    job_id,
                    int(ranks["RANK"]),
                    int(ranks["LOCAL_RANK"] or ranks["RANK"]),
                    int(ranks["WORLD_SIZE"]),
                )
            world = _dist.world_size()
            joined = ranks is not None and world > 1 and (effective_batch is not None or job_view)
            if joined and effective_batch is not None:
                _dist.refuse_unsupported(model, world)
            budget = memory_budget
            if budget is not None and cuda and budget.strip().lower() != "auto":
                _torch.cap_cuda(self.device, _native.parse_bytes(budget))
            self._model = model
            self._params = (
                [p for p in model.parameters() if p.requires_grad] if model is not None else []
            )
            self._hard_limit = bool(hard_limit)
            if self._hard_limit and not cuda:
                _torch.start_thread_pools()
            self._on_checkpoint = on_checkpoint
            self._adaptive = effective_batch is not None
            self._effective = effective_batch or 0
            self._native = _native.NativeRun(
                name,
                producer=(
                    f"headroom.py (python {sys.version.split()[0]}, torch {torch.__version__})"
                ),
                device=str(self.device),
                device_name=_torch.device_name(self.device),
                parameters=(0 if model is None else sum(p.numel() for p in model.parameters())),
                total_steps=total_steps,
                effective_batch=self._effective,
                micro_batch=micro_batch or self._effective or 1,
                log=log,
                listen=listen,
                sample_hz=sample_hz,
                cuda_index=self.device.index if cuda else None,
                device_total=_torch.device_total(self.device),
                allocator=_torch.CudaAllocator(self.device) if cuda else None,
                memory_budget="" if budget is None else budget,
                hard_limit=self._hard_limit,
                thresholds=thresholds,
                profile=profile,
                adaptive=adaptive and self._adaptive,
                job=job,
                checkpoints=on_checkpoint is not None,
            )
            if log is not None and self._native.log_path != log:
                # Said where a script's user looks, as well as in the log itself.
                print(
                    f"headroom: {log} holds an earlier run's log, kept; this run logs to "
                    f"{self._native.log_path}",
                    file=sys.stderr,
                    flush=True,
                )
            self._job = None
            self._job_commands: list[str] = []
            if joined:
                # Collective: every rank's Run gets here (docs/PYTHON.md, torchrun).
                self._job = _dist.Job(self, model, self._params, job[0])
                self._say_job(world)
            self._meter = _torch.PeakMeter(self.device)
            if not self._meter.exact:
                self.notice(
                    "the kernel refused to reset the peak RSS (/proc/self/clear_refs); step "
                    "peaks are the process's peak so far and over-state later steps",
                    level="warn",
                )
            self._oom_snapshot = bool(oom_snapshot) and cuda
            if oom_snapshot and not cuda:
                self.notice(
                    "oom_snapshot: off on the CPU: the snapshot is the CUDA caching "
                    "allocator's (torch.cuda.memory._dump_snapshot), and the CPU has none"
                )
            if self._oom_snapshot:
                # What memory_viz shows needs the allocations' history from here on.
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            if self._adaptive:
                self._native.adapt(
                    micro_batch or self._effective,
                    min_micro_batch or 1,
                    max_micro_batch or 0,
                    max_seq_len or 0,
                    baseline=self._meter.held(),
                    adaptive=adaptive,
                )
                self._say_batch_range(micro_batch, min_micro_batch, max_micro_batch)
            # Which batch-size notices were given (a larger batch, a smaller one).
            self._batch_said: set[bool] = set()
            self._step = 0
            self._accumulated: tuple | None = None
            self._boundary_t = time.perf_counter()
            self._signalled: int | None = None
            self._signalled_at = 0.0
            self._signal_boundaries = 0
            self._stop_checkpointed = False
            self._optimizer_said = False
            self._parts_said = False
            # A headroom.plan(...): its prediction is logged beside each step's peak.
            self._plan = plan
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
            if previous is not None:
                self.notice(previous, level="warn")
        except BaseException:
            with _current_lock:
                _current = None
            raise
        atexit.register(self._at_exit)

    def _say(self, text: str, level: str = "warn") -> None:
        """A notice that a script's user must see: in the log, on the dashboard and on
        stderr."""
        self.notice(text, level=level)
        with contextlib.suppress(RuntimeError):
            print(f"headroom: {text}", file=sys.stderr, flush=True)

    def _say_batch_range(self, micro_batch, min_micro_batch, max_micro_batch) -> None:
        """Once, at the start: a micro-batch setting the run cannot honour as given, what
        it does instead and why (a micro-batch is a part of a step's batch)."""
        eff = self._effective
        top = eff if not max_micro_batch else min(max_micro_batch, eff)
        self._max_micro_batch = top
        low = min(max(min_micro_batch, 1), top)
        start = self._native.micro_batch
        said = []
        if max_micro_batch and max_micro_batch > eff:
            said.append(
                f"max_micro_batch={max_micro_batch} is above effective_batch={eff}: the "
                f"largest micro-batch is {eff}"
            )
        if min_micro_batch > top:
            said.append(f"min_micro_batch={min_micro_batch} is above {top}: the smallest is {top}")
        if micro_batch is not None and micro_batch != start:
            said.append(
                f"micro_batch={micro_batch} is outside {low}..{top}: the run starts at {start}"
            )
        if said:
            self._say(
                "; ".join(said) + f" (a micro-batch is a part of a step's batch of {eff} samples)"
            )

    def _say_batch_size(self, step: int, n: int) -> None:
        """Once: a batch handed to run.backward() that is not effective_batch samples. The
        step learns from the whole batch it is given (nothing is dropped or held back), so
        its effective batch is what was handed; the micro-batches stay in their range."""
        eff = self._effective
        if n == eff or (n > eff) in self._batch_said:
            return
        self._batch_said.add(n > eff)
        if n > eff:
            self._say(
                f"step {step}: run.backward() got a batch of {n} samples where "
                f"effective_batch={eff} was given: the step learns from the whole batch it "
                f"is handed, so its effective batch is {n} (logged as such), cut into "
                f"micro-batches of at most {self._max_micro_batch}. Create the run "
                f"with effective_batch={n}, or hand it batches of {eff}"
            )
        else:
            self.notice(
                f"step {step}: run.backward() got a batch of {n} samples, fewer than "
                f"effective_batch={eff} (a loader's last batch, say): the step learns from "
                f"the {n} it is handed, logged as its effective batch"
            )

    # ---- signals -------------------------------------------------------------------------

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
        took = time.perf_counter() - self._boundary_t
        self._native.notice_text(
            f"{name}: step {self._step + 1} abandoned after {done} of {samples} samples "
            f"({took:.1f} s in): {_dropped(done, samples)}; {self._stop_saves('is')}, "
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

    # ---- what a loop reads -------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def ended(self) -> bool:
        return self._native.ended

    @property
    def should_stop(self) -> bool:
        """True once a stop was asked (from the dashboard, `S`): end the loop."""
        return self._native.stop_requested

    @property
    def micro_batch(self) -> int | None:
        """The controller's micro-batch now (adaptive runs)."""
        return self._native.micro_batch

    @property
    def step_count(self) -> int:
        """Steps completed."""
        return self._step

    @property
    def log_path(self) -> str | None:
        """Where the run log goes: `log=`, or, when that holds an earlier run's log, the
        next free name beside it (`gpt-2.jsonl`)."""
        return self._native.log_path

    @property
    def socket(self) -> str | None:
        """The Unix socket `headroom attach` reaches this run on."""
        return self._native.socket

    @property
    def tcp(self) -> str | None:
        return self._native.tcp

    @property
    def token_file(self) -> str | None:
        return self._native.token_file

    @property
    def limit_bytes(self) -> int:
        return self._native.limit_bytes

    @property
    def thresholds(self) -> tuple[float, float, float, float]:
        return self._native.thresholds

    # ---- watch-only ----------------------------------------------------------------------

    def report(
        self,
        loss: float | torch.Tensor | None,
        *,
        samples: int | None = None,
        seq_len: int = 1,
        lr: float | None = None,
        grad_norm: float | None = None,
    ) -> None:
        """Ends a step of a loop that trains by itself: its loss, its peak memory (since
        the last report), then the dashboard's commands (pause waits here).

        The loss is a number or a one-element tensor, or None for a step that has none.
        As in an adaptive run, a NaN or infinite loss raises :class:`LossError` (here after
        the step is recorded, its loss missing: the loop has already applied it)."""
        if self._adaptive:
            raise RunError(
                "this run is adaptive: its steps end with run.step(optimizer), not "
                "run.report(); create the run without effective_batch= to only watch"
            )
        value = math.nan if loss is None else _scalar(loss, "the loss given to run.report()")
        samples = _args.optional_whole("run.report(samples=)", samples, 1, 32)
        seq_len = _args.whole("run.report(seq_len=)", seq_len, 1, 1)
        lr = _args.optional_number("run.report(lr=)", lr)
        grad_norm = _args.optional_number("run.report(grad_norm=)", grad_norm)
        step = self._step + 1
        now = time.perf_counter()
        dt = now - self._boundary_t
        n = samples or 1
        peak = self._meter.peak()
        self._native.observe(step, n, seq_len, peak)
        if self._plan is not None:
            self._native.plan_check(step, n, self._plan.predict(n), peak)
        self._native.step(step, value, n, n, seq_len, dt, n * seq_len, lr, grad_norm)
        self._step = step
        if loss is not None and not math.isfinite(value):
            error = (
                f"step {step}: the loss given to run.report() is {value} (training diverged, "
                "or the data holds a NaN/inf); the step is recorded without a loss. Lower the "
                "learning rate or check the batch"
            )
            self._native.notice_text(error, level="error", source="python")
            failure = LossError(error)
            if self._job is not None:
                # The other ranks learn it at this step's agreement, not by waiting there.
                self._job_fail(step, failure)
            raise failure
        if self._job is not None:
            self._job_note(n, peak, dt, value)
            self._job_agreed(step, self._job.agree(step))
        self._boundary()

    # ---- adaptive ------------------------------------------------------------------------

    def backward(
        self,
        batch: Any,
        loss_fn: LossFn,
        *,
        split: Callable[[Any, int, int], Any] | None = None,
        samples: int | None = None,
        seq_len: int | None = None,
        reduction: str = "mean",
        backward: Callable[[torch.Tensor], Any] | None = None,
        scaler: Any = None,
    ) -> float:
        """Forward and backward over `batch` in the controller's micro-batches; the
        gradients then equal one full-batch backward's. Returns the batch's loss.

        `loss_fn(micro_batch)` returns the micro-batch's scalar loss: its mean over the
        micro-batch's samples (`reduction="mean"`, weighted by its share of the batch) or
        a loss already normalised over the whole batch (`reduction="sum"`, added as is).
        An out-of-memory error anywhere in forward or backward is caught: the samples not
        yet done are retried smaller, the completed micro-batches' gradients kept.

        `backward(weighted_loss)` runs each micro-batch's backward in place of
        ``weighted_loss.backward()`` (Fabric: ``fabric.backward``; Lightning:
        ``self.manual_backward``); `scaler`, a ``torch.amp.GradScaler``, scales each
        micro-batch's weighted loss before it (give the same scaler to :meth:`step`).
        """
        if not self._adaptive:
            raise RunError(
                "run.backward() needs an adaptive run: create it with effective_batch=N "
                "and model=model (a watch-only run reports with run.report(loss))"
            )
        if self._native.ended:
            raise RunError("this run has ended; create a new headroom.Run")
        if self._accumulated is not None:
            raise RunError(
                "run.backward() was called twice without run.step(optimizer) between: the "
                "second batch's gradients would add to the first's; call run.step(optimizer) "
                "after each run.backward()"
            )
        if reduction not in ("mean", "sum"):
            raise ValueError(f'reduction={reduction!r}: use "mean" or "sum"')
        _args.callback(
            "run.backward(batch, loss_fn)'s loss_fn",
            loss_fn,
            "a function of a micro-batch returning its loss, e.g. lambda mb: model.loss(mb)",
        )
        if loss_fn is None:
            raise TypeError(
                "run.backward(batch, loss_fn): loss_fn is None; give a function of a "
                "micro-batch returning its loss, e.g. lambda mb: model.loss(mb)"
            )
        _args.callback("run.backward(split=)", split, "a function split(batch, start, end)")
        _args.callback("run.backward(backward=)", backward, "a function of the weighted loss")
        samples = _args.optional_whole("run.backward(samples=)", samples, 1, 32)
        seq_len = _args.optional_whole("run.backward(seq_len=)", seq_len, 1, 128)
        if self._job is None:
            _refuse_distributed()
        job = self._job
        if split is None:
            n = _batch.size_of(batch)
            cut = _batch.take_dynamic if _torch.is_compiled(self._model) else _batch.take
        else:
            if samples is None:
                samples = _samples_of(batch)
            n = samples
            cut = split
        if n < 1:
            raise _batch.BatchError("the batch holds no samples")
        self._say_batch_size(self._step + 1, n)
        seq = seq_len or (_batch.seq_len_of(batch) if split is None else 1)
        step = self._step + 1
        t0 = time.perf_counter()
        mb, free = self._native.before_step(step, seq)
        if free:
            _torch.free_memory(self.device)
        if job is not None:
            job.sync_buffers(step)
        given_up = None
        try:
            with job.no_sync() if job is not None else contextlib.nullcontext():
                total, mb, predicted = self._accumulate(
                    batch, loss_fn, cut, n, seq, step, mb, reduction, backward, scaler
                )
            value = float(total)
            if not math.isfinite(value):
                raise LossError(
                    f"step {step}: the batch's loss is {value} (training diverged, or the data "
                    "holds a NaN/inf); the gradients were cleared. Lower the learning rate or "
                    "check the batch"
                )
        except _dist.Abandon as e:
            # A stop signal on this rank: the step is given up at the agreement, by every
            # rank together (below).
            given_up = e
        except BaseException as e:
            # Whatever ends the step early (a bad loss, an error in loss_fn, Ctrl-C)
            # leaves no gradient of it behind: a retried step starts clean.
            self._clear_grads()
            if job is not None:
                self._job_fail(step, e)
            raise
        if job is not None:
            agreed = job.agree(step, _dist.ABANDON if given_up else _dist.OK)
            self._job_agreed(step, agreed)
            if agreed.abandon:
                return self._give_up_step(step, given_up)
            job.reduce(step, agreed.grads_agree)
        self._accumulated = (step, mb, seq, n, t0, value, predicted)
        return value

    def _give_up_step(self, step: int, here: _dist.Abandon | None) -> float:
        """A job's stop during a step: every rank drops the step's gradients at the same
        agreement; the parameters are those of the last completed step, which the stop's
        checkpoint (at run.step's boundary) saves on every rank. Returns NaN: the step has
        no loss, and run.step applies nothing."""
        self._clear_grads()
        where = f"after {here.done} of {here.samples} samples on this rank " if here else ""
        dropped = _dropped(here.done, here.samples) if here else "its gradients are dropped"
        self._native.notice_text(
            f"step {step} given up by every rank of the job {where}(a stop signal): "
            f"{dropped}; {self._stop_saves('is')}, and a resume redoes step {step}",
            level="warn",
            source="signal",
        )
        self._accumulated = _GIVEN_UP
        return math.nan

    def _accumulate(
        self, batch, loss_fn, cut, n: int, seq: int, step: int, mb: int, reduction, backward, scaler
    ):
        """The micro-batches of one step, forward and backward, with out-of-memory errors
        caught and the remaining samples retried smaller; returns the weighted loss, the
        micro-batch it ended at and the memory predicted for it."""
        total = torch.zeros((), device=self.device)
        start = 0
        self._meter.reset()
        predicted = self._native.predicted_bytes(mb, seq)
        while start < n:
            self._stop_between_micro_batches(start, n)
            end = min(n, start + mb)
            failed = None
            in_backward = False
            versions = self._grad_versions()
            try:
                loss = loss_fn(cut(batch, start, end))
                _check_loss(loss, step, start, end)
                weight = (end - start) / n if reduction == "mean" else 1.0
                in_backward = True
                _backward_of(loss * weight, backward, scaler)
                total += loss.detach() * weight
            except Exception as e:
                if not _torch.is_oom(e, capped=self._hard_limit):
                    raise
                failed = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            loss = None
            if failed is None:
                start = end
                continue
            # Out of memory: the attempt's tensors went with its frames.
            restart = in_backward and self._grads_changed(versions)
            retry, _ = self._native.oom(step, mb, seq, failed)
            self._snapshot_oom(step)
            _torch.free_memory(self.device)
            if retry is None:
                raise OutOfMemory(
                    f"step {step} ran out of memory at micro-batch {mb} ({seq} tokens per "
                    f"sample) repeatedly: {failed}; {self._save_on_give_up()}. Give the run "
                    "more memory or make a sample smaller"
                )
            if restart:
                # The backward had already added part of this micro-batch's gradients:
                # they cannot be told apart from the completed ones', so the step's
                # samples start over (exact, at the cost of recomputing them).
                self.notice(
                    f"step {step}: the out-of-memory error struck after gradients were "
                    "partly accumulated; the step's samples start over at micro-batch "
                    f"{retry}",
                    level="warn",
                )
                self._clear_grads()
                total = torch.zeros((), device=self.device)
                start = 0
            mb = retry
            self._meter.reset()
            predicted = self._native.predicted_bytes(mb, seq)
        return total, mb, predicted

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        zero_grad: bool = True,
        grad_norm: float | None = None,
        scaler: Any = None,
    ) -> None:
        """Ends an adaptive step: ``optimizer.step()`` (all or nothing under an OOM),
        ``optimizer.zero_grad()``, the step's peak to the controller, then the
        dashboard's commands (pause waits here). With `scaler` (the GradScaler given to
        :meth:`backward`): ``scaler.step(optimizer)`` and ``scaler.update()``; a step it
        skips for inf/NaN gradients is said on the dashboard and not fed to the
        controller (its peak lacks the optimizer's update)."""
        _args.optimizer(optimizer)
        grad_norm = _args.optional_number("run.step(grad_norm=)", grad_norm)
        if self._accumulated is None:
            raise RunError(
                "run.step(optimizer) without run.backward(batch, loss_fn) before it: there "
                "are no gradients of this run to apply"
            )
        if self._accumulated is _GIVEN_UP:
            # The job gave the step up (a stop): nothing to apply; the boundary checkpoints.
            self._accumulated = None
            self._boundary()
            return
        step, mb, seq, n, t0, value, predicted = self._accumulated
        if not self._optimizer_said:
            self._optimizer_said = True
            advice = _torch.optimizer_advice(optimizer)
            if advice:
                self.notice(advice, level="warn")
        try:
            self._optimizer_step(optimizer, step, scaler)
        except BaseException as e:
            if self._job is not None:
                self._job_fail(step, e)
            raise
        skipped = _scaler_update(scaler, optimizer)
        if not self._parts_said and not skipped:
            # Once, while the gradients and the optimizer's state both exist: what the
            # fixed part of a step is made of (the optimizer-state hint reads it).
            self._parts_said = True
            self._native.memory_parts(*_torch.memory_parts(self._model, optimizer))
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
        self._accumulated = None
        peak = self._meter.peak()
        if skipped:
            next_mb, free = self._say_skipped(step, skipped), False
        else:
            next_mb, free = self._native.observe(step, mb, seq, peak, predicted_bytes=predicted)
            if self._plan is not None:
                self._native.plan_check(step, mb, self._plan.predict(mb), peak)
        if free:
            _torch.free_memory(self.device)
        dt = time.perf_counter() - t0
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        self._native.step(step, value, mb, n, seq, dt, n * seq, _opt(lr), grad_norm)
        self._step = step
        if self._job is not None:
            self._job_note(next_mb, peak, dt, value)
        self._boundary()

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, step: int, scaler=None) -> None:
        """optimizer.step(), retried after an OOM that changed nothing it cannot restore.

        What an optimizer changes in place is visible in the tensors' version counters:
        an OOM before any parameter or state tensor changed (the first step's state
        allocation, a temporary) is undone by dropping the state it created and restoring
        its step counters, then retried; one after is refused loudly, never passed off.
        """
        for attempt in range(3):
            snapshot = _OptimizerSnapshot(optimizer)
            try:
                if scaler is None:
                    optimizer.step()
                else:
                    scaler.step(optimizer)
                return
            except Exception as e:
                if not _torch.is_oom(e, capped=self._hard_limit):
                    raise
                text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _torch.free_memory(self.device)
            if not snapshot.restore():
                self._native.notice_text(
                    f"step {step}: out of memory inside optimizer.step() after it had "
                    f"updated some parameters ({text})",
                    level="error",
                    source="memory",
                )
                raise OptimizerStepFailed(
                    f"step {step}: out of memory inside optimizer.step() after it had "
                    f"changed parameters or their state ({text}); those changes cannot be "
                    "undone. Resume from your last checkpoint with more memory, or a "
                    "smaller model"
                )
            self._native.notice_text(
                f"step {step}: out of memory inside optimizer.step() before it changed "
                f"anything ({text}); cache freed, retried (attempt {attempt + 2})",
                level="warn",
                source="memory",
            )
        raise OutOfMemory(f"step {step}: optimizer.step() ran out of memory three times")

    def _save_on_give_up(self) -> str:
        """As `headroom train` does when it gives up: the last completed step saved through
        on_checkpoint (its parameters and optimizer state are untouched by the step given
        up), with the hard cap lifted meanwhile, since the cap is for training's
        allocations and the callback's own objects may need what it holds back. Returns
        what became of the save, for the error."""
        if self._on_checkpoint is None:
            return "no checkpoint was taken (pass on_checkpoint=fn to have one)"
        if self._job is not None:
            return "no checkpoint was taken (under torchrun a save is every rank's together)"
        lifted = _native.lift_cap()
        try:
            path = self._on_checkpoint(self._step)
        except Exception as e:
            return f"the checkpoint failed too: {type(e).__name__}: {e}"
        finally:
            if lifted:
                _native.restore_cap()
        where = "" if path is None else f" at {os.fspath(path)}"
        if path is not None:
            self._native.checkpoint_saved(self._step, os.fspath(path))
        said = f"the state after step {self._step} is saved by on_checkpoint{where}"
        self._native.notice_text(said, level="warn", source="checkpoint")
        return said

    def _say_skipped(self, step: int, scales: tuple[float, float]) -> int:
        """Says the scaler skipped `step`; the micro-batch stays as it is."""
        self._native.notice_text(
            f"step {step}: the GradScaler skipped the optimizer step (inf/NaN gradients); "
            f"loss scale {scales[0]:g} → {scales[1]:g}; not fed to the memory controller",
            level="warn",
            source="python",
        )
        return self._native.micro_batch

    def _grad_versions(self) -> list:
        return [None if p.grad is None else (id(p.grad), p.grad._version) for p in self._params]

    def _grads_changed(self, versions: list) -> bool:
        return versions != self._grad_versions()

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    # ---- a torchrun job -------------------------------------------------------------------

    def _say_job(self, world: int) -> None:
        job = self._job
        if self._adaptive:
            text = (
                f"torchrun job {job.job_id}: rank {job.rank} of {world}; effective_batch "
                f"{self._effective} is per rank, so the global batch is {self._effective * world} "
                "samples per step. Each rank's controller sizes its own micro-batches (all under "
                "DDP's no_sync(), so an out-of-memory error stays local); after every rank's "
                "micro-batches the ranks agree, then the gradients are all-reduced once"
            )
        else:
            text = (
                f"torchrun job {job.job_id}: rank {job.rank} of {world}, watched; each report "
                "joins the job's agreement (rank 0 serves every rank's row; commands reach "
                "every rank at the same step)"
            )
        self.notice(text)

    def _job_note(self, micro_batch: int, peak: int, dt: float, loss: float) -> None:
        """This rank's figures for its row at the next agreement."""
        limit, usage = self._native.last_memory
        self._job.last = {
            "micro_batch": float(micro_batch),
            "peak": float(peak),
            "limit": float(limit),
            "usage": usage,
            "step_time": dt,
            "loss": loss,
        }

    def _job_fail(self, step: int, error: BaseException) -> None:
        """This rank cannot finish the step: the others learn why at the agreement,
        instead of waiting there for it."""
        if isinstance(error, _dist.RankFailed):
            return
        text = f"{type(error).__name__}: {error}".strip()
        # Best effort: the original error is what this rank raises either way.
        with contextlib.suppress(Exception):
            self._job.agree(step, _dist.FAILED, error=text)

    def _job_agreed(self, step: int, a: _dist.Agreement) -> None:
        """What the agreement says every rank does: end (another rank failed), take the
        commands at this step's end, stop after this step."""
        if a.failed:
            self._clear_grads()
            rank, text = next(iter(a.failed.items()))
            raise _dist.RankFailed(
                f"step {step}: rank {rank} of the job failed ({text}); rank {self._job.rank} "
                "ends too"
            )
        self._job_commands = a.commands
        if a.stop_by and not self._native.stop_requested:
            who = ", ".join(map(str, a.stop_by))
            self._native.request_stop(
                f"a stop signal (rank {who}); every rank of the job stops after step {step}"
            )

    def _job_boundary(self) -> None:
        """The step boundary of a job: the commands agreed on, then, while paused, rounds
        of the agreement every 100 ms, so every rank resumes (or stops) at the same one."""
        job = self._job
        while True:
            commands, self._job_commands = self._job_commands, []
            actions = self._native.apply_commands(commands)
            job.applied += len(commands)
            while self._pending_signals:
                self._handle_signal(self._pending_signals.pop(0))
            for cid, kind in actions:
                self._native.confirm(cid, self._carry_out(kind))
            if not self._native.paused:
                return
            self._job_agreed(self._step, job.agree(self._step, wait_s=0.1))

    def _take_commands(self, wait_s: float) -> list[str]:
        """A viewer's commands, raw, for the job's agreement. A signal arriving while the
        extension waits is acted on after (it would need the run the wait borrows)."""
        self._in_poll = True
        try:
            return self._native.take_commands(wait_s)
        finally:
            self._in_poll = False
            while self._pending_signals:
                self._handle_signal(self._pending_signals.pop(0))

    # ---- both ----------------------------------------------------------------------------

    def notice(self, text: str, level: str = "info") -> None:
        """A line in the dashboard's event log (level: info, warn, error)."""
        self._native.notice_text(str(text), level=level, source="python")

    def eval(self, val_loss: float, train_loss: float | None = None, tokens: int = 0) -> None:
        """A validation result at the current step."""
        v = _scalar(val_loss, "val_loss")
        t = v if train_loss is None else _scalar(train_loss, "train_loss")
        self._native.eval(self._step, v, t, tokens)

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue this run as if it had never stopped: the
        steps done and, for an adaptive run, the controller's journal (every call that
        changed it), which :meth:`load_state_dict` replays. Save it with the model's and
        the optimizer's state (it is plain data: ints, strings)."""
        return {"version": _STATE_VERSION, "native": self._native.state()}

    def load_state_dict(self, state: dict) -> None:
        """Continues from a checkpoint's :meth:`state_dict`, right after creating the run
        (before its first step): the step count goes on from the saved step, and an
        adaptive run's controller is the one the run had (same micro-batch, the sizes it
        measured, a ceiling an out-of-memory error taught), so the resumed loop splits its
        steps as the uninterrupted one would have. A `memory_budget="auto"` keeps the
        budget the run resolved at its start."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise RunError(
                f"load_state_dict() needs what run.state_dict() returned (a dict with "
                f"version {_STATE_VERSION}), got {type(state).__name__}"
                + (f" version {state.get('version')!r}" if isinstance(state, dict) else "")
            )
        if self._step != 0 or self._accumulated is not None:
            raise RunError(
                f"load_state_dict() after step {self._step}: call it right after creating "
                "the run, before its first step"
            )
        self._step = self._native.restore(state["native"])

    def checkpoint_saved(self, path: str | os.PathLike) -> None:
        """Tells the dashboard the loop wrote a checkpoint."""
        self._native.checkpoint_saved(self._step, os.fspath(path))

    def finish(self) -> None:
        """Ends the run: attached dashboards show it finished; the socket goes."""
        if self._native.ended:
            return
        self._checkpoint_for_stop()
        warning = self._native.finish()
        self._release()
        if warning:
            print(f"headroom: warning: {warning}", file=sys.stderr)

    def fail(self, reason: str) -> None:
        if self._native.ended:
            return
        self._native.fail(str(reason))
        self._release()

    def _snapshot_oom(self, step: int) -> None:
        """With oom_snapshot=True on CUDA: what the allocator held when a step ran out of
        memory, as the pickle PyTorch's memory_viz reads, beside the log (or in the
        working directory without one); its path goes in the event log."""
        if not self._oom_snapshot:
            return
        log = self.log_path
        base = Path(log).with_suffix("") if log else Path.cwd() / self.name
        path = f"{base}.oom-step{step}.pickle"
        try:
            torch.cuda.memory._dump_snapshot(path)
        except Exception as e:  # a snapshot must never end the run it explains
            self.notice(f"step {step}: the out-of-memory snapshot failed: {e}", level="warn")
            return
        self.notice(
            f"step {step}: out of memory: the allocator's state then is in {path} "
            "(open it at https://pytorch.org/memory_viz)",
            level="warn",
        )

    def _release(self) -> None:
        global _current
        if getattr(self, "_oom_snapshot", False):
            torch.cuda.memory._record_memory_history(enabled=None)
        self._restore_signal_handlers()
        with _current_lock:
            if _current is self:
                _current = None
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        if self._native.ended:
            return
        if _uncaught:
            e = _uncaught[-1]
            self.fail(f"{type(e).__name__}: {e}")
        else:
            self.finish()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if value is None:
            self.finish()
        elif isinstance(value, KeyboardInterrupt):
            self.fail(f"interrupted (KeyboardInterrupt) after step {self._step}")
        else:
            self.fail(f"{type(value).__name__}: {value}")

    def _boundary(self) -> None:
        self._boundary_t = time.perf_counter()
        while self._job is None:
            self._in_poll = True
            try:
                actions = self._native.poll()
            finally:
                self._in_poll = False
            while self._pending_signals:
                self._handle_signal(self._pending_signals.pop(0))
            for cid, kind in actions:
                self._native.confirm(cid, self._carry_out(kind))
            # Also while paused: the saving is what the signal's sender waits for.
            self._checkpoint_if_asked()
            if not self._native.paused:
                break
        if self._job is not None:
            self._job_boundary()
        self._checkpoint_if_asked()
        self._checkpoint_for_stop()
        if self._signalled is not None and self._native.stop_requested:
            self._after_signal_boundary()
        self._boundary_t = time.perf_counter()
        self._meter.reset()

    def _carry_out(self, kind: str) -> str:
        if kind == "free_cache":
            before = _torch.held_text(self.device)
            _torch.free_memory(self.device)
            return f"cached memory freed: {before} → {_torch.held_text(self.device)}"
        if kind == "checkpoint":
            if self._on_checkpoint is None:
                return (
                    "refused: this run has no checkpoint callback (give "
                    "headroom.Run(on_checkpoint=fn), fn(step) saving and returning the path)"
                )
            try:
                path = self._on_checkpoint(self._step)
            except Exception as e:
                self._native.notice_text(
                    f"checkpoint failed: {type(e).__name__}: {e}",
                    level="error",
                    source="checkpoint",
                )
                return f"checkpoint failed: {type(e).__name__}: {e}"
            if path is None:
                return f"checkpoint of step {self._step} written by the callback"
            self._native.checkpoint_saved(self._step, os.fspath(path))
            return f"checkpoint of step {self._step} at {os.fspath(path)}"
        return f"not understood: {kind}"


class _OptimizerSnapshot:
    """What optimizer.step() may change, seen before it runs: version counters of the
    parameters and state tensors, the scalar state (step counters) by value, and which
    parameters had no state yet."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.versions = [p._version for p in self.params]
        self.stateless = [p for p in self.params if not opt.state.get(p)]
        self.tensors = []
        self.scalars = []
        for p in self.params:
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    if v.numel() == 1:
                        self.scalars.append((v, v.detach().clone()))
                    else:
                        self.tensors.append((v, v._version))

    def restore(self) -> bool:
        """Undoes a failed step that changed nothing but scalars and new state; False
        when a parameter or a state tensor was changed in place."""
        if any(p._version != v for p, v in zip(self.params, self.versions)):
            return False
        if any(t._version != v for t, v in self.tensors):
            return False
        with torch.no_grad():
            for t, v in self.scalars:
                t.copy_(v)
        for p in self.stateless:
            self.opt.state.pop(p, None)
        return True


def _backward_of(weighted: torch.Tensor, backward: Callable | None, scaler: Any) -> None:
    """One micro-batch's backward: the loss scaled per micro-batch when a GradScaler is
    given (scaling is linear, so the scaled sum is the scaled full-batch loss), then the
    user's backward (a framework's, carrying its precision and strategy) or autograd's."""
    if scaler is not None:
        weighted = scaler.scale(weighted)
    if backward is None:
        weighted.backward()
    else:
        backward(weighted)


def _scaler_update(scaler: Any, optimizer: torch.optim.Optimizer) -> tuple[float, float] | None:
    """``scaler.update()`` after its step; the loss scale before and after when the step
    was skipped for inf/NaN gradients (None when it was taken, or with no scaler)."""
    if scaler is None:
        return None
    found_inf = scaler.is_enabled() and any(
        v.item() for v in scaler._found_inf_per_device(optimizer).values()
    )
    before = scaler.get_scale()
    scaler.update()
    return (before, scaler.get_scale()) if found_inf else None


def _finish_previous(name: str | None, allowed: bool) -> str | None:
    """A new run in a process whose previous run is still active (a notebook cell run
    again, a script that forgot finish()) finishes that one first, as experiment trackers'
    init does, saying so in its log and on its dashboard; returns what the new run says.
    `allowed=False` keeps the old strictness: the new run is refused."""
    previous = _current
    if previous is None or previous.ended or not allowed:
        return None
    new = name or _default_name()
    at = f"step {previous.step_count}"
    previous.notice(
        f"finished by a new run ({new!r}) created in this process at {at}", level="warn"
    )
    previous.finish()
    text = (
        f"the previous run {previous.name!r}, still active in this process, was finished at "
        f"{at} by this new run (pass finish_previous=False to refuse instead)"
    )
    print(f"headroom: {text}", file=sys.stderr)
    return text


def _samples_of(batch: Any) -> int:
    """With split=: the samples of a tensor (dim 0) or of a list (one item a sample). Any
    other batch must say (samples=): a tuple's, dict's or custom class's len() counts its
    fields, not its samples, and a wrapped object may have no len() at all."""
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return int(batch.shape[0])
    if isinstance(batch, list):
        return len(batch)
    raise ValueError(
        f"with split=, give samples=N: the batch is a {type(batch).__name__}, whose "
        "samples headroom cannot count (only a tensor's dim 0 or a list's items are)"
    )


def _opt(x: Any) -> float | None:
    """A figure the loop may not know: None is sent as null, never as a made-up 0."""
    return None if x is None else float(x)


def _scalar(x: Any, what: str) -> float:
    """A loss as a float: a number or a one-element tensor. A string is refused even
    when it reads as a number ("nan", "0.5"): a loop that hands one is mistaken."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise LossError(
                f"{what} is a tensor of shape {tuple(x.shape)}; give a scalar (e.g. the "
                "loss's .mean())"
            )
        return float(x.detach())
    if not isinstance(x, (str, bytes, bool)):
        try:
            return float(x)
        except (TypeError, ValueError):
            pass
    raise LossError(
        f"{what} is {_args._got(x)}; give a number (a float) or a one-element tensor"
    ) from None


def _check_loss(loss: Any, step: int, start: int, end: int) -> None:
    if not isinstance(loss, torch.Tensor):
        raise LossError(
            f"step {step}: loss_fn returned {type(loss).__name__} for samples [{start}, {end}); "
            "return the micro-batch's loss as a scalar tensor (with its graph, not .item())"
        )
    if loss.numel() != 1:
        raise LossError(
            f"step {step}: loss_fn returned a tensor of shape {tuple(loss.shape)} for samples "
            f"[{start}, {end}); return a scalar (e.g. reduce it with .mean())"
        )
    if not loss.requires_grad:
        raise LossError(
            f"step {step}: the loss of samples [{start}, {end}) does not require grad (was it "
            "computed under torch.no_grad(), or detached?); return the loss with its graph"
        )


def _refuse_distributed() -> None:
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    world = dist.get_world_size()
    if world > 1:
        raise RunError(
            f"run.backward() under an initialised process group of {world} ranks: each rank "
            "would pick its own micro-batches, and DDP's gradient all-reduce would then wait "
            "for backward passes other ranks never make (a deadlock). Synchronised adaptive "
            "batching across ranks is not built yet; watch each rank with run.report(loss) "
            "instead"
        )
