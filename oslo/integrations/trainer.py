"""transformers' ``Trainer`` saving, resuming and evaluating an oslo model whose parameters are split over several
processes.

The Trainer writes a checkpoint from its main process alone: ``save_model`` and each ``checkpoint-N``'s model
files through ``save_pretrained`` (or, for a module that is not a transformers model, its ``state_dict``), the
optimizer's state with ``torch.save(optimizer.state_dict())``. No single rank holds a split model's weights or its
optimizer's state, so those saves are collective: :func:`install` wraps some of the Trainer's methods, for oslo
models that span several processes (and, for the optimizer's state, oslo models of one process; every other model
takes the Trainer's own path):

- ``_save`` (``save_model``, and the model files of a checkpoint): every rank takes part in
  ``save_pretrained_with_parallel(save_with_merging=True)``, a plain transformers checkpoint published atomically
  (``from_pretrained`` loads it as it loads the Trainer's files of one process), or, for a PEFT model, in PEFT's
  ``save_pretrained`` (the whole adapter); the main process then writes the tokenizer and the training arguments as
  the Trainer does.
- ``_save_optimizer_and_scheduler``: the optimizer's state goes to ``optimizer/`` with
  ``torch.distributed.checkpoint`` (each rank writes its slices, keyed by the model's parameter names: torch's
  ``get_optimizer_state_dict`` as oslo adjusts it, see :mod:`oslo.parallel.dtensor`), with the model's random
  streams (dropout); the scheduler's state to ``scheduler.pt``, as the Trainer writes it. An oslo model in one
  process saves the same way, so that every oslo checkpoint resumes at any layout.
- ``_load_optimizer_and_scheduler``: the reverse, each rank reading its slices (``resume_from_checkpoint``), at
  the layout that saved them or another one.

The model files need no hook to load back (``resume_from_checkpoint``, ``load_best_model_at_end``): the Trainer hands
their whole tensors to the model's ``load_state_dict``, which an oslo model (or ``gpu_modules()``' wrapper) takes at
any layout, each rank keeping its slices; a PEFT model's adapter goes through PEFT's ``load_adapter``. The one case
the Trainer does not see as PEFT, a PEFT model's replicas handed over as ``gpu_modules()``, saves its adapter too,
and ``_load_from_checkpoint`` and ``_load_best_model`` read it back with ``load_adapter``.

Every rank must call ``trainer.save_model()``, as with DeepSpeed or FSDP (the Trainer's own checkpoints do).

Evaluation (``evaluate``, ``predict``) gathers every process's outputs, while the ranks of a tensor-parallel group
compute on the same rows: ``evaluation_loop`` is wrapped to keep one copy of them (:func:`_evaluation_loop_hook`).
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from oslo.parallel.dtensor import is_distributed, model_parameter_names
from oslo.training_state import (
    WeightsOnlyLoadPlanner,
    random_state,
    random_streams_to_load,
    restore_random_streams,
)

OPTIMIZER_DIRECTORY = "optimizer"


def oslo_model(model: nn.Module | None) -> nn.Module | None:
    """The oslo model in ``model`` (itself, a PEFT model's base, the module of ``gpu_modules()``' or DDP's
    wrapper); ``None`` if there is none."""
    seen: set[int] = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        if hasattr(type(model), "save_pretrained_with_parallel"):
            return model
        if hasattr(type(model), "get_base_model"):  # PEFT
            model = model.get_base_model()
        else:
            model = getattr(model, "_modules", {}).get("module")
    return None


def split_model(model: nn.Module | None) -> nn.Module | None:
    """The oslo model in ``model`` when its parameters span several processes; ``None`` otherwise."""
    model = oslo_model(model)
    return model if model is not None and is_distributed(model) else None


def _is_peft(model: nn.Module) -> bool:
    return hasattr(type(model), "get_base_model") and hasattr(type(model), "load_adapter")


def _adapted(trainer_model: nn.Module, oslo_model: nn.Module | None) -> nn.Module | None:
    """The PEFT model the Trainer trains: the one it holds, or the one around the oslo model that ``gpu_modules()``'
    wrapper holds (data-parallel replicas of a PEFT model, handed to the Trainer as ``model.gpu_modules()``)."""
    if _is_peft(trainer_model):
        return trainer_model
    reference = getattr(oslo_model, "_oslo_wrapper", None) if oslo_model is not None else None
    wrapper = reference() if reference is not None else None
    if wrapper is None or not _is_peft(wrapper) or wrapper.get_base_model() is not oslo_model:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer  # PEFT made the wrapper: it is installed

    # Still adapted (merge_and_unload() leaves the wrapper behind, around a plain model).
    return wrapper if any(isinstance(module, BaseTunerLayer) for module in oslo_model.modules()) else None


def _save_hook(save):
    @functools.wraps(save)
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        model = split_model(self.model)
        if model is None or state_dict is not None:
            return save(self, output_dir, state_dict)
        from transformers.trainer import TRAINING_ARGS_NAME

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        adapted = _adapted(self.model, model)
        if adapted is not None:  # oslo's PEFT saves gather the adapter on every rank; the main process writes
            adapted.save_pretrained(output_dir, is_main_process=self.args.should_save)
        else:
            model.save_pretrained_with_parallel(output_dir, save_with_merging=True)
        if not self.args.should_save:
            return
        # What the Trainer writes beside the model.
        tokenizer = self.processing_class
        if tokenizer is None and self.data_collator is not None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    return _save


def _takes_own_path(trainer) -> bool:
    """DeepSpeed and FSDP save and load the optimizer their own way."""
    return bool(getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False))


def _renamed(state: dict, names: dict[str, str]) -> dict:
    """An optimizer state dict of torch's ``get_optimizer_state_dict`` (keyed by parameter name) under ``names``'
    names: saved under the model's names, whatever module the Trainer holds (the model, or ``gpu_modules()``'
    wrapper, whose parameters are named otherwise), so that a run at another layout loads it. The per-parameter
    states are the same tensors (``dcp.load`` fills them in place). Nested (``{"state": {name: ...}, "param_groups":
    [...]}``) or flattened (``"state.<name>.<key>"``, ``"param_groups.<name>.<key>"``), as torch gives it."""
    if "state" in state:
        return {
            "state": {names.get(name, name): value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [names.get(name, name) for name in group["params"]]}
                             for group in state["param_groups"]],
        }
    renamed = {}
    for key, value in state.items():
        kind, _, rest = key.partition(".")
        name, _, entry = rest.rpartition(".")
        renamed[f"{kind}.{names.get(name, name)}.{entry}"] = value
    return renamed


def _save_optimizer_hook(save_optimizer):
    @functools.wraps(save_optimizer)
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        model = oslo_model(self.model)  # in one process too: its state then loads at any layout
        if model is None or _takes_own_path(self):
            return save_optimizer(self, output_dir)
        from transformers.trainer import SCHEDULER_NAME

        context = model.parallel_context
        optimizer = _renamed(get_optimizer_state_dict(self.model, self.optimizer), model_parameter_names(self.model))
        dcp.save({"optimizer": optimizer, **random_state(context)},
                 checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIRECTORY))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    return _save_optimizer_and_scheduler


def _load_optimizer_hook(load_optimizer):
    @functools.wraps(load_optimizer)
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        model = oslo_model(self.model)
        directory = None if checkpoint is None else os.path.join(checkpoint, OPTIMIZER_DIRECTORY)
        if model is None or _takes_own_path(self) or directory is None or not os.path.isdir(directory):
            return load_optimizer(self, checkpoint)
        from transformers.trainer import SCHEDULER_NAME

        context = model.parallel_context
        names = model_parameter_names(self.model)
        state = {
            "optimizer": _renamed(get_optimizer_state_dict(self.model, self.optimizer), names),
            "rng": random_streams_to_load(context, directory),
        }
        dcp.load(state, checkpoint_id=directory, planner=WeightsOnlyLoadPlanner())
        ours = {model_name: name for name, model_name in names.items()}
        set_optimizer_state_dict(self.model, self.optimizer, _renamed(state["optimizer"], ours))
        restore_random_streams(context, state["rng"])
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    return _load_optimizer_and_scheduler


def _load_adapter_hook(load):
    """``_load_from_checkpoint`` (``resume_from_checkpoint``) and ``_load_best_model`` (``load_best_model_at_end``)
    for a PEFT model handed over as ``gpu_modules()``, whose checkpoints hold its adapter: PEFT's ``load_adapter``,
    as the Trainer loads a PEFT model it holds itself."""

    @functools.wraps(load)
    def loading(self, *args, **kwargs):
        model = split_model(self.model)
        adapted = None if _is_peft(self.model) else _adapted(self.model, model)
        if adapted is None or _takes_own_path(self):
            return load(self, *args, **kwargs)
        checkpoint = args[0] if args else kwargs.get("resume_from_checkpoint", self.state.best_model_checkpoint)
        adapted.load_adapter(checkpoint, adapted.active_adapter, is_trainable=True)

    return loading


def _one_copy_per_replica(accelerator, gather_function, context):
    """``gather_function`` (the Trainer's ``gather_for_metrics``) keeping, of what every process sent, one copy of each
    data-parallel replica's rows: the first tensor-parallel rank's (of the last stage, which holds the outputs).
    Only the gather of its results: the count of label tokens that the Trainer sums with ``accelerator.gather`` in the
    same loop (and divides by ``tensor_parallel_size`` itself) is left as it is."""
    from accelerate.utils import recursively_apply

    keep = [context.global_rank(replica, context.pipeline_parallel_size - 1, 0)
            for replica in range(context.data_parallel_size)]

    def one_copy(tensor: torch.Tensor) -> torch.Tensor:
        parts = tensor.chunk(context.world_size)
        return torch.cat([parts[rank] for rank in keep])

    gather = accelerator.gather

    def gather_once(data):
        return recursively_apply(one_copy, gather(data))

    if getattr(gather_function, "__self__", None) is accelerator and gather_function.__name__ == "gather":
        return gather_once

    @functools.wraps(gather_function)
    def gathering(*args, **kwargs):
        accelerator.gather = gather_once  # what gather_for_metrics calls before it cuts the last batch's repeats
        try:
            return gather_function(*args, **kwargs)
        finally:
            del accelerator.gather

    return gathering


def _evaluation_loop_hook(loop):
    """``evaluation_loop`` (``evaluate``, ``predict``) of a tensor-parallel model. The Trainer gathers each batch's
    losses, predictions and labels from every process (accelerate's ``gather_for_metrics``), while accelerate gives
    the ranks of one tensor-parallel group the same rows (it shards the data over the replicas): each row would come
    back once per tensor-parallel rank (``predict()`` returning ``tensor_parallel_size`` copies), and the cut of the
    last batch (the rows it repeats to fill the replicas' batches) would keep the wrong rows. While the loop runs, the
    Trainer's gather keeps one copy (the loop itself sets it back when it ends)."""

    @functools.wraps(loop)
    def evaluation_loop(self, *args, **kwargs):
        model = split_model(self.model)
        if model is None or model.parallel_context.tensor_parallel_size == 1 or _takes_own_path(self):
            return loop(self, *args, **kwargs)
        original = self.gather_function
        gathering = _one_copy_per_replica(self.accelerator, original, model.parallel_context)
        self.gather_function = gathering
        try:
            return loop(self, *args, **kwargs)
        finally:
            if self.gather_function is gathering:  # the loop stopped before it set its gather back
                self.gather_function = original

    return evaluation_loop


_HOOKS = {
    "_save": _save_hook,
    "_save_optimizer_and_scheduler": _save_optimizer_hook,
    "_load_optimizer_and_scheduler": _load_optimizer_hook,
    "_load_from_checkpoint": _load_adapter_hook,
    "_load_best_model": _load_adapter_hook,
    "evaluation_loop": _evaluation_loop_hook,
}


def install() -> None:
    """Install the hooks above on transformers' ``Trainer``, once, if ``transformers.trainer`` is imported (oslo
    models call it when they are built and when the Trainer reads their ``tp_size``)."""
    module = sys.modules.get("transformers.trainer")
    if module is None:
        return
    cls = module.Trainer
    for name, hook in _HOOKS.items():
        method = getattr(cls, name, None)
        if method is not None and not getattr(method, "_oslo_hook", False):
            hooked = hook(method)
            hooked._oslo_hook = True
            setattr(cls, name, hooked)
