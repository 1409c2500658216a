"""How a call of an oslo model runs: its body and its head, with or without pipeline stages.

A head class's ``forward`` hands :func:`forward_with_head` its body, its batch, the head (a function of the
body's output) and the output class; the runner calls the body whole, or its steps stage by stage under
pipeline parallelism (a 1F1B training step, or one pass without gradients whose outputs every stage
receives), runs the head on the last stage and turns the head's loss sums into losses
(:mod:`oslo.models.loss_accounting`). It also makes the output classes of a training call that leaves the
full logits ungathered (:func:`logits_not_gathered`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp import FSDPModule

from oslo.models import loss_accounting
from oslo.models.compat import CACHE_FIELD, rename_legacy_cache
from oslo.models.stages import running_stage
from oslo.parallel.agreement import cached_positions
from oslo.parallel.data_parallel import active_data_parallel_wrapper
from oslo.parallel.deepspeed_engine import active_deepspeed_engine, check_engine, hold_reduction, reduce_now
from oslo.parallel.pipeline import (
    PipelineStep,
    StageLink,
    check_interleaved,
    pipeline_pass,
    pipeline_schedule,
    split_micro_batches,
)
from oslo.parallel.sequence import splits_sequences

if TYPE_CHECKING:
    from oslo.models.base import OsloPreTrainedModel

_LOGITS_NOT_GATHERED = (
    "logits were not gathered: a training call (labels given, gradients enabled, model.train()) computes the "
    "loss on the vocabulary-split logits and skips assembling the full logits, a batch x sequence x vocabulary "
    "all-gather the loss does not need. Pass gather_logits=True to get them; under torch.no_grad(), in eval "
    "mode or without labels they are gathered as before."
)


def _no_logits(output) -> None:
    raise AttributeError(_LOGITS_NOT_GATHERED)


def _set_no_logits(output, value) -> None:
    if value is not None:  # the dataclass constructor sets the field's default, None
        raise AttributeError(_LOGITS_NOT_GATHERED)


class _LogitsNotGathered:
    """Mixin of an output class whose ``logits`` were left out on purpose: asking for them raises. A property,
    not a ``__getattribute__`` override, so that ``torch.compile`` builds the output inside its graph."""

    logits = property(_no_logits, _set_no_logits)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{key}={value!r}' for key, value in self.items())})"

    def __reduce__(self):
        plain = type(self).__mro__[2]  # the transformers output class
        return plain, tuple(self.__dict__.get(field) for field in plain.__dataclass_fields__)


_NOT_GATHERED: dict[type, type] = {}


class _PassWithoutStageGradients(torch.autograd.Function):
    """An output of a pipelined pass without labels, as it is (no copy), whose backward raises: the pass carries
    no gradient back over the stages, so a loss computed from its outputs must fail, not train the user's own
    layers on top and leave the model's untouched."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor, pipeline_parallel_size: int) -> torch.Tensor:
        ctx.pipeline_parallel_size = pipeline_parallel_size
        return value.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(
            f"a loss was backpropagated into the outputs of a call without labels under pipeline parallelism "
            f"(pipeline_parallel_size={ctx.pipeline_parallel_size}): such a call is one pass over the stages and "
            "carries no gradient back to them, so it cannot train the model. Train through the pipeline: pass the "
            "labels (start_positions/end_positions for question answering) and backpropagate each micro-batch's "
            "loss, `for micro_output in model(**batch, labels=labels): micro_output.loss.backward()`. To train "
            "only layers of your own on the model's outputs, freeze the model (model.requires_grad_(False)) or "
            "detach the outputs; to evaluate, call it under torch.no_grad()."
        )


def _refuse_stage_gradients(value, pipeline_parallel_size: int):
    """``value`` (a tensor, or a tuple of them: per-layer outputs) with every floating tensor passed through
    :class:`_PassWithoutStageGradients`."""
    if isinstance(value, tuple):
        return tuple(_refuse_stage_gradients(item, pipeline_parallel_size) for item in value)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    anchor = torch.empty(0, device=value.device, requires_grad=True)
    return _PassWithoutStageGradients.apply(anchor, value, pipeline_parallel_size)


def logits_not_gathered(output_class: type) -> type:
    """``output_class`` (a transformers ``ModelOutput``) whose ``logits`` attribute raises an error that says
    why they are missing and how to get them (``gather_logits=True``). Made once per class, when a model class
    that returns it is defined (see :meth:`~oslo.models.base.OsloPreTrainedModel.__init_subclass__`):
    ``torch.compile`` cannot trace a class being made inside ``forward``."""
    made = _NOT_GATHERED.get(output_class)
    if made is None:
        # ``logits`` is no field of it either: code that walks an output's dataclass fields (FSDP2's hooks) skips it.
        fields = {name: field for name, field in output_class.__dataclass_fields__.items() if name != "logits"}
        made = _NOT_GATHERED[output_class] = type(
            output_class.__name__, (_LogitsNotGathered, output_class),
            {"__module__": output_class.__module__, "__dataclass_fields__": fields})
    return made


def forward_with_head(
    model: OsloPreTrainedModel,
    body: Callable,
    inputs: dict,
    head_inputs: dict,
    head: Callable,
    output_class: type,
    cache=None,
    use_cache: bool | None = None,
    return_dict: bool | None = None,
    body_kwargs: dict | None = None,
    loss_items: Callable[[dict], dict[str, torch.Tensor]] | None = None,
    num_items_in_batch=None,
):
    """Run ``body`` (the transformer, a :class:`~oslo.models.body.StagedBody`) and ``head`` on its output.

    Without pipeline parallelism this is ``head(body(**inputs), ...)``. With it, the runner calls the
    body's steps stage by stage (``prepare`` on every stage, ``embed`` on the first, ``run_layers``,
    ``finish`` and the head on the last) and passes the body's payload between stages: a call that has
    the loss inputs (``_pipeline_loss_inputs``) while gradients are enabled returns the 1F1B micro-batch
    outputs (a :class:`~oslo.parallel.pipeline.PipelineStep`, each output holding ``loss``); any other
    call is one pass without gradients whose outputs every stage receives.

    Losses average as one process averages the whole batch: each loss output is the mean over
    its own (micro-)batch's items, and its gradient is the sum's share of the whole step's items
    (every micro-batch, every data-parallel replica when their gradients are averaged), so the
    gradients after the step equal those of the global batch on one process.

    Args:
        body: The body module; called whole as ``body(**inputs, cache=..., use_cache=...,
            return_dict=True, **body_kwargs)``, or step by step under pipelines.
        inputs: The body's batch inputs (``input_ids``, ``attention_mask``, ...; ``None`` allowed).
        head_inputs: Batch tensors only the head uses (``labels``, ``mc_token_ids``, ...).
        head: ``head(outputs, inputs, head_inputs, outputs_needed)``, ``outputs`` being the body's whole
            ``ModelOutput`` (``last_hidden_state``, ``pooler_output``...), returns the output fields it
            computes, losses as :class:`~oslo.parallel.loss.LossSum`; fields it leaves out are taken
            from the body's output (hidden states, attentions). ``outputs_needed=False`` (pipeline
            training) means only ``loss`` is used.
        output_class: The transformers ``ModelOutput`` to return.
        loss_items: ``loss_items(batch)`` gives, for each loss the head returns, its item counts
            per term in ``batch`` (a dict of the inputs and head inputs), from the labels alone.
        num_items_in_batch: Divide the losses' sums by this instead (transformers' ``Trainer``
            passes it).
    """
    body_kwargs = body_kwargs or {}
    return_dict = return_dict if return_dict is not None else model.config.return_dict
    fields = list(output_class.__dataclass_fields__)
    context = model.parallel_context
    ddp = active_data_parallel_wrapper(context)
    pending = getattr(model, "_ddp_sync_to_restore", None)  # (torch 2.11's Dynamo cannot trace __dict__.pop)
    if pending is not None:  # an earlier pipeline step under DDP that was never started
        del model._ddp_sync_to_restore
        pending[0].require_backward_grad_sync = pending[1]
    batch = {name: value for name, value in {**inputs, **head_inputs}.items() if value is not None}
    has_loss_inputs = any(value is not None for value in head_inputs.values())
    ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
    splits_sequences(context, ids.shape[-1] if ids is not None else  # refuses a length it cannot split
                     embeds.shape[-2] if embeds is not None else None)

    def with_body_fields(values: dict, outputs) -> dict:
        for name in fields:
            if name not in values and getattr(outputs, name, None) is not None:
                values[name] = getattr(outputs, name)
        return values

    fsdp = isinstance(model, FSDPModule)  # fully_shard (FSDP2) averages the gradients over the replicas
    if fsdp and context.pipeline_parallel_size > 1:
        raise NotImplementedError(
            f"{type(model).__name__} is wrapped by fully_shard (FSDP2) at pipeline_parallel_size="
            f"{context.pipeline_parallel_size}: FSDP2 composes with oslo's tensor parallelism at "
            "pipeline_parallel_size=1 (any tensor- and data-parallel size). With pipelines, wrap the model in "
            "DistributedDataParallel(model.gpu_modules(), process_group=model.mpu.get_data_parallel_group())."
        )
    if context.pipeline_parallel_size == 1:
        divisors = None
        averages_itself = has_loss_inputs and loss_accounting.averages_replicas_itself(model, ddp, fsdp)
        engine = active_deepspeed_engine(context)
        if engine is not None:
            check_engine(engine, pipeline=False)
        averaged = ddp is not None or fsdp or averages_itself or engine is not None  # DeepSpeed averages too
        if averaged and torch.is_grad_enabled() and has_loss_inputs and loss_items is not None \
                and num_items_in_batch is None and context.data_parallel_size > 1:
            # DDP averages: a share of the global mean
            divisors = loss_accounting.step_divisors(context, loss_items, [batch])
        if torch.compiler.is_compiling():  # the compiled backward calls eager code (oslo.parallel.traced)
            on_backward = loss_accounting.traced_on_backward(model, has_loss_inputs, averages_itself)
        else:
            on_backward = loss_accounting.overflow_agreement(model, loss_accounting.computes_in_half(model)) \
                if has_loss_inputs else None
            if averages_itself:
                on_backward = loss_accounting.both(loss_accounting.replica_averaging(model), on_backward)
        if body is model:  # the head class is its own body (T5ForConditionalGeneration): run its steps
            outputs = body.run(body.prepare(**inputs, cache=cache, use_cache=use_cache, return_dict=True,
                                            **body_kwargs))
        else:
            outputs = body(**inputs, cache=cache, use_cache=use_cache, return_dict=True, **body_kwargs)
        values = head(outputs, inputs, head_inputs, True)
        loss_accounting.average_losses(values, batch, loss_items, num_items_in_batch, divisors, on_backward)
        if not has_loss_inputs and loss_accounting.averages_replicas_itself(model, ddp, fsdp) \
                and not torch.compiler.is_compiling():
            # The caller computes the loss from the outputs (transformers' Trainer with label smoothing or a
            # compute_loss_func pops the labels): the backward through them averages over the replicas too.
            watched = next((value for value in values.values()
                            if isinstance(value, torch.Tensor) and value.requires_grad), None)
            if watched is not None:
                watched.register_hook(loss_accounting.replica_averaging(model))
        output = output_class(**with_body_fields(values, outputs))
        return output if return_dict else output.to_tuple()

    # Per-layer outputs asked for (hidden states, attentions): each stage has its layers' share.
    per_layer_fields = [name for name in body.per_layer_outputs if name in fields]
    stage_outputs: dict[int, dict[str, tuple]] = {}  # stage (virtual, under an interleaved schedule): its share
    last_stage = context.pipeline_parallel_size * context.virtual_pipeline_size - 1

    def run_stage(batch: dict, received, cache, outputs_needed: bool, divisors=None, stage: int = 0,
                  states: dict | None = None):
        """Run stage ``stage``; a pass's stages on one rank (an interleaved schedule's) share the ``states`` of
        the body's ``prepare``, whose positions read the cache before any of them adds to it."""
        body_inputs = {name: batch.get(name) for name in inputs}
        last = stage == last_stage
        with model._model_call(), running_stage(model, stage):  # a part of this call: no input check
            state = states.get("state") if states is not None else None
            if state is None:
                state = body.prepare(**body_inputs, cache=cache, use_cache=cache is not None,
                                     return_dict=True, **body_kwargs)
                if states is not None:
                    states["state"] = state
            marks = {name: len(getattr(state, name, None) or ()) for name in per_layer_fields}
            payload = body.run_layers(body.embed(state) if received is None else received, state)
            outputs = body.finish(payload, state) if last else None
        stage_outputs[stage] = {name: getattr(state, name)[marks[name]:] for name in per_layer_fields
                                if getattr(state, name, None) is not None}
        if not last:
            return payload
        values = head(outputs, body_inputs, {name: batch.get(name) for name in head_inputs}, outputs_needed)
        if outputs_needed:  # the body's own fields the head leaves (T5's encoder_last_hidden_state)
            values = with_body_fields(values, outputs)
        return loss_accounting.average_losses(values, batch, loss_items, num_items_in_batch, divisors)

    def wrap(output):
        return output if return_dict else output.to_tuple()

    def asked(name: str) -> bool:
        """Whether the call asks for the per-layer output ``name`` (its flag given, or the config's)."""
        flag = "output_hidden_states" if "hidden_states" in name else "output_attentions"
        return bool(body_kwargs[flag] if body_kwargs.get(flag) is not None else getattr(model.config, flag, False))

    if torch.is_grad_enabled() and all(head_inputs.get(name) is not None for name in model._pipeline_loss_inputs):
        if cache is not None or any(asked(name) for name in per_layer_fields):
            raise NotImplementedError(
                "a KV cache (cache=), output_hidden_states and output_attentions are not supported in a pipeline "
                "training step (its micro-batch outputs hold the loss); run the model under torch.no_grad() "
                "for them."
            )
        micro_batches = split_micro_batches(batch, model.micro_batch_size)
        check_interleaved(context.pipeline_parallel_size, context.virtual_pipeline_size, len(micro_batches))
        divisors = None
        if context.is_pipeline_last_stage() and loss_items is not None and num_items_in_batch is None:
            divisors = loss_accounting.step_divisors(context, loss_items, micro_batches)
        # DeepSpeed's engine averages over the replicas itself, once the step's gradients are complete.
        engine = active_deepspeed_engine(context)
        if engine is not None:
            hold_reduction(engine, check_only=True)  # refused layouts fail at the call, on every rank
        average_replicas = engine is None
        if ddp is not None:
            # DDP would average after the first micro-batch's backward only: the pipeline averages
            # after the last one instead, and DDP's reducer stays out of this step (inside DDP's
            # no_sync(), neither averages, as DDP would not).
            average_replicas = ddp.require_backward_grad_sync
            ddp.require_backward_grad_sync = False
            model._ddp_sync_to_restore = (ddp, average_replicas)
        half = loss_accounting.computes_in_half(model)

        def steps():
            restore = model.__dict__.pop("_ddp_sync_to_restore", None)
            if restore is not None:  # DDP's forward has returned: its flag is the user's again
                restore[0].require_backward_grad_sync = restore[1]
            reduce = model.pipeline_gradient_reduction(average_replicas, half)
            if engine is not None:
                hold_reduction(engine)

            def after_step(scaled: bool) -> None:
                reduce(scaled)
                if engine is not None:
                    reduce_now(engine)

            yield from pipeline_schedule(
                context,
                len(micro_batches),
                lambda i, received, stage: run_stage(micro_batches[i], received, None, False, divisors, stage),
                micro_output=lambda values, loss: wrap(output_class(loss=loss)),
                last_stage_loss=lambda values: values["loss"],
                after_step=after_step,
                timeline=model.pipeline_timeline,
                payload=body.stage_payload,
            )

        return PipelineStep(steps(), context)

    # One pass without gradients. Each stage caches its own layers' keys and values (bodies that cache).
    use_cache = CACHE_FIELD in fields and body.builds_cache() and (
        use_cache if use_cache is not None else model.config.use_cache)
    if use_cache and cache is None:
        cache = model._new_cache()
    if use_cache:
        # The positions cached so far, recorded alike on every stage: a stage may hold no layer that caches
        # (T5's encoder stages), and the input check compares this count across the stages.
        cache._oslo_positions = cached_positions(cache) + body.cached_positions(inputs)
    names = [name for name in fields if name not in per_layer_fields and name != CACHE_FIELD]
    states: dict = {}
    values = pipeline_pass(context, lambda received, stage: run_stage(batch, received, cache, True, stage=stage,
                                                                      states=states),
                           names, payload=body.stage_payload, first_stage=body.first_pass_stage(inputs, body_kwargs))
    # The fields asked for, alike on every stage (a stage may have run no layer: T5's encoder stages when its
    # output is given); a field no stage has stays None.
    link = StageLink(context)
    values.update({name: link.gather_stages({stage: outputs[name] for stage, outputs in stage_outputs.items()
                                             if name in outputs}) for name in per_layer_fields if asked(name)})
    if torch.is_grad_enabled() and any(param.requires_grad for param in model.parameters()):
        # transformers' outputs would carry gradients into the model here; these cannot (see the class).
        size = context.pipeline_parallel_size
        values = {name: _refuse_stage_gradients(value, size) for name, value in values.items()}
    if CACHE_FIELD in fields:
        values[CACHE_FIELD] = cache if use_cache else None
    return wrap(output_class(**values))


def pipelined_body_call(model: OsloPreTrainedModel, *args, **kwargs):
    """A body called by the user under pipeline parallelism: one pass without gradients over every
    stage (the body's own ``forward`` is single-device code); every stage returns the output."""
    bound = inspect.signature(model.forward).bind(*args, **rename_legacy_cache(dict(kwargs)))
    arguments = dict(bound.arguments)
    arguments.update(arguments.pop("kwargs", {}))
    options = {"cache", "use_cache", "return_dict"}
    inputs = {name: value for name, value in arguments.items()
              if name not in options and (value is None or isinstance(value, torch.Tensor))}
    body_kwargs = {name: value for name, value in arguments.items() if name not in options and name not in inputs}
    per_layer = set(model.per_layer_outputs) | {CACHE_FIELD}

    def head(outputs, inputs, head_inputs, outputs_needed):
        return {name: value for name, value in outputs.items() if name not in per_layer}

    return forward_with_head(
        model, model, inputs, {}, head, model.output_class,
        cache=arguments.get("cache"), use_cache=arguments.get("use_cache"),
        return_dict=arguments.get("return_dict"), body_kwargs=body_kwargs,
    )
