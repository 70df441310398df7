"""The package's shape, read from its source with `ast`: its modules import one another
without a circle (a module that needs another's name imports it at the top, not inside a
function to dodge the circle), and the framework layers use a Run through its public
methods and properties only."""

from __future__ import annotations

import ast

from conftest import ROOT

PACKAGE = ROOT / "py" / "python" / "headroom"


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def _imported(tree: ast.Module, modules: set[str]) -> set[str]:
    """The package's modules `tree` imports anywhere (at the top or inside a function):
    ``from . import _x``, ``from ._x import y``, ``from headroom._x import y``,
    ``import headroom._x``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] != "headroom":
                continue
            parts = (node.module or "").split(".")
            # `from headroom._x` names the module after the package; `from ._x` right away.
            target = parts[1:] if node.level == 0 else parts
            if target and target[0]:
                found.add(target[0])
            else:
                # `from . import _x, _y` (or `from headroom import ...`): the names that
                # are modules; any other comes from __init__.
                for alias in node.names:
                    found.add(alias.name if alias.name in modules else "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "headroom":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return found & modules


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle in `graph` as the path that closes it (its first module last too), or
    None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := walk(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := walk(m)) is not None:
            return found
    return None


def test_no_import_circle_in_the_package():
    trees = _modules()
    graph = {m: _imported(t, set(trees)) - {m} for m, t in trees.items()}
    # The reading finds what is there (a test that reads nothing finds no circle).
    assert {"_args", "_dist", "_job", "_signals"} <= graph["_run"], graph
    cycle = _cycle(graph)
    assert cycle is None, "an import circle in headroom: " + " -> ".join(cycle)


def _holds_run(e: ast.expr, names: set[str], attrs: set[str]) -> bool:
    """Whether `e` is a Run, as far as a reading can tell: ``Run(...)``,
    ``x._make_run(...)``, a name or an attribute a Run was assigned to, or a conditional
    of them."""
    if isinstance(e, ast.Call):
        f = e.func
        return (isinstance(f, ast.Name) and f.id == "Run") or (
            isinstance(f, ast.Attribute) and f.attr == "_make_run"
        )
    if isinstance(e, ast.Name):
        return e.id in names
    if isinstance(e, ast.Attribute):
        return e.attr in attrs
    if isinstance(e, ast.IfExp):
        return _holds_run(e.body, names, attrs) or _holds_run(e.orelse, names, attrs)
    return False


def _private_reads_of_a_run(tree: ast.Module) -> tuple[list[str], set[str]]:
    """Each ``<a Run>._name`` in `tree` (as line: text), and the names and attributes
    found holding a Run (every assignment of one, followed until nothing changes)."""
    names: set[str] = set()
    attrs: set[str] = set()
    assigns: list[tuple[ast.expr, ast.expr | None, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            assigns += [(t, node.value, False) for t in node.targets]
        elif isinstance(node, ast.AnnAssign):
            # `self.headroom: Run | None = None` holds a Run by its annotation.
            typed = "Run" in {n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name)}
            assigns.append((node.target, node.value, typed))
    while True:
        before = len(names) + len(attrs)
        for target, value, typed in assigns:
            if typed or (value is not None and _holds_run(value, names, attrs)):
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute):
                    attrs.add(target.attr)
        if len(names) + len(attrs) == before:
            break
    reads = [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and _holds_run(node.value, names, attrs)
    ]
    return reads, names | {f".{a}" for a in attrs}


def test_the_framework_layers_read_no_private_attribute_of_a_run():
    """headroom.hf and headroom.lightning use the run's public calls and the few made for
    them (`Run.in_step`, `begin_evaluation`, `end_evaluation`, `evaluate_chunked`): a
    change inside the Run cannot break them unseen."""
    for module in ("hf", "lightning"):
        tree = ast.parse((PACKAGE / f"{module}.py").read_text())
        reads, holders = _private_reads_of_a_run(tree)
        # The reading finds the runs (a test that finds none finds no private read).
        assert {"run", ".run"} <= holders, (module, holders)
        assert not reads, f"headroom/{module}.py reads a Run's private attributes: {reads}"


def test_each_error_is_one_class_wherever_it_is_imported_from():
    """`headroom.X`, `headroom._errors.X` and where X was defined before `_errors`: one
    class, so an `except` of any of them catches what headroom raises."""
    import headroom
    from headroom import _batch, _dist, _errors, _run

    for where, names in (
        (_run, ("RunError", "OutOfMemory", "OptimizerStepFailed", "LossError")),
        (_dist, ("RankFailed",)),
        (_batch, ("BatchError",)),
    ):
        for name in names:
            assert getattr(where, name) is getattr(_errors, name) is getattr(headroom, name)


def test_the_run_never_asks_its_rank_which_it_is():
    """`headroom.Run` holds one rank (one process, a watched job rank, DDP, FSDP2) and
    calls what every rank has: no isinstance of a rank class, no reach into a rank's job
    or gates, outside the one factory that makes the rank (`_make_rank`)."""
    tree = ast.parse((PACKAGE / "_run.py").read_text())
    ranks = {"Rank", "SoloRank", "JobRank", "ReplicatedRank", "ShardedRank"}
    asked = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name == "_make_rank":
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & ranks:
                    asked.append(f"{fn.name}:{node.lineno} isinstance")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "_rank"
                and node.attr in ("job", "gates", "fsdp", "hold")
            ):
                asked.append(f"{fn.name}:{node.lineno} _rank.{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr in ("_job", "_solo_fsdp"):
                # The old shape: the run held the job and branched on it.
                asked.append(f"{fn.name}:{node.lineno} .{node.attr}")
    assert not asked, asked
