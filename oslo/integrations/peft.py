"""PEFT's LoRA, (IA)^3, LoHa and LoKr on oslo's linear layers (and AdaLoRA in one process).

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
replicated ones. There the class computes the adapter itself: plain LoRA, rsLoRA, ``lora_bias``, DoRA (its
magnitude split like the output features) and PEFT's mixed batches (``adapter_names=``); other variants refuse.
With pipelines each stage wraps the layers it holds, and the saved adapter gathers every stage's.
:class:`ParallelIA3Linear` does the same for PEFT's ``IA3Model``: PEFT's own ``ia3.Linear`` in one process, vectors
split like the features they scale with several processes. LoHa's and LoKr's layers (see :func:`_make_lycoris_class`)
are PEFT's own in one process; with several processes their factors are whole on every rank, and each rank runs the
input through its layer's slice of the whole update. PEFT's trainable tokens take oslo's vocabulary-split embedding
and LM head (see :func:`_install_trainable_tokens`). PEFT's other tuners work on a model of one process, on plain
layers standing for oslo's (see :func:`_install_other_tuners`).

Installed by :func:`install` when an oslo model is built with PEFT importable (``pip install peft``): it wraps
``LoraModel._create_new_module`` and ``IA3Model``'s (oslo's layers first), their ``inject_adapter`` (the layers
learn their model's parallel context), their ``_check_merge_allowed`` (a layer tied across pipeline stages),
``ModulesToSaveWrapper.update`` (a deep-copied DTensor computes on its own copy), the state dict that
``PeftModel.save_pretrained`` writes (whole tensors, every stage's), ``PeftModel.save_pretrained`` itself (staged
and published atomically, as oslo's saves; rank 0 writes) and the search for modules tied to the input embedding (a
pipeline stage may have none).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import os
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch.distributed.tensor import DTensor

from oslo.checkpoint import StagedSave
from oslo.parallel.dtensor import distribute_parameters, local, relink_storages, unblock, undistribute_parameters
from oslo.parallel.errors import RankFailedError, naming_timeouts
from oslo.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead
from oslo.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    gather_sequence,
    reduce_from_tensor_parallel,
    reduce_scatter_sequence,
    scatter_to_tensor_parallel,
)
from oslo.parallel.plan import COLUMN, ROW, VOCAB, ShardSpec
from oslo.parallel.sequence import added_bias
from oslo.parallel.ties import tie_families

__all__ = ["ParallelIA3Linear", "ParallelLoraLinear", "install"]

ParallelLoraLinear = None  # the class, once PEFT is imported (see install)
ParallelIA3Linear = None  # the same for (IA)^3
_AdaLoraOnOsloLinear = None  # and AdaLoRA's, in one process
_LYCORIS: dict[str, type] = {}  # LoHa's and LoKr's: "loha", "lokr" -> the class


class _KeepsDTensors:
    """A module of adapter DTensors (``_oslo_context``: the model's parallel context): ``.to()`` and friends convert
    the plain slices, and the DTensors are rebuilt around them, as for the model's own parameters (torch swaps a
    DTensor parameter for a new one, which would not know its storage)."""

    def _apply(self, fn, recurse=True):
        plain_leaves = undistribute_parameters(self)
        try:
            return super()._apply(fn, recurse)
        finally:
            distribute_parameters(self, self._oslo_context, plain_leaves=plain_leaves)

    def assign(self, parts: dict[str, torch.Tensor]) -> None:
        """``load_state_dict(assign=True)``: the parameters ``parts`` names become these slices (their device and
        dtype), still DTensors on their storages."""
        plain_leaves = undistribute_parameters(self)
        try:
            for name, part in parts.items():
                trained = self._parameters[name].requires_grad
                self._parameters[name] = torch.nn.Parameter(part.detach(), requires_grad=trained)
        finally:
            distribute_parameters(self, self._oslo_context, plain_leaves=plain_leaves)

    def upcast(self, names=None) -> None:
        """PEFT's ``autocast_adapter_dtype``: the half-precision parameters ``names`` (all: ``None``) in float32,
        still DTensors on their storages (PEFT's own cast replaces a parameter with a new one)."""
        parts = {name: _stored(param).float() for name, param in self._parameters.items()
                 if param is not None and (names is None or name in names) and param.dtype in _UPCAST}
        if parts:
            self.assign(parts)


_UPCAST = (torch.float16, torch.bfloat16)  # what PEFT's autocast_adapter_dtype takes to float32


class _Shard(_KeepsDTensors, torch.nn.Module):
    """One LoRA matrix (``lora_A`` or ``lora_B``, with ``lora_bias`` its bias) or DoRA magnitude vector of a model of
    several processes: a ``weight`` (and ``bias``) DTensor on the tensor-parallel mesh like every oslo parameter,
    holding this rank's slice (``parallel_specs``; no entry: the whole tensor on every rank). Its state dict holds the
    whole tensors, as PEFT saves and loads adapters: writing it gathers the slices (every rank of the
    tensor-parallel group takes part), reading it keeps this rank's slice.

    Args:
        parts: ``name -> (local, global_shape, spec)``: this rank's slice, the whole tensor's shape, how it is split.
    """

    loads_whole_tensors = True  # its _load_from_state_dict cuts them (no collective)

    def __init__(self, parts: dict[str, tuple[torch.Tensor, tuple[int, ...], ShardSpec | None]], context) -> None:
        super().__init__()
        self._shapes = {name: tuple(shape) for name, (_, shape, _) in parts.items()}
        if len(self._shapes["weight"]) == 2:
            self.out_features, self.in_features = self._shapes["weight"]
        self.parallel_specs = {name: spec for name, (_, _, spec) in parts.items() if spec is not None}
        for name, (part, _, _) in parts.items():
            setattr(self, name, torch.nn.Parameter(part.detach().clone(), requires_grad=part.requires_grad))
        self._oslo_context = context
        distribute_parameters(self, context)

    @classmethod
    def split(cls, context, **wholes: tuple[torch.Tensor, ShardSpec | None]) -> _Shard:
        """From whole tensors (``name=(tensor, spec)``), each rank keeping its slice."""
        return cls({name: (_slice(full, spec), tuple(full.shape), spec) for name, (full, spec) in wholes.items()},
                   context)

    @property
    def spec(self) -> ShardSpec | None:
        return self.parallel_specs.get("weight")

    def local_weight(self) -> torch.Tensor:
        """The tensor to compute on (this rank's slice; its gradient reaches the DTensor)."""
        return local(self.weight, self.spec)

    def local_bias(self) -> torch.Tensor | None:
        return local(self.bias, self.parallel_specs.get("bias")) if "bias" in self._shapes else None

    def stored(self, name: str = "weight") -> torch.Tensor:
        """This rank's slice itself (no autograd): what merging reads."""
        return _stored(getattr(self, name))

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for name in self._shapes:
            value = getattr(self, name)
            full = unblock(value.full_tensor(), self.parallel_specs.get(name)) if isinstance(value, DTensor) else value
            destination[prefix + name] = full if keep_vars else full.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        for name, shape in self._shapes.items():
            key = prefix + name
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            full = state_dict[key]
            if isinstance(full, DTensor):
                full = full.full_tensor()
            if tuple(full.shape) != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(full.shape)}, the "
                                  f"shape in current model is {shape}.")
                continue
            part = _slice(full, self.parallel_specs.get(name))
            if local_metadata.get("assign_to_params_buffers", False) or self.stored(name).is_meta:
                # load_state_dict(assign=True) (PEFT's low_cpu_mem_usage: the module was built on the meta device)
                self.assign({name: part})
                continue
            with torch.no_grad():
                self.stored(name).copy_(part)


def _slice(full: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's slice of a whole tensor (itself when it is not split)."""
    return full if spec is None else spec.slice_of(full)


def _stored(param: torch.Tensor) -> torch.Tensor:
    """The tensor an oslo parameter's values live in: a DTensor's storage (this rank's slice), else itself."""
    return param._oslo_storage if hasattr(param, "_oslo_storage") else param


def _context_of(layer):
    """The parallel context of the model a layer belongs to (see :func:`_check_layout`), or ``None``."""
    ref = layer.__dict__.get("_oslo_lora_context")
    return None if ref is None else ref()


def _take_first_ranks(context, tensors: list[torch.Tensor]) -> None:
    """Make the whole tensors PEFT just drew (from this rank's torch generator) those of this pipeline stage's first
    rank, as ``distribute_tensor`` takes rank 0's: one broadcast over the tensor-parallel group, one over the
    data-parallel group. A model of one stage so gets the adapter one process draws after the same
    ``torch.manual_seed``, whatever the other ranks' generators hold."""
    if any(tensor.is_meta for tensor in tensors):  # built empty, to be loaded (PEFT's low_cpu_mem_usage)
        return
    flat = torch.cat([tensor.detach().reshape(-1) for tensor in tensors])
    with naming_timeouts(context, "taking a new adapter's initial values from the first rank",
                         "every rank adds the same adapters to the model (get_peft_model, add_adapter)"):
        for group, size in ((context.tensor_parallel_group, context.tensor_parallel_size),
                            (context.data_parallel_group, context.data_parallel_size)):
            if size > 1:
                torch.distributed.broadcast(flat, group=group, group_src=0)
    with torch.no_grad():
        for tensor, value in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            tensor.copy_(value.view_as(tensor))


@contextmanager
def _computing_with(layer: torch.nn.Module, weight: torch.Tensor) -> Iterator[None]:
    """While in the block, an oslo layer's own forward computes with ``weight`` (this rank's tensor, in the layer's
    stored layout) in place of its weight parameter: oslo swaps only DTensors for their local views."""
    stored = layer._parameters["weight"]
    layer._parameters["weight"] = weight
    try:
        yield
    finally:
        layer._parameters["weight"] = stored


def _as_vectors(module: torch.nn.Module, attribute: str, context) -> _Vectors:
    """``module``'s ParameterDict ``attribute`` as a :class:`_Vectors` of DTensors (whole on every rank unless its
    ``parallel_specs`` say otherwise), its entries distributed."""
    vectors = getattr(module, attribute)
    if not isinstance(vectors, _Vectors):
        converted = _Vectors(context)
        for key, value in vectors.items():
            converted[key] = value
        setattr(module, attribute, converted)
        vectors = converted
    distribute_parameters(vectors, context)
    return vectors


class _OnOsloLayer:
    """What PEFT's layers adapted to oslo's linear layers share (:class:`ParallelLoraLinear` and
    :class:`ParallelIA3Linear`): the kind of layer they wrap, its stored layout, and how a replicated layer of which
    each rank reads part of the output is computed. ``_oslo_context``: the model's parallel context, ``None`` in one
    process."""

    def _oslo_adopt(self, base_layer, config):
        """Before PEFT's constructor: learn the model's parallel context (``None`` in one process) and set the
        config's ``fan_in_fan_out`` (of the methods that have one) from the layer's layout, as PEFT sets it for
        ``Conv1D`` and ``nn.Linear`` (with the same warning). Returns the oslo layer under ``base_layer``."""
        base = base_layer.get_base_layer() if hasattr(base_layer, "get_base_layer") else base_layer
        context = _context_of(base)
        self._oslo_context = context if context is not None and context.world_size > 1 else None
        transposed = bool(getattr(base, "transposed", False))
        if hasattr(config, "fan_in_fan_out") and transposed != bool(config.fan_in_fan_out):
            layout = ("(in_features, out_features), as transformers' Conv1D" if transposed
                      else "(out_features, in_features), as torch.nn.Linear")
            warnings.warn(f"fan_in_fan_out is set to {bool(config.fan_in_fan_out)} but the target module "
                          f"{type(base).__name__} stores its weight as {layout}. Setting fan_in_fan_out to "
                          f"{transposed}.", stacklevel=4)
            config.fan_in_fan_out = transposed
        return base

    def _oslo_write_merged(self, name: str, safe_merge: bool, weight: torch.Tensor, merged: torch.Tensor,
                           bias: torch.Tensor | None, new_bias: torch.Tensor | None) -> None:
        """Write adapter ``name``'s merged slices into the layer's stored ``weight`` (and ``bias``); with
        ``safe_merge`` first check them, every rank of the group learning of a broken slice anywhere."""
        if safe_merge:
            broken = torch.tensor([float(not torch.isfinite(merged).all() or (
                new_bias is not None and not torch.isfinite(new_bias).all()))], device=weight.device)
            if self._oslo_context is not None and self._oslo_kind != "replicated":
                torch.distributed.all_reduce(broken, op=torch.distributed.ReduceOp.MAX,
                                             group=self.get_base_layer().group)
            if broken.item():
                raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems to be broken")
        weight.copy_(merged)
        if new_bias is not None:
            bias.copy_(new_bias)

    @property
    def _oslo_kind(self) -> str:
        """``"column"``, ``"row"``, or ``"replicated"`` (an ``nn.Linear`` of a model of several processes)."""
        base = self.get_base_layer()
        return COLUMN if isinstance(base, ColumnParallelLinear) else ROW if isinstance(base, RowParallelLinear) \
            else "replicated"

    def _oslo_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight in the layer's stored layout as ``(out, in)`` (this rank's rows and columns)."""
        return weight.t() if getattr(self.get_base_layer(), "transposed", False) else weight

    @property
    def _oslo_read_in_part(self) -> bool:
        """A replicated layer of which each rank reads part of the output (the Llama family's key/value
        projections when the tensor-parallel size does not divide their heads): the gradients of what
        computes it come from this rank's part only, and are summed over the tensor-parallel group."""
        return self._oslo_kind == "replicated" and getattr(self.get_base_layer(), "output_read_in_part", False)

    def _oslo_whole(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """``tensor`` (a replicated parameter's) as computed on: its gradient summed over the group when each
        rank reads part of the output."""
        if tensor is None or not self._oslo_read_in_part:
            return tensor
        return copy_to_tensor_parallel(tensor, self._oslo_context.tensor_parallel_group)

    def _oslo_disabled(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The call with the adapters disabled (``disable_adapter()``): the merged ones taken out of the weight, the
        base layer's output."""
        if self.merged:
            self.unmerge()
        return self._oslo_base(x, *args, **kwargs)

    def _oslo_base(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not self._oslo_read_in_part:
            return self.base_layer(x, *args, **kwargs)
        base = self.get_base_layer()
        specs = getattr(base, "parallel_specs", {})
        weight = self._oslo_whole(local(base.weight, specs.get("weight")))
        bias = None if base.bias is None else self._oslo_whole(local(base.bias, specs.get("bias")))
        return torch.nn.functional.linear(x, weight, bias)


def _make_class():
    from peft.tuners.lora.layer import Linear
    from peft.tuners.lora.variants import DoraLinearVariant
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class ParallelLoraLinear(_OnOsloLayer, Linear):
        """PEFT's ``lora.Linear`` around an oslo :class:`~oslo.parallel.ColumnParallelLinear` or
        :class:`~oslo.parallel.RowParallelLinear`. In one process it is PEFT's class as it is (the layer holds the
        whole weight). With several processes its LoRA matrices are :class:`_Shard` DTensors, split like the
        layer: for a column-parallel layer ``A`` whole and ``B`` split like the output features (like the vocabulary,
        padding rows included, on an LM head), for a row-parallel layer ``A`` split like the input features and
        ``B`` whole; the forward adds one small collective of ``r`` features per adapter (DoRA on a row-parallel
        layer one more, its weight norm), so that values and gradients are those of the unsplit layer."""

        def __init__(self, base_layer, adapter_name: str, config, **kwargs) -> None:
            # LoraLayer reads the features of nn.Linear and Conv1D only; oslo's layers state them themselves.
            base = self._oslo_adopt(base_layer, config)
            self._oslo_features = (base.in_features, base.out_features)
            if self._oslo_context is not None and config.use_dora and getattr(base, "weight_spec", None) is not None \
                    and base.weight_spec.kind == VOCAB:
                raise NotImplementedError(
                    f"DoRA on a vocabulary-split layer ({type(base).__name__} with {base.out_features} outputs, an LM "
                    "head) of an oslo model of several processes is not implemented yet (plain LoRA is): target the "
                    "attention and MLP layers with DoRA, or adapt it in one process.")
            if self._oslo_context is not None and config.use_dora and getattr(base, "gather_output", False):
                raise NotImplementedError(
                    f"DoRA on a {type(base).__name__} that gathers its output (gather_output=True) of an oslo model of "
                    "several processes is not implemented yet: target the attention and MLP layers.")
            init = config.init_lora_weights
            if self._oslo_context is not None and not (isinstance(init, bool) or init in ("gaussian", "orthogonal")):
                raise NotImplementedError(
                    f"init_lora_weights={init!r} derives the adapter from the base weights (or from data), which an "
                    "oslo model of several processes holds in slices: not implemented yet. Initialize the adapter in "
                    "one process and save it as plain LoRA (for PiSSA, OLoRA and CorDA: save_pretrained(..., "
                    "path_initial_model_for_weight_conversion=...)), then load it at any layout; or use "
                    "init_lora_weights=True, False, 'gaussian' or 'orthogonal'.")
            kwargs["fan_in_fan_out"] = config.fan_in_fan_out
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

        def _get_in_out_features(self, module):
            return self._oslo_features

        def resolve_lora_variant(self, *, config, **kwargs):
            variant = super().resolve_lora_variant(config=config, **kwargs)
            if self._oslo_context is None or variant is None:
                return variant
            if config.use_dora and isinstance(variant, DoraLinearVariant):
                return None  # DoRA of a split layer: this class's own forward and merge (see _oslo_dora)
            raise NotImplementedError(
                f"the LoRA variant {type(variant).__name__} on oslo models of several processes is not implemented "
                "yet (plain LoRA, use_rslora, use_dora and lora_bias are); it works on a model built in one process.")

        def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
            context = self._oslo_context
            if context is None:
                return super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
            # PEFT draws the whole matrices from torch's generator, as in one process; every rank takes its stage's
            # first rank's (the draw of one process, seeded alike, on the first stage).
            super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
            spec_b = self._oslo_split(adapter_name)
            if config.use_dora:
                # DoRA's magnitude: the norm of each output row of W + scaling * B @ A, split like the output features
                with torch.no_grad():
                    norm = self._oslo_weight_norm(self._oslo_rows(_stored(self.get_base_layer().weight)),
                                                  self._oslo_rows(self.get_delta_weight(adapter_name)))
                if not self.lora_magnitude_vector:
                    self.adapter_layer_names = self.adapter_layer_names[:] + ("lora_magnitude_vector",)
                self.lora_magnitude_vector[adapter_name] = _Shard({"weight": (norm, (self.out_features,), spec_b)},
                                                                  self._oslo_context)
                self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

        def _oslo_split(self, adapter_name: str) -> ShardSpec | None:
            """Make adapter ``adapter_name``'s whole matrices (``nn.Linear`` modules, as PEFT builds them) this
            layer's :class:`_Shard` DTensors, split like the layer, after every rank took its stage's first rank's
            values. Returns how ``lora_B`` is split."""
            context = self._oslo_context
            b = self.lora_B[adapter_name]
            _take_first_ranks(context, [self.lora_A[adapter_name].weight, b.weight]
                                       + ([] if b.bias is None else [b.bias]))
            spec_a = spec_b = None
            kind = self._oslo_kind
            if kind != "replicated":
                base_spec = self.get_base_layer().parallel_specs["weight"]
            if kind == COLUMN and base_spec.kind == VOCAB:  # B's rows split like the vocabulary, padding included
                spec_b = ShardSpec(VOCAB, 0, self.out_features, base_spec.world_size, base_spec.rank)
            elif kind == COLUMN:  # B (and its bias) split like the output features (GPT2's fused q/k/v block by block)
                spec_b = ShardSpec(COLUMN, 0, self.out_features, base_spec.world_size, base_spec.rank,
                                   base_spec.chunks)
            elif kind == ROW:  # A split like the input features
                spec_a = ShardSpec(ROW, 1, self.in_features, base_spec.world_size, base_spec.rank)
            self.lora_A[adapter_name] = _Shard.split(context, weight=(self.lora_A[adapter_name].weight, spec_a))
            b = self.lora_B[adapter_name]
            parts = {"weight": (b.weight, spec_b)}
            if b.bias is not None:
                parts["bias"] = (b.bias, spec_b)
            self.lora_B[adapter_name] = _Shard.split(context, **parts)
            return spec_b

        def _oslo_weight_norm(self, weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
            """DoRA's ``||W + delta||`` of each output row (this rank's rows), both ``(out, in)`` and ``delta``
            scaled: a row-parallel layer holds part of each row, so the squares are summed over the group."""
            total = weight + delta.to(weight.dtype)
            if self._oslo_kind != ROW:
                return torch.linalg.vector_norm(total, dim=1)
            squares = total.pow(2).sum(1)
            torch.distributed.all_reduce(squares, group=self.get_base_layer().group)
            return squares.sqrt()

        def _oslo_dora_factor(self, adapter: str, norm: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            """``magnitude / norm``, shaped to scale the output features of ``like`` (the stored layout)."""
            factor = self.lora_magnitude_vector[adapter].stored() / norm
            return (factor.view(1, -1) if getattr(self.get_base_layer(), "transposed", False)
                    else factor.view(-1, 1)).to(like.dtype)

        def _oslo_output(self, name: str, x: torch.Tensor, result: torch.Tensor, kwargs) -> torch.Tensor:
            """What adapter ``name`` adds to the base layer's ``result`` for the input ``x``, in ``result``'s layout
            (this rank's output features on a column-parallel layer that does not gather them)."""
            base, rng = self.get_base_layer(), self._oslo_context.rng
            group = getattr(base, "group", None)
            a_module, b_module = self.lora_A[name], self.lora_B[name]
            a, b, b_bias = (self._oslo_whole(t) for t in (a_module.local_weight(), b_module.local_weight(),
                                                          b_module.local_bias()))
            dropout, h = self.lora_dropout[name], x.to(a.dtype)
            kind = self._oslo_kind
            # Under sequence parallelism (a block's layer, running on shards) a column-parallel layer reads this
            # rank's sequence shard and gathers it, a row-parallel one reduce-scatters its output into shards.
            sequence = getattr(base, "sequence", None)
            on_shards = sequence is not None and sequence.active
            copied = kwargs.get("input_is_copied", False)
            if kind == "replicated":  # every rank computes the whole, identical product
                h = dropout(h)
                z = torch.nn.functional.linear(h, a)
            elif kind == COLUMN:
                if copied:
                    # x's gradient is summed over the group where it was copied (or gathered): this path's share
                    # stays partial, and A's gradient (partial too) is summed here.
                    h = dropout(h)
                    z = torch.nn.functional.linear(h, copy_to_tensor_parallel(a, group))
                elif on_shards:
                    # x is this rank's shard: A reads it (its gradient, from this shard's positions, summed over
                    # the group), z is gathered (its gradient reduce-scattered: x's is whole on its shard).
                    with rng.split():  # dropout on this rank's positions: masks distinct per rank
                        h = dropout(h)
                    z = gather_sequence(torch.nn.functional.linear(h, copy_to_tensor_parallel(a, group)), group,
                                        sequence.dim)
                else:  # z's gradient summed over the group: A's and x's are then whole on every rank
                    h = dropout(h)
                    z = copy_to_tensor_parallel(torch.nn.functional.linear(h, a), group)
            else:
                if not base.input_is_parallel:
                    h = scatter_to_tensor_parallel(h, group, dim=-1)
                with rng.split():  # dropout on this rank's input features: masks distinct per rank
                    h = dropout(h)
                z = torch.nn.functional.linear(h, a)
                if on_shards:
                    # z's sums go to the shards, as the layer's output; B reads this rank's shard, so its gradient
                    # (and its bias's) is summed over the group.
                    z = reduce_scatter_sequence(z, group, sequence.dim)
                    b = copy_to_tensor_parallel(b, group)
                    b_bias = None if b_bias is None else copy_to_tensor_parallel(b_bias, group)
                else:
                    z = reduce_from_tensor_parallel(z, group)
            lora = torch.nn.functional.linear(z, b, b_bias)
            scaling = self.scaling[name]
            if self.use_dora.get(name, False):
                dropped = self.training and not isinstance(dropout, torch.nn.Identity)
                shards = sequence if on_shards and not copied else None
                if dropped and kind == COLUMN and not on_shards and not copied:
                    h = copy_to_tensor_parallel(h, group)  # the recomputed base output's share of x's gradient
                return self._oslo_dora(name, h, result, lora, dropped, shards)
            if kind == COLUMN and base.gather_output:
                lora = gather_from_tensor_parallel(lora, group, dim=-1)
            return lora * scaling

        def _oslo_dora(self, name: str, h: torch.Tensor, result: torch.Tensor, lora: torch.Tensor,
                       dropped: bool, shards=None) -> torch.Tensor:
            """DoRA's addition (PEFT's ``DoraLinearLayer.forward``) on this rank's output features: ``h`` the
            (dropped-out) input the adapter read (this rank's features on a row-parallel layer), ``lora`` its
            ``B A h``. The weight norm is a constant, as in DoRA's paper and PEFT.

            ``shards``: the layer's sequence-parallel state while it runs on sequence shards (``h`` then this rank's
            shard on a column-parallel layer, gathered before the base output is recomputed from it; ``result`` and
            ``lora`` this rank's shard on a row-parallel one, whose magnitude, applied to a shard, has its gradient
            summed over the group)."""
            base = self.get_base_layer()
            kind = self._oslo_kind
            weight = self._oslo_rows(_stored(base.weight)).to(h.dtype)
            with torch.no_grad():
                norm = self._oslo_weight_norm(weight, self._oslo_rows(self.get_delta_weight(name)).to(h.dtype))
            magnitude = self._oslo_whole(self.lora_magnitude_vector[name].local_weight())
            if shards is not None and kind == ROW:
                magnitude = copy_to_tensor_parallel(magnitude, base.group)
            scale = magnitude / norm
            if dropped:  # PEFT recomputes the base output on the dropped-out input
                if shards is not None and kind == COLUMN:  # the dropped-out shard, gathered as the layer gathers x
                    h = gather_sequence(h, base.group, shards.dim)
                base_result = torch.nn.functional.linear(h, weight)
                if kind == ROW:
                    base_result = (reduce_scatter_sequence(base_result, base.group, shards.dim) if shards is not None
                                   else reduce_from_tensor_parallel(base_result, base.group))
            else:
                base_result = result if base.bias is None else result - added_bias(base)
            return (scale - 1) * base_result + scale * lora * self.scaling[name]

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            base = self.get_base_layer()
            if kwargs.get("skip_bias_add", False) and base.bias is not None:
                # A fused caller adds the layer's bias itself; DoRA's output reads the biased result (it scales the
                # unbiased part), so the result is computed whole and the bias taken off after: the tensor the layer
                # added, whose gradient cancels the layer's own (summed over the group on sequence shards).
                kwargs["skip_bias_add"] = False
                return self.forward(x, *args, **kwargs) - added_bias(base)
            if self._oslo_context is None:
                return super().forward(x, *args, **kwargs)
            self._check_forward_args(x, *args, **kwargs)
            adapter_names = kwargs.pop("adapter_names", None)
            if self.disable_adapters:
                return self._oslo_disabled(x, *args, **kwargs)
            result = self._oslo_base(x, *args, **kwargs)
            if self.merged:
                return result
            dtype = result.dtype
            if adapter_names is not None:  # a batch mixing adapters (PEFT's mixed-batch inference)
                # in order of first appearance, the same on every rank (a set's order is not): the collectives match
                for name in dict.fromkeys(adapter_names):
                    if name == "__base__" or name not in self.lora_A:
                        continue
                    rows = [i for i, item in enumerate(adapter_names) if item == name]
                    result[rows] += self._oslo_output(name, x[rows], result[rows], kwargs).to(dtype)
                return result
            for name in self.active_adapters:
                if name in self.lora_A:
                    result = result + self._oslo_output(name, x, result, kwargs)
            return result.to(dtype)

        def get_delta_weight(self, adapter) -> torch.Tensor:
            if self._oslo_context is None:
                return super().get_delta_weight(adapter)
            # This rank's slice of B @ A, in the layout of the layer's stored slice ((in, out) when transposed).
            a, b = self.lora_A[adapter].stored(), self.lora_B[adapter].stored()
            delta = (b.float() @ a.float()) * self.scaling[adapter]
            return (delta.t() if getattr(self.get_base_layer(), "transposed", False) else delta).to(b.dtype)

        def _oslo_unmerged(self, name: str, weight: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
            """``weight`` (the stored layout) with adapter ``name`` taken out of it; ``norm``: its DoRA norm."""
            delta = self.get_delta_weight(name).to(weight.dtype)
            if norm is None:
                return weight - delta
            return weight / self._oslo_dora_factor(name, norm, weight) - delta

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            if self._oslo_context is None:
                return super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
            adapter_names = check_adapters_to_merge(self, adapter_names)
            base = self.get_base_layer()
            weight = _stored(base.weight)
            bias = None if base.bias is None else _stored(base.bias)
            for name in adapter_names:
                if name not in self.lora_A:
                    continue
                with torch.no_grad():
                    delta = self.get_delta_weight(name).to(weight.dtype)
                    if self.use_dora.get(name, False):
                        # the norm of the unmerged weight, as the forward computes it (earlier merges taken out)
                        unmerged = weight
                        for earlier in reversed(self.merged_adapters):
                            unmerged = self._oslo_unmerged(earlier, unmerged,
                                                           self._caches.get(f"{earlier}-weight_norm"))
                        norm = self._oslo_weight_norm(self._oslo_rows(unmerged), self._oslo_rows(delta))
                        merged = self._oslo_dora_factor(name, norm, weight) * (weight + delta)
                    else:
                        norm, merged = None, weight + delta
                    new_bias = None
                    if self.lora_bias[name]:
                        if bias is None:
                            raise RuntimeError("Impossible to merge LoRA with `lora_bias=True` because the base "
                                               "layer has no bias.")
                        new_bias = bias + self.lora_B[name].stored("bias").to(bias.dtype) * self.scaling[name]
                    self._oslo_write_merged(name, safe_merge, weight, merged, bias, new_bias)
                if norm is not None:
                    self._cache_store(f"{name}-weight_norm", norm)
                self.merged_adapters.append(name)

        def unmerge(self) -> None:
            if self._oslo_context is None:
                return super().unmerge()
            if not self.merged:
                warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
                return
            base = self.get_base_layer()
            weight = _stored(base.weight)
            while self.merged_adapters:
                name = self.merged_adapters.pop()
                if name not in self.lora_A:
                    continue
                norm = self._cache_pop(f"{name}-weight_norm") if self.use_dora.get(name, False) else None
                with torch.no_grad():
                    weight.copy_(self._oslo_unmerged(name, weight, norm))
                    if self.lora_bias[name]:
                        _stored(base.bias).sub_(self.lora_B[name].stored("bias").to(weight.dtype) * self.scaling[name])

    ParallelLoraLinear.__module__, ParallelLoraLinear.__qualname__ = __name__, "ParallelLoraLinear"
    return ParallelLoraLinear


def _make_adalora_class():
    from peft.tuners.adalora.layer import SVDLinear

    class AdaLoraOnOsloLinear(_OnOsloLayer, SVDLinear):
        """PEFT's AdaLoRA ``SVDLinear`` around an oslo linear layer of a model built in one process (the layer holds
        the whole weight; PEFT's class as it is). With several processes AdaLoRA refuses: its rank allocator ranks
        the singular values of every adapted layer against one global budget, which would need every rank's and
        every stage's scores."""

        def __init__(self, base_layer, adapter_name: str, config, **kwargs) -> None:
            base = self._oslo_adopt(base_layer, config)
            if self._oslo_context is not None:
                raise NotImplementedError(
                    f"PEFT's AdaLoRA on an oslo model of several processes (world size "
                    f"{self._oslo_context.world_size}) is not implemented yet: its rank allocator ranks every "
                    "adapted layer's singular values against one budget. Use LoRA (DoRA, rsLoRA) or (IA)^3, which "
                    "work at every layout, or AdaLoRA on a model built in one process.")
            self._oslo_features = (base.in_features, base.out_features)
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

        def _get_in_out_features(self, module):
            return self._oslo_features

    AdaLoraOnOsloLinear.__module__, AdaLoraOnOsloLinear.__qualname__ = __name__, "AdaLoraOnOsloLinear"
    return AdaLoraOnOsloLinear

class _Vectors(_KeepsDTensors, torch.nn.ParameterDict):
    """(IA)^3's ``ia3_l`` of a model of several processes: each adapter's vector a DTensor on the tensor-parallel
    mesh (``parallel_specs``: how it is split; no entry: whole on every rank), under PEFT's names. Its state dict
    holds whole tensors, as PEFT saves adapters (writing it gathers the slices over the group); a whole tensor
    loaded is cut to this rank's slice (:func:`~oslo.parallel.dtensor.distribute_parameters`' load hook)."""

    def __init__(self, context) -> None:
        super().__init__()
        self.parallel_specs: dict[str, ShardSpec] = {}
        self._oslo_context = context

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for name, value in self._parameters.items():
            if isinstance(value, DTensor):
                value = unblock(value.full_tensor(), self.parallel_specs.get(name))
            destination[prefix + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        if not local_metadata.get("assign_to_params_buffers", False):
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        # load_state_dict(assign=True) (PEFT's low_cpu_mem_usage): this rank's slices, kept on their storages
        parts = {}
        for name, param in self._parameters.items():
            value = state_dict.get(prefix + name)
            if value is None:
                if strict:
                    missing_keys.append(prefix + name)
                continue
            if isinstance(value, DTensor):  # PEFT (or the load hook) made it one: this rank's slice of the whole
                value = unblock(value.full_tensor(), self.parallel_specs.get(name))
            shape = tuple(unblock(torch.empty(param.shape, device="meta"), self.parallel_specs.get(name)).shape)
            if tuple(value.shape) != shape:
                error_msgs.append(f"size mismatch for {prefix + name}: copying a param with shape "
                                  f"{tuple(value.shape)}, the shape in current model is {shape}.")
                continue
            parts[name] = _slice(value, self.parallel_specs.get(name))
        self.assign(parts)


def _make_ia3_class():
    from peft.tuners.ia3.layer import Linear
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class ParallelIA3Linear(_OnOsloLayer, Linear):
        """PEFT's (IA)^3 ``Linear`` around an oslo :class:`~oslo.parallel.ColumnParallelLinear` or
        :class:`~oslo.parallel.RowParallelLinear`: a learned vector scaling the layer's output features (its input
        features for the ``feedforward_modules``). In one process it is PEFT's class as it is. With several
        processes each vector is a DTensor split like the features it scales: a column-parallel layer's output
        scaling like its output (GPT2's fused ``c_attn`` block by block), a row-parallel layer's input scaling like
        its input; the others (the input of a column-parallel layer, the output of a row-parallel one) are whole on
        every rank, their gradients summed over the group where each rank sees part of them (a shared or sequence-
        sharded input, a sequence-sharded output). No collective is added otherwise."""

        def __init__(self, base_layer, adapter_name: str, config, is_feedforward: bool = False, **kwargs) -> None:
            base = self._oslo_adopt(base_layer, config)
            if self._oslo_context is not None and (getattr(base, "gather_output", False)
                                                   or getattr(base, "input_is_parallel", True) is False):
                raise NotImplementedError(
                    f"(IA)^3 on a {type(base).__name__} that gathers its output or splits its input itself of an oslo "
                    "model of several processes is not implemented yet: target the attention and MLP layers.")
            torch.nn.Module.__init__(self)
            # IA3Layer's constructor, for a layer that states its (whole) features itself
            self.base_layer = base_layer
            self.ia3_l = torch.nn.ParameterDict({}) if self._oslo_context is None else _Vectors(self._oslo_context)
            self._disable_adapters = False
            self.merged_adapters = []
            self.is_feedforward = is_feedforward
            self.in_features, self.out_features = base.in_features, base.out_features
            # Linear's
            self.fan_in_fan_out = config.fan_in_fan_out
            self.is_target_conv_1d_layer = False
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, config=config)

        def _oslo_spec(self) -> ShardSpec | None:
            """How this layer's vectors are split: like the features they scale when those are split."""
            kind = self._oslo_kind
            if kind == "replicated":
                return None
            base_spec = self.get_base_layer().parallel_specs["weight"]
            if kind == COLUMN and not self.is_feedforward:
                if base_spec.kind == VOCAB:  # padding rows included (they scale the padding logits)
                    return ShardSpec(VOCAB, 0, self.out_features, base_spec.world_size, base_spec.rank)
                return ShardSpec(COLUMN, 0, self.out_features, base_spec.world_size, base_spec.rank, base_spec.chunks)
            if kind == ROW and self.is_feedforward:
                return ShardSpec(ROW, 1, self.in_features, base_spec.world_size, base_spec.rank)
            return None

        def update_layer(self, adapter_name, config, **kwargs):
            context = self._oslo_context
            if context is None:
                return super().update_layer(adapter_name, config=config, **kwargs)
            super().update_layer(adapter_name, config=config, **kwargs)
            _take_first_ranks(context, [self.ia3_l[adapter_name]])  # a random init (init_ia3_weights=False)
            spec = self._oslo_spec()
            if spec is not None:
                self.ia3_l.parallel_specs[adapter_name] = spec
                vector = self.ia3_l[adapter_name]
                self.ia3_l[adapter_name] = torch.nn.Parameter(spec.slice_of(vector.detach()),
                                                              requires_grad=vector.requires_grad)
            distribute_parameters(self.ia3_l, context)

        def _oslo_vector(self, name: str, summed: bool) -> torch.Tensor:
            """Adapter ``name``'s vector as computed on (this rank's features, flat); ``summed``: its gradient is
            summed over the tensor-parallel group (each rank computed it from part of the positions)."""
            vector = self._oslo_whole(local(self.ia3_l[name], self.ia3_l.parallel_specs.get(name))).flatten()
            if summed and not self._oslo_read_in_part:
                vector = copy_to_tensor_parallel(vector, self.get_base_layer().group)
            return vector

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            base = self.get_base_layer()
            if kwargs.get("skip_bias_add", False) and base.bias is not None and not self.is_feedforward:
                # A fused caller adds the layer's bias itself; (IA)^3 scales the biased output, so the result is
                # computed whole and the bias taken off after (the tensor the layer added: its gradient cancels).
                kwargs["skip_bias_add"] = False
                return self.forward(x, *args, **kwargs) - added_bias(base)
            if self._oslo_context is None:
                return super().forward(x, *args, **kwargs)
            if self.disable_adapters:
                return self._oslo_disabled(x, *args, **kwargs)
            names = [name for name in self.active_adapters if name in self.ia3_l]
            if self.merged or not names:
                return self._oslo_base(x, *args, **kwargs)
            kind = self._oslo_kind
            sequence = getattr(base, "sequence", None)
            on_shards = sequence is not None and sequence.active
            if self.is_feedforward:
                # A column-parallel layer's whole input is read by every rank: its scaling's gradient is this rank's
                # share where x was copied before (a shared input) or is this rank's sequence shard.
                summed = kind == COLUMN and (kwargs.get("input_is_copied", False) or on_shards)
            else:
                summed = kind == ROW and on_shards  # the output is this rank's sequence shard
            scaling = 1
            for name in names:
                scaling = scaling * self._oslo_vector(name, summed)
            dtype = x.dtype
            if self.is_feedforward:
                return self._oslo_base((x.to(scaling.dtype) * scaling).to(dtype), *args, **kwargs)
            result = self._oslo_base(x, *args, **kwargs)
            return (result * scaling).to(result.dtype)

        def _oslo_factor(self, name: str, like: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
            """Adapter ``name``'s stored vector (this rank's slice), shaped to scale ``like`` (the layer's stored
            weight) along the features it scales."""
            vector = _stored(self.ia3_l[name]).flatten() + offset
            transposed = getattr(self.get_base_layer(), "transposed", False)
            along_rows = self.is_feedforward == transposed  # (out, in) scales its rows' outputs, (in, out) inputs
            return (vector.view(-1, 1) if along_rows else vector.view(1, -1)).to(like.dtype)

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            if self._oslo_context is None:
                return super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
            adapter_names = check_adapters_to_merge(self, adapter_names)
            base = self.get_base_layer()
            weight = _stored(base.weight)
            bias = None if base.bias is None or self.is_feedforward else _stored(base.bias)
            for name in adapter_names:
                if name not in self.ia3_l:
                    continue
                with torch.no_grad():
                    merged = weight * self._oslo_factor(name, weight)
                    new_bias = None if bias is None else bias * _stored(self.ia3_l[name]).flatten().to(bias.dtype)
                    self._oslo_write_merged(name, safe_merge, weight, merged, bias, new_bias)
                self.merged_adapters.append(name)

        def unmerge(self) -> None:
            if self._oslo_context is None:
                return super().unmerge()
            if not self.merged:
                warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
                return
            warnings.warn("Unmerge result can be inaccurate for (IA)^3.", stacklevel=2)
            base = self.get_base_layer()
            weight = _stored(base.weight)
            bias = None if base.bias is None or self.is_feedforward else _stored(base.bias)
            while self.merged_adapters:
                name = self.merged_adapters.pop()
                if name not in self.ia3_l:
                    continue
                with torch.no_grad():  # PEFT's tolerance against a division by zero
                    weight.div_(self._oslo_factor(name, weight, offset=1e-8))
                    if bias is not None:
                        bias.div_((_stored(self.ia3_l[name]).flatten() + 1e-8).to(bias.dtype))

    ParallelIA3Linear.__module__, ParallelIA3Linear.__qualname__ = __name__, "ParallelIA3Linear"
    return ParallelIA3Linear


def _make_lycoris_class(method: str):
    """PEFT's LyCORIS ``Linear`` of ``method`` (``"loha"``, ``"lokr"``) adapted to oslo's linear layers."""
    from peft.tuners.tuners_utils import check_adapters_to_merge

    peft_linear = importlib.import_module(f"peft.tuners.{method}.layer").Linear
    title = {"loha": "LoHa", "lokr": "LoKr"}[method]

    class ParallelLycorisLinear(_OnOsloLayer, peft_linear):
        """PEFT's ``{method}.Linear`` around an oslo linear layer: the adapter is a weight update ``delta`` (LoHa's
        Hadamard product of two low-rank products, LoKr's Kronecker product) that PEFT computes whole from small
        factors. In one process it is PEFT's class as it is, the layer seen as the ``nn.Linear`` it computes. With
        several processes every factor is whole on every rank (a replicated DTensor); each rank computes the whole
        ``delta``, keeps the slice its layer holds, and runs the input through that slice as the layer runs it
        through its weight (one more collective per adapted layer each way: the layer's own, for the update's
        part); the factors' gradients, each rank's from its slice, are summed over the group. The update is not
        added to the weight before the call (no extra collective): as in PEFT, a small update must not be rounded
        away in a half-precision weight.

        A layer that stores its weight as ``(in, out)`` (GPT2's, transformers' ``Conv1D``) is refused, as PEFT
        refuses ``Conv1D``; so are ``rank_dropout`` and ``module_dropout`` with several processes (each rank would
        draw its own)."""

        def __init__(self, base_layer, adapter_name: str, config, **kwargs) -> None:
            base = self._oslo_adopt(base_layer, config)
            if getattr(base, "transposed", False):
                raise TypeError(
                    f"Target module {type(base).__name__} stores its weight as (in_features, out_features), as "
                    f"transformers' Conv1D, which PEFT's {title} does not support (nor on the transformers model): "
                    "use LoRA or (IA)^3 there.")
            # PEFT's constructor reads the layer's features and weight shape from an nn.Linear: it is shown one of
            # the whole layer's shape, on the meta device (not a submodule), until the adapter exists.
            self.__dict__["_oslo_stand_in"] = torch.nn.Linear(base.in_features, base.out_features, bias=False,
                                                              device="meta")
            with self._oslo_standing_in():
                super().__init__(base_layer, adapter_name, config=config, **kwargs)

        @contextmanager
        def _oslo_standing_in(self, standing: bool = True):
            previous = self.__dict__.get("_oslo_standing", False)
            self.__dict__["_oslo_standing"] = standing
            try:
                yield
            finally:
                self.__dict__["_oslo_standing"] = previous

        def get_base_layer(self):
            if self.__dict__.get("_oslo_standing", False):
                return self.__dict__["_oslo_stand_in"]
            return super().get_base_layer()

        def _move_adapter_to_device_of_base_layer(self, *args, **kwargs):
            with self._oslo_standing_in(False):
                return super()._move_adapter_to_device_of_base_layer(*args, **kwargs)

        def update_layer(self, adapter_name, r, alpha, config, **kwargs):
            context = self._oslo_context
            if context is not None and (config.rank_dropout or config.module_dropout):
                raise NotImplementedError(
                    f"{title}'s rank_dropout ({config.rank_dropout}) and module_dropout ({config.module_dropout}) on "
                    f"an oslo model of several processes are not implemented yet (each rank would draw its own): set "
                    "them to 0, or adapt the model in one process.")
            with self._oslo_standing_in():
                super().update_layer(adapter_name, r, alpha, config, **kwargs)
            if context is None:
                return
            # PEFT drew the whole factors from torch's generator, as in one process: every rank takes its stage's
            # first rank's, then holds them as replicated DTensors.
            names = [name for name in self.adapter_layer_names if adapter_name in getattr(self, name)]
            _take_first_ranks(context, [getattr(self, name)[adapter_name] for name in names])
            for name in names:
                _as_vectors(self, name, context)

        @contextmanager
        def _oslo_factors(self, adapter: str):
            """With several processes: adapter ``adapter``'s factors, while PEFT computes with them, as the tensors to
            compute on (their gradients summed over the group where each rank computes from part of the layer)."""
            split = self._oslo_kind != "replicated"
            swapped = []
            for name in self.adapter_layer_names:
                factors = getattr(self, name)
                value = factors._parameters.get(adapter) if isinstance(factors, _Vectors) else None
                if isinstance(value, DTensor):
                    view = local(value)
                    factors._parameters[adapter] = (copy_to_tensor_parallel(view, self.get_base_layer().group)
                                                    if split else self._oslo_whole(view))
                    swapped.append((factors, value))
            try:
                yield
            finally:
                for factors, value in swapped:
                    factors._parameters[adapter] = value

        def get_delta_weight(self, adapter_name: str, **kwargs) -> torch.Tensor:
            """The whole ``(out, in)`` update, as in one process (computed on every rank)."""
            factors = nullcontext() if self._oslo_context is None else self._oslo_factors(adapter_name)
            with factors, self._oslo_standing_in():  # (the factors read the layer: entered first)
                return super().get_delta_weight(adapter_name, **kwargs)

        def _oslo_part(self, whole: torch.Tensor) -> torch.Tensor:
            """This rank's part of the whole ``(out, in)`` update ``whole``: the slice the layer holds."""
            base = self.get_base_layer()
            spec = getattr(base, "parallel_specs", {}).get("weight") if self._oslo_context is not None else None
            return _slice(whole, spec)

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if self._oslo_context is None:
                return super().forward(x, *args, **kwargs)
            if self.disable_adapters:
                return self._oslo_disabled(x, *args, **kwargs)
            result = self._oslo_base(x, *args, **kwargs)
            names = [name for name in self.active_adapters if name in self._available_adapters]
            if self.merged or not names:
                return result
            delta = sum(self._oslo_part(self.get_delta_weight(name)) for name in names)
            return (result + self._oslo_through(x, delta, kwargs)).to(x.dtype)

        def _oslo_through(self, x: torch.Tensor, weight: torch.Tensor, kwargs) -> torch.Tensor:
            """``x`` through ``weight`` (this rank's part of an ``(out, in)`` update, no bias) by the layer's own
            forward (its collectives), so that the result is in the layer's output layout and every gradient is the
            unsplit layer's."""
            base, h = self.get_base_layer(), self._cast_input_dtype(x, weight.dtype)
            if self._oslo_kind == "replicated":
                return torch.nn.functional.linear(h, weight)
            with _computing_with(base, weight):
                return base(h, **{**kwargs, "skip_bias_add": True})

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            adapter_names = check_adapters_to_merge(self, adapter_names)
            weight = _stored(self.get_base_layer().weight)
            for name in adapter_names:
                if name not in self._available_adapters:
                    continue
                with torch.no_grad():
                    merged = weight + self._oslo_part(self.get_delta_weight(name)).to(weight.dtype)
                    self._oslo_write_merged(name, safe_merge, weight, merged, None, None)
                self.merged_adapters.append(name)

        def unmerge(self) -> None:
            if not self.merged:
                warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
                return
            weight = _stored(self.get_base_layer().weight)
            while self.merged_adapters:
                name = self.merged_adapters.pop()
                if name in self._available_adapters:
                    with torch.no_grad():
                        weight.sub_(self._oslo_part(self.get_delta_weight(name)).to(weight.dtype))

    name = f"Parallel{title}Linear"
    ParallelLycorisLinear.__name__ = ParallelLycorisLinear.__qualname__ = name
    ParallelLycorisLinear.__module__ = __name__
    ParallelLycorisLinear.__doc__ = ParallelLycorisLinear.__doc__.replace("{method}", method)
    return ParallelLycorisLinear


def _check_layout(model) -> None:
    """Before PEFT touches an oslo model: tell each of its linear layers the model's parallel context
    (:class:`ParallelLoraLinear` reads it)."""
    context = getattr(model, "parallel_context", None)
    if context is None:
        return
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, torch.nn.Linear)):
            module._oslo_lora_context = weakref.ref(context)  # (a weak reference: modules_to_save deep-copies modules)


def _oslo_model(peft_model):
    """The oslo model under a PeftModel (or a tuner), or ``None``."""
    from peft.peft_model import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    model = peft_model
    while isinstance(model, (PeftModel, BaseTuner)):
        model = model.base_model if isinstance(model, PeftModel) else model.model
    return model if hasattr(model, "parallel_context") else None


def _oslo_linear_layers(model, peft_config) -> set[str]:
    """The names of ``model``'s oslo linear layers that PEFT's ``"all-linear"`` takes, by PEFT's rules: not the
    output layer (nor, for sequence classification, the classifier), not a layer an adapter already wraps."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.constants import SEQ_CLS_HEAD_NAMES

    excluded = set()
    output = model.get_output_embeddings()
    heads = [output] if output is not None else (
        [getattr(model, name) for name in SEQ_CLS_HEAD_NAMES if getattr(model, name, None) is not None][:1]
        if getattr(peft_config, "task_type", None) == "SEQ_CLS" else [])
    names = {}
    for name, module in model.named_modules():
        names.setdefault(id(module), name)
        if isinstance(module, BaseTunerLayer):
            excluded.update(f"{name}.{suffix}" for suffix, _ in module.named_modules() if suffix)
    excluded.update(names[id(head)] for head in heads if id(head) in names)
    return {name for name, module in model.named_modules()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear))} - excluded


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


def _adapts(target) -> bool:
    """Whether oslo's adapted layer wraps ``target`` (an oslo linear layer, or the ``nn.Linear`` of a model of several
    processes, whose weight is a DTensor); PEFT's own layers wrap the rest."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if isinstance(base, torch.nn.Linear):
        context = _context_of(base)
        return context is not None and context.world_size > 1
    return isinstance(base, (ColumnParallelLinear, RowParallelLinear))


def _lora_module(target, adapter_name, config, **kwargs):
    """PEFT's dispatcher signature: a LoRA module for an oslo linear layer, or ``None`` for anything else."""
    return ParallelLoraLinear(target, adapter_name, config=config, **kwargs) if _adapts(target) else None


def _ia3_module(target, adapter_name, config, is_feedforward: bool = False, **kwargs):
    """The same for (IA)^3 (``kwargs``: PEFT's quantization flags)."""
    if not _adapts(target):
        return None
    if kwargs.get("loaded_in_8bit") or kwargs.get("loaded_in_4bit"):
        raise NotImplementedError("(IA)^3 on a quantized oslo model is not implemented")
    return ParallelIA3Linear(target, adapter_name, config=config, is_feedforward=is_feedforward)


def _adalora_module(target, adapter_name, config, device_map=None, **kwargs):
    """The same for AdaLoRA (``kwargs``: ``r``, ``lora_alpha`` and PEFT's quantization flags)."""
    if not _adapts(target):
        return None
    if kwargs.get("loaded_in_8bit") or kwargs.get("loaded_in_4bit") or kwargs.get("gptq_quantization_config"):
        raise NotImplementedError("AdaLoRA on a quantized oslo model is not implemented")
    return _AdaLoraOnOsloLinear(target, adapter_name, config=config, r=kwargs["r"], lora_alpha=kwargs["lora_alpha"])


def _whole_linear(shard: _Shard) -> torch.nn.Linear:
    """A LoRA matrix of a model of several processes as PEFT holds it in one process: an ``nn.Linear`` of the whole
    tensors (gathered over the group: every rank takes part)."""
    state = shard.state_dict()
    weight, bias = state["weight"], state.get("bias")
    linear = torch.nn.utils.skip_init(torch.nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None,
                                      device=weight.device, dtype=weight.dtype)  # (no draw from the generator)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.requires_grad_(shard.weight.requires_grad)


@contextmanager
def _combined_whole(layers, adapters) -> Iterator[None]:
    """While PEFT combines ``adapters`` into a new one (``add_weighted_adapter``): each LoRA layer of ``layers`` (of a
    model of several processes) computes as in one process, ``adapters``' matrices whole and the new adapter's built
    whole by PEFT; after, the sources get their split matrices back and every new adapter is split like its layer."""
    saved = []
    for layer in layers:
        kept = {name: (layer.lora_A[name], layer.lora_B[name]) for name in adapters if name in layer.lora_A}
        for name, (a, b) in kept.items():
            layer.lora_A[name], layer.lora_B[name] = _whole_linear(a), _whole_linear(b)
        saved.append((layer, layer._oslo_context, kept, set(layer.lora_A)))
        layer._oslo_context = None
    try:
        yield
    finally:
        for layer, context, kept, before in saved:
            layer._oslo_context = context
            for name, (a, b) in kept.items():
                layer.lora_A[name], layer.lora_B[name] = a, b
            for name in sorted(set(layer.lora_A) - before):
                layer._oslo_split(name)


def _lycoris_module(method: str):
    """PEFT's dispatcher for LoHa or LoKr (``method``): their module for an oslo linear layer, else ``None``."""

    def module_for(target, adapter_name, config, **kwargs):
        return _LYCORIS[method](target, adapter_name, config=config, **kwargs) if _adapts(target) else None

    return module_for


def _in_stage_order(tuner, model, adapter_name: str, inject):
    """Run ``inject`` (PEFT adding adapter ``adapter_name``, which draws new matrices from torch's generator) one
    pipeline stage after the other, each stage continuing the generator where the stage before left it, as one
    process draws the layers in order: a new adapter is one process's draw on every stage, and every rank then holds
    the generator one process holds after it (the ranks' later draws, a batch, agree).

    A stage that holds none of the targeted layers (``target_modules=["lm_head"]`` on the first) adds the adapter
    with none, as PEFT adds a dummy one, unless no stage holds any (then PEFT's error, on every rank). A stage that
    fails tells the others, which raise :class:`~oslo.parallel.errors.RankFailedError` instead of waiting."""
    from peft.utils.constants import DUMMY_TARGET_MODULES
    from peft.utils.error import NoMatchingPeftModuleError

    context = getattr(model, "parallel_context", None)
    if context is None or context.pipeline_parallel_size == 1:
        return inject()
    failure = None
    matched = []  # per stage: whether it held a targeted layer
    state = torch.get_rng_state()
    for stage in range(context.pipeline_parallel_size):
        status = 0
        if stage == context.pipeline_parallel_rank:
            try:
                inject()
            except NoMatchingPeftModuleError as exc:  # none here: known once every stage tried
                failure, status = exc, 2
            except Exception as exc:  # noqa: BLE001 - passed on to the other stages, then raised here
                failure, status = exc, 1
            state = torch.get_rng_state()
        message = torch.cat([torch.tensor([status], dtype=torch.uint8), state]).to(context.device)
        with naming_timeouts(context, f"adding an adapter on pipeline stage {stage}, then the next",
                             "every rank adds the same adapters to the model (get_peft_model, add_adapter)",
                             context.pipeline_parallel_group):
            torch.distributed.broadcast(message, group=context.pipeline_parallel_group, group_src=stage)
        message = message.cpu()
        if message[0] == 1:
            if stage == context.pipeline_parallel_rank:
                raise failure
            raise RankFailedError(f"pipeline stage {stage} failed to add the adapter (its error is raised there)")
        matched.append(message[0] == 0)
        state = message[1:].clone()
        torch.set_rng_state(state)
    if failure is not None:  # this stage holds none of the targeted layers
        if not any(matched):
            raise failure
        config = tuner.peft_config[adapter_name]
        targets = config.target_modules
        config.target_modules = DUMMY_TARGET_MODULES
        try:
            inject()
        finally:
            config.target_modules = targets


def _teach(tuner, module_for) -> None:
    """Make PEFT's ``tuner`` (``LoraModel``, ``IA3Model``) wrap oslo's layers with ``module_for``'s modules (PEFT's
    own for the others) and tell the layers their model's parallel context before it injects an adapter."""
    create = tuner._create_new_module

    @functools.wraps(create)
    def create_new_module(config, adapter_name, target, **kwargs):
        module = module_for(target, adapter_name, config, **kwargs)
        return module if module is not None else create(config, adapter_name, target, **kwargs)

    inject = tuner.inject_adapter
    if getattr(inject, "_oslo_layout", False):  # inherited from a tuner taught already (AdaLoRA's, LoRA's)
        inject_adapter = None
    else:
        @functools.wraps(inject)
        def inject_adapter(self, model, adapter_name, *args, **kwargs):
            _check_layout(model)
            context = getattr(model, "parallel_context", None)
            config = self.peft_config.get(adapter_name)
            if context is not None and context.pipeline_parallel_size > 1 \
                    and getattr(config, "trainable_token_indices", None) is not None \
                    and getattr(model.config, "tie_word_embeddings", False):
                raise NotImplementedError(
                    "PEFT's trainable tokens (trainable_token_indices) of a model whose LM head is tied to its input "
                    f"embeddings at pipeline_parallel_size={context.pipeline_parallel_size} are not implemented yet "
                    "(the embeddings and the head are on different stages): use them at pipeline_parallel_size=1 "
                    "(any tensor_parallel_size), or train the whole embeddings (modules_to_save=[<the input "
                    "embeddings' name>]).")
            return _in_stage_order(self, model, adapter_name, lambda: inject(self, model, adapter_name, *args,
                                                                             **kwargs))

        inject_adapter._oslo_layout = True

    tuner._create_new_module = staticmethod(create_new_module)
    if inject_adapter is not None:
        tuner.inject_adapter = inject_adapter


_installed: bool | None = None  # whether install() taught PEFT (None: not tried yet)


def install() -> bool:
    """Make PEFT's ``LoraModel`` and ``IA3Model`` wrap oslo's linear layers (once per process); ``False`` without
    PEFT. Every oslo model calls it when it is built: after the first, it only returns what the first found."""
    global ParallelLoraLinear, ParallelIA3Linear, _AdaLoraOnOsloLinear, _installed
    if _installed is not None:
        return _installed
    _installed = False
    if importlib.util.find_spec("peft") is None:
        return False
    from peft.tuners.adalora.model import AdaLoraModel
    from peft.tuners.ia3.model import IA3Model
    from peft.tuners.loha.model import LoHaModel
    from peft.tuners.lokr.model import LoKrModel
    from peft.tuners.lora.model import LoraModel

    ParallelLoraLinear = _make_class()
    ParallelIA3Linear = _make_ia3_class()
    _AdaLoraOnOsloLinear = _make_adalora_class()
    _teach(LoraModel, _lora_module)
    _teach(IA3Model, _ia3_module)
    _teach(AdaLoraModel, _adalora_module)
    for method, tuner in (("loha", LoHaModel), ("lokr", LoKrModel)):
        _LYCORIS[method] = _make_lycoris_class(method)
        _teach(tuner, _lycoris_module(method))
    _install_copies_and_saves()
    _install_other_tuners()
    _installed = True
    return True


def _vocabulary_layer(layer) -> VocabParallelEmbedding | ColumnParallelLinear | None:
    """The oslo layer under PEFT's trainable-tokens ``layer`` when it is a vocabulary-split embedding or LM head."""
    base = layer.get_base_layer()
    if isinstance(base, VocabParallelEmbedding) or (isinstance(base, ColumnParallelLinear)
                                                   and base.weight_spec.kind == VOCAB):
        return base
    return None


def _own_tokens(base, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the token ids ``indices``: which this rank's slice of the vocabulary holds, and their rows in it."""
    start, stop = base.parallel_specs["weight"].vocab_range()
    ids = torch.tensor(indices, device=device)
    mine = (ids >= start) & (ids < stop)
    return mine, ids[mine] - start


def _token_rows(layer, base, names, values_of, like: torch.Tensor) -> torch.Tensor:
    """``like`` (this rank's stored vocabulary rows) with the rows of each adapter of ``names`` that this rank holds
    replaced by ``values_of(name)`` (that adapter's whole ``(tokens, dim)`` tensor)."""
    for name in names:
        mine, rows = _own_tokens(base, layer.token_indices[name], like.device)
        like = like.index_copy(0, rows, values_of(name)[mine].to(like))
    return like


def _install_trainable_tokens() -> None:
    """PEFT's trainable tokens (``trainable_token_indices=[...]``, PEFT's ``TrainableTokensLayer``) on oslo's
    vocabulary-split embedding and LM head: PEFT's layer computes with ``nn.Embedding``'s and ``nn.Linear``'s
    functions (on oslo's layers it failed at the first call). The layer here calls oslo's layer with a weight whose
    trained rows are replaced, as PEFT replaces them. With several processes the trained rows are whole on every rank
    (a replicated DTensor; their original values gathered over the group when the adapter is added), each rank
    replaces the rows its slice of the vocabulary holds, and their gradients (each row's from the rank holding it)
    are summed over the group."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    from peft.tuners.tuners_utils import check_adapters_to_merge

    update, forward, merge, unmerge, merged_weights = (
        TrainableTokensLayer.update_layer, TrainableTokensLayer.forward_adapters, TrainableTokensLayer.merge,
        TrainableTokensLayer.unmerge, TrainableTokensLayer.get_merged_weights)

    def context_of(base):
        context = _context_of(base)
        return context if context is not None and context.world_size > 1 else None

    @functools.wraps(update)
    def update_layer(self, adapter_name, config=None, tied_adapter=None, **kwargs):
        base = _vocabulary_layer(self)
        context = None if base is None else context_of(base)
        if context is None or tied_adapter is not None:
            return update(self, adapter_name, config=config, tied_adapter=tied_adapter, **kwargs)
        indices = config.token_indices if config is not None else kwargs["token_indices"]
        init_weights = config.init_weights if config is not None else kwargs.get("init_weights", True)
        self.token_indices[adapter_name] = indices
        stored = _stored(base.weight).detach()  # the originals are a buffer: no autograd history
        mine, rows = _own_tokens(base, indices, stored.device)
        originals = stored.new_zeros((len(indices), stored.shape[1]))
        originals[mine] = stored[rows]
        with naming_timeouts(context, "gathering the trained tokens' rows over the tensor-parallel group",
                             "every rank adds the same adapters to the model (get_peft_model, add_adapter)"):
            torch.distributed.all_reduce(originals, group=base.group)
        values = originals.clone() if init_weights else torch.randn_like(originals)
        if not init_weights:
            _take_first_ranks(context, [values])
        self.trainable_tokens_delta[adapter_name] = torch.nn.Parameter(values, requires_grad=True)
        _as_vectors(self, "trainable_tokens_delta", context)
        self.trainable_tokens_original[adapter_name] = originals
        self._move_adapter_to_device_of_base_layer(adapter_name)

    @functools.wraps(forward)
    def forward_adapters(self, x, active_adapters, *args, **kwargs):
        base = _vocabulary_layer(self)
        if base is None:
            return forward(self, x, active_adapters, *args, **kwargs)
        if self.disable_adapters or not active_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged:
            return self.base_layer(x, *args, **kwargs)
        self._check_overlapping_tokens(active_adapters)
        context = context_of(base)

        def trained(name):
            values = self.trainable_tokens_delta[name]
            if context is None:
                return values
            # whole on every rank; each row's gradient comes from the rank holding it: summed over the group
            return copy_to_tensor_parallel(local(values), base.group)

        weight = _token_rows(self, base, active_adapters, trained,
                             local(base.weight, base.parallel_specs.get("weight")))
        with _computing_with(base, weight):
            return self.base_layer(x, *args, **kwargs)

    @functools.wraps(merge)
    def merge_tokens(self, safe_merge: bool = False, adapter_names=None) -> None:
        base = _vocabulary_layer(self)
        if base is None:
            return merge(self, safe_merge=safe_merge, adapter_names=adapter_names)
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        self._check_overlapping_tokens(adapter_names)
        weight = _stored(base.weight)
        with torch.no_grad():
            merged = _token_rows(self, base, adapter_names, lambda name: _stored(self.trainable_tokens_delta[name]),
                                 weight)
            if safe_merge and not all(torch.isfinite(_stored(self.trainable_tokens_delta[name])).all()
                                      for name in adapter_names):  # (whole on every rank: every rank agrees)
                raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter_names} seems to be "
                                 "broken")
            weight.copy_(merged)
        self.merged_adapters.extend(adapter_names)

    @functools.wraps(unmerge)
    def unmerge_tokens(self) -> None:
        base = _vocabulary_layer(self)
        if base is None:
            return unmerge(self)
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        weight = _stored(base.weight)
        with torch.no_grad():
            while self.merged_adapters:
                name = self.merged_adapters.pop()
                weight.copy_(_token_rows(self, base, [name], lambda n: self.trainable_tokens_original[n], weight))

    @functools.wraps(merged_weights)
    def get_merged_weights(self, active_adapters):
        base = _vocabulary_layer(self)
        if base is None or context_of(base) is None:
            return merged_weights(self, active_adapters)
        # (``wrapper.weight``): the layer's parameter, a DTensor of the unmerged weight
        return base.weight

    # With pipelines each stage wraps the layers it holds (the input embeddings are on the first).
    import peft.peft_model
    import peft.tuners.tuners_utils as tuners_utils

    additional = tuners_utils.set_additional_trainable_modules

    @functools.wraps(additional)
    def additional_on_this_stage(model, peft_config, *args, **kwargs):
        context = getattr(model, "parallel_context", None)
        indices = getattr(peft_config, "trainable_token_indices", None)
        if context is None or context.pipeline_parallel_size == 1 or indices is None:
            return additional(model, peft_config, *args, **kwargs)
        if isinstance(indices, dict):
            names = [name for name, _ in model.named_modules()]
            held = {layer: ids for layer, ids in indices.items()
                    if any(name == layer or name.endswith("." + layer) for name in names)}
        else:
            held = indices if model.get_input_embeddings() is not None else None
        peft_config = copy.copy(peft_config)
        peft_config.trainable_token_indices = held or None
        return additional(model, peft_config, *args, **kwargs)

    tuners_utils.set_additional_trainable_modules = additional_on_this_stage
    peft.peft_model.set_additional_trainable_modules = additional_on_this_stage

    TrainableTokensLayer.update_layer = update_layer
    TrainableTokensLayer.forward_adapters = forward_adapters
    TrainableTokensLayer.merge = merge_tokens
    TrainableTokensLayer.unmerge = unmerge_tokens
    TrainableTokensLayer.get_merged_weights = get_merged_weights


class _PlainLinear(torch.nn.Linear):
    """An oslo linear layer of a model of one process as the ``nn.Linear`` it computes, on the same parameters: what
    PEFT's other tuners (those oslo does not adapt itself) take. Called as oslo's layers are called too
    (``skip_bias_add``, ``input_is_copied``)."""

    def __init__(self, layer) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias

    def forward(self, x: torch.Tensor, skip_bias_add: bool = False, input_is_copied: bool = False) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, None if skip_bias_add else self.bias)


def _plain_conv1d_class():
    from transformers.pytorch_utils import Conv1D

    class _PlainConv1D(Conv1D):
        """The same for an oslo layer storing its weight as ``(in, out)`` (GPT2's): transformers' ``Conv1D``."""

        def __init__(self, layer) -> None:
            torch.nn.Module.__init__(self)
            self.nf, self.nx = layer.out_features, layer.in_features
            self.weight, self.bias = layer.weight, layer.bias

        def forward(self, x: torch.Tensor, skip_bias_add: bool = False, input_is_copied: bool = False) -> torch.Tensor:
            out = x @ self.weight
            return out if skip_bias_add or self.bias is None else out + self.bias

    return _PlainConv1D


def _skip_bias_pre_hook(module, args, kwargs):
    """Before a PEFT layer of another tuner: oslo's call options taken off (its layer may compute without calling
    the base layer); a fused caller's ``skip_bias_add`` remembered for :func:`_skip_bias_hook`."""
    module.__dict__.setdefault("_oslo_skipping", []).append(bool(kwargs.pop("skip_bias_add", False)))
    kwargs.pop("input_is_copied", None)
    return args, kwargs


def _skip_bias_hook(module, args, kwargs, output):
    """After it: the bias taken off the output the layer computed whole when the caller adds it itself (the tensor
    the layer added: its gradient cancels)."""
    if module.__dict__["_oslo_skipping"].pop():
        bias = added_bias(module)
        if bias is not None:
            return output - bias
    return output


def _install_other_tuners() -> None:
    """PEFT's other tuners (OFT, BOFT, HRA, VeRA, FourierFT...: those oslo does not adapt itself) take ``nn.Linear``
    (some also transformers' ``Conv1D``) only. In a model of one process an oslo linear layer computes what the
    ``nn.Linear`` (GPT2's: the ``Conv1D``) it stands for computes: the layers such a tuner targets become those, on
    the same parameters, before PEFT wraps them with its own layers, as on transformers' model. With several
    processes such a tuner raises ``NotImplementedError`` on every rank, naming itself."""
    import peft.tuners.tuners_utils as tuners_utils
    from peft.tuners.trainable_tokens.model import TrainableTokensModel
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, check_target_module_exists

    plain_conv1d = _plain_conv1d_class()
    plain_layers = (_PlainLinear, plain_conv1d)

    def oslo_layers_for(tuner, model, config) -> bool:
        """Before ``tuner`` (not one oslo adapts itself) acts on ``model``: the oslo linear layers ``config`` targets
        made plain layers (one process), or its refusal (several); whether ``model`` is an oslo model."""
        context = getattr(model, "parallel_context", None)
        if context is None or isinstance(tuner, TrainableTokensModel) \
                or getattr(type(tuner).inject_adapter, "_oslo_layout", False):
            return False
        try:  # the targets as PEFT resolves them (its defaults for the model's type, "all-linear")
            config = tuner._prepare_adapter_config(copy.deepcopy(config), BaseTuner.get_model_config(model))
            config = tuners_utils._maybe_include_all_linear_layers(config, model)
            # (with several processes an nn.Linear's parameters are DTensors too: PEFT's layers cannot compute on them)
            kinds = (ColumnParallelLinear, RowParallelLinear) + ((torch.nn.Linear,) if context.world_size > 1 else ())
            targets = [name for name, module in model.named_modules()
                       if isinstance(module, kinds)
                       and not (isinstance(module, ColumnParallelLinear) and module.weight_spec.kind == VOCAB)
                       and check_target_module_exists(config, name)]
        except Exception:  # noqa: BLE001 - a config PEFT itself refuses: PEFT's own error, raised by PEFT
            return True
        if targets and context.world_size > 1:
            method = getattr(config.peft_type, "value", config.peft_type)
            raise NotImplementedError(
                f"PEFT's {method} on an oslo model of several processes (world size {context.world_size}) is not "
                f"implemented yet (it targets {targets[0]}, whose parameters are DTensors here): it works on a "
                "model built in one process; LoRA (DoRA, rsLoRA), (IA)^3, LoHa and LoKr work at every layout.")
        for name in targets:
            parent_name, _, child = name.rpartition(".")
            layer = model.get_submodule(name)
            plain = plain_conv1d(layer) if getattr(layer, "transposed", False) else _PlainLinear(layer)
            setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
        return True

    init = BaseTuner.__init__

    @functools.wraps(init)
    def init_on_plain_layers(self, model, peft_config, adapter_name, *args, **kwargs):
        # (before the tuner's own pre-injection hook: VeRA sizes its projections from the layers it targets)
        oslo_layers_for(self, model, peft_config[adapter_name] if isinstance(peft_config, dict) else peft_config)
        init(self, model, peft_config, adapter_name, *args, **kwargs)

    inject = BaseTuner.inject_adapter

    @functools.wraps(inject)
    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        if not oslo_layers_for(self, model, self.peft_config[adapter_name]):
            return inject(self, model, adapter_name, *args, **kwargs)
        result = inject(self, model, adapter_name, *args, **kwargs)
        for module in model.modules():
            if isinstance(module, BaseTunerLayer) and isinstance(module.get_base_layer(), plain_layers) \
                    and "_oslo_skipping" not in module.__dict__:
                module.__dict__["_oslo_skipping"] = []
                module.register_forward_pre_hook(_skip_bias_pre_hook, with_kwargs=True)
                module.register_forward_hook(_skip_bias_hook, with_kwargs=True)
        return result

    BaseTuner.__init__ = init_on_plain_layers
    BaseTuner.inject_adapter = inject_adapter


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

    # An adapted embedding or LM head is saved with its base weights when PEFT saves embedding layers (a LoRA on
    # GPT2's tied lm_head): PEFT looks for an nn.Linear or nn.Embedding base layer, oslo's are vocabulary-split.
    import peft.utils.save_and_load as save_and_load

    valid_base = save_and_load.has_valid_embedding_base_layer

    @functools.wraps(valid_base)
    def valid_oslo_base(layer):
        return valid_base(layer) or isinstance(getattr(layer, "base_layer", None),
                                               VocabParallelEmbedding | VocabParallelLMHead)

    save_and_load.has_valid_embedding_base_layer = valid_oslo_base

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

    # The Trainer hands accelerate the PEFT model: the oslo model learns it is wrapped (whether accelerate prepared
    # its wrapper decides who averages the gradients over the data-parallel replicas).
    init = peft.peft_model.PeftModel.__init__

    @functools.wraps(init)
    def init_wrapping(self, model, *args, **kwargs):
        init(self, model, *args, **kwargs)
        wrapped = _oslo_model(self)
        if wrapped is not None:
            wrapped._oslo_wrapper = weakref.ref(self)

    peft.peft_model.PeftModel.__init__ = init_wrapping

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

    # Merging into a layer tied across pipeline stages would change one stage's copy only (transformers' tie is one
    # tensor: PEFT's merge changes the input embeddings too). PEFT asks every rank before any merge.
    from peft.tuners.ia3.model import IA3Model
    from peft.tuners.loha.model import LoHaModel
    from peft.tuners.lokr.model import LoKrModel
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import check_target_module_exists

    def refusing_tied_merges(check_merge):
        @functools.wraps(check_merge)
        def merge_allowed(self):
            check_merge(self)
            model = getattr(self, "model", None)
            if getattr(model, "parallel_context", None) is None or model.parallel_context.pipeline_parallel_size == 1:
                return
            tied = {name.rsplit(".", 1)[0] for source, members in tie_families(model).items()
                    for name in (source, *members)}
            for config in self.peft_config.values():
                targeted = sorted(module for module in tied if check_target_module_exists(config, module))
                if targeted:
                    raise NotImplementedError(
                        f"merging an adapter of {', '.join(targeted)} (tied across pipeline stages: each stage holds "
                        f"a copy) at pipeline_parallel_size={model.parallel_context.pipeline_parallel_size} is not "
                        "implemented yet: merge it in a model of one stage (load the saved adapter there), or keep "
                        "it unmerged.")

        return merge_allowed

    # target_modules="all-linear" picks the nn.Linear and Conv1D layers: oslo's linear layers are linear layers too.
    import peft.tuners.tuners_utils as tuners_utils

    all_linear = tuners_utils._maybe_include_all_linear_layers

    @functools.wraps(all_linear)
    def all_linear_with_oslo_layers(peft_config, model):
        target = getattr(peft_config, "target_modules", None)
        shorthand = isinstance(target, str) and target.lower() == "all-linear"
        peft_config = all_linear(peft_config, model)
        if shorthand and hasattr(model, "parallel_context"):
            peft_config.target_modules = set(peft_config.target_modules) | _oslo_linear_layers(model, peft_config)
        return peft_config

    tuners_utils._maybe_include_all_linear_layers = all_linear_with_oslo_layers

    # PEFT takes an adapter of a half-precision model to float32 by replacing its parameters: oslo's adapter DTensors
    # are converted on their storages first (PEFT then finds nothing to convert).
    cast = tuners_utils.cast_adapter_dtype

    @functools.wraps(cast)
    def cast_keeping_dtensors(model, adapter_name, autocast_adapter_dtype=True):
        if autocast_adapter_dtype:
            for layer in model.modules():
                if not isinstance(layer, _OnOsloLayer):
                    continue
                for layer_name in layer.adapter_layer_names:
                    adapters = getattr(layer, layer_name, None)
                    if not isinstance(adapters, torch.nn.Module) or adapter_name not in adapters:
                        continue
                    if isinstance(adapters, _Vectors):  # (IA)^3's vectors
                        adapters.upcast({adapter_name})
                    elif isinstance(adapters[adapter_name], _KeepsDTensors):  # a LoRA matrix, DoRA's magnitude
                        adapters[adapter_name].upcast()
        return cast(model, adapter_name, autocast_adapter_dtype=autocast_adapter_dtype)

    tuners_utils.cast_adapter_dtype = cast_keeping_dtensors

    _install_trainable_tokens()

    # LoRA's add_weighted_adapter combines whole matrices (the SVD types their product, the DARE types with random
    # masks): with several processes PEFT computes on each layer's whole matrices, as in one process, and the new
    # adapter is then split like its layer (every rank taking its stage's first rank's, as for a new adapter).
    weighted = LoraModel.add_weighted_adapter

    @functools.wraps(weighted)
    def add_weighted_adapter(self, adapters, weights, adapter_name, *args, **kwargs):
        model = getattr(self, "model", None)
        context = getattr(model, "parallel_context", None)
        if context is None or context.world_size == 1:
            return weighted(self, adapters, weights, adapter_name, *args, **kwargs)
        check = getattr(self, "_check_add_weighted_adapter", None)
        if check is not None:  # PEFT's own refusals (DoRA since PEFT 0.22), on every rank before any collective
            bound = inspect.signature(weighted).bind(self, adapters, weights, adapter_name, *args, **kwargs)
            bound.apply_defaults()
            check(adapters, bound.arguments.get("combination_type", "svd"), bound.arguments.get("svd_rank"))
        dora = [name for name in adapters if getattr(self.peft_config.get(name), "use_dora", False)]
        if dora:
            raise NotImplementedError(
                f"add_weighted_adapter of DoRA adapters ({', '.join(dora)}) on an oslo model of several processes is "
                "not implemented yet: combine them in one process (load them on the model built there, "
                "add_weighted_adapter, save_pretrained), then load the result at any layout.")
        layers = [layer for layer in model.modules()
                  if isinstance(layer, ParallelLoraLinear) and layer._oslo_context is not None]
        with _combined_whole(layers, adapters):
            return weighted(self, adapters, weights, adapter_name, *args, **kwargs)

    LoraModel.add_weighted_adapter = add_weighted_adapter

    # PEFT's prompt learning embeds the virtual tokens itself, on every rank: a later pipeline stage has no input
    # embeddings (PEFT would fail there with "'NoneType' object is not callable", mid-step). Refused on every rank.
    setup = peft.peft_model.PeftModel._setup_prompt_encoder

    @functools.wraps(setup)
    def setup_prompt_encoder(self, adapter_name, *args, **kwargs):
        model = _oslo_model(self)
        context = None if model is None else model.parallel_context
        if context is not None and context.pipeline_parallel_size > 1:
            method = self.peft_config[adapter_name].peft_type
            raise NotImplementedError(
                f"PEFT's {getattr(method, 'value', method)} (prompt learning) on an oslo model at "
                f"pipeline_parallel_size={context.pipeline_parallel_size} is not implemented yet: PEFT embeds the "
                "virtual tokens on every rank, and a later pipeline stage holds no input embeddings. Use it at "
                "pipeline_parallel_size=1 (prompt tuning works with tensor parallelism), or LoRA or (IA)^3, which "
                "work with pipelines.")
        return setup(self, adapter_name, *args, **kwargs)

    peft.peft_model.PeftModel._setup_prompt_encoder = setup_prompt_encoder

    for tuner in (LoraModel, IA3Model, LoHaModel, LoKrModel):
        tuner._check_merge_allowed = refusing_tied_merges(tuner._check_merge_allowed)

