"""PEFT's LoRA on oslo's linear layers.

PEFT builds its LoRA wrappers for ``nn.Linear`` and transformers' ``Conv1D``; oslo's layers are
:class:`~oslo.parallel.ColumnParallelLinear` and :class:`~oslo.parallel.RowParallelLinear` (GPT2's with
``Conv1D``'s ``(in, out)`` layout), which PEFT refuses (``Target module ... is not supported``). This module
teaches PEFT's ``LoraModel`` to wrap them: the user writes the ``LoraConfig`` they would write for the
transformers class, ``target_modules`` by the same names.

In one process an oslo linear layer holds the whole weight as a plain tensor, and :class:`ParallelLoraLinear` is
PEFT's own ``lora.Linear`` (merging, several adapters, DoRA and the other variants, saving and loading unchanged),
with ``fan_in_fan_out`` set from the layer's layout, as PEFT sets it for ``Conv1D``. With several processes (any
tensor_parallel_size, data-parallel replicas) the LoRA matrices are DTensors split like their layer (see
:class:`ParallelLoraLinear`); the plain ``nn.Linear`` layers of such a model (BERT's pooler, classifiers) get
replicated ones. With pipelines each stage wraps the layers it holds, and the saved adapter gathers every stage's.

Installed by :func:`install` when an oslo model is built with PEFT importable (``pip install peft``): it wraps
``LoraModel._create_new_module`` (oslo's layers first), ``LoraModel.inject_adapter`` (the layers learn their
model's parallel context), ``ModulesToSaveWrapper.update`` (a deep-copied DTensor computes on its own copy), the
state dict that ``PeftModel.save_pretrained`` writes (whole tensors, every stage's), ``PeftModel.save_pretrained``
itself (staged and published atomically, as oslo's saves; rank 0 writes) and the search for modules tied to the
input embedding (a pipeline stage may have none).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
import weakref

import torch
from torch.distributed.tensor import DTensor

from oslo.checkpoint import StagedSave
from oslo.parallel.dtensor import distribute_parameters, local, relink_storages, unblock, undistribute_parameters
from oslo.parallel.errors import naming_timeouts
from oslo.parallel.layers import ColumnParallelLinear, RowParallelLinear
from oslo.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from oslo.parallel.plan import COLUMN, ROW, VOCAB, ShardSpec

__all__ = ["ParallelLoraLinear", "install"]

ParallelLoraLinear = None  # the class, once PEFT is imported (see install)


class _Shard(torch.nn.Module):
    """One LoRA matrix (``lora_A`` or ``lora_B``) of a model of several processes: a ``weight`` DTensor on the
    tensor-parallel mesh like every oslo parameter, holding this rank's slice (``spec``; ``None``: the whole
    matrix on every rank). Its state dict holds the whole matrix, as PEFT saves and loads adapters: writing it
    gathers the slices (every rank of the tensor-parallel group takes part), reading it keeps this rank's slice.
    """

    def __init__(self, full: torch.Tensor, spec: ShardSpec | None, context) -> None:
        super().__init__()
        self.out_features, self.in_features = full.shape
        self.parallel_specs = {"weight": spec} if spec is not None else {}
        local = full if spec is None else spec.shard(lambda start, stop: full.narrow(spec.dim, start, stop - start))
        self.weight = torch.nn.Parameter(local.detach().clone(), requires_grad=full.requires_grad)
        self._oslo_context = context
        distribute_parameters(self, context)

    def _apply(self, fn, recurse=True):
        # .to() and friends convert the plain slice; the DTensor is rebuilt around it (as for the model's own).
        plain_leaves = undistribute_parameters(self)
        try:
            return super()._apply(fn, recurse)
        finally:
            distribute_parameters(self, self._oslo_context, plain_leaves=plain_leaves)

    @property
    def spec(self) -> ShardSpec | None:
        return self.parallel_specs.get("weight")

    def local_weight(self) -> torch.Tensor:
        """The tensor to compute on (this rank's slice; its gradient reaches the DTensor)."""
        return local(self.weight, self.spec)

    def stored(self) -> torch.Tensor:
        """This rank's slice itself (no autograd): what merging reads."""
        return _stored(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.local_weight())

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        weight = self.weight
        full = unblock(weight.full_tensor(), self.spec) if isinstance(weight, DTensor) else weight
        destination[prefix + "weight"] = full if keep_vars else full.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        full = state_dict[key]
        if isinstance(full, DTensor):
            full = full.full_tensor()
        if tuple(full.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(full.shape)}, the shape "
                              f"in current model is {(self.out_features, self.in_features)}.")
            return
        spec = self.spec
        part = full if spec is None else spec.shard(lambda start, stop: full.narrow(spec.dim, start, stop - start))
        with torch.no_grad():
            self.stored().copy_(part)


def _stored(param: torch.Tensor) -> torch.Tensor:
    """The tensor an oslo parameter's values live in: a DTensor's storage (this rank's slice), else itself."""
    return param._oslo_storage if hasattr(param, "_oslo_storage") else param


def _context_of(layer):
    """The parallel context of the model a layer belongs to (see :func:`_check_layout`), or ``None``."""
    ref = layer.__dict__.get("_oslo_lora_context")
    return None if ref is None else ref()


def _make_class():
    from peft.tuners.lora.layer import Linear
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class ParallelLoraLinear(Linear):
        """PEFT's ``lora.Linear`` around an oslo :class:`~oslo.parallel.ColumnParallelLinear` or
        :class:`~oslo.parallel.RowParallelLinear`. In one process it is PEFT's class as it is (the layer holds the
        whole weight). With several processes its LoRA matrices are :class:`_Shard` DTensors, split like the
        layer: for a column-parallel layer ``A`` whole and ``B`` split like the output features, for a row-parallel
        layer ``A`` split like the input features and ``B`` whole; the forward adds one small collective of
        ``r`` features per adapter, so that values and gradients are those of the unsplit layer."""

        def __init__(self, base_layer, adapter_name: str, config, **kwargs) -> None:
            # LoraLayer reads the features of nn.Linear and Conv1D only; oslo's layers state them themselves.
            base = base_layer.get_base_layer() if hasattr(base_layer, "get_base_layer") else base_layer
            self._oslo_features = (base.in_features, base.out_features)
            context = _context_of(base)
            self._oslo_context = context if context is not None and context.world_size > 1 else None
            if getattr(base, "transposed", False) and not config.fan_in_fan_out:  # as PEFT does for Conv1D
                warnings.warn(f"fan_in_fan_out is set to False but the target module {type(base).__name__} stores its "
                              "weight as (in_features, out_features), as transformers' Conv1D. Setting "
                              "fan_in_fan_out to True.", stacklevel=3)
                config.fan_in_fan_out = True
            if self._oslo_context is not None and getattr(base, "weight_spec", None) is not None \
                    and base.weight_spec.kind == VOCAB:
                raise NotImplementedError(
                    f"LoRA on a vocabulary-split layer ({type(base).__name__} with {base.out_features} outputs, an LM "
                    "head) of an oslo model of several processes is not implemented yet: target the attention and MLP "
                    "layers, or adapt it in one process.")
            if self._oslo_context is not None:
                unsupported = [name for name, on in (("use_dora", config.use_dora), ("lora_bias", config.lora_bias))
                               if on]
                if unsupported:
                    raise NotImplementedError(
                        f"{' and '.join(unsupported)} on oslo models of several processes are not implemented yet "
                        "(plain LoRA and use_rslora are); they work on a model built in one process.")
            kwargs["fan_in_fan_out"] = config.fan_in_fan_out
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

        def _get_in_out_features(self, module):
            return self._oslo_features

        @property
        def _oslo_kind(self) -> str:
            """``"column"``, ``"row"``, or ``"replicated"`` (an ``nn.Linear`` of a model of several processes)."""
            base = self.get_base_layer()
            return COLUMN if isinstance(base, ColumnParallelLinear) else ROW if isinstance(base, RowParallelLinear) \
                else "replicated"

        def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
            context = self._oslo_context
            if context is None:
                return super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
            # PEFT draws the whole matrices; from the model's replicated stream, every rank draws the same ones.
            with context.rng.replicated():
                super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
            spec_a = spec_b = None
            kind = self._oslo_kind
            if kind != "replicated":
                base_spec = self.get_base_layer().parallel_specs["weight"]
            if kind == COLUMN:  # B split like the output features (GPT2's fused q/k/v block by block)
                spec_b = ShardSpec(COLUMN, 0, self.out_features, base_spec.world_size, base_spec.rank,
                                   base_spec.chunks)
            elif kind == ROW:  # A split like the input features
                spec_a = ShardSpec(ROW, 1, self.in_features, base_spec.world_size, base_spec.rank)
            for matrices, spec in ((self.lora_A, spec_a), (self.lora_B, spec_b)):
                full = matrices[adapter_name].weight
                matrices[adapter_name] = _Shard(full, spec, context)

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if self._oslo_context is None:
                return super().forward(x, *args, **kwargs)
            self._check_forward_args(x, *args, **kwargs)
            if kwargs.pop("adapter_names", None) is not None:
                raise NotImplementedError("adapter_names= (a batch mixing adapters) on oslo models of several "
                                          "processes is not implemented yet")
            if self.disable_adapters:
                if self.merged:
                    self.unmerge()
                return self.base_layer(x, *args, **kwargs)
            result = self.base_layer(x, *args, **kwargs)
            if self.merged:
                return result
            base = self.get_base_layer()
            group, rng = getattr(base, "group", None), self._oslo_context.rng
            dtype = result.dtype
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                a, b = self.lora_A[name].local_weight(), self.lora_B[name].local_weight()
                dropout, h = self.lora_dropout[name], x.to(a.dtype)
                if self._oslo_kind == "replicated":  # every rank computes the whole, identical product
                    delta = torch.nn.functional.linear(torch.nn.functional.linear(dropout(h), a), b)
                elif self._oslo_kind == COLUMN:
                    if kwargs.get("input_is_copied", False):
                        # x's gradient is summed over the group where it was copied: this path's share stays
                        # partial, and A's gradient (partial too) is summed here.
                        z = torch.nn.functional.linear(dropout(h), copy_to_tensor_parallel(a, group))
                    else:  # z's gradient summed over the group: A's and x's are then whole on every rank
                        z = copy_to_tensor_parallel(torch.nn.functional.linear(dropout(h), a), group)
                    delta = torch.nn.functional.linear(z, b)
                    if base.gather_output:
                        delta = gather_from_tensor_parallel(delta, group, dim=-1)
                else:
                    if not base.input_is_parallel:
                        h = scatter_to_tensor_parallel(h, group, dim=-1)
                    with rng.split():  # dropout on this rank's input features: masks distinct per rank
                        h = dropout(h)
                    z = reduce_from_tensor_parallel(torch.nn.functional.linear(h, a), group)
                    delta = torch.nn.functional.linear(z, b)
                result = result + delta * self.scaling[name]
            return result.to(dtype)

        def get_delta_weight(self, adapter) -> torch.Tensor:
            if self._oslo_context is None:
                return super().get_delta_weight(adapter)
            # This rank's slice of B @ A, in the layout of the layer's stored slice ((in, out) when transposed).
            a, b = self.lora_A[adapter].stored(), self.lora_B[adapter].stored()
            delta = (b.float() @ a.float()) * self.scaling[adapter]
            return (delta.t() if getattr(self.get_base_layer(), "transposed", False) else delta).to(b.dtype)

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            if self._oslo_context is None:
                return super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
            adapter_names = check_adapters_to_merge(self, adapter_names)
            weight = _stored(self.get_base_layer().weight)
            for name in adapter_names:
                if name not in self.lora_A:
                    continue
                with torch.no_grad():
                    merged = weight + self.get_delta_weight(name).to(weight.dtype)
                    if safe_merge and not torch.isfinite(merged).all():
                        raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems to be broken")
                    weight.copy_(merged)
                self.merged_adapters.append(name)

        def unmerge(self) -> None:
            if self._oslo_context is None:
                return super().unmerge()
            if not self.merged:
                warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
                return
            weight = _stored(self.get_base_layer().weight)
            while self.merged_adapters:
                name = self.merged_adapters.pop()
                if name in self.lora_A:
                    with torch.no_grad():
                        weight.sub_(self.get_delta_weight(name).to(weight.dtype))

    ParallelLoraLinear.__module__, ParallelLoraLinear.__qualname__ = __name__, "ParallelLoraLinear"
    return ParallelLoraLinear


def _check_layout(model) -> None:
    """Before PEFT touches an oslo model: tell each of its linear layers the model's parallel context
    (:class:`ParallelLoraLinear` reads it)."""
    context = getattr(model, "parallel_context", None)
    if context is None:
        return
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, torch.nn.Linear)):
            module._oslo_lora_context = weakref.ref(context)  # (a weak reference: modules_to_save deep-copies modules)


def _oslo_model(peft_model):
    """The oslo model under a PeftModel (or a tuner), or ``None``."""
    model = peft_model
    for attribute in ("base_model", "model"):
        model = getattr(model, attribute, model)
    return model if hasattr(model, "parallel_context") else None


def _whole_adapter(state: dict, model) -> dict:
    """The adapter's state dict as PEFT writes it: whole tensors (a DTensor's slices gathered over its group) and,
    with pipelines, every stage's entries (gathered over the pipeline group: each stage holds its layers')."""
    state = {name: value.full_tensor() if isinstance(value, DTensor) else value for name, value in state.items()}
    context = None if model is None else model.parallel_context
    if context is None or context.pipeline_parallel_size == 1:
        return state
    import torch.distributed as dist

    stages: list[dict | None] = [None] * context.pipeline_parallel_size
    with naming_timeouts(context, "gathering the adapter of every pipeline stage to save it",
                         "every rank calls save_pretrained (is_main_process=rank == 0 writes)",
                         context.pipeline_parallel_group):
        dist.all_gather_object(stages, {name: value.cpu() for name, value in state.items()},
                               group=context.pipeline_parallel_group)
    whole: dict = {}
    for stage in stages:
        whole.update(stage)
    return whole


def _dispatch(target, adapter_name, config, **kwargs):
    """PEFT's dispatcher signature: a LoRA module for an oslo linear layer, or ``None`` for anything else."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if isinstance(base, torch.nn.Linear):  # replicated: oslo's LoRA once its weight is a DTensor, else PEFT's
        context = _context_of(base)
        if context is None or context.world_size == 1:
            return None
    elif not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        return None
    return ParallelLoraLinear(target, adapter_name, config=config, **kwargs)


_installed: bool | None = None  # whether install() taught PEFT (None: not tried yet)


def install() -> bool:
    """Make PEFT's ``LoraModel`` wrap oslo's linear layers (once per process); ``False`` without PEFT. Every oslo
    model calls it when it is built: after the first, it only returns what the first found."""
    global ParallelLoraLinear, _installed
    if _installed is not None:
        return _installed
    _installed = False
    if importlib.util.find_spec("peft") is None:
        return False
    from peft.tuners.lora.model import LoraModel

    create = LoraModel._create_new_module
    ParallelLoraLinear = _make_class()

    @functools.wraps(create)
    def create_new_module(lora_config, adapter_name, target, **kwargs):
        module = _dispatch(target, adapter_name, lora_config, **kwargs)
        return module if module is not None else create(lora_config, adapter_name, target, **kwargs)

    inject = LoraModel.inject_adapter

    @functools.wraps(inject)
    def inject_adapter(self, model, *args, **kwargs):
        _check_layout(model)
        return inject(self, model, *args, **kwargs)

    LoraModel._create_new_module = staticmethod(create_new_module)
    LoraModel.inject_adapter = inject_adapter
    _install_copies_and_saves()
    _installed = True
    return True


def _install_copies_and_saves() -> None:
    """``modules_to_save`` copies a module (``copy.deepcopy``): an oslo DTensor parameter's copy must compute on its
    own copied slice. And the state dict PEFT saves holds whole tensors, not DTensors (every rank calls
    ``save_pretrained``, as every rank calls oslo's saves; ``is_main_process`` writes)."""
    import peft.peft_model
    from peft.utils.other import ModulesToSaveWrapper

    update = ModulesToSaveWrapper.update

    @functools.wraps(update)
    def update_copies(self, adapter_name, *args, **kwargs):
        result = update(self, adapter_name, *args, **kwargs)
        copy = self.modules_to_save[adapter_name] if adapter_name in self.modules_to_save else None
        if copy is not None:
            relink_storages(copy)
        return result

    ModulesToSaveWrapper.update = update_copies
    state_dict_of = peft.peft_model.get_peft_model_state_dict

    @functools.wraps(state_dict_of)
    def whole_adapter(model, *args, **kwargs):
        return _whole_adapter(state_dict_of(model, *args, **kwargs), _oslo_model(model))

    peft.peft_model.get_peft_model_state_dict = whole_adapter

    # An adapter of an oslo model is saved like oslo's checkpoints: staged beside the target, written by rank 0,
    # published in one atomic exchange (a save killed at any instant leaves the old adapter or the new one).
    save_pretrained = peft.peft_model.PeftModel.save_pretrained

    @functools.wraps(save_pretrained)
    def save_staged(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        model = _oslo_model(self)
        if model is None:
            return save_pretrained(self, save_directory, *args, is_main_process=is_main_process, **kwargs)
        context = model.parallel_context
        save = StagedSave(context, os.fspath(save_directory))
        save.step(lambda: save_pretrained(self, save.staging, *args,
                                          is_main_process=is_main_process and context.rank == 0, **kwargs),
                  "saving the adapter to")
        save.publish()

    peft.peft_model.PeftModel.save_pretrained = save_staged

    # A pipeline stage without the input embedding (GPT2's last stage) has none to tie to.
    from peft.tuners.tuners_utils import BaseTuner

    tied = BaseTuner._get_module_names_tied_with_embedding

    @functools.wraps(tied)
    def tied_on_this_stage(self, *args, **kwargs):
        model = getattr(self, "model", None)
        if hasattr(model, "parallel_context") and model.get_input_embeddings() is None:
            return []
        return tied(self, *args, **kwargs)

    BaseTuner._get_module_names_tied_with_embedding = tied_on_this_stage

