"""GPT2, tensor-parallel, with every head transformers offers for it.

Reads like transformers' single-device GPT2: the parallel layers keep ``nn.Linear``-like signatures
and Hugging Face parameter names and layouts (``Conv1D`` weights stay ``(in, out)``), and attention
reshapes with ``view(b, t, -1, head_dim)`` so each rank's local head count falls out of the shapes.
Under tensor parallelism every block does two all-reduces forward (after ``attn.c_proj`` and
``mlp.c_proj``) and two backward (before ``attn.c_attn`` and ``mlp.c_fc``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import (
    GPT2DoubleHeadsModelOutput,
    GPT2SequenceSummary,
    eager_attention_forward,
)

from oslo.kernels import (
    bias_dropout_add,
    gelu_approximation_for_activation,
    scaled_masked_softmax,
)
from oslo.kernels.bias_dropout_add import adds_residual
from oslo.models.base import OsloPreTrainedModel, check_split_sizes
from oslo.models.body import BodyState, LearnedPositions, pre_norm_block
from oslo.models.compat import accepts_legacy_cache_name
from oslo.models.heads import (
    CausalLMHead,
    QuestionAnsweringHead,
    SequenceClassificationHead,
    TokenClassificationHead,
    VocabularyHead,
    body_inputs,
    class_items,
    gather_logits_by_default,
    lm_loss_dtype,
    output_class_for,
    vocabulary_loss,
)
from oslo.models.runner import forward_with_head
from oslo.parallel.context import ParallelContext
from oslo.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelLMHead,
)
from oslo.parallel.loss import LossSum, causal_lm_items, check_labels
from oslo.parallel.mappings import gather_from_tensor_parallel
from oslo.parallel.sequence import added_bias, dropout_stream


class GPT2Attention(nn.Module):
    """Causal self-attention over this rank's heads. ``fuse()`` switches scale + mask + softmax to oslo's
    fused kernel (Triton on CUDA, torch reference on CPU) where the scores are materialized (eager
    attention, or ``output_attentions=True``; sdpa stays sdpa), and bias + dropout + residual where that
    kernel pays (:func:`~oslo.kernels.fused_bias_dropout_add_pays`)."""

    def __init__(
        self, config: GPT2Config, layer_idx: int, parallel_context: ParallelContext
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        # Slot in the KV cache: the layer index, except on a later pipeline stage, whose cache holds
        # only its own layers (from slot 0, so the cache's length is that of its first slot).
        self.cache_idx = layer_idx  # its slot in the stage's KV cache (StageLayers.keep renumbers it)
        self.embed_dim = config.hidden_size
        self.head_dim = self.embed_dim // config.num_attention_heads
        self.is_causal = True
        self.scaling = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_idx + 1)
        self.rng = parallel_context.rng
        self.tensor_parallel_group = parallel_context.tensor_parallel_group
        self.fused = False

        # c_attn is [q | k | v] along its output: each rank takes its heads of each of the three.
        self.c_attn = ColumnParallelLinear(
            self.embed_dim, 3 * self.embed_dim, parallel_context=parallel_context, chunks=3, transposed=True
        )
        self.c_proj = RowParallelLinear(
            self.embed_dim, self.embed_dim, parallel_context=parallel_context, transposed=True
        )
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def fuse(self) -> None:
        self.fused = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        residual: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return the attention's output (transformers': after ``c_proj`` and its dropout) and the attention weights
        (all heads); with ``residual``, ``residual + `` that output (in oslo's kernel, where a fused block uses it)."""
        query, key, value = self.c_attn(hidden_states).chunk(3, dim=-1)  # 3 x (B, T, nh_local * hs)
        batch, length = query.shape[:2]  # the whole sequence (gathered under sequence parallelism)
        query = query.view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, nh_local, T, hs)
        key = key.view(batch, length, -1, self.head_dim).transpose(1, 2)
        value = value.view(batch, length, -1, self.head_dim).transpose(1, 2)

        if cache is not None:
            key, value = cache.update(key, value, self.cache_idx)  # (B, nh_local, T_past + T, hs)

        dropout = self.attn_dropout.p if self.training else 0.0
        # Attention dropout acts on this rank's heads only: draw distinct masks per rank.
        with self.rng.split() if dropout > 0 else nullcontext():
            if self.fused and (output_attentions or self.config._attn_implementation == "eager"):
                # Scores are materialized: the fused softmax. Otherwise sdpa (flash, cuDNN) serves fused too.
                attn_output, attn_weights = self._fused_attention(query, key, value, attention_mask, dropout)
            else:
                attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                    self.config._attn_implementation, eager_attention_forward
                )
                attn_output, attn_weights = attention(
                    self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
                )
        attn_output = attn_output.reshape(batch, length, -1).contiguous()  # (B, T, nh_local * hs)
        if residual is not None and adds_residual(self, attn_output, self.resid_dropout):
            out = self.c_proj(attn_output, skip_bias_add=True)
            with dropout_stream(self.resid_dropout):
                hidden_states = bias_dropout_add(out, added_bias(self.c_proj), residual, self.resid_dropout.p,
                                                 self.training)
        else:
            hidden_states = self.resid_dropout(self.c_proj(attn_output))
            if residual is not None:
                hidden_states = residual + hidden_states

        if output_attentions and attn_weights is not None:
            attn_weights = gather_from_tensor_parallel(attn_weights, self.tensor_parallel_group, dim=1)
        return hidden_states, attn_weights

    def _fused_attention(self, query, key, value, attention_mask, dropout):
        scores = query @ key.transpose(-1, -2)  # (B, nh_local, T, T_past + T)
        # Without a mask (sdpa's causal fast path) the kernel applies causality itself.
        probs = scaled_masked_softmax(scores, attention_mask, self.scaling, causal=attention_mask is None)
        probs = nn.functional.dropout(probs, p=dropout, training=self.training)
        return (probs @ value).transpose(1, 2), probs  # (B, T, nh_local, hs)


class GPT2MLP(nn.Module):
    """Feed-forward block, column- then row-parallel. ``fuse()`` runs the GeLU as torch's one kernel (the
    bias added by the matmul) instead of transformers' ``gelu_new`` formula (eight kernels, each saving its
    input for backward), and bias + dropout + residual as oslo's kernel where that pays."""

    def __init__(self, intermediate_size: int, config: GPT2Config, parallel_context: ParallelContext) -> None:
        super().__init__()
        embed_dim = config.hidden_size
        self.c_fc = ColumnParallelLinear(
            embed_dim, intermediate_size, parallel_context=parallel_context, transposed=True
        )
        self.c_proj = RowParallelLinear(
            intermediate_size, embed_dim, parallel_context=parallel_context, transposed=True
        )
        self.activation_function = config.activation_function
        self.act = ACT2FN[config.activation_function]
        self.dropout = nn.Dropout(config.resid_pdrop)
        self.fused = False

    def fuse(self) -> None:
        # Refuses activations the fused kernel does not compute exactly (never changes the math).
        self.gelu_approximation = gelu_approximation_for_activation(self.activation_function)
        self.fused = True

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Return ``mlp(hidden_states)`` (transformers' output); with ``residual``, ``residual + mlp(hidden_states)``
        (in oslo's kernel, where a fused block uses it)."""
        if self.fused:  # torch's one-kernel GeLU; the matmul adds the bias (measured faster than bias_gelu)
            hidden_states = F.gelu(self.c_fc(hidden_states), approximate=self.gelu_approximation)
        else:
            hidden_states = self.act(self.c_fc(hidden_states))  # (B, T, inner_local)
        if residual is not None and adds_residual(self, hidden_states, self.dropout):
            out = self.c_proj(hidden_states, skip_bias_add=True)  # (B, T, C)
            with dropout_stream(self.dropout):
                return bias_dropout_add(out, added_bias(self.c_proj), residual, self.dropout.p, self.training)
        hidden_states = self.dropout(self.c_proj(hidden_states))  # (B, T, C)
        return hidden_states if residual is None else residual + hidden_states


class GPT2Block(GradientCheckpointingLayer):
    def __init__(
        self, config: GPT2Config, layer_idx: int, parallel_context: ParallelContext
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        inner_dim = config.n_inner if config.n_inner is not None else 4 * hidden_size
        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx, parallel_context)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(inner_dim, config, parallel_context)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return pre_norm_block(self, hidden_states, cache=cache, attention_mask=attention_mask,
                              output_attentions=output_attentions, **kwargs)


class GPT2PreTrainedModel(OsloPreTrainedModel):
    config_class = GPT2Config
    config: GPT2Config
    base_model_prefix = "transformer"
    _no_split_modules = ["GPT2Block"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = True
    _keys_to_ignore_on_load_unexpected = [r"attn\.bias", r"crossattention\.bias"]
    _supports_pipeline_parallel = True
    _supports_sequence_parallel = True
    supports_gradient_checkpointing = True

    @classmethod
    def _validate_parallel_config(cls, config: GPT2Config, tensor_parallel_size: int) -> None:
        inner = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
        check_split_sizes(tensor_parallel_size, ("n_head", config.num_attention_heads), ("n_inner", inner))
        if config.add_cross_attention:
            raise NotImplementedError(
                "GPT2 with add_cross_attention=True is not supported by oslo yet; load it with "
                "add_cross_attention=False."
            )
        if config.reorder_and_upcast_attn:
            raise NotImplementedError(
                "reorder_and_upcast_attn=True is not supported by oslo yet; load with reorder_and_upcast_attn=False."
            )

    def _init_std(self, module_name: str) -> float:
        # GPT-2 paper: residual projections are scaled by 1/sqrt(2 * n_layer).
        if module_name.endswith((".attn.c_proj", ".mlp.c_proj")):
            return self.config.initializer_range / math.sqrt(2 * self.config.n_layer)
        return self.config.initializer_range


class GPT2Model(LearnedPositions, GPT2PreTrainedModel):
    flattens_leading_dims = True
    # As transformers' GPT2Model: cross_attentions=() whenever attentions are asked for (no cross-attention here).
    per_layer_outputs = ("hidden_states", "attentions", "cross_attentions")

    def __init__(self, config: GPT2Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self._build_body(config, config.embd_pdrop, lambda i: GPT2Block(config, i, self.parallel_context))
        self.post_init()

    def layer_inputs(self, hidden_states: torch.Tensor, state: BodyState) -> dict:
        return {"position_ids": state.position_ids, **state.kwargs}


class GPT2LMHeadModel(CausalLMHead, GPT2PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: GPT2Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = GPT2Model(config, self.parallel_context)
        self._build_lm_head(config)
        self.post_init()


class GPT2DoubleHeadsModel(VocabularyHead, GPT2PreTrainedModel, GenerationMixin):
    """Under pipeline parallelism, training steps backpropagate the language-modeling loss (``labels``);
    ``mc_labels`` there raise, since every stage must backpropagate the same single loss."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    _lm_output_class = GPT2DoubleHeadsModelOutput
    _loss_in_logits_dtype = True  # transformers' nn.CrossEntropyLoss on the logits

    def __init__(self, config: GPT2Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        config.num_labels = 1  # as transformers does: the multiple-choice head scores one choice
        context = self.parallel_context
        self.transformer = GPT2Model(config, context)
        self.lm_head = VocabParallelLMHead(config.n_embd, config.vocab_size, parallel_context=context)
        self.multiple_choice_head = GPT2SequenceSummary(config)  # small: replicated
        self.post_init()

    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        mc_token_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        mc_labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        gather_logits: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> GPT2DoubleHeadsModelOutput | tuple:
        """As transformers' ``GPT2DoubleHeadsModel.forward``; ``gather_logits`` as for
        :class:`GPT2LMHeadModel` (a training call with ``labels`` skips gathering the LM logits)."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if labels is not None:
            check_labels(labels, self.config.vocab_size)  # every rank, before any communication
        if mc_labels is not None:  # a class per row: one of the choices
            check_labels(mc_labels, (input_ids if input_ids is not None else inputs_embeds).shape[1], classes=True)
        if self.parallel_context.pipeline_parallel_size > 1 and mc_labels is not None and torch.is_grad_enabled():
            raise NotImplementedError(
                "GPT2DoubleHeadsModel with pipeline_parallel_size > 1 trains on the language-modeling loss only: "
                "pass labels without mc_labels (or evaluate mc_labels under torch.no_grad())."
            )
        gather = gather_logits_by_default(self, gather_logits, labels)

        def head(outputs, inputs, head_inputs, outputs_needed):
            hidden_states = outputs.last_hidden_state  # (B, choices, T, C)
            returned = gather and outputs_needed
            lm_loss, local_logits = vocabulary_loss(self, hidden_states, head_inputs["labels"], returned=returned,
                                                    shift=True)
            mc_logits = self.multiple_choice_head(hidden_states, head_inputs["mc_token_ids"]).squeeze(-1)
            mc_loss = None
            if head_inputs["mc_labels"] is not None:
                mc_labels = head_inputs["mc_labels"].to(mc_logits.device)
                mc_loss = LossSum(F.cross_entropy(mc_logits.view(-1, mc_logits.size(-1)), mc_labels.view(-1),
                                                  reduction="sum"))
            lm_loss = None if lm_loss is None else LossSum(lm_loss, dtype=lm_loss_dtype(self, hidden_states))
            logits = self.lm_head.gather(local_logits) if returned else None
            return {"loss": lm_loss, "mc_loss": mc_loss, "logits": logits, "mc_logits": mc_logits}

        def loss_items(batch):
            items = {}
            if "labels" in batch:
                items["loss"] = causal_lm_items(batch["labels"])
            if "mc_labels" in batch:
                items["mc_loss"] = class_items(batch["mc_labels"])
            return items

        return forward_with_head(
            self,
            self.transformer,
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds),
            {"mc_token_ids": mc_token_ids, "labels": labels, "mc_labels": mc_labels},
            head,
            output_class_for(self, self._lm_output_class, gather, gather_logits),
            cache=cache,
            use_cache=use_cache,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=loss_items,
            num_items_in_batch=num_items_in_batch,
        )


class GPT2ForSequenceClassification(SequenceClassificationHead, GPT2PreTrainedModel):
    def __init__(self, config: GPT2Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = GPT2Model(config, self.parallel_context)
        self._build_sequence_classification_head(config)
        self.post_init()


class GPT2ForTokenClassification(TokenClassificationHead, GPT2PreTrainedModel):
    def __init__(self, config: GPT2Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = GPT2Model(config, self.parallel_context)
        self._build_token_classification_head(config)
        self.post_init()


class GPT2ForQuestionAnswering(QuestionAnsweringHead, GPT2PreTrainedModel):
    def __init__(self, config: GPT2Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = GPT2Model(config, self.parallel_context)
        self._build_question_answering_head(config)
        self.post_init()


__all__ = [
    "GPT2Attention",
    "GPT2MLP",
    "GPT2Block",
    "GPT2PreTrainedModel",
    "GPT2Model",
    "GPT2LMHeadModel",
    "GPT2DoubleHeadsModel",
    "GPT2ForSequenceClassification",
    "GPT2ForTokenClassification",
    "GPT2ForQuestionAnswering",
]
