"""Guarded Triton import and the rule deciding when a fused op runs Triton instead of torch.

Triton is an optional dependency: importing oslo never requires it. Every fused op keeps a torch
reference path, used on CPU tensors, when Triton is missing, and as the oracle in tests.

Each fused op is a ``torch.library`` custom operator (:func:`define_op`: ``triton_op`` when Triton is
installed, so ``torch.compile`` sees the kernel launches; ``custom_op`` otherwise), with a registered
autograd formula and fake implementation, so compiled graphs trace through it. Inside an op, the device
of the tensors picks the path (:func:`launches_triton`); the public functions in front of the ops pick
the torch expression instead for shapes where a Triton launch costs more than it saves
(:data:`TRITON_MIN_ROWS`).

Kernels are written as plain functions decorated with :func:`triton_kernel`, which jits them on
first launch rather than at import, so whether a launch is compiled or interpreted depends on
``TRITON_INTERPRET`` at launch time, not on when oslo was imported.

Running Triton's CPU interpreter (``TRITON_INTERPRET=1``) has one more requirement: the variable must
be set *before triton itself is imported*, because Triton's own library functions (``tl.sum``,
``tl.sigmoid``, ``tl.rand``...) are jitted when ``triton.language`` is imported, and compiled-mode
ones cannot run under the interpreter. Note that ``torch._dynamo`` (pulled in by
``transformers.activations``, among others) imports triton, so set the variable in the environment of
the process, e.g. ``TRITON_INTERPRET=1 python script.py``. :func:`triton_interpreter_ready` tells
whether this process can interpret.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the torch paths cover every op without it
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "TRITON_MIN_ROWS",
    "define_op",
    "launchable",
    "launches_triton",
    "next_power_of_2",
    "num_warps_for",
    "tl",
    "triton",
    "triton_interpret_enabled",
    "triton_interpreter_ready",
    "triton_kernel",
    "use_triton",
]


def triton_interpret_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set: Triton kernels then run on CPU through its interpreter.

    Returns:
        True when the environment variable is exactly ``"1"`` (the value every Triton release accepts).
    """
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_interpreter_ready() -> bool:
    """Whether this process can run Triton kernels in the interpreter.

    True when triton was imported while ``TRITON_INTERPRET=1`` was set (its library functions are then
    interpretable); False when triton is missing or was imported in compiled mode.

    Returns:
        Whether interpreted launches will work in this process.
    """
    if not HAS_TRITON:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(getattr(tl, "sigmoid", None), InterpretedFunction)


#: Below this many rows (``numel // shape[-1]``) a CUDA call of an element-wise fused op takes the torch
#: expression: decoding (a few rows per step) is launch-bound, and the op's dispatch plus Triton's Python
#: launcher cost ~40-80 us of CPU against ~6 us for a torch kernel launch, while the memory traffic the
#: fusion saves is a few microseconds of GPU time at most. 8 x 1024-token training batches (8192 rows) are
#: far above it; a 1024-token prefill is still below it. The interpreter ignores it (it exists for tests).
TRITON_MIN_ROWS = 2048


def use_triton(*tensors: torch.Tensor, rows: int | None = None) -> bool:
    """Decide whether a fused op should launch its Triton kernel for these tensors.

    Triton is used when it is importable and either every tensor lives on a CUDA device (and, when
    ``rows`` is given, there are at least :data:`TRITON_MIN_ROWS` of them), or ``TRITON_INTERPRET=1`` is
    set (the CPU interpreter, meant for tests; slow). Otherwise the op runs its torch path. Traceable by
    ``torch.compile``: while compiling, only the devices decide (no environment read).

    Args:
        tensors: the op's tensor inputs.
        rows: the number of rows the op processes, for element-wise ops; None: no row threshold.

    Returns:
        True to run the Triton kernel, False to run the torch path.
    """
    if not HAS_TRITON:
        return False
    if not torch.compiler.is_compiling() and triton_interpret_enabled():
        return True
    if not all(t.is_cuda for t in tensors):
        return False
    return rows is None or rows >= TRITON_MIN_ROWS


def launches_triton(tensor: torch.Tensor) -> bool:
    """Inside a custom op: whether its implementation launches the Triton kernel for ``tensor``.

    CUDA tensors (real, or fake while ``torch.compile`` traces the op) launch it; CPU tensors launch it in
    the interpreter when ``TRITON_INTERPRET=1`` is set and this process can interpret, except fake ones
    (tracing, or ``torch.library.opcheck``'s fake-tensor checks), which take the torch reference: it gives
    the same shapes and dtypes, and the interpreter cannot run on fake tensors.
    """
    if not HAS_TRITON:
        return False
    if tensor.is_cuda:
        return True
    if tensor.device.type != "cpu" or not triton_interpret_enabled() or not triton_interpreter_ready():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(tensor)


class LazyTritonKernel:
    """A Triton kernel jitted on first launch, once per interpreter mode.

    Launch it exactly like a ``@triton.jit`` function: ``kernel[grid](*args, CONST=...)``.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._variants: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]

    def jitted(self) -> Any:
        """The ``triton.jit`` function for the current mode (interpreted or compiled), jitted once."""
        interpret = triton_interpret_enabled()
        kernel = self._variants.get(interpret)
        if kernel is None:
            if triton is None:
                raise RuntimeError(
                    f"Triton kernel {self.__name__} was launched but triton is not installed; install it "
                    '(pip install "triton>=3.0") or call the op on tensors that take the torch path.'
                )
            if interpret and not triton_interpreter_ready():
                raise RuntimeError(
                    "TRITON_INTERPRET=1 is set, but triton was imported before it was set, so Triton's "
                    f"library functions are compiled-mode and kernel {self.__name__} cannot run in the "
                    "interpreter. "
                    "Set TRITON_INTERPRET=1 in the environment before starting Python (torch._dynamo and "
                    "transformers import triton early), or unset it to use the torch path on CPU."
                )
            # triton.jit returns an interpreted function when TRITON_INTERPRET=1 is set right now.
            kernel = triton.jit(self.fn)
            self._variants[interpret] = kernel
        return kernel

    def __repr__(self) -> str:
        return f"LazyTritonKernel({self.__name__})"


def triton_kernel(fn: Callable[..., Any]) -> LazyTritonKernel:
    """Decorator: like ``@triton.jit``, but jits on first launch (see :class:`LazyTritonKernel`).

    Args:
        fn: the kernel body, written in Triton language.

    Returns:
        A launchable kernel.
    """
    return LazyTritonKernel(fn)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_warps_for(block_size: int) -> int:
    """A warp count that keeps roughly 256-element chunks per warp for a row-wise kernel."""
    return max(1, min(16, block_size // 256))


def launchable(kernel: LazyTritonKernel) -> Any:
    """``kernel`` ready to launch inside a ``triton_op``: ``launchable(kernel)[grid](*args)``.

    Wrapped with ``torch.library.wrap_triton`` so that ``torch.compile`` records the launch in its graph
    (in eager mode ``triton_op`` turns the wrapper off: a direct launch). Interpreted kernels run as they
    are (older torch releases' ``wrap_triton`` refuses them).
    """
    jitted = kernel.jitted()
    if triton_interpret_enabled():
        return jitted
    return torch.library.wrap_triton(jitted)


def define_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Any]:
    """Decorator registering a fused op's implementation as the custom operator ``name``.

    With Triton installed this is ``torch.library.triton_op``: the implementation (which must use only
    torch operators and kernels launched through :func:`launchable`) is also the fake implementation, and
    ``torch.compile`` traces into it, so Inductor sees the Triton launches. Without Triton it is
    ``torch.library.custom_op`` with the implementation (then pure torch) registered as fake too.

    Args:
        name: ``"oslo::op_name"``.
        mutates_args: names of the arguments the implementation writes to.

    Returns:
        A decorator turning the implementation into a ``CustomOpDef`` (call it like the function;
        ``register_autograd`` on it).
    """

    def decorate(fn: Callable[..., Any]) -> Any:
        if HAS_TRITON:
            return torch.library.triton_op(name, fn, mutates_args=mutates_args)
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.register_fake(fn)
        return op

    return decorate
