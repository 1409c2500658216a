"""Which part of a model each pipeline stage holds.

A model file builds the whole model, as on one device: every layer in its :class:`StageLayers`, the
embeddings, the final norm, the heads. When the model's pipeline has several stages, :func:`assign_stage`
then measures that model and prunes it to this rank's stage:

* every parameter weighs its checkpoint size (a tensor-parallel shard counts whole, so every tensor-parallel
  size gives one partition), a weight tied within one place (T5's ``shared`` and ``encoder.embed_tokens``)
  once;
* a parameter inside a :class:`StageLayers` belongs to its layer; one registered before the first layer
  (the embeddings) to the first stage; one after the last (the final norm, the heads, a tied copy of the
  embeddings) to the last stage. Between two containers (an encoder-decoder), one of the first container's
  parent (T5's ``encoder.final_layer_norm``) goes with that container's last layer, any other (the decoder's
  ``embed_tokens``) with the next container's first layer;
* the layers are split into contiguous ranges, the largest stage (its layers and what comes with them) as
  small as it can be (:func:`~oslo.parallel.pipeline.partition_costs`); under an interleaved schedule
  (``virtual_pipeline_size`` = ``v``) into ``v x P`` ranges, the virtual stages, rank ``s`` holding
  ``s, s + P, ...``;
* the rank keeps its stage's layers (renumbered from slot 0 of its KV cache) and every module holding a
  parameter of its stage; any other module holding parameters becomes ``None``.

A call runs one virtual stage at a time inside :func:`running_stage`.

The model is built once (on the meta device by ``from_pretrained_with_parallel``: nothing is allocated
before the pruning) and constructors never ask which stage they build.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

from torch import nn

from oslo.parallel import ties
from oslo.parallel.context import validate_parallel_size
from oslo.parallel.pipeline import StageLayers, partition_costs
from oslo.parallel.plan import parameter_specs

__all__ = ["assign_stage", "running_stage", "stage_ranges"]

_BEFORE, _AFTER = "before", "after"


def _containers(model: nn.Module) -> dict[str, StageLayers]:
    """The model's :class:`StageLayers` by name, in construction order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, StageLayers)}


def _checkpoint_sizes(model: nn.Module) -> dict[str, int]:
    """Every parameter name (tied duplicates included) mapped to the element count of its checkpoint tensor."""
    named = dict(model.named_parameters())
    specs = {id(named[name]): spec for name, spec in parameter_specs(model).items()}
    sizes = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        spec = specs.get(id(param))
        sizes[name] = math.prod(spec.global_shape(param.shape)) if spec is not None else param.numel()
    return sizes


def _places(model: nn.Module, containers: dict[str, StageLayers]) -> dict[str, int | str]:
    """Every parameter name mapped to its global layer index (over the containers, in order), or to
    ``"before"`` / ``"after"`` the layers."""
    offsets, total = {}, 0
    for name, container in containers.items():
        offsets[name] = total
        total += container.num_layers
    places: dict[str, int | str] = {}
    between: list[str] = []  # parameters waiting for the next container's first layer
    last = None
    for name, _ in model.named_parameters(remove_duplicate=False):
        container = next((c for c in containers if name.startswith(c + ".")), None)
        if container is not None:
            places.update(dict.fromkeys(between, offsets[container]))
            between, last = [], container
            places[name] = offsets[container] + int(name[len(container) + 1:].split(".")[0])
        elif last is None:
            places[name] = _BEFORE
        elif len(containers) > 1 and name.startswith(last.rpartition(".")[0] + "."):
            places[name] = offsets[last] + containers[last].num_layers - 1
        else:
            between.append(name)
    places.update(dict.fromkeys(between, _AFTER))
    return places


def stage_ranges(model: nn.Module, pipeline_parallel_size: int) -> list[range]:
    """The layers each of ``pipeline_parallel_size`` stages holds, for the whole (unpruned) ``model``: one
    ``range`` of global layer indices per stage, over its :class:`StageLayers` in construction order."""
    num_stages = validate_parallel_size("pipeline_parallel_size", pipeline_parallel_size)
    containers = _containers(model)
    if num_stages == 1:
        return [range(sum(container.num_layers for container in containers.values()))]
    return _partition(model, containers, _places(model, containers), num_stages)


def _partition(model: nn.Module, containers: dict[str, StageLayers], places: dict[str, int | str],
               num_stages: int) -> list[range]:
    """:func:`stage_ranges` at several stages, the parameters' ``places`` given."""
    costs = [0.0] * sum(container.num_layers for container in containers.values())
    extra = {_BEFORE: 0.0, _AFTER: 0.0}
    sizes = _checkpoint_sizes(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    family = {member: source for source, targets in ties.tie_families(model).items() for member in (source, *targets)}
    counted = set()  # (weight, place): a weight tied within a place is held there once, tied yet or not
    for name, place in places.items():
        weight = family.get(name, id(params[name]))
        if (weight, place) in counted:
            continue
        counted.add((weight, place))
        if isinstance(place, int):
            costs[place] += sizes[name]
        else:
            extra[place] += sizes[name]
    return partition_costs(costs, num_stages, extra[_BEFORE], extra[_AFTER])


def assign_stage(model: nn.Module) -> None:
    """Prune the whole ``model`` to its pipeline stage (see the module's docstring) and record every stage's
    layers as ``pipeline_stages`` on the modules that declare that attribute (the model and its bodies).
    Without pipelines nothing is pruned."""
    context = model.parallel_context
    containers = _containers(model)
    if context.pipeline_parallel_size == 1:
        _record(model, stage_ranges(model, 1))
        return
    size, chunks = context.pipeline_parallel_size, context.virtual_pipeline_size
    layers = sum(container.num_layers for container in containers.values())
    if chunks > 1 and layers < size * chunks:
        raise ValueError(
            f"virtual_pipeline_size={chunks} x pipeline_parallel_size={size} = {size * chunks} virtual stages, but "
            f"{type(model).__name__} has {layers} layers: every virtual stage needs at least one. Use "
            f"virtual_pipeline_size <= {max(layers // size, 1)}."
        )
    places = _places(model, containers)
    ranges = _partition(model, containers, places, size * chunks)
    _record(model, ranges)
    stage = context.pipeline_parallel_rank
    rank_of = {layer: index % size for index, layers in enumerate(ranges) for layer in layers}
    owners = {name: 0 if place == _BEFORE else (len(ranges) - 1) % size if place == _AFTER else rank_of[place]
              for name, place in places.items()}
    mine, offset = {layer for layer, rank in rank_of.items() if rank == stage}, 0
    for container in containers.values():
        container.keep({layer - offset for layer in mine if offset <= layer < offset + container.num_layers})
        offset += container.num_layers
    _prune(model, "", owners, stage)


@contextlib.contextmanager
def running_stage(model: nn.Module, stage: int) -> Iterator[None]:
    """Within it, the model's :class:`StageLayers` hold (for iteration) only the layers of ``stage``, one of this
    rank's virtual stages under an interleaved schedule; without virtual stages, nothing changes."""
    ranges = model.pipeline_stages
    if ranges is None or len(ranges) == model.parallel_context.pipeline_parallel_size:
        yield
        return
    containers, offset = list(_containers(model).values()), 0
    for container in containers:
        container.running = range(ranges[stage].start - offset, ranges[stage].stop - offset)
        offset += container.num_layers
    try:
        yield
    finally:
        for container in containers:
            container.running = None


def _record(model: nn.Module, ranges: list[range]) -> None:
    for module in model.modules():
        if hasattr(module, "pipeline_stages"):
            module.pipeline_stages = ranges


def _prune(module: nn.Module, prefix: str, owners: dict[str, int], stage: int) -> None:
    for child_name, child in list(module.named_children()):
        if isinstance(child, StageLayers):
            continue
        full = prefix + child_name
        if any(isinstance(inner, StageLayers) for inner in child.modules()):
            _prune(child, full + ".", owners, stage)
            continue
        names = [f"{full}.{name}" for name, _ in child.named_parameters(remove_duplicate=False)]
        if names and all(owners[name] != stage for name in names):
            setattr(module, child_name, None)
