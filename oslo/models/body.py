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
stages, and calls ``finish`` and the head on the last. Nothing in a model file mentions stages except
which modules a stage builds (``if first`` / ``if last``) and its ``StageLayers``.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, ModelOutput

__all__ = ["BodyState", "StagedBody", "stand_in_embeds"]


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


def stand_in_embeds(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """What transformers' mask builders read from ``inputs_embeds`` (batch, length, dtype, device),
    without the embeddings: every stage builds its masks from the inputs alone."""
    if inputs_embeds is not None:
        return inputs_embeds
    return torch.empty((*input_ids.shape[:2], 0), dtype=dtype, device=device)
