"""Evaluation that does not run out of memory: one evaluation batch run in chunks the
run's controller sizes (core/src/policy/eval.rs), a chunk that runs out of memory retried
smaller (only its samples), the size kept for the next batch, the chunks' results combined
into what the whole batch would have given. `Run.evaluate` (a hand-written loop),
`headroom.hf.adapt` (the Trainer's ``prediction_step``) and `headroom.lightning.Adaptive`
(validation, test and predict steps) run their batches through `run_batch`.

How chunks combine (`combine=`, per leaf of a tuple, list or dict result):
- ``"mean"``: weighted by the chunk's samples (a floating-point scalar's default: a mean
  loss of the batch is the samples-weighted mean of the chunks' means, summed in float64);
- ``"sum"``: added (an integer scalar's default: counts add up);
- ``"cat"``: concatenated along dim 0 (a tensor with a batch dimension's default: logits,
  predictions, per-sample losses);
- a function ``fn(parts)`` of ``[(samples, result), ...]`` for anything else (a median,
  a metric object).
A batch that needed no split returns exactly what ``fn`` returned.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import _batch, _torch
from ._errors import BatchError, OutOfMemory


class Plain:
    """The sizer when there is no run to ask (Lightning's sanity check runs before the
    fit's run exists): halves after an out-of-memory error and keeps the size; no
    records."""

    def __init__(self) -> None:
        self.size: int | None = None

    def eval_size(self, asked: int, seq_len: int) -> int:
        return asked if self.size is None else max(1, min(asked, self.size))

    def eval_chunk(self, size: int, seq_len: int, peak: int) -> None:
        pass

    def eval_oom(self, size: int, seq_len: int, error: str) -> int | None:
        self.size = size // 2 if size > 1 else None
        return self.size


def run_batch(
    sizer: Any,
    meter: _torch.PeakMeter | None,
    device: torch.device,
    batch: Any,
    fn: Callable[[Any], Any],
    *,
    capped: bool = False,
    combine: Any = None,
    cut: Callable[[Any, int, int], Any] | None = None,
    samples: int | None = None,
    seq_len: int | None = None,
    on_chunk: Callable[[Any, Callable[[Any], Any]], Any] | None = None,
    after_oom: Callable[[], Any] | None = None,
) -> Any:
    """`fn` over `batch` in chunks `sizer` (a NativeRun or `Plain`) sizes; the combined
    result. `on_chunk(chunk, fn)` makes each call in its place (Lightning points its
    logging at the chunk first); `after_oom()` puts the model back after an out-of-memory
    error left a forward half run (FSDP2's units)."""
    n = samples if samples is not None else _batch.size_of(batch)
    seq = seq_len or (_batch.seq_len_of(batch) if cut is None else 1)
    cut = cut or _batch.take
    if n < 1:
        raise BatchError("the evaluation batch holds no samples")
    size = sizer.eval_size(n, seq)
    parts: list[tuple[int, Any]] = []
    start = 0
    while start < n:
        end = min(n, start + size)
        if meter is not None:
            meter.reset()
        failed = None
        try:
            chunk = batch if (start, end) == (0, n) else cut(batch, start, end)
            out = on_chunk(chunk, fn) if on_chunk is not None else fn(chunk)
        except Exception as e:
            if not _torch.is_oom(e, capped=capped):
                raise
            failed = _torch.first_line(e)
        chunk = None
        if failed is None:
            sizer.eval_chunk(end - start, seq, meter.peak() if meter is not None else 0)
            parts.append((end - start, out))
            out = None
            start = end
            continue
        # Out of memory: the attempt's tensors went with its frames; only this chunk's
        # samples are retried, the completed chunks' results kept.
        retry = sizer.eval_oom(end - start, seq, failed)
        if after_oom is not None:
            after_oom()
        _torch.free_memory(device)
        if retry is None:
            raise OutOfMemory(
                f"evaluation ran out of memory at one sample ({seq} tokens): {failed}. "
                "Give the run more memory or make a sample smaller"
            )
        size = retry
    return combine_parts(parts, combine)


def combine_parts(parts: list[tuple[int, Any]], how: Any = None) -> Any:
    """The chunks' results as the whole batch's (the module's doc says how)."""
    if callable(how):
        return how(parts)
    if how not in (None, "mean", "sum", "cat"):
        raise ValueError(f'combine={how!r}: use "mean", "sum", "cat" or a function of the parts')
    if len(parts) == 1:
        return parts[0][1]
    sizes = [n for n, _ in parts]
    return _merge([v for _, v in parts], sizes, how, "the result")


def _merge(values: list, sizes: list[int], how: str | None, path: str) -> Any:
    first = values[0]
    if first is None:
        return None
    if isinstance(first, dict):
        merged = {k: _merge([v[k] for v in values], sizes, how, f"{path}[{k!r}]") for k in first}
        return merged if type(first) is dict else type(first)(**merged)
    if isinstance(first, (tuple, list)):
        items = [
            _merge([v[i] for v in values], sizes, how, f"{path}[{i}]") for i in range(len(first))
        ]
        if hasattr(first, "_fields"):  # a namedtuple
            return type(first)(*items)
        return type(first)(items)
    if isinstance(first, torch.Tensor):
        mode = how or ("cat" if first.dim() > 0 else "sum" if _integral(first) else "mean")
    elif isinstance(first, (int, float)) and not isinstance(first, bool):
        mode = how or ("sum" if isinstance(first, int) else "mean")
    else:
        raise TypeError(
            f"{path} is a {type(first).__name__}, which headroom cannot combine across the "
            "chunks of a split evaluation batch; give combine=fn, fn([(samples, result), "
            "...]) returning the whole batch's"
        )
    if mode == "cat":
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise TypeError(f'{path}: combine="cat" needs tensors with a batch dimension')
        for v, n in zip(values, sizes):
            if v.shape[0] != n:
                raise TypeError(
                    f"{path} has {v.shape[0]} rows for a chunk of {n} samples: it is not "
                    'per sample, so "cat" cannot join it; give combine="mean", "sum" or a '
                    "function"
                )
        return torch.cat(values, 0)
    total = sum(sizes)
    if isinstance(first, torch.Tensor):
        acc = sum(v.double() * (n if mode == "mean" else 1) for v, n in zip(values, sizes))
        if mode == "mean":
            acc = acc / total
        return acc.to(first.dtype)
    acc = sum(float(v) * (n if mode == "mean" else 1) for v, n in zip(values, sizes))
    if mode == "mean":
        return acc / total
    return type(first)(acc)


def _integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())
