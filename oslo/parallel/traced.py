"""oslo's communication as ``torch.library`` custom operators, for the code that ``torch.compile`` traces.

A compiled model call cannot run Python around a collective: the failure watchdog that polls a pending
all-reduce for a peer's failure (:func:`oslo.parallel.failure.wait`), the agreement on the inputs that raises
:class:`~oslo.parallel.agreement.InputMismatchError` on every rank, the overflow agreement queued at the end of
a backward pass. Each is wrapped here in a custom operator: the compiler sees an opaque call with a declared
output (its fake implementation gives the shape), and when the compiled program runs, the operator runs the
same eager code, with the same guarantees and error messages, as an uncompiled call. Outputs are fresh
tensors (a custom operator may not return its input), which the caller uses in place of the input, so the
program cannot move them ahead of what they depend on, nor drop them.

Eager calls keep their in-place collectives; only a call that is being traced (``torch.compiler.is_compiling()``)
goes through these operators. Groups are named by their ``group_name``, models by a key of :func:`register`
(an operator's arguments are tensors, numbers and strings). An operator needs at least one tensor argument.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from oslo.parallel.collectives import eager_all_gather, eager_all_reduce, eager_reduce_scatter

__all__ = ["Hook", "all_gather", "all_reduce", "call", "eager", "hook", "reduce_scatter", "register", "run"]

_objects: dict[int, weakref.ref] = {}
_keys = itertools.count(1)


def register(obj: Any) -> int:
    """A key for ``obj`` (a model) that an operator can take as an argument; the same key every time for the
    same object. The operator holds no reference: a collected object's key finds nothing. Models register when
    they are built (a traced call only reads the key: the tracer would not run the registration itself)."""
    key = getattr(obj, "_oslo_traced_key", None)
    if torch.compiler.is_compiling():
        if key is None:
            raise RuntimeError(f"oslo: {type(obj).__name__} was not registered for compiled calls before tracing")
        return key
    known = _objects.get(key) if key is not None else None
    if known is None or known() is not obj:  # new, or a copy of a registered model (copy.deepcopy)
        key = next(_keys)
        object.__setattr__(obj, "_oslo_traced_key", key)
        _objects[key] = weakref.ref(obj)
    return key


def _lookup(key: int) -> Any:
    obj = _objects.get(key)
    obj = None if obj is None else obj()
    if obj is None:
        raise RuntimeError(f"oslo: a compiled program refers to a model that no longer exists (key {key})")
    return obj


def _group(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("oslo::all_reduce", mutates_args=())
def _all_reduce_op(tensor: torch.Tensor, group_name: str, op: str, what: str) -> torch.Tensor:
    return eager_all_reduce(tensor.clone(memory_format=torch.contiguous_format), _group(group_name), what, op)


@_all_reduce_op.register_fake
def _(tensor, group_name, op, what):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@torch.library.custom_op("oslo::all_gather", mutates_args=())
def _all_gather_op(tensor: torch.Tensor, group_name: str, dim: int, what: str) -> torch.Tensor:
    return eager_all_gather(tensor, _group(group_name), dim, what)


@_all_gather_op.register_fake
def _(tensor, group_name, dim, what):
    parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format)] * dist.get_world_size(_group(group_name))
    return torch.cat(parts, dim=dim)


@torch.library.custom_op("oslo::reduce_scatter", mutates_args=())
def _reduce_scatter_op(tensor: torch.Tensor, group_name: str, dim: int, what: str) -> torch.Tensor:
    return eager_reduce_scatter(tensor, _group(group_name), dim, what).contiguous()


@_reduce_scatter_op.register_fake
def _(tensor, group_name, dim, what):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format).chunk(
        dist.get_world_size(_group(group_name)), dim=dim)[0].contiguous()


def all_reduce(tensor: torch.Tensor, group, what: str, op: str = "sum") -> torch.Tensor:
    """:func:`oslo.parallel.mappings.all_reduce` as a traced operator: a new tensor."""
    return _all_reduce_op(tensor, group.group_name, op, what)


def all_gather(tensor: torch.Tensor, group, dim: int, what: str) -> torch.Tensor:
    """:func:`oslo.parallel.mappings.all_gather` as a traced operator."""
    return _all_gather_op(tensor, group.group_name, dim, what)


def reduce_scatter(tensor: torch.Tensor, group, dim: int, what: str) -> torch.Tensor:
    """:func:`oslo.parallel.mappings.reduce_scatter` as a traced operator."""
    return _reduce_scatter_op(tensor, group.group_name, dim, what)


# ---- calls into eager code: the input agreement, the overflow agreement -------------------------------------
_calls: dict[str, Any] = {}


@torch.library.custom_op("oslo::call", mutates_args=())
def _call_op(tensors: list[torch.Tensor], name: str, key: int, spec: str) -> list[torch.Tensor]:
    outputs = _calls[name](_lookup(key), tensors, spec)
    return [t.clone() for t in outputs]


@_call_op.register_fake
def _(tensors, name, key, spec):
    return [torch.empty_like(t) for t in tensors]


class Hook(NamedTuple):
    """A deferred :func:`call` (of ``name`` on the object registered as ``key``, with ``spec``): what a traced
    loss hands its backward, which calls it with the loss's gradient (:func:`run`)."""

    name: str
    key: int
    spec: str = ""


def hook(name: str, obj: Any, spec: str = "") -> Hook:
    return Hook(name, register(obj), spec)


def run(hook: Hook, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`call` for a :class:`Hook`."""
    return _call_op(tensors, hook.name, hook.key, hook.spec)


def call(name: str, obj: Any, tensors: list[torch.Tensor], spec: str = "") -> list[torch.Tensor]:
    """Run the eager function registered as ``name`` (:func:`eager`) when the compiled program reaches this
    point: ``function(obj, tensors, spec)``, which may communicate and raise; the program goes on with copies
    of ``tensors`` (returned: use them in place of the inputs, so that what follows waits for the call)."""
    return _call_op(tensors, name, register(obj), spec)


def eager(name: str):
    """Register ``function(obj, tensors, spec) -> tensors`` for :func:`call` under ``name``."""

    def decorate(function):
        _calls[name] = function
        return function

    return decorate
