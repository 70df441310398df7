"""Every contact with torch's private state, one function per need, and the probe that
tells at a Run's start whether this torch has what a capability needs.

headroom reaches past torch's documented API in a few places (FSDP2's step state after an
out-of-memory error, its collectives' base classes, DDP's forward broadcast, the job's
store, GradScaler's found-inf record, a tensor's version counter, torch.compile's wrapper,
the CUDA allocator's history). Each lives here and nowhere else, so a new torch is checked
against one file, and a torch whose internals differ is refused where the run starts,
naming its version and what works without the capability, never an AttributeError at the
first out-of-memory error. Where a newer torch has a public way (FSDP2's
``reset_iter_state`` since 2.15), that is used. Supported and tested: torch 2.11 to 2.15
(docs/PYTHON.md, "Supported torch").
"""

from __future__ import annotations

from typing import Any

import torch

# The releases the suite runs against (./dev test: the pin and the newest).
TESTED = ("2.11", "2.15")


def torch_version() -> str:
    return torch.__version__.split("+")[0]


def _supported_text() -> str:
    return f"headroom is tested with torch {TESTED[0]} to {TESTED[-1]}"


# ---- FSDP2 -----------------------------------------------------------------------------


def fsdp_comm_bases() -> tuple[type, type]:
    """FSDP2's base classes for a custom all-gather and reduce-scatter (what
    ``FSDPModule.set_custom_all_gather`` takes is public; the classes' module is not)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def _groups(state: Any) -> list[Any]:
    """A unit's parameter groups: one before torch 2.15 (``_fsdp_param_group``), a list
    since (``_fsdp_param_groups``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _has_public_reset(root: Any) -> bool:
    return callable(getattr(root, "reset_iter_state", None))


def _private_reset_missing(root: Any) -> str | None:
    """What the private reset (torch before 2.15) needs and this torch lacks."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    except ImportError:
        return "FSDP2's TrainingState"
    if not hasattr(TrainingState, "IDLE"):
        return "TrainingState.IDLE"
    get_state = getattr(root, "_get_fsdp_state", None)
    if get_state is None:
        return "FSDPModule._get_fsdp_state"
    state = get_state()
    ctx = getattr(state, "_state_ctx", None)
    if ctx is None or not hasattr(ctx, "all_states"):
        return "the FSDP state context's all_states"
    if not hasattr(state, "_fsdp_param_group") and not hasattr(state, "_fsdp_param_groups"):
        return "a unit's parameter groups"
    for name in ("iter_forward_root", "post_backward_final_callback_queued", "is_last_backward"):
        if not hasattr(ctx, name):
            return f"the FSDP state context's {name}"
    return None


def fsdp_missing(root: Any) -> str | None:
    """Why this torch's FSDP2 cannot be run adaptively by headroom (None: it can): the
    custom collectives it gates, and a way to put a unit back to between steps after an
    out-of-memory error (public since 2.15; torch's private state before)."""
    try:
        fsdp_comm_bases()
    except ImportError as e:
        return f"torch {torch_version()}'s FSDP2 has no custom collectives ({e})"
    for name in (
        "set_custom_all_gather",
        "set_custom_reduce_scatter",
        "set_requires_gradient_sync",
    ):
        if not callable(getattr(root, name, None)):
            return f"torch {torch_version()}'s FSDPModule has no {name}"
    if _has_public_reset(root):
        return None
    missing = _private_reset_missing(root)
    if missing is not None:
        return (
            f"torch {torch_version()}'s FSDP2 has neither FSDPModule.reset_iter_state (torch "
            f"2.15) nor the private step state headroom resets before it ({missing} is "
            f"missing), so a unit half run by an out-of-memory error could not be put back; "
            f"{_supported_text()}"
        )
    return None


def fsdp_reset(root: Any) -> None:
    """FSDP2's state back to between steps after an exception left a forward or backward
    half run: every unit resharded, no pending all-gather or reduce-scatter, no gradient
    of the attempt kept (the caller redoes the step from its first micro-batch)."""
    if _has_public_reset(root):
        root.reset_iter_state()
        return
    _private_fsdp_reset(root)


def _private_fsdp_reset(root: Any) -> None:
    """torch 2.11's step state put back by hand (what 2.15's reset_iter_state does)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state0 = root._get_fsdp_state()
    ctx = state0._state_ctx
    for state in ctx.all_states:
        for group in _groups(state):
            pending = getattr(group, "_all_gather_result", None)
            work = getattr(pending, "all_gather_work", None)
            if work is not None and hasattr(work, "wait"):
                # Launched behind a gate every rank passed: every rank is in it, so it
                # ends; its buffer must outlive it.
                work.wait()
            for name in (
                "_all_gather_result",
                "_partial_reduce_output",
                "_all_reduce_state",
                "_post_reduce_event",
            ):
                if hasattr(group, name):
                    setattr(group, name, None)
            indices = getattr(group, "_post_forward_indices", None)
            if indices is not None:
                # Indices into the post-forward order cleared below: the redo's backward
                # would prefetch by stale ones.
                indices.clear()
            for p in group.fsdp_params:
                if _settable(p, "unsharded_accumulated_grad"):
                    p.unsharded_accumulated_grad = None
                unsharded = getattr(p, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
            group._training_state = TrainingState.IDLE
            group.reshard()
        state._training_state = TrainingState.IDLE
        # A unit of several modules (fully_shard([norm, embed, head]), as accelerate makes
        # for a tied embedding) runs its pre-forward only when this set is empty: a
        # forward that raised inside it left the set full, and the redo would run the
        # modules on their shards, never gathered.
        pending = getattr(state, "_modules_to_run_forward", None)
        if pending is not None:
            pending.clear()
    ctx.iter_forward_root = None
    ctx.post_backward_final_callback_queued = False
    ctx.is_last_backward = True
    comm = getattr(state0, "_comm_ctx", None)
    if comm is not None:
        comm.all_gather_state = None
        comm.reduce_scatter_state = None
        if hasattr(comm, "post_forward_order"):
            comm.post_forward_order.clear()


def _settable(obj: Any, name: str) -> bool:
    """Whether `name` is a plain attribute of `obj` (torch 2.15 made FSDPParam's
    ``unsharded_accumulated_grad`` a read-only property)."""
    prop = getattr(type(obj), name, None)
    return not isinstance(prop, property) or prop.fset is not None


# ---- DDP -------------------------------------------------------------------------------


def ddp_forward_sync_off(ddp: Any) -> None:
    """DDP's forward broadcasts its buffers (and, after a find_unused_parameters
    backward, rebuilds state) each forward unless this is off: headroom broadcasts once
    per step instead (a retried forward must not enter a collective alone)."""
    ddp.require_forward_param_sync = False


def ddp_comm_hooks(ddp: Any) -> list[str]:
    """The communication hooks registered on DDP (``register_comm_hook``), by name: DDP
    keeps them in a private list."""
    hooks = getattr(ddp, "_comm_hooks", None) or []
    return [getattr(h, "__qualname__", None) or repr(h) for h, _ in hooks]


def ddp_buffers(ddp: Any) -> list[torch.Tensor]:
    """The buffers DDP broadcasts from rank 0 (its own list when it keeps one)."""
    return list(getattr(ddp, "modules_buffers", None) or ddp.module.buffers())


# ---- the job's store ---------------------------------------------------------------------


def default_store() -> Any:
    """The default process group's key-value store (torchrun's), or None: the job's slow
    path marks arrivals and liveness there."""
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


# ---- tensors, amp, compile, CUDA history -------------------------------------------------


def version(t: torch.Tensor) -> int:
    """A tensor's in-place version counter: bumped by every in-place change."""
    return t._version


def scaler_found_inf(scaler: Any, optimizer: Any) -> bool:
    """Whether the GradScaler's last unscale found inf/NaN gradients for `optimizer`
    (the record its ``step`` skipped by)."""
    per_device = scaler._found_inf_per_device(optimizer)
    return any(v.item() for v in per_device.values())


def compiled_wrapper_type() -> type | None:
    """torch.compile's module wrapper (``OptimizedModule``), or None."""
    dynamo = getattr(torch, "_dynamo", None)
    return getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)


def compiled_inner(model: Any) -> Any:
    """The module a torch.compile wrapper holds."""
    return model._orig_mod


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Tells torch.compile a tensor's dimension varies (the micro-batch's), so a new size
    does not compile a new graph."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def record_memory_history(on: bool) -> None:
    """The CUDA allocator's history, which an out-of-memory snapshot shows."""
    if on:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    torch.cuda.memory._dump_snapshot(path)


# ---- the probe -------------------------------------------------------------------------


def probe(fsdp_root: Any = None) -> dict[str, str | None]:
    """Each capability and why this torch lacks it (None: present); FSDP2's needs are
    read off a sharded root where one is given. What docs/PYTHON.md lists; a Run's start
    checks the FSDP2 capability of the model it is given (_fsdp.check)."""
    found: dict[str, str | None] = {}
    found["tensor version counters"] = (
        None if hasattr(torch.ones(1), "_version") else "Tensor._version is missing"
    )
    found["torch.compile wrapper"] = (
        None if compiled_wrapper_type() is not None else "no torch._dynamo OptimizedModule"
    )
    amp = getattr(torch, "amp", None)
    scaler = getattr(amp, "GradScaler", None)
    found["GradScaler's skipped steps"] = (
        None
        if scaler is not None and hasattr(scaler, "_found_inf_per_device")
        else "GradScaler._found_inf_per_device is missing"
    )
    if fsdp_root is not None:
        found["FSDP2 after an out-of-memory error"] = fsdp_missing(fsdp_root)
    return found
