"""Cutting a batch into micro-batches: tensors, and tuples, lists and dicts of them, are
split on dim 0; anything else in the structure is passed to every micro-batch as is."""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import _internals

# headroom._batch.BatchError stays importable (it was defined here before _errors).
from ._errors import BatchError

Split = Callable[[Any, int, int], Any]


def _leaves(batch: Any, path: str):
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, dict):
        for k, v in batch.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, v in enumerate(batch):
            yield from _leaves(v, f"{path}[{i}]")


def size_of(batch: Any) -> int:
    """The number of samples: the common dim 0 of every tensor in the batch."""
    leaves = list(_leaves(batch, "batch"))
    if not leaves:
        raise BatchError(
            f"the batch ({type(batch).__name__}) holds no tensor to split; hand over a "
            "tensor, or a tuple, list or dict of tensors, or pass split=fn(batch, start, "
            "end) and samples=N for other data"
        )
    for path, t in leaves:
        if t.dim() == 0:
            raise BatchError(
                f"{path} is a 0-d tensor, which has no dim 0 to split into micro-batches; "
                "give every tensor of the batch a leading sample dimension"
            )
    first_path, first = leaves[0]
    n = first.shape[0]
    for path, t in leaves[1:]:
        if t.shape[0] != n:
            raise BatchError(
                f"the batch's tensors disagree on dim 0: {first_path} has {n} samples, "
                f"{path} has {t.shape[0]}; every tensor is cut on dim 0 into micro-batches, "
                "so all must hold the same samples (or pass split= for packed data)"
            )
    return n


def take(batch: Any, start: int, end: int) -> Any:
    """Samples [start, end) of every tensor, the structure kept."""
    if isinstance(batch, torch.Tensor):
        return batch[start:end]
    if isinstance(batch, dict):
        return type(batch)((k, take(v, start, end)) for k, v in batch.items())
    if isinstance(batch, tuple):
        items = [take(v, start, end) for v in batch]
        # A namedtuple is rebuilt from its fields.
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    if isinstance(batch, list):
        return [take(v, start, end) for v in batch]
    return batch


def take_dynamic(batch: Any, start: int, end: int) -> Any:
    """`take`, with dim 0 of every tensor marked dynamic for torch.compile: the compiled
    model then serves each micro-batch size the controller picks from one graph, instead
    of compiling a static graph for the first size and recompiling at the next."""
    part = take(batch, start, end)
    for _, t in _leaves(part, "batch"):
        if t.dim() > 0:
            _internals.mark_dynamic(t, 0)
    return part


def seq_len_of(batch: Any) -> int:
    """Tokens per sample, for the controller's memory model: dim 1 of the first integer
    tensor of two or more dims (token ids), else 1 (a sample is the unit)."""
    for _, t in _leaves(batch, "batch"):
        if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex():
            return int(t.shape[1])
    return 1


def samples_of(batch: Any) -> int:
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
