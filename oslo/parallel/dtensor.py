"""Shards that say what they are: with several processes every parameter of an oslo model is a PyTorch
``DTensor`` on the tensor-parallel mesh (of size 1 too, so that a distributed checkpoint holds the same
tensors at every layout), and torch's own tools (``clip_grad_norm_``, distributed checkpointing, FSDP2,
``full_tensor()``) see the whole model's tensors, not one rank's slice under a full name.

The math stays oslo's. Each DTensor's local tensor is a view of a plain *storage* tensor — the layer's
own shard, with the zero rows that pad a vocabulary to a multiple of the tensor-parallel size — and the
layers compute on the storages: for the length of a module's forward its DTensors are swapped for
:func:`local` views of their storages, whose backward hands the gradient to the DTensor
(:class:`_LocalView`). Within a model call each parameter has one view, which every layer reading it shares,
with a :class:`GradientSink` that those layers add their weight gradients into (a tied embedding and LM head
fill one buffer). The forward is oslo's, with its 2 + 2 all-reduces per block; the DTensor is the
autograd leaf (``torch.autograd.grad``, tensor hooks and optimizers work on it as on any parameter), and
its gradient is a DTensor of the same layout.

How a shard maps to a DTensor:

* replicated parameter: ``Replicate()``;
* column/row split: ``Shard(dim)``, global shape the transformers one;
* vocabulary split: ``Shard(dim)`` of the *unpadded* vocabulary (torch's uneven sharding is oslo's: the
  first ranks hold ``ceil(V / tp)`` rows, the last the rest); the local tensor leaves the padding out;
* fused blocks (GPT2's ``c_attn``, ``[q | k | v]``, each split on its own): ``_StridedShard(dim, split_factor=3)``,
  PyTorch's strided sharding, of transformers' shape (``full_tensor()`` is the transformers weight). Distributed
  checkpointing cannot save such a slice (it is three pieces of the whole), so torch's state-dict functions show
  it to DCP as ``(.., 3, size / 3, ..)`` blocks sharded on the second (``Shard(dim + 1)``), views of the same
  memory; a model in one process shows its plain tensor the same way, so a state saved at any layout loads at
  any other (see :func:`install_torch_hooks`).

``DistributedDataParallel`` (and DeepSpeed) need plain tensors: :func:`plain_leaves_module`, what
``model.gpu_modules()`` returns, hands them the storages as parameters, the model computes on those from
then on, and every gradient they receive is mirrored into the DTensor's ``.grad`` (same memory), so
``clip_grad_norm_(model.parameters())`` and optimizers over ``model.parameters()`` still see the DTensors.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint.state_dict as _dcp_state_dict
import torch.nn.utils.clip_grad as _clip_grad
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.parallel import DistributedDataParallel

from oslo.parallel.context import ParallelContext
from oslo.parallel.data_parallel import refuse_dtensor_parameters
from oslo.parallel.mappings import copy_many_to_tensor_parallel
from oslo.parallel.plan import COLUMN, VOCAB, ShardSpec, parameter_specs

__all__ = [
    "device_mesh",
    "distribute_parameters",
    "GradientSink",
    "gradient_sink",
    "has_user_forward_hooks",
    "has_user_hooks",
    "is_distributed",
    "local",
    "local_named_parameters",
    "model_parameter_names",
    "plain",
    "plain_leaves_module",
    "PipelineStageNormError",
    "relink_storages",
    "shared_views",
    "trains_plain_leaves",
    "unblock",
    "undistribute_parameters",
]

# A state dict of GPT2 (``torch.save(model.state_dict())``) holds DTensors with ``_StridedShard`` placements; torch
# 2.13 lets ``torch.load(..., weights_only=True)`` rebuild them, 2.11 only its other placements. The same class made
# loadable on every torch (a placement is a dimension and a split factor: nothing to run).
if _StridedShard not in torch.serialization.get_safe_globals():
    torch.serialization.add_safe_globals([_StridedShard])

# Megatron-LM's parameter attributes, read by DeepSpeed (its gradient norm through ``mpu``), apex and NeMo.
_MEGATRON_REPLICATED = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def device_mesh(context: ParallelContext) -> DeviceMesh:
    """The ``DeviceMesh`` of this rank's pipeline stage, dimensions ``("dp", "tp")``, built on the context's
    own groups (no new communicator). Parameters live on ``mesh["tp"]``; FSDP2 shards over ``mesh["dp"]``."""
    mesh = context.__dict__.get("_device_mesh")
    if mesh is None:
        p = context.pipeline_parallel_rank
        ranks = torch.tensor([[context.global_rank(d, p, t) for t in range(context.tensor_parallel_size)]
                              for d in range(context.data_parallel_size)])
        mesh = DeviceMesh.from_group(
            [context.data_parallel_group, context.tensor_parallel_group], context.device.type,
            mesh=ranks, mesh_dim_names=("dp", "tp"),
        )
        context._device_mesh = mesh
        _probe_strided_sharding(mesh["tp"])
    return mesh


# Whether this torch redistributes a DTensor with PyTorch's strided sharding (``full_tensor()`` of GPT2's fused
# ``c_attn``). torch 2.11's graph-based redistribution planner reads every ``_StridedShard`` as a device order
# and refuses one on a 1-D mesh (a ValueError, "unable to be interpreted into a corresponding shard_order"),
# although its redistribution carries out ``_StridedShard -> Replicate`` (an all-gather, then the blocks put
# back in order); torch 2.13 plans such a one with its greedy planner instead. Where the planner refuses, oslo
# makes it fall back the same way (:func:`_plan_undecodable_strided_greedily`, the one change to torch's
# behaviour, and only for placements it refused). If the planner still refuses, fused parameters are DTensors of
# blocks (``(in, 3, n)``): ``full_tensor()`` then needs :func:`unblock` for transformers' shape.
_STRIDED_SHARDING = True


def _plans_strided_sharding(mesh: DeviceMesh) -> bool:
    """Whether the redistribution planner (no communication) plans gathering a strided-sharded vector on ``mesh``."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    meta = TensorMeta(torch.Size([3 * mesh.size()]), (1,), torch.float32)
    try:
        _gen_transform_infos_non_cached(DTensorSpec(mesh, (_StridedShard(0, split_factor=3),), meta),
                                        DTensorSpec(mesh, (Replicate(),), meta))
    except ValueError:
        return False
    return True


def _plan_undecodable_strided_greedily() -> None:
    """torch 2.13's answer to a ``_StridedShard`` that names no device order, on a torch that raises instead: the
    graph-based planner's ValueError becomes the greedy plan (what that torch does for every placement without
    ``_StridedShard``, and 2.13 for these)."""
    from torch.distributed.tensor._redistribute import DTensorRedistributePlanner

    graph_based = DTensorRedistributePlanner.generate_graph_based_transform_infos
    if getattr(graph_based, "_oslo_greedy_fallback", False):
        return

    @functools.wraps(graph_based)
    def planned(self, src_spec, dst_spec, *args, **kwargs):
        try:
            return graph_based(self, src_spec, dst_spec, *args, **kwargs)
        except ValueError as error:
            if "shard_order" not in str(error):
                raise
            return self.generate_greedy_transform_infos(src_spec, dst_spec)

    planned._oslo_greedy_fallback = True
    DTensorRedistributePlanner.generate_graph_based_transform_infos = planned


def _probe_strided_sharding(mesh: DeviceMesh) -> None:
    """Whether this torch plans strided sharding on ``mesh``, once per process (greedily where its graph-based planner
    refuses, see above); sets :data:`_STRIDED_SHARDING`."""
    global _STRIDED_SHARDING
    if getattr(_probe_strided_sharding, "done", False):
        return
    _probe_strided_sharding.done = True
    try:
        if _plans_strided_sharding(mesh):
            return
        _plan_undecodable_strided_greedily()
        _STRIDED_SHARDING = _plans_strided_sharding(mesh)
    except Exception:  # noqa: BLE001 - a torch before the graph-based planner (its redistribution handles
        # _StridedShard itself), or another private signature: keep strided sharding, the tests say if it works
        pass


def plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The local tensor of a DTensor (this rank's values, the same memory); anything else as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def trained_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient that training accumulates for ``param``, as a plain tensor: the storage's when the storage
    trains in the DTensor's place (``DistributedDataParallel``, DeepSpeed: they may clear or replace it without
    the DTensor knowing until the next call), else the local tensor of ``param.grad``."""
    if isinstance(param, DTensor) and getattr(param, "_oslo_plain_leaf", False):
        return param._oslo_storage.grad
    return plain(param.grad)


def current_grad(param: torch.Tensor) -> torch.Tensor | None:
    """:func:`trained_grad` as the next call will see it: a gradient cleared on one side of a storage that trains
    in its DTensor's place (the optimizer's ``zero_grad`` on the DTensor; DDP or DeepSpeed on the storage) is
    cleared on both first, as a layer does when it reads the parameter. For what reads a gradient before the
    layers run (a pipeline step's snapshot of its tied weights' gradients)."""
    if isinstance(param, DTensor) and getattr(param, "_oslo_plain_leaf", False):
        _sync_plain_leaf(param)
    return trained_grad(param)


def is_distributed(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (built with several processes)."""
    return bool(model.__dict__.get("_oslo_distributed", False))


# ---- one parameter ---------------------------------------------------------------------------------
def _local_of(storage: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The DTensor's local tensor: a view of ``storage`` without padding (fused blocks split on the first dimension
    unflattened, see :func:`_strided`)."""
    if spec is None:
        return storage
    if spec.kind == VOCAB:
        start, stop = spec.vocab_range()
        return storage.narrow(spec.dim, 0, stop - start)
    if _blocked(spec):
        return storage.unflatten(spec.dim, (spec.chunks, storage.size(spec.dim) // spec.chunks))
    return storage


def unblock(full: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """A whole tensor (``full_tensor()``) in transformers' shape: a fused parameter seen as blocks, flattened."""
    if _blocked(spec) and full.dim() > spec.dim + 1 and full.size(spec.dim) == spec.chunks:
        return full.flatten(spec.dim, spec.dim + 1)
    return full


def _strided(spec: ShardSpec | None) -> bool:
    """Whether a parameter is a fused one (blocks split one by one: GPT2's ``c_attn`` weight and bias), a DTensor of
    transformers' shape with PyTorch's strided sharding. (FSDP2 sees one split on its first dimension as blocks, see
    :func:`_fsdp_sees_blocks`.)"""
    return spec is not None and spec.chunks > 1 and _STRIDED_SHARDING


def _blocked(spec: ShardSpec | None) -> bool:
    """Whether a fused parameter is a DTensor of blocks (``(in, 3, n)``), where torch cannot plan strided sharding
    and the parameter is split (on one rank it is whole: a plain ``Shard`` of transformers' shape)."""
    return spec is not None and spec.chunks > 1 and not _STRIDED_SHARDING and spec.world_size > 1


def _placement_and_shape(storage: torch.Tensor, spec: ShardSpec | None) -> tuple[object, tuple[int, ...]]:
    if spec is None:
        return Replicate(), tuple(storage.shape)
    shape = list(storage.shape)
    shape[spec.dim] = spec.global_size
    if _strided(spec):  # each block split on its own: PyTorch's strided sharding, transformers' shape
        return _StridedShard(spec.dim, split_factor=spec.chunks), tuple(shape)
    if _blocked(spec):
        shape[spec.dim:spec.dim + 1] = [spec.chunks, spec.global_size // spec.chunks]
        return Shard(spec.dim + 1), tuple(shape)
    return Shard(spec.dim), tuple(shape)


def _megatron_attributes(spec: ShardSpec | None) -> dict[str, object]:
    if spec is None:
        return dict(_MEGATRON_REPLICATED)
    return {"tensor_model_parallel": True, "partition_dim": spec.dim, "partition_stride": spec.chunks}


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def _wrap(local: torch.Tensor, dt: DTensor) -> DTensor:
    """``local`` (shaped like ``dt``'s local tensor) as a DTensor of ``dt``'s layout."""
    return DTensor(local, dt._spec, requires_grad=False)


def _make_dtensor(storage: nn.Parameter, spec: ShardSpec | None, mesh: DeviceMesh) -> nn.Parameter:
    placement, shape = _placement_and_shape(storage, spec)
    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), storage.dtype)
    local = _local_of(storage.detach(), spec)
    dt = nn.Parameter(DTensor(local, DTensorSpec(mesh, (placement,), meta), requires_grad=storage.requires_grad),
                      requires_grad=storage.requires_grad)
    dt._oslo_storage = storage
    dt._oslo_spec = spec
    dt._oslo_plain_leaf = False
    for name, value in _megatron_attributes(spec).items():
        setattr(dt, name, value)
        setattr(storage, name, value)
    return dt


def _storage_gradient(dt: DTensor) -> torch.Tensor | None:
    """``dt.grad`` in the storage's shape (padding rows zero), or ``None``."""
    if dt.grad is None:
        return None
    storage, spec = dt._oslo_storage, dt._oslo_spec
    grad = plain(dt.grad)
    if spec is not None and spec.kind == VOCAB and grad.size(spec.dim) != storage.size(spec.dim):
        full = torch.zeros_like(storage)
        full.narrow(spec.dim, 0, grad.size(spec.dim)).copy_(grad)
        return full
    return grad.reshape(storage.shape)


def _graph_task() -> int:
    """The running backward pass (-1 outside one)."""
    return torch._C._current_graph_task_id()


class GradientSink:
    """The gradient of one local view, summed in place by the layers that compute on it.

    A layer whose weight is a view carrying a sink (:func:`gradient_sink`) hands its weight gradient to the sink
    instead of returning it, and the view's backward (:class:`_LocalView`) takes the sum. Within a model call
    every layer reading a parameter shares one view (:func:`shared_views`), so the contributions of a tied
    embedding and LM head land in one buffer: the head's weight gradient, into which the embedding adds its
    rows in place, instead of a dense embedding-sized gradient of mostly zeros and a second embedding-sized
    sum (two fresh buffers of the vocabulary's size per step, as plain autograd does).

    What a backward pass left behind that no view took (a ``torch.autograd.grad`` that stopped short of the
    view) belongs to that pass and is dropped by the next one."""

    __slots__ = ("grad", "task")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.task = -1

    def _current(self) -> torch.Tensor | None:
        task = _graph_task()
        if self.task != task:
            self.grad, self.task = None, task
        return self.grad

    def add(self, grad: torch.Tensor) -> None:
        """Add ``grad``, a tensor the caller made and hands over (it may become the sum)."""
        current = self._current()
        self.grad = grad if current is None else current.add_(grad)

    def index_add(self, index: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> None:
        """Add ``rows[i]`` to row ``index[i]`` of the sum (zeros shaped like ``like`` if nothing came yet)."""
        current = self._current()
        if current is None:
            current = self.grad = torch.zeros_like(like, memory_format=torch.contiguous_format)
        current.index_add_(0, index, rows.to(current.dtype))

    def take(self) -> torch.Tensor | None:
        grad = self._current()
        self.grad, self.task = None, -1
        return grad


def gradient_sink(weight: torch.Tensor) -> GradientSink | None:
    """The sink of a local view that layers hand their weight gradient to, if ``weight`` is one (see
    :class:`GradientSink`); ``None`` for anything else (a plain parameter, a storage that trains itself), and
    under ``torch.compile``, whose views have no sink (see :func:`local`)."""
    if torch.compiler.is_compiling():
        return None
    return getattr(weight, "_oslo_sink", None)


class _LocalView(torch.autograd.Function):
    """The storage of a DTensor parameter, to compute on; its gradient goes to the DTensor (the padding
    rows' part, zero, is dropped): the gradient that reached the view, plus what layers put in its sink."""

    @staticmethod
    def forward(ctx, dt: DTensor, sink: GradientSink) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.dt, ctx.sink = dt, sink
        return dt._oslo_storage.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> tuple[DTensor | None, None]:
        dt = ctx.dt
        total = ctx.sink.take()
        if grad is not None:
            total = grad if total is None else total.add_(grad)
        if total is None:
            return None, None
        return _wrap(_local_of(total, dt._oslo_spec), dt), None


class _Shared(threading.local):
    """``views``: id(DTensor) -> (DTensor, its view) during a model call, ``None`` outside one. Set in
    ``__init__``, which runs in each thread on its first use, so the attribute exists before any call: a compiled
    call guards on what it read, and an attribute first set by the first call would recompile the second."""

    def __init__(self) -> None:
        self.views: dict[int, tuple[DTensor, torch.Tensor]] | None = None


_shared = _Shared()


@contextmanager
def shared_views() -> Iterator[None]:
    """Within the block every layer computing on a DTensor parameter gets the same local view of it (one
    :class:`_LocalView`, one :class:`GradientSink`): what a model call runs in."""
    outer = _shared.views
    _shared.views = {} if outer is None else outer
    try:
        yield
    finally:
        _shared.views = outer


def _view(param: DTensor) -> torch.Tensor:
    views = _shared.views
    if views is not None:
        known = views.get(id(param))
        if known is not None and known[0] is param:
            return known[1]
    sink = GradientSink()
    view = _LocalView.apply(param, sink)
    view._oslo_sink = sink
    if views is not None:
        views[id(param)] = (param, view)
    return view


# ---- the model ---------------------------------------------------------------------------------------
def _mirror_gradient(storage: torch.Tensor) -> None:
    """Post-accumulate hook of a storage that ``DistributedDataParallel`` trains: its DTensor's ``.grad`` is a
    view of the storage's (DDP averages that one in place)."""
    dt = storage._oslo_dtensor
    if storage.grad is None:
        return
    current = dt.grad
    local = _local_of(storage.grad, dt._oslo_spec)
    if current is None or plain(current).data_ptr() != local.data_ptr() or plain(current).shape != local.shape:
        dt.grad = _wrap(local, dt)


def _sync_plain_leaf(dt: DTensor) -> None:
    """Before a call: the storage trains in ``dt``'s place; a gradient cleared on one side is cleared on both."""
    storage = dt._oslo_storage
    if storage.requires_grad != dt.requires_grad:
        storage.requires_grad_(dt.requires_grad)
    if dt.grad is None and storage.grad is not None:
        storage.grad = None
    elif storage.grad is None and dt.grad is not None:
        dt.grad = None


def _as_stored(tensor: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """A DTensor's local tensor in the layout the layer computes on: fused blocks flattened, the vocabulary
    padded to ``ceil(V / tp)`` rows (differentiable; the padding is a copy, on the ranks that pad only)."""
    if spec is None:
        return tensor
    if spec.chunks > 1 and tensor.dim() > spec.dim + 1 and tensor.size(spec.dim) == spec.chunks:
        return tensor.flatten(spec.dim, spec.dim + 1)
    if spec.kind == VOCAB and tensor.size(spec.dim) < spec.local_size:
        shape = list(tensor.shape)
        shape[spec.dim] = spec.local_size - tensor.size(spec.dim)
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=spec.dim)
    return tensor


def local(param: torch.Tensor, spec: ShardSpec | None = None) -> torch.Tensor:
    """The tensor to compute on for ``param``: for a DTensor parameter, a view of its storage whose gradient
    reaches the DTensor (the storage itself without gradients, or once ``DistributedDataParallel`` trains
    the storages); anything else as it is. A layer's own parameters are swapped for these during its
    forward; code that reads another module's parameter (a fused kernel taking ``c_proj.bias``) calls this.

    A DTensor that is not oslo's — the unsharded parameter ``fully_shard`` (FSDP2) gathers for the forward —
    is computed on through ``to_local()``, put in the layer's layout by ``spec``, its ``parallel_specs`` entry."""
    if not isinstance(param, DTensor):
        return param
    if not hasattr(param, "_oslo_storage"):
        return _as_stored(param.to_local(), spec)
    if torch.compiler.is_compiling() and not param._oslo_plain_leaf:
        # A traced call computes on ``to_local()`` (differentiable, its gradient a DTensor of the parameter's
        # layout): the compiler sums the gradients of a parameter read twice itself, without a sink.
        return _as_stored(param.to_local(), param._oslo_spec)
    if param._oslo_plain_leaf:
        _sync_plain_leaf(param)
        return param._oslo_storage
    if torch.is_grad_enabled() and param.requires_grad:
        return _view(param)
    return param._oslo_storage.detach()


def _swap_in(module: nn.Module, args) -> None:
    swapped = []
    specs = getattr(module, "parallel_specs", {})
    # Replicated parameters applied to sequence shards (oslo.parallel.sequence): each rank's gradient is its
    # shard's part, summed over the tensor-parallel group on the way back.
    summed, group = module.__dict__.get("_oslo_sequence_summed", ((), None))
    for name, param in module._parameters.items():
        if isinstance(param, DTensor):
            module._parameters[name] = local(param, specs.get(name))
            swapped.append((name, param))
    names = [name for name, _ in swapped if name in summed]
    if names:  # one all-reduce for the module's gradients (a norm's weight and bias arrive together)
        values = copy_many_to_tensor_parallel([module._parameters[name] for name in names], group)
        module._parameters.update(zip(names, values, strict=True))
    stack = module.__dict__.get("_oslo_swapped")
    if stack is None:  # (made when the module was distributed; not __dict__.setdefault: torch 2.11's Dynamo cannot)
        stack = module._oslo_swapped = []
    stack.append(swapped)


def _swap_out(module: nn.Module, args, output) -> None:
    stack = module.__dict__.get("_oslo_swapped")
    if stack:
        for name, param in stack.pop():
            module._parameters[name] = param


def has_user_hooks(module: nn.Module) -> bool:
    """Whether ``module`` itself (not its children) has a forward or forward-pre hook other than oslo's own, or
    a global one is registered: code that expects its ``forward`` to run (an adapter, a profiler, FSDP2's
    gathering of the parameters)."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return (any(hook is not _swap_in for hook in module._forward_pre_hooks.values())
            or any(hook is not _swap_out for hook in module._forward_hooks.values()))


def has_user_forward_hooks(model: nn.Module) -> bool:
    """Whether a forward hook other than oslo's own (which swaps the local views out) is registered on a module of
    ``model``, or globally: something that may keep a module's output."""
    if nn.modules.module._global_forward_hooks:
        return True
    return any(hook is not _swap_out for module in model.modules() for hook in module._forward_hooks.values())


class PipelineStageNormError(RuntimeError):
    """torch's gradient norm was asked for the gradients of one pipeline stage: it cannot see the others."""


def _refuse_stage_gradients(total_norm):
    """torch's ``clip_grad_norm_`` / ``get_total_norm`` (through ``torch.nn.utils.clip_grad._get_total_norm``,
    which every caller reaches: the Trainer, accelerate, a loop) wrapped so that the gradients of a pipeline
    stage raise instead of giving that stage's norm (each stage would clip by its own factor, silently)."""

    @functools.wraps(total_norm)
    def checked(tensors, *args, **kwargs):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for tensor in tensors:
            if isinstance(tensor, DTensor) and getattr(tensor.device_mesh, "_oslo_pipeline_stage", None):
                raise PipelineStageNormError(
                    f"torch's gradient norm (torch.nn.utils.clip_grad_norm_) was given the gradients of one "
                    f"pipeline stage ({tensor.device_mesh._oslo_pipeline_stage}): it would return that stage's "
                    "norm and clip every stage by a different factor. Clip with model.clip_grad_norm_(max_norm), "
                    "which adds every stage's share and returns the whole model's norm on every rank."
                )
        return total_norm(tensors, *args, **kwargs)

    checked._oslo_checks_stages = True
    return checked


def _optimizer_state_by_name(verify_options):
    """torch's ``get_state_dict`` / ``set_state_dict`` (through ``_verify_options``, which both reach) with the
    optimizer's hyperparameters keyed by parameter name for oslo models — torch's
    ``flatten_optimizer_state_dict=True``, its setting for pipelines — at every layout, so that PyTorch's
    recipe, unchanged, saves and resumes across pipeline layouts: unflattened, each stage's parameter group
    lists other parameters under the same key, and DCP would keep one stage's list for all of them.

    Not where a parameter group is empty (transformers' ``Trainer`` makes one for the parameters without weight
    decay, which a PEFT adapter lacks): the flattened form keys a group's hyperparameters by its parameters, so an
    empty group's are lost, and torch cannot rebuild the groups (``IndexError``)."""

    @functools.wraps(verify_options)
    def verified(model, optims=(), *args, **kwargs):
        info = verify_options(model, optims, *args, **kwargs)
        empty_group = any(not group["params"] for optimizer in optims for group in optimizer.param_groups)
        if _is_oslo_model(model) and not empty_group:  # in one process too: one set of keys at every layout
            info.flatten_optimizer_state_dict = True
        return info

    verified._oslo_flattens = True
    return verified


def _is_oslo_model(model: nn.Module) -> bool:
    return getattr(model, "parallel_context", None) is not None and hasattr(model, "_oslo_traced_key")


def _fused(model: nn.Module) -> dict[str, ShardSpec]:
    """The parameters of an oslo model stored as blocks split one by one (GPT2's fused ``c_attn``): name -> spec.
    Empty for other models."""
    if not _is_oslo_model(model):
        return {}
    if isinstance(model, _PlainLeaves):  # gpu_modules(): the model's storages, under their own names
        return {_leaf_name(name): spec for name, spec in _fused(model._modules["module"]).items()}
    specs = parameter_specs(model)
    for name, param in model.named_parameters():  # a PEFT model's adapters: their own DTensors say how they split
        if specs.get(name) is None and isinstance(param, DTensor):
            specs[name] = getattr(param, "_oslo_spec", None)
    return {name: spec for name, spec in specs.items() if _strided(spec) or _whole_fused(spec)
            or (spec is not None and spec.chunks > 1 and not is_distributed(model))}


def _whole_fused(spec: ShardSpec | None) -> bool:
    """A fused parameter on one rank where torch cannot plan strided sharding: a ``Shard`` of transformers' shape,
    which DCP sees as blocks too (as a split model's are there), so that a state saved at one layout loads at any."""
    return spec is not None and spec.chunks > 1 and spec.world_size == 1 and not _STRIDED_SHARDING


def _blocks_shape(shape, spec: ShardSpec) -> tuple[int, ...]:
    shape = list(shape)
    shape[spec.dim:spec.dim + 1] = [spec.chunks, shape[spec.dim] // spec.chunks]
    return tuple(shape)


def _as_blocks(tensor, spec: ShardSpec, ndim: int):
    """A fused parameter's tensor (the weight, an optimizer moment) as DCP sees it: ``(.., chunks, n, ..)``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != ndim:
        return tensor
    if isinstance(tensor, DTensor):
        local = tensor._local_tensor
        shape = _blocks_shape(tensor.shape, spec)
        return DTensor.from_local(local.unflatten(spec.dim, (spec.chunks, local.size(spec.dim) // spec.chunks)),
                                  tensor.device_mesh, [Shard(spec.dim + 1)], run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))
    return tensor.unflatten(spec.dim, (spec.chunks, tensor.size(spec.dim) // spec.chunks))


def _as_stored_blocks(tensor, spec: ShardSpec, ndim: int):
    """The inverse of :func:`_as_blocks`."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != ndim + 1:
        return tensor
    if isinstance(tensor, DTensor):
        local = tensor._local_tensor
        shape = list(tensor.shape)
        shape[spec.dim:spec.dim + 2] = [shape[spec.dim] * shape[spec.dim + 1]]
        placement = Shard(spec.dim) if _whole_fused(spec) else _StridedShard(spec.dim, split_factor=spec.chunks)
        return DTensor.from_local(local.flatten(spec.dim, spec.dim + 1), tensor.device_mesh, [placement],
                                  run_check=False,
                                  shape=tuple(shape), stride=_contiguous_stride(shape))
    return tensor.flatten(spec.dim, spec.dim + 1)


def _map_fused(model: nn.Module, state: dict, optimizer: bool, convert) -> dict:
    """``state`` (a model's or an optimizer's DCP state dict, flattened or not) with every fused parameter's tensors
    (the weight; Adam's moments) passed through ``convert(tensor, spec, the parameter's ndim)``."""
    fused = _fused(model)
    if not fused:
        return state
    ndims = {name: param.dim() for name, param in model.named_parameters()}
    blocks = {name for name, param in model.named_parameters() if getattr(param, "_oslo_blocks", False)}
    state = dict(state)
    for name, spec in fused.items():
        if name in blocks:  # seen as blocks already (under FSDP2)
            continue
        if optimizer and isinstance(state.get("state"), dict):  # not flattened: {"state": {name: {key: tensor}}}
            if name in state["state"]:
                state["state"] = {**state["state"], name: {key: convert(value, spec, ndims[name])
                                                           for key, value in state["state"][name].items()}}
        elif optimizer:
            prefix = f"state.{name}."
            for key in [key for key in state if key.startswith(prefix)]:
                state[key] = convert(state[key], spec, ndims[name])
        elif name in state:
            state[name] = convert(state[name], spec, ndims[name])
    return state


def _fused_as_blocks(get_model, load_model, get_optimizer, load_optimizer):
    """torch's state-dict functions with an oslo model showing its fused parameters (and their optimizer state) as
    blocks, views of the same memory (see the module docstring): DCP can save a split model's slices of them, and a
    state saved at any layout, one process included, loads at any other (``dcp.load`` fills the views; loading
    turns them back)."""

    @functools.wraps(get_model)
    def get_model_blocks(model, *args, **kwargs):
        return _map_fused(model, get_model(model, *args, **kwargs), False, _as_blocks)

    @functools.wraps(load_model)
    def load_model_blocks(model, state_dict, *args, **kwargs):
        return load_model(model, _map_fused(model, state_dict, False, _as_stored_blocks), *args, **kwargs)

    @functools.wraps(get_optimizer)
    def get_optimizer_blocks(model, *args, **kwargs):
        return _map_fused(model, get_optimizer(model, *args, **kwargs), True, _as_blocks)

    @functools.wraps(load_optimizer)
    def load_optimizer_blocks(model, optimizers, state_dict, *args, **kwargs):
        return load_optimizer(model, optimizers, _map_fused(model, state_dict, True, _as_stored_blocks), *args,
                              **kwargs)

    for function in (get_model_blocks, load_model_blocks, get_optimizer_blocks, load_optimizer_blocks):
        function._oslo_blocks = True
    return get_model_blocks, load_model_blocks, get_optimizer_blocks, load_optimizer_blocks


def _fsdp_sees_blocks(init):
    """FSDP2 (``fully_shard``) shards a parameter's first dimension over the data-parallel mesh, and cannot compose
    that with a strided sharding of the same dimension (``full_tensor()`` comes out in the wrong order). A fused
    parameter split on its first dimension (GPT2's ``c_attn.bias``, a LoRA ``B`` of ``c_attn``) is therefore handed to
    it as blocks, ``(chunks, size / chunks, ..)`` sharded on the second (a view of the same memory), and the module
    holds that view from then on: under FSDP2 such a parameter has the shape DCP sees, not transformers'."""

    @functools.wraps(init)
    def init_with_blocks(self, param, module_info, *args, **kwargs):
        spec = getattr(param, "_oslo_spec", None)
        if isinstance(param, DTensor) and _strided(spec) and spec.dim == 0:
            blocks = nn.Parameter(_as_blocks(param, spec, param.dim()), requires_grad=param.requires_grad)
            blocks._oslo_blocks = True
            for module, name in zip([module_info.module, *module_info.shared_modules],
                                    [module_info.param_name, *module_info.shared_param_names], strict=True):
                module._parameters[name] = blocks
            param = blocks
        return init(self, param, module_info, *args, **kwargs)

    init_with_blocks._oslo_blocks = True
    return init_with_blocks


def _strided_as_blocks(value):
    """A DTensor strided-sharded on a 1-D mesh (a fused parameter of a plain ``model.state_dict()``, its optimizer
    moments) as DCP can save it: the blocks view of :func:`_as_blocks`, same memory; anything else as it is."""
    if not isinstance(value, DTensor) or value.device_mesh.ndim != 1:
        return value
    placement = value.placements[0]
    if not isinstance(placement, _StridedShard):
        return value
    dim, chunks = placement.dim, placement.split_factor
    if value.shape[dim] % chunks or value._local_tensor.size(dim) % chunks:
        return value
    mesh = value.device_mesh
    spec = ShardSpec(COLUMN, dim, value.shape[dim], mesh.size(), mesh.get_local_rank(), chunks)
    return _as_blocks(value, spec, value.dim())


def _planner_sees_blocks(set_up_planner):
    """DCP's default save and load planners with every strided-sharded DTensor of the (flattened) state dict seen as
    blocks: ``dcp.save({"model": model.state_dict()})`` writes a split GPT2 as torch's state-dict functions show it
    (``get_state_dict``), and ``dcp.load`` fills the views, so the same files load either way."""

    @functools.wraps(set_up_planner)
    def set_up_with_blocks(self, *args, **kwargs):
        set_up_planner(self, *args, **kwargs)
        if isinstance(self.state_dict, dict):
            self.state_dict = {key: _strided_as_blocks(value) for key, value in self.state_dict.items()}

    set_up_with_blocks._oslo_blocks = True
    return set_up_with_blocks


def install_torch_hooks() -> None:
    """The places where oslo adjusts torch's stock tools to oslo models (installed once, by the first oslo
    model; other models and tensors pass through unchanged)."""
    if not getattr(DistributedDataParallel.__init__, "_oslo_hook", False):
        DistributedDataParallel.__init__ = refuse_dtensor_parameters(DistributedDataParallel.__init__)
    if not getattr(_clip_grad._get_total_norm, "_oslo_checks_stages", False):
        _clip_grad._get_total_norm = _refuse_stage_gradients(_clip_grad._get_total_norm)
    verify = getattr(_dcp_state_dict, "_verify_options", None)
    if verify is not None and not getattr(verify, "_oslo_flattens", False):
        _dcp_state_dict._verify_options = _optimizer_state_by_name(verify)
    names = ("_get_model_state_dict", "_load_model_state_dict", "_get_optim_state_dict", "_load_optim_state_dict")
    functions = [getattr(_dcp_state_dict, name, None) for name in names]
    if all(f is not None for f in functions) and not getattr(functions[0], "_oslo_blocks", False):
        for name, function in zip(names, _fused_as_blocks(*functions), strict=True):
            setattr(_dcp_state_dict, name, function)
    for planner in (DefaultSavePlanner, DefaultLoadPlanner):
        if not getattr(planner.set_up_planner, "_oslo_blocks", False):
            planner.set_up_planner = _planner_sees_blocks(planner.set_up_planner)
    try:  # (FSDP2's parameter class is private: a torch without it has nothing to adjust)
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:
        return
    if not getattr(FSDPParam.__init__, "_oslo_blocks", False):
        FSDPParam.__init__ = _fsdp_sees_blocks(FSDPParam.__init__)


def _whole_to_slice(module: nn.Module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook of a module with DTensor parameters: a whole plain tensor of a parameter's
    (transformers') shape — a transformers state dict, the embedding layers PEFT saves beside an adapter — is cut
    to this rank's slice, as a DTensor of the parameter's layout (a DTensor is loaded as it is). Modules that cut
    whole tensors themselves (``loads_whole_tensors``: an adapter's matrices) are left to do it."""
    if getattr(module, "loads_whole_tensors", False):
        return
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        if not isinstance(param, DTensor) or not hasattr(param, "_oslo_spec") or isinstance(value, DTensor) \
                or not isinstance(value, torch.Tensor):
            continue
        spec = param._oslo_spec
        if (_blocks_shape(value.shape, spec) if _blocked(spec) else tuple(value.shape)) != tuple(param.shape):
            continue
        value = value.to(device=param.device, dtype=param.dtype)
        part = value if spec is None else spec.slice_of(value)
        state_dict[prefix + name] = _wrap(_local_of(part, spec), param)


def distribute_parameters(model: nn.Module, context: ParallelContext, plain_leaves: bool = False) -> None:
    """Make every parameter of ``model`` a DTensor on the tensor-parallel mesh (see the module docstring).
    The layers' plain parameters become the storages; tied parameters stay tied. With pipelines the mesh is
    marked as a stage's, and torch's gradient norm refuses its gradients (:class:`PipelineStageNormError`)."""
    install_torch_hooks()
    mesh = device_mesh(context)["tp"]
    if context.pipeline_parallel_size > 1:
        mesh._oslo_pipeline_stage = (
            f"stage {context.pipeline_parallel_rank} of pipeline_parallel_size={context.pipeline_parallel_size}")
    specs = parameter_specs(model)
    made: dict[int, nn.Parameter] = {}
    spec_of = {id(p): specs[name] for name, p in model.named_parameters()}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            dt = made.get(id(param))
            if dt is None:
                dt = made[id(param)] = _make_dtensor(param, spec_of[id(param)], mesh)
                param._oslo_dtensor = dt
                grad = param.grad
                if grad is not None:
                    dt.grad = _wrap(_local_of(grad, dt._oslo_spec), dt)
                    if not plain_leaves:
                        param.grad = None
            module._parameters[name] = dt
        if any(isinstance(p, DTensor) for p in module._parameters.values()) and "_oslo_hooks" not in module.__dict__:
            module._oslo_swapped = []  # what _swap_in swapped, per call in progress
            module._oslo_hooks = (module.register_forward_pre_hook(_swap_in),
                                  module.register_forward_hook(_swap_out, always_call=True),
                                  module.register_load_state_dict_pre_hook(_whole_to_slice))
    model._oslo_distributed = True
    if plain_leaves:
        use_plain_leaves(model)


def undistribute_parameters(model: nn.Module) -> bool:
    """Put the plain storages back in the modules (gradients with them); returns whether the storages were
    training in the DTensors' place (:func:`plain_leaves_module`)."""
    plain_leaves = False
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor) and hasattr(param, "_oslo_storage"):
                storage = param._oslo_storage
                plain_leaves = plain_leaves or param._oslo_plain_leaf
                if not param._oslo_plain_leaf:
                    storage.grad = _storage_gradient(param)
                storage.requires_grad_(param.requires_grad)
                module._parameters[name] = storage
        for handle in module.__dict__.pop("_oslo_hooks", ()):
            handle.remove()
    model._oslo_distributed = False
    model._oslo_plain_leaves = False
    return plain_leaves


def local_named_parameters(model: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_parameters`` with every DTensor replaced by its storage (this rank's shard as the layer holds
    it, vocabulary padding included): what checkpoints read and write."""
    for name, param in model.named_parameters(remove_duplicate=remove_duplicate):
        yield name, param._oslo_storage if isinstance(param, DTensor) else param


def use_plain_leaves(model: nn.Module) -> None:
    """From now on the storages are the tensors autograd trains (``DistributedDataParallel``/DeepSpeed
    wrap them); each gradient they get is mirrored into its DTensor's ``.grad``."""
    for dt in model.parameters():
        if not isinstance(dt, DTensor) or not hasattr(dt, "_oslo_storage"):
            continue
        storage = dt._oslo_storage
        if not dt._oslo_plain_leaf:
            if dt.grad is not None and storage.grad is None:
                storage.grad = _storage_gradient(dt)
            storage.requires_grad_(dt.requires_grad)
            dt._oslo_plain_leaf = True
            _mirror_gradient(storage)
        # a frozen weight (fine-tuning, an adapter's base) gets no gradient to mirror; one unfrozen since is
        # mirrored from the next call on (model.gpu_modules() again)
        if storage.requires_grad and not getattr(storage, "_oslo_mirrors", False):
            storage.register_post_accumulate_grad_hook(_mirror_gradient)
            storage._oslo_mirrors = True
    model._oslo_plain_leaves = True


def _view_storage(dt: DTensor) -> None:
    """Make ``dt``'s local tensor a view of its storage's current memory again, if it is not."""
    storage = dt._oslo_storage
    local = dt._local_tensor
    if local.untyped_storage().data_ptr() != storage.untyped_storage().data_ptr() \
            or local.storage_offset() != storage.storage_offset():
        dt._local_tensor = _local_of(storage.detach(), dt._oslo_spec)


def follow_storages(model: nn.Module) -> None:
    """Point every DTensor whose storage trains in its place at the storage's current memory. DeepSpeed's
    ZeRO 1 and 2 move the parameters it trains into one flat buffer (``param.data = view``): without this the
    DTensors (``state_dict``, saving, ``full_tensor()``) would keep showing the weights from before."""
    for dt in model.parameters():
        if isinstance(dt, DTensor) and getattr(dt, "_oslo_plain_leaf", False):
            _view_storage(dt)


def relink_storages(module: nn.Module) -> None:
    """Make every oslo DTensor parameter of ``module`` a view of its own storage again: after ``copy.deepcopy``
    (PEFT's ``modules_to_save``) a copied DTensor and its copied storage are two separate tensors, and the layers
    (which compute on the storage) and an optimizer (which updates the DTensor) would part ways."""
    for dt in module.parameters():
        if isinstance(dt, DTensor) and hasattr(dt, "_oslo_storage"):
            _view_storage(dt)
            # nn.Parameter's deepcopy keeps no attribute: the copied storage learns again whose it is, and its
            # Megatron attributes (DDP and DeepSpeed train the storages: model.gpu_modules())
            storage = dt._oslo_storage
            storage._oslo_dtensor = dt
            for name, value in _megatron_attributes(dt._oslo_spec).items():
                setattr(storage, name, value)


class _PlainLeaves(nn.Module):
    """``model`` as ``DistributedDataParallel`` and DeepSpeed need it: this rank's storages (plain tensors,
    Megatron attributes set) are the parameters; the model's DTensors are left to the caller's optimizer."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model
        names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
        self._ddp_params_and_buffers_to_ignore = [f"module.{name}" for name in names]
        for name, storage in local_named_parameters(model):
            self.register_parameter(_leaf_name(name), storage)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _oslo_before_wrap(self) -> None:
        """Called as ``DistributedDataParallel`` wraps this module: weights frozen (or unfrozen) on the model since
        ``gpu_modules()`` are so on the storages DDP registers now (they follow at each call otherwise, too late
        for DDP, which would wait for gradients that never come)."""
        for dt in self.module.parameters():
            if isinstance(dt, DTensor) and getattr(dt, "_oslo_plain_leaf", False):
                _sync_plain_leaf(dt)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # Its own parameters only, the plain shards: not the model's DTensors (DDP skips those by the ignore
        # list; an optimizer over model_ddp.parameters() must not see each weight twice).
        return super().named_parameters(prefix, recurse=False, remove_duplicate=remove_duplicate)

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        # Itself only. A wrapper walks its submodules through this (DDP's parameters() and buffers() on the
        # wrapped module): past here it would reach the model's modules, whose DTensors are the same weights again
        # (an optimizer over model_ddp.parameters() applied every update twice). children() still holds the model:
        # train(), eval(), to() and state_dict() reach it.
        memo = set() if memo is None else memo
        if self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self

    # Its state dict is the model's, under the model's names, as ``DistributedDataParallel(model).module`` is the
    # model for a plain one: ``torch.save(model_ddp.module.state_dict())`` loads into the model (or transformers'),
    # and ``model_ddp.state_dict()`` holds ``module.`` + the model's names. The plain shards are the same weights as
    # the model's DTensors (the same memory): they are neither saved nor loaded on their own.
    # Without model parallelism (every process a data-parallel replica, the one layout where DDP wraps over every
    # process, as accelerate does) the values are plain tensors, the whole weights, as DDP's of a plain model are:
    # accelerate's save_state writes them with safetensors, which cannot write DTensors.
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        model = self._modules["module"]
        state = model.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        context = model.parallel_context
        if context.tensor_parallel_size * context.pipeline_parallel_size == 1:
            for key, value in state.items():
                if key.startswith(prefix) and isinstance(value, DTensor):
                    state[key] = value.to_local()
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        model = self._modules["module"]
        if not any(key.startswith("module.") for key in state_dict):  # the model's own call (ties across stages)
            return model.load_state_dict(state_dict, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # The model's keys go to the model (the child ``module``); a plain shard's key, which earlier versions
        # saved beside them, is dropped (the model's DTensor of the same weight loads it).
        follow_storages(self._modules["module"])  # the model's DTensors view the storages that train
        inner = prefix + "module."
        for key in [key for key in state_dict if key.startswith(prefix) and not key.startswith(inner)]:
            value = state_dict.pop(key)
            if key[len(prefix):] not in self._parameters:
                state_dict[inner + key[len(prefix):]] = value

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def trains_plain_leaves(model: nn.Module) -> bool:
    """Whether ``model``'s storages train in its DTensors' place (after :func:`plain_leaves_module`): a flag that
    :func:`use_plain_leaves` sets on the model it converts and :func:`undistribute_parameters` clears, read on
    every call without walking the parameters (a compiled call would trace that walk, each module's parameters
    one by one)."""
    return bool(model.__dict__.get("_oslo_plain_leaves", False))


def _leaf_name(name: str) -> str:
    """The name under which :class:`_PlainLeaves` registers the model's parameter ``name`` (a parameter's name has
    no dot)."""
    return name.replace(".", "__")


def model_parameter_names(module: nn.Module) -> dict[str, str]:
    """``{name in module: the model's name}`` of ``module``'s parameters: :func:`plain_leaves_module`'s wrapper
    registers the model's storages as its own parameters (:func:`_leaf_name`); every other module's names are the
    model's."""
    if isinstance(module, _PlainLeaves):
        return {_leaf_name(name): name for name, _ in local_named_parameters(module._modules["module"])}
    return {name: name for name, _ in module.named_parameters()}


def plain_leaves_module(model: nn.Module) -> nn.Module:
    """The module to wrap in ``DistributedDataParallel`` (see :class:`_PlainLeaves`); the model trains its
    storages from now on."""
    use_plain_leaves(model)
    return _plain_leaves_class(type(model))(model)


@functools.cache
def _plain_leaves_class(model_class: type) -> type:
    """:class:`_PlainLeaves` for models of ``model_class``: its ``forward`` has the model's signature and its name
    keeps the model's, which transformers' ``Trainer`` reads from the class (the label names that make it compute
    an evaluation loss, the batch columns it keeps, a question-answering head's positions)."""

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward.__signature__ = inspect.signature(model_class.forward)
    name = f"{model_class.__name__}GpuModules"
    return type(name, (_PlainLeaves,), {"forward": forward, "__qualname__": name, "__module__": __name__})
