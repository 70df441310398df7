"""The errors headroom raises, in one module that imports nothing of the package: every
module raises them from here, so none needs `_run` (which imports them all) to raise one.

`headroom.RunError` and the others are these classes; `headroom._run`, `headroom._dist`
and `headroom._batch` re-export the ones they held before, for code that imports them
from there."""

from __future__ import annotations


class RunError(RuntimeError):
    """headroom was used in a way it cannot honour (the message says how to fix it)."""


class OutOfMemory(RuntimeError):
    """A step ran out of memory even at the smallest micro-batch."""


class OptimizerStepFailed(RuntimeError):
    """An out-of-memory error inside optimizer.step() after it had changed parameters or
    optimizer state, which cannot be undone: the parameters are not those of any step."""


class LossError(ValueError):
    """A loss function returned something that is not a finite scalar."""


class RankFailed(RuntimeError):
    """Another rank of the job failed; this one ends too (the message says which)."""


class BatchError(ValueError):
    """A batch headroom cannot cut into micro-batches."""
