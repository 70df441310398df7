"""`headroom.Run`: a PyTorch training loop on headroom's stream, watched or steered.

The class is made of three parts: this module (the loop's calls, the adaptive step, the
step boundary), `_signals` (the signals that would end the process) and `_job` (a rank
of a torchrun job).

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
from ._errors import BatchError, LossError, OptimizerStepFailed, OutOfMemory, RunError
from ._job import JobRank
from ._signals import StopSignals

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


class Run(StopSignals, JobRank):
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
        self._model = a.model
        self._params = (
            [p for p in a.model.parameters() if p.requires_grad] if a.model is not None else []
        )
        self._hard_limit = bool(a.hard_limit)
        if self._hard_limit and not cuda:
            _torch.start_thread_pools()
        self._on_checkpoint = a.on_checkpoint
        self._adaptive = a.effective_batch is not None
        self._effective = a.effective_batch or 0
        self._native = self._open_native(a, name, job)
        self._sharded_accumulation = a.sharded_accumulation
        self._start_job(a.model, world, job[0] if joined else None)
        self._solo_fsdp = self._fsdp_alone(a.model)
        self._start_meters(a.oom_snapshot)
        self._levers = _levers.Levers(self.device)
        if self._adaptive:
            self._start_controller(a)
        # Which batch-size notices were given (a larger batch, a smaller one).
        self._batch_said: set[bool] = set()
        self._step = 0
        self._accumulated: tuple | None = None
        self._boundary_t = time.perf_counter()
        self._optimizer_said = False
        self._parts_said = False
        # A headroom.plan(...): its prediction is logged beside each step's peak, and its
        # split is the memory panel's (without one, the session's from measured steps).
        self._plan = a.plan
        if a.plan is not None:
            p = a.plan
            self._native.plan_split(
                p.parameters + p.gradients + p.optimizer,
                max(0, p.fixed_overhead),
                p.activations_per_sample / max(1, p.seq_len),
            )
        self._start_signals(a.on_usr1, a.on_usr2)

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
            effective_batch=self._effective,
            micro_batch=a.micro_batch or self._effective or 1,
            log=a.log,
            log_rotate=a.log_rotate,
            listen=a.listen,
            sample_hz=a.sample_hz,
            cuda_index=self.device.index if cuda else None,
            device_total=_torch.device_total(self.device),
            allocator=_torch.CudaAllocator(self.device) if cuda else None,
            memory_budget="" if a.memory_budget is None else a.memory_budget,
            hard_limit=self._hard_limit,
            thresholds=a.thresholds,
            profile=a.profile,
            adaptive=a.adaptive and self._adaptive,
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
        self._oom_snapshot = bool(oom_snapshot) and cuda
        if oom_snapshot and not cuda:
            self.notice(
                "oom_snapshot: off on the CPU: the snapshot is the CUDA caching "
                "allocator's (torch.cuda.memory._dump_snapshot), and the CPU has none"
            )
        if self._oom_snapshot:
            # What memory_viz shows needs the allocations' history from here on.
            _internals.record_memory_history(True)

    def _start_controller(self, a) -> None:
        """An adaptive run's controller: its micro-batch range, from the memory the run
        holds before its first step."""
        self._native.adapt(
            a.micro_batch or self._effective,
            a.min_micro_batch or 1,
            a.max_micro_batch or 0,
            a.max_seq_len or 0,
            baseline=self._meter.held(),
            adaptive=a.adaptive,
        )
        self._levers = _levers.Levers(
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
        elif self._job is None and isinstance(loss, torch.Tensor) and loss.numel() == 1:
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
        step = self._step + 1
        dt = time.perf_counter() - self._boundary_t
        n = samples or 1
        diverged = loss is not None and not math.isfinite(value)
        if self._job is None:
            given = value if device_loss is None else device_loss
            self._report_off_thread(step, given, n, seq_len, dt, lr, grad_norm, diverged)
            return
        peak = self._meter.peak()
        self._native.observe(step, n, seq_len, peak)
        if self._plan is not None:
            self._native.plan_check(step, n, self._plan.predict(n), peak)
        self._native.step(step, value, n, n, seq_len, dt, n * seq_len, lr, grad_norm)
        self._step = step
        if diverged:
            self._diverged(step, value)
        self._job_note(n, peak, dt, value)
        self._job_agreed(step, self._job.agree(step))
        self._boundary()

    def _report_off_thread(self, step, value, n, seq_len, dt, lr, grad_norm, diverged) -> None:
        """A watch-only step outside a job: the extension's reporter thread reads the peak
        (on the CPU; CUDA's allocator peak is read here, where torch is) and records the
        step; the boundary runs only when it has work (commands, pause, stop, signals)."""
        peak = self._meter.take_peak if self._meter.cuda else None
        planned = None if self._plan is None else self._plan.predict(n)
        busy = self._native.report(step, value, n, seq_len, dt, lr, grad_norm, peak, planned)
        self._step = step
        if diverged:
            self._diverged(step, value)
        if busy or self._pending_signals or self._checkpoint_asked or self._signalled:
            # The reporter has read this step's peak before the boundary's own work (a
            # checkpoint) and its reset, as the step's peak always excluded them.
            self._native.flush()
            late = self._native.take_diverged()
            if late is not None:
                # A device tensor's loss, read off this thread: said at the next report.
                self._diverged(*late)
            self._boundary()
            return
        self._boundary_t = time.perf_counter()

    def _diverged(self, step: int, value: float) -> None:
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
        self._end_open_evaluation()
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
            _dist.refuse_process_group()
        job = self._job
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
        self._say_batch_size(self._step + 1, n)
        seq = seq_len or (_batch.seq_len_of(batch) if split is None else 1)
        step = self._step + 1
        t0 = time.perf_counter()
        mb, free = self._native.before_step(step, seq)
        if free:
            _torch.free_memory(self.device)
        if job is not None:
            job.sync_buffers(step)
        # fp16 in force by the precision lever: the run's GradScaler (run.step uses it too).
        scaler = scaler if scaler is not None else self._levers.scaler
        given_up = None
        # A job's reduction after the last backward found that this rank's zeros for a
        # gradient it lacks did not fit: its own out-of-memory error, the step redone.
        zeros_oom = None
        while True:
            try:
                if zeros_oom is not None:
                    mb = self._retry_after_oom(step, mb, seq, zeros_oom)
                    self.notice(
                        f"step {step}: out of memory on this rank making zeros for gradients "
                        "its samples did not produce, before the gradients' all-reduce; every "
                        "rank of the job drops the step's gradients and its samples start "
                        f"over, this rank's at micro-batch {mb}",
                        level="warn",
                    )
                    zeros_oom = None
                if job is not None and job.fsdp is not None:
                    total, mb, predicted = self._accumulate_sharded(
                        batch, loss_fn, cut, n, seq, step, mb, reduction, backward, scaler
                    )
                else:
                    with job.no_sync() if job is not None else contextlib.nullcontext():
                        total, mb, predicted = self._accumulate(
                            batch, loss_fn, cut, n, seq, step, mb, reduction, backward, scaler
                        )
                value = float(total)
                if not math.isfinite(value):
                    raise LossError(
                        f"step {step}: the batch's loss is {value} (training diverged, or the "
                        "data holds a NaN/inf); the gradients were cleared. Lower the learning "
                        "rate or check the batch"
                    )
            except _dist.Abandon as e:
                # A stop signal on this rank: the step is given up at the agreement, by
                # every rank together (below).
                given_up = e
            except BaseException as e:
                # Whatever ends the step early (a bad loss, an error in loss_fn, Ctrl-C)
                # leaves no gradient of it behind: a retried step starts clean.
                self._clear_grads()
                if job is not None:
                    self._job_fail(step, e)
                raise
            if job is None:
                break
            if given_up is not None and given_up.agreed:
                return self._give_up_step(step, given_up)
            if given_up is None and self._overlapped():
                # The agreement came before the last backward, the gradients' all-reduce
                # during it.
                break
            agreed = job.agree(step, _dist.ABANDON if given_up else _dist.OK)
            self._job_agreed(step, agreed)
            if agreed.abandon:
                return self._give_up_step(step, given_up)
            redo, zeros_oom = self._job_reduce(step, agreed.grads_agree)
            if not redo:
                break
        self._accumulated = (step, mb, seq, n, t0, value, predicted)
        return value

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
            # A job's last backward of the step carries the gradients' all-reduce (_overlap).
            overlapped = False
            versions = self._grad_versions()
            try:
                with self._levers.autocast():
                    loss = loss_fn(cut(batch, start, end))
                _args.micro_batch_loss(loss, step, start, end)
                weight = (end - start) / n if reduction == "mean" else 1.0
                if end == n and self._overlapped():
                    self._before_last_backward(step, start, n)
                    overlapped = True
                in_backward = True
                _torch.backward_of(loss * weight, backward, scaler)
                total += loss.detach() * weight
            except Exception as e:
                oom = _torch.is_oom(e, capped=self._hard_limit)
                if overlapped:
                    self._after_last_backward(step, oom=oom, failed=not oom)
                if not oom:
                    raise
                failed = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            except BaseException:
                if overlapped:
                    self._after_last_backward(step, failed=True)
                raise
            loss = None
            zeros = False
            if failed is None and overlapped:
                redo, failed = self._after_last_backward(
                    step, failed=not math.isfinite(float(total))
                )
                zeros = failed is not None
                if redo and not zeros:
                    # Another rank's last backward ran out of memory: the step's gradients
                    # are dropped on every rank, and its samples start again.
                    self._clear_grads()
                    total = torch.zeros((), device=self.device)
                    start = 0
                    self._meter.reset()
                    continue
            if failed is None:
                start = end
                continue
            # Out of memory: the attempt's tensors went with its frames. In a job's last
            # backward the all-reduce had begun: every rank starts the step over. FSDP2
            # without a job: its units put back to between steps, and the step over too
            # (what its half-run unit had gathered or accumulated cannot be told apart).
            restart = overlapped or (in_backward and self._grads_changed(versions))
            if self._solo_fsdp is not None:
                self._reset_solo_fsdp()
                restart = True
            retry = self._retry_after_oom(step, mb, seq, failed)
            if restart:
                # The backward had already added part of this micro-batch's gradients:
                # they cannot be told apart from the completed ones', so the step's
                # samples start over (exact, at the cost of recomputing them).
                where = (
                    "on this rank making zeros for gradients its samples did not produce, "
                    "after its last backward"
                    if zeros
                    else "in this rank's last backward"
                )
                self.notice(
                    f"step {step}: out of memory {where}, with the gradients' all-reduce "
                    "under way; every rank of the job drops the step's gradients and its "
                    f"samples start over, this rank's at micro-batch {retry}"
                    if overlapped
                    else f"step {step}: the out-of-memory error struck after gradients were "
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

    def _retry_after_oom(self, step: int, mb: int, seq: int, failed: str) -> int:
        """This rank ran out of memory in step `step` at micro-batch `mb` (`failed`: the
        error's first line): the controller told, the micro-batch to retry at; raises
        OutOfMemory when there is none."""
        retry, _, last_resort = self._native.oom(step, mb, seq, failed)
        self._snapshot_oom(step)
        _torch.free_memory(self.device)
        if last_resort:
            # Out of sizes: checkpointing on, the same samples retried (the session said
            # so).
            self._switch_lever("checkpointing", "blocks", "controller")
        if retry is None:
            raise OutOfMemory(
                f"step {step} ran out of memory at micro-batch {mb} ({seq} tokens per "
                f"sample) repeatedly: {failed}; {self._save_on_give_up()}. Give the run "
                "more memory or make a sample smaller"
            )
        return retry

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
        if self._accumulated is _job.GIVEN_UP:
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
        scaler = scaler if scaler is not None else self._levers.scaler
        try:
            self._optimizer_step(optimizer, step, scaler)
        except BaseException as e:
            if self._job is not None:
                self._job_fail(step, e)
            raise
        skipped = _torch.scaler_update(scaler, optimizer)
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
            snapshot = _torch.OptimizerSnapshot(optimizer)
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
        try:
            with _torch.cap_lifted():
                path = self._on_checkpoint(self._step)
        except Exception as e:
            return f"the checkpoint failed too: {type(e).__name__}: {e}"
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

    def _fsdp_alone(self, model: Any) -> Any:
        """An adaptive run's FSDP2 root when it joined no job (one process, or world size
        1): an out-of-memory error inside a unit leaves it half run (a unit's parameters
        gathered and never resharded, its state mid-forward), and training on from there
        learns the wrong thing. None otherwise."""
        if not self._adaptive or self._job is not None or model is None:
            return None
        return _fsdp.outermost(model)

    @staticmethod
    def _check_solo_fsdp(model: Any) -> None:
        root = _fsdp.outermost(model) if model is not None else None
        why = None if root is None else _fsdp.check(root)
        if why is not None:
            raise RunError(
                f"adaptive mode with FSDP2: {why}; watch the run with run.report(loss) "
                "(create the Run without effective_batch=)"
            )

    def _reset_solo_fsdp(self) -> None:
        if self._solo_fsdp is not None:
            _fsdp.reset(self._solo_fsdp)

    def _grad_versions(self) -> list:
        return [
            None if p.grad is None else (id(p.grad), _internals.version(p.grad))
            for p in self._params
        ]

    def _grads_changed(self, versions: list) -> bool:
        return versions != self._grad_versions()

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    # ---- both ----------------------------------------------------------------------------

    def notice(self, text: str, level: str = "info") -> None:
        """A line in the dashboard's event log (level: info, warn, error)."""
        self._native.notice_text(str(text), level=level, source="python")

    def eval(self, val_loss: float, train_loss: float | None = None, tokens: int = 0) -> None:
        """A validation result at the current step."""
        v = _args.loss_value(val_loss, "val_loss")
        t = v if train_loss is None else _args.loss_value(train_loss, "train_loss")
        self._native.eval(self._step, v, t, tokens)

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
        if self._accumulated is not None:
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
        return self._accumulated is not None

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
                capped=self._hard_limit,
                combine=combine,
                cut=cut,
                samples=samples,
                seq_len=seq_len,
                on_chunk=on_chunk,
                after_oom=self._reset_solo_fsdp,
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
            _internals.dump_memory_snapshot(path)
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
            _internals.record_memory_history(False)
        self._restore_signal_handlers()
        if self._job is not None:
            self._job.close()
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
            self._handle_pending_signals()
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
        lever, _, to = kind.partition(":")
        if lever in ("precision", "checkpointing") and to:
            return self._switch_lever(lever, to, "command")
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

    @property
    def scaler(self) -> Any:
        """The GradScaler the run scales its loss with while its precision lever is at fp16
        (``half_precision="fp16"``), else None. ``run.backward`` and ``run.step`` use it;
        a loop that clips gradients unscales first: ``run.scaler.unscale_(optimizer)``."""
        return self._levers.scaler

    def _switch_lever(self, lever: str, to: str, source: str) -> str:
        """Switches a lever the run holds, from the next micro-batch on; the answer."""
        if lever == "precision":
            was = self._levers.set_precision(to)
        else:
            was = self._levers.set_checkpointing(to)
        return self._native.switched(lever, was, to, source)


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
