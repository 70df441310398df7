"""Everything torch-specific: devices, a step's peak memory, the allocator's figures,
what an out-of-memory error looks like, and freeing memory after one.

The Rust extension links no libtorch; it reaches the user's torch only through here.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Callable

import torch

from . import _internals, _native

# What the allocators say when an allocation fails. CUDA raises torch.OutOfMemoryError;
# the CPU allocator raises a RuntimeError with one of these texts.
_OOM_TEXTS = ("out of memory", "not enough memory", "can't allocate memory")
# Under a hard cap (RLIMIT_DATA) memory runs out in places that do not name it, trusted
# only there: oneDNN fails to "create a primitive"; a thread cannot start, since its
# stack is a private writable mapping the cap counts (pthread_create's EAGAIN, which C++
# raises as "Resource temporarily unavailable": the autograd engine's and gloo's
# threads); C++'s operator new throws std::bad_alloc.
_CAPPED_OOM_TEXTS = (
    "could not create a primitive",
    "resource temporarily unavailable",
    "std::bad_alloc",
)

# Fault injection (tests, benchmarks): 2^52 bytes is beyond any machine, so asking the
# allocator for it raises the allocator's own out-of-memory error.
IMPOSSIBLE_BYTES = 1 << 52


def is_oom(exc: BaseException, capped: bool = False) -> bool:
    """True when `exc` says an allocation failed (CUDA or CPU)."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    if any(t in text for t in _OOM_TEXTS):
        return True
    return capped and any(t in text for t in _CAPPED_OOM_TEXTS)


def first_line(e: BaseException) -> str:
    """An error's first line (its type's name when it says nothing): what a notice, a
    record and the controller are told of it."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def provoke_oom(device: torch.device) -> None:
    """Raises a real out-of-memory error from `device`'s allocator."""
    torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8, device=device)
    raise RuntimeError("out of memory (injected: the oversized allocation succeeded)")


def is_compiled(model: Any) -> bool:
    """Whether `model` is torch.compile's wrapper (`OptimizedModule`), outermost or
    under a DDP/FSDP-style `.module`."""
    wrapper = _internals.compiled_wrapper_type()
    if wrapper is None or model is None:
        return False
    return isinstance(model, wrapper) or isinstance(getattr(model, "module", None), wrapper)


def uncompiled(model: Any) -> Any:
    """The module torch.compile wrapped (`torch.compile(DDP(model))`, the way PyTorch
    documents compiling DDP: DDP's optimizer splits the graph at its buckets), else
    `model` itself."""
    if is_compiled(model) and hasattr(model, "_orig_mod"):
        return _internals.compiled_inner(model)
    return model


def resolve_device(device: Any, model: Any) -> torch.device:
    """The device the run trains on: the argument, else the model's, else CUDA if any."""
    if device is not None:
        d = torch.device(device)
    elif model is not None:
        try:
            d = next(model.parameters()).device
        except StopIteration:
            d = torch.device("cpu")
    else:
        d = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {d} was asked for but torch sees no CUDA device; "
                "use device='cpu' or run on a machine with a GPU"
            )
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    elif d.type != "cpu":
        raise ValueError(f"device {d}: headroom measures cpu and cuda devices only")
    return d


def device_name(d: torch.device) -> str:
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return f"CPU ({torch.get_num_threads()} threads)"


def device_total(d: torch.device) -> int | None:
    if d.type == "cuda":
        return torch.cuda.mem_get_info(d)[1]
    return None


def cap_cuda(d: torch.device, budget: int) -> None:
    """Caps the caching allocator at `budget` bytes: past it, a real CUDA OOM."""
    total = torch.cuda.mem_get_info(d)[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), d)


class PeakMeter:
    """A step's peak memory and the limit it is a share of, as the built-in trainer
    measures it: on CUDA the allocator's peak allocated bytes plus the memory outside the
    allocator (the context, other processes); on the CPU the peak resident set."""

    def __init__(self, d: torch.device):
        self.device = d
        self.cuda = d.type == "cuda"
        self.exact = True
        try:
            self.reset()
        except OSError:
            # The kernel refused the peak reset: peaks are then the process's so far.
            self.exact = False

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.exact:
            _native.reset_peak_rss()

    def peak(self) -> int:
        if self.cuda:
            stats = torch.cuda.memory_stats(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            outside = max(0, total - free - stats.get("reserved_bytes.all.current", 0))
            return stats.get("allocated_bytes.all.peak", 0) + outside
        return _native.peak_rss()

    def take_peak(self) -> int:
        """The peak since the last call (or reset), and a new window from now: what the
        extension's reporter thread calls for a watch-only step on CUDA (under the GIL:
        memory_stats() flattens the allocator's statistics in Python meanwhile)."""
        peak = self.peak()
        self.reset()
        return peak

    def held(self) -> int:
        """What the process holds now (the fixed part before the first step)."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return _native.rss() or 0


def tensor_bytes(tensors, seen: set[int] | None = None) -> int:
    """Bytes of `tensors` this process holds (a DTensor's local shard: FSDP2's parameters,
    gradients and optimizer state), each storage counted once (across calls sharing
    `seen`)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        to_local = getattr(t, "to_local", None)
        if callable(to_local):
            t = to_local()
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def memory_parts(model: Any, optimizer: Any) -> tuple[int, int, int]:
    """Bytes of the model's parameters, their gradients (as they stand: call before
    zero_grad) and the optimizer's state tensors, each tensor counted once."""
    seen: set[int] = set()
    params = list(model.parameters()) if model is not None else []
    p = tensor_bytes(params, seen)
    g = tensor_bytes((q.grad for q in params if q.grad is not None), seen)
    state = optimizer.state.values() if optimizer is not None else ()
    o = tensor_bytes((v for s in state for v in s.values()), seen)
    return p, g, o


def start_thread_pools() -> None:
    """Starts torch's threads now, before a hard cap is set: each thread's stack is
    memory the cap counts, and a thread started under a full cap fails to start (EAGAIN),
    which no smaller micro-batch can cure. The CPU's intra-op pool (sized by the
    machine's cores), and the autograd engine's device threads, which its first backward
    starts (8 of them, 8 MiB of stack each, on this CPU once torch.distributed is up)."""
    torch.ones(1 << 17).mul_(2.0)
    torch.ones(1, requires_grad=True).sum().backward()


_lifts = 0
_lifted = False


@contextlib.contextmanager
def cap_lifted():
    """The hard cap lifted for the block: a collective every rank has agreed to enter.
    Once the others are inside it, this rank must enter it too, and the collective's own
    allocations (gloo's all_gather_into_tensor allocates a temporary as large as its
    output; its threads' stacks) must not fail under the cap, which stands for the
    device's memory, where NCCL's buffers are its own. Nested blocks lift once; without a
    cap this is two cheap calls."""
    global _lifts, _lifted
    if _lifts == 0:
        _lifted = _native.lift_cap()
    _lifts += 1
    try:
        yield
    finally:
        _lifts -= 1
        if _lifts == 0 and _lifted:
            _lifted = False
            _native.restore_cap()


def free_memory(d: torch.device) -> None:
    """Drops what a failed attempt left (its frames are gone once the exception is), and
    returns cached memory: the CUDA cache, or glibc's free heap pages."""
    gc.collect()
    if d.type == "cuda":
        torch.cuda.empty_cache()
    else:
        _native.trim_heap()


def held_text(d: torch.device) -> str:
    if d.type == "cuda":
        return f"reserved {_fmt(torch.cuda.memory_reserved(d))}"
    rss = _native.rss()
    return f"resident {_fmt(rss) if rss is not None else '?'}"


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


class CudaAllocator:
    """The caching allocator's figures and segment map for the sampler (read on its
    thread, a few times a second; `memory_stats` needs no device sync)."""

    def __init__(self, d: torch.device):
        self.device = d

    def stats(self) -> dict[str, int] | None:
        s = torch.cuda.memory_stats(self.device)

        def g(key: str) -> int:
            return int(s.get(key, 0))

        return {
            "allocated": g("allocated_bytes.all.current"),
            "allocated_peak": g("allocated_bytes.all.peak"),
            "reserved": g("reserved_bytes.all.current"),
            "reserved_peak": g("reserved_bytes.all.peak"),
            "active": g("active_bytes.all.current"),
            "active_peak": g("active_bytes.all.peak"),
            "inactive_split": g("inactive_split_bytes.all.current"),
            "inactive_split_peak": g("inactive_split_bytes.all.peak"),
            "requested": g("requested_bytes.all.current"),
            "requested_peak": g("requested_bytes.all.peak"),
            "num_alloc_retries": g("num_alloc_retries"),
            "num_ooms": g("num_ooms"),
            "segments": g("segment.all.current"),
        }

    def segments(self) -> list[tuple[int, int, str, list[tuple[int, bool]]]] | None:
        index = self.device.index or 0
        out = []
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device", 0) != index:
                continue
            # active_allocated and active_pending_free are held by tensors (or streams);
            # only "inactive" is cached space the allocator could reuse.
            blocks = [(int(b["size"]), b.get("state") != "inactive") for b in seg["blocks"]]
            out.append(
                (
                    int(seg["address"]),
                    int(seg["total_size"]),
                    str(seg.get("segment_type", "large")),
                    blocks,
                )
            )
        return out


# torch.optim classes whose update is elementwise per parameter and that offer `fused`:
# one kernel that updates parameters and state in place with no parameter-sized memory
# (py/tests/test_optimizer.py measures it), so an OOM can only strike before anything
# changed, which headroom undoes.
_FUSABLE = ("Adam", "AdamW", "SGD", "Adagrad")


def unwrap_optimizer(opt: Any) -> Any:
    """The optimizer under a framework's wrapper (Lightning's ``LightningOptimizer``,
    accelerate's ``AcceleratedOptimizer``, Fabric's): the one whose update runs."""
    seen = set()
    while id(opt) not in seen:
        seen.add(id(opt))
        inner = getattr(opt, "_optimizer", None)
        if inner is None:
            inner = getattr(opt, "optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            break
        opt = inner
    return opt


def optimizer_name(opt: Any) -> str:
    """The optimizer as its user wrote it: ``torch.optim.AdamW``, ``mypkg.Lion``."""
    opt = unwrap_optimizer(opt)
    kind = type(opt)
    if kind.__module__.startswith("torch.optim") and hasattr(torch.optim, kind.__name__):
        return f"torch.optim.{kind.__name__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def is_fused(opt: Any) -> bool:
    """Whether every parameter group of the (unwrapped) optimizer runs the fused update."""
    opt = unwrap_optimizer(opt)
    return bool(opt.param_groups) and all(g.get("fused") for g in opt.param_groups)


def optimizer_advice(opt: Any) -> str | None:
    """What to say, once, about whether `opt.step()` can be made all-or-nothing: of the
    optimizer the user made (under any framework's wrapper), and only where it is true."""
    if getattr(opt, "headroom_steps_it", True) is False:
        # A framework stepped it already (the HF Trainer): headroom's undo never runs.
        return None
    inner = unwrap_optimizer(opt)
    name = optimizer_name(inner)
    kind = type(inner).__name__
    if kind in _FUSABLE and name.startswith("torch.optim."):
        if is_fused(inner):
            return None
        return (
            f"{name} without fused=True allocates parameter-sized temporaries in the middle "
            "of its update, so an out-of-memory error there cannot be undone (headroom would "
            f"stop with OptimizerStepFailed rather than train on half-updated parameters); "
            f"{name}(..., fused=True) allocates none once the update begins, and makes every "
            "step all-or-nothing"
        )
    return (
        f"{name}.step(): headroom undoes an out-of-memory error that strikes before the "
        "step changed a parameter or its state, and stops with OptimizerStepFailed on one "
        "after; a fused torch.optim optimizer (Adam, AdamW, SGD, Adagrad with fused=True) "
        "is all-or-nothing"
    )


def rank_info() -> dict[str, str] | None:
    """torchrun's environment: the job and this process's rank, when launched by it."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {k: os.environ.get(k, "") for k in keys}


class OptimizerSnapshot:
    """What optimizer.step() may change, seen before it runs: version counters of the
    parameters and state tensors, the scalar state (step counters) by value, and which
    parameters had no state yet."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.versions = [_internals.version(p) for p in self.params]
        self.stateless = [p for p in self.params if not opt.state.get(p)]
        self.tensors = []
        self.scalars = []
        for p in self.params:
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    if v.numel() == 1:
                        self.scalars.append((v, v.detach().clone()))
                    else:
                        self.tensors.append((v, _internals.version(v)))

    def restore(self) -> bool:
        """Undoes a failed step that changed nothing but scalars and new state; False
        when a parameter or a state tensor was changed in place."""
        if any(_internals.version(p) != v for p, v in zip(self.params, self.versions)):
            return False
        if any(_internals.version(t) != v for t, v in self.tensors):
            return False
        with torch.no_grad():
            for t, v in self.scalars:
                t.copy_(v)
        for p in self.stateless:
            self.opt.state.pop(p, None)
        return True


def backward_of(weighted: torch.Tensor, backward: Callable | None, scaler: Any) -> None:
    """One micro-batch's backward: the loss scaled per micro-batch when a GradScaler is
    given (scaling is linear, so the scaled sum is the scaled full-batch loss), then the
    user's backward (a framework's, carrying its precision and strategy) or autograd's."""
    if scaler is not None:
        weighted = scaler.scale(weighted)
    if backward is None:
        weighted.backward()
    else:
        backward(weighted)


def scaler_update(scaler: Any, optimizer: torch.optim.Optimizer) -> tuple[float, float] | None:
    """``scaler.update()`` after its step; the loss scale before and after when the step
    was skipped for inf/NaN gradients (None when it was taken, or with no scaler)."""
    if scaler is None:
        return None
    found_inf = scaler.is_enabled() and _internals.scaler_found_inf(scaler, optimizer)
    before = scaler.get_scale()
    scaler.update()
    return (before, scaler.get_scale()) if found_inf else None
