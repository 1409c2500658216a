"""Task heads written once, for every architecture.

A head is a mixin: an architecture's class declares it before its pre-trained base class, e.g.
``class GPT2ForTokenClassification(TokenClassificationHead, GPT2PreTrainedModel)``, and builds it in
``__init__`` after its body (``self._build_..._head(config)``). The head's ``forward`` runs the body
(``self.base_model``, the module named by ``base_model_prefix``) through
:func:`~oslo.models.runner.forward_with_head`, so tensor and pipeline parallelism,
loss averaging over micro-batches and replicas, and the input checks are the same for every model.
The heads' layers are small and replicated, and live on the last pipeline stage only.

What a head needs from its architecture:

* ``config.hidden_size`` (every transformers config maps it);
* the dropout before a classifier: :meth:`ClassifierDropout._classifier_dropout_probability`, which an
  architecture overrides when its config names it differently;
* for sequence classification, how a sequence is pooled: the last non-padding token (decoders, such as
  GPT2), the body's ``pooler_output`` (encoders, such as BERT), see :class:`SequenceClassificationHead`.

The loss math — transformers' losses, as sums over their items so that averaging follows the whole
step — lives in the functions below the heads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import (
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)

from oslo.models.compat import accepts_legacy_cache_name, rename_legacy_cache
from oslo.models.runner import forward_with_head, logits_not_gathered
from oslo.parallel.dtensor import has_user_forward_hooks, has_user_hooks
from oslo.parallel.layers import VocabParallelLMHead
from oslo.parallel.loss import LossSum, causal_lm_items, check_labels, vocab_parallel_cross_entropy

__all__ = [
    "VocabularyHead",
    "fused_loss_applies",
    "vocabulary_loss",
    "CausalLMHead",
    "MaskedLMHead",
    "MultipleChoiceHead",
    "QuestionAnsweringHead",
    "Seq2SeqLMHead",
    "SequenceClassificationHead",
    "TokenClassificationHead",
    "answer_positions",
    "body_inputs",
    "check_eos_tokens",
    "class_items",
    "last_eos_hidden_state",
    "problem_type",
    "seq2seq_body_inputs",
    "sequence_classification_items",
    "sequence_classification_loss_sum",
]


def body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds) -> dict:
    """The batch inputs every body takes, by name."""
    return dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                position_ids=position_ids, inputs_embeds=inputs_embeds)


class ClassifierDropout:
    """The dropout probability before a classifier, as transformers reads it from a config."""

    @staticmethod
    def _classifier_dropout_probability(config) -> float:
        for name in ("classifier_dropout", "hidden_dropout", "hidden_dropout_prob"):
            if getattr(config, name, None) is not None:
                return getattr(config, name)
        return 0.1


def keep_last(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """transformers' ``logits_to_keep``: the last n positions (0: all), or the given indices."""
    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
        return hidden_states[:, -logits_to_keep:, :]
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden_states[:, logits_to_keep, :]
    return hidden_states


def logits_are_private(model: nn.Module, returned: bool) -> bool:
    """Whether the loss may overwrite the local logits (``overwrite_logits`` of
    :func:`~oslo.parallel.loss.vocab_parallel_cross_entropy`): they are not ``returned`` (gathered for the
    output) and no forward hook of the user's could have kept them. Only the module the logits come from
    (``model._logits_module()``, its children included) returns them: a hook elsewhere (on a block, say) never
    sees them, and leaves the loss its memory-saving path."""
    return not returned and not has_user_forward_hooks(model._logits_module())


def gather_logits_by_default(model: nn.Module, gather_logits: bool | None, labels) -> bool:
    """``gather_logits`` as given, or by default: not in a training call (labels, gradients, train mode),
    whose loss comes from the vocabulary-split logits and needs no batch x sequence x vocabulary gather."""
    if gather_logits is not None:
        return gather_logits
    return not (labels is not None and torch.is_grad_enabled() and model.training)


def output_class_for(model: nn.Module, output_class: type, gather: bool, gather_logits: bool | None) -> type:
    """The output class of a call that gathers the logits or not: when they were skipped by default (a
    training call), asking the output for them raises an error that says so (pipeline micro-batch
    outputs carry only the loss anyway)."""
    if gather or gather_logits is False or model.parallel_context.pipeline_parallel_size > 1:
        return output_class
    return logits_not_gathered(output_class)


def fused_loss_applies(model: nn.Module, projection: nn.Module, returned: bool) -> bool:
    """Whether a language-modeling loss may come straight from the hidden states
    (:func:`~oslo.parallel.loss.linear_cross_entropy`: the logits never built): nothing reads the logits (they
    are not ``returned``, no forward hook of the user's could keep them), the projection is oslo's own (not
    wrapped, e.g. by an adapter) and ``model.loss_chunk_size`` is not 0. Under ``torch.compile`` only when
    ``loss_chunk_size`` is set (the chunks trace, ignored tokens masked instead of dropped): by default a compiled
    call builds the whole logits, measured faster there (``benchmarks/fused_loss.py --part c``)."""
    chunks = model.loss_chunk_size
    return (chunks != 0 and (chunks is not None or not torch.compiler.is_compiling())
            and type(projection) is VocabParallelLMHead and not has_user_hooks(projection)
            and logits_are_private(model, returned))


def vocabulary_loss(model: nn.Module, hidden_states: torch.Tensor, labels: torch.Tensor | None, *,
                    returned: bool, shift: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The summed cross entropy of a language-modeling head (labels shifted for next-token prediction when
    ``shift``; ``None`` without labels) and this rank's vocabulary columns of the logits (``None`` when they
    were not built: see :func:`fused_loss_applies`). ``returned``: the logits are gathered for the output."""
    projection = model._vocab_projection()
    if labels is not None and fused_loss_applies(model, model._vocab_module(), returned):
        return projection.loss_from_features(model._lm_features(hidden_states), labels, shift=shift,
                                             chunk_rows=model.loss_chunk_size), None
    local_logits = model._lm_logits(hidden_states)  # (..., V_local)
    if labels is None:
        return None, local_logits
    overwrite = logits_are_private(model, returned)
    if shift:
        return projection.causal_lm_loss(local_logits, labels, reduction="sum", overwrite_logits=overwrite), \
            local_logits
    return MaskedLMHead._masked_lm_loss_sum(projection, local_logits, labels, overwrite_logits=overwrite), \
        local_logits


def lm_loss_dtype(model: nn.Module, hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype of ``model``'s language-modeling loss as the transformers class of the same name returns it (oslo
    computes it in float32, float64 for float64 logits, and rounds it to this): float32 where transformers computes
    on ``logits.float()`` (its ``loss_function``: the causal LMs); the logits' own dtype where it applies
    ``nn.CrossEntropyLoss`` to the logits as they are (``_loss_in_logits_dtype``: BERT's masked-LM and pre-training
    heads, T5's, GPT2's double heads), which is float32 under autocast (autocast computes cross entropy in
    float32) and the hidden states' dtype otherwise."""
    if not model._loss_in_logits_dtype:
        return torch.float32
    if torch.is_autocast_enabled(hidden_states.device.type):
        return torch.promote_types(hidden_states.dtype, torch.float32)
    return hidden_states.dtype


class VocabularyHead:
    """What the language-modeling heads share: ``self.lm_head``, a
    :class:`~oslo.parallel.layers.VocabParallelLMHead` on the last stage (tied to the input embeddings through
    ``_tied_weights_keys``) built by :meth:`_build_lm_head`, and the hooks an architecture overrides
    when its prediction is more than that projection (BERT's transform before its decoder, T5's output scaling).

    A training call's loss is computed from the hidden states a chunk of tokens at a time, never building the
    logits, when nothing asks for them (see :func:`fused_loss_applies`). ``loss_chunk_size`` sets the tokens
    per chunk: ``None`` (the default) chooses from the shapes (:func:`~oslo.parallel.loss.loss_chunk_rows`),
    ``0`` builds the whole logits as an evaluation call does."""

    loss_chunk_size: int | None = None

    _loss_in_logits_dtype: bool = False  # transformers' loss has the logits' dtype (see lm_loss_dtype)

    def _build_lm_head(self, config, bias: bool = False) -> None:
        self.lm_head = VocabParallelLMHead(config.hidden_size, config.vocab_size, bias,
                                           parallel_context=self.parallel_context)

    def _lm_features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the vocabulary projection reads: the body's last hidden states, as they are by default."""
        return hidden_states

    def _lm_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits, ``(..., V_local)``."""
        return self._vocab_module()(self._lm_features(hidden_states))

    def _vocab_module(self) -> nn.Module:
        """The vocabulary projection, as the model holds it (an adapter may wrap it)."""
        return self.lm_head

    def _logits_module(self) -> nn.Module:
        """The module whose call in :meth:`_lm_logits` returns the local logits: the only module whose forward
        hooks see them."""
        return self._vocab_module()

    def _vocab_projection(self) -> VocabParallelLMHead:
        """The vocabulary-split projection itself, unwrapped (its vocabulary range, group, losses and ``gather``)."""
        module = self._vocab_module()
        if hasattr(module, "token_adapter"):  # PEFT's trainable tokens: a wrapper around their layer
            module = module.token_adapter
        return module.get_base_layer() if hasattr(module, "get_base_layer") else module


class CausalLMHead(VocabularyHead):
    """Next-token prediction over a vocabulary split across tensor-parallel ranks.

    The loss is computed on vocabulary-split logits (no gather). The full logits are gathered for the
    output except in a training call (``labels`` given, gradients enabled, ``model.train()``), whose
    output then has no ``logits`` (asking for them raises an error naming ``gather_logits=True``).
    ``gather_logits=True`` / ``False`` gathers them always / never (``logits`` is then ``None``).

    The projection and its hooks: :class:`VocabularyHead`.
    """

    _lm_output_class: type = CausalLMOutputWithCrossAttentions

    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        gather_logits: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """Causal language modeling, as transformers' ``...ForCausalLM.forward`` (see the class).

        Under pipeline parallelism, a call with ``labels`` while gradients are enabled returns the
        micro-batch outputs of a training step (see :func:`oslo.parallel.pipeline.pipeline_schedule`); any
        other call runs the whole batch through the stages without gradients and returns the usual
        output on every stage.
        """
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if labels is not None:
            check_labels(labels, self.config.vocab_size)  # every rank, before any communication
        gather = gather_logits_by_default(self, gather_logits, labels)

        def head(outputs, inputs, head_inputs, outputs_needed):
            returned = gather and outputs_needed
            loss, local_logits = vocabulary_loss(self, keep_last(outputs.last_hidden_state, logits_to_keep),
                                                 head_inputs["labels"], returned=returned, shift=True)
            logits = self._vocab_projection().gather(local_logits) if returned else None
            dtype = lm_loss_dtype(self, outputs.last_hidden_state)
            return {"loss": None if loss is None else LossSum(loss, dtype=dtype), "logits": logits}

        return forward_with_head(
            self,
            self.base_model,
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds),
            {"labels": labels},
            head,
            output_class_for(self, self._lm_output_class, gather, gather_logits),
            cache=cache,
            use_cache=use_cache,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=lambda batch: {"loss": causal_lm_items(batch["labels"])},
            num_items_in_batch=num_items_in_batch,
        )


def seq2seq_body_inputs(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, inputs_embeds,
                        decoder_inputs_embeds, encoder_outputs=None) -> dict:
    """The batch inputs an encoder-decoder body takes, by name (``encoder_outputs``, when given, as its
    ``last_hidden_state``: a tensor that micro-batches split)."""
    return dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                decoder_attention_mask=decoder_attention_mask, inputs_embeds=inputs_embeds,
                decoder_inputs_embeds=decoder_inputs_embeds,
                encoder_last_hidden_state=None if encoder_outputs is None else encoder_outputs[0])


class Seq2SeqLMHead(VocabularyHead):
    """Sequence-to-sequence language modeling (T5's ``ForConditionalGeneration``): a prediction per decoder
    position over a vocabulary split across tensor-parallel ranks, against labels that the decoder reads
    shifted right (``self._shift_right(labels)`` when no decoder inputs are given), ``-100`` not predicted.

    The loss is the vocabulary-parallel cross entropy of :class:`MaskedLMHead` (unshifted, never gathering
    the logits); the logits are gathered for the output as :class:`CausalLMHead` does. The projection and its
    hooks: :class:`VocabularyHead` (T5 overrides :meth:`_lm_features` to scale the decoder's output first).
    """

    _lm_output_class: type = Seq2SeqLMOutput

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
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        gather_logits: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """As transformers' ``...ForConditionalGeneration.forward`` (see the class; ``gather_logits`` as for
        :class:`CausalLMHead`). Under pipeline parallelism a call with ``labels`` while gradients are enabled
        returns the micro-batch outputs of a training step; with ``encoder_outputs`` given (generate()'s
        decoding steps) only the decoder's stages run."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if labels is not None:
            check_labels(labels, self.config.vocab_size)  # every rank, before any communication
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self._shift_right(labels)
        gather = gather_logits_by_default(self, gather_logits, labels)

        return forward_with_head(
            self,
            self.base_model,
            seq2seq_body_inputs(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, inputs_embeds,
                                decoder_inputs_embeds, encoder_outputs),
            {"labels": labels},
            unshifted_lm_head(self, gather),
            output_class_for(self, self._lm_output_class, gather, gather_logits),
            cache=cache,
            use_cache=use_cache,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=lambda batch: {"loss": class_items(batch["labels"])},
            num_items_in_batch=num_items_in_batch,
        )


class TokenClassificationHead(ClassifierDropout):
    """A class per token: dropout, then a linear layer on every position's hidden state, named by
    ``_token_classifier`` (``"classifier"``; the Llama family: ``"score"``)."""

    _token_classifier: str = "classifier"
    _token_loss_in_float32: bool = False  # transformers' loss_function takes logits.float() (the Llama family's)

    def _build_token_classification_head(self, config) -> None:
        self.num_labels = config.num_labels
        self.dropout = nn.Dropout(self._classifier_dropout_probability(config))
        bias = getattr(config, "token_classification_bias", True)
        setattr(self, self._token_classifier, nn.Linear(config.hidden_size, config.num_labels, bias=bias))

    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> TokenClassifierOutput | tuple:
        return self._classify_tokens(
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds), labels,
            cache=cache, use_cache=use_cache, return_dict=return_dict, **kwargs)

    def _classify_tokens(self, inputs: dict, labels, cache=None, use_cache=None, return_dict=None, **kwargs):
        """The head on the body's outputs for ``inputs`` (the body's batch inputs, by name): what every
        architecture's ``forward`` calls, whatever inputs its body takes."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if labels is not None:
            check_labels(labels, self.num_labels, classes=True)  # every rank, before any communication

        def head(outputs, inputs, head_inputs, outputs_needed):
            logits = getattr(self, self._token_classifier)(self.dropout(outputs.last_hidden_state))
            loss = None
            if head_inputs["labels"] is not None:
                labels = head_inputs["labels"].to(logits.device)
                flat = logits.view(-1, self.num_labels)
                loss = LossSum(F.cross_entropy(flat.float() if self._token_loss_in_float32 else flat, labels.view(-1),
                                               reduction="sum"))
            return {"loss": loss, "logits": logits}

        return forward_with_head(
            self,
            self.base_model,
            inputs,
            {"labels": labels},
            head,
            TokenClassifierOutput,
            cache=cache,
            use_cache=use_cache,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=lambda batch: {"loss": class_items(batch["labels"])},
            num_items_in_batch=num_items_in_batch,
        )


class SequenceClassificationHead:
    """A class (or regression targets) per sequence. The loss (regression, single- or multi-label) follows
    ``config.problem_type``, decided from the labels as transformers does, on every rank.

    How a sequence is pooled, and the classifier's name, are declared by the class:

    * ``_sequence_pooling = "last_token"`` (default, transformers' decoders such as GPT2): the hidden state
      of the sequence's last non-padding token (``config.pad_token_id`` finds it; left and right padding
      both work);
    * ``_sequence_pooling = "pooler"`` (transformers' encoders such as BERT): the body's ``pooler_output``;
    * ``_sequence_pooling = "eos"`` (transformers' encoder-decoders such as T5): the hidden state at the last
      ``config.eos_token_id`` of each input row, every row holding the same number of them (checked on
      every rank before the model runs, a ``ValueError`` otherwise, as transformers raises).

    ``_sequence_classifier`` names the classifier (``"score"``; BERT: ``"classifier"``; T5:
    ``"classification_head"``, a module of its own; the class builds it when it is not a plain linear layer),
    ``_sequence_classifier_bias`` whether it has a bias, ``_sequence_classifier_dropout`` whether a dropout
    (:meth:`ClassifierDropout._classifier_dropout_probability`) comes before it, and
    ``_sequence_classification_output_class`` the output class.
    """

    _sequence_pooling: str = "last_token"
    _sequence_classifier: str = "score"
    _sequence_classifier_bias: bool = False
    _sequence_classifier_dropout: bool = False
    _sequence_classification_output_class: type = SequenceClassifierOutputWithPast

    def _build_sequence_classification_head(self, config) -> None:
        if self._sequence_pooling not in ("last_token", "pooler", "eos"):
            raise ValueError(
                f"{type(self).__name__}._sequence_pooling is {self._sequence_pooling!r}; use 'last_token', 'pooler' "
                "or 'eos'."
            )
        self.num_labels = config.num_labels
        if self._sequence_classifier_dropout:
            self.dropout = nn.Dropout(ClassifierDropout._classifier_dropout_probability(config))
        setattr(self, self._sequence_classifier,
                nn.Linear(config.hidden_size, self.num_labels, bias=self._sequence_classifier_bias))

    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast | tuple:
        return self._classify_sequences(
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds), labels,
            cache=cache, use_cache=use_cache, return_dict=return_dict, **kwargs)

    def _classify_sequences(self, inputs: dict, labels, cache=None, use_cache=None, return_dict=None, **kwargs):
        """The head on the body's outputs for ``inputs`` (the body's batch inputs, by name): what every
        architecture's ``forward`` calls, whatever inputs its body takes."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        kind = problem_type(self.config, self.num_labels, labels) if labels is not None else None
        if kind == "single_label_classification":  # cross entropy on classes
            check_labels(labels, self.num_labels, classes=True)  # every rank, before any communication
        input_ids, inputs_embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
        batch_size = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        pooling = self._sequence_pooling
        if pooling == "last_token" and self.config.pad_token_id is None and batch_size != 1:
            raise ValueError(
                f"{type(self).__name__} needs config.pad_token_id to find the last token of each of the "
                f"{batch_size} sequences; set pad_token_id (e.g. pad_token_id=tokenizer.eos_token_id)."
            )
        if pooling == "eos":
            check_eos_tokens(type(self).__name__, input_ids, self.config.eos_token_id)  # every rank, first

        def head(outputs, inputs, head_inputs, outputs_needed):
            classifier = getattr(self, self._sequence_classifier)
            if pooling == "eos":
                pooled_logits = classifier(last_eos_hidden_state(outputs.last_hidden_state, inputs["input_ids"],
                                                                 self.config.eos_token_id))  # (B, num_labels)
            elif pooling == "pooler":
                pooled = outputs.pooler_output  # (B, C)
                if self._sequence_classifier_dropout:
                    pooled = self.dropout(pooled)
                pooled_logits = classifier(pooled)  # (B, num_labels)
            else:
                hidden_states = outputs.last_hidden_state
                if self._sequence_classifier_dropout:
                    hidden_states = self.dropout(hidden_states)
                logits = classifier(hidden_states)  # (B, T, num_labels)
                input_ids, pad_token_id = inputs["input_ids"], self.config.pad_token_id
                if pad_token_id is None or input_ids is None:
                    last_token = -1
                else:
                    # The rightmost non-pad token, so both left and right padding work.
                    not_pad = (input_ids != pad_token_id).to(logits.device, torch.int32)
                    positions = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
                    last_token = (positions * not_pad).argmax(-1)
                pooled_logits = logits[torch.arange(logits.shape[0], device=logits.device), last_token]
            loss = None
            if head_inputs["labels"] is not None:
                loss = LossSum(sequence_classification_loss_sum(kind, self.num_labels, pooled_logits,
                                                                head_inputs["labels"]))
            return {"loss": loss, "logits": pooled_logits}

        return forward_with_head(
            self,
            self.base_model,
            inputs,
            {"labels": labels},
            head,
            self._sequence_classification_output_class,
            cache=cache,
            use_cache=use_cache,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=lambda batch: {"loss": sequence_classification_items(kind, batch["labels"])},
            num_items_in_batch=num_items_in_batch,
        )


class QuestionAnsweringHead:
    """Extractive question answering: a start and an end logit per token; the loss is the mean of the
    start and the end cross entropy, positions outside the input ignored (as transformers)."""

    _pipeline_loss_inputs = ("start_positions", "end_positions")

    def _build_question_answering_head(self, config) -> None:
        self.num_labels = config.num_labels
        self.qa_outputs = nn.Linear(config.hidden_size, 2)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput | tuple:
        return self._answer_questions(
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds), start_positions,
            end_positions, return_dict=return_dict, **kwargs)

    def _answer_questions(self, inputs: dict, start_positions, end_positions, return_dict=None,
                          output_class: type = QuestionAnsweringModelOutput, **kwargs):
        """The head on the body's outputs for ``inputs`` (the body's batch inputs, by name; the answer is
        searched in ``input_ids``): what every architecture's ``forward`` calls, whatever inputs its body
        takes."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        # A cache given is read and filled, as transformers' bodies do (the output has no field for it); none
        # given, none is built.
        cache = rename_legacy_cache(kwargs).pop("cache", None)
        use_cache = kwargs.pop("use_cache", None)
        input_ids, inputs_embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]

        def head(outputs, inputs, head_inputs, outputs_needed):
            start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).split(1, dim=-1)
            start_logits = start_logits.squeeze(-1).contiguous()
            end_logits = end_logits.squeeze(-1).contiguous()
            loss = None
            start_positions, end_positions = head_inputs["start_positions"], head_inputs["end_positions"]
            if start_positions is not None and end_positions is not None:
                start = answer_positions(start_positions, length).to(start_logits.device)
                end = answer_positions(end_positions, length).to(end_logits.device)
                loss = LossSum(torch.stack([
                    F.cross_entropy(start_logits, start, ignore_index=length, reduction="sum"),
                    F.cross_entropy(end_logits, end, ignore_index=length, reduction="sum"),
                ]), weights=(0.5, 0.5))
            return {"loss": loss, "start_logits": start_logits, "end_logits": end_logits}

        def loss_items(batch):
            if "start_positions" not in batch or "end_positions" not in batch:
                return {}
            return {"loss": torch.stack([class_items(answer_positions(batch[name], length), length)
                                         for name in ("start_positions", "end_positions")])}

        return forward_with_head(
            self,
            self.base_model,
            inputs,
            {"start_positions": start_positions, "end_positions": end_positions},
            head,
            output_class,
            cache=cache,
            use_cache=cache is not None if use_cache is None else use_cache,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=loss_items,
            num_items_in_batch=num_items_in_batch,
        )


def unshifted_lm_head(model: nn.Module, gather: bool) -> Callable:
    """The head function of :class:`MaskedLMHead` and :class:`Seq2SeqLMHead`: the cross entropy of
    :func:`vocabulary_loss` against unshifted labels (never gathering the logits), and the full
    logits gathered when ``gather`` and the outputs are needed."""

    def head(outputs, inputs, head_inputs, outputs_needed):
        returned = gather and outputs_needed
        loss, local_logits = vocabulary_loss(model, outputs.last_hidden_state, head_inputs["labels"],
                                             returned=returned, shift=False)
        logits = model._vocab_projection().gather(local_logits) if returned else None
        return {"loss": None if loss is None else LossSum(loss, dtype=lm_loss_dtype(model, outputs.last_hidden_state)),
                "logits": logits}

    return head


class MaskedLMHead(VocabularyHead):
    """Masked language modeling: a prediction per position over a vocabulary split across tensor-parallel
    ranks, against unshifted labels (``-100``: not predicted), as transformers' ``...ForMaskedLM``.

    The architecture supplies the prediction: :meth:`_lm_features` (what the projection reads; BERT's transform)
    and :meth:`_vocab_projection` (the :class:`~oslo.parallel.layers.VocabParallelLMHead`, BERT's decoder tied
    to the word embeddings with its own bias split by vocabulary, whose vocabulary range and group the loss and
    the gather use), or builds a plain projection (:class:`VocabularyHead`). The loss is a vocabulary-parallel
    cross entropy (never gathering the logits; in a training call never building them); the logits are
    gathered for the output as :class:`CausalLMHead` does (not in a training call unless ``gather_logits=True``).
    """

    _masked_lm_output_class: type = MaskedLMOutput

    @staticmethod
    def _masked_lm_loss_sum(projection: VocabParallelLMHead, local_logits: torch.Tensor,
                            labels: torch.Tensor, overwrite_logits: bool = False) -> torch.Tensor:
        """Sum over the labelled positions of the cross entropy of vocabulary-split logits (no shift)."""
        start, stop = projection.weight_spec.vocab_range()
        return vocab_parallel_cross_entropy(local_logits, labels.to(local_logits.device), vocab_start=start,
                                            valid_columns=stop - start, group=projection.group,
                                            overwrite_logits=overwrite_logits).sum()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        gather_logits: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """Masked language modeling, as transformers' ``...ForMaskedLM.forward`` (see the class)."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if labels is not None:
            check_labels(labels, self.config.vocab_size)  # every rank, before any communication
        gather = gather_logits_by_default(self, gather_logits, labels)

        return forward_with_head(
            self,
            self.base_model,
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds),
            {"labels": labels},
            unshifted_lm_head(self, gather),
            output_class_for(self, self._masked_lm_output_class, gather, gather_logits),
            use_cache=False,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=lambda batch: {"loss": class_items(batch["labels"])},
            num_items_in_batch=num_items_in_batch,
        )


class MultipleChoiceHead(ClassifierDropout):
    """A score per choice: inputs are ``(batch, choices, length)`` (embeddings ``(batch, choices, length,
    hidden)``); the body scores each choice as a row of its own (a body flattens the leading dimensions
    of its inputs, as BERT's and GPT2's do), the body's ``pooler_output`` goes through dropout and a linear
    layer to one score, reshaped to ``(batch, choices)``; the loss is the cross entropy over the choices.
    Pipeline micro-batches split the batch by examples, all of an example's choices together."""

    def _build_multiple_choice_head(self, config) -> None:
        self.dropout = nn.Dropout(self._classifier_dropout_probability(config))
        self.classifier = nn.Linear(config.hidden_size, 1)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MultipleChoiceModelOutput | tuple:
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        inputs = input_ids if input_ids is not None else inputs_embeds
        if inputs is None or inputs.dim() < (3 if input_ids is not None else 4):
            raise ValueError(
                f"{type(self).__name__} takes (batch, choices, length) input_ids (or (batch, choices, length, "
                f"hidden) inputs_embeds), got shape {None if inputs is None else tuple(inputs.shape)}."
            )
        num_choices = inputs.shape[1]
        if labels is not None:
            check_labels(labels, num_choices, classes=True)  # every rank, before any communication

        def head(outputs, inputs, head_inputs, outputs_needed):
            logits = self.classifier(self.dropout(outputs.pooler_output)).view(-1, num_choices)  # (B, choices)
            loss = None
            if head_inputs["labels"] is not None:
                labels = head_inputs["labels"].to(logits.device)
                loss = LossSum(F.cross_entropy(logits, labels.view(-1), reduction="sum"))
            return {"loss": loss, "logits": logits}

        return forward_with_head(
            self,
            self.base_model,
            body_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds),
            {"labels": labels},
            head,
            MultipleChoiceModelOutput,
            use_cache=False,
            return_dict=return_dict,
            body_kwargs=kwargs,
            loss_items=lambda batch: {"loss": class_items(batch["labels"])},
            num_items_in_batch=num_items_in_batch,
        )


# ---------------------------------------------------------------------------------------------
# Loss math shared by the heads
# ---------------------------------------------------------------------------------------------
def class_items(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Labelled items of a cross entropy: labels that are not ``ignore_index``."""
    return (labels != ignore_index).sum()


def problem_type(config, num_labels: int, labels: torch.Tensor) -> str:
    """transformers' choice of loss for sequence classification, made (and recorded in the config) on
    every rank before the model runs, so every pipeline stage's config, and a saved config.json, has it."""
    if config.problem_type is None:
        if num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    return config.problem_type


def sequence_classification_loss_sum(kind: str, num_labels: int, logits: torch.Tensor, labels: torch.Tensor):
    """transformers' sequence-classification losses (regression, single- or multi-label), summed over
    their items instead of averaged (see :func:`sequence_classification_items`)."""
    labels = labels.to(logits.device)
    if kind == "regression":
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype), reduction="sum")
        return F.mse_loss(logits, labels.to(logits.dtype), reduction="sum")
    if kind == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1), reduction="sum")
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="sum")


def sequence_classification_items(kind: str, labels: torch.Tensor) -> torch.Tensor:
    """What each sequence-classification loss averages over: labelled rows for cross entropy (``-100``
    ignored), every element of the labels for regression and multi-label classification."""
    if kind == "single_label_classification":
        return class_items(labels.view(-1))
    return torch.full((), labels.numel(), device=labels.device)  # made on the device: no copy from the host


def check_eos_tokens(model_name: str, input_ids: torch.Tensor | None, eos_token_id: int | None) -> None:
    """EOS pooling's requirement, checked before the model runs: every row of ``input_ids`` holds the same
    number (at least one) of ``eos_token_id``, as transformers requires. Under ``torch.compile`` (no branching
    on the ids) the compiled program asserts it instead: a ``RuntimeError`` without the counts when it runs."""
    if input_ids is None or eos_token_id is None:
        raise ValueError(
            f"{model_name} pools each sequence at its last eos_token_id: it needs input_ids and "
            f"config.eos_token_id (got input_ids={'None' if input_ids is None else 'given'}, "
            f"eos_token_id={eos_token_id})."
        )
    counts = input_ids.eq(eos_token_id).sum(-1).reshape(-1)
    message = (
        f"{model_name}: all examples must have the same number of <eos> tokens, and at least one "
        f"(eos_token_id={eos_token_id}); the rows hold {{counts}}. End every row with one eos token "
        "(and pad after it)."
    )
    if not counts.numel():
        return
    if torch.compiler.is_compiling():
        torch._assert_async((counts.min() == counts.max()) & (counts.min() >= 1), message.format(counts="other counts"))
    elif counts.min() != counts.max() or counts.min() < 1:
        raise ValueError(message.format(counts=counts.tolist()))


def last_eos_hidden_state(hidden_states: torch.Tensor, input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """``(B, C)``: each row's hidden state at its last ``eos_token_id`` (every row holds one; see
    :func:`check_eos_tokens`). Indexed by position, not by a boolean mask, whose selection's size depends on
    the ids (``torch.compile`` cannot trace that)."""
    is_eos = input_ids.eq(eos_token_id).to(hidden_states.device)  # (B, T)
    positions = torch.arange(1, is_eos.size(-1) + 1, device=is_eos.device)
    last = (is_eos * positions).argmax(-1)  # (B,) each row's last eos: the largest position holding one
    return hidden_states[torch.arange(hidden_states.size(0), device=last.device), last]


def answer_positions(positions: torch.Tensor, length: int) -> torch.Tensor:
    """Start or end positions as transformers scores them: squeezed to one per row, and clamped to
    ``[0, length]``, where ``length`` (outside the input) is the ignored index."""
    if positions.dim() > 1:
        positions = positions.squeeze(-1)
    return positions.clamp(0, length)
