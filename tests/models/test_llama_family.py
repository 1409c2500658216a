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


def _count_rms_norm_calls(monkeypatch, on_cpu: bool) -> list[int]:
    """Counts ``F.rms_norm`` calls; with ``on_cpu`` the fused RMSNorm takes it on CPU tensors too (as on CUDA)."""
    from oslo.models import llama

    calls = [0]
    rms_norm = torch.nn.functional.rms_norm

    def counted(*args, **kwargs):
        calls[0] += 1
        return rms_norm(*args, **kwargs)

    monkeypatch.setattr(llama.F, "rms_norm", counted)
    if on_cpu:
        monkeypatch.setattr(llama, "_takes_fused_rms_norm", lambda hidden, weight: hidden.dtype == weight.dtype)
    return calls


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral"])
def test_fused_rms_norm_equals_transformers(tmp_path, monkeypatch, family):
    """After ``fuse()`` each RMSNorm runs torch's ``F.rms_norm`` where it is one kernel (CUDA; here on CPU in its
    place): outputs, loss and gradients are transformers' in float32, and in bfloat16 at bfloat16's tolerances.
    On CPU the fused model keeps transformers' expression."""
    name = f"{family}ForCausalLM"
    torch.manual_seed(0)
    reference = getattr(transformers, name)(tiny_config(getattr(transformers, f"{family}Config"))).eval()
    reference.save_pretrained(tmp_path)
    batch = lm_batch()
    model = getattr(oslo, name).from_pretrained_with_parallel(tmp_path).eval().fuse()
    norms = [m for m in model.modules() if isinstance(m, oslo.LlamaRMSNorm)]
    assert norms and all(m.fused for m in norms)

    calls = _count_rms_norm_calls(monkeypatch, on_cpu=False)
    zoo.compare_outputs(model(**batch), reference(**batch), name)
    assert calls[0] == 0, "fused RMSNorm took F.rms_norm on CPU"

    calls = _count_rms_norm_calls(monkeypatch, on_cpu=True)
    expected, actual = reference(**batch, output_hidden_states=True), model(**batch, output_hidden_states=True)
    assert calls[0] == len(norms)
    zoo.compare_outputs(actual, expected, name)
    expected.loss.backward()
    actual.loss.backward()
    zoo.compare_grads(model, reference, name)

    reference, model = reference.to(torch.bfloat16), model.to(torch.bfloat16)
    with torch.no_grad():
        expected, actual = reference(**batch), model(**batch)
    torch.testing.assert_close(actual.loss, expected.loss)
    torch.testing.assert_close(actual.logits, expected.logits)


def _fused_rms_norm_at_tp2(rank, world_size, path, sequence_parallel):
    monkeypatch = pytest.MonkeyPatch()
    calls = _count_rms_norm_calls(monkeypatch, on_cpu=True)
    case = CASES[0]
    reference = transformers.LlamaForCausalLM.from_pretrained(path)
    model = oslo.LlamaForCausalLM.from_pretrained_with_parallel(
        path, tensor_parallel_size=world_size, sequence_parallel=sequence_parallel).fuse()
    zoo.check_parity(case, path, world_size, 1, models=(reference, model))
    return calls[0] > 0


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_fused_rms_norm_at_tp2(tmp_path, sequence_parallel):
    """The fused RMSNorm at tensor_parallel_size 2 (a replicated key/value head), with and without sequence
    parallelism (each rank normalizes its rows; the weight's gradient summed over the ranks): transformers'
    outputs, loss and gradients."""
    case = CASES[0]
    torch.manual_seed(0)
    getattr(transformers, case.name)(case.config()).save_pretrained(tmp_path)
    assert run_distributed(_fused_rms_norm_at_tp2, 2, str(tmp_path), sequence_parallel, timeout=240) == [True, True]
