"""oslo.convert_state_dict: a rank's slices of a transformers state dict (the tensor_parallel README's helper),
checked against what a model loaded at that layout holds, and against the whole tensor they merge back to."""

from __future__ import annotations

import pytest
import torch
import transformers

import oslo
from oslo.parallel.dtensor import local_named_parameters
from oslo.parallel.plan import parameter_specs
from tests.distributed import run_distributed
from tests.helpers import save_reference, tiny_gpt2_config


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(n_layer=2), path)
    return str(path)


def _loaded_storages(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    return {name: tensor.detach().clone() for name, tensor in local_named_parameters(model)}


@pytest.mark.parametrize("tp", [2, 4])
def test_slices_are_what_a_model_at_that_layout_holds(gpt2, tp):
    reference = transformers.GPT2LMHeadModel.from_pretrained(gpt2)
    state = reference.state_dict()
    loaded = run_distributed(_loaded_storages, tp, gpt2)
    slices = [oslo.convert_state_dict(state, reference.config, tp, rank) for rank in range(tp)]
    for rank in range(tp):
        assert set(slices[rank]) == set(state)  # every key given (the tied lm_head.weight too)
        for name, tensor in loaded[rank].items():
            torch.testing.assert_close(slices[rank][name], tensor, rtol=0, atol=0, msg=name)
    # The slices merge back into the whole tensors.
    with torch.device("meta"):
        planned = oslo.GPT2LMHeadModel(reference.config, parallel_context=_planning(tp))
    for name, spec in parameter_specs(planned).items():
        if spec is not None:
            torch.testing.assert_close(spec.merge([s[name] for s in slices]), state[name], rtol=0, atol=0)


def _planning(tp):
    context = oslo.ParallelContext.planning()
    context.tensor_parallel_size = tp
    return context


def test_partial_state_dict_and_other_key_forms(gpt2):
    """One part of a checkpoint converts on its own; keys without the base-model prefix are understood."""
    reference = transformers.GPT2LMHeadModel.from_pretrained(gpt2)
    state = reference.state_dict()
    part = {"h.0.attn.c_attn.weight": state["transformer.h.0.attn.c_attn.weight"],
            "transformer.ln_f.weight": state["transformer.ln_f.weight"]}
    whole = oslo.convert_state_dict(state, reference, 2, 1)
    converted = oslo.convert_state_dict(part, reference, 2, 1)
    assert set(converted) == set(part)
    torch.testing.assert_close(converted["h.0.attn.c_attn.weight"], whole["transformer.h.0.attn.c_attn.weight"])
    assert converted["h.0.attn.c_attn.weight"].shape == (32, 48)  # this rank's heads of q, k and v


def test_bad_arguments_name_the_problem(gpt2):
    reference = transformers.GPT2LMHeadModel.from_pretrained(gpt2)
    state = reference.state_dict()
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        oslo.convert_state_dict(state, reference, 2, 2)
    with pytest.raises(ValueError, match="no parameters of GPT2LMHeadModel.*'encoder.weight'"):
        oslo.convert_state_dict({"encoder.weight": torch.zeros(2)}, reference, 2, 0)
    with pytest.raises(ValueError, match="expects"):
        oslo.convert_state_dict({"transformer.wte.weight": torch.zeros(7, 32)}, reference, 2, 0)
    with pytest.raises(ValueError, match="n_head"):
        oslo.convert_state_dict(state, reference, 3, 0)
    config = reference.config
    config.architectures = ["FalconForCausalLM"]
    with pytest.raises(ValueError, match="no parallel class 'FalconForCausalLM'.*GPT2LMHeadModel"):
        oslo.convert_state_dict(state, config, 2, 0)
