"""What the zoo's matrix (tests/models/cases_llama.py, cases_qwen2.py, cases_mistral.py) does not cover for the
Llama family: key/value heads replicated at tensor_parallel_size 2 (one key/value head), and transformers' order
of positional arguments. (A Qwen2 config mixing full and sliding-window layers is a case of the matrix.)"""

from __future__ import annotations

import pytest
import torch
import transformers

import oslo
from tests.distributed import run_distributed
from tests.models import zoo
from tests.models.cases_llama import lm_batch, tiny_config

CASES = [
    zoo.Case("llama", "LlamaForCausalLM", lambda: tiny_config(transformers.LlamaConfig, num_key_value_heads=1),
             lm_batch, generate=True, variant="one-kv-head"),
]


def _check(rank, world_size, root):
    for case in CASES:
        path = f"{root}/{case.key}"
        zoo.check_parity(case, path, world_size, 1)
        zoo.check_generate(case, path, world_size, 1, rank)
    return True


def test_a_replicated_key_value_head_at_tp2(tmp_path):
    for case in CASES:
        torch.manual_seed(0)
        getattr(transformers, case.name)(case.config()).save_pretrained(tmp_path / case.key)
    assert run_distributed(_check, 2, str(tmp_path), timeout=240) == [True, True]


@pytest.mark.parametrize("name, targets", [("LlamaForCausalLM", "labels"), ("Qwen2ForSequenceClassification", "labels"),
                                           ("MistralForTokenClassification", "labels"),
                                           ("LlamaForQuestionAnswering", "start_positions")])
def test_positional_arguments_in_transformers_order(tmp_path, name, targets):
    """``model(input_ids, attention_mask, position_ids, cache, inputs_embeds, <targets>)``: the order of
    transformers' Llama-family classes (not GPT2's, ``input_ids, past_key_values, attention_mask...``)."""
    family = {"Llama": transformers.LlamaConfig, "Qwen2": transformers.Qwen2Config,
              "Mistral": transformers.MistralConfig}[name.split("For")[0]]
    torch.manual_seed(0)
    reference = getattr(transformers, name)(tiny_config(family, num_labels=3)).eval()
    reference.save_pretrained(tmp_path)
    model = getattr(oslo, name).from_pretrained_with_parallel(tmp_path).eval()
    batch = lm_batch()
    target = {"labels": batch["labels"] if name.endswith("CausalLM") else
              torch.tensor([0, 2, 1, 2]) if "Sequence" in name else batch["labels"].clamp(max=2),
              "start_positions": torch.tensor([1, 4, 7, 0])}[targets]
    args = (batch["input_ids"], batch["attention_mask"], None, None, None, target)
    if targets == "start_positions":
        args += (torch.tensor([3, 9, 11, 2]),)  # end_positions
    expected, actual = reference(*args), model(*args)
    assert expected.loss is not None
    torch.testing.assert_close(actual.loss, expected.loss)
