"""`import headroom` is cheap and complete: it imports neither transformers nor lightning
(nor torch), `headroom.hf` and `headroom.lightning` load on first use, as the README's one
line for Hugging Face has it, and `dir(headroom)` lists what the package offers. Each in
a fresh interpreter: this one has long imported everything."""

from __future__ import annotations

import json
import subprocess
import sys


def _python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_import_headroom_imports_no_framework_and_loads_each_on_first_use():
    out = _python(
        "import json, sys, headroom\n"
        "before = sorted(m for m in ('torch', 'transformers', 'lightning', "
        "'pytorch_lightning') if m in sys.modules)\n"
        "hf = headroom.hf\n"
        "after_hf = 'transformers' in sys.modules\n"
        "pl = headroom.lightning\n"
        "print(json.dumps({'before': before, 'after_hf': after_hf, "
        "'lightning': 'lightning' in sys.modules or 'pytorch_lightning' in sys.modules, "
        "'adapt': callable(hf.adapt), 'module': hf.__name__, 'pl': pl.__name__, "
        "'Adaptive': hasattr(pl, 'Adaptive')}))\n"
    )
    got = json.loads(out.strip().splitlines()[-1])
    assert got["before"] == [], got
    assert got["after_hf"] and got["lightning"], got
    assert got["module"] == "headroom.hf" and got["pl"] == "headroom.lightning"
    assert got["adapt"] and got["Adaptive"]


def test_dir_headroom_lists_run_and_the_framework_layers():
    out = _python("import headroom, json, sys; print(json.dumps(dir(headroom)))")
    names = json.loads(out.strip().splitlines()[-1])
    for name in ("Run", "RunError", "LossError", "plan", "Plan", "hf", "lightning"):
        assert name in names, names
    out = _python(
        "import headroom, sys\n"
        "try:\n"
        "    headroom.nonesuch\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    assert "no attribute 'nonesuch'" in out
