"""USAGE.md stays true: every snippet runs, in order, with the launch it is documented with, and prints
what its comments say it prints.

A script (a snippet and the continuations after it) runs as ``torchrun --nproc_per_node=N script.py``
would run it: one process per rank, each with the launcher's environment and its own random state
(forked from this pre-imported process, then reseeded from the OS as a fresh interpreter is), the code
as ``__main__``. So a batch drawn from an unseeded generator differs between the ranks, as it does under
torchrun. ``test_a_snippet_under_real_torchrun`` checks the equivalence on one script with the real
launcher.

What a snippet prints is checked on rank 0; the other ranks must print nothing. A comment starting with
``# prints``, on a print call or on its own line right after one, claims what rank 0 prints there:
``print(x.shape)  # prints torch.Size([2, 16])`` passes when every time that call runs on rank 0 it prints
``torch.Size([2, 16])`` (and it runs at least once); ``...`` in a claim stands for any text (for values
that vary, like losses).
"""

from __future__ import annotations

import ast
import builtins
import io
import os
import random
import re
import signal
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed import RankError, run_distributed

USAGE = Path(__file__).resolve().parent.parent / "USAGE.md"
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CLAIM = "# prints "
SCRIPT_TIMEOUT = 120


@dataclass
class Script:
    """A snippet of USAGE.md with the continuations after it, as one script."""

    name: str  # the heading it is under, numbered when a heading has several scripts
    ranks: int | None  # None: plain python
    parts: list[tuple[int, str]]  # (USAGE.md line of the part's first line of code, code)

    @property
    def source(self) -> str:
        return "\n".join(code for _, code in self.parts)


def scripts(text: str | None = None) -> list[Script]:
    """The scripts of USAGE.md, in order; every ```python block must carry a launch line."""
    lines = (USAGE.read_text() if text is None else text).splitlines()
    found: list[Script] = []
    names: dict[str, int] = {}
    heading, in_fence, index = "(top)", False, 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("```"):
            if line == "```python":
                launch = lines[index - 1] if index else ""
                match = re.fullmatch(r"launch: (plain python|(\d+) ranks|continues the previous snippet)", launch)
                assert match, f"USAGE.md:{index + 1}: a python block without a launch line above it ({launch!r})"
                end = lines.index("```", index + 1)
                part = (index + 2, "\n".join(lines[index + 1:end]) + "\n")
                if match.group(1).startswith("continues"):
                    assert found, f"USAGE.md:{index}: continues no snippet"
                    found[-1].parts.append(part)
                else:
                    names[heading] = names.get(heading, 0) + 1
                    name = heading if names[heading] == 1 else f"{heading} #{names[heading]}"
                    found.append(Script(name, int(match.group(2)) if match.group(2) else None, [part]))
                index = end + 1
                continue
            in_fence = not in_fence
        elif not in_fence and re.match(r"#{1,4} ", line):
            heading = line.lstrip("#").strip()
        index += 1
    return found


def _reseed() -> None:
    """Give this forked process the random state of a fresh interpreter: each seeded from the OS."""
    random.seed()
    np.random.seed()
    torch.seed()


def _run_rank(rank: int, world_size: int, parts: list[tuple[int, str]], directory: str, plain: bool):
    """One rank of a script, as its own process under torchrun; returns [(USAGE.md line, text)] of its prints."""
    if plain:  # no launcher: oslo must not see RANK/WORLD_SIZE
        for name in LAUNCHER_VARIABLES:
            os.environ.pop(name)
    _reseed()
    os.chdir(directory)
    printed: list[tuple[int, str]] = []
    original = builtins.print

    def recording_print(*args, file=None, **kwargs):
        if file is not None and file is not sys.stdout:
            return original(*args, file=file, **kwargs)
        buffer = io.StringIO()
        original(*args, file=buffer, **kwargs)
        sys.stdout.write(buffer.getvalue())
        caller = sys._getframe(1)
        if caller.f_code.co_filename == str(USAGE):
            printed.append((caller.f_lineno, buffer.getvalue()))

    builtins.print = recording_print  # this process only: it ends with the script
    namespace = {"__name__": "__main__"}
    for line, code in parts:  # padded, so that tracebacks and prints carry USAGE.md's line numbers
        exec(compile("\n" * (line - 1) + code, str(USAGE), "exec"), namespace)
    return printed


def run_script(script: Script, directory: Path) -> list[list[tuple[int, str]]]:
    """Run ``script`` in ``directory`` with its launch; return each rank's prints."""
    return run_distributed(_run_rank, script.ranks or 1, script.parts, str(directory), script.ranks is None,
                           timeout=SCRIPT_TIMEOUT)


def _claim_pattern(claim: str) -> re.Pattern:
    return re.compile(".*?".join(re.escape(piece) for piece in claim.split("...")), re.S)


def claims(script: Script) -> dict[tuple[int, int], tuple[int, str]]:
    """{(first, last) USAGE.md line of a print call: (line of its comment, what it claims to print)}."""
    found = {}
    for line, code in script.parts:
        padded = "\n" * (line - 1) + code
        calls = [node for node in ast.walk(ast.parse(padded))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
        for token in tokenize.generate_tokens(io.StringIO(padded).readline):
            if token.type == tokenize.COMMENT and token.string.startswith(CLAIM):
                comment_line = token.start[0]
                after = 1 if token.line.lstrip().startswith("#") else 0  # a comment line right after the call
                call = [c for c in calls if c.lineno <= comment_line <= c.end_lineno + after]
                assert call, f"USAGE.md:{comment_line}: a '{CLAIM.strip()}' comment that is not on a print call"
                found[(call[0].lineno, call[0].end_lineno)] = (comment_line, token.string[len(CLAIM):].strip())
    return found


def check_prints(script: Script, printed: list[list[tuple[int, str]]]) -> list[str]:
    """What is wrong with a script's prints: any on ranks other than 0, and claims that rank 0 does not print."""
    problems = []
    for rank, prints in enumerate(printed[1:], start=1):
        for line, text in prints[:1]:
            problems.append(f"USAGE.md:{line} prints on rank {rank} too ({text.rstrip()!r}): print on rank 0 only")
    for (first, last), (comment_line, claim) in claims(script).items():
        texts = [text.rstrip("\n") for line, text in printed[0] if first <= line <= last]
        if not texts:
            problems.append(f"USAGE.md:{comment_line}: the print claiming {claim!r} printed nothing on rank 0")
        for text in texts:
            if not _claim_pattern(claim).fullmatch(text):
                problems.append(f"USAGE.md:{comment_line}: claims {claim!r}, rank 0 printed {text!r}")
    return problems


def _short(error: BaseException, lines: int = 12) -> str:
    text = str(error).splitlines()
    return "\n".join(text if len(text) <= 2 * lines else [*text[:lines], "...", *text[-lines:]])


def test_usage_snippets_run(tmp_path):
    text = USAGE.read_text()
    found = scripts(text)
    assert sum(len(script.parts) for script in found) == text.count("```python") >= 10
    failures = []
    for script in found:
        where = f"{script.name!r} (USAGE.md:{script.parts[0][0]}, {script.ranks or 'plain python'})"
        try:
            printed = run_script(script, tmp_path)
        except (RankError, TimeoutError) as error:
            failures.append(f"{where} failed: {_short(error)}")
            continue
        failures.extend(f"{where}: {problem}" for problem in check_prints(script, printed))
    if failures:
        pytest.fail(f"{len(failures)} problem(s):\n\n" + "\n\n".join(failures), pytrace=False)
    assert (tmp_path / "tiny-split" / "model_tp=1_pp=0.safetensors").exists()
    assert (tmp_path / "tiny-merged" / "model.safetensors.index.json").exists()
    assert (tmp_path / "tiny-pipelined" / "model.safetensors").exists()


def test_a_snippet_under_real_torchrun(tmp_path):
    """The forked launch above is torchrun's: the same script passes and prints the same under the real one."""
    found = {script.name: script for script in scripts()}
    run_script(found["A checkpoint to try things on"], tmp_path)
    script = found["Mixed precision"]
    (tmp_path / "script.py").write_text(script.source)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={script.ranks}",
               "script.py"]
    environment = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    # its own session, so that a timeout ends the launcher and its workers together
    launcher = subprocess.Popen(command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        stdout, stderr = launcher.communicate()
        pytest.fail(f"torchrun did not finish within {SCRIPT_TIMEOUT} s:\n{stderr[-4000:]}")
    assert launcher.returncode == 0, f"torchrun exited with {launcher.returncode}:\n{stderr[-4000:]}"
    forked = run_script(script, tmp_path)[0]
    # torchrun's output, cut into the prints of the forked run (same calls, same numbers of lines)
    lines = stdout.splitlines(keepends=True)
    assert len(lines) == sum(text.count("\n") for _, text in forked), (stdout, forked)
    printed, start = [], 0
    for line, text in forked:
        count = text.count("\n")
        printed.append((line, "".join(lines[start:start + count])))
        start += count
    assert check_prints(script, [printed]) == []
