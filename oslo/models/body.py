"""How a model body (the transformer without a head) runs: whole, or one pipeline stage at a time.

A body declares four steps, and its ``forward`` is their composition, readable as single-device code:

.. code-block:: python

    def forward(self, input_ids=None, attention_mask=None, ...):
        state = self.prepare(input_ids=input_ids, attention_mask=attention_mask, ...)
        return self.run(state)  # finish(run_layers(embed(state), state), state)

* ``prepare(**inputs)`` turns the batch inputs into a :class:`BodyState`: what every stage rebuilds
  from the inputs alone (defaults resolved, masks, position ids, the cache, the per-layer output
  tuples to fill). It never reads the embeddings' output.
* ``embed(state)`` (first stage) returns the payload, the named tensors that flow through the layers
  (``{"hidden_states": ...}``; an encoder-decoder carries more than one).
* ``run_layers(payload, state)`` runs this stage's layers (a :class:`~oslo.parallel.pipeline.StageLayers`
  holds only them) and fills the per-layer outputs in ``state``.
* ``finish(payload, state)`` (last stage) applies what follows the layers and returns the body's
  ``ModelOutput``.

The pipeline runner (:func:`~oslo.models.runner.forward_with_head`), not the model,
knows stages: it calls ``prepare`` on every stage, ``embed`` on the first, passes the payload between
stages, and calls ``finish`` and the head on the last. Nothing in a model file mentions stages: it builds
the whole model, its layers in a ``StageLayers``, and each stage keeps its part (:mod:`oslo.models.stages`).

The decoder-only bodies (GPT2, GPT-Neo, the Llama family) share their steps: :class:`DecoderBody` writes
``prepare``, ``run_layers`` and ``finish`` once, and a model file declares where its layers and final norm live,
writes ``embed_inputs`` and says what its layers take (:meth:`DecoderBody.layer_inputs`); GPT2 and GPT-Neo, whose
transformers classes take the same arguments, share all of that in :class:`LearnedPositions`. BERT and T5 write
their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, ModelOutput

from oslo.kernels.bias_dropout_add import adds_residual
from oslo.models.compat import (
    CACHE_FIELD,
    accepts_legacy_cache_name,
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from oslo.parallel.context import SequenceSharding
from oslo.parallel.layers import VocabParallelEmbedding
from oslo.parallel.mappings import gather_from_tensor_parallel, keep_sequence_shards, scatter_to_tensor_parallel
from oslo.parallel.pipeline import StageLayers
from oslo.parallel.sequence import splits_sequences

__all__ = ["BodyState", "DecoderBody", "LearnedPositions", "StagedBody", "stand_in_embeds"]

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # transformers' config.layer_types


class BodyState:
    """Everything a body's steps share for one call (or one pipeline stage's part of it). The per-layer
    outputs are attributes named like the output fields (``hidden_states``, ``attentions``): a tuple
    when asked for, else ``None``.

    A plain class (not ``types.SimpleNamespace``, whose C constructor ``torch.compile`` cannot trace), so
    that a compiled model call builds it inside its graph."""

    def __init__(self, **fields) -> None:
        for name, value in fields.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        return f"BodyState({', '.join(f'{name}={value!r}' for name, value in vars(self).items())})"


class StagedBody:
    """Mixin of a body class: the steps the pipeline runner calls, and what it needs to know.

    Attributes:
        output_class: The ``ModelOutput`` that ``finish`` returns.
        stage_payload: Names of the tensors one stage passes the next.
        per_layer_outputs: Output fields that the layers fill stage by stage (gathered in stage order
            when a pipelined call asks for them).
        head_runs_stages: The class is a head over itself (its forward runs the stages through the head).
    """

    output_class: type[ModelOutput] = BaseModelOutputWithPastAndCrossAttentions
    # A class that is its own body and has a head (T5ForConditionalGeneration holds the stacks itself): its
    # forward runs the stages through the head; a plain body's call is one pass over the stages.
    head_runs_stages: bool = False
    stage_payload: tuple[str, ...] = ("hidden_states",)
    per_layer_outputs: tuple[str, ...] = ("hidden_states", "attentions")

    def builds_cache(self) -> bool:
        """Whether a no-gradient call of this body keeps keys and values for later steps (decoders do;
        an encoder does not, as transformers' BERT caches only with ``is_decoder``)."""
        return True

    def first_pass_stage(self, inputs: dict, options: dict) -> int:
        """The first pipeline stage a no-gradient pass of these inputs runs (0: all; an encoder-decoder given
        the encoder's output starts where the decoder does). Its ``embed`` gets the first payload."""
        return 0

    def cached_positions(self, inputs: dict) -> int:
        """How many positions a call with ``inputs`` adds to its KV cache: the input sequence's length (an
        encoder-decoder's override: the decoder's)."""
        if inputs.get("input_ids") is not None:
            return inputs["input_ids"].shape[-1]
        if inputs.get("inputs_embeds") is not None:
            return inputs["inputs_embeds"].shape[-2]
        return 0

    def prepare(self, **inputs) -> BodyState:
        raise NotImplementedError

    def embed(self, state: BodyState) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def run_layers(self, payload: dict[str, torch.Tensor], state: BodyState) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def finish(self, payload: dict[str, torch.Tensor], state: BodyState) -> ModelOutput:
        raise NotImplementedError

    def run(self, state: BodyState):
        """The whole body on one stage: ``finish(run_layers(embed(state), state), state)``, as a tuple
        when ``state.return_dict`` is false."""
        output = self.finish(self.run_layers(self.embed(state), state), state)
        return output if state.return_dict else output.to_tuple()

    # ---- sequence parallelism (oslo.parallel.sequence): the layers run on shards of the sequence ------------
    def _shard(self, hidden_states: torch.Tensor, sharded: bool) -> torch.Tensor:
        """This rank's shard of ``hidden_states`` along the sequence when the call's sequence is ``sharded``."""
        if not sharded:
            return hidden_states
        return scatter_to_tensor_parallel(hidden_states, self.parallel_context.tensor_parallel_group,
                                          SequenceSharding.dim)

    def _whole(self, hidden_states: torch.Tensor, sharded: bool) -> torch.Tensor:
        """``hidden_states`` with the whole sequence (gathered from the ranks' shards when ``sharded``)."""
        if not sharded:
            return hidden_states
        return gather_from_tensor_parallel(hidden_states, self.parallel_context.tensor_parallel_group,
                                           SequenceSharding.dim)

    @contextlib.contextmanager
    def _layers_on(self, sharded: bool) -> Iterator[None]:
        """Run layers on shards of the sequence (their gathered inputs kept as shards for the backward and
        gathered again there), or whole in a call that is not split (see ``SequenceSharding``)."""
        sequence = self.parallel_context.sequence
        if sequence.enabled:
            sequence.suspended = not sharded
        try:
            with keep_sequence_shards() if sharded else contextlib.nullcontext():
                yield
        finally:
            if sequence.enabled:
                sequence.suspended = False  # a recomputation in the backward (activation checkpointing) is split


def adopt_cache(cache, context) -> None:
    """Check the KV cache a call was given (``past_key_values``) and mark it as this model's.

    With several tensor-parallel ranks each rank caches only its own heads, and with pipelines each stage only its
    own layers (from slot 0): a cache this model did not fill (built by PEFT's prefix tuning, or taken from a
    transformers model's output) holds every head of every layer, and reading it would fail on a shape or, on a
    later stage, silently read another layer's entries. Such a cache, not empty, raises ``NotImplementedError`` (on
    every rank: each holds the same); an empty one (``DynamicCache()``, the one ``generate()`` or the call itself
    makes) is adopted, and so is every cache in one process, where it is transformers' own layout."""
    if cache is None or getattr(cache, "_oslo_filled", False):
        return
    tp, pp = context.tensor_parallel_size, context.pipeline_parallel_size
    if tp * pp > 1 and cache.get_seq_length() > 0:
        raise NotImplementedError(
            f"past_key_values holds {cache.get_seq_length()} positions this model did not cache (a cache built "
            "outside it, e.g. by PEFT's prefix tuning or from a transformers model's output). At "
            f"tensor_parallel_size={tp}, pipeline_parallel_size={pp} each rank caches only its own attention heads "
            "of its own stage's layers, so such a cache cannot be read. Pass the past_key_values of this model's own "
            "output (or none); to tune prompts at this layout use PEFT's prompt tuning or LoRA. Prefix tuning works "
            "in one process.")
    cache._oslo_filled = True


def stand_in_embeds(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """What transformers' mask builders read from ``inputs_embeds`` (batch, length, dtype, device),
    without the embeddings: every stage builds its masks from the inputs alone."""
    if inputs_embeds is not None:
        return inputs_embeds
    return torch.empty((*input_ids.shape[:2], 0), dtype=dtype, device=device)


class DecoderBody(StagedBody):
    """The body of a decoder-only model (GPT2, GPT-Neo, the Llama family): embeddings, a stack of layers, a final
    norm. The steps are written once here; a model declares where its parts live and what differs:

    Attributes:
        layers_attribute: The attribute holding the layers (a :class:`~oslo.parallel.pipeline.StageLayers`).
        norm_attribute: The attribute holding the final norm (built on the last pipeline stage).
        embeds_token_types: ``token_type_ids`` go through the token embedding (GPT2, GPT-Neo); without it a call
            that passes them raises.
        flattens_leading_dims: Inputs with more than one leading dimension are flattened to ``(-1, length)`` and
            the hidden states reshaped back (transformers' GPT2), the attention mask viewed as ``(batch, -1)``.
        cache_only_with_use_cache: The output holds the cache only when the call used it (GPT2, Qwen2, Mistral);
            else whatever cache the call had (GPT-Neo and Llama), each as its transformers class.

    A model writes ``embed_inputs`` (its embeddings: the first payload) and :meth:`layer_inputs` (what every layer
    takes besides the hidden states, the mask, the cache and ``output_attentions``), and, with layers of both kinds
    of attention, a ``layer_types`` list (``"full_attention"`` / ``"sliding_attention"``, one per layer of the
    model).

    Under sequence parallelism (:mod:`oslo.parallel.sequence`) the payload between the embeddings and the final
    norm is this rank's shard of the sequence: ``embed`` splits it, ``finish`` gathers the norm's output, and the
    per-layer hidden states are gathered as they are recorded. A call without gradients whose length the
    tensor-parallel size does not divide (a decoding step) runs whole instead.
    """

    layers_attribute: str = "layers"
    norm_attribute: str = "norm"
    embeds_token_types: bool = False
    flattens_leading_dims: bool = False
    cache_only_with_use_cache: bool = True
    layer_types: list[str] | None = None

    def embed_inputs(self, state: BodyState) -> dict[str, torch.Tensor]:
        """The embeddings of the call's inputs: the first payload (whole sequences)."""
        raise NotImplementedError

    def embed(self, state: BodyState) -> dict[str, torch.Tensor]:
        payload = self.embed_inputs(state)
        # this rank's shard of the sequence from here to the final norm
        return {**payload, "hidden_states": self._shard(payload["hidden_states"], state.sequence_sharded)}

    def layer_inputs(self, hidden_states: torch.Tensor, state: BodyState) -> dict:
        """The keyword arguments every layer of this stage takes besides the hidden states, ``attention_mask``,
        ``cache`` and ``output_attentions`` (position ids, rotary embeddings, the call's extra arguments)."""
        return {}

    def prepare(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs) -> BodyState:
        config = self.config
        if token_type_ids is not None and not self.embeds_token_types:
            raise ValueError(f"{type(self).__name__} has no token type embeddings: do not pass token_type_ids.")
        use_cache = use_cache if use_cache is not None else config.use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False  # the recomputation would add the keys and values a second time
        output_attentions = output_attentions if output_attentions is not None else config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        input_shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        if self.flattens_leading_dims:
            if input_ids is not None:
                input_ids = input_ids.view(-1, input_shape[-1])
            else:
                inputs_embeds = inputs_embeds.view(-1, input_shape[-1], inputs_embeds.shape[-1])
        if use_cache and cache is None:
            cache = DynamicCache(config=config)  # each rank caches its own heads, each stage its own layers
        adopt_cache(cache, self.parallel_context)
        embeds = stand_in_embeds(input_ids, inputs_embeds, self.dtype, self.device)
        if token_type_ids is not None:
            token_type_ids = token_type_ids.view(-1, embeds.shape[1])
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(embeds.shape[1], device=embeds.device) + past_seen)[None]
        if self.flattens_leading_dims and attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(embeds.shape[0], -1)
        # One mask per kind of attention among the layers (a sliding-window layer's keys back to its window).
        mask_inputs = dict(config=config, inputs_embeds=embeds, attention_mask=attention_mask, cache=cache,
                           position_ids=position_ids)
        masks = {kind: (create_sliding_window_causal_mask if kind == SLIDING_ATTENTION else create_causal_mask)(
            **mask_inputs) for kind in set(self.layer_types or (FULL_ATTENTION,))}
        return BodyState(
            sequence_sharded=splits_sequences(self.parallel_context, embeds.shape[1]),
            input_ids=input_ids, inputs_embeds=inputs_embeds, token_type_ids=token_type_ids,
            input_shape=input_shape, position_ids=position_ids, masks=masks, cache=cache, use_cache=use_cache,
            output_attentions=output_attentions, kwargs=kwargs,
            return_dict=return_dict if return_dict is not None else config.return_dict,
            hidden_states=() if output_hidden_states else None, attentions=() if output_attentions else None,
            # A body whose transformers twin returns cross_attentions=() with the attentions (GPT2: no layer
            # of this body fills it) declares it among its per-layer outputs.
            cross_attentions=() if output_attentions and "cross_attentions" in self.per_layer_outputs else None,
        )

    def run_layers(self, payload: dict[str, torch.Tensor], state: BodyState) -> dict[str, torch.Tensor]:
        hidden_states = payload["hidden_states"]
        inputs = self.layer_inputs(hidden_states, state)
        with self._layers_on(state.sequence_sharded):
            for layer in getattr(self, self.layers_attribute):
                if state.hidden_states is not None:
                    state.hidden_states += (self._whole(hidden_states, state.sequence_sharded),)
                kind = self.layer_types[layer.layer_idx] if self.layer_types else FULL_ATTENTION
                hidden_states, attn_weights = layer(
                    hidden_states, attention_mask=state.masks[kind], cache=state.cache,
                    output_attentions=state.output_attentions, **inputs,
                )
                if state.attentions is not None and attn_weights is not None:  # sdpa has none: ()
                    state.attentions += (attn_weights,)
        return {"hidden_states": hidden_states}

    def finish(self, payload: dict[str, torch.Tensor], state: BodyState) -> ModelOutput:
        hidden_states = self._whole(getattr(self, self.norm_attribute)(payload["hidden_states"]),
                                    state.sequence_sharded)
        if self.flattens_leading_dims:
            hidden_states = hidden_states.view(-1, *state.input_shape[1:], hidden_states.size(-1))
        if state.hidden_states is not None:
            state.hidden_states += (hidden_states,)
        cache = state.cache if state.use_cache or not self.cache_only_with_use_cache else None
        return self.output_class(
            last_hidden_state=hidden_states,
            **{CACHE_FIELD: cache},
            hidden_states=state.hidden_states,
            attentions=state.attentions,
            **({"cross_attentions": state.cross_attentions} if "cross_attentions" in self.per_layer_outputs else {}),
        )


def pre_norm_block(block: torch.nn.Module, hidden_states: torch.Tensor, **attention_kwargs):
    """A GPT-style block's call, ``h + attn(ln_1(h))`` then ``h + mlp(ln_2(h))``, returning ``(h, attn_weights)``.
    The block adds each residual, as in transformers (hooks on ``block.attn`` and ``block.mlp`` see their outputs),
    except where a fused module's bias + dropout + residual kernel pays (:func:`adds_residual`): the module is then
    handed the residual and adds it in the kernel. The attention module has ``fused`` and ``resid_dropout``, the
    MLP ``fused`` and ``dropout``."""
    normed = block.ln_1(hidden_states)
    fused = adds_residual(block.attn, normed, block.attn.resid_dropout)
    attn_output, attn_weights = block.attn(normed, residual=hidden_states if fused else None, **attention_kwargs)
    hidden_states = attn_output if fused else hidden_states + attn_output
    normed = block.ln_2(hidden_states)
    if adds_residual(block.mlp, normed, block.mlp.dropout):
        return block.mlp(normed, residual=hidden_states), attn_weights
    return hidden_states + block.mlp(normed), attn_weights


class LearnedPositions(DecoderBody):
    """The body of GPT2 and GPT-Neo: a decoder body with learned absolute positions. ``wte`` embeds the tokens (and
    the token types, when given, through the same table), ``wpe`` the positions, then ``drop``; the layers are
    ``h``, the final norm ``ln_f``. The two transformers classes take the same arguments in the same order, so
    their ``forward`` is written once here."""

    layers_attribute, norm_attribute = "h", "ln_f"
    embeds_token_types = True  # through the token embedding, as transformers' GPT2 and GPT-Neo

    def _build_body(self, config, dropout: float, block: Callable[[int], nn.Module]) -> None:
        """The embeddings, ``config.num_hidden_layers`` layers (``block(i)``: layer ``i``) and the final norm."""
        self.embed_dim = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, self.embed_dim, parallel_context=self.parallel_context)
        self.wpe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        self.drop = nn.Dropout(float(dropout))
        self.h = StageLayers.build(config.num_hidden_layers, block)
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.wte

    def set_input_embeddings(self, new_embeddings: VocabParallelEmbedding) -> None:
        self.wte = new_embeddings

    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ModelOutput | tuple:
        """As transformers' ``GPT2Model.forward`` and ``GPTNeoModel.forward`` (under pipeline parallelism: one pass
        without gradients over every stage, whose output every stage returns)."""
        return self.run(self.prepare(
            input_ids=input_ids, cache=cache, attention_mask=attention_mask,
            token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
            use_cache=use_cache, output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            return_dict=return_dict, **kwargs,
        ))

    def embed_inputs(self, state: BodyState) -> dict[str, torch.Tensor]:
        inputs_embeds = state.inputs_embeds if state.inputs_embeds is not None else self.wte(state.input_ids)
        hidden_states = inputs_embeds + self.wpe(state.position_ids).to(inputs_embeds.device)  # (B, T, C)
        if state.token_type_ids is not None:
            hidden_states = hidden_states + self.wte(state.token_type_ids)
        return {"hidden_states": self.drop(hidden_states)}
