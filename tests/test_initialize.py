"""oslo.initialize(model, config), the tutorials' entry point, and save_parallelized / from_parallelized.

A transformers model becomes the oslo model of the same class: the same outputs and gradients at tensor and
pipeline parallelism, its dtype, mode and a copy of its config; the given model is consumed (meta device);
an optimizer built before the call trains the parallel model; bad configs and unsupported classes fail on
every rank before any process group is made."""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

import oslo
from tests.distributed import run_distributed
from tests.helpers import full_params, tiny_gpt2_config
from tests.models import cases_bert, cases_gpt2, cases_gpt_neo, cases_t5
from tests.models.zoo import compare_grads, compare_outputs

TIMEOUT = 120


def _layout(tp: int = 1, pp: int = 1) -> dict:
    return {"model_parallelism": {"enable": True, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}}


def _gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=4))


def _case(module, name: str):
    return next(case for case in module.CASES if case.name == name and not case.variant)


# ---------------------------------------------------------------------------------------------
# Parity with transformers
# ---------------------------------------------------------------------------------------------
def _gpt2_parity(rank, world_size, tp, pp):
    hf = _gpt2().eval()
    reference = copy.deepcopy(hf)
    given = list(hf.parameters())
    model = oslo.initialize(hf, _layout(tp, pp))
    assert type(model) is oslo.GPT2LMHeadModel and not model.training
    assert (model.parallel_context.tensor_parallel_size, model.parallel_context.pipeline_parallel_size) == (tp, pp)
    # The given model is consumed: the same parameter objects (ties kept), on the meta device.
    assert all(a is b for a, b in zip(hf.parameters(), given, strict=True))
    assert all(p.is_meta for p in hf.parameters()) and all(b.is_meta for b in hf.buffers())
    assert hf.lm_head.weight is hf.transformer.wte.weight

    batch = cases_gpt2._lm_batch()
    expected = reference(**batch)
    if pp == 1:
        actual = model(**batch)
        compare_outputs(actual, expected, "GPT2LMHeadModel")
        expected.loss.backward()
        actual.loss.backward()
        return compare_grads(model, reference, "GPT2LMHeadModel")
    with torch.no_grad():  # one pass: logits and loss on every stage
        actual = model(**batch)
    compare_outputs(actual, expected, "GPT2LMHeadModel")
    losses = []
    for micro_output in model(**batch):  # a training step: one output per micro-batch (micro_batch_size 1)
        losses.append(micro_output.loss.detach())
        micro_output.loss.backward()
    with torch.no_grad():
        expected_losses = [reference(**{k: v[i : i + 1] for k, v in batch.items()}).loss for i in range(4)]
    assert len(losses) == 4
    for ours, theirs in zip(losses, expected_losses, strict=True):
        torch.testing.assert_close(ours, theirs)
    reference(**batch).loss.backward()  # the step's gradients are the whole batch's
    return compare_grads(model, reference, "GPT2LMHeadModel")


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_gpt2_logits_loss_and_gradients_match_transformers(tp, pp):
    names = run_distributed(_gpt2_parity, tp * pp, tp, pp, timeout=TIMEOUT)
    assert set().union(*names) >= {name for name, _ in _gpt2().named_parameters()}  # every one (each stage its own)


def _other_architectures(rank, world_size):
    checked = []
    for module, name in ((cases_bert, "BertForMaskedLM"), (cases_t5, "T5ForConditionalGeneration"),
                         (cases_gpt_neo, "GPTNeoForCausalLM")):
        case = _case(module, name)
        torch.manual_seed(0)
        hf = getattr(transformers, name)(case.config()).eval()
        reference = copy.deepcopy(hf)
        model = oslo.initialize(hf, _layout(tp=world_size))
        assert type(model) is getattr(oslo, name)
        batch = case.batch()
        with torch.no_grad():
            compare_outputs(model(**batch), reference(**batch), name)
        checked.append(name)
    return checked


def test_bert_t5_and_gpt_neo_outputs_match_transformers_at_tp2():
    results = run_distributed(_other_architectures, 2, timeout=TIMEOUT)
    assert results == [["BertForMaskedLM", "T5ForConditionalGeneration", "GPTNeoForCausalLM"]] * 2


def _meta_model(rank, world_size):
    config = tiny_gpt2_config(n_layer=4)
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(config)
    model = oslo.initialize(hf, _layout(tp=world_size))
    assert model.training  # as the given model
    assert not any(p.is_meta for p in model.parameters())
    twin = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=world_size,
                                                         seed=model.parallel_context.seed)
    ours, theirs = full_params(model), full_params(twin)
    assert sorted(ours) == sorted(theirs)
    for name, value in ours.items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=0, msg=name)
    return True


def test_meta_device_model_is_initialized_from_the_seed():
    assert run_distributed(_meta_model, 2, timeout=TIMEOUT) == [True, True]


# ---------------------------------------------------------------------------------------------
# An optimizer created before initialize (the tutorials' order)
# ---------------------------------------------------------------------------------------------
def _optimizer_before_initialize(rank, world_size, tp, pp):
    hf = _gpt2().train()
    reference = copy.deepcopy(hf)
    # eps well above rounding noise: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift),
    # and Adam would turn its ~1e-10 noise into full-size steps of either sign.
    optimizer = torch.optim.Adam(hf.parameters(), lr=1e-2, eps=1e-4)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, eps=1e-4)
    model = oslo.initialize(hf, _layout(tp, pp))
    assert model.training
    batch = cases_gpt2._lm_batch()
    for _ in range(2):
        optimizer.zero_grad()
        if pp == 1:
            model(**batch).loss.backward()
        else:
            for micro_output in model(**batch):
                micro_output.loss.backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        reference(**batch).loss.backward()
        reference_optimizer.step()
    # The optimizer now holds this rank's oslo parameters (another stage's are dropped), each once.
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(held) == len({id(p) for p in held})
    assert {id(p) for p in held} == {id(p) for p in model.parameters()}
    assert all(p in optimizer.state for p in held)
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    ours = full_params(model)
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], msg=lambda m, n=name: f"{n} after two Adam steps: {m}")

    # The parallel model gone, the retired parameters have no replacement: a clear error, not a silent no-op.
    orphan = _gpt2(seed=1)
    stale = torch.optim.SGD(orphan.parameters(), lr=0.1)
    parallel = oslo.initialize(orphan, _layout(tp, pp))
    del parallel
    gc.collect()
    with pytest.raises(RuntimeError, match="Create the optimizer after oslo.initialize"):
        stale.step()
    return sorted(ours)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_optimizer_created_before_initialize_trains_the_parallel_model(tp, pp):
    names = run_distributed(_optimizer_before_initialize, tp * pp, tp, pp, timeout=TIMEOUT)
    assert set().union(*names) >= {name for name, _ in _gpt2().named_parameters()}


# ---------------------------------------------------------------------------------------------
# save_parallelized / from_parallelized
# ---------------------------------------------------------------------------------------------
def _round_trip(rank, world_size, config_path, root, bert_dir):
    model = oslo.initialize(_gpt2(seed=0).eval(), config_path)
    split, merged = f"{root}/split", f"{root}/merged"
    model.save_parallelized(split)
    model.save_parallelized(merged, merge_checkpoints=True)
    saved = full_params(model)
    for directory in (split, merged):
        other = oslo.initialize(_gpt2(seed=1), config_path)  # other weights
        params = list(other.parameters())
        assert other.from_parallelized(directory) is other
        assert all(a is b for a, b in zip(other.parameters(), params, strict=True))  # loaded in place
        loaded = full_params(other)
        assert sorted(loaded) == sorted(saved)
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), f"{name} differs after from_parallelized({directory!r})"
    with pytest.raises(ValueError, match="holds a 'bert' checkpoint"):
        other.from_parallelized(bert_dir)
    # A split checkpoint of another layout loads too (each rank reads its slices of the saved files).
    tp, pp = model.parallel_context.tensor_parallel_size, model.parallel_context.pipeline_parallel_size
    swapped = oslo.initialize(_gpt2(seed=1), _layout(tp=pp, pp=tp)).from_parallelized(split)
    loaded = full_params(swapped)
    reference = dict(_gpt2(seed=0).named_parameters(remove_duplicate=False))
    for name, value in loaded.items():
        assert torch.equal(value, reference[name].detach()), f"{name} differs after loading another layout's files"
    return True


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_save_parallelized_and_from_parallelized_round_trip(tmp_path, tp, pp):
    config_path = tmp_path / "oslo-config.json"
    config_path.write_text(json.dumps(_layout(tp, pp)))
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cases_bert.tiny_bert_config()).save_pretrained(tmp_path / "bert")
    assert run_distributed(_round_trip, tp * pp, str(config_path), str(tmp_path), str(tmp_path / "bert"),
                           timeout=TIMEOUT) == [True] * (tp * pp)
    # The merged checkpoint is a plain transformers one, with the given model's weights and outputs.
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    original = _gpt2(seed=0).eval()
    for name, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    batch = cases_gpt2._lm_batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, original(**batch).logits)


# ---------------------------------------------------------------------------------------------
# One process: the config, the mode and dtype, and refusals before any process group
# ---------------------------------------------------------------------------------------------
def test_single_process_keeps_dtype_mode_config_and_weights():
    hf = _gpt2().to(torch.bfloat16).train()
    hf.generation_config.max_new_tokens = 7
    hf.transformer.wpe.weight.requires_grad_(False)
    expected = {name: value.clone() for name, value in hf.state_dict().items()}
    config = hf.config
    model = oslo.initialize(hf, {"model_parallelism": {}})  # enable defaults to true, sizes to 1
    assert type(model) is oslo.GPT2LMHeadModel and model.training and model.dtype == torch.bfloat16
    assert model.config is not config and model.config.to_diff_dict() == config.to_diff_dict()
    assert model.generation_config.max_new_tokens == 7
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["transformer.wpe.weight"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert all(p.is_meta for p in hf.parameters())
    with pytest.raises(ValueError, match="already given to oslo.initialize"):
        oslo.initialize(hf, _layout())
    with pytest.raises(TypeError, match="parallel already"):
        oslo.initialize(model, _layout())


def test_weights_on_the_meta_device_are_initialized_from_the_seed(caplog):
    """A model partly on the meta device: its weights are copied, the meta ones initialized (and named)."""
    hf = _gpt2()
    hf.transformer.ln_f.weight = nn.Parameter(torch.empty(32, device="meta"))
    expected = {name: value.clone() for name, value in hf.state_dict().items() if not value.is_meta}
    with caplog.at_level("WARNING"):
        model = oslo.initialize(hf, _layout())
    assert "transformer.ln_f.weight" in caplog.text
    assert torch.equal(model.transformer.ln_f.weight, torch.ones(32))  # a LayerNorm weight starts at one
    for name, value in expected.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_enable_false_or_no_section_returns_the_model_itself(tmp_path):
    model = _gpt2()
    assert oslo.initialize(model, {"model_parallelism": {"enable": False, "tensor_parallel_size": 2}}) is model
    assert oslo.initialize(model, {}) is model
    path = tmp_path / "off.json"
    path.write_text('{"model_parallelism": {"enable": false, "tensor_parallel_size": 4}}')
    assert oslo.initialize(model, str(path)) is model
    assert not any(p.is_meta for p in model.parameters())


def test_config_errors_name_the_problem(tmp_path):
    model = _gpt2()
    with pytest.raises(ValueError, match=r"unknown key\(s\) in the config: data_parallelism\. The known keys are "
                                         r"\['model_parallelism'\]"):
        oslo.initialize(model, {**_layout(2), "data_parallelism": {"size": 2}})
    with pytest.raises(ValueError, match=r"model_parallelism\.tensor_paralel_size \(did you mean "
                                         r"'model_parallelism\.tensor_parallel_size'\?\)\. The known keys of "
                                         r"model_parallelism are \['enable', 'tensor_parallel_size', "
                                         r"'pipeline_parallel_size'\]"):
        oslo.initialize(model, {"model_parallelism": {"tensor_paralel_size": 2}})
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        oslo.initialize(model, str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_parallelism": {"tensor_parallel_size": 2,}}')
    with pytest.raises(ValueError, match="bad.json.*not valid json"):
        oslo.initialize(model, bad)
    unknown_in_file = tmp_path / "unknown.json"
    unknown_in_file.write_text('{"model_parallelism": {"tensor_parallel_size": 2, "sequence_parallel": true}}')
    with pytest.raises(ValueError, match="model_parallelism.sequence_parallel"):
        oslo.initialize(model, unknown_in_file)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        oslo.initialize(model, _layout(tp=0))
    with pytest.raises(TypeError, match="tensor_parallel_size must be a positive integer"):
        oslo.initialize(model, {"model_parallelism": {"tensor_parallel_size": "2"}})
    with pytest.raises(TypeError, match="enable must be true or false"):
        oslo.initialize(model, {"model_parallelism": {"enable": "yes"}})
    with pytest.raises(TypeError, match="config must be a dict or the path of a json file"):
        oslo.initialize(model, 2)
    # Checked before any process group: tp=3 in one process would otherwise fail for want of processes.
    with pytest.raises(ValueError, match="n_head=4"):
        oslo.initialize(model, _layout(tp=3))
    assert not dist.is_initialized()
    assert not any(p.is_meta for p in model.parameters())  # nothing consumed


def _unsupported():
    config = transformers.FalconConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    return transformers.FalconForCausalLM(config)


def test_unsupported_models_list_the_supported_classes():
    for model in (_unsupported(), nn.Linear(4, 4)):
        with pytest.raises(ValueError, match=r"supported classes are \[.*'GPT2LMHeadModel'.*'T5ForConditionalGen"):
            oslo.initialize(model, _layout(tp=2))  # tp=2 in one process: refused before any process group
    assert not dist.is_initialized()


def _bad_input_everywhere(rank, world_size):
    messages = []
    for model, config in ((_gpt2(), {"model_parallelism": {"tensor_parallel_size": 2, "pipline": 2}}),
                          (_unsupported(), _layout(tp=2))):
        try:
            oslo.initialize(model, config)
        except ValueError as exc:
            messages.append(str(exc))
    assert not dist.is_initialized()  # refused before any process group work
    return messages


def test_every_rank_refuses_bad_input():
    results = run_distributed(_bad_input_everywhere, 2, timeout=TIMEOUT)
    for messages in results:
        assert len(messages) == 2
        assert "model_parallelism.pipline" in messages[0]
        assert "FalconForCausalLM" in messages[1]
