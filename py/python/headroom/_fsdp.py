"""FSDP2 (``fully_shard``) under adaptive micro-batching, without a deadlock.

FSDP all-gathers each unit's parameters in forward and backward and reduce-scatters its
gradients, so every rank must run the same collectives in the same order, and a rank that
runs out of memory inside a unit would leave the others waiting in the next one. Three
rules make that impossible:

* **The same number of micro-batches on every rank.** At each step the ranks agree on
  the count (the largest any rank's controller needs; a rank with fewer samples or more
  memory splits its batch into as many, smaller, pieces). Sizes may differ per rank.
* **A gate before every collective.** headroom hands each FSDP unit its own all-gather
  and reduce-scatter (FSDP2's public ``set_custom_all_gather``/``set_custom_reduce_scatter``):
  each allocates its buffer as FSDP's does, then, before the collective, every rank says
  through one small all-reduce on headroom's own gloo group whether all is well. A rank
  that ran out of memory (in a unit's compute, or allocating the next buffer) is by then
  out of the step and answers every gate the others reach with "out of memory" until
  each of them has left the step too: no rank ever enters a collective another will not.
* **The step starts over on every rank.** Once every rank is out, FSDP's state is put back
  to between steps (:func:`reset`), the step's gradients are dropped, the controller of
  the rank that ran out shrinks, the ranks agree on the new count, and the step's samples
  run again from the first: exact, at the cost of the micro-batches already done.

A stop signal mid-step travels the same way: the signalled rank leaves the step at its
next gate or micro-batch with "stop", the others leave at theirs, and the step is given
up on every rank at the agreement (its gradients dropped, the last completed step saved).

Accumulation: gradient sync is off for all micro-batches but the last (each rank holds its
units' unsharded gradients meanwhile; one reduce-scatter per unit per step, the traffic of
a fixed-batch run) while those gradients take at most a tenth of the memory limit; past
that, a reduce-scatter after every micro-batch keeps them sharded (:data:`HOLD_SHARE`,
the run's ``sharded_accumulation=``). docs/PYTHON.md, "FSDP2".

A gate's promise holds only if nothing between it and the collective can fail: every rank
that passed it is inside the collective a moment later. So the collective's buffer is
allocated before the gate, and the collective itself runs with the hard cap lifted
(gloo's all-gather allocates a temporary as large as its output, under the cap a failure
after the others had entered: the deadlock of issue 44). A rank that still cannot enter a
collective it passed the gate for ends the job (:class:`CollectiveFailed`): the others are
inside it, and only the end of this process lets them out.

Only torch.distributed moves data between ranks. FSDP2's between-steps state is private to
torch before 2.15 (_internals): :func:`check` refuses a torch whose FSDP2 lacks what
:func:`reset` puts back.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import _internals, _torch

# What a gate carries: [worst status, whether any rank is still in the step]. The worst
# (the largest) decides: a failure ends the job, a stop gives the step up, an
# out-of-memory error has it redone.
RUNNING, OOM, ABANDON, FAILED = 0.0, 1.0, 1.5, 2.0


class PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory mid-step: this rank leaves the step to redo it."""


class StopRequested(RuntimeError):
    """A stop signal reached this rank mid-step: it leaves the step at its next gate (or
    micro-batch), and every rank gives the step up."""


class PeerAbandoned(RuntimeError):
    """Another rank left the step for a stop signal: this one gives it up too."""


class PeerFailed(RuntimeError):
    """Another rank failed mid-step (not out of memory): the agreement says which, why."""


class CollectiveFailed(RuntimeError):
    """This rank passed a gate and then could not enter the collective behind it: the
    other ranks are inside it and wait for this one, so the job cannot go on. Raised
    past the gates and the agreement (which the others can no longer reach); the
    process's end is what frees them (torchrun ends the job)."""


def is_comm_error(e: BaseException) -> bool:
    """A collective failed under this rank (a peer died: gloo sees its connection close)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("gloo" in text or "Connection" in text)


def fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def is_fsdp2(model: Any) -> bool:
    cls = fsdp_module_type()
    return cls is not None and isinstance(model, cls)


def units(model: torch.nn.Module) -> list[Any]:
    cls = fsdp_module_type()
    return [m for m in model.modules() if isinstance(m, cls)]


def outermost(module: torch.nn.Module) -> Any:
    """The FSDP2 root of `module`: itself when sharded at its top, else the one outermost
    FSDP unit below it holding every trainable parameter (a LightningModule whose
    ``configure_model`` sharded ``self.net``); None when there is no such unit."""
    cls = fsdp_module_type()
    if cls is None:
        return None
    if isinstance(module, cls):
        return module
    tops = []
    for name, m in module.named_modules():
        if isinstance(m, cls) and not any(name.startswith(t + ".") for t, _ in tops):
            tops.append((name, m))
    if len(tops) != 1:
        return None
    held = {id(p) for p in tops[0][1].parameters()}
    if all(id(p) in held for p in module.parameters() if p.requires_grad):
        return tops[0][1]
    return None


def check(model: Any) -> str | None:
    """Why this FSDP2 model cannot be run adaptively (None: it can): what this torch's
    FSDP2 lacks of what the gates and the reset need (_internals)."""
    return _internals.fsdp_missing(model)


class Gates:
    """The agreement before each of FSDP's collectives, on headroom's own gloo group."""

    def __init__(self, dist, group):
        self.dist = dist
        self.group = group
        self.passed = 0
        self.reduce_scatters = 0
        self.us = 0.0
        # While a step's micro-batches run: whether this rank is to leave the step (a stop
        # signal arrived), asked before each gate, so a long micro-batch is left promptly.
        self.leaving = None
        # The rounds' tensors, made once: a round must not allocate (under a full cap, an
        # allocation in `leave` would strand the others at their gates).
        self._round_buf = torch.zeros(2, dtype=torch.float64)
        self._count_buf = torch.zeros(2, dtype=torch.float64)

    def close(self) -> None:
        """The run has ended: FSDP's collectives pass without a gate from now on (a
        forward after training, an export), and the gates' group goes with the run."""
        group, self.group = self.group, None
        if group is not None:
            self.dist.destroy_process_group(group)

    def _round(self, status: float, running: float) -> tuple[float, float]:
        t = self._round_buf
        t[0], t[1] = status, running
        t0 = time.perf_counter()
        with _torch.cap_lifted():
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        self.us += (time.perf_counter() - t0) * 1e6
        return float(t[0]), float(t[1])

    def gate(self) -> None:
        """Before a collective: every rank is here, or one is out of the step."""
        if self.group is None:
            return
        if self.leaving is not None and self.leaving():
            raise StopRequested("a stop signal on this rank")
        status, _ = self._round(RUNNING, 1.0)
        self.passed += 1
        if status == OOM:
            raise PeerOutOfMemory("another rank ran out of memory in this step")
        if status == ABANDON:
            raise PeerAbandoned("another rank left this step for a stop signal")
        if status == FAILED:
            raise PeerFailed("another rank failed in this step")

    def leave(self, status: float) -> float:
        """This rank is out of the step (`status`: RUNNING when it completed it): answers
        the others' gates until every rank is out; the worst status any rank left with."""
        worst = status
        while True:
            got, running = self._round(status, 0.0)
            worst = max(worst, got)
            status = max(status, got)
            if running == 0.0:
                return worst

    def count(self, wanted: int, give_up: bool = False) -> int:
        """The step's micro-batch count every rank runs: the largest any wants; 0 when a
        rank gives up (it cannot fit one sample)."""
        t = self._count_buf
        t[0], t[1] = float(wanted), 1.0 if give_up else 0.0
        with _torch.cap_lifted():
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return 0 if t[1] > 0 else int(t[0])

    def enter(self, what: str, collective, *args, **kwargs):
        """A collective behind a gate every rank passed: entered with the cap lifted, and
        never left for the gates' rounds (the others are inside it)."""
        try:
            with _torch.cap_lifted():
                return collective(*args, **kwargs)
        except Exception as e:
            if is_comm_error(e):
                raise
            raise CollectiveFailed(
                f"this rank passed the gate of FSDP's {what} and could not enter it "
                f"({type(e).__name__}: {_torch.first_line(e)}); the other ranks are inside "
                "it, so the job cannot go on"
            ) from e


def _comms(gates: Gates):
    AllGather, ReduceScatter = _internals.fsdp_comm_bases()

    class GatedAllGather(AllGather):
        """FSDP's own all-gather, its buffer allocated first, behind a gate."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            gates.gate()
            return gates.enter(
                "all-gather",
                gates.dist.all_gather_into_tensor,
                output_tensor,
                input_tensor,
                group=group,
                async_op=async_op,
            )

    class GatedReduceScatter(ReduceScatter):
        """FSDP's own reduce-scatter, its buffer allocated first, behind a gate."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            gates.gate()
            gates.reduce_scatters += 1
            return gates.enter(
                "reduce-scatter",
                gates.dist.reduce_scatter_tensor,
                output=output_tensor,
                input=input_tensor,
                group=group,
                op=op,
                async_op=async_op,
            )

    return GatedAllGather(), GatedReduceScatter()


# Holding every unit's unsharded gradients between micro-batches costs a full replica of
# the gradients on each rank, what sharding was for; a reduce-scatter after every
# micro-batch keeps them sharded for a reduce-scatter per micro-batch (12-27% slower on a
# 2-core CPU with gloo, docs/BENCHMARKS.md "headroom under FSDP2"). "auto" holds them
# while they take at most this share of the memory limit.
HOLD_SHARE = 0.10


def unsharded_grad_bytes(model: torch.nn.Module) -> int:
    """What every trainable parameter's unsharded gradient takes (a DTensor's numel is
    its global one)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def holds_unsharded(choice: str, grad_bytes: int, limit: int) -> bool:
    """Whether the run keeps the unsharded gradients until the last micro-batch."""
    if choice != "auto":
        return choice == "hold"
    return limit <= 0 or grad_bytes <= HOLD_SHARE * limit


def install(model: torch.nn.Module, gates: Gates) -> int:
    """Every FSDP unit of `model` collects through the gates; the number of units."""
    found = units(model)
    for unit in found:
        all_gather, reduce_scatter = _comms(gates)
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)
    return len(found)


def set_sync(model: torch.nn.Module, on: bool) -> None:
    """Gradient reduce-scatter in this micro-batch's backward (the last one) or not."""
    model.set_requires_gradient_sync(on)


def reset(model: torch.nn.Module) -> None:
    """FSDP's state back to between steps after an exception left a forward or backward
    half run: no pending all-gather or reduce-scatter, every unit resharded, no
    unsharded gradient accumulated, the next forward the start of an iteration."""
    _internals.fsdp_reset(model)
    set_sync(model, True)
