"""Llama, tensor-parallel, with every head transformers offers for it; the blocks of the whole Llama family.

Reads like transformers' single-device Llama, with Hugging Face parameter names and layouts. RMSNorm,
rotary positions, grouped-query attention and a SwiGLU MLP. Qwen2 (``qwen2.py``) and Mistral
(``mistral.py``) are declarations over these classes: what differs between the three is said by the
``...PreTrainedModel`` class (:meth:`LlamaPreTrainedModel._projection_biases`,
:meth:`LlamaPreTrainedModel._layer_types`), which the blocks read.

Tensor parallelism: each rank holds ``num_attention_heads / tp`` query heads. Key/value heads are split
the same way when ``tp`` divides ``num_key_value_heads``; when it does not (fewer key/value heads than
ranks), ``k_proj`` and ``v_proj`` are replicated on every rank, each rank projects the key/value heads its
query heads read, and their gradients are summed over the group in backward. Every block does two
all-reduces forward (after ``o_proj`` and ``down_proj``) and two backward (before the attention's and the
MLP's input projections), plus, with replicated key/value projections, one per replicated weight backward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm as _TransformersLlamaRMSNorm
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from oslo.models.base import OsloPreTrainedModel, check_split_sizes
from oslo.models.body import FULL_ATTENTION, SLIDING_ATTENTION, BodyState, DecoderBody
from oslo.models.compat import CACHE_FIELD, accepts_legacy_cache_name
from oslo.models.heads import (
    CausalLMHead,
    QuestionAnsweringHead,
    SequenceClassificationHead,
    TokenClassificationHead,
)
from oslo.parallel.context import ParallelContext
from oslo.parallel.dtensor import local
from oslo.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from oslo.parallel.mappings import copy_to_tensor_parallel, enter_tensor_parallel, gather_from_tensor_parallel
from oslo.parallel.pipeline import StageLayers


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over this rank's query heads, rotary positions on queries and keys."""

    def __init__(self, config, layer_idx: int, parallel_context: ParallelContext,
                 *, family: type[LlamaPreTrainedModel]) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        # Slot in the KV cache: a later pipeline stage's cache holds only its own layers, from slot 0.
        self.cache_idx = layer_idx  # its slot in the stage's KV cache (StageLayers.keep renumbers it)
        self.head_dim = _head_dim(config)
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        layer_type = family._layer_types(config)[layer_idx]
        self.sliding_window = config.sliding_window if layer_type == SLIDING_ATTENTION else None
        self.rng = parallel_context.rng
        self.tensor_parallel_group = parallel_context.tensor_parallel_group
        self.sequence = None  # sequence parallelism's state, when on (see oslo.parallel.sequence)
        qkv_bias, o_bias = family._projection_biases(config)
        heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        tp, rank = parallel_context.tensor_parallel_size, parallel_context.tensor_parallel_rank

        self.q_proj = ColumnParallelLinear(hidden, heads * self.head_dim, qkv_bias, parallel_context=parallel_context)
        self.kv_split = kv_heads % tp == 0
        if self.kv_split:  # this rank's key/value heads, which its query heads read
            self.k_proj = ColumnParallelLinear(hidden, kv_heads * self.head_dim, qkv_bias,
                                               parallel_context=parallel_context)
            self.v_proj = ColumnParallelLinear(hidden, kv_heads * self.head_dim, qkv_bias,
                                               parallel_context=parallel_context)
            self.num_key_value_groups = heads // kv_heads
        else:  # replicated; this rank projects the key/value heads its query heads read
            self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
            self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
            # Each rank reads part of their output: the gradients of what computes it are summed over the group.
            self.k_proj.output_read_in_part = self.v_proj.output_read_in_part = True
            local_heads, group = heads // tp, heads // kv_heads
            self.kv_reads = [(rank * local_heads + j) // group for j in range(local_heads)]  # of each query head
            self.kv_rows = slice(self.kv_reads[0] * self.head_dim, (self.kv_reads[-1] + 1) * self.head_dim)
            self.register_buffer("kv_index", self._kv_index(), persistent=False)
            self.num_key_value_groups = 1  # keys and values are expanded to the query heads here
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, o_bias, parallel_context=parallel_context)

    def _kv_index(self) -> torch.Tensor:
        """Each local query head's key/value head among the ones this rank projects."""
        return torch.tensor([read - self.kv_reads[0] for read in self.kv_reads])

    def _replicated_projection(self, projection: nn.Module, shared: torch.Tensor) -> torch.Tensor:
        if hasattr(projection, "get_base_layer"):
            # Wrapped by a PEFT adapter (which sees output_read_in_part): its forward projects every key/value head
            # and sums its gradients over the group itself; this rank keeps the rows of the heads it reads.
            return projection(shared)[..., self.kv_rows]
        # The whole weight enters the group (its gradient, from this rank's heads only, is summed over the
        # ranks), then this rank keeps the rows of the heads it reads.
        weight = copy_to_tensor_parallel(local(projection.weight), self.tensor_parallel_group)[self.kv_rows]
        bias = projection.bias
        if bias is not None:
            bias = copy_to_tensor_parallel(local(bias), self.tensor_parallel_group)[self.kv_rows]
        return F.linear(shared, weight, bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # One entry into the tensor-parallel region for q, k and v: one collective backward, not three.
        shared = enter_tensor_parallel(hidden_states, self.tensor_parallel_group, self.sequence)
        batch, length, _ = shared.shape  # the whole sequence (gathered under sequence parallelism)
        hidden_shape = (batch, length, -1, self.head_dim)
        query = self.q_proj(shared, input_is_copied=True).view(hidden_shape).transpose(1, 2)  # (B, nh_local, T, hd)
        if self.kv_split:
            key, value = self.k_proj(shared, input_is_copied=True), self.v_proj(shared, input_is_copied=True)
        else:
            key, value = (self._replicated_projection(self.k_proj, shared),
                          self._replicated_projection(self.v_proj, shared))
        key = key.view(hidden_shape).transpose(1, 2)  # (B, kv_local, T, hd)
        value = value.view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.cache_idx)
        if not self.kv_split:
            key, value = key.index_select(1, self.kv_index), value.index_select(1, self.kv_index)

        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        dropout = self.attention_dropout if self.training else 0.0
        # Attention dropout acts on this rank's heads only: draw distinct masks per rank.
        with self.rng.split() if dropout > 0 else nullcontext():
            attn_output, attn_weights = attention(
                self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
                sliding_window=self.sliding_window, **kwargs,
            )
        attn_output = attn_output.reshape(batch, length, -1).contiguous()  # (B, T, nh_local * hd)
        if output_attentions and attn_weights is not None:
            attn_weights = gather_from_tensor_parallel(attn_weights, self.tensor_parallel_group, dim=1)
        return self.o_proj(attn_output), attn_weights


def _takes_fused_rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a fused RMSNorm runs torch's ``F.rms_norm``: on CUDA (torch's fused kernels there, where
    transformers' expression launches seven and saves its float32 intermediates), for one dtype. Elsewhere,
    and where the input's dtype is not the weight's (transformers then promotes), transformers' expression."""
    return hidden_states.is_cuda and hidden_states.dtype == weight.dtype


class LlamaRMSNorm(_TransformersLlamaRMSNorm):
    """transformers' ``LlamaRMSNorm`` (same weight, same math); after ``fuse()`` torch's one-kernel
    ``F.rms_norm`` where :func:`_takes_fused_rms_norm` says so. In float32 both compute the same; in bfloat16 and
    float16 torch rounds once where transformers rounds before multiplying by the weight (1 ulp apart)."""

    fused = False

    def fuse(self) -> None:
        self.fused = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.fused and _takes_fused_rms_norm(hidden_states, self.weight):
            return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))``, gate and up column-parallel, down row-parallel."""

    def __init__(self, config, parallel_context: ParallelContext, *, family: type[LlamaPreTrainedModel]) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, family._mlp_bias(config)
        self.tensor_parallel_group = parallel_context.tensor_parallel_group
        self.sequence = None  # sequence parallelism's state, when on (see oslo.parallel.sequence)
        self.gate_proj = ColumnParallelLinear(hidden, inner, bias, parallel_context=parallel_context)
        self.up_proj = ColumnParallelLinear(hidden, inner, bias, parallel_context=parallel_context)
        self.down_proj = RowParallelLinear(inner, hidden, bias, parallel_context=parallel_context)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # One entry into the tensor-parallel region for gate and up: one collective backward, not two.
        shared = enter_tensor_parallel(hidden_states, self.tensor_parallel_group, self.sequence)
        gate = self.gate_proj(shared, input_is_copied=True)
        return self.down_proj(self.act_fn(gate) * self.up_proj(shared, input_is_copied=True))


class LlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx: int, parallel_context: ParallelContext,
                 *, family: type[LlamaPreTrainedModel]) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # the model's numbering: which kind of attention (config.layer_types)
        self.self_attn = LlamaAttention(config, layer_idx, parallel_context, family=family)
        self.mlp = LlamaMLP(config, parallel_context, family=family)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, output_attentions=False,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_output, attn_weights = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask=attention_mask, cache=cache,
            output_attentions=output_attentions, **kwargs,
        )
        hidden_states = hidden_states + attn_output
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, attn_weights


class LlamaPreTrainedModel(OsloPreTrainedModel):
    """The Llama family's declarations; Qwen2 and Mistral override the three hooks below."""

    config_class = LlamaConfig
    config: LlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ["LlamaDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]
    _supports_sdpa = True
    _supports_attention_backend = True
    _supports_pipeline_parallel = True
    _supports_sequence_parallel = True
    supports_gradient_checkpointing = True

    @staticmethod
    def _projection_biases(config) -> tuple[bool, bool]:
        """Whether (q/k/v, o) projections have a bias."""
        return config.attention_bias, config.attention_bias

    @staticmethod
    def _mlp_bias(config) -> bool:
        return config.mlp_bias

    def _stage_layer_types(self) -> list[str] | None:
        """The kind of attention of each slot of this pipeline stage's KV cache (its layers from slot 0, see
        ``StageLayers.keep``) when that differs from the whole model's (pipelines over both full and sliding-window
        layers); else ``None``."""
        types = self._layer_types(self.config)
        if self.parallel_context.pipeline_parallel_size == 1 or len(set(types)) == 1:
            return None
        slots = sorted({(m.cache_idx, m.layer_idx) for m in self.modules() if isinstance(m, LlamaAttention)})
        return [types[layer] for _, layer in slots]

    def _new_cache(self) -> Cache:
        """A fresh KV cache for this pipeline stage, each slot of its layer's kind."""
        types = self._stage_layer_types()
        if types is None:
            return super()._new_cache()
        config = copy.copy(self.config)
        config.layer_types, config.num_hidden_layers = types, len(types)
        return DynamicCache(config=config)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """As transformers' (``generate()``), then this stage's own cache in place of the one built from the whole
        model's config, when their slots' kinds differ (see :meth:`_new_cache`)."""
        given = model_kwargs.get(CACHE_FIELD) is not None
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if not given and type(model_kwargs.get(CACHE_FIELD)) is DynamicCache and self._stage_layer_types():
            model_kwargs[CACHE_FIELD] = self._new_cache()
        return result

    @staticmethod
    def _layer_types(config) -> list[str]:
        """Each layer's attention: ``"full_attention"`` or ``"sliding_attention"`` (``config.sliding_window``)."""
        return [FULL_ATTENTION] * config.num_hidden_layers

    @classmethod
    def _validate_parallel_config(cls, config, tensor_parallel_size: int) -> None:
        check_split_sizes(tensor_parallel_size, ("num_attention_heads", config.num_attention_heads),
                          ("intermediate_size", config.intermediate_size))
        if config.num_attention_heads % config.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={config.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={config.num_key_value_heads}: every key/value head serves as many query heads."
            )

    def _init_std(self, module_name: str) -> float:
        return self.config.initializer_range

    def _init_buffers(self, module: nn.Module) -> None:
        if isinstance(module, LlamaRotaryEmbedding):  # the meta-device build left the frequencies unset
            compute = (module.compute_default_rope_parameters if module.rope_type == "default"
                       else ROPE_INIT_FUNCTIONS[module.rope_type])
            inv_freq, _ = compute(module.config, device=module.inv_freq.device)
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq.copy_(inv_freq)
        elif isinstance(module, LlamaAttention) and not module.kv_split:
            module.kv_index.copy_(module._kv_index())


class LlamaModel(DecoderBody, LlamaPreTrainedModel):
    output_class = BaseModelOutputWithPast
    layers_attribute, norm_attribute = "layers", "norm"
    cache_only_with_use_cache = False  # transformers' Llama returns the cache it was given either way

    def __init__(self, config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        context = self.parallel_context
        family = type(self)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.padding_idx,
                                                   parallel_context=context)
        self.layers = StageLayers.build(config.num_hidden_layers,
                                        lambda i: LlamaDecoderLayer(config, i, context, family=family))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.layer_types = family._layer_types(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.embed_tokens

    def set_input_embeddings(self, new_embeddings: VocabParallelEmbedding) -> None:
        self.embed_tokens = new_embeddings

    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        """As transformers' ``LlamaModel.forward`` (under pipeline parallelism: one pass without
        gradients over every stage, whose output every stage returns)."""
        return self.run(self.prepare(
            input_ids=input_ids, cache=cache, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=return_dict, **kwargs,
        ))

    def embed_inputs(self, state: BodyState) -> dict[str, torch.Tensor]:
        hidden_states = state.inputs_embeds if state.inputs_embeds is not None else self.embed_tokens(state.input_ids)
        return {"hidden_states": hidden_states}

    def layer_inputs(self, hidden_states: torch.Tensor, state: BodyState) -> dict:
        return {"position_embeddings": self.rotary_emb(hidden_states, state.position_ids), **state.kwargs}


# The heads' forwards take their arguments in the order of transformers' Llama classes (input_ids, attention_mask,
# position_ids, cache, inputs_embeds, targets, ...), which differs from GPT2's the shared heads follow.


class LlamaForCausalLM(CausalLMHead, LlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _lm_output_class = CausalLMOutputWithPast
    _body_class = LlamaModel

    def __init__(self, config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.model = self._body_class(config, self.parallel_context)
        self._build_lm_head(config)
        self.post_init()

    @accepts_legacy_cache_name
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        """As transformers' ``LlamaForCausalLM.forward``; see :class:`~oslo.models.heads.CausalLMHead`."""
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                               logits_to_keep=logits_to_keep, **kwargs)


class LlamaForSequenceClassification(SequenceClassificationHead, LlamaPreTrainedModel):
    _body_class = LlamaModel

    def __init__(self, config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.model = self._body_class(config, self.parallel_context)
        self._build_sequence_classification_head(config)
        self.post_init()

    @accepts_legacy_cache_name
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, **kwargs):
        """As transformers' ``LlamaForSequenceClassification.forward``."""
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, **kwargs)


class LlamaForTokenClassification(TokenClassificationHead, LlamaPreTrainedModel):
    _token_classifier = "score"
    _token_loss_in_float32 = True
    _body_class = LlamaModel

    def __init__(self, config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        self.model = self._body_class(config, self.parallel_context)
        self._build_token_classification_head(config)
        self.post_init()

    @accepts_legacy_cache_name
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, **kwargs):
        """As transformers' ``LlamaForTokenClassification.forward``."""
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, **kwargs)


class LlamaForQuestionAnswering(QuestionAnsweringHead, LlamaPreTrainedModel):
    base_model_prefix = "transformer"  # as transformers names it for these heads
    _body_class = LlamaModel

    def __init__(self, config, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config, parallel_context)
        setattr(self, self.base_model_prefix, self._body_class(config, self.parallel_context))
        self._build_question_answering_head(config)
        self.post_init()

    @accepts_legacy_cache_name
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                start_positions=None, end_positions=None, **kwargs):
        """As transformers' ``LlamaForQuestionAnswering.forward`` (a ``cache`` given is read and filled; the output
        has no field for it)."""
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, start_positions=start_positions,
                               end_positions=end_positions, **kwargs)


__all__ = [
    "LlamaAttention",
    "LlamaMLP",
    "LlamaDecoderLayer",
    "LlamaPreTrainedModel",
    "LlamaModel",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaForTokenClassification",
    "LlamaForQuestionAnswering",
]
