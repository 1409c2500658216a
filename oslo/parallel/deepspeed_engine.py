"""DeepSpeed's engine around an oslo model (``deepspeed.initialize(model=model.gpu_modules(),
model_parameters=model.gpu_parameters(), mpu=model.mpu, config=...)``): the few places where oslo adjusts
DeepSpeed's ``DeepSpeedEngine`` for engines around oslo models (other engines pass through unchanged).

- The engine running a call is known to the model (as ``DistributedDataParallel``'s active module is), so
  the loss divides by the items of the global batch and, with pipelines, the step's micro-batches are one
  accumulation: DeepSpeed reduces the gradients once, at the end of the step, and not after each
  micro-batch's backward (ZeRO 1 would keep only the last micro-batch's share), after the copies of a weight
  tied across pipeline stages have summed their gradients (ZeRO then partitions the sum, not one stage's
  share).
- ZeRO stage 0's float32 clipping (``deepspeed.runtime.utils.clip_grad_norm_``, which counts replicated
  weights on model-parallel rank 0 only, i.e. on the first pipeline stage, and tied copies twice) is
  :func:`oslo.parallel.clip.clip_grad_norm_`. ZeRO 1 and 2 count by Megatron's attributes, the tensor-parallel
  rank and ``ds_pipe_replicated``, which oslo sets on tied copies.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable

from oslo.parallel.clip import clip_grad_norm_
from oslo.parallel.context import ParallelContext

__all__ = ["active_deepspeed_engine", "check_engine", "hold_reduction", "install_deepspeed_hooks", "reduce_now"]


def _oslo_model(engine):
    """The oslo model inside ``engine`` (``model.gpu_modules()`` holds it as ``.module``), or ``None``."""
    model = getattr(getattr(engine, "module", None), "module", None)
    context = getattr(model, "parallel_context", None)
    if isinstance(context, ParallelContext) and engine.mpu is context:
        return model
    return None


def active_deepspeed_engine(context: ParallelContext):
    """The DeepSpeed engine around a model of ``context`` whose forward is running now (``None`` outside one)."""
    ref = context.__dict__.get("_deepspeed_engine")
    return ref() if ref is not None else None


def _forward(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(engine, *args, **kwargs):
        model = _oslo_model(engine)
        if model is None:
            return forward(engine, *args, **kwargs)
        context = model.parallel_context
        outer = context.__dict__.get("_deepspeed_engine")
        context._deepspeed_engine = weakref.ref(engine)
        try:
            return forward(engine, *args, **kwargs)
        finally:
            context._deepspeed_engine = outer

    run._oslo_hook = True
    return run


def hold_reduction(engine, check_only: bool = False) -> None:
    """Until :func:`reduce_now`, the engine's backward passes accumulate (no reduction over the replicas): the
    micro-batches of a pipeline step are one accumulation. ``check_only``: only refuse what cannot be held.

    Raises:
        NotImplementedError: ZeRO stage 2 or 3 (they reduce during the backward pass).
    """
    check_engine(engine, pipeline=True)
    if not check_only:
        engine.set_gradient_accumulation_boundary(False)


def check_engine(engine, pipeline: bool) -> None:
    """Refuse what DeepSpeed cannot do with an oslo model (every rank of the engine alike, at the model call).

    Raises:
        NotImplementedError: ZeRO stage 3 (it gathers the parameters of each submodule, while an oslo model's
            layers compute on the shards that ``model.gpu_modules()`` holds), or ZeRO stage 2 with pipelines.
    """
    stage = engine.zero_optimization_stage()
    if stage >= 3:
        raise NotImplementedError(
            "DeepSpeed ZeRO stage 3 is not supported with oslo models: it gathers each submodule's parameters "
            "around its forward, while oslo's layers compute on the tensor-parallel shards model.gpu_modules() holds. "
            "Use ZeRO stage 1 or 2 (\"zero_optimization\": {\"stage\": 2}), or FSDP2 (USAGE.md, 'FSDP2')."
        )
    if pipeline and engine.zero_optimization_partition_gradients():
        raise NotImplementedError(
            f"DeepSpeed ZeRO stage {engine.zero_optimization_stage()} partitions gradients during the backward "
            "pass, before the copies of weights tied across pipeline stages have summed theirs: it is supported at "
            "pipeline_parallel_size=1. With pipelines use ZeRO stage 0 or 1 (\"zero_optimization\": {\"stage\": 1})."
        )


def reduce_now(engine) -> None:
    """The engine's reduction over the data-parallel replicas (averaging; ZeRO 1 keeps its partition), once the
    step's gradients are complete (tied copies summed), if the step ends an accumulation
    (``gradient_accumulation_steps``); the engine's own count decides again afterwards."""
    engine._is_gradient_accumulation_boundary = None  # DeepSpeed's own count (micro-steps)
    if not engine.is_gradient_accumulation_boundary():
        return
    engine.set_gradient_accumulation_boundary(True)
    try:
        engine.allreduce_gradients()
    finally:
        engine._is_gradient_accumulation_boundary = None


def _clip_fp32_gradients(clip_fp32_gradients: Callable) -> Callable:
    @functools.wraps(clip_fp32_gradients)
    def clip(engine):
        model = _oslo_model(engine)
        if model is None:
            return clip_fp32_gradients(engine)
        clip_grad_norm_(model, engine.gradient_clipping())

    clip._oslo_hook = True
    return clip


def install_deepspeed_hooks() -> None:
    """Install the hooks above on DeepSpeed's engine class, once, if DeepSpeed is imported."""
    module = sys.modules.get("deepspeed.runtime.engine")
    if module is None:
        return
    cls = module.DeepSpeedEngine
    for name, hook in (("forward", _forward), ("clip_fp32_gradients", _clip_fp32_gradients)):
        method = getattr(cls, name)
        if not getattr(method, "_oslo_hook", False):
            setattr(cls, name, hook(method))
