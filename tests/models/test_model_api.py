"""What transformers users read off a loaded model, for every class of the zoo in one process, against the
transformers class loaded from the same checkpoint: ``name_or_path``, ``num_parameters`` (with
``exclude_embeddings``: oslo's embedding layers are not ``nn.Embedding`` but are embeddings) and which module
``get_output_embeddings()`` is (PEFT's ``"all-linear"`` leaves it out)."""

from __future__ import annotations

import pytest
import transformers

import oslo
from tests.models import zoo


@pytest.mark.parametrize("case", zoo.all_cases(), ids=lambda case: case.key)
def test_what_a_loaded_model_reports(zoo_checkpoints, case):
    path = f"{zoo_checkpoints(case.arch)}/{case.key}"
    reference = getattr(transformers, case.name).from_pretrained(path)
    model = getattr(oslo, case.name).from_pretrained_with_parallel(path)
    assert model.name_or_path == model.config.name_or_path == reference.name_or_path == path
    for options in ({}, {"exclude_embeddings": True}, {"only_trainable": True, "exclude_embeddings": True}):
        assert model.num_parameters(**options) == reference.num_parameters(**options), options
    theirs = reference.get_output_embeddings()
    ours = model.get_output_embeddings()
    if theirs is None:
        assert ours is None
    else:
        names = {module: name for name, module in model.named_modules()}
        assert names[ours] == next(name for name, module in reference.named_modules() if module is theirs)
