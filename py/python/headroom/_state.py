"""What a run's parts share: the extension's run, the device, the parameters, the step
count, and the acts each part does the same way (a notice, the gradients cleared, the
controller told of an out-of-memory error, a viewer's command carried out).

`headroom.Run` (the loop's calls), its signals (`_signals.Signals`) and its rank (a
strategy of `_rank`: one process, DDP or FSDP2) each hold this one object instead of
reaching into each other's attributes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import _internals, _levers, _native, _torch
from ._errors import OutOfMemory


class RunState:
    """One run's shared state; built by `Run._start` in order (the extension's run first,
    then the meter and the levers)."""

    native: _native.NativeRun
    device: torch.device
    meter: _torch.PeakMeter
    levers: _levers.Levers

    def __init__(
        self,
        *,
        device: torch.device,
        model: Any,
        hard_limit: bool,
        adaptive: bool,
        effective: int,
        on_checkpoint: Callable[[int], Any] | None,
    ):
        self.device = device
        self.model = model
        self.params = (
            [p for p in model.parameters() if p.requires_grad] if model is not None else []
        )
        self.hard_limit = hard_limit
        self.adaptive = adaptive
        self.effective = effective
        self.on_checkpoint = on_checkpoint
        self.oom_snapshot = False
        # Steps completed.
        self.step = 0
        # Between run.backward() and run.step(): what backward left for step (or GIVEN_UP).
        self.accumulated: Any = None
        # When the step in progress began (its time, a stop's notice).
        self.boundary_t = time.perf_counter()
        # The extension is waiting (a pause, a job's command wait): a signal arriving
        # meanwhile is queued (_signals) and acted on once it returns.
        self.in_poll = False

    # ---- what every part says and does alike -------------------------------------------

    def notice(self, text: str, level: str = "info", source: str = "python") -> None:
        self.native.notice_text(str(text), level=level, source=source)

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def grad_versions(self) -> list:
        return [
            None if p.grad is None else (id(p.grad), _internals.version(p.grad))
            for p in self.params
        ]

    def grads_changed(self, versions: list) -> bool:
        return versions != self.grad_versions()

    def switch_lever(self, lever: str, to: str, source: str) -> str:
        """Switches a lever the run holds, from the next micro-batch on; the answer."""
        if lever == "precision":
            was = self.levers.set_precision(to)
        else:
            was = self.levers.set_checkpointing(to)
        return self.native.switched(lever, was, to, source)

    def snapshot_oom(self, step: int) -> None:
        """With oom_snapshot=True on CUDA: what the allocator held when a step ran out of
        memory, as the pickle PyTorch's memory_viz reads, beside the log (or in the
        working directory without one); its path goes in the event log."""
        if not self.oom_snapshot:
            return
        log = self.native.log_path
        base = Path(log).with_suffix("") if log else Path.cwd() / self.native.name
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

    def retry_after_oom(
        self, step: int, mb: int, seq: int, failed: str, give_up: Callable[[], str]
    ) -> int:
        """This rank ran out of memory in step `step` at micro-batch `mb` (`failed`: the
        error's first line): the controller told, the micro-batch to retry at; raises
        OutOfMemory (`give_up()` saying what became of the last completed step) when
        there is none."""
        retry, _, last_resort = self.native.oom(step, mb, seq, failed)
        self.snapshot_oom(step)
        _torch.free_memory(self.device)
        if last_resort:
            # Out of sizes: checkpointing on, the same samples retried (the session said
            # so).
            self.switch_lever("checkpointing", "blocks", "controller")
        if retry is None:
            raise OutOfMemory(
                f"step {step} ran out of memory at micro-batch {mb} ({seq} tokens per "
                f"sample) repeatedly: {failed}; {give_up()}. Give the run more memory or "
                "make a sample smaller"
            )
        return retry

    def carry_out(self, kind: str) -> str:
        """A viewer's command (or a signal's checkpoint) at a step boundary; the answer."""
        if kind == "free_cache":
            before = _torch.held_text(self.device)
            _torch.free_memory(self.device)
            return f"cached memory freed: {before} → {_torch.held_text(self.device)}"
        lever, _, to = kind.partition(":")
        if lever in ("precision", "checkpointing") and to:
            return self.switch_lever(lever, to, "command")
        if kind == "checkpoint":
            if self.on_checkpoint is None:
                return (
                    "refused: this run has no checkpoint callback (give "
                    "headroom.Run(on_checkpoint=fn), fn(step) saving and returning the path)"
                )
            try:
                path = self.on_checkpoint(self.step)
            except Exception as e:
                self.notice(
                    f"checkpoint failed: {type(e).__name__}: {e}",
                    level="error",
                    source="checkpoint",
                )
                return f"checkpoint failed: {type(e).__name__}: {e}"
            if path is None:
                return f"checkpoint of step {self.step} written by the callback"
            self.native.checkpoint_saved(self.step, os.fspath(path))
            return f"checkpoint of step {self.step} at {os.fspath(path)}"
        return f"not understood: {kind}"

    def stop_saves(self, verb: str, mid_step: bool = False) -> str:
        """What a stop saves: the last completed step (a watch-only loop's step in
        progress, when asked mid-step: the loop finishes it), through on_checkpoint, or
        nothing, said as such (never a checkpoint that will not be taken)."""
        if self.on_checkpoint is not None and mid_step and not self.adaptive:
            return f"the checkpoint {verb} taken at the end of the step in progress"
        if self.on_checkpoint is not None:
            return f"the checkpoint {verb} of step {self.step}"
        return (
            "no checkpoint is taken: this run has no on_checkpoint (give "
            "headroom.Run(on_checkpoint=fn), fn(step) saving and returning the path)"
        )

    def take_commands(self, wait_s: float, after: Callable[[], None]) -> list[str]:
        """A viewer's commands, raw, for a job's agreement. A signal arriving while the
        extension waits is acted on after (`after`: it would need the run the wait
        borrows)."""
        self.in_poll = True
        try:
            return self.native.take_commands(wait_s)
        finally:
            self.in_poll = False
            after()
