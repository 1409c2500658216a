"""USAGE.md stays true: every snippet runs, in order, with the launch it is documented with."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.distributed import run_distributed

USAGE = Path(__file__).resolve().parent.parent / "USAGE.md"
_SNIPPET = re.compile(
    r"^launch: (plain python|(\d+) ranks|continues the previous snippet)\n```python\n(.*?)^```", re.M | re.S
)


def snippets() -> list[tuple[int | None, str]]:
    """(ranks or None for plain python, code) per script; continuations join the script before them."""
    found: list[tuple[int | None, str]] = []
    for match in _SNIPPET.finditer(USAGE.read_text()):
        if match.group(1).startswith("continues"):
            ranks, code = found.pop()
            found.append((ranks, code + "\n" + match.group(3)))
        else:
            found.append((int(match.group(2)) if match.group(2) else None, match.group(3)))
    return found


def _run_snippet(rank, world_size, code, directory, plain):
    if plain:  # no launcher: oslo must not see RANK/WORLD_SIZE
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name)
    os.chdir(directory)
    exec(compile(code, str(USAGE), "exec"), {"__name__": "__main__"})


def test_usage_snippets_run(tmp_path):
    found = snippets()
    # Every python block carries a launch line, so none escapes this test.
    assert len(_SNIPPET.findall(USAGE.read_text())) == USAGE.read_text().count("```python") >= 10
    for ranks, code in found:
        run_distributed(_run_snippet, ranks or 1, code, str(tmp_path), ranks is None, timeout=120)
    assert (tmp_path / "tiny-split" / "model_tp=1_pp=0.safetensors").exists()
    assert (tmp_path / "tiny-merged" / "model.safetensors.index.json").exists()
    assert (tmp_path / "tiny-pipelined" / "model.safetensors").exists()
