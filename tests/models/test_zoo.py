"""Every class of the zoo against transformers, at every layout of the matrix (see tests/models/zoo.py)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.models import zoo


@pytest.mark.parametrize("arch, tp, pp", zoo.layouts(), ids=lambda v: str(v))
def test_zoo(zoo_checkpoints, tmp_path, arch, tp, pp):
    results = run_distributed(zoo.run_layout, tp * pp, arch, tp, pp, zoo_checkpoints(arch), str(tmp_path), timeout=240)
    expected = {case.key for case in zoo.cases_of(arch) if case.runs_at(tp, pp)}
    assert set(results[0]) == expected
    assert all(result == results[0] for result in results)


@pytest.mark.parametrize("arch", sorted({case.arch for case in zoo.all_cases()}))
def test_two_all_reduces_per_block_each_way(arch):
    results = run_distributed(zoo.count_block_all_reduces, 2, arch)
    assert results == [(2, 2), (2, 2)], results


@pytest.mark.parametrize("arch", [a for a in sorted({c.arch for c in zoo.all_cases()}) if a != "gpt2"])
@pytest.mark.parametrize("tp, pp, wrap", [(1, 2, False), (2, 1, True)], ids=["tp1-pp2-dp2", "tp2-pp1-dp2-ddp"])
def test_training_equals_one_process(zoo_checkpoints, arch, tp, pp, wrap):
    """The anchor class trained by the manual's loop at (tp, pp, dp=2) gets, after one SGD step, the weights
    transformers gets from one step on the whole batch (GPT2's every head and more layouts:
    tests/models/test_gpt2_training.py)."""
    case = next(c for c in zoo.cases_of(arch) if c.anchor)
    path = f"{zoo_checkpoints(arch)}/{case.key}"
    results = run_distributed(zoo.run_training, tp * pp * 2, arch, case.name, path, tp, pp, wrap)
    expected = zoo.reference_training_step(case, path)
    for params in results:
        assert set(params) <= set(expected), sorted(set(params) - set(expected))
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name], msg=lambda m, n=name: f"{case.name} {n}: {m}")
