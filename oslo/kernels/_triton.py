"""Guarded Triton import and the rule deciding when a fused op runs Triton instead of torch.

Triton is an optional dependency: importing oslo never requires it. Every fused op keeps a torch
reference path, used on CPU tensors, when Triton is missing, and as the oracle in tests.

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


def use_triton(*tensors: torch.Tensor) -> bool:
    """Decide whether a fused op should launch its Triton kernel for these tensors.

    Triton is used when it is importable and either every tensor lives on a CUDA device, or
    ``TRITON_INTERPRET=1`` is set (the CPU interpreter, meant for tests; slow). Otherwise the op runs
    its torch path.

    Args:
        tensors: the op's tensor inputs.

    Returns:
        True to run the Triton kernel, False to run the torch path.
    """
    if not HAS_TRITON:
        return False
    if triton_interpret_enabled():
        return True
    return all(t.is_cuda for t in tensors)


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
        return kernel[grid]

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
