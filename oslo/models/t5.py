"""T5, tensor- and pipeline-parallel, with every head transformers offers for it.

Reads like transformers' single-device T5 and keeps its parameter names
(``encoder.block.{i}.layer.0.SelfAttention.q`` ...), so transformers checkpoints load as they are and
merged ones load back in transformers.

* Attention is split by heads: ``q``, ``k``, ``v`` (no bias) are column-parallel and share one
  identity-forward / all-reduce-backward of their input, ``o`` is row-parallel; the feed-forward is
  column- (``wi``; ``wi_0`` and ``wi_1`` when gated) then row-parallel (``wo``). The relative position
  bias table ``(num_buckets, num_heads)`` of each stack's first block is split by heads too (each rank its
  heads' columns). An encoder block does two all-reduces forward and two backward; a decoder block three
  and three. The encoder's output enters the decoder's tensor-parallel region once per pipeline stage
  (its gradient is summed over the ranks once, not once per cross-attention).
* ``T5LayerNorm`` (RMS, no bias, fp32 variance), dense-relu and gated-gelu feed-forward (t5 v1.0 and
  v1.1), no attention scaling, the decoder output scaled by ``d_model ** -0.5`` before the head when
  ``config.scale_decoder_outputs`` (transformers 5 always ties ``lm_head`` to ``shared`` and records v1.1's
  ``tie_word_embeddings=False`` as ``scale_decoder_outputs=False``).
* Pipelines: the encoder's and the decoder's blocks form one sequence of layers, partitioned by their
  measured cost (a decoder block weighs more: cross-attention). Between stages travel the running hidden
  state, the encoder's output (once the encoder is done: every decoder stage uses it, and its gradients
  from every decoder stage flow back into the encoder), and the relative position tables of the stacks
  that go on (``(num_buckets, heads)``: a few hundred bytes, not the ``(heads, T, T)`` bias; their
  gradients flow back to the first block). ``shared`` (first stage), the decoder's ``embed_tokens`` (the
  stage where the decoder starts) and ``lm_head`` (last stage) are one tied weight over however many
  stages hold them. ``generate()`` runs the encoder once over the encoder's stages
  (:meth:`get_encoder`), then each step over the decoder's stages only, each keeping an
  ``EncoderDecoderCache`` of its own layers.
"""

from __future__ import annotations

import copy
import weakref
from contextlib import nullcontext

import torch
from torch import nn
from transformers import T5Config
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqModelOutput,
    Seq2SeqQuestionAnsweringModelOutput,
    Seq2SeqSequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.t5.modeling_t5 import T5Attention as _TransformersT5Attention
from transformers.models.t5.modeling_t5 import eager_attention_forward

from oslo.models.base import OsloPreTrainedModel, check_split_sizes
from oslo.models.body import BodyState, StagedBody, adopt_cache, stand_in_embeds
from oslo.models.compat import CACHE_FIELD, accepts_legacy_cache_name, create_causal_mask
from oslo.models.heads import (
    QuestionAnsweringHead,
    Seq2SeqLMHead,
    SequenceClassificationHead,
    TokenClassificationHead,
    seq2seq_body_inputs,
)
from oslo.models.stages import running_stage
from oslo.parallel.context import ParallelContext
from oslo.parallel.dtensor import local
from oslo.parallel.layers import (
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from oslo.parallel.mappings import copy_to_tensor_parallel, enter_tensor_parallel, gather_from_tensor_parallel
from oslo.parallel.pipeline import StageLayers, StageLink, pipeline_pass
from oslo.parallel.sequence import splits_sequences

# transformers' bucketing of relative positions (a pure function of positions and the config)
relative_position_bucket = _TransformersT5Attention._relative_position_bucket


def _clamp_half(hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' guard for float16 training: infinities clamped to the largest finite values."""
    if hidden_states.dtype != torch.float16:
        return hidden_states
    clamp_value = torch.where(torch.isinf(hidden_states).any(), torch.finfo(hidden_states.dtype).max - 1000,
                              torch.finfo(hidden_states.dtype).max)
    return torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)


def relative_position_bias(table: torch.Tensor, query_length: int, key_length: int, past: int, bidirectional: bool,
                           config: T5Config) -> torch.Tensor:
    """``(1, heads, query_length, key_length)``: T5's bias from a relative attention table ``(num_buckets,
    heads)`` (this rank's heads), the queries being the last ``query_length`` positions after ``past``."""
    device = table.device
    context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None] + past
    memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
    buckets = relative_position_bucket(
        memory_position - context_position,  # (query_length, key_length)
        bidirectional=bidirectional,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
    )
    return nn.functional.embedding(buckets, table).permute([2, 0, 1]).unsqueeze(0)  # (1, heads, q, k)


class T5LayerNorm(nn.Module):
    """RMS norm without bias or mean subtraction; the variance accumulates in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class T5DenseActDense(nn.Module):
    """``wo(dropout(act(wi(x))))``: ``wi`` column-, ``wo`` row-parallel (t5 v1.0's dense-relu)."""

    def __init__(self, config: T5Config, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.wi = ColumnParallelLinear(config.d_model, config.d_ff, bias=False, parallel_context=parallel_context)
        self.wo = RowParallelLinear(config.d_ff, config.d_model, bias=False, parallel_context=parallel_context)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = ACT2FN[config.dense_act_fn]
        self.rng = parallel_context.rng

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.act(self.wi(hidden_states))  # (B, T, d_ff_local)
        with self.rng.split():  # dropout on this rank's columns: masks distinct per rank
            hidden_states = self.dropout(hidden_states)
        if hidden_states.dtype != self.wo.weight.dtype:
            hidden_states = hidden_states.to(self.wo.weight.dtype)
        return self.wo(hidden_states)


class T5DenseGatedActDense(nn.Module):
    """``wo(dropout(act(wi_0(x)) * wi_1(x)))``: the gated feed-forward of t5 v1.1 (``gated-gelu``)."""

    def __init__(self, config: T5Config, parallel_context: ParallelContext) -> None:
        super().__init__()
        self.wi_0 = ColumnParallelLinear(config.d_model, config.d_ff, bias=False, parallel_context=parallel_context)
        self.wi_1 = ColumnParallelLinear(config.d_model, config.d_ff, bias=False, parallel_context=parallel_context)
        self.wo = RowParallelLinear(config.d_ff, config.d_model, bias=False, parallel_context=parallel_context)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = ACT2FN[config.dense_act_fn]
        self.rng = parallel_context.rng
        self.tensor_parallel_group = parallel_context.tensor_parallel_group
        self.sequence = None  # under sequence parallelism: see oslo.parallel.sequence

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # One copy into the tensor-parallel region for both input projections: one all-reduce backward (under
        # sequence parallelism one all-gather of the shards).
        shared = enter_tensor_parallel(hidden_states, self.tensor_parallel_group, self.sequence)
        hidden_gelu = self.act(self.wi_0(shared, input_is_copied=True))
        hidden_states = hidden_gelu * self.wi_1(shared, input_is_copied=True)  # (B, T, d_ff_local)
        with self.rng.split():
            hidden_states = self.dropout(hidden_states)
        if hidden_states.dtype != self.wo.weight.dtype:
            hidden_states = hidden_states.to(self.wo.weight.dtype)
        return self.wo(hidden_states)


class T5LayerFF(nn.Module):
    def __init__(self, config: T5Config, parallel_context: ParallelContext) -> None:
        super().__init__()
        dense = T5DenseGatedActDense if config.is_gated_act else T5DenseActDense
        self.DenseReluDense = dense(config, parallel_context)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.dropout(self.DenseReluDense(self.layer_norm(hidden_states)))


class T5Attention(nn.Module):
    """Self- or cross-attention over this rank's heads; unscaled scores plus the position bias.

    Args:
        config: The stack's config (``is_decoder`` set for the decoder's).
        has_relative_attention_bias: Whether this layer holds the stack's relative position table.
        cache_idx: Slot in the KV cache (the layer's position on its pipeline stage).
        is_causal: Self-attention of the decoder.
    """

    def __init__(self, config: T5Config, has_relative_attention_bias: bool, parallel_context: ParallelContext,
                 cache_idx: int = 0, is_causal: bool = False) -> None:
        super().__init__()
        self.config = config
        self.is_decoder = config.is_decoder
        self.is_causal = is_causal
        self.has_relative_attention_bias = has_relative_attention_bias
        self.key_value_proj_dim = config.d_kv
        self.n_heads = config.num_heads
        self.dropout = config.dropout_rate
        self.scaling = 1.0  # T5 folds the scaling into its initialization
        self.cache_idx = cache_idx
        self.rng = parallel_context.rng
        self.tensor_parallel_group = parallel_context.tensor_parallel_group
        self.sequence = None  # under sequence parallelism: see oslo.parallel.sequence
        inner = config.num_heads * config.d_kv
        self.q = ColumnParallelLinear(config.d_model, inner, bias=False, parallel_context=parallel_context)
        self.k = ColumnParallelLinear(config.d_model, inner, bias=False, parallel_context=parallel_context)
        self.v = ColumnParallelLinear(config.d_model, inner, bias=False, parallel_context=parallel_context)
        self.o = RowParallelLinear(inner, config.d_model, bias=False, parallel_context=parallel_context)
        if has_relative_attention_bias:
            self.relative_attention_bias = ColumnParallelEmbedding(
                config.relative_attention_num_buckets, config.num_heads, parallel_context=parallel_context)

    def _heads(self, layer: ColumnParallelLinear, states: torch.Tensor) -> torch.Tensor:
        batch, length, _ = states.shape
        return layer(states, input_is_copied=True).view(batch, length, -1, self.key_value_proj_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
        cache=None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``key_value_states``: the encoder's output, already copied into the tensor-parallel region
        (cross-attention). Returns this layer's output and the attention weights (all heads)."""
        shared = enter_tensor_parallel(hidden_states, self.tensor_parallel_group, self.sequence)
        batch, length, _ = shared.shape  # the whole sequence (gathered from the shards under sequence parallelism)
        query = self._heads(self.q, shared)  # (B, nh_local, T, d_kv)
        is_cross_attention = key_value_states is not None
        is_updated = False
        current_cache = cache
        if isinstance(cache, EncoderDecoderCache):
            is_updated = cache.is_updated.get(self.cache_idx)
            current_cache = cache.cross_attention_cache if is_cross_attention else cache.self_attention_cache
        if is_cross_attention and cache is not None and is_updated:  # the encoder's keys and values, kept
            key = current_cache.layers[self.cache_idx].keys
            value = current_cache.layers[self.cache_idx].values
        else:
            current = key_value_states if is_cross_attention else shared
            key, value = self._heads(self.k, current), self._heads(self.v, current)
            if cache is not None:
                key, value = current_cache.update(key, value, self.cache_idx)
                if is_cross_attention and isinstance(cache, EncoderDecoderCache):
                    cache.is_updated[self.cache_idx] = True

        dropout = self.dropout if self.training else 0.0
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        # Attention dropout acts on this rank's heads only: draw distinct masks per rank.
        with self.rng.split() if dropout > 0 else nullcontext():
            attn_output, attn_weights = attention(self, query, key, value, mask, dropout=dropout,
                                                  scaling=self.scaling, position_bias=position_bias)
        attn_output = self.o(attn_output.reshape(batch, length, -1).contiguous())
        if output_attentions and attn_weights is not None:
            attn_weights = gather_from_tensor_parallel(attn_weights, self.tensor_parallel_group, dim=1)
        return attn_output, attn_weights


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config: T5Config, has_relative_attention_bias: bool, parallel_context: ParallelContext,
                 cache_idx: int = 0) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(config, has_relative_attention_bias, parallel_context, cache_idx,
                                         is_causal=config.is_decoder)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, cache=None, output_attentions=False):
        attention_output, weights = self.SelfAttention(self.layer_norm(hidden_states), mask=attention_mask,
                                                       position_bias=position_bias, cache=cache,
                                                       output_attentions=output_attentions)
        return hidden_states + self.dropout(attention_output), weights


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config: T5Config, parallel_context: ParallelContext, cache_idx: int = 0) -> None:
        super().__init__()
        self.EncDecAttention = T5Attention(config, False, parallel_context, cache_idx, is_causal=False)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, key_value_states, attention_mask=None, position_bias=None, cache=None,
                output_attentions=False):
        attention_output, weights = self.EncDecAttention(
            self.layer_norm(hidden_states), mask=attention_mask, key_value_states=key_value_states,
            position_bias=position_bias, cache=cache, output_attentions=output_attentions)
        return hidden_states + self.dropout(attention_output), weights


class T5Block(GradientCheckpointingLayer):
    """Self-attention, cross-attention (decoder), feed-forward; each pre-norm with a residual."""

    def __init__(self, config: T5Config, has_relative_attention_bias: bool, parallel_context: ParallelContext,
                 cache_idx: int = 0) -> None:
        super().__init__()
        self.is_decoder = config.is_decoder
        self.layer = nn.ModuleList()
        self.layer.append(T5LayerSelfAttention(config, has_relative_attention_bias, parallel_context, cache_idx))
        if self.is_decoder:
            self.layer.append(T5LayerCrossAttention(config, parallel_context, cache_idx))
        self.layer.append(T5LayerFF(config, parallel_context))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        encoder_decoder_position_bias: torch.Tensor | None = None,
        cache=None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        hidden_states, self_weights = self.layer[0](hidden_states, attention_mask, position_bias, cache,
                                                    output_attentions)
        hidden_states = _clamp_half(hidden_states)
        cross_weights = None
        if self.is_decoder and encoder_hidden_states is not None:
            hidden_states, cross_weights = self.layer[1](hidden_states, encoder_hidden_states, encoder_attention_mask,
                                                         encoder_decoder_position_bias, cache, output_attentions)
            hidden_states = _clamp_half(hidden_states)
        hidden_states = _clamp_half(self.layer[-1](hidden_states))
        return hidden_states, self_weights, cross_weights


class T5Stack(nn.Module):
    """The encoder's or the decoder's blocks (this pipeline stage's), with what the stage holding its first
    block builds (``embed_tokens``, tied to ``shared``) and what the stage holding its last one builds
    (``final_layer_norm``). Run by the model (:class:`_T5Stacks`); calling the encoder's runs the encoder
    alone, as ``model.get_encoder()`` does."""

    main_input_name = "input_ids"  # what generate() reads

    def __init__(self, config: T5Config, parallel_context: ParallelContext, embed_tokens: nn.Module | None) -> None:
        super().__init__()
        self.config = config
        self.is_decoder = config.is_decoder
        self.embed_tokens = embed_tokens
        self.block = StageLayers.build(
            config.num_layers, lambda i: T5Block(config, i == 0, parallel_context, cache_idx=i))
        self.num_layers = config.num_layers
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)
        self._owner: weakref.ref | None = None  # the model that runs this stack (set by it)

    def held(self) -> list[int]:
        """The indices of this stage's blocks (of the virtual stage running, under an interleaved schedule)."""
        return self.block.indices()

    @property
    def starts_here(self) -> bool:
        """This stage holds the stack's first block."""
        return 0 in self.held()

    @property
    def ends_here(self) -> bool:
        """This stage holds the stack's last block."""
        return self.num_layers - 1 in self.held()

    def position_table(self) -> torch.Tensor:
        """The relative position table of the first block (this stage holds it)."""
        return local(self.block[0].layer[0].SelfAttention.relative_attention_bias.weight)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        """The encoder alone, as transformers' ``model.encoder(input_ids=...)`` (over the pipeline stages that
        hold it; its output on every stage): ``model.get_encoder()``'s call. The decoder is run by its model."""
        owner = self._owner() if self._owner is not None else None
        if self.is_decoder or owner is None:
            raise NotImplementedError(
                "T5's decoder stack is run by its model (its stages, cache and cross-attention): call the model "
                "with decoder_input_ids (and encoder_outputs= to skip the encoder)."
            )
        return owner.get_encoder()(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                   output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                                   return_dict=return_dict, **kwargs)


class T5PreTrainedModel(OsloPreTrainedModel):
    config_class = T5Config
    config: T5Config
    base_model_prefix = "transformer"
    _no_split_modules = ["T5Block"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _keep_in_fp32_modules = ["wo"]  # as transformers: float32 in a float16 model (T5 overflows float16 there)
    _supports_sdpa = True
    _supports_attention_backend = True
    _supports_pipeline_parallel = True
    _supports_sequence_parallel = True  # the blocks' norms and residual streams on sequence shards
    supports_gradient_checkpointing = True
    _keys_to_ignore_on_load_unexpected = [r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias"]
    _id_inputs = {"input_ids": "vocab_size", "inputs": "vocab_size", "decoder_input_ids": "vocab_size"}

    @classmethod
    def _validate_parallel_config(cls, config: T5Config, tensor_parallel_size: int) -> None:
        check_split_sizes(tensor_parallel_size, ("num_heads", config.num_heads), ("d_ff", config.d_ff))

    def _init_rule(self, module_name: str, module: nn.Module, param_name: str) -> tuple[str, float]:
        # transformers' T5 initialization (_init_weights), by module.
        factor, d_model = self.config.initializer_factor, self.config.d_model
        leaf = module_name.rpartition(".")[2]
        if isinstance(module, T5LayerNorm):
            return ("ones", 0.0)
        if param_name == "bias":
            return ("zeros", 0.0)
        if leaf in ("shared", "embed_tokens", "lm_head", "classifier"):
            return ("normal", factor * 1.0)
        if leaf == "q":
            return ("normal", factor * (d_model * self.config.d_kv) ** -0.5)
        if leaf == "o":
            return ("normal", factor * (self.config.num_heads * self.config.d_kv) ** -0.5)
        if leaf == "wo":
            return ("normal", factor * self.config.d_ff ** -0.5)
        return ("normal", factor * d_model ** -0.5)  # k, v, wi*, relative_attention_bias, heads' dense layers

    def _shift_right(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's inputs for ``input_ids`` (labels): shifted right after the start token, ``-100``
        replaced by the pad token, as transformers' T5 does."""
        start, pad = self.config.decoder_start_token_id, self.config.pad_token_id
        if start is None:
            raise ValueError("config.decoder_start_token_id has to be defined; in T5 it is usually the pad_token_id.")
        if pad is None:
            raise ValueError("config.pad_token_id has to be defined.")
        shifted = input_ids.new_zeros(input_ids.shape)
        shifted[..., 1:] = input_ids[..., :-1].clone()
        shifted[..., 0] = start
        return shifted.masked_fill_(shifted == -100, pad)

    def _decoder_inputs_from(self, input_ids, decoder_input_ids, decoder_inputs_embeds):
        """The decoder's input ids of the classification and question-answering heads: as given, else the
        encoder's input shifted right (transformers' T5 reads the input again)."""
        if decoder_input_ids is not None or decoder_inputs_embeds is not None:
            return decoder_input_ids
        if input_ids is None:
            raise ValueError("Pass input_ids, decoder_input_ids or decoder_inputs_embeds.")
        return self._shift_right(input_ids)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self._shift_right(labels)

    def _new_cache(self):
        """A cache of the decoder's layers (``num_decoder_layers``, as transformers' decoder stack counts them)."""
        return EncoderDecoderCache(DynamicCache(config=self._cache_config), DynamicCache(config=self._cache_config))


def _stack_configs(config: T5Config) -> tuple[T5Config, T5Config]:
    """The encoder's and the decoder's configs, as transformers derives them."""
    encoder_config = copy.deepcopy(config)
    encoder_config.is_decoder = False
    encoder_config.use_cache = False
    decoder_config = copy.deepcopy(config)
    decoder_config.is_decoder = True
    decoder_config.num_layers = config.num_decoder_layers
    return encoder_config, decoder_config


class _T5Stacks(StagedBody):
    """What runs T5's stacks stage by stage (see :mod:`oslo.models.body`), for the classes that hold
    ``encoder`` (and ``decoder``) themselves."""

    def builds_cache(self) -> bool:
        return self.decoder is not None

    def _build_stacks(self, config: T5Config, decoder: bool = True) -> None:
        context = self.parallel_context
        self.shared = VocabParallelEmbedding(config.vocab_size, config.d_model, parallel_context=context)
        encoder_config, decoder_config = _stack_configs(config)
        # What a new cache is built from: the decoder's config as a plain decoder's, whose get_text_config()
        # (each DynamicCache reads it) is the config itself: an encoder-decoder's is a deep copy made on every call.
        self._cache_config = copy.deepcopy(decoder_config)
        self._cache_config.is_encoder_decoder = False
        self.encoder = T5Stack(encoder_config, context, self.shared)
        self.encoder._owner = weakref.ref(self)
        # The decoder's embed_tokens is shared too; a stage where the decoder starts without the encoder's first
        # block keeps it as its copy of the tied weight.
        self.decoder = T5Stack(decoder_config, context, self.shared) if decoder else None

    def _stage_of_layer(self, layer: int) -> int:
        """The pipeline stage holding global layer ``layer`` (encoder's blocks, then the decoder's); the last
        stage for a layer past the model's."""
        ranges = self.pipeline_stages or [range(layer + 1)]
        return next((stage for stage, layers in enumerate(ranges) if layer in layers), len(ranges) - 1)

    @property
    def encoder_end_stage(self) -> int:
        """The pipeline stage holding the encoder's last block."""
        return self._stage_of_layer(self.config.num_layers - 1)

    @property
    def decoder_start_stage(self) -> int:
        """The pipeline stage holding the decoder's first block."""
        return self._stage_of_layer(self.config.num_layers)

    def get_input_embeddings(self) -> VocabParallelEmbedding | None:
        return self.shared

    def set_input_embeddings(self, new_embeddings: VocabParallelEmbedding) -> None:
        self.shared = new_embeddings
        self.encoder.embed_tokens = new_embeddings
        if self.decoder is not None and self.decoder.starts_here:
            self.decoder.embed_tokens = new_embeddings

    # ---- the body's steps (see oslo.models.body) -----------------------------------------------
    def _payload(self, **values) -> dict[str, torch.Tensor | None]:
        return {name: values.get(name) for name in self.stage_payload}

    def cached_positions(self, inputs: dict) -> int:
        if inputs.get("decoder_input_ids") is not None:
            return inputs["decoder_input_ids"].shape[-1]
        if inputs.get("decoder_inputs_embeds") is not None:
            return inputs["decoder_inputs_embeds"].shape[-2]
        return 0

    def first_pass_stage(self, inputs: dict, options: dict) -> int:
        # With the encoder's output given (generate()'s decoding steps), only the decoder's stages run.
        given = inputs.get("encoder_last_hidden_state") is not None or options.get("encoder_outputs") is not None
        return self.decoder_start_stage if given and self.decoder is not None else 0

    def prepare(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        encoder_last_hidden_state=None,
        cache=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        encoder_outputs=None,
        encoder_only: bool = False,
        **kwargs,
    ) -> BodyState:
        config = self.config
        if encoder_outputs is not None and encoder_last_hidden_state is None:
            encoder_last_hidden_state = encoder_outputs[0]
        output_attentions = output_attentions if output_attentions is not None else config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        device, dtype = self.device, self.dtype
        if encoder_last_hidden_state is None and (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds (the encoder's input).")
        encoder_embeds = stand_in_embeds(input_ids, inputs_embeds if encoder_last_hidden_state is None
                                         else encoder_last_hidden_state, dtype, device)
        encoder_mask = None
        if encoder_last_hidden_state is None:
            encoder_mask = create_bidirectional_mask(config=self.encoder.config, inputs_embeds=encoder_embeds,
                                                     attention_mask=attention_mask)
        decoder_fields = self.decoder is not None and not encoder_only
        state = BodyState(
            encoder_sharded=encoder_last_hidden_state is None and splits_sequences(self.parallel_context,
                                                                                   encoder_embeds.shape[1]),
            decoder_sharded=False,
            input_ids=input_ids, inputs_embeds=inputs_embeds, encoder_mask=encoder_mask,
            encoder_last_hidden_state=encoder_last_hidden_state, encoder_only=encoder_only or self.decoder is None,
            output_attentions=output_attentions, use_cache=False, cache=None,
            return_dict=return_dict if return_dict is not None else config.return_dict,
        )
        encoder_fields = ("encoder_hidden_states", "encoder_attentions") if decoder_fields else ("hidden_states",
                                                                                                 "attentions")
        state.encoder_fields = encoder_fields
        setattr(state, encoder_fields[0], () if output_hidden_states and encoder_last_hidden_state is None else None)
        setattr(state, encoder_fields[1], () if output_attentions and encoder_last_hidden_state is None else None)
        if not decoder_fields:
            state.cross_attentions = () if output_attentions else None  # empty, as transformers' encoder stack
            return state

        if (decoder_input_ids is None) == (decoder_inputs_embeds is None):
            raise ValueError(
                "Pass exactly one of decoder_input_ids or decoder_inputs_embeds (T5ForConditionalGeneration makes "
                "them from labels; T5Model needs them, e.g. model._shift_right(target_ids))."
            )
        use_cache = use_cache if use_cache is not None else self.decoder.config.use_cache
        if self.decoder.block and any(block.gradient_checkpointing for block in self.decoder.block) and self.training:
            use_cache = False  # the recomputation would add the keys and values a second time
        if use_cache and cache is None:
            cache = self._new_cache()
        adopt_cache(cache, self.parallel_context)
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        decoder_embeds = stand_in_embeds(decoder_input_ids, decoder_inputs_embeds, dtype, device)
        state.decoder_sharded = splits_sequences(self.parallel_context, decoder_embeds.shape[1])
        state.past_length = self_cache.get_seq_length() if self_cache is not None else 0
        state.decoder_input_ids, state.decoder_inputs_embeds = decoder_input_ids, decoder_inputs_embeds
        state.decoder_mask = create_causal_mask(self.decoder.config, decoder_embeds, decoder_attention_mask,
                                                self_cache)
        state.cross_mask = create_bidirectional_mask(config=self.decoder.config, inputs_embeds=decoder_embeds,
                                                     attention_mask=attention_mask,
                                                     encoder_hidden_states=encoder_embeds)
        state.cache, state.use_cache = cache, bool(use_cache)
        state.decoder_hidden_states = () if output_hidden_states else None
        state.decoder_attentions = () if output_attentions else None
        state.cross_attentions = () if output_attentions else None
        return state

    def embed(self, state: BodyState) -> dict[str, torch.Tensor | None]:
        if state.encoder_last_hidden_state is not None:  # the decoder alone: the encoder's output is given
            return self._payload(encoder_hidden_states=state.encoder_last_hidden_state)
        inputs_embeds = state.inputs_embeds if state.inputs_embeds is not None else self.encoder.embed_tokens(
            state.input_ids)
        hidden_states = self._shard(self.encoder.dropout(inputs_embeds), state.encoder_sharded)  # (B, T, d_model)
        return self._payload(hidden_states=hidden_states)

    # ---- sequence parallelism: each stack's blocks run on shards of its own sequence (StagedBody._layers_on) ---
    def _length(self, hidden_states: torch.Tensor, sharded: bool) -> int:
        """The whole sequence's length of ``hidden_states`` (a shard of it when ``sharded``)."""
        return hidden_states.shape[1] * (self.parallel_context.tensor_parallel_size if sharded else 1)

    def run_layers(self, payload: dict[str, torch.Tensor | None], state: BodyState) -> dict[str, torch.Tensor | None]:
        hidden_states, encoder_output = payload["hidden_states"], payload.get("encoder_hidden_states")
        encoder_table, decoder_table = payload.get("encoder_position_table"), payload.get("decoder_position_table")
        hidden_field, attentions_field = state.encoder_fields
        if encoder_output is None and len(self.encoder.block):
            table = encoder_table if encoder_table is not None else self.encoder.position_table()
            sharded = state.encoder_sharded
            length = self._length(hidden_states, sharded)
            position_bias = relative_position_bias(table, length, length, 0, True, self.config)  # (1, nh, T, T)
            with self._layers_on(sharded):
                for block in self.encoder.block:
                    if getattr(state, hidden_field) is not None:
                        setattr(state, hidden_field, getattr(state, hidden_field) + (self._whole(hidden_states,
                                                                                                  sharded),))
                    hidden_states, weights, _ = block(hidden_states, state.encoder_mask, position_bias,
                                                      output_attentions=state.output_attentions)
                    if getattr(state, attentions_field) is not None and weights is not None:
                        setattr(state, attentions_field, getattr(state, attentions_field) + (weights,))
            encoder_table = table
            if self.encoder.ends_here:  # the encoder's output whole: the decoder's cross-attentions read all of it
                hidden_states = self._whole(hidden_states, sharded)
                hidden_states = self.encoder.dropout(self.encoder.final_layer_norm(hidden_states))
                if getattr(state, hidden_field) is not None:
                    setattr(state, hidden_field, getattr(state, hidden_field) + (hidden_states,))
                encoder_table = None
                if not state.encoder_only:  # the decoder takes over
                    encoder_output, hidden_states = hidden_states, None
        if state.encoder_only or encoder_output is None or not len(self.decoder.block):
            return self._payload(hidden_states=hidden_states, encoder_hidden_states=encoder_output,
                                 encoder_position_table=encoder_table, decoder_position_table=decoder_table)

        sharded = state.decoder_sharded
        if self.decoder.starts_here:
            embeds = (state.decoder_inputs_embeds if state.decoder_inputs_embeds is not None
                      else self.decoder.embed_tokens(state.decoder_input_ids))
            hidden_states = self._shard(self.decoder.dropout(embeds), sharded)
        table = decoder_table if decoder_table is not None else self.decoder.position_table()
        length, past = self._length(hidden_states, sharded), state.past_length
        # The keys the self-attentions read: the past and this call's, or a fixed-size cache's every slot (a
        # StaticCache, generate(cache_implementation="static"); its unfilled slots are masked).
        key_length = past + length
        self_cache = state.cache.self_attention_cache if isinstance(state.cache, EncoderDecoderCache) else state.cache
        if self_cache is not None and len(self.decoder.block):
            first = next(iter(self.decoder.block)).layer[0].SelfAttention  # this stage's first decoder block
            key_length = self_cache.get_mask_sizes(length, first.cache_idx)[0]
        position_bias = relative_position_bias(table, length, key_length, past, False, self.config)
        heads = table.shape[1]
        cross_position_bias = torch.zeros((1, heads, length, encoder_output.shape[1]), device=hidden_states.device,
                                          dtype=hidden_states.dtype)
        # The encoder's output enters the tensor-parallel region once for all of this stage's cross-attentions.
        encoder_states = copy_to_tensor_parallel(encoder_output, self.parallel_context.tensor_parallel_group)
        with self._layers_on(sharded):
            for block in self.decoder.block:
                if state.decoder_hidden_states is not None:
                    state.decoder_hidden_states += (self._whole(hidden_states, sharded),)
                hidden_states, self_weights, cross_weights = block(
                    hidden_states, state.decoder_mask, position_bias, encoder_states, state.cross_mask,
                    cross_position_bias, cache=state.cache, output_attentions=state.output_attentions)
                if state.decoder_attentions is not None and self_weights is not None:
                    state.decoder_attentions += (self_weights,)
                if state.cross_attentions is not None and cross_weights is not None:
                    state.cross_attentions += (cross_weights,)
        return self._payload(hidden_states=hidden_states, encoder_hidden_states=encoder_output,
                             decoder_position_table=None if self.decoder.ends_here else table)

    def finish(self, payload: dict[str, torch.Tensor | None], state: BodyState):
        if state.encoder_only:
            return BaseModelOutputWithPastAndCrossAttentions(
                last_hidden_state=payload["hidden_states"], hidden_states=getattr(state, state.encoder_fields[0]),
                attentions=getattr(state, state.encoder_fields[1]), cross_attentions=state.cross_attentions)
        hidden_states = self._whole(payload["hidden_states"], state.decoder_sharded)
        hidden_states = self.decoder.dropout(self.decoder.final_layer_norm(hidden_states))
        if state.decoder_hidden_states is not None:
            state.decoder_hidden_states += (hidden_states,)
        return Seq2SeqModelOutput(
            last_hidden_state=hidden_states,
            **{CACHE_FIELD: state.cache if state.use_cache else None},
            decoder_hidden_states=state.decoder_hidden_states,
            decoder_attentions=state.decoder_attentions,
            cross_attentions=state.cross_attentions,
            encoder_last_hidden_state=payload["encoder_hidden_states"],
            encoder_hidden_states=state.encoder_hidden_states,
            encoder_attentions=state.encoder_attentions,
        )

    # ---- the encoder alone (generate() runs it once) -------------------------------------------
    def get_encoder(self, modality: str | None = None):
        """What transformers' ``generate()`` runs once before decoding: the encoder over the stages that hold
        it, its output returned on every stage (``encoder(input_ids=..., attention_mask=...)``)."""
        return _T5Encoder(self)

    def _encode(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs) -> BaseModelOutput:
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        options = dict(output_attentions=output_attentions, output_hidden_states=output_hidden_states)
        context = self.parallel_context

        def run(received):
            state = self.prepare(**inputs, **options, encoder_only=True)
            payload = self.run_layers(self.embed(state) if received is None else received, state)
            return state, payload

        if context.pipeline_parallel_size == 1:
            state, payload = run(None)
            output = BaseModelOutput(last_hidden_state=payload["hidden_states"],
                                     hidden_states=getattr(state, state.encoder_fields[0]),
                                     attentions=getattr(state, state.encoder_fields[1]))
            return output if return_dict is not False else output.to_tuple()
        states = {}

        def stage_forward(received, stage):
            with running_stage(self, stage):
                state, payload = run(received)
            states[stage] = state
            if stage == self.encoder_end_stage:
                return {"last_hidden_state": payload["hidden_states"]}
            return payload

        values = pipeline_pass(context, stage_forward, ["last_hidden_state"], payload=self.stage_payload,
                               last_stage=self.encoder_end_stage)
        link = StageLink(context)
        per_layer = {}
        for field, flag in zip(("hidden_states", "attentions"), (output_hidden_states, output_attentions),
                               strict=True):
            asked = flag if flag is not None else getattr(self.config, f"output_{field}")
            if asked:
                per_layer[field] = link.gather_stages({
                    stage: getattr(state, state.encoder_fields[field == "attentions"]) or ()
                    for stage, state in states.items()})
        output = BaseModelOutput(last_hidden_state=values["last_hidden_state"], **per_layer)
        return output if return_dict is not False else output.to_tuple()


class _T5Encoder:
    """``model.get_encoder()``: calling it runs T5's encoder over the stages that hold it (see
    :meth:`_T5Stacks._encode`); transformers' ``generate()`` reads ``forward``'s signature."""

    def __init__(self, model: _T5Stacks) -> None:
        self.model = model
        self.main_input_name = "input_ids"

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs) -> BaseModelOutput:
        # Other arguments are ignored, as transformers' T5Stack ignores them: generate() hands an encoder that
        # takes **kwargs every model argument it has (labels, for Seq2SeqTrainer's predict_with_generate).
        with self.model._user_call((), dict(input_ids=input_ids, attention_mask=attention_mask,
                                            inputs_embeds=inputs_embeds)):
            return self.model._encode(input_ids, attention_mask, inputs_embeds, output_attentions,
                                      output_hidden_states, return_dict)

    __call__ = forward


_SEQ2SEQ_PAYLOAD = ("hidden_states", "encoder_hidden_states", "encoder_position_table", "decoder_position_table")
_SEQ2SEQ_PER_LAYER = ("encoder_hidden_states", "encoder_attentions", "decoder_hidden_states", "decoder_attentions",
                      "cross_attentions")


class T5Model(_T5Stacks, T5PreTrainedModel):
    output_class = Seq2SeqModelOutput
    stage_payload = _SEQ2SEQ_PAYLOAD
    per_layer_outputs = _SEQ2SEQ_PER_LAYER
    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight",
                          "decoder.embed_tokens.weight": "shared.weight"}

    def __init__(self, config: T5Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self._build_stacks(config)
        self.post_init()

    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs=None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        encoder_last_hidden_state: torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput | tuple:
        """As transformers' ``T5Model.forward`` (under pipeline parallelism: one pass without gradients over
        every stage, whose output every stage returns)."""
        if encoder_outputs is not None:
            encoder_last_hidden_state = encoder_outputs[0]
        return self.run(self.prepare(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask, inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds, encoder_last_hidden_state=encoder_last_hidden_state,
            cache=cache, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=return_dict, **kwargs,
        ))


class T5EncoderModel(_T5Stacks, T5PreTrainedModel):
    output_class = BaseModelOutputWithPastAndCrossAttentions
    stage_payload = ("hidden_states", "encoder_position_table")
    per_layer_outputs = ("hidden_states", "attentions", "cross_attentions")  # the last always empty
    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight"}

    def __init__(self, config: T5Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self._build_stacks(config, decoder=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        """As transformers' ``T5EncoderModel.forward``."""
        kwargs.pop("use_cache", None)
        if kwargs.pop("cache", None) is not None:
            raise ValueError("T5's encoder keeps no KV cache: call it without cache=.")
        return self.run(self.prepare(
            input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            return_dict=return_dict, **kwargs,
        ))


class T5ForConditionalGeneration(Seq2SeqLMHead, _T5Stacks, T5PreTrainedModel, GenerationMixin):
    head_runs_stages = True
    _loss_in_logits_dtype = True  # transformers' nn.CrossEntropyLoss on the logits
    output_class = Seq2SeqModelOutput
    stage_payload = _SEQ2SEQ_PAYLOAD
    per_layer_outputs = _SEQ2SEQ_PER_LAYER
    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
        "lm_head.weight": "shared.weight",
    }

    def __init__(self, config: T5Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.model_dim = config.d_model
        self._build_stacks(config)
        self._build_lm_head(config)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """As transformers' (``generate()``), then a cache of the decoder's layers in place of the dynamic one it
        builds from the whole model's config, which holds ``num_layers`` (the encoder's): with more decoder
        layers than encoder layers, transformers' T5 fails there (an ``IndexError`` in the cache's update)."""
        given = model_kwargs.get(CACHE_FIELD) is not None
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_FIELD)
        if not given and type(cache) is EncoderDecoderCache and type(cache.self_attention_cache) is DynamicCache \
                and type(cache.cross_attention_cache) is DynamicCache:
            model_kwargs[CACHE_FIELD] = self._new_cache()
        return result

    def _lm_features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if getattr(self.config, "scale_decoder_outputs", self.config.tie_word_embeddings):
            hidden_states = hidden_states * (self.model_dim**-0.5)
        return hidden_states


class T5ClassificationHead(nn.Module):
    """Sentence-level classification: dropout, dense, tanh, dropout, projection (replicated; small)."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.dropout = nn.Dropout(p=config.classifier_dropout)
        self.out_proj = nn.Linear(config.d_model, config.num_labels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = torch.tanh(self.dense(self.dropout(hidden_states)))
        return self.out_proj(self.dropout(hidden_states))


class T5ForSequenceClassification(SequenceClassificationHead, T5PreTrainedModel):
    """Pools each sequence at its last EOS token of the decoder's output (the decoder reads the input
    shifted right), as transformers' T5 does."""

    _keys_to_ignore_on_load_unexpected = [r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias"]
    _sequence_pooling = "eos"
    _sequence_classifier = "classification_head"
    _sequence_classification_output_class = Seq2SeqSequenceClassifierOutput

    def __init__(self, config: T5Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = T5Model(config, self.parallel_context)
        self.num_labels = config.num_labels
        self.classification_head = T5ClassificationHead(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs=None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> Seq2SeqSequenceClassifierOutput | tuple:
        """As transformers' ``T5ForSequenceClassification.forward``."""
        if labels is not None:
            use_cache = False
        if input_ids is None and inputs_embeds is not None:
            raise NotImplementedError(f"Passing input embeddings is not supported for {type(self).__name__} (as "
                                      "in transformers): it finds the EOS tokens in input_ids.")
        decoder_input_ids = self._decoder_inputs_from(input_ids, decoder_input_ids, decoder_inputs_embeds)
        return self._classify_sequences(
            seq2seq_body_inputs(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, inputs_embeds,
                                decoder_inputs_embeds, encoder_outputs),
            labels, use_cache=use_cache, return_dict=return_dict, **kwargs)


class T5ForTokenClassification(TokenClassificationHead, T5PreTrainedModel):
    def __init__(self, config: T5Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.transformer = T5EncoderModel(config, self.parallel_context)
        self._build_token_classification_head(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> TokenClassifierOutput | tuple:
        """As transformers' ``T5ForTokenClassification.forward``."""
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        return self._classify_tokens(inputs, labels, return_dict=return_dict, **kwargs)


class T5ForQuestionAnswering(QuestionAnsweringHead, _T5Stacks, T5PreTrainedModel):
    """Start and end logits from the decoder's output (the decoder reads the input shifted right)."""

    head_runs_stages = True
    output_class = Seq2SeqModelOutput
    stage_payload = _SEQ2SEQ_PAYLOAD
    per_layer_outputs = _SEQ2SEQ_PER_LAYER
    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight",
                          "decoder.embed_tokens.weight": "shared.weight"}

    def __init__(self, config: T5Config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.model_dim = config.d_model
        self._build_stacks(config)
        self.num_labels = config.num_labels
        self.qa_outputs = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs=None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> Seq2SeqQuestionAnsweringModelOutput | tuple:
        """As transformers' ``T5ForQuestionAnswering.forward``."""
        decoder_input_ids = self._decoder_inputs_from(input_ids, decoder_input_ids, decoder_inputs_embeds)
        return self._answer_questions(
            seq2seq_body_inputs(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, inputs_embeds,
                                decoder_inputs_embeds, encoder_outputs),
            start_positions, end_positions, return_dict=return_dict,
            output_class=Seq2SeqQuestionAnsweringModelOutput, **kwargs)


__all__ = [
    "T5Attention",
    "T5Block",
    "T5DenseActDense",
    "T5DenseGatedActDense",
    "T5EncoderModel",
    "T5ForConditionalGeneration",
    "T5ForQuestionAnswering",
    "T5ForSequenceClassification",
    "T5ForTokenClassification",
    "T5LayerFF",
    "T5LayerNorm",
    "T5Model",
    "T5PreTrainedModel",
    "T5Stack",
]
