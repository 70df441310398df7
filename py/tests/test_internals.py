"""torch's private state behind one adapter (headroom._internals): the probe at a Run's
start finds what this torch has, a torch lacking what FSDP2's recovery needs is refused
there (naming its version and what works without it), never an AttributeError at the
first out-of-memory error; and what a full hard cap raises where memory is not named."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from headroom import _internals, _torch

HERE = Path(__file__).parent
PACKAGE = HERE.parent / "python" / "headroom"

# A one-rank process group and a small model sharded the way torchtitan shards one.
SHARDED = textwrap.dedent(
    """
    import os, socket, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, {here!r})
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from llama import LlamaConfig, build, shard
    model = shard(build(LlamaConfig()))
    """
)


def run_python(body: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(SHARDED.format(here=str(HERE)) + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )


def test_this_torch_has_every_capability_and_fsdp2_resets_through_the_way_it_offers(tmp_path):
    p = run_python(
        """
        from headroom import _internals
        found = _internals.probe(model)
        assert all(v is None for v in found.values()), found
        assert "FSDP2 after an out-of-memory error" in found
        public = callable(getattr(model, "reset_iter_state", None))
        print("public" if public else "private")
        """,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # torch 2.15 has the public recovery; 2.11 is reset through its private state.
    major_minor = tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert p.stdout.strip() == ("public" if major_minor >= (2, 15) else "private"), p.stdout


def test_a_torch_lacking_what_fsdp2_recovery_needs_is_refused_as_the_run_starts(tmp_path):
    """A torch with neither 2.15's reset_iter_state nor the private step state the reset
    puts back before it (as a release that renamed it would be): the Run refuses at its
    start, naming the torch version, the range headroom is tested with, and the way to
    watch instead; nothing is set up."""
    p = run_python(
        """
        import headroom
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard import _fsdp_common
        if hasattr(FSDPModule, "reset_iter_state"):
            del FSDPModule.reset_iter_state
        del _fsdp_common.TrainingState
        try:
            headroom.Run("probe", model=model, effective_batch=4)
        except headroom.RunError as e:
            print(e)
        else:
            raise SystemExit("not refused")
        """,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    said = p.stdout
    assert f"torch {torch.__version__.split('+')[0]}" in said, said
    assert "reset_iter_state" in said and "TrainingState" in said, said
    assert "2.11 to 2.15" in said and "run.report(loss)" in said, said


def test_a_ddp_model_with_a_communication_hook_is_refused_naming_it(tmp_path):
    """headroom all-reduces a step's gradients itself, under no_sync(): a hook the user
    registered on DDP (fp16 compression, PowerSGD) would never run, and the job would
    learn from other gradients than the user's plain DDP does. Refused at the start."""
    p = run_python(
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from headroom import _dist, RunError
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        _dist.refuse_unsupported(ddp, 2)  # no hook: accepted
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        try:
            _dist.refuse_unsupported(ddp, 2)
        except RunError as e:
            print(e)
        else:
            raise SystemExit("not refused")
        """,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "fp16_compress_hook" in p.stdout and "run.report(loss)" in p.stdout, p.stdout


def test_under_a_hard_cap_a_thread_that_cannot_start_is_an_out_of_memory_error():
    """pthread_create's EAGAIN (a thread's stack is memory RLIMIT_DATA counts), C++'s
    bad_alloc and oneDNN's failed primitive do not name memory: trusted only under the
    cap, where memory is what ran out."""
    for text in (
        "Resource temporarily unavailable",
        "std::bad_alloc",
        "could not create a primitive",
    ):
        assert _torch.is_oom(RuntimeError(text), capped=True), text
        assert not _torch.is_oom(RuntimeError(text), capped=False), text


def _private_uses(tree: ast.AST) -> list[str]:
    """Attribute reads of torch's private names: `torch.x._y`, `something._fsdp_...`."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            root = base.id if isinstance(base, ast.Name) else ""
            if root in ("torch", "dist") or node.attr in _TORCH_PRIVATE:
                found.append(f"{node.lineno}: .{node.attr}")
    return found


# Private names of torch's objects headroom has used (FSDP2's state, DDP's, autograd's,
# amp's, dynamo's): none may appear outside _internals.
_TORCH_PRIVATE = {
    "_get_fsdp_state",
    "_state_ctx",
    "_comm_ctx",
    "_fsdp_param_group",
    "_fsdp_param_groups",
    "_training_state",
    "_unsharded_param",
    "_all_gather_result",
    "_post_forward_indices",
    "_modules_to_run_forward",
    "_version",
    "_found_inf_per_device",
    "_orig_mod",
    "_dynamo",
    "_get_default_store",
    "_record_memory_history",
    "_dump_snapshot",
}


def test_only_the_adapter_touches_torchs_private_state():
    offenders = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "_internals.py":
            continue
        uses = _private_uses(ast.parse(path.read_text()))
        if uses:
            offenders[path.name] = uses
    assert not offenders, offenders
    assert _private_uses(ast.parse((PACKAGE / "_internals.py").read_text())), (
        "the check finds nothing"
    )


@pytest.mark.parametrize("name", ["unsharded_accumulated_grad"])
def test_a_read_only_property_is_not_written(name):
    class Param:
        @property
        def unsharded_accumulated_grad(self):
            return None

    class Plain:
        unsharded_accumulated_grad = None

    assert not _internals._settable(Param(), name)
    assert _internals._settable(Plain(), name)
