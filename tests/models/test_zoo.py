"""Every class of the zoo against transformers, at every layout of the matrix (see tests/models/zoo.py)."""

from __future__ import annotations

import pytest
import transformers

from tests.distributed import run_distributed
from tests.models import zoo


@pytest.mark.parametrize("arch, tp, pp", zoo.layouts(), ids=lambda v: str(v))
def test_zoo(zoo_checkpoints, tmp_path, arch, tp, pp):
    root = zoo_checkpoints(arch)
    results = run_distributed(zoo.run_layout, tp * pp, arch, tp, pp, root, str(tmp_path), timeout=240)
    expected = {case.key for case in zoo.cases_of(arch) if case.runs_at(tp, pp)}
    assert set(results[0]["checked"]) == expected
    assert all(result["checked"] == results[0]["checked"] for result in results)
    if pp == 1:
        return
    # Under pipelines every parameter is on exactly one stage (a tied weight's copies on several, each under
    # one of its names).
    for case in zoo.cases_of(arch):
        stages = [set(results[stage * tp]["held"].get(case.key, ())) for stage in range(pp)]
        if not any(stages):  # a case the pipeline does not train
            continue
        for group in zoo.weight_names(getattr(transformers, case.name).from_pretrained(f"{root}/{case.key}")):
            holders = [stage for stage, held in enumerate(stages) if group & held]
            assert holders, f"{case.key}: {sorted(group)} on no stage"
            assert len(group) > 1 or len(holders) == 1, f"{case.key}: {sorted(group)} on stages {holders}"


@pytest.mark.parametrize("arch", sorted({case.arch for case in zoo.all_cases()}))
def test_two_all_reduces_per_block_each_way(arch):
    results = run_distributed(zoo.count_block_all_reduces, 2, arch)
    assert results == [(2, 2), (2, 2)], results


@pytest.mark.parametrize("case, tp, pp, dp, micro_batch_size, wrap", zoo.training_layouts(),
                         ids=lambda v: v.key if isinstance(v, zoo.Case) else str(v))
def test_training_equals_one_process(zoo_checkpoints, case, tp, pp, dp, micro_batch_size, wrap):
    """The manual's loop at (tp, pp, dp), unchanged (the model or its DDP wrapper called on the replica's rows,
    each micro-batch's loss backpropagated), gets after one SGD step the weights transformers gets from one step
    on the whole batch, and each rank's losses are its own (micro-)batches'."""
    path = f"{zoo_checkpoints(case.arch)}/{case.key}"
    results = run_distributed(zoo.run_training, tp * pp * dp, case.key, path, tp, pp, micro_batch_size, wrap)
    zoo.check_training(case, path, pp, results)
