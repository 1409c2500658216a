"""The KV cache under both of its transformers names: ``cache`` (transformers >= 5.24, what generate()
passes) and ``past_key_values`` (before 5.24, and code written for it), against transformers' model."""

from __future__ import annotations

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


def test_both_names_at_once_are_refused(models):
    _, model = models
    ids = torch.tensor([[5, 17]])
    with pytest.raises(TypeError, match="both cache= and past_key_values="):
        model(ids, cache=DynamicCache(), past_key_values=DynamicCache())
    with pytest.raises(TypeError, match="both cache= and past_key_values="):
        model(ids, DynamicCache(), past_key_values=DynamicCache())
    with pytest.raises(TypeError, match="both cache= and past_key_values="):
        model.transformer(ids, cache=DynamicCache(), past_key_values=DynamicCache())
