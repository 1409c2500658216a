"""PEFT's LoRA on oslo's linear layers.

PEFT builds its LoRA wrappers for ``nn.Linear`` and transformers' ``Conv1D``; oslo's layers are
:class:`~oslo.parallel.ColumnParallelLinear` and :class:`~oslo.parallel.RowParallelLinear` (GPT2's with
``Conv1D``'s ``(in, out)`` layout), which PEFT refuses (``Target module ... is not supported``). This module
teaches PEFT's ``LoraModel`` to wrap them: the user writes the ``LoraConfig`` they would write for the
transformers class, ``target_modules`` by the same names.

In one process (tensor_parallel_size 1, no pipeline, no launcher) an oslo linear layer holds the whole weight as
a plain tensor, so :class:`ParallelLoraLinear` is PEFT's own ``lora.Linear`` (merging, unmerging, several
adapters, DoRA, rsLoRA, saving and loading adapters unchanged), with ``fan_in_fan_out`` set from the layer's
layout, as PEFT sets it for ``Conv1D``. A model of several processes (split layers, pipeline stages, DTensor
parameters) raises :class:`NotImplementedError` on every rank before PEFT changes it.

Installed by :func:`install` when an oslo model is built with PEFT importable (``pip install peft``).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

__all__ = ["ParallelLoraLinear", "install"]

ParallelLoraLinear = None  # the class, once PEFT is imported (see install)


def _make_class():
    from peft.tuners.lora.layer import Linear

    class ParallelLoraLinear(Linear):
        """PEFT's ``lora.Linear`` around an oslo :class:`~oslo.parallel.ColumnParallelLinear` or
        :class:`~oslo.parallel.RowParallelLinear` of a model at tensor_parallel_size 1 (the whole weight)."""

        def __init__(self, base_layer, adapter_name: str, config, **kwargs) -> None:
            # LoraLayer reads the features of nn.Linear and Conv1D only; oslo's layers state them themselves.
            base = base_layer.get_base_layer() if hasattr(base_layer, "get_base_layer") else base_layer
            self._oslo_features = (base.in_features, base.out_features)
            if base.transposed and not config.fan_in_fan_out:  # as PEFT does for transformers' Conv1D
                warnings.warn(f"fan_in_fan_out is set to False but the target module {type(base).__name__} stores its "
                              "weight as (in_features, out_features), as transformers' Conv1D. Setting "
                              "fan_in_fan_out to True.", stacklevel=3)
                config.fan_in_fan_out = True
            kwargs["fan_in_fan_out"] = config.fan_in_fan_out
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

        def _get_in_out_features(self, module):
            return self._oslo_features

    ParallelLoraLinear.__module__, ParallelLoraLinear.__qualname__ = __name__, "ParallelLoraLinear"
    return ParallelLoraLinear


def _check_layout(model) -> None:
    """Refuse LoRA on an oslo model whose parameters are split, staged or DTensors (several processes): not
    implemented yet. Raised before PEFT touches the model, on every rank alike."""
    context = getattr(model, "parallel_context", None)
    if context is None or context.world_size == 1:
        return
    if context.tensor_parallel_size > 1:
        why = (f"tensor_parallel_size={context.tensor_parallel_size} (each rank holds 1/{context.tensor_parallel_size} "
               "of the split layers' weights)")
    elif context.pipeline_parallel_size > 1:
        why = f"pipeline_parallel_size={context.pipeline_parallel_size} (each rank holds one stage's layers)"
    else:
        why = f"{context.world_size} processes (the parameters are DTensors)"
    raise NotImplementedError(
        f"PEFT adapters on an oslo {type(model).__name__} built at {why} are not implemented yet: they work on a "
        "model built in one process (tensor_parallel_size=1, pipeline_parallel_size=1, no launcher). To train an "
        "adapter on a split model now, train it on the transformers class and load it with "
        "PeftModel.from_pretrained on an oslo model in one process, or merge it (merge_and_unload) and split the "
        "merged model."
    )


def _dispatch(target, adapter_name, config, **kwargs):
    """PEFT's dispatcher signature: a LoRA module for an oslo linear layer, or ``None`` for anything else."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from oslo.parallel.layers import ColumnParallelLinear, RowParallelLinear

    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        return None
    return ParallelLoraLinear(target, adapter_name, config=config, **kwargs)


def install() -> bool:
    """Make PEFT's ``LoraModel`` wrap oslo's linear layers (once per process); ``False`` without PEFT."""
    global ParallelLoraLinear
    if importlib.util.find_spec("peft") is None:
        return False
    from peft.tuners.lora.model import LoraModel

    create = LoraModel._create_new_module
    if getattr(create, "_oslo_dispatches", False):
        return True
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

    create_new_module._oslo_dispatches = True
    LoraModel._create_new_module = staticmethod(create_new_module)
    LoraModel.inject_adapter = inject_adapter
    return True

