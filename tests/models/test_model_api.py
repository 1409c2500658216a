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


def test_resizing_a_built_model_names_the_build_option():
    """``resize_token_embeddings()`` on a built model is refused naming the option that builds the model at the new
    size; in one process its message does not speak of ranks."""
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=1001, n_positions=32)
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config)
    with pytest.raises(NotImplementedError, match=r"resize_token_embeddings=1010 to from_pretrained_with_parallel") \
            as refused:
        model.resize_token_embeddings(1010)
    assert "rank" not in str(refused.value)
