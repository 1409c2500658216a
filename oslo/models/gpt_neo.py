"""GPT-Neo, tensor-parallel, with every head transformers offers for it.

Reads like transformers' single-device GPT-Neo and keeps its parameter names
(``transformer.h.{i}.attn.attention.q_proj`` ...) and ``nn.Linear`` layouts, so transformers checkpoints
load as they are and merged ones load back in transformers. Attention is split by heads: ``q_proj``,
``k_proj``, ``v_proj`` (no bias) are column-parallel, ``out_proj`` row-parallel; the MLP is column- then
row-parallel. Under tensor parallelism every block does two all-reduces forward (after ``out_proj`` and
``c_proj``) and two backward.

What sets GPT-Neo apart from GPT2, and how this file follows transformers:

* Layers alternate between ``"global"`` (causal) and ``"local"`` attention as ``config.attention_layers``
  says; a local layer's query sees itself and the ``window_size - 1`` keys before it. transformers keeps a
  ``max_positions x max_positions`` boolean buffer per layer for this (``tril ^ tril(-window)``, sliced at
  ``[k_len - q_len : k_len, :k_len]``); here the same window is computed from the query and key lengths
  of each call (:func:`causal_window`): no buffer to allocate per layer (4 MiB each at 2048 positions) nor
  to initialize after the meta-device build, and the same values bit for bit.
* Scores are not scaled, and are computed in float32 (query and key cast), as transformers does; keys
  outside the causal window get ``finfo(float32).min``, then the padding mask (``create_causal_mask``) is
  added, the softmax runs in float32 and the probabilities are cast back to the values' dtype.
* Only eager attention exists in transformers for GPT-Neo (no sdpa), so the masks are additive.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPTNeoConfig
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from oslo.kernels import (
    HF_GELU_APPROXIMATIONS,
    bias_dropout_add,
    scaled_masked_softmax,
)
from oslo.kernels.bias_dropout_add import adds_residual
from oslo.models.base import OsloPreTrainedModel, check_split_sizes
from oslo.models.body import LearnedPositions, pre_norm_block
from oslo.models.compat import LEGACY_CACHE_NAME
from oslo.models.heads import (
    CausalLMHead,
    QuestionAnsweringHead,
    SequenceClassificationHead,
    TokenClassificationHead,
)
from oslo.parallel.context import ParallelContext
from oslo.parallel.layers import ColumnParallelLinear, RowParallelLinear
from oslo.parallel.mappings import enter_tensor_parallel, gather_from_tensor_parallel
from oslo.parallel.sequence import added_bias, dropout_stream

ATTENTION_TYPES = ("global", "local")


def causal_window(q_len: int, k_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``(q_len, k_len)`` boolean, True where a query may attend a key: causal, bottom-right aligned (the
    queries are the last ``q_len`` of the ``k_len`` positions, as with a KV cache), and with ``window``
    only the ``window`` most recent keys, its own included (GPT-Neo's local layers)."""
    queries = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    keys = torch.arange(k_len, device=device)[None, :]
    keep = keys <= queries
    if window is not None:
        keep = keep & (keys > queries - window)
    return keep


class GPTNeoSelfAttention(nn.Module):
    """Causal self-attention over this rank's heads, global or local (a sliding window)."""

    def __init__(
        self,
        config: GPTNeoConfig,
        attention_type: str,
        layer_id: int,
        parallel_context: ParallelContext,
    ) -> None:
        super().__init__()
        self.config = config
        self.attention_type = attention_type
        self.window = config.window_size if attention_type == "local" else None
        self.layer_id = layer_id
        # Slot in the KV cache: the layer index, except on a later pipeline stage, whose cache holds
        # only its own layers (from slot 0).
        self.cache_idx = layer_id  # its slot in the stage's KV cache (StageLayers.keep renumbers it)
        self.is_causal = True
        self.embed_dim = config.hidden_size
        self.head_dim = self.embed_dim // config.num_heads
        self.rng = parallel_context.rng
        self.tensor_parallel_group = parallel_context.tensor_parallel_group
        self.sequence = None  # sequence parallelism's state, when on (see oslo.parallel.sequence)
        self.fused = False

        context = parallel_context
        self.k_proj = ColumnParallelLinear(self.embed_dim, self.embed_dim, bias=False, parallel_context=context)
        self.v_proj = ColumnParallelLinear(self.embed_dim, self.embed_dim, bias=False, parallel_context=context)
        self.q_proj = ColumnParallelLinear(self.embed_dim, self.embed_dim, bias=False, parallel_context=context)
        self.out_proj = RowParallelLinear(self.embed_dim, self.embed_dim, parallel_context=context)
        self.attn_dropout = nn.Dropout(float(config.attention_dropout))
        self.resid_dropout = nn.Dropout(float(config.resid_dropout))

    def _heads(self, tensor: torch.Tensor) -> torch.Tensor:
        batch, length, _ = tensor.shape
        return tensor.view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, nh_local, T, hs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return the attention's output (transformers': after ``out_proj`` and its dropout) and the attention
        weights (all heads); with ``residual``, ``residual + `` that output (in oslo's kernel, where a fused block
        uses it)."""
        # One entry into the tensor-parallel region for q, k and v: one collective backward, not three.
        shared = enter_tensor_parallel(hidden_states, self.tensor_parallel_group, self.sequence)
        batch, length, _ = shared.shape  # the whole sequence (gathered under sequence parallelism)
        query = self._heads(self.q_proj(shared, input_is_copied=True))
        key = self._heads(self.k_proj(shared, input_is_copied=True))
        value = self._heads(self.v_proj(shared, input_is_copied=True))
        if cache is not None:
            key, value = cache.update(key, value, self.cache_idx)  # (B, nh_local, T_past + T, hs)

        if self.fused and not output_attentions:
            attn_output = self._sdpa_attention(query, key, value, attention_mask)  # (B, T, nh_local * hs)
        else:
            # Unscaled scores, in float32 whatever the model's dtype (as transformers computes them).
            scores = query.to(torch.float32) @ key.to(torch.float32).transpose(-1, -2)  # (B, nh_local, T, T_all)
            if self.fused:  # the weights are asked for: the fused softmax materializes them
                mask = attention_mask
                if mask is not None and mask.dtype != torch.bool:
                    mask = mask.to(scores.dtype)  # what adding it to the float32 scores promotes it to
                probs = scaled_masked_softmax(scores, mask, 1.0, causal=True, window=self.window)
            else:
                keep = causal_window(query.shape[-2], key.shape[-2], self.window, scores.device)
                scores = torch.where(keep, scores, torch.finfo(scores.dtype).min)
                if attention_mask is not None:
                    scores = scores + attention_mask
                probs = nn.functional.softmax(scores, dim=-1)
            probs = probs.to(value.dtype)
            if self.training and self.attn_dropout.p > 0:
                # Attention dropout acts on this rank's heads only: draw distinct masks per rank.
                with self.rng.split():
                    probs = self.attn_dropout(probs)
            attn_output = (probs @ value).transpose(1, 2).reshape(batch, length, -1)  # (B, T, nh_local * hs)

        if residual is not None and adds_residual(self, attn_output, self.resid_dropout):
            out = self.out_proj(attn_output, skip_bias_add=True)
            with dropout_stream(self.resid_dropout):
                hidden_states = bias_dropout_add(out, added_bias(self.out_proj), residual, self.resid_dropout.p,
                                                 self.training)
        else:
            hidden_states = self.resid_dropout(self.out_proj(attn_output))
            if residual is not None:
                hidden_states = hidden_states + residual

        weights = None
        if output_attentions:
            weights = gather_from_tensor_parallel(probs, self.tensor_parallel_group, dim=1)
        return hidden_states, weights

    def _sdpa_attention(self, query, key, value, attention_mask):
        """The fused path without weights: ``F.scaled_dot_product_attention`` (flash, cuDNN or
        memory-efficient: no materialized scores), with the causal window and the padding as one additive
        mask built with the unfused path's arithmetic (``where(keep, 0, float32 min) + attention_mask``), so
        every key gets the same offset as there. In half precision the mask's finite values are clamped to
        the dtype's range (float32's minimum is -inf in bfloat16), -inf kept: a padded query's row stays
        uniform over its window's keys as in float32 (in float16 its minimum, -65504, does not drown the
        scores: such rows, whose outputs nothing reads, then follow the scores). The kernels accumulate the
        scores and run the softmax in float32, as GPT-Neo's upcast does; in float64 the query and key are
        rounded to float32 first, as that upcast rounds them. One difference remains, in the backward of a
        padded query that sees only padding (scores all at the minimum: uniform in both): eager
        differentiates the saturated scores as if they were not, sdpa's kernels through a logsumexp the
        minimum swamps, so such a query's gradients differ (its forward does not)."""
        batch, _, length, _ = query.shape
        keep = causal_window(length, key.shape[-2], self.window, query.device)  # (T, T_all)
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
        if attention_mask is not None:
            mask = mask + attention_mask  # (B, 1, T, T_all)
        dtype = query.dtype  # the dtype sdpa runs in: autocast casts float32 inputs, mask included
        if dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
            dtype = torch.get_autocast_dtype(query.device.type)
        if dtype in (torch.float16, torch.bfloat16):
            finite = mask.clamp_min(torch.finfo(dtype).min)
            mask = torch.where(mask == float("-inf"), mask, finite)
        elif dtype == torch.float64:
            query, key = query.to(torch.float32).to(dtype), key.to(torch.float32).to(dtype)
        if dtype in (torch.float32, torch.bfloat16):
            # CUDA's sdpa kernels scale the masked scores by log2(e) before their exp2: a value at the
            # dtype's minimum overflows to -inf there, and a padded query's row (all at the minimum, uniform
            # in eager) becomes all -inf. A quarter of the minimum still swamps any score and survives that.
            saturated = torch.finfo(dtype).min / 4
            mask = torch.where(torch.isfinite(mask) & (mask <= saturated), saturated, mask)
        mask = mask.to(dtype)
        dropout = self.attn_dropout.p if self.training else 0.0
        # Attention dropout acts on this rank's heads only: draw distinct masks per rank.
        with self.rng.split() if dropout > 0 else nullcontext():
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=1.0)
        return out.transpose(1, 2).reshape(batch, length, -1)  # (B, T, nh_local * hs)


class GPTNeoAttention(nn.Module):
    """A layer's attention as ``config.attention_layers`` types it (``"global"`` or ``"local"``), under
    transformers' name ``attn.attention``. ``fuse()`` switches attention to ``F.scaled_dot_product_attention``
    with the window as a mask, or, when the weights are asked for, mask + softmax (sliding window included)
    to oslo's fused kernel (Triton on CUDA, torch reference on CPU); and bias + dropout + residual to
    oslo's fused kernel where it pays (:func:`~oslo.kernels.fused_bias_dropout_add_pays`)."""

    def __init__(
        self, config: GPTNeoConfig, layer_id: int, parallel_context: ParallelContext
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_type = config.attention_layers[layer_id]
        if self.attention_type not in ATTENTION_TYPES:
            raise NotImplementedError(
                f"GPT-Neo layer {layer_id} has attention type {self.attention_type!r}; only {ATTENTION_TYPES} "
                f"exist (config.attention_layers: {config.attention_layers})."
            )
        self.attention = GPTNeoSelfAttention(config, self.attention_type, layer_id, parallel_context)

    def fuse(self) -> None:
        self.attention.fused = True

    @property
    def fused(self) -> bool:
        return self.attention.fused

    @property
    def resid_dropout(self) -> nn.Dropout:
        return self.attention.resid_dropout

    def forward(self, hidden_states, cache=None, attention_mask=None, output_attentions=False, residual=None):
        return self.attention(hidden_states, cache, attention_mask, output_attentions, residual=residual)


class GPTNeoMLP(nn.Module):
    """Feed-forward block, column- then row-parallel. ``fuse()`` runs a GeLU activation (``gelu``,
    ``gelu_new``...; any other keeps its own math) as torch's one kernel, the bias added by the matmul, and
    bias + dropout + residual as oslo's kernel where that pays."""

    def __init__(self, intermediate_size: int, config: GPTNeoConfig, parallel_context: ParallelContext) -> None:
        super().__init__()
        embed_dim = config.hidden_size
        self.c_fc = ColumnParallelLinear(embed_dim, intermediate_size, parallel_context=parallel_context)
        self.c_proj = RowParallelLinear(intermediate_size, embed_dim, parallel_context=parallel_context)
        self.activation_function = config.activation_function
        self.act = ACT2FN[config.activation_function]
        self.dropout = nn.Dropout(float(config.resid_dropout))
        self.fused = False
        self.gelu_approximation: str | None = None

    def fuse(self) -> None:
        self.gelu_approximation = HF_GELU_APPROXIMATIONS.get(self.activation_function)
        self.fused = True

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Return ``mlp(hidden_states)`` (transformers' output); with ``residual``, ``residual + mlp(hidden_states)``
        (in oslo's kernel, where a fused block uses it)."""
        if self.fused and self.gelu_approximation is not None:  # torch's one-kernel GeLU; the matmul adds the bias
            hidden_states = F.gelu(self.c_fc(hidden_states), approximate=self.gelu_approximation)
        else:
            hidden_states = self.act(self.c_fc(hidden_states))  # (B, T, inner_local)
        if residual is not None and adds_residual(self, hidden_states, self.dropout):
            out = self.c_proj(hidden_states, skip_bias_add=True)
            with dropout_stream(self.dropout):
                return bias_dropout_add(out, added_bias(self.c_proj), residual, self.dropout.p, self.training)
        hidden_states = self.dropout(self.c_proj(hidden_states))  # (B, T, C)
        return hidden_states if residual is None else residual + hidden_states


class GPTNeoBlock(GradientCheckpointingLayer):
    def __init__(
        self, config: GPTNeoConfig, layer_id: int, parallel_context: ParallelContext
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        inner_dim = config.intermediate_size if config.intermediate_size is not None else 4 * hidden_size
        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPTNeoAttention(config, layer_id, parallel_context)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPTNeoMLP(inner_dim, config, parallel_context)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return pre_norm_block(self, hidden_states, cache=cache, attention_mask=attention_mask,
                              output_attentions=output_attentions)


class GPTNeoPreTrainedModel(OsloPreTrainedModel):
    config_class = GPTNeoConfig
    config: GPTNeoConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["GPTNeoBlock"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    # Older GPT-Neo checkpoints hold transformers' (recomputed) attention masks.
    _keys_to_ignore_on_load_unexpected = [r"attn\.attention\.bias", r"attn\.attention\.masked_bias"]
    _supports_pipeline_parallel = True
    _supports_sequence_parallel = True
    supports_gradient_checkpointing = True

    @classmethod
    def _validate_parallel_config(cls, config: GPTNeoConfig, tensor_parallel_size: int) -> None:
        inner = config.intermediate_size if config.intermediate_size is not None else 4 * config.hidden_size
        check_split_sizes(tensor_parallel_size, ("num_heads", config.num_heads), ("intermediate_size", inner))
        unknown = sorted(set(config.attention_layers) - set(ATTENTION_TYPES))
        if unknown:
            raise ValueError(
                f"config.attention_layers holds attention types {unknown}; GPT-Neo has only {list(ATTENTION_TYPES)}."
            )


class GPTNeoModel(LearnedPositions, GPTNeoPreTrainedModel):
    output_class = BaseModelOutputWithPast
    cache_only_with_use_cache = False  # transformers' GPT-Neo returns the cache it was given either way
    # (The layers' window is their own: every layer takes the padding + causal mask.)

    def __init__(self, config: GPTNeoConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self._build_body(config, config.embed_dropout, lambda i: GPTNeoBlock(config, i, self.parallel_context))
        self.post_init()


class GPTNeoForCausalLM(CausalLMHead, GPTNeoPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    _lm_output_class = CausalLMOutputWithPast

    def __init__(self, config: GPTNeoConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = GPTNeoModel(config, self.parallel_context)
        self._build_lm_head(config)
        self.post_init()


class GPTNeoForSequenceClassification(SequenceClassificationHead, GPTNeoPreTrainedModel):
    def __init__(self, config: GPTNeoConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = GPTNeoModel(config, self.parallel_context)
        self._build_sequence_classification_head(config)
        self.post_init()


class GPTNeoForTokenClassification(TokenClassificationHead, GPTNeoPreTrainedModel):
    def __init__(self, config: GPTNeoConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = GPTNeoModel(config, self.parallel_context)
        self._build_token_classification_head(config)
        self.post_init()


class GPTNeoForQuestionAnswering(QuestionAnsweringHead, GPTNeoPreTrainedModel):
    def __init__(self, config: GPTNeoConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = GPTNeoModel(config, self.parallel_context)
        self._build_question_answering_head(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                start_positions=None, end_positions=None, return_dict=None, **kwargs):
        """As transformers' ``GPTNeoForQuestionAnswering.forward``, which hands its body no KV cache: a cache
        given (``cache=``, ``past_key_values=``) is neither read nor filled."""
        for name in ("cache", LEGACY_CACHE_NAME, "use_cache"):
            kwargs.pop(name, None)
        return super().forward(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               start_positions, end_positions, return_dict=return_dict, **kwargs)


__all__ = [
    "GPTNeoSelfAttention",
    "GPTNeoAttention",
    "GPTNeoMLP",
    "GPTNeoBlock",
    "GPTNeoPreTrainedModel",
    "GPTNeoModel",
    "GPTNeoForCausalLM",
    "GPTNeoForSequenceClassification",
    "GPTNeoForTokenClassification",
    "GPTNeoForQuestionAnswering",
]
