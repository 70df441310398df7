"""`headroom.plan`: where one training step's memory goes, measured before a run.

A probe step (forward, backward, optimizer step) at two micro-batch sizes, on the
model's device, measured as a run measures a step (`_torch.PeakMeter`: the allocator's
peak plus memory outside it on CUDA, the peak resident set on the CPU). The difference
between the two sizes is the activation memory per sample; the parameters, gradients and
optimizer state are counted tensor by tensor; what is left of the step's peak is fixed
overhead (the CUDA context and workspaces, or on the CPU the process itself: the
interpreter, libtorch, the allocator's slack). The model and optimizer are restored
afterwards: parameters, buffers, gradients, optimizer state and the RNG, bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import _batch, _native, _torch

# The controller's default target (core's Thresholds::default): the share of the budget
# a step's peak is grown up to.
DEFAULT_TARGET = 0.9


@dataclass(frozen=True)
class Plan:
    """One step's memory, split by what holds it (bytes)."""

    device: str
    seq_len: int
    # The two probe sizes and the step peaks measured there (as a run would measure them).
    sizes: tuple[int, int]
    peaks: tuple[int, int]
    parameters: int
    gradients: int
    optimizer: int
    activations_per_sample: float
    # The step's peak at zero samples minus parameters, gradients and optimizer state.
    fixed_overhead: int
    budget: int
    target: float

    @property
    def base(self) -> int:
        """A step's peak at zero samples: everything that does not grow with the batch."""
        return self.parameters + self.gradients + self.optimizer + self.fixed_overhead

    def predict(self, micro_batch: int) -> int:
        """The step's peak at `micro_batch` samples, bytes."""
        return int(self.base + self.activations_per_sample * micro_batch)

    def largest_micro_batch(self, budget: int | None = None, target: float | None = None):
        """The largest micro-batch whose predicted peak stays under `target` of `budget`
        (the plan's own by default); None when not even one sample fits."""
        room = (target or self.target) * (budget or self.budget) - self.base
        if self.activations_per_sample <= 0:
            return None
        n = int(room // self.activations_per_sample)
        return n if n >= 1 else None

    def table(self) -> str:
        mb = self.largest_micro_batch()
        rows = [
            ("parameters", _fmt(self.parameters)),
            ("gradients", _fmt(self.gradients)),
            ("optimizer state", _fmt(self.optimizer)),
            (
                "activations",
                f"{_fmt(self.activations_per_sample)} per sample"
                + (f" of {self.seq_len} tokens" if self.seq_len > 1 else ""),
            ),
            ("fixed overhead", _fmt(self.fixed_overhead)),
        ]
        for n, p in zip(self.sizes, self.peaks):
            rows.append((f"measured at {n}", f"{_fmt(p)} (predicted {_fmt(self.predict(n))})"))
        rows.append(
            (
                f"largest micro-batch under {self.target:.0%} of {_fmt(self.budget)}",
                "none: one sample does not fit"
                if mb is None
                else f"{mb} (predicted peak {_fmt(self.predict(mb))})",
            )
        )
        width = max(len(k) for k, _ in rows)
        head = f"headroom plan on {self.device}: one step's memory"
        return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])

    def __str__(self) -> str:
        return self.table()


def plan(
    model: torch.nn.Module,
    sample_batch: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    sizes: tuple[int, int] | None = None,
    budget: int | str | None = None,
    target: float = DEFAULT_TARGET,
    show: bool = True,
) -> Plan:
    """Measures where a step's memory goes and prints the table (`show=False`: only
    returns it). `loss_fn(micro_batch)` is the loss a run's `backward` takes;
    `sample_batch` holds at least the larger probe size (default: half the batch and the
    whole batch). `budget`: the memory the run may use (bytes or "6GiB"; default the
    device's memory, or the host's on the CPU). The model and optimizer are left as
    they were."""
    n = _batch.size_of(sample_batch)
    small, large = sizes or (max(1, n // 2), n)
    if not 1 <= small < large <= n:
        raise ValueError(
            f"sizes=({small}, {large}): give two micro-batch sizes 1 ≤ a < b ≤ the sample "
            f"batch's {n} samples"
        )
    device = _torch.resolve_device(None, model)
    seq = _batch.seq_len_of(sample_batch)
    saved = _Saved(model, optimizer, device)
    meter = _torch.PeakMeter(device)
    try:

        def probe(k: int) -> tuple[int, tuple[int, int, int]]:
            _clear_grads(model)
            meter.reset()
            loss = loss_fn(_batch.take(sample_batch, 0, k))
            loss.backward()
            if optimizer is not None:
                optimizer.step()
            peak = meter.peak()
            del loss
            return peak, _torch.memory_parts(model, optimizer)

        # Each size twice, the second measured: a run's step starts where the step before
        # it (of the same size) left the allocator, not from a trimmed heap; the first
        # step also warms up what a run's first step would (lazy kernels and pools, the
        # optimizer's state).
        _torch.free_memory(device)
        probe(small)
        p_small, _ = probe(small)
        probe(large)
        p_large, (params, grads, opt) = probe(large)
    finally:
        _clear_grads(model)
        saved.restore()
        _torch.free_memory(device)
    # What the saved copy adds to the process during the probes (the CPU; on CUDA the
    # copy is in host memory, outside the measurement) is not the run's.
    extra = saved.resident_bytes
    p_small, p_large = p_small - extra, p_large - extra
    per_sample = max(0.0, (p_large - p_small) / (large - small))
    intercept = p_small - per_sample * small
    fixed = int(intercept) - params - grads - opt
    if budget is None:
        limit = _torch.device_total(device) or _host_total()
    elif isinstance(budget, str):
        limit = _native.parse_bytes(budget)
    else:
        limit = int(budget)
    result = Plan(
        device=str(device),
        seq_len=seq,
        sizes=(small, large),
        peaks=(p_small, p_large),
        parameters=params,
        gradients=grads,
        optimizer=opt,
        activations_per_sample=per_sample,
        fixed_overhead=fixed,
        budget=limit,
        target=target,
    )
    if show:
        print(result.table())
    return result


class _Saved:
    """The model's and optimizer's state before the probes, in host memory, put back
    after them (in place: references the caller holds stay valid)."""

    def __init__(self, model: torch.nn.Module, optimizer, device: torch.device):
        cpu = torch.device("cpu")
        self.model = model
        self.optimizer = optimizer
        self.tensors = {k: v.detach().to(cpu, copy=True) for k, v in model.state_dict().items()}
        self.grads = [
            None if p.grad is None else p.grad.detach().to(cpu, copy=True)
            for p in model.parameters()
        ]
        self.opt_state = None if optimizer is None else copy.deepcopy(optimizer.state_dict())
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device
        held = list(self.tensors.values()) + [g for g in self.grads if g is not None]
        # The state dict's copy is on the model's device when that is the CPU.
        if self.opt_state is not None:
            held += list(_tensors_in(self.opt_state))
        self.resident_bytes = _torch.tensor_bytes(held) if device.type == "cpu" else 0

    def restore(self) -> None:
        with torch.no_grad():
            current = self.model.state_dict()
            for k, v in self.tensors.items():
                current[k].copy_(v)
            for p, g in zip(self.model.parameters(), self.grads):
                p.grad = None if g is None else g.to(p.device)
        if self.optimizer is not None:
            # load_state_dict keeps the saved state's tensors; a fresh optimizer's is empty.
            self.optimizer.state.clear()
            self.optimizer.load_state_dict(self.opt_state)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def _clear_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _tensors_in(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def _host_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemTotal from /proc/meminfo; give budget=")


def _fmt(n: float) -> str:
    return _torch._fmt(int(n))
