"""Checks of what a loop hands headroom: each error names the argument, what it got and
what it takes (docs/PYTHON.md, "Errors"). A wrong type is a TypeError, a value out of
range a ValueError, both raised before anything else happens (no previous run is
finished, no socket opened, no hard cap set). A loss that is not a scalar is a
LossError (a ValueError)."""

from __future__ import annotations

import operator
import os
from types import SimpleNamespace
from typing import Any

import torch

from ._errors import LossError, RunError


def _got(v: Any) -> str:
    """What was given, as an error says it: the value and, where it is not obvious, its
    type ("'64' (a str)")."""
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = type(v).__name__
    if isinstance(v, torch.nn.Module):
        return f"a {kind} (a torch.nn.Module)"
    if isinstance(v, torch.optim.Optimizer):
        return f"a {kind} (a torch.optim.Optimizer)"
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return f"{text} (a {kind})"


def whole(what: str, v: Any, least: int, example: int = 64) -> int:
    """A whole number ≥ `least` (an int, or anything with __index__, as numpy's)."""
    if isinstance(v, bool):
        n = None
    else:
        try:
            n = operator.index(v)
        except TypeError:
            n = None
    if n is None:
        raise TypeError(
            f"{what}: got {_got(v)}; give a whole number ≥ {least} as an int, e.g. "
            f"{what}={max(example, least)}"
        )
    if n < least:
        raise ValueError(f"{what}={n}: give a whole number ≥ {least}")
    return n


def optional_whole(what: str, v: Any, least: int, example: int = 64) -> int | None:
    return None if v is None else whole(what, v, least, example)


def flag(what: str, v: Any) -> bool:
    """True or False: a string such as "no" would otherwise read as true."""
    if not isinstance(v, bool):
        raise TypeError(f"{what}: got {_got(v)}; give True or False")
    return v


def number(what: str, v: Any, *, positive: bool = False) -> float:
    """A real number (an int, a float, a one-element tensor); never a string."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, (str, bytes, bool)) or not _real(v):
        raise TypeError(f"{what}: got {_got(v)}; give a number")
    x = float(v)
    if positive and not x > 0:
        raise ValueError(f"{what}={x:g}: give a number > 0")
    return x


def optional_number(what: str, v: Any) -> float | None:
    """A figure the loop may not know: None is sent as null, never as a made-up 0."""
    return None if v is None else number(what, v)


def _real(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def name(v: Any) -> str | None:
    """The run's name: a string. A model given first (`Run(model)`) is the usual slip."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, torch.nn.Module):
        raise TypeError(
            f"headroom.Run(name, ...): the first argument is the run's name and got "
            f'{_got(v)}; give the model by keyword: headroom.Run("my-run", model=model)'
        )
    raise TypeError(f'name: got {_got(v)}; give the run\'s name as a str, e.g. "gpt"')


def model(v: Any) -> None:
    if v is not None and not isinstance(v, torch.nn.Module):
        raise TypeError(f"model: got {_got(v)}; give the torch.nn.Module you train (or None)")


def device(v: Any) -> Any:
    """What torch.device takes; torch's own error (its list of every device type) is
    replaced by what headroom measures."""
    if v is None or isinstance(v, torch.device):
        return v
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        raise TypeError(f'device: got {_got(v)}; give "cpu", "cuda", "cuda:N" or a torch.device')
    try:
        return torch.device(v)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(
            f'device={v!r} is not a device torch knows; give "cpu", "cuda", "cuda:N" '
            "or a torch.device"
        ) from None


def memory_budget(v: Any) -> str | None:
    """A size ("2GiB", "1.5GB"), bytes as an int, or "auto"; as the string Rust parses."""
    if v is None or v == "":
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        pass
    elif isinstance(v, int):
        if v < 1:
            raise ValueError(f'memory_budget={v}: give a size > 0, e.g. memory_budget="2GiB"')
        return str(v)
    raise TypeError(
        f'memory_budget: got {_got(v)}; give a size as a string ("2GiB", "512MiB"), bytes '
        'as an int, or "auto" (CPU)'
    )


THRESHOLDS_FORMAT = (
    "four ascending fractions of the limit (target, warning, critical, emergency), as a "
    'string "0.9,0.92,0.95,0.97" or a tuple (0.9, 0.92, 0.95, 0.97)'
)


def thresholds(v: Any) -> str | None:
    """The string Rust parses, from a string or four numbers (what run.thresholds gives)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, (tuple, list)) and len(v) == 4:
        try:
            return ",".join(repr(number("thresholds", x)) for x in v)
        except TypeError:
            pass
    raise TypeError(f"thresholds: got {_got(v)}; give {THRESHOLDS_FORMAT}")


def profile(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise TypeError(
        f'profile: got {_got(v)}; give "aggressive", "balanced" or "conservative" as a str'
    )


def path(what: str, v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, (str, os.PathLike)):
        return os.fspath(v)
    raise TypeError(f"{what}: got {_got(v)}; give a file path (a str or a pathlib.Path)")


def log_rotate(v: Any, log: str | None) -> str | None:
    """When the log closes and a fresh one starts (its form is checked by the run)."""
    if v is None:
        return None
    if not isinstance(v, str):
        raise TypeError(f'log_rotate: got {_got(v)}; give a size ("256MiB") or an age ("1d")')
    if log is None:
        raise ValueError(
            f"log_rotate={v!r} rotates the run's log, and the run has none: give log= too "
            '(e.g. log="run.jsonl.zst")'
        )
    return v


def listen(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)):
        return str(v)
    raise TypeError(f'listen: got {_got(v)}; give a port (8123) or "HOST:PORT"')


def callback(what: str, v: Any, takes: str) -> None:
    if v is not None and not callable(v):
        raise TypeError(f"{what}: got {_got(v)}; give {takes}")


def optimizer(v: Any) -> None:
    """What run.step() steps: anything with param_groups and step() (a torch.optim
    optimizer, or a framework's wrapper of one)."""
    if hasattr(v, "param_groups") and callable(getattr(v, "step", None)):
        return
    hint = ""
    if isinstance(v, torch.nn.Module):
        hint = " (the model, not its optimizer)"
    raise TypeError(
        f"run.step(optimizer): got {_got(v)}{hint}; give the optimizer that updates the "
        "model, e.g. opt = torch.optim.AdamW(model.parameters()); run.step(opt)"
    )


# What SIGUSR1/SIGUSR2 may mean (`on_usr1=`, `on_usr2=`; the binary's `run.on_usr1`).
USER_SIGNAL_ACTIONS = ("stop", "checkpoint")


def user_signal_action(what: str, v: Any, on_checkpoint: Any) -> None:
    if v not in USER_SIGNAL_ACTIONS:
        raise ValueError(
            f'{what}={v!r} is not an action; use "stop" (checkpoint and stop, the '
            'default) or "checkpoint" (checkpoint at the step\'s end and go on)'
        )
    if v == "checkpoint" and on_checkpoint is None:
        raise ValueError(
            f'{what}="checkpoint" needs on_checkpoint=fn (fn(step) saving and '
            "returning the path): without it the signal would save nothing"
        )


def run_arguments(given: dict[str, Any]) -> SimpleNamespace:
    """headroom.Run's arguments, by name, each checked (the first mistake in this order is
    the one raised) and normalised."""
    a = SimpleNamespace(**given)
    a.name = name(a.name)
    model(a.model)
    a.device = device(a.device)
    a.total_steps = whole("total_steps", a.total_steps, 0, 1000)
    a.effective_batch = optional_whole("effective_batch", a.effective_batch, 1)
    a.micro_batch = optional_whole("micro_batch", a.micro_batch, 1, 8)
    a.min_micro_batch = whole("min_micro_batch", a.min_micro_batch, 0, 1)
    a.max_micro_batch = optional_whole("max_micro_batch", a.max_micro_batch, 1)
    a.max_seq_len = optional_whole("max_seq_len", a.max_seq_len, 0, 1024)
    for what in ("adaptive", "hard_limit", "job_view", "finish_previous", "oom_snapshot"):
        flag(what, getattr(a, what))
    a.memory_budget = memory_budget(a.memory_budget)
    a.thresholds = thresholds(a.thresholds)
    a.profile = profile(a.profile)
    a.log = path("log", a.log)
    a.log_rotate = log_rotate(a.log_rotate, a.log)
    a.listen = listen(a.listen)
    callback(
        "on_checkpoint", a.on_checkpoint, "a function fn(step) that saves and returns the path"
    )
    a.sample_hz = number("sample_hz", a.sample_hz, positive=True)
    a.sharded_accumulation = sharded_accumulation(a.sharded_accumulation)
    for what in ("on_usr1", "on_usr2"):
        user_signal_action(what, getattr(a, what), a.on_checkpoint)
    a.precision = precision(a.precision)
    a.half_precision = half_precision(a.half_precision, a.precision)
    a.checkpoint_blocks = blocks(a.checkpoint_blocks)
    callback(
        "checkpointing",
        a.checkpointing,
        "a function fn(on) switching the model's activation checkpointing on or off",
    )
    levers = (a.precision, a.checkpoint_blocks, a.checkpointing)
    if a.effective_batch is None and any(x is not None for x in levers):
        raise RunError(
            "precision=, checkpoint_blocks= and checkpointing= are levers the run switches "
            "in its run.backward: they need an adaptive run (effective_batch=N)"
        )
    if a.checkpoint_blocks is not None and a.checkpointing is not None:
        raise ValueError(
            "checkpoint_blocks= and checkpointing= both name how to checkpoint: give one "
            "(the modules to wrap, or a function that switches the model's own)"
        )
    return a


def sharded_accumulation(v: Any) -> str:
    """How an FSDP2 run accumulates between micro-batches (see _fsdp.HOLD_SHARE)."""
    if not isinstance(v, str) or v.strip().lower() not in ("auto", "hold", "reduce"):
        raise ValueError(
            f'sharded_accumulation={v!r}: give "hold" (each rank keeps its units\' unsharded '
            'gradients until the last micro-batch: one reduce-scatter per step), "reduce" (a '
            'reduce-scatter after every micro-batch: sharded gradients only) or "auto" (hold '
            "while they take at most a tenth of the memory limit)"
        )
    return v.strip().lower()


def precision(v: Any) -> str | None:
    """The precision a run's forward starts at, when the run switches it."""
    if v is None:
        return None
    if not isinstance(v, str) or v.strip().lower() not in ("fp32", "bf16", "fp16"):
        raise ValueError(
            f'precision={v!r}: give "fp32", "bf16" or "fp16", the precision the run\'s '
            "forward starts at (the dashboard's m switches it; None leaves it to the script)"
        )
    return v.strip().lower()


def half_precision(v: Any, start: str | None) -> str | None:
    """The half precision the precision lever switches to from fp32: bf16 unless the run
    starts at fp16 or the script says fp16 (a device without bf16)."""
    if v is None:
        return None if start is None else "fp16" if start == "fp16" else "bf16"
    if not isinstance(v, str) or v.strip().lower() not in ("bf16", "fp16"):
        raise ValueError(
            f'half_precision={v!r}: give "bf16" or "fp16", what the dashboard\'s m switches '
            "the forward to from fp32 (fp16 with a GradScaler the run keeps)"
        )
    v = v.strip().lower()
    if start is None:
        raise ValueError(
            f'half_precision="{v}" names where the precision lever goes: give the lever '
            'too, precision="fp32" (the precision the forward starts at)'
        )
    if start != "fp32" and start != v:
        raise ValueError(
            f'precision="{start}" with half_precision="{v}": a run switches between fp32 '
            "and one half precision; start at fp32 or at the half precision you name"
        )
    return v


def framework_half(where: str, run_kwargs: dict[str, Any], own: str) -> None:
    """A framework steps its own optimizer, so a GradScaler of the run's would scale
    gradients nothing unscales: fp16 as the lever's half precision is refused there."""
    if str(run_kwargs.get("half_precision") or "").strip().lower() == "fp16":
        raise ValueError(
            f'{where}(half_precision="fp16"): fp16 needs the run\'s GradScaler at the '
            f"optimizer step, which {own}; the precision lever switches to bf16 here (or "
            "train in fp16 from the start with the framework's own mixed precision)"
        )


def blocks(v: Any) -> list | None:
    """The modules a run checkpoints on demand."""
    if v is None:
        return None
    if isinstance(v, torch.nn.Module) and not isinstance(
        v, (torch.nn.ModuleList, torch.nn.Sequential)
    ):
        v = [v]
    try:
        found = list(v)
    except TypeError:
        found = None
    if not found or not all(isinstance(b, torch.nn.Module) for b in found):
        raise TypeError(
            f"checkpoint_blocks={type(v).__name__}: give the modules whose activations may be "
            "recomputed in backward, e.g. checkpoint_blocks=model.blocks"
        )
    return found


def loss_value(x: Any, what: str) -> float:
    """A loss as a float: a number or a one-element tensor. A string is refused even
    when it reads as a number ("nan", "0.5"): a loop that hands one is mistaken."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise LossError(
                f"{what} is a tensor of shape {tuple(x.shape)}; give a scalar (e.g. the "
                "loss's .mean())"
            )
        # .item() reads a tensor that requires grad as it is; a detach() first would
        # make a tensor for nothing (a report's every step).
        return float(x.item())
    if not isinstance(x, (str, bytes, bool)):
        try:
            return float(x)
        except (TypeError, ValueError):
            pass
    raise LossError(
        f"{what} is {_got(x)}; give a number (a float) or a one-element tensor"
    ) from None


def micro_batch_loss(loss: Any, step: int, start: int, end: int) -> None:
    """What loss_fn returned for samples [start, end): a scalar tensor with its graph."""
    if not isinstance(loss, torch.Tensor):
        raise LossError(
            f"step {step}: loss_fn returned {type(loss).__name__} for samples [{start}, {end}); "
            "return the micro-batch's loss as a scalar tensor (with its graph, not .item())"
        )
    if loss.numel() != 1:
        raise LossError(
            f"step {step}: loss_fn returned a tensor of shape {tuple(loss.shape)} for samples "
            f"[{start}, {end}); return a scalar (e.g. reduce it with .mean())"
        )
    if not loss.requires_grad:
        raise LossError(
            f"step {step}: the loss of samples [{start}, {end}) does not require grad (was it "
            "computed under torch.no_grad(), or detached?); return the loss with its graph"
        )
