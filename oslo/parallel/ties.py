"""Weights tied across pipeline stages: which parameters a model ties, which of them a stage holds apart from
their twins on other stages, and how the copies' gradients are summed so that every copy trains as the single
tied weight would.

Under pipeline parallelism a tie may span stages (GPT2's ``wte`` on the first, ``lm_head`` on the last; T5's
shared embedding, its decoder's copy and ``lm_head`` on up to three). The members a stage holds share one
parameter; the stages' copies start equal (initialization seeds a copy as its source) and get equal gradients
(:func:`pipeline_gradient_reduction`). Checkpoints, clipping and resharding read the same maps from here.

Every function takes the model (an :class:`~oslo.models.base.OsloPreTrainedModel`, a pipeline stage of it);
the model's public methods of the same names delegate to them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from oslo.parallel.agreement import agree_on_nonfinite_gradients
from oslo.parallel.data_parallel import average_over_replicas
from oslo.parallel.dtensor import current_grad, trained_grad


def tie_families(model: nn.Module) -> dict[str, list[str]]:
    """``{source: [targets]}`` of the model's weight ties, sub-models' included, as full parameter names
    (whichever stage holds them): GPT2's ``{"transformer.wte.weight": ["lm_head.weight"]}``, T5's
    ``shared.weight`` with the encoder's and the decoder's ``embed_tokens`` and ``lm_head``. Ties hold only
    where the (sub-)model's config ties word embeddings, as in transformers."""
    families: dict[str, list[str]] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, PreTrainedModel) or not getattr(module.config, "tie_word_embeddings", False):
            continue
        dot = f"{prefix}." if prefix else ""
        for target, source in (module._tied_weights_keys or {}).items():
            targets = families.setdefault(dot + source, [])
            if dot + target not in targets:
                targets.append(dot + target)
    return families


def tie_targets(model: nn.Module) -> set[str]:
    """Every tie target's full name (see :func:`tie_families`), computed once per model: ties are fixed
    when the model is built."""
    targets = model.__dict__.get("_tie_targets_cache")
    if targets is None:
        targets = {target for members in tie_families(model).values() for target in members}
        model.__dict__["_tie_targets_cache"] = targets
    return targets


def stage_tied_weights_keys(model: nn.Module) -> dict:
    """transformers' ``get_expanded_tied_weights_keys`` for a pipeline stage: ``{member: the member it
    shares}`` among the members of each tie this stage holds (the source if held here, else the first
    target). oslo's tie keys are plain parameter names: they are not expanded as patterns (transformers would
    look up both ends among this stage's parameters, and fail when one is on another stage)."""
    if not getattr(model.config, "tie_word_embeddings", False) or not model._tied_weights_keys:
        return {}
    local = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    families: dict[str, list[str]] = {}
    for target, source in model._tied_weights_keys.items():
        families.setdefault(source, []).append(target)
    tied = {}
    for source, targets in families.items():
        members = [name for name in [source, *sorted(targets)] if name in local]
        tied.update({member: members[0] for member in members[1:]})
    return tied


def cross_stage_tied_weights(model: nn.Module) -> dict[str, str]:
    """``{local parameter: the name of a tied twin on another stage}`` (empty without pipelines).

    A tie target's twin is its source (``lm_head.weight``: ``transformer.wte.weight``), which the
    checkpoints hold; a source's twin is a target held elsewhere. The stages' copies start equal and get
    the same gradients. Ties whose members are all on this stage (BERT's decoder bias and
    ``cls.predictions.bias``) share one parameter and are not listed.
    """
    if model.parallel_context.pipeline_parallel_size == 1:
        return {}
    local = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    twins = {}
    for source, targets in sorted(tie_families(model).items()):
        elsewhere = [name for name in [source, *sorted(targets)] if name not in local]
        if not elsewhere:
            continue
        for member in [source, *targets]:
            if member in local:
                twins[member] = source if source not in local else elsewhere[0]
    return twins


def cross_stage_tied_copies(model: nn.Module) -> dict[str, str]:
    """``{copy: source}`` for this stage's tie targets whose source is on another stage (GPT2's
    ``lm_head.weight`` on the last stage). Merged checkpoints leave them out, as transformers leaves
    out tied weights; gradient clipping counts them once; initialization copies the source."""
    twins = cross_stage_tied_weights(model)
    return {name: twin for source, targets in tie_families(model).items() for name in targets
            if (twin := twins.get(name)) == source}


def build_tie_groups(model: nn.Module) -> None:
    """For every tie whose members sit on several pipeline stages, the group of those stages (see
    :meth:`~oslo.parallel.context.ParallelContext.stage_group`), over which the copies sum their
    gradients; kept on the model as ``_tie_groups``. The stages tell each other which ties they hold (one
    small all-gather), so the groups follow what each stage built."""
    model._tie_groups: dict[str, tuple[tuple[int, ...], object]] = {}
    context = model.parallel_context
    if context.pipeline_parallel_size == 1:
        return
    local = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    families = tie_families(model)
    held = sorted(source for source, targets in families.items() if any(m in local for m in [source, *targets]))
    stages: list = [None] * context.pipeline_parallel_size
    dist.all_gather_object(stages, held, group=context.pipeline_parallel_group)
    for source in sorted(families):
        holders = tuple(stage for stage, sources in enumerate(stages) if source in sources)
        if len(holders) > 1:
            model._tie_groups[source] = (holders, context.stage_group(holders))


def agree_on_freezing(tied: list[tuple[torch.Tensor, object]], context) -> None:
    """Freeze or unfreeze every copy of a weight tied across stages when one was: in transformers the copies are
    one parameter, so ``model.get_input_embeddings().weight.requires_grad_(False)`` (which only the first stage
    can run) freezes GPT2's ``lm_head`` too. At the start of a step each stage tells the others whether its copy
    changed since the last step (all copies start each step alike, so a change goes one way)."""
    for param, group in tied:
        agreed = getattr(param, "_oslo_agreed_requires_grad", True)
        changed = torch.tensor([int(param.requires_grad != agreed)], device=context.device)
        dist.all_reduce(changed, group=group, op=dist.ReduceOp.MAX)
        if changed.item():
            param.requires_grad_(not agreed)
            if agreed:  # frozen now: no gradient left for an optimizer to apply
                param.grad = None
        param._oslo_agreed_requires_grad = param.requires_grad


def pipeline_gradient_reduction(
    model: nn.Module, average_replicas: bool = True, half: bool = False
) -> Callable[[bool], None]:
    """What ends a pipeline step once every micro-batch is backpropagated (the schedule calls it).

    Returns a function ``reduce(scaled)`` that (1) sums the gradients a step added to the copies of a
    weight tied across stages (over the stages that hold it), so every copy gets the gradient the single
    tied weight would, (2) averages gradients over the data-parallel group, as
    ``DistributedDataParallel`` would (unless ``average_replicas=False``: inside DDP's ``no_sync()``),
    and (3) makes the ranks of the model agree on non-finite gradients, so that a gradient scaler skips
    the step on all of them or on none (each rank looks for them when ``half`` (float16 compute) or
    ``scaled`` (a backward seeded by a loss scale)). Gradients accumulated before the step (several
    batches per optimizer step) are not counted twice: the snapshot of the tied gradients is taken now,
    at the start of the step.
    """
    context = model.parallel_context
    # under the model's own names: a PEFT adapter wrapping a tied layer (an LM head) holds its weight as base_layer,
    # PEFT's modules_to_save as original_module (beside the trained copy, which no tie holds)
    parameters = {name.replace(".base_layer.", ".").replace(".original_module.", "."): param
                  for name, param in model.named_parameters(remove_duplicate=False)}
    families = tie_families(model)
    tied = []  # (parameter, group): this stage's one parameter of each tie held on several stages
    for source, (holders, group) in sorted(getattr(model, "_tie_groups", {}).items()):
        if context.pipeline_parallel_rank not in holders:
            continue
        member = next(name for name in [source, *sorted(families[source])] if name in parameters)
        tied.append((parameters[member], group))
    agree_on_freezing(tied, context)
    # (before any layer ran: a gradient the user's zero_grad cleared on the DTensor only is cleared here too)
    before = [grad.detach().clone() if (grad := current_grad(param)) is not None else None for param, _ in tied]

    def reduce(scaled: bool) -> None:
        for (param, group), previous in zip(tied, before, strict=True):
            if not param.requires_grad:  # frozen on every stage that holds it (agree_on_freezing)
                continue
            if trained_grad(param) is None:
                if getattr(param, "_oslo_plain_leaf", False):
                    param._oslo_storage.grad = torch.zeros_like(param._oslo_storage)
                else:
                    param.grad = torch.zeros_like(param)
            grad = trained_grad(param)
            dist.all_reduce(grad, group=group)
            if previous is not None:  # every holding stage added it
                grad.sub_(previous * (dist.get_world_size(group) - 1))
        grads = [grad for param in model.parameters() if (grad := trained_grad(param)) is not None]
        if average_replicas:
            average_over_replicas(grads, context)
        agree_on_nonfinite_gradients(grads, context, scan=half or scaled)

    return reduce
