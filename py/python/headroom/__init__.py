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

from importlib import import_module

from ._native import PROTOCOL, VERSION

__version__ = VERSION

# The torch layer loads on first use, not at import: the `headroom` command (the viewer,
# headroom/_cli.py) imports this package and must start without paying for torch (nor
# for `typing`, a tenth of an idle start).
_LAZY = {
    "BatchError": "._errors",
    "LossError": "._errors",
    "OptimizerStepFailed": "._errors",
    "OutOfMemory": "._errors",
    "Plan": "._plan",
    "RankFailed": "._errors",
    "Run": "._run",
    "RunError": "._errors",
    "plan": "._plan",
}


# The framework layers, also loaded on first use (`headroom.hf.adapt(trainer)` after a plain
# `import headroom`): `import headroom` imports neither transformers nor lightning.
_SUBMODULES = ("hf", "lightning")


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None and name not in _SUBMODULES:
        raise AttributeError(f"module 'headroom' has no attribute {name!r}")
    try:
        import torch  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "headroom works with the PyTorch of your environment and found none; install "
            "torch (e.g. pip install torch), then use headroom"
        ) from e
    if module is None:
        # The submodule's own ImportError names the package it needs.
        return import_module(f".{name}", __name__)
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """What `dir(headroom)` and a shell's completion list: the lazy names too."""
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


__all__ = [
    "PROTOCOL",
    "BatchError",
    "LossError",
    "OptimizerStepFailed",
    "OutOfMemory",
    "Plan",
    "RankFailed",
    "Run",
    "RunError",
    "__version__",
    "plan",
]
