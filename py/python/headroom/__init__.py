"""headroom for PyTorch: any training loop on the headroom dashboard, watched or with its
micro-batch steered by headroom's memory controller. The whole API: docs/PYTHON.md.

    import headroom
    run = headroom.Run("cnn")            # watch only
    ...
    run.report(loss)                     # once per step

    run = headroom.Run("gpt", model=model, effective_batch=64)   # adaptive
    loss = run.backward(batch, lambda mb: model(mb).loss)
    run.step(optimizer)
"""

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "headroom works with the PyTorch of your environment and found none; install "
        "torch (e.g. pip install torch), then import headroom"
    ) from e

from ._batch import BatchError
from ._dist import RankFailed
from ._native import PROTOCOL, VERSION
from ._run import LossError, OptimizerStepFailed, OutOfMemory, Run, RunError

__version__ = VERSION

__all__ = [
    "PROTOCOL",
    "BatchError",
    "LossError",
    "OptimizerStepFailed",
    "OutOfMemory",
    "RankFailed",
    "Run",
    "RunError",
    "__version__",
]
