"""The KV cache under both of its transformers names: ``cache`` (transformers >= 5.24, what generate()
passes) and ``past_key_values`` (before 5.24, and code written for it), against transformers' model."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache

import oslo
from oslo.models.compat import CACHE_FIELD
from tests.helpers import save_reference, tiny_gpt2_config


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cache-names"))
    reference = save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return reference, oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path).eval()


def _decode(model, name: str | None, prompt: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """Greedy decoding one token at a time, the cache passed as ``name`` (``None``: positionally)."""
    logits, cache, ids = [], None, prompt
    with torch.no_grad():
        for step in range(steps):
            new = ids if step == 0 else ids[:, -1:]
            output = model(new, cache) if name is None else model(new, **{name: cache})
            cache = output[CACHE_FIELD]
            logits.append(output.logits[:, -1])
            ids = torch.cat([ids, output.logits[:, -1:].argmax(-1)], dim=1)
    assert cache.get_seq_length() == prompt.shape[1] + steps - 1
    return logits


@pytest.mark.parametrize("name", ["cache", "past_key_values", None])
def test_either_name_uses_the_cache(models, name):
    reference, model = models
    prompt = torch.tensor([[5, 17, 900, 3, 44]])
    expected = _decode(reference, CACHE_FIELD, prompt)
    for ours, theirs in zip(_decode(model, name, prompt), expected, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_both_names_at_once_use_cache_as_transformers_does(models):
    """Both names as keywords: ``cache`` is used and ``past_key_values`` ignored with a ``FutureWarning``, as
    transformers' models do (``generate()`` passes ``cache=`` while PEFT's prefix tuning adds
    ``past_key_values=``); a positional cache and ``past_key_values=`` is an argument given twice."""
    reference, model = models
    ids = torch.tensor([[5, 17, 900]])
    with torch.no_grad():
        filled = model(ids[:, :2])[CACHE_FIELD]  # two positions that would shift the next call if it read them
        for call in (model, model.transformer):
            with pytest.warns(FutureWarning, match="ignoring `past_key_values`"):
                output = call(ids, cache=DynamicCache(), past_key_values=filled)
            assert output[CACHE_FIELD].get_seq_length() == 3  # the empty cache was used, the filled one ignored
        with pytest.warns(FutureWarning):
            ours = model(ids, cache=None, past_key_values=filled).logits
        torch.testing.assert_close(ours, reference(ids).logits)
    with pytest.raises(TypeError, match="multiple values for argument 'cache'"):
        model(ids, DynamicCache(), past_key_values=DynamicCache())


_BODIES = {
    "GPT2Model": lambda: tiny_gpt2_config(),
    "GPTNeoModel": lambda: transformers.GPTNeoConfig(
        vocab_size=97, max_position_embeddings=32, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=4),
    "LlamaModel": lambda: transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32),
    "Qwen2Model": lambda: transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32),
    "MistralModel": lambda: transformers.MistralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, sliding_window=4),
}


@pytest.mark.parametrize("name", list(_BODIES))
def test_the_output_holds_the_cache_when_transformers_does(tmp_path, name):
    # The decoder bodies share their steps (oslo.models.body.DecoderBody); whether the output holds the cache a
    # call was given with use_cache=False differs by model in transformers (GPT2, Qwen2 and Mistral drop it,
    # GPT-Neo and Llama keep it): each must follow its own transformers class, and hold the same keys and values.
    config = _BODIES[name]()
    reference = save_reference(getattr(transformers, name), config, str(tmp_path)).eval()
    model = getattr(oslo, name).from_pretrained_with_parallel(str(tmp_path)).eval()
    ids = torch.tensor([[5, 17, 90, 3, 44]]) % config.vocab_size
    for use_cache in (False, True, None):
        with torch.no_grad():
            theirs = getattr(reference(ids, **{CACHE_FIELD: DynamicCache(config=config)}, use_cache=use_cache),
                             CACHE_FIELD)
            ours = getattr(model(ids, cache=DynamicCache(config=config), use_cache=use_cache), CACHE_FIELD)
        assert (ours is None) == (theirs is None), (name, use_cache)
        if theirs is not None:
            assert ours.get_seq_length() == theirs.get_seq_length() == ids.shape[1]
            for layer in range(config.num_hidden_layers if hasattr(config, "num_hidden_layers") else 2):
                torch.testing.assert_close(ours.layers[layer].keys, theirs.layers[layer].keys)


_HEADS = {
    "GPT2Model": ["GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification",
                  "GPT2ForQuestionAnswering"],
    "GPTNeoModel": ["GPTNeoForCausalLM", "GPTNeoForSequenceClassification", "GPTNeoForTokenClassification",
                    "GPTNeoForQuestionAnswering"],
    **{body: [f"{body[:-5]}{head}" for head in ("ForCausalLM", "ForSequenceClassification",
                                                  "ForTokenClassification", "ForQuestionAnswering")]
       for body in ("LlamaModel", "Qwen2Model", "MistralModel")},
}


@pytest.mark.parametrize("name", [name for heads in _HEADS.values() for name in heads] + list(_HEADS))
def test_every_decoder_class_reads_a_cache_passed_as_past_key_values(tmp_path, name):
    """A cache filled by a first call and passed to the next, both as ``past_key_values=`` (the name code written
    for transformers before 5.24 uses): the second call continues from it, giving transformers' outputs. A class
    whose ``forward`` names ``cache=None`` in its own signature must not hand that ``None`` on beside the
    user's ``past_key_values`` (it would be "both given" and the user's cache silently ignored)."""
    body = next((body for body, heads in _HEADS.items() if name in heads), name)
    config = _BODIES[body]()
    config.pad_token_id = 0
    reference = save_reference(getattr(transformers, name), config, str(tmp_path)).eval()
    model = getattr(oslo, name).from_pretrained_with_parallel(str(tmp_path)).eval()
    ids = torch.tensor([[5, 17, 90, 3, 44], [6, 7, 8, 9, 10]]) % config.vocab_size
    outputs, caches = [], []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)  # the old name's deprecation
        for call in (reference, model):
            caches.append(DynamicCache(config=config))
            call(ids[:, :3], past_key_values=caches[-1], use_cache=True)
            outputs.append(call(ids[:, 3:], past_key_values=caches[-1], use_cache=True))
    theirs, ours = outputs
    key = next(key for key in ("logits", "start_logits", "last_hidden_state") if key in theirs)
    torch.testing.assert_close(ours[key], theirs[key])
    # transformers' GPTNeoForQuestionAnswering hands its body no cache: it stays empty there, in oslo too
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == (0 if name == "GPTNeoForQuestionAnswering"
                                                                          else 5)
