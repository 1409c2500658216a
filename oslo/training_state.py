"""The whole training state — model, optimizer, LR scheduler, random streams, a step counter — saved with
``torch.distributed.checkpoint`` (DCP) and resumed at any layout.

The parameters of a parallel model are DTensors (see :mod:`oslo.parallel.dtensor`), so PyTorch's own recipe
works unchanged; these two functions are that recipe with what a training loop also needs:

* the scheduler, a step counter and ``extra`` values of the caller's;
* a state saved without pipelines resumes with them: the last stage's copy of a tied weight reads its
  optimizer state from the tie's source;
* non-tensor values unpickled with ``weights_only=True`` (DCP's default planner does not);
* the random streams: the replicated stream (the same on every rank) is restored at any layout; the split
  stream and torch's own generators only at the layout that saved them (they are per-rank and have no
  meaning on another layout);
* crash safety: the save is staged beside the target and published in one atomic exchange by rank 0, as
  ``save_pretrained_with_parallel`` does — killed at any instant, the directory holds the previous state or the
  new one.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from oslo.checkpoint import StagedSave

__all__ = ["load_training_state", "save_training_state"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with the saved non-tensor values (hyperparameters, the scheduler's state, the
    step) unpickled with ``weights_only=True``: a checkpoint cannot run code."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _layout(context) -> str:
    return f"tp={context.tensor_parallel_size},pp={context.pipeline_parallel_size},dp={context.data_parallel_size}"


def _random_streams(context) -> dict[str, object]:
    """This rank's random streams under keys that say whose they are (DCP keeps one value per key): the replicated
    stream, the split one and torch's default generator."""
    place = f"pp{context.pipeline_parallel_rank}.tp{context.tensor_parallel_rank}.dp{context.data_parallel_rank}"
    states = context.rng.states()
    return {
        "replicated": states["replicated"],
        f"split.{place}": states["split"],
        f"torch.{place}": torch.get_rng_state(),
    }


def random_state(context) -> dict[str, object]:
    """The entries of a saved state that hold this rank's random streams (``"rng"``) and the layout that saved them
    (``"layout"``)."""
    return {"layout": _layout(context), "rng": _random_streams(context)}


def random_streams_to_load(context, directory: str) -> dict[str, object]:
    """This rank's random streams, for ``dcp.load`` to fill from the state in ``directory`` (under ``"rng"``) and
    :func:`restore_random_streams` to set: all of them where this layout saved it, else the replicated stream alone
    (the per-rank streams of another layout mean nothing here)."""
    saved = {"layout": ""}
    dcp.load(saved, checkpoint_id=directory, planner=WeightsOnlyLoadPlanner())
    streams = _random_streams(context)
    return streams if saved["layout"] == _layout(context) else {"replicated": streams["replicated"]}


def restore_random_streams(context, streams: dict[str, object]) -> None:
    """Set this rank's random streams to ``streams`` (as :func:`random_streams_to_load` gave them, filled)."""
    context.rng.set_states({"replicated": streams["replicated"]})
    for key, value in streams.items():
        if key.startswith("split."):
            context.rng.set_states({"split": value})
        elif key.startswith("torch."):
            torch.set_rng_state(value)


def _state(model: nn.Module, optimizer, scheduler, step, extra) -> dict[str, object]:
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_OPTIONS)
    context = model.parallel_context
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict() if scheduler is not None else {},
        "step": step,
        "extra": json.dumps(extra if extra is not None else {}),  # one value: DCP would walk into a dict
        **random_state(context),
    }


def _read_ties_from_their_source(model: nn.Module, optimizer_state: dict, directory: str) -> dict[str, str]:
    """A weight tied across pipeline stages (GPT2's ``lm_head`` on the last stage, twin of ``wte`` on the first)
    has optimizer state of its own only where it is its own parameter: a state saved without pipelines holds it
    under the tie's source. Such entries are read from the source's (renamed in ``optimizer_state``); returns
    ``{name: source name}`` to rename them back."""
    twins = model.cross_stage_tied_weights() if hasattr(model, "cross_stage_tied_weights") else {}
    if not twins:
        return {}
    saved = set(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)
    moved = {}
    for key in list(optimizer_state):
        if f"optimizer.{key}" in saved:
            continue
        for name, source in twins.items():
            kind, _, rest = key.partition(".")
            if rest.startswith(name + "."):
                renamed = f"{kind}.{source}{rest[len(name):]}"
                if f"optimizer.{renamed}" in saved and renamed not in optimizer_state:
                    optimizer_state[renamed] = optimizer_state.pop(key)
                    moved[key] = renamed
    return moved


def save_training_state(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler=None, *, step: int | None = None, extra: dict | None = None) -> None:
    """Save the training state of ``model`` (an oslo model) and ``optimizer`` to ``directory`` with DCP.

    Collective: every rank of the model calls it. Loads at any (tp, pp, dp) layout with
    :func:`load_training_state`, or with PyTorch's recipe (``get_state_dict``, ``dcp.load``, ``set_state_dict``)
    under the keys ``"model"`` and ``"optimizer"``.

    Args:
        directory: The checkpoint directory (replaced atomically when it exists).
        model: The oslo model.
        optimizer: Its optimizer (built over ``model.parameters()``).
        scheduler: An LR scheduler, saved with ``state_dict()``.
        step: A step counter, returned by :func:`load_training_state`.
        extra: Further values (a JSON-serializable dict: numbers, strings, lists) returned by
            :func:`load_training_state`.
    """
    state = _state(model, optimizer, scheduler, step, extra)
    save = StagedSave(model.parallel_context, os.fspath(directory))
    save.step(lambda: dcp.save(state, checkpoint_id=save.staging), "saving the training state to")
    save.publish()


def load_training_state(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler=None) -> dict[str, object]:
    """Load what :func:`save_training_state` saved into ``model``, ``optimizer`` and ``scheduler``, at this
    model's layout (any). Returns ``{"step": ..., "extra": ...}``.

    Raises:
        FileNotFoundError: ``directory`` holds no training state.
    """
    directory = os.fspath(directory)
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(
            f"{directory!r} holds no training state (no DCP .metadata file): pass the directory that "
            "save_training_state wrote."
        )
    context = model.parallel_context
    state = _state(model, optimizer, scheduler, None, None)
    state["rng"] = random_streams_to_load(context, directory)
    moved = _read_ties_from_their_source(model, state["optimizer"], directory)
    dcp.load(state, checkpoint_id=directory, planner=WeightsOnlyLoadPlanner())
    for name, source in moved.items():
        state["optimizer"][name] = state["optimizer"].pop(source)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_OPTIONS)
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    restore_random_streams(context, state["rng"])
    return {"step": state["step"], "extra": json.loads(state["extra"])}
