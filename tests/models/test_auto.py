"""oslo's Auto classes pick, for every checkpoint of the zoo, the class transformers' Auto class of the same name picks
(its own ``_model_mapping``), and build it with the class's arguments (a layout, ``config=``), equal to transformers'
model; what oslo does not have is named."""

from __future__ import annotations

import pytest
import torch
import transformers

import oslo
from oslo.models import auto
from tests.distributed import run_distributed
from tests.models import zoo

CASES = zoo.all_cases()


@pytest.mark.parametrize("name", auto.__all__)
def test_each_auto_class_picks_what_transformers_picks(name):
    ours, theirs = getattr(oslo, name), getattr(transformers, name)
    picked = 0
    for case in CASES:
        config = case.config()
        try:
            expected = theirs._model_mapping[type(config)]
        except KeyError:  # transformers has no class for this task: neither has oslo
            with pytest.raises(ValueError, match=rf"{name} has no oslo class for model_type '{config.model_type}'"):
                ours.class_for(config.model_type)
            continue
        if not hasattr(oslo, expected.__name__):
            continue
        assert ours.class_for(config.model_type) is getattr(oslo, expected.__name__), (name, case.key)
        picked += 1
    assert picked, f"{name} picked no class"


@pytest.mark.parametrize("case", [case for case in CASES if case.anchor], ids=lambda case: case.key)
def test_from_pretrained_and_from_config(zoo_checkpoints, case):
    path = f"{zoo_checkpoints(case.arch)}/{case.key}"
    task = next(name for name in auto.__all__ if name != "AutoModel"
                and getattr(transformers, name)._model_mapping.get(type(case.config()), None)
                is getattr(transformers, case.name))
    model = getattr(oslo, task).from_pretrained_with_parallel(path)
    assert type(model) is getattr(oslo, case.name)
    reference = getattr(transformers, case.name).from_pretrained(path)
    zoo.compare_outputs(model(**case.batch()), reference(**case.batch()), f"{task} {case.key}")
    config = transformers.AutoConfig.from_pretrained(path)
    assert type(oslo.AutoModel.from_config_with_parallel(config, seed=0)) is getattr(oslo, type(
        transformers.AutoModel.from_config(config)).__name__)
    assert type(getattr(oslo, task).from_pretrained_with_parallel(path, config=config)) is getattr(oslo, case.name)


def _tensor_parallel_logits(rank, world_size, path, batch):
    model = oslo.AutoModelForCausalLM.from_pretrained_with_parallel(path, tensor_parallel_size=2)
    return type(model).__name__, model(**batch).logits


def test_a_layout_passes_through(zoo_checkpoints):
    case = next(case for case in CASES if case.key == "LlamaForCausalLM")
    path = f"{zoo_checkpoints(case.arch)}/{case.key}"
    expected = transformers.AutoModelForCausalLM.from_pretrained(path)(**case.batch()).logits
    for name, logits in run_distributed(_tensor_parallel_logits, 2, path, case.batch()):
        assert name == "LlamaForCausalLM"
        torch.testing.assert_close(logits, expected)


def test_what_oslo_lacks_is_named(tmp_path):
    config = transformers.OPTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
                                    vocab_size=50, word_embed_proj_dim=16)
    transformers.OPTForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"AutoModelForCausalLM has no oslo class for model_type 'opt'; oslo's for "
                                         r"this task: 'bert': BertLMHeadModel, .*'llama': LlamaForCausalLM"):
        oslo.AutoModelForCausalLM.from_pretrained_with_parallel(tmp_path)
    with pytest.raises(OSError, match=r"AutoModel builds models through AutoModel.from_pretrained_with_parallel"):
        oslo.AutoModel()
    with pytest.raises(TypeError, match="config must be a transformers PretrainedConfig, got dict"):
        oslo.AutoModel.from_config_with_parallel({"model_type": "gpt2"})
