"""The names transformers gives the KV cache, across the transformers 5 releases oslo supports.

transformers 5.24 renamed ``past_key_values`` to ``cache``: the models' forward argument (``generate()``
passes ``cache=``), the output field (``output.cache``; ``output.past_key_values`` still reads it, with a
deprecation warning) and the mask builders' argument. Earlier releases use ``past_key_values``
everywhere. oslo's models take ``cache`` and, as transformers does until 5.40, ``past_key_values`` as its
older name; they fill whichever field the installed transformers' output classes have.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable

import torch
from transformers.masking_utils import create_causal_mask as _create_causal_mask
from transformers.masking_utils import create_sliding_window_causal_mask as _create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast

__all__ = ["CACHE_FIELD", "LEGACY_CACHE_NAME", "accepts_legacy_cache_name", "create_causal_mask",
           "create_sliding_window_causal_mask", "rename_legacy_cache"]

LEGACY_CACHE_NAME = "past_key_values"

#: The output field holding the KV cache in the installed transformers (``cache`` from 5.24).
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else LEGACY_CACHE_NAME


def _cache_argument(function: Callable) -> str:
    return "cache" if "cache" in inspect.signature(function).parameters else LEGACY_CACHE_NAME


_CAUSAL_MASK_CACHE = _cache_argument(_create_causal_mask)


def rename_legacy_cache(kwargs: dict) -> dict:
    """``kwargs`` with ``past_key_values`` moved to ``cache`` (in place). Both given, ``cache`` is used and
    ``past_key_values`` dropped with a ``FutureWarning``, as transformers' models do (its ``deprecate_kwarg``):
    ``generate()`` passes ``cache=`` while code written for the older name (PEFT's prefix tuning) adds
    ``past_key_values=``."""
    if LEGACY_CACHE_NAME in kwargs:
        legacy = kwargs.pop(LEGACY_CACHE_NAME)
        if "cache" in kwargs:
            if not torch.compiler.is_compiling():  # as transformers: a warning would break a compiled graph
                warnings.warn(f"Both `{LEGACY_CACHE_NAME}` and `cache` are set: using `cache` and ignoring "
                              f"`{LEGACY_CACHE_NAME}` (its name before transformers 5.24), as transformers does.",
                              FutureWarning, stacklevel=3)
        else:
            kwargs["cache"] = legacy
    return kwargs


def accepts_legacy_cache_name(forward: Callable) -> Callable:
    """Decorate a ``forward`` whose KV cache argument is ``cache`` (and which takes ``**kwargs``) so that it
    also takes ``past_key_values=`` (what transformers before 5.24, and code written for it, pass)."""
    signature = inspect.signature(forward)
    var_keyword = next(p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD)

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if LEGACY_CACHE_NAME not in kwargs:
            return forward(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)  # past_key_values lands in **kwargs, cache where it was given
        if "cache" in bound.arguments and "cache" not in kwargs:  # positionally, and by its other name
            raise TypeError(f"{forward.__qualname__}() got multiple values for argument 'cache' (a positional "
                            f"cache and {LEGACY_CACHE_NAME}=, its name before transformers 5.24)")
        extra = bound.arguments[var_keyword]
        given = {LEGACY_CACHE_NAME: extra.pop(LEGACY_CACHE_NAME)}
        if "cache" in kwargs:
            given["cache"] = kwargs["cache"]
        bound.arguments["cache"] = rename_legacy_cache(given)["cache"]
        return forward(*bound.args, **bound.kwargs)

    return wrapper


def create_causal_mask(config, inputs_embeds: torch.Tensor, attention_mask, cache, position_ids=None):
    """transformers' ``create_causal_mask``, taking the cache as ``cache`` whatever the installed release."""
    return _create_causal_mask(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                               position_ids=position_ids, **{_CAUSAL_MASK_CACHE: cache})


def create_sliding_window_causal_mask(config, inputs_embeds: torch.Tensor, attention_mask, cache, position_ids=None):
    """transformers' ``create_sliding_window_causal_mask`` (``config.sliding_window`` keys back), taking the
    cache as ``cache`` whatever the installed release."""
    return _create_sliding_window_causal_mask(config=config, inputs_embeds=inputs_embeds,
                                              attention_mask=attention_mask, position_ids=position_ids,
                                              **{_CAUSAL_MASK_CACHE: cache})
