"""BERT, tensor- and pipeline-parallel, with every head transformers offers for it.

Reads like transformers' single-device BERT and keeps its parameter names
(``bert.encoder.layer.{i}.attention.self.query`` ...) and ``nn.Linear`` layouts, so transformers
checkpoints load as they are and merged ones load back in transformers.

* Blocks are post-LN: ``LayerNorm(x + dropout(dense(...)))`` after the attention and after the MLP.
* Attention is split by heads: ``query``, ``key``, ``value`` are three column-parallel linears (separate
  weights, as in the checkpoints) that share one identity-forward / all-reduce-backward of their input;
  ``attention.output.dense`` is row-parallel; the MLP is column- (``intermediate.dense``) then row-parallel
  (``output.dense``). Under tensor parallelism every block does exactly two all-reduces forward (after the
  two row-parallel layers) and two backward (the input of q/k/v, the input of ``intermediate.dense``).
* Attention is bidirectional with a padding mask (``create_bidirectional_mask``), or causal when
  ``config.is_decoder`` (``create_causal_mask``; BertLMHeadModel), scaled by ``head_dim ** -0.5``, sdpa or
  eager as transformers runs it. Only a decoder keeps a KV cache (:meth:`BertModel.builds_cache`).
  Cross-attention (``add_cross_attention=True``, ``encoder_hidden_states``) is refused with
  ``NotImplementedError`` for now.
* Embeddings: word (vocabulary-split), absolute positions and token types (replicated), then LayerNorm
  and dropout. Missing ``position_ids`` / ``token_type_ids`` come from the ``position_ids`` /
  ``token_type_ids`` buffers transformers keeps (non-persistent, so the build gives them their values:
  :meth:`BertPreTrainedModel._init_buffers`).
* ``hidden_act`` is honoured exactly (``"gelu"`` is the erf GeLU); ``fuse()`` runs torch's one-kernel GeLU
  only for the GeLUs it computes exactly.
* The pooler (tanh of a dense layer on the first token) and the heads live on the last pipeline stage;
  the masked-LM prediction head (``cls.predictions``: transform, decoder tied to the word embeddings, its
  own bias split by vocabulary like the decoder) gives vocabulary-split logits, whose loss never gathers
  them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    NextSentencePredictorOutput,
    SequenceClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput, eager_attention_forward

from oslo.kernels import (
    HF_GELU_APPROXIMATIONS,
    bias_dropout_add,
    fused_bias_dropout_add_pays,
    scaled_masked_softmax,
)
from oslo.models.base import OsloPreTrainedModel, check_split_sizes
from oslo.models.body import BodyState, StagedBody, adopt_cache, stand_in_embeds
from oslo.models.compat import CACHE_FIELD, accepts_legacy_cache_name, create_causal_mask
from oslo.models.heads import (
    CausalLMHead,
    MaskedLMHead,
    MultipleChoiceHead,
    QuestionAnsweringHead,
    SequenceClassificationHead,
    TokenClassificationHead,
    VocabularyHead,
    body_inputs,
    class_items,
    gather_logits_by_default,
    lm_loss_dtype,
    vocabulary_loss,
)
from oslo.models.runner import forward_with_head
from oslo.parallel.context import ParallelContext
from oslo.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from oslo.parallel.loss import LossSum, check_labels
from oslo.parallel.mappings import enter_tensor_parallel, gather_from_tensor_parallel
from oslo.parallel.pipeline import StageLayers
from oslo.parallel.sequence import added_bias, dropout_stream, splits_sequences


def _activation(hidden_act) -> Callable:
    """``config.hidden_act``: an ``ACT2FN`` name, or a callable (as transformers accepts)."""
    return ACT2FN[hidden_act] if isinstance(hidden_act, str) else hidden_act


def _refuse_cross_attention(encoder_hidden_states, encoder_attention_mask) -> None:
    if encoder_hidden_states is not None or encoder_attention_mask is not None:
        raise NotImplementedError(
            "BERT cross-attention (encoder_hidden_states / encoder_attention_mask, add_cross_attention=True) is "
            "not supported by oslo yet; call the model without them."
        )


class BertEmbeddings(nn.Module):
    """Word (vocabulary-split), position and token-type embeddings, summed, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id, parallel_context=parallel_context
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # As transformers keeps them (non-persistent): default positions and token types (all zeros).
        self.register_buffer(
            "position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False
        )
        self.register_buffer(
            "token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long), persistent=False
        )

    def reset_buffers(self) -> None:
        self.position_ids.copy_(torch.arange(self.position_ids.shape[-1]).expand((1, -1)))
        self.token_type_ids.zero_()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values_length: int = 0,
    ) -> torch.Tensor:
        batch, length = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        if position_ids is None:
            position_ids = self.position_ids[:, past_key_values_length : past_key_values_length + length]
        if token_type_ids is None:
            # The zeros buffer, read at the positions (as transformers does, for tracing).
            buffered = self.token_type_ids.expand(position_ids.shape[0], -1)
            token_type_ids = torch.gather(buffered, dim=1, index=position_ids).expand(batch, length)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (B, T, C)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    """Self-attention over this rank's heads: ``query``, ``key``, ``value`` column-parallel. Returns this
    rank's heads' output ``(B, T, nh_local * hs)`` (``attention.output.dense`` sums over the ranks).
    ``fuse()`` switches scale + mask + softmax to oslo's fused kernel where the scores are materialized
    (eager attention, or ``output_attentions=True``); sdpa stays sdpa."""

    def __init__(
        self, config: BertConfig, layer_idx: int, parallel_context: ParallelContext
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        # Slot in the KV cache: the layer index, except on a later pipeline stage, whose cache holds
        # only its own layers (from slot 0).
        self.cache_idx = layer_idx  # its slot in the stage's KV cache (StageLayers.keep renumbers it)
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.scaling = self.attention_head_size**-0.5
        self.is_decoder = config.is_decoder
        self.is_causal = config.is_decoder  # read by sdpa when there is no mask
        self.rng = parallel_context.rng
        self.tensor_parallel_group = parallel_context.tensor_parallel_group
        self.fused = False
        self.sequence = None  # under sequence parallelism: see oslo.parallel.sequence

        hidden = config.hidden_size
        self.query = ColumnParallelLinear(hidden, hidden, parallel_context=parallel_context)
        self.key = ColumnParallelLinear(hidden, hidden, parallel_context=parallel_context)
        self.value = ColumnParallelLinear(hidden, hidden, parallel_context=parallel_context)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def fuse(self) -> None:
        self.fused = True

    def _heads(self, layer: ColumnParallelLinear, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's heads of one projection, ``(B, nh_local, T, hs)``. The input already went through
        ``enter_tensor_parallel`` once for q, k and v (one all-reduce backward instead of three; under sequence
        parallelism one all-gather of the shards)."""
        batch, length, _ = hidden_states.shape
        out = layer(hidden_states, input_is_copied=True)
        return out.view(batch, length, -1, self.attention_head_size).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        shared = enter_tensor_parallel(hidden_states, self.tensor_parallel_group, self.sequence)
        batch, length, _ = shared.shape  # the whole sequence (gathered from the shards under sequence parallelism)
        query = self._heads(self.query, shared)
        key = self._heads(self.key, shared)
        value = self._heads(self.value, shared)
        if cache is not None:
            key, value = cache.update(key, value, self.cache_idx)  # (B, nh_local, T_past + T, hs)

        dropout = self.dropout.p if self.training else 0.0
        # Attention dropout acts on this rank's heads only: draw distinct masks per rank.
        with self.rng.split() if dropout > 0 else nullcontext():
            if self.fused and (output_attentions or self.config._attn_implementation == "eager"):
                # Scores are materialized: the fused softmax. Otherwise sdpa (flash, cuDNN) serves fused too.
                scores = query @ key.transpose(-1, -2)  # (B, nh_local, T, T_past + T)
                # Without a mask (sdpa's fast paths) a decoder's kernel applies causality itself.
                probs = scaled_masked_softmax(scores, attention_mask, self.scaling,
                                              causal=attention_mask is None and self.is_causal)
                attn_weights = nn.functional.dropout(probs, p=dropout, training=self.training)
                attn_output = (attn_weights @ value).transpose(1, 2)  # (B, T, nh_local, hs)
            else:
                attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                    self.config._attn_implementation, eager_attention_forward
                )
                attn_output, attn_weights = attention(
                    self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
                )
        attn_output = attn_output.reshape(batch, length, -1).contiguous()  # (B, T, nh_local * hs)
        if output_attentions and attn_weights is not None:
            attn_weights = gather_from_tensor_parallel(attn_weights, self.tensor_parallel_group, dim=1)
        return attn_output, attn_weights


class BertSelfOutput(nn.Module):
    """``LayerNorm(residual + dropout(dense(attention)))``, ``dense`` row-parallel (one all-reduce).
    ``fuse()`` switches bias + dropout + residual to oslo's fused kernel where it pays
    (:func:`~oslo.kernels.fused_bias_dropout_add_pays`)."""

    def __init__(self, config: BertConfig, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, parallel_context=parallel_context)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.fused = False

    def fuse(self) -> None:
        self.fused = True

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        if self.fused and fused_bias_dropout_add_pays(hidden_states, self.dropout.p, self.training):
            out = self.dense(hidden_states, skip_bias_add=True)
            with dropout_stream(self.dropout):
                added = bias_dropout_add(out, added_bias(self.dense), input_tensor, self.dropout.p, self.training)
            return self.LayerNorm(added)
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertAttention(nn.Module):
    def __init__(
        self, config: BertConfig, layer_idx: int, parallel_context: ParallelContext
    ) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, layer_idx, parallel_context)
        self.output = BertSelfOutput(config, parallel_context)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_output, attn_weights = self.self(
            hidden_states, attention_mask=attention_mask, cache=cache,
            output_attentions=output_attentions, **kwargs,
        )
        return self.output(attn_output, hidden_states), attn_weights


class BertIntermediate(nn.Module):
    """``act(dense(x))``, ``dense`` column-parallel. ``fuse()`` runs the activation as torch's one-kernel GeLU
    (the bias added by the matmul) when ``hidden_act`` is a GeLU it computes exactly (``"gelu"``: erf;
    ``"gelu_new"``...: tanh); any other activation keeps its own math, unfused."""

    def __init__(self, config: BertConfig, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size,
                                          parallel_context=parallel_context)
        self.hidden_act = config.hidden_act
        self.intermediate_act_fn = _activation(config.hidden_act)
        self.gelu_approximation: str | None = None

    def fuse(self) -> None:
        if isinstance(self.hidden_act, str):
            self.gelu_approximation = HF_GELU_APPROXIMATIONS.get(self.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.gelu_approximation is not None:  # torch's one-kernel GeLU; the matmul adds the bias
            return F.gelu(self.dense(hidden_states), approximate=self.gelu_approximation)
        return self.intermediate_act_fn(self.dense(hidden_states))  # (B, T, intermediate_local)


class BertOutput(nn.Module):
    """``LayerNorm(residual + dropout(dense(intermediate)))``, ``dense`` row-parallel (one all-reduce).
    ``fuse()`` switches bias + dropout + residual to oslo's fused kernel where it pays
    (:func:`~oslo.kernels.fused_bias_dropout_add_pays`)."""

    def __init__(self, config: BertConfig, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.dense = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                       parallel_context=parallel_context)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.fused = False

    def fuse(self) -> None:
        self.fused = True

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        if self.fused and fused_bias_dropout_add_pays(hidden_states, self.dropout.p, self.training):
            out = self.dense(hidden_states, skip_bias_add=True)
            with dropout_stream(self.dropout):
                added = bias_dropout_add(out, added_bias(self.dense), input_tensor, self.dropout.p, self.training)
            return self.LayerNorm(added)
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertLayer(GradientCheckpointingLayer):
    def __init__(
        self, config: BertConfig, layer_idx: int, parallel_context: ParallelContext
    ) -> None:
        super().__init__()
        self.attention = BertAttention(config, layer_idx, parallel_context)
        self.intermediate = BertIntermediate(config, parallel_context)
        self.output = BertOutput(config, parallel_context)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attention_output, attn_weights = self.attention(
            hidden_states, attention_mask=attention_mask, cache=cache,
            output_attentions=output_attentions, **kwargs,
        )
        return self.output(self.intermediate(attention_output), attention_output), attn_weights


class BertEncoder(nn.Module):
    """This pipeline stage's layers, as ``encoder.layer.{i}`` (global indices)."""

    def __init__(self, config: BertConfig, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.layer = StageLayers.build(config.num_hidden_layers, lambda i: BertLayer(config, i, parallel_context))


class BertPooler(nn.Module):
    """``tanh(dense(hidden state of the first token))`` (replicated)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = _activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    """transform (replicated), then ``decoder``: a vocabulary-split projection tied to the word embeddings,
    whose bias is ``bias``, split by vocabulary like the decoder (tied to ``decoder.bias`` as in transformers).
    Returns this rank's vocabulary columns of the logits."""

    def __init__(self, config: BertConfig, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = VocabParallelLMHead(config.hidden_size, config.vocab_size, bias=True,
                                           parallel_context=parallel_context)
        spec = self.decoder.parallel_specs["bias"]
        self.bias = nn.Parameter(torch.zeros(spec.local_size))
        self.parallel_specs = {"bias": spec}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(hidden_states))  # (B, T, V_local)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config, parallel_context)

    def forward(self, sequence_output: torch.Tensor) -> torch.Tensor:
        return self.predictions(sequence_output)


class BertOnlyNSPHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, pooled_output: torch.Tensor) -> torch.Tensor:
        return self.seq_relationship(pooled_output)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config, parallel_context)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output: torch.Tensor, pooled_output: torch.Tensor):
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


class BertPreTrainedModel(OsloPreTrainedModel):
    config_class = BertConfig
    config: BertConfig
    base_model_prefix = "bert"
    _no_split_modules = ["BertEmbeddings", "BertLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = True
    _supports_pipeline_parallel = True
    _supports_sequence_parallel = True  # the layers' norms and residual stream on sequence shards
    supports_gradient_checkpointing = True
    # Older checkpoints saved the position_ids buffer.
    _keys_to_ignore_on_load_unexpected = [r"embeddings\.position_ids"]
    # BERT embeds token types with a table of its own (type_vocab_size rows), not the word embeddings.
    _id_inputs = {"input_ids": "vocab_size", "inputs": "vocab_size", "token_type_ids": "type_vocab_size"}

    @classmethod
    def _validate_parallel_config(cls, config: BertConfig, tensor_parallel_size: int) -> None:
        if not isinstance(config, BertConfig):
            raise TypeError(
                f"{cls.__name__} needs a BertConfig, got {type(config).__name__}: the architectures differ. "
                f"Build a {getattr(config, 'model_type', type(config).__name__)!r} model with its own class."
            )
        heads, hidden, inner = config.num_attention_heads, config.hidden_size, config.intermediate_size
        if hidden % heads != 0:
            raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}.")
        check_split_sizes(tensor_parallel_size, ("num_attention_heads", heads), ("intermediate_size", inner))
        if config.add_cross_attention:
            raise NotImplementedError(
                "BERT with add_cross_attention=True is not supported by oslo yet; load it with "
                "add_cross_attention=False (cross-attention weights are then unused)."
            )

    def _init_buffers(self, module: nn.Module) -> None:
        if isinstance(module, BertEmbeddings):
            module.reset_buffers()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # As nn.Embedding's init: the padding token's row is zero.
        if isinstance(module, VocabParallelEmbedding) and module.local_padding_idx is not None:
            module.weight[module.local_padding_idx].zero_()

    def _seeded_global_init(self, name: str, global_shape: tuple[int, ...], seed: int) -> torch.Tensor:
        value = super()._seeded_global_init(name, global_shape, seed)
        source = (self._tied_weights_keys or {}).get(name, name)  # the decoder on another stage than its twin
        pad = self.config.pad_token_id
        if source.endswith("embeddings.word_embeddings.weight") and pad is not None and 0 <= pad < global_shape[0]:
            value[pad] = 0  # as nn.Embedding's init: the padding token's row is zero
        return value


class BertModel(StagedBody, BertPreTrainedModel):
    """The BERT body: embeddings (first stage), layers, pooler (last stage; ``add_pooling_layer``).

    Inputs of shape ``(..., length)`` are flattened into rows (multiple choice passes
    ``(batch, choices, length)``)."""

    output_class = BaseModelOutputWithPoolingAndCrossAttentions
    # transformers returns cross_attentions=() whenever attentions are asked for (no layer fills it here).
    per_layer_outputs = ("hidden_states", "attentions", "cross_attentions")

    def __init__(
        self,
        config: BertConfig,
        parallel_context: ParallelContext | None = None,
        add_pooling_layer: bool = True,
    ) -> None:
        if isinstance(parallel_context, bool):  # transformers' positional BertModel(config, add_pooling_layer)
            parallel_context, add_pooling_layer = None, parallel_context
        super().__init__(config, parallel_context)
        context = self.parallel_context
        self.add_pooling_layer = add_pooling_layer
        self.embeddings = BertEmbeddings(config, context)
        self.encoder = BertEncoder(config, context)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.gradient_checkpointing = False
        self.post_init()

    def builds_cache(self) -> bool:
        # Only a decoder caches keys and values, as transformers' BERT.
        return bool(self.config.is_decoder)

    def get_input_embeddings(self) -> VocabParallelEmbedding | None:
        return self.embeddings.word_embeddings if self.embeddings is not None else None

    def set_input_embeddings(self, value: VocabParallelEmbedding) -> None:
        self.embeddings.word_embeddings = value

    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPoolingAndCrossAttentions | tuple:
        """As transformers' ``BertModel.forward`` (under pipeline parallelism: one pass without gradients
        over every stage, whose output every stage returns)."""
        return self.run(self.prepare(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, inputs_embeds=inputs_embeds, encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask, cache=cache, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            return_dict=return_dict, **kwargs,
        ))

    def prepare(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        cache=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> BodyState:
        config = self.config
        _refuse_cross_attention(encoder_hidden_states, encoder_attention_mask)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        use_cache = (use_cache if use_cache is not None else config.use_cache) if config.is_decoder else False
        if self.gradient_checkpointing and self.training:
            use_cache = False  # the recomputation would add the keys and values a second time
        output_attentions = output_attentions if output_attentions is not None else config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        # (batch, choices, length) inputs of multiple choice: a row per choice.
        if input_ids is not None:
            length = input_ids.shape[-1]
            input_ids = input_ids.reshape(-1, length)
        else:
            length = inputs_embeds.shape[-2]
            inputs_embeds = inputs_embeds.reshape(-1, length, inputs_embeds.shape[-1])
        if attention_mask is not None and attention_mask.dim() == 3:
            attention_mask = attention_mask.reshape(-1, attention_mask.shape[-1])
        if token_type_ids is not None and token_type_ids.dim() > 2:
            token_type_ids = token_type_ids.reshape(-1, length)
        if position_ids is not None and position_ids.dim() > 2:
            position_ids = position_ids.reshape(-1, length)

        if use_cache and cache is None:
            cache = DynamicCache(config=config)  # each rank caches its own heads
        adopt_cache(cache, self.parallel_context)
        past_length = cache.get_seq_length() if cache is not None else 0
        embeds = stand_in_embeds(input_ids, inputs_embeds, self.dtype, self.device)
        if config.is_decoder:
            mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=attention_mask,
                                      cache=cache)
        else:
            mask = create_bidirectional_mask(config=config, inputs_embeds=embeds, attention_mask=attention_mask)
        return BodyState(
            sequence_sharded=splits_sequences(self.parallel_context, length),
            input_ids=input_ids, inputs_embeds=inputs_embeds, token_type_ids=token_type_ids,
            position_ids=position_ids, past_length=past_length, attention_mask=mask,
            cache=cache, use_cache=use_cache, output_attentions=output_attentions,
            return_dict=return_dict if return_dict is not None else config.return_dict, kwargs=kwargs,
            hidden_states=() if output_hidden_states else None, attentions=() if output_attentions else None,
            cross_attentions=() if output_attentions else None,
        )

    def embed(self, state: BodyState) -> dict[str, torch.Tensor]:
        hidden_states = self.embeddings(
            input_ids=state.input_ids, token_type_ids=state.token_type_ids, position_ids=state.position_ids,
            inputs_embeds=state.inputs_embeds, past_key_values_length=state.past_length,
        )
        # this rank's shard of the sequence through the layers
        return {"hidden_states": self._shard(hidden_states, state.sequence_sharded)}

    def run_layers(self, payload: dict[str, torch.Tensor], state: BodyState) -> dict[str, torch.Tensor]:
        hidden_states = payload["hidden_states"]
        with self._layers_on(state.sequence_sharded):
            for layer in self.encoder.layer:
                if state.hidden_states is not None:
                    state.hidden_states += (self._whole(hidden_states, state.sequence_sharded),)
                hidden_states, attn_weights = layer(
                    hidden_states,
                    attention_mask=state.attention_mask,
                    cache=state.cache,
                    output_attentions=state.output_attentions,
                    **state.kwargs,
                )
                if state.attentions is not None and attn_weights is not None:  # sdpa has none: ()
                    state.attentions += (attn_weights,)
        return {"hidden_states": hidden_states}

    def finish(
        self, payload: dict[str, torch.Tensor], state: BodyState
    ) -> BaseModelOutputWithPoolingAndCrossAttentions:
        sequence_output = self._whole(payload["hidden_states"], state.sequence_sharded)
        if state.hidden_states is not None:
            state.hidden_states += (sequence_output,)
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output,
            pooler_output=self.pooler(sequence_output) if self.pooler is not None else None,
            **{CACHE_FIELD: state.cache if state.use_cache else None},
            hidden_states=state.hidden_states,
            attentions=state.attentions,
            cross_attentions=state.cross_attentions,
        )


class _BertPredictions(VocabularyHead):
    """The masked-LM prediction head ``cls.predictions`` as the vocabulary heads use it."""

    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def _lm_features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.cls.predictions.transform(hidden_states)

    def _lm_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.cls.predictions(hidden_states)  # (..., V_local); its forward runs, and hooks on it see it

    def _vocab_module(self) -> nn.Module:
        return self.cls.predictions.decoder

    def _logits_module(self) -> nn.Module:
        return self.cls.predictions

    def get_output_embeddings(self) -> nn.Module | None:
        """``cls.predictions.decoder``, as transformers' BERT heads return (what PEFT's ``"all-linear"`` leaves
        out); ``None`` on a pipeline stage that does not hold the head."""
        predictions = getattr(getattr(self, "cls", None), "predictions", None)
        return None if predictions is None else getattr(predictions, "decoder", None)

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias


class BertForPreTraining(_BertPredictions, BertPreTrainedModel):
    """Masked LM + next sentence prediction; the loss (both labels given) is their sum, each averaged over
    its own items. Under pipeline parallelism a training step needs both ``labels`` and
    ``next_sentence_label``. ``prediction_logits`` are gathered as :class:`~oslo.models.heads.CausalLMHead`
    gathers logits: not in a training call (``None`` then) unless ``gather_logits=True``."""

    _pipeline_loss_inputs = ("labels", "next_sentence_label")
    _loss_in_logits_dtype = True  # transformers' nn.CrossEntropyLoss on the logits

    def __init__(self, config: BertConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        context = self.parallel_context
        self.bert = BertModel(config, context)
        self.cls = BertPreTrainingHeads(config, context)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        gather_logits: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BertForPreTrainingOutput | tuple:
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if labels is not None:
            check_labels(labels, self.config.vocab_size)  # every rank, before any communication
        if next_sentence_label is not None:
            check_labels(next_sentence_label, 2, classes=True)
        gather = gather_logits_by_default(self, gather_logits, labels)

        def head(outputs, inputs, head_inputs, outputs_needed):
            returned = gather and outputs_needed
            seq_relationship_logits = self.cls.seq_relationship(outputs.pooler_output)  # (B, 2)
            loss = None
            labels, next_sentence = head_inputs["labels"], head_inputs["next_sentence_label"]
            if next_sentence is None:
                labels = None  # (transformers' loss needs both)
            masked_lm, local_logits = vocabulary_loss(self, outputs.last_hidden_state, labels, returned=returned,
                                                      shift=False)
            if labels is not None:
                next_sentence = next_sentence.to(seq_relationship_logits.device)
                nsp = F.cross_entropy(seq_relationship_logits.view(-1, 2), next_sentence.view(-1), reduction="sum")
                both = torch.promote_types(masked_lm.dtype, nsp.dtype)
                loss = LossSum(torch.stack([masked_lm.to(both), nsp.to(both)]), weights=(1.0, 1.0),
                               dtype=lm_loss_dtype(self, outputs.last_hidden_state))
            logits = self._vocab_projection().gather(local_logits) if returned else None
            return {"loss": loss, "prediction_logits": logits, "seq_relationship_logits": seq_relationship_logits}

        def loss_items(batch):
            if "labels" not in batch or "next_sentence_label" not in batch:
                return {}
            return {"loss": torch.stack([class_items(batch["labels"]), class_items(batch["next_sentence_label"])])}

        return forward_with_head(
            self,
            self.bert,
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds),
            {"labels": labels, "next_sentence_label": next_sentence_label},
            head,
            BertForPreTrainingOutput,
            use_cache=False,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=loss_items,
            num_items_in_batch=num_items_in_batch,
        )


class BertLMHeadModel(_BertPredictions, CausalLMHead, BertPreTrainedModel, GenerationMixin):
    """Causal language modeling (``config.is_decoder=True``; transformers warns otherwise) through
    ``cls.predictions``; ``generate()`` as transformers'."""

    def __init__(self, config: BertConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        context = self.parallel_context
        self.bert = BertModel(config, context, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config, context)
        self.post_init()

    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        """As transformers' ``BertLMHeadModel.forward`` (its argument order; ``gather_logits`` as for
        :class:`~oslo.models.heads.CausalLMHead`)."""
        _refuse_cross_attention(encoder_hidden_states, encoder_attention_mask)
        if labels is not None:
            use_cache = False  # as transformers' BERT
        return super().forward(
            input_ids=input_ids, cache=cache, attention_mask=attention_mask,
            token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels,
            use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs,
        )


class BertForMaskedLM(_BertPredictions, MaskedLMHead, BertPreTrainedModel):
    _loss_in_logits_dtype = True  # transformers' nn.CrossEntropyLoss on the logits

    def __init__(self, config: BertConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        context = self.parallel_context
        self.bert = BertModel(config, context, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config, context)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ):
        """As transformers' ``BertForMaskedLM.forward`` (its argument order; ``gather_logits`` as for
        :class:`~oslo.models.heads.MaskedLMHead`)."""
        _refuse_cross_attention(encoder_hidden_states, encoder_attention_mask)
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels, **kwargs,
        )


class BertForNextSentencePrediction(BertPreTrainedModel):
    """Is sentence B the continuation of sentence A: ``cls.seq_relationship`` on the pooled output."""

    def __init__(self, config: BertConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        context = self.parallel_context
        self.bert = BertModel(config, context)
        self.cls = BertOnlyNSPHead(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> NextSentencePredictorOutput | tuple:
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if labels is not None:
            check_labels(labels, 2, classes=True)  # every rank, before any communication

        def head(outputs, inputs, head_inputs, outputs_needed):
            logits = self.cls(outputs.pooler_output)  # (B, 2)
            loss = None
            if head_inputs["labels"] is not None:
                labels = head_inputs["labels"].to(logits.device)
                loss = LossSum(F.cross_entropy(logits.view(-1, 2), labels.view(-1), reduction="sum"))
            return {"loss": loss, "logits": logits}

        return forward_with_head(
            self,
            self.bert,
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds),
            {"labels": labels},
            head,
            NextSentencePredictorOutput,
            use_cache=False,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=lambda batch: {"loss": class_items(batch["labels"])},
            num_items_in_batch=num_items_in_batch,
        )


class BertForSequenceClassification(SequenceClassificationHead, BertPreTrainedModel):
    """Classification (or regression) of the pooled output: dropout, then ``classifier`` (with a bias)."""

    _sequence_pooling = "pooler"
    _sequence_classifier = "classifier"
    _sequence_classifier_bias = True
    _sequence_classifier_dropout = True
    _sequence_classification_output_class = SequenceClassifierOutput

    def __init__(self, config: BertConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.bert = BertModel(config, self.parallel_context)
        self._build_sequence_classification_head(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ):
        """As transformers' ``BertForSequenceClassification.forward`` (its argument order)."""
        return self._classify_sequences(
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds), labels, **kwargs)


class BertForMultipleChoice(MultipleChoiceHead, BertPreTrainedModel):
    def __init__(self, config: BertConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.bert = BertModel(config, self.parallel_context)
        self._build_multiple_choice_head(config)
        self.post_init()


class BertForTokenClassification(TokenClassificationHead, BertPreTrainedModel):
    def __init__(self, config: BertConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.bert = BertModel(config, self.parallel_context, add_pooling_layer=False)
        self._build_token_classification_head(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ):
        """As transformers' ``BertForTokenClassification.forward`` (its argument order)."""
        return self._classify_tokens(
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds), labels, **kwargs)


class BertForQuestionAnswering(QuestionAnsweringHead, BertPreTrainedModel):
    def __init__(self, config: BertConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.bert = BertModel(config, self.parallel_context, add_pooling_layer=False)
        self._build_question_answering_head(config)
        self.post_init()


__all__ = [
    "BertEmbeddings",
    "BertSelfAttention",
    "BertSelfOutput",
    "BertAttention",
    "BertIntermediate",
    "BertOutput",
    "BertLayer",
    "BertPreTrainedModel",
    "BertModel",
    "BertForPreTraining",
    "BertLMHeadModel",
    "BertForMaskedLM",
    "BertForNextSentencePrediction",
    "BertForSequenceClassification",
    "BertForMultipleChoice",
    "BertForTokenClassification",
    "BertForQuestionAnswering",
]
