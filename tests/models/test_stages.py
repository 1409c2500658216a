"""Which part of the model each pipeline stage holds (oslo.models.stages), for every class of the zoo: the model is
built whole and each stage keeps its part, and the stages together hold the one-process model.

Building needs no process group, so every stage of a layout is built here in one process, as its rank
(``pipeline_parallel_rank``) on the meta device; the pipelined runs themselves are in test_zoo.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import oslo
from oslo.parallel import ties
from oslo.parallel.context import ParallelContext
from oslo.parallel.pipeline import StageLayers
from tests.models.zoo import all_cases


def _stage_context(pp: int, rank: int) -> ParallelContext:
    """The context of pipeline stage ``rank`` of ``pp`` for building only (no process group)."""
    context = ParallelContext.planning()
    context.pipeline_parallel_size, context.pipeline_parallel_rank = pp, rank
    return context


def _build(cls, config, pp: int, rank: int, device: str = "meta"):
    with torch.device(device):
        return cls(config, parallel_context=_stage_context(pp, rank))


def _names(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters(remove_duplicate=False)}


def _layers(model: nn.Module) -> list[int]:
    """The global indices of the layers a stage holds, over its StageLayers in order (T5: encoder, decoder)."""
    held, offset = [], 0
    for module in model.modules():
        if isinstance(module, StageLayers):
            held += [offset + int(index) for index in module._modules]
            offset += module.num_layers
    return held


PIPELINED = [case for case in all_cases() if getattr(oslo, case.name)._supports_pipeline_parallel]


@pytest.mark.parametrize("case", PIPELINED, ids=lambda case: case.key)
@pytest.mark.parametrize("pp", [2, 3])
def test_the_stages_hold_the_whole_model_once(case, pp):
    cls, config = getattr(oslo, case.name), case.config()
    whole = _build(cls, config, 1, 0)
    total = len(_layers(whole))
    if total < pp:
        pytest.skip(f"{total} layers")
    stages = [_build(cls, config, pp, rank) for rank in range(pp)]
    tied = {member for source, targets in ties.tie_families(whole).items() for member in (source, *targets)}

    # Each stage holds a run of consecutive layers, none empty, together every layer once, in order.
    held = [_layers(stage) for stage in stages]
    assert all(held) and sum(held, []) == list(range(total)), held
    assert all(stage.pipeline_stages == [range(h[0], h[-1] + 1) for h in held] for stage in stages)
    # Every parameter of the one-process model is on some stage, and only a tied weight on several.
    names = [_names(stage) for stage in stages]
    assert set().union(*names) == _names(whole)
    for name in _names(whole) - tied:
        assert sum(name in stage for stage in names) == 1, name
    # The embeddings are the first stage's; what is built last (the head, or the final norm) the last stage's.
    assert [stage.get_input_embeddings() is not None for stage in stages] == [True] + [False] * (pp - 1)
    last_built = [name for name, _ in whole.named_parameters()][-1]
    assert last_built in names[-1] and not any(last_built in stage for stage in names[:-1]), last_built
    # A stage's layers fill its KV cache from slot 0.
    for stage in stages:
        for module in stage.modules():
            if isinstance(module, StageLayers):
                for slot, layer in enumerate(module):
                    assert {m.cache_idx for m in layer.modules() if hasattr(m, "cache_idx")} <= {slot}


def test_a_direct_build_on_the_cpu_keeps_the_same_part():
    case = next(case for case in PIPELINED if case.name == "GPT2LMHeadModel")
    cls, config = oslo.GPT2LMHeadModel, case.config()
    for rank in range(2):
        on_cpu, on_meta = _build(cls, config, 2, rank, "cpu"), _build(cls, config, 2, rank)
        assert _names(on_cpu) == _names(on_meta)
        assert all(param.device.type == "cpu" for param in on_cpu.parameters())


def test_a_subclass_that_builds_more_is_pruned_whole():
    """A user's class that adds a module after ``super().__init__`` (whose ``post_init`` then ran inside its
    constructor): the stage is assigned once the outermost constructor returns, the new module counted with
    what follows the layers (the last stage)."""

    class WithExtra(oslo.GPT2LMHeadModel):
        def __init__(self, config, parallel_context=None):
            super().__init__(config, parallel_context)
            self.extra = nn.Linear(4, 4)

    config = next(case for case in PIPELINED if case.name == "GPT2LMHeadModel").config()
    first, last = _build(WithExtra, config, 2, 0), _build(WithExtra, config, 2, 1)
    assert first.extra is None and first.lm_head is None and first.transformer.wte is not None
    assert last.extra is not None and last.lm_head is not None and last.transformer.wte is None
    assert sorted(_layers(first) + _layers(last)) == list(range(config.n_layer))
