"""The package's shape, read from its source with `ast`: its modules import one another
without a circle (a module that needs another's name imports it at the top, not inside a
function to dodge the circle)."""

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
