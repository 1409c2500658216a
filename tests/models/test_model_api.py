"""What transformers users read off a loaded model, for every class of the zoo in one process, against the
transformers class loaded from the same checkpoint: ``name_or_path``, ``num_parameters`` (with
``exclude_embeddings``: oslo's embedding layers are not ``nn.Embedding`` but are embeddings) and which module
``get_output_embeddings()`` is (PEFT's ``"all-linear"`` leaves it out)."""

from __future__ import annotations

import pytest
import torch
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


def test_transformers_loading_options(tmp_path):
    """transformers' ``from_pretrained`` loading options: those that hold for oslo's loading are taken as they are
    (``low_cpu_mem_usage``, ``use_safetensors=True``, ``device_map="cpu"``, ``weights_only=True``);
    ``output_loading_info=True`` returns transformers' info (a new head's weights missing, an LM head unused);
    those oslo cannot honor raise a ``ValueError`` naming the option."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=32, num_labels=3,
                                     pad_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        tmp_path, low_cpu_mem_usage=True, use_safetensors=True, device_map="cpu", weights_only=True)
    assert model.device.type == "cpu"
    for name in ("GPT2ForSequenceClassification", "GPT2Model"):
        _, expected = getattr(transformers, name).from_pretrained(tmp_path, output_loading_info=True)
        loaded, info = getattr(oslo, name).from_pretrained_with_parallel(tmp_path, output_loading_info=True)
        assert isinstance(loaded, getattr(oslo, name))
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            assert sorted(info[key]) == sorted(expected[key]), (name, key, info[key], expected[key])
    for option, value in (("use_safetensors", False), ("device_map", "auto"), ("device_map", {"transformer": 0}),
                          ("weights_only", False)):
        with pytest.raises(ValueError, match=option):
            oslo.GPT2LMHeadModel.from_pretrained_with_parallel(tmp_path, **{option: value})


@pytest.mark.parametrize("case", [case for case in zoo.all_cases() if case.anchor and case.arch != "gpt_neo"],
                         ids=lambda case: case.arch)  # (GPT-Neo's attention is eager in transformers)
def test_attentions_asked_of_sdpa(zoo_checkpoints, case):
    """``output_attentions=True`` under sdpa, which computes no attention weights: every attentions field is what
    transformers returns (an empty tuple), not a tuple of ``None``."""
    path = f"{zoo_checkpoints(case.arch)}/{case.key}"
    reference = getattr(transformers, case.name).from_pretrained(path).eval()
    model = getattr(oslo, case.name).from_pretrained_with_parallel(path).eval()
    assert model.config._attn_implementation == reference.config._attn_implementation == "sdpa"
    batch = case.batch()
    expected, actual = reference(**batch, output_attentions=True), model(**batch, output_attentions=True)
    fields = [key for key in expected if "attentions" in key]
    assert fields, f"{case.name}: transformers returned no attentions field"
    for key in fields:
        assert isinstance(actual[key], tuple) and len(actual[key]) == len(expected[key]), (key, actual[key])
    zoo.compare_outputs(actual, expected, case.name)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neo", "llama"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_submodules_are_transformers_modules(zoo_checkpoints, arch, fused):
    """A block's attention and MLP compute what transformers' do (the block adds the residual): forward hooks on
    them see transformers' values, an ablation hook zeroing one changes the logits as it does there, and a direct
    call ``block.mlp(x)`` returns transformers' MLP output; also after ``fuse()``."""
    case = next(case for case in zoo.all_cases() if case.arch == arch and case.anchor)
    path = f"{zoo_checkpoints(arch)}/{case.key}"
    reference = getattr(transformers, case.name).from_pretrained(path).eval()
    model = getattr(oslo, case.name).from_pretrained_with_parallel(path).eval()
    if fused:
        model.fuse()
    blocks = {"llama": lambda m: m.model.layers[0]}.get(arch, lambda m: m.transformer.h[0])
    attention = {"llama": "self_attn"}.get(arch, "attn")
    batch = {k: v for k, v in case.batch().items() if k in ("input_ids", "attention_mask")}
    seen = {}

    def record(key):
        def hook(module, args, output):
            seen[key] = output[0] if isinstance(output, tuple) else output
        return hook

    for tag, net in (("theirs", reference), ("ours", model)):
        block = blocks(net)
        handles = [getattr(block, attention).register_forward_hook(record((tag, "attn"))),
                   block.mlp.register_forward_hook(record((tag, "mlp")))]
        with torch.no_grad():
            seen[(tag, "logits")] = net(**batch).logits
        for handle in handles:
            handle.remove()
        handle = block.mlp.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
        with torch.no_grad():
            seen[(tag, "ablated")] = net(**batch).logits
        handle.remove()
    for key in ("attn", "mlp", "logits", "ablated"):
        torch.testing.assert_close(seen[("ours", key)], seen[("theirs", key)], msg=lambda m, k=key: f"{k}: {m}")
    x = torch.randn(2, 5, reference.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(blocks(model).mlp(x), blocks(reference).mlp(x))
