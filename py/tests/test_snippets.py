"""docs/PYTHON.md's snippets and examples/python's commands run as written from a fresh
environment that has only the user's torch (and the frameworks they use) and the pip
install of headroom: no ./dev, no target/release, no repository on the path.

The environment is a fresh venv with the wheel (conftest's `wheel`) installed by pip,
seeing the torch of the test's interpreter and its transformers and lightning through a
.pth file, as a user's venv with those installed would. Each snippet runs in a folder of
its own, with `python`; each example's docstring commands run with that venv's `python`
from the repository root, with only the step count made small (`--steps 1`) and /tmp
paths moved into the test's folder."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

from conftest import ROOT

DOC = ROOT / "docs" / "PYTHON.md"
EXAMPLES = sorted((ROOT / "examples" / "python").glob("*.py"))


@pytest.fixture(scope="session")
def user_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv: the wheel installed by pip, torch and the frameworks reachable as a
    user's own installs (a .pth naming the site directories they are in)."""
    env_dir = tmp_path_factory.mktemp("user") / "env"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    import lightning
    import torch
    import transformers

    dirs = {str(Path(m.__file__).resolve().parents[1]) for m in (torch, transformers, lightning)}
    dirs.add(sysconfig.get_paths()["purelib"])
    (Path(site) / "user-packages.pth").write_text("\n".join(sorted(dirs)) + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)],
        check=True,
    )
    return env_dir


def user_env(venv_dir: Path, runtime_dir: Path) -> dict:
    """A user's shell: the venv's bin first; no PYTHONPATH (the staged package), no
    HEADROOM_BIN, no repository paths."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "HEADROOM_BIN", "VIRTUAL_ENV") and not k.startswith("PYO3")
    }
    env["PATH"] = f"{venv_dir / 'bin'}:/usr/bin:/bin"
    env["HEADROOM_RUNTIME_DIR"] = str(runtime_dir)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def doc_snippets() -> tuple[str, list[tuple[str, str, str]]]:
    """The setup block and every other `python` block: (id, how, code), `how` from the
    `<!-- snippet: ... -->` line above a block: "alone" (complete by itself), "fragment"
    (a part of a larger script, named by the comment), else it runs after the setup."""
    text = DOC.read_text()
    setup_at = text.index("## The snippets on this page")
    setup, blocks = None, []
    for m in re.finditer(r"(?:<!-- snippet: (\w+)[^>]*-->\n)?```python\n(.*?)```", text, re.S):
        if setup is None and m.start() > setup_at:
            setup = m.group(2)
            continue
        line = text[: m.start()].count("\n") + 1
        blocks.append((f"PYTHON.md:{line}", m.group(1) or "after-setup", m.group(2)))
    assert setup is not None, "docs/PYTHON.md lost its setup block"
    return setup, blocks


SETUP, SNIPPETS = doc_snippets()


@pytest.mark.parametrize("ident, how, code", SNIPPETS, ids=[s[0] for s in SNIPPETS])
def test_a_docs_snippet_runs_as_written_from_the_pip_install(
    user_venv, runtime_dir, tmp_path, ident, how, code
):
    if how == "fragment":
        pytest.skip(f"{ident} is a fragment of a larger script (its comment names which)")
    script = tmp_path / "snippet.py"
    script.write_text(code if how == "alone" else SETUP + "\n" + code)
    as_user(
        [user_venv / "bin" / "python", script.name],
        tmp_path,
        user_venv,
        runtime_dir,
        f"{ident}:\n{script.read_text()}",
    )


def as_user(argv: list, cwd: Path, venv_dir: Path, runtime_dir: Path, what: str) -> None:
    """Runs `argv` in the user's environment; it must succeed without a traceback."""
    p = subprocess.run(
        argv,
        cwd=cwd,
        env=user_env(venv_dir, runtime_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, f"{what}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    assert "Traceback" not in p.stderr, f"{what}\n{p.stderr[-4000:]}"


def example_commands(path: Path) -> list[list[str]]:
    """The commands a script's docstring gives (`python …`, continued lines joined)."""
    doc = path.read_text().split('"""')[1].replace("\\\\\n", " ")
    out = []
    for line in doc.splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("python "):
            out.append(shlex.split(line))
    return out


def test_the_examples_docstrings_name_no_developer_tool():
    """What a pip user does not have: ./dev, the full build's target/release/headroom."""
    for path in EXAMPLES:
        doc = path.read_text().split('"""')[1]
        assert "./dev" not in doc and "target/release" not in doc, path.name
        assert example_commands(path), f"{path.name} gives no command to run it"
    text = DOC.read_text()
    examples = text[text.index("## Examples") :]
    assert "./dev" not in examples and "target/release" not in examples


COMMANDS = [
    (f"{path.name}:{i}", argv) for path in EXAMPLES for i, argv in enumerate(example_commands(path))
]


@pytest.mark.parametrize("ident, argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_an_examples_command_runs_as_written_from_the_pip_install(
    user_venv, runtime_dir, tmp_path, ident, argv
):
    argv = list(argv)
    if "--steps" in argv:
        argv[argv.index("--steps") + 1] = "1"
    else:
        argv += ["--steps", "1"]
    argv = [a.replace("/tmp/", f"{tmp_path}/") for a in argv]
    argv[0] = str(user_venv / "bin" / "python")
    as_user(argv, ROOT, user_venv, runtime_dir, f"{ident}: {shlex.join(argv)}")


def test_the_venv_has_the_headroom_command_and_no_repository_on_its_path(user_venv, runtime_dir):
    env = user_env(user_venv, runtime_dir)
    probe = subprocess.run(
        [
            user_venv / "bin" / "python",
            "-c",
            "import headroom, sys; print(headroom.__file__); print(sys.path)",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(user_venv) in probe.stdout.splitlines()[0], probe.stdout
    assert str(ROOT / "target") not in probe.stdout
    ls = subprocess.run(
        [user_venv / "bin" / "headroom", "ls"], env=env, capture_output=True, text=True, timeout=30
    )
    assert ls.returncode == 0, ls.stderr
