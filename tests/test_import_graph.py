"""oslo's imports point one way: ``tools/import_graph.py`` finds no cycle (lazy imports included) and no private
name taken from another module; on a package made for the purpose it finds both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "import_graph.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_no_import_cycle_and_no_private_import():
    done = _run()
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 cycles, 0 private imports" in done.stdout.splitlines()[-1], done.stdout


def test_it_finds_a_lazy_cycle_and_a_private_name_but_not_a_re_export(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "from oslo.b import value\n",
        "b.py": "value = 1\n\ndef later():\n    from oslo import a  # hides the cycle until called\n",
        "pkg/__init__.py": "from oslo.pkg.low import Thing\nfrom oslo.pkg.high import Other\n",
        "pkg/low.py": "_hidden = 2\n\nclass Thing:\n    pass\n",
        "pkg/high.py": "from typing import TYPE_CHECKING\n\nfrom oslo.pkg import Thing\n\n"
                       "if TYPE_CHECKING:\n    from oslo.c import C\n\nclass Other(Thing):\n    pass\n",
        "c.py": "from oslo.pkg.high import Thing\nfrom oslo.pkg.low import _hidden\n\nclass C:\n    pass\n",
    }
    for name, text in files.items():
        path = tmp_path / "oslo" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    done = _run(str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "cycle among 2 modules: oslo.a, oslo.b" in lines
    assert "lazy import: oslo.b -> oslo.a  (oslo/b.py:4)  <- closes a cycle" in lines
    assert "private name: oslo/c.py:2: from oslo.pkg.low import _hidden" in lines
    assert "typing-only import: oslo.pkg.high -> oslo.c  (oslo/pkg/high.py:6)" in lines
    # oslo.pkg.high takes Thing through the package, which imports oslo.pkg.high: no cycle, Thing is oslo.pkg.low's
    assert lines[-1] == "7 modules, 7 imports, 1 cycles, 1 private imports", done.stdout
