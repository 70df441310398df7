"""`headroom.Run`: a PyTorch training loop on headroom's stream, watched or steered.

The run holds three parts and asks none of them what it is: its state (`_state`, what
every part shares), its signals (`_signals`, an object it owns) and its rank (`_rank`: the
way it trains, one process, or a rank of a torchrun job watched (`_job`), under DDP
(`_replicated`) or FSDP2 (`_sharded`)), which cuts each step into micro-batches, redoes
what an out-of-memory error ended and ends each step. This module is the loop's calls.

`headroom.hf` and `headroom.lightning` drive a run from a framework's hooks and read no
private attribute of it (py/tests/test_imports.py holds them to that): what they need
beyond a loop's calls is four members of the class, public and documented, in a section
of their own (`in_step`, `begin_evaluation`, `end_evaluation`, `evaluate_chunked`). On
the run itself rather than grouped on an object (`run.frontend`): four are too few for
one, and a hand-written loop whose evaluation pass begins and ends in different places
may use them as well."""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import _args, _batch, _dist, _eval, _fsdp, _internals, _job, _levers, _native, _torch

# headroom._run.RunError, .OutOfMemory, .OptimizerStepFailed and .LossError stay importable
# (they were defined here before _errors).
from ._errors import (  # noqa: F401 (re-exported)
    BatchError,
    LossError,
    OptimizerStepFailed,
    OutOfMemory,
    RunError,
)
from ._rank import GIVEN_UP, Rank, SoloRank, StepWork
from ._replicated import ReplicatedRank
from ._sharded import ShardedRank
from ._signals import Signals
from ._state import RunState

LossFn = Callable[[Any], torch.Tensor]


_current: Run | None = None
_current_lock = threading.Lock()
_uncaught: list[BaseException] = []


def _excepthook(kind, value, tb):
    _uncaught.append(value)
    _previous_excepthook(kind, value, tb)


_previous_excepthook = sys.excepthook
sys.excepthook = _excepthook


def _default_name() -> str:
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") else ""
    return script or "python"


def _claim(run: Run) -> None:
    """Makes `run` the process's run: one process serves one run."""
    global _current
    with _current_lock:
        if _current is not None and not _current.ended:
            raise RunError(
                f"a headroom run ({_current.name!r}) is already active in this process; "
                "finish() it, or use `with headroom.Run(...) as run:`, before creating "
                "another (one process serves one run)"
            )
        _current = run


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
        sample_hz: float = 20.0,
        job_view: bool = True,
        finish_previous: bool = True,
        plan: Any = None,
        oom_snapshot: bool = False,
        on_usr1: str = "stop",
        on_usr2: str = "stop",
        precision: str | None = None,
        checkpoint_blocks: Any = None,
        checkpointing: Callable[[bool], Any] | None = None,
        half_precision: str | None = None,
        log_rotate: str | None = None,
        sharded_accumulation: str = "auto",
    ):
        global _current
        # Every argument is checked before anything happens: a mistake finishes no
        # previous run, opens no socket and sets no cap. (locals(): the arguments.)
        a = _args.run_arguments({k: v for k, v in locals().items() if k != "self"})
        previous = _finish_previous(a.name, a.finish_previous)
        _claim(self)
        try:
            self._start(a)
            if previous is not None:
                self.notice(previous, level="warn")
        except BaseException:
            with _current_lock:
                _current = None
            raise
        atexit.register(self._at_exit)

    def _start(self, a) -> None:
        """Everything a new run sets up, in order, from its checked arguments `a`."""
        if a.effective_batch is not None and a.model is None:
            raise RunError(
                "an adaptive run (effective_batch=…) needs model=: headroom keeps or clears "
                "its parameters' gradients across an out-of-memory error"
            )
        self.device = _torch.resolve_device(a.device, a.model)
        cuda = self.device.type == "cuda"
        name, job = _job.identity(a.name or _default_name())
        world = _dist.world_size()
        joined = job is not None and world > 1 and (a.effective_batch is not None or a.job_view)
        if joined and a.effective_batch is not None:
            _dist.refuse_unsupported(a.model, world)
            _dist.overlap_asked()
        elif a.effective_batch is not None:
            # Before anything is set up: a torch whose FSDP2 headroom cannot put back
            # after an out-of-memory error is refused here, not at the first one.
            self._check_solo_fsdp(a.model)
        budget = a.memory_budget
        if budget is not None and cuda and budget.strip().lower() != "auto":
            _torch.cap_cuda(self.device, _native.parse_bytes(budget))
        self._s = s = RunState(
            device=self.device,
            model=a.model,
            hard_limit=bool(a.hard_limit),
            adaptive=a.effective_batch is not None,
            effective=a.effective_batch or 0,
            on_checkpoint=a.on_checkpoint,
        )
        # The objects the loop's calls use most, under their own names (the same the rank
        # and the signals reach through `s`).
        self._model = a.model
        self._params = s.params
        if self._s.hard_limit and not cuda:
            _torch.start_thread_pools()
        self._native = s.native = self._open_native(a, name, job)
        self._start_meters(a.oom_snapshot)
        self._levers = s.levers = _levers.Levers(self.device)
        # A headroom.plan(...): its prediction is logged beside each step's peak, and its
        # split is the memory panel's (without one, the session's from measured steps).
        self._plan = a.plan
        self._signals = Signals(s, a.on_usr1, a.on_usr2, self.finish, self.fail)
        self._rank = self._make_rank(a, job[0] if joined else None)
        self._rank.start(world)
        if self._s.adaptive:
            self._start_controller(a)
        # Which batch-size notices were given (a larger batch, a smaller one).
        self._batch_said: set[bool] = set()
        self._optimizer_said = False
        self._parts_said = False
        if a.plan is not None:
            p = a.plan
            self._native.plan_split(
                p.parameters + p.gradients + p.optimizer,
                max(0, p.fixed_overhead),
                p.activations_per_sample / max(1, p.seq_len),
            )
        # Last: a run that failed to start leaves the process's handlers as they were.
        self._signals.install()

    def _make_rank(self, a, job_id: str | None) -> Rank:
        """The run's way of training: one process, or a rank of a torchrun job (watched,
        DDP, FSDP2). Under a job, collective: every rank's Run gets here."""
        s = self._s
        if job_id is None:
            return SoloRank(s, self._signals, a.plan)
        # torch.compile of the wrapped model: what it wraps decides.
        inner = _torch.uncompiled(a.model)
        if s.adaptive and _fsdp.is_fsdp2(inner):
            return ShardedRank(
                s, self._signals, a.plan, a.model, job_id, inner, a.sharded_accumulation
            )
        if s.adaptive:
            return ReplicatedRank(s, self._signals, a.plan, a.model, job_id)
        return _job.JobRank(s, self._signals, a.plan, a.model, job_id)

    def _open_native(self, a, name: str, job) -> _native.NativeRun:
        """The extension's run: the stream, the log, the controller, the cap."""
        cuda = self.device.type == "cuda"
        model = a.model
        run = _native.NativeRun(
            name,
            producer=f"headroom.py (python {sys.version.split()[0]}, torch {torch.__version__})",
            device=str(self.device),
            device_name=_torch.device_name(self.device),
            parameters=(0 if model is None else sum(p.numel() for p in model.parameters())),
            total_steps=a.total_steps,
            effective_batch=self._s.effective,
            micro_batch=a.micro_batch or self._s.effective or 1,
            log=a.log,
            log_rotate=a.log_rotate,
            listen=a.listen,
            sample_hz=a.sample_hz,
            cuda_index=self.device.index if cuda else None,
            device_total=_torch.device_total(self.device),
            allocator=_torch.CudaAllocator(self.device) if cuda else None,
            memory_budget="" if a.memory_budget is None else a.memory_budget,
            hard_limit=self._s.hard_limit,
            thresholds=a.thresholds,
            profile=a.profile,
            adaptive=a.adaptive and self._s.adaptive,
            job=job,
            checkpoints=a.on_checkpoint is not None,
            precision=a.precision,
            half_precision=a.half_precision,
            # Under FSDP2 a recomputed unit's forward runs inside backward: one rank's
            # switch would change its collectives, so only a command (every rank at one
            # step) switches checkpointing there.
            last_resort=not (job is not None and _fsdp.is_fsdp2(_torch.uncompiled(model))),
            checkpointing=(
                "none" if (a.checkpoint_blocks or a.checkpointing) is not None else None
            ),
        )
        if a.log is not None and run.log_path != a.log:
            # Said where a script's user looks, as well as in the log itself.
            print(
                f"headroom: {a.log} holds an earlier run's log, kept; this run logs to "
                f"{run.log_path}",
                file=sys.stderr,
                flush=True,
            )
        return run

    def _start_meters(self, oom_snapshot: bool) -> None:
        """The step-peak meter and, with oom_snapshot=True on CUDA, the allocator's
        history an out-of-memory snapshot shows."""
        cuda = self.device.type == "cuda"
        self._meter = _torch.PeakMeter(self.device)
        if not self._meter.exact:
            self.notice(
                "the kernel refused to reset the peak RSS (/proc/self/clear_refs); step "
                "peaks are the process's peak so far and over-state later steps",
                level="warn",
            )
        self._s.meter = self._meter
        self._s.oom_snapshot = bool(oom_snapshot) and cuda
        if oom_snapshot and not cuda:
            self.notice(
                "oom_snapshot: off on the CPU: the snapshot is the CUDA caching "
                "allocator's (torch.cuda.memory._dump_snapshot), and the CPU has none"
            )
        if self._s.oom_snapshot:
            # What memory_viz shows needs the allocations' history from here on.
            _internals.record_memory_history(True)

    def _start_controller(self, a) -> None:
        """An adaptive run's controller: its micro-batch range, from the memory the run
        holds before its first step."""
        self._native.adapt(
            a.micro_batch or self._s.effective,
            a.min_micro_batch or 1,
            a.max_micro_batch or 0,
            a.max_seq_len or 0,
            baseline=self._meter.held(),
            adaptive=a.adaptive,
        )
        self._levers = self._s.levers = _levers.Levers(
            self.device, a.precision, a.checkpoint_blocks, a.checkpointing, a.half_precision
        )
        self._say_batch_range(a.micro_batch, a.min_micro_batch, a.max_micro_batch)

    def _say(self, text: str, level: str = "warn") -> None:
        """A notice that a script's user must see: in the log, on the dashboard and on
        stderr."""
        self.notice(text, level=level)
        with contextlib.suppress(RuntimeError):
            print(f"headroom: {text}", file=sys.stderr, flush=True)

    def _say_batch_range(self, micro_batch, min_micro_batch, max_micro_batch) -> None:
        """Once, at the start: a micro-batch setting the run cannot honour as given, what
        it does instead and why (a micro-batch is a part of a step's batch)."""
        eff = self._s.effective
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
        eff = self._s.effective
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
        return self._s.step

    @property
    def stop_gave_up_a_step(self) -> bool:
        """A stop gave a step up mid-way: the stop's checkpoint is then taken inside the
        step (the parameters are the last completed step's), where a framework's own save
        must happen at once, not at its batch's end (headroom.hf, .lightning)."""
        return self._signals.gave_up_a_step

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
        if self._s.adaptive:
            raise RunError(
                "this run is adaptive: its steps end with run.step(optimizer), not "
                "run.report(); create the run without effective_batch= to only watch"
            )
        # The common call (a float or a tensor, the rest left out or plain) checked
        # inline: a report is on the training thread's every step (issue 34: µs).
        device_loss = None
        if type(loss) is float:
            value = loss
        elif loss is None:
            value = math.nan
        elif isinstance(loss, torch.Tensor) and loss.is_cpu:
            try:
                value = float(loss.item())
            except RuntimeError:  # not one element: the error names it
                value = _args.loss_value(loss, "the loss given to run.report()")
        elif (
            self._rank.reads_loss_off_thread
            and isinstance(loss, torch.Tensor)
            and loss.numel() == 1
        ):
            # Read on the extension's reporter thread: .item() here would wait for the
            # device, every step.
            device_loss, value = loss.detach(), 0.0
        else:
            value = _args.loss_value(loss, "the loss given to run.report()")
        if not (samples is None or (type(samples) is int and samples >= 1)):
            samples = _args.optional_whole("run.report(samples=)", samples, 1, 32)
        if not (type(seq_len) is int and seq_len >= 1):
            seq_len = _args.whole("run.report(seq_len=)", seq_len, 1, 1)
        if not (lr is None or type(lr) is float):
            lr = _args.optional_number("run.report(lr=)", lr)
        if not (grad_norm is None or type(grad_norm) is float):
            grad_norm = _args.optional_number("run.report(grad_norm=)", grad_norm)
        if self._native.evaluating:
            self._native.eval_end()
        step = self._s.step + 1
        dt = time.perf_counter() - self._s.boundary_t
        n = samples or 1
        diverged = loss is not None and not math.isfinite(value)
        given = value if device_loss is None else device_loss
        self._rank.report(step, given, n, seq_len, dt, lr, grad_norm, diverged)

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
        if not self._s.adaptive:
            raise RunError(
                "run.backward() needs an adaptive run: create it with effective_batch=N "
                "and model=model (a watch-only run reports with run.report(loss))"
            )
        if self._native.ended:
            raise RunError("this run has ended; create a new headroom.Run")
        self._end_open_evaluation()
        if self._s.accumulated is not None:
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
        self._rank.check_backward()
        if split is None:
            n = _batch.size_of(batch)
            cut = _batch.take_dynamic if _torch.is_compiled(self._model) else _batch.take
        else:
            if samples is None:
                samples = _batch.samples_of(batch)
            n = samples
            cut = split
        if n < 1:
            raise BatchError("the batch holds no samples")
        step = self._s.step + 1
        self._say_batch_size(step, n)
        seq = seq_len or (_batch.seq_len_of(batch) if split is None else 1)
        t0 = time.perf_counter()
        mb, free = self._native.before_step(step, seq)
        if free:
            _torch.free_memory(self.device)
        self._rank.sync_buffers(step)
        # fp16 in force by the precision lever: the run's GradScaler (run.step uses it too).
        scaler = scaler if scaler is not None else self._levers.scaler
        work = StepWork(step, batch, loss_fn, cut, n, seq, reduction, backward, scaler)
        result = self._rank.backward(work, mb)
        if result is GIVEN_UP:
            # The job gave the step up (a stop): run.step applies nothing.
            self._s.accumulated = GIVEN_UP
            return math.nan
        value, mb, predicted = result
        self._s.accumulated = (step, mb, seq, n, t0, value, predicted)
        return value

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
        if self._s.accumulated is None:
            raise RunError(
                "run.step(optimizer) without run.backward(batch, loss_fn) before it: there "
                "are no gradients of this run to apply"
            )
        if self._s.accumulated is GIVEN_UP:
            # The job gave the step up (a stop): nothing to apply; the boundary checkpoints.
            self._s.accumulated = None
            self._rank.boundary()
            return
        step, mb, seq, n, t0, value, predicted = self._s.accumulated
        if not self._optimizer_said:
            self._optimizer_said = True
            advice = _torch.optimizer_advice(optimizer)
            if advice:
                self.notice(advice, level="warn")
        scaler = scaler if scaler is not None else self._levers.scaler
        try:
            self._optimizer_step(optimizer, step, scaler)
        except BaseException as e:
            self._rank.fail(step, e)
            raise
        skipped = _torch.scaler_update(scaler, optimizer)
        if not self._parts_said and not skipped:
            # Once, while the gradients and the optimizer's state both exist: what the
            # fixed part of a step is made of (the optimizer-state hint reads it).
            self._parts_said = True
            self._native.memory_parts(*_torch.memory_parts(self._model, optimizer))
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
        self._s.accumulated = None
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
        self._s.step = step
        self._rank.stepped(next_mb, peak, dt, value)
        self._rank.boundary()

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, step: int, scaler=None) -> None:
        """optimizer.step(), retried after an OOM that changed nothing it cannot restore.

        What an optimizer changes in place is visible in the tensors' version counters:
        an OOM before any parameter or state tensor changed (the first step's state
        allocation, a temporary) is undone by dropping the state it created and restoring
        its step counters, then retried; one after is refused loudly, never passed off.
        """
        for attempt in range(3):
            snapshot = _torch.OptimizerSnapshot(optimizer)
            try:
                if scaler is None:
                    optimizer.step()
                else:
                    scaler.step(optimizer)
                return
            except Exception as e:
                if not _torch.is_oom(e, capped=self._s.hard_limit):
                    raise
                text = _torch.first_line(e)
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

    def _say_skipped(self, step: int, scales: tuple[float, float]) -> int:
        """Says the scaler skipped `step`; the micro-batch stays as it is."""
        self._native.notice_text(
            f"step {step}: the GradScaler skipped the optimizer step (inf/NaN gradients); "
            f"loss scale {scales[0]:g} → {scales[1]:g}; not fed to the memory controller",
            level="warn",
            source="python",
        )
        return self._native.micro_batch

    @staticmethod
    def _check_solo_fsdp(model: Any) -> None:
        root = _fsdp.outermost(model) if model is not None else None
        why = None if root is None else _fsdp.check(root)
        if why is not None:
            raise RunError(
                f"adaptive mode with FSDP2: {why}; watch the run with run.report(loss) "
                "(create the Run without effective_batch=)"
            )

    def _clear_grads(self) -> None:
        self._s.clear_grads()

    # ---- both ----------------------------------------------------------------------------

    def notice(self, text: str, level: str = "info") -> None:
        """A line in the dashboard's event log (level: info, warn, error)."""
        self._native.notice_text(str(text), level=level, source="python")

    def eval(self, val_loss: float, train_loss: float | None = None, tokens: int = 0) -> None:
        """A validation result at the current step."""
        v = _args.loss_value(val_loss, "val_loss")
        t = v if train_loss is None else _args.loss_value(train_loss, "train_loss")
        self._native.eval(self._s.step, v, t, tokens)

    # ---- evaluation ----------------------------------------------------------------------

    def evaluate(
        self,
        batch: Any,
        fn: Callable[[Any], Any],
        *,
        combine: Any = None,
        split: Callable[[Any, int, int], Any] | None = None,
        samples: int | None = None,
        seq_len: int | None = None,
        grad: bool = False,
    ) -> Any:
        """``fn(batch)`` for an evaluation batch, run in chunks that fit: returns what
        ``fn`` on the whole batch would have (a mean loss, logits, a dict of them).

        The chunk size is the controller's (evaluation's own peaks against the run's
        thresholds); a chunk that runs out of memory is retried smaller, only its
        samples, and the size is kept for the next batch. The training micro-batch is not
        touched. The results combine per leaf: floating-point scalars as a mean weighted
        by samples, integer scalars added, tensors with a batch dimension concatenated;
        ``combine="mean"|"sum"|"cat"`` or ``combine=fn([(samples, result), ...])`` says
        otherwise (a metric that is not a mean of per-sample values). `split`, `samples`
        and `seq_len` as for :meth:`backward`. Runs under ``torch.no_grad()`` unless
        ``grad=True``. Consecutive calls form one evaluation pass in the log and on the
        dashboard (the ``eval_memory`` record), ended by the next training step or by
        :meth:`evaluation`'s block.
        """
        if self._native.ended:
            raise RunError("this run has ended; create a new headroom.Run")
        if self._s.accumulated is not None:
            raise RunError(
                "run.evaluate() between run.backward() and run.step(): its chunks' peaks "
                "would be measured into the step's; evaluate after run.step(optimizer)"
            )
        _args.callback(
            "run.evaluate(batch, fn)'s fn",
            fn,
            "a function of an evaluation chunk returning its result, e.g. lambda b: model.loss(b)",
        )
        if fn is None:
            raise TypeError(
                "run.evaluate(batch, fn): fn is None; give a function of an evaluation chunk "
                "returning its result, e.g. lambda b: model.loss(b)"
            )
        _args.callback("run.evaluate(split=)", split, "a function split(batch, start, end)")
        samples = _args.optional_whole("run.evaluate(samples=)", samples, 1, 32)
        seq_len = _args.optional_whole("run.evaluate(seq_len=)", seq_len, 1, 128)
        if split is not None and samples is None:
            samples = _batch.samples_of(batch)
        with contextlib.nullcontext() if grad else torch.no_grad():
            return self.evaluate_chunked(
                batch, fn, combine=combine, cut=split, samples=samples, seq_len=seq_len
            )

    @contextlib.contextmanager
    def evaluation(self, phase: str = "eval"):
        """A block whose :meth:`evaluate` calls are one evaluation pass named `phase`
        (``"validation"``, ``"test"``, …): its ``eval_memory`` record is written when the
        block ends."""
        if not isinstance(phase, str) or not phase:
            raise ValueError(f"run.evaluation(phase={phase!r}): give a name, e.g. 'validation'")
        self.begin_evaluation(phase)
        try:
            yield self
        finally:
            self.end_evaluation()

    def _end_open_evaluation(self) -> None:
        """A training step begins: an evaluation pass still open (run.evaluate calls without
        run.evaluation's block) ends here."""
        if self._native.evaluating:
            self._native.eval_end()

    # ---- what the framework layers use (the module's doc says why these) ---------------

    @property
    def in_step(self) -> bool:
        """True from :meth:`backward` until the :meth:`step` that ends its step (a step a
        torchrun job gave up included: run.step still ends it)."""
        return self._s.accumulated is not None

    def begin_evaluation(self, phase: str) -> None:
        """Opens an evaluation pass named `phase`: :meth:`evaluation`'s block for a loop
        whose pass begins and ends in separate hooks (Lightning's ``on_validation_start``
        and ``on_validation_end``). :meth:`end_evaluation` closes it."""
        self._native.eval_begin(phase)

    def end_evaluation(self) -> None:
        """Closes the pass :meth:`begin_evaluation` opened: its ``eval_memory`` record is
        written. Nothing once the run has ended."""
        if not self._native.ended:
            self._native.eval_end()

    def evaluate_chunked(
        self,
        batch: Any,
        fn: Callable[[Any], Any],
        *,
        combine: Any = None,
        cut: Callable[[Any, int, int], Any] | None = None,
        samples: int | None = None,
        seq_len: int | None = None,
        on_chunk: Callable[[Any, Callable[[Any], Any]], Any] | None = None,
    ) -> Any:
        """`fn` over an evaluation batch in chunks the controller sizes, with the run's
        meter, hard cap and FSDP2 reset (`_eval.run_batch`): what :meth:`evaluate` runs
        once it checked its arguments and set the grad mode, for a framework layer whose
        own loop does both (headroom.lightning). `on_chunk(chunk, fn)` makes each call in
        its place; `cut` is :meth:`evaluate`'s `split`."""
        try:
            return _eval.run_batch(
                self._native,
                self._meter,
                self.device,
                batch,
                fn,
                capped=self._s.hard_limit,
                combine=combine,
                cut=cut,
                samples=samples,
                seq_len=seq_len,
                on_chunk=on_chunk,
                after_oom=self._rank.reset_evaluation,
            )
        finally:
            # The next step's peak starts from here, not from the last chunk's.
            self._meter.reset()

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
        if self._s.step != 0 or self._s.accumulated is not None:
            raise RunError(
                f"load_state_dict() after step {self._s.step}: call it right after creating "
                "the run, before its first step"
            )
        self._s.step = self._native.restore(state["native"])

    def checkpoint_saved(self, path: str | os.PathLike) -> None:
        """Tells the dashboard the loop wrote a checkpoint."""
        self._native.checkpoint_saved(self._s.step, os.fspath(path))

    def finish(self) -> None:
        """Ends the run: attached dashboards show it finished; the socket goes."""
        if self._native.ended:
            return
        self._signals.checkpoint_for_stop()
        warning = self._native.finish()
        self._release()
        if warning:
            print(f"headroom: warning: {warning}", file=sys.stderr)

    def fail(self, reason: str) -> None:
        if self._native.ended:
            return
        self._native.fail(str(reason))
        self._release()

    def _release(self) -> None:
        global _current
        if getattr(getattr(self, "_s", None), "oom_snapshot", False):
            _internals.record_memory_history(False)
        self._signals.restore()
        self._rank.close()
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
            self.fail(f"interrupted (KeyboardInterrupt) after step {self._s.step}")
        else:
            self.fail(f"{type(value).__name__}: {value}")

    def _carry_out(self, kind: str) -> str:
        """What a viewer's command does at a step boundary (the levers' benchmarks and
        tests call it directly)."""
        return self._s.carry_out(kind)

    @property
    def scaler(self) -> Any:
        """The GradScaler the run scales its loss with while its precision lever is at fp16
        (``half_precision="fp16"``), else None. ``run.backward`` and ``run.step`` use it;
        a loop that clips gradients unscales first: ``run.scaler.unscale_(optimizer)``."""
        return self._levers.scaler

    def _switch_lever(self, lever: str, to: str, source: str) -> str:
        """Switches a lever the run holds, from the next micro-batch on; the answer."""
        return self._s.switch_lever(lever, to, source)


def _finish_previous(name: str | None, allowed: bool) -> str | None:
    """A new run in a process whose previous run is still active (a notebook cell run
    again, a script that forgot finish()) finishes that one first, as experiment trackers'
    init does, saying so in its log and on its dashboard; returns what the new run says.
    With `allowed=False` the new run is refused instead."""
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


def _opt(x: Any) -> float | None:
    """A figure the loop may not know: None is sent as null, never as a made-up 0."""
    return None if x is None else float(x)
