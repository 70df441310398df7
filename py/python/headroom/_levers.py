"""The memory levers a run switches itself, as `headroom train` does: activation
checkpointing of the blocks the script names, and the precision its forward runs at.

A script hands them to its run (``headroom.Run(checkpoint_blocks=model.blocks,
precision="fp32")``); the dashboard's ``a`` and ``m`` (or a viewer's command) then switch
them at a step boundary, and out of micro-batch sizes the run switches checkpointing on
before it gives up. Checkpointing recomputes a block's activations in backward with the
random state it had in forward, so nothing learned changes; bf16 and fp16 are a change of
what is computed, said as such (fp16 with a GradScaler the run keeps while it is in force,
``half_precision="fp16"``, for devices without bf16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint as _recompute


class Levers:
    """The run's levers and their state; a lever the script did not hand over is None."""

    def __init__(
        self,
        device: torch.device,
        precision: str | None = None,
        blocks: Iterable[torch.nn.Module] | None = None,
        switch: Callable[[bool], Any] | None = None,
        half: str | None = None,
    ):
        # Checked by _args.run_arguments.
        self.device = device
        self.precision = None
        self.half = half
        # While the precision is fp16: the GradScaler run.backward scales the loss with
        # and run.step steps through (float16's range underflows small gradients).
        self.scaler = None
        self.set_precision(precision)
        self._blocks = None if blocks is None else list(blocks)
        self._switch = switch
        self.checkpointing = "none" if (self._blocks is not None or switch is not None) else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward runs in: autocast to the half precision in force."""
        dtype = _HALF.get(self.precision)
        if dtype is not None:
            return torch.autocast(device_type=self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def set_precision(self, to: str | None) -> str | None:
        """Switches the precision (a step boundary: no scaled gradient is pending); what
        it was. fp16 comes with a fresh GradScaler, any other precision drops it."""
        was, self.precision = self.precision, to
        if to != "fp16":
            self.scaler = None
        elif self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device.type)
        return was

    def set_checkpointing(self, to: str) -> str:
        """Switches checkpointing: ``none``, ``blocks`` (all of them) or ``every:N``
        (blocks 0, N, 2N, …, as `headroom train`'s model.checkpoint); what it was."""
        every = 0 if to == "none" else 1 if to == "blocks" else int(to.split(":", 1)[1])
        if self._switch is not None:
            self._switch(every > 0)
        for i, block in enumerate(self._blocks or ()):
            _recomputed(block, every > 0 and i % every == 0)
        was, self.checkpointing = self.checkpointing, to
        return was


_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _recomputed(block: torch.nn.Module, on: bool) -> None:
    """Wraps (or unwraps) `block`'s forward in ``torch.utils.checkpoint``: in training,
    its activations are dropped after forward and recomputed in backward."""
    if not on:
        block.__dict__.pop("forward", None)
        return
    if "forward" in block.__dict__:
        return
    forward = block.forward

    def recomputing(*args, **kwargs):
        if torch.is_grad_enabled():
            return _recompute(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    block.forward = recomputing
