"""Kernel tests: the torch paths always run; the Triton kernels run on CUDA when present, otherwise in
Triton's CPU interpreter.

Triton's interpreter needs ``TRITON_INTERPRET=1`` set *before triton is imported* (its library
functions, e.g. ``tl.sum``, are jitted at import): ``tests/conftest.py`` imports triton that way first
thing, so this process can interpret, while every test that does not ask for Triton sees no
``TRITON_INTERPRET`` and exercises the torch path.
"""

from __future__ import annotations

import pytest
import torch

# Forked gloo workers in other test packages hang if this process used torch's default thread pool.
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton: runs a Triton kernel (on CUDA, or in the CPU interpreter)")


@pytest.fixture(autouse=True)
def _torch_path_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TRITON_INTERPRET, CPU tensors take the torch path (even if CI exports the variable)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def triton_device(monkeypatch: pytest.MonkeyPatch) -> str:
    """Device on which the fused ops will launch their Triton kernels; skips when that is impossible.
    The row threshold below which CUDA calls take the torch path is lifted: the tests' shapes are small."""
    pytest.importorskip("triton")
    import oslo.kernels._triton

    monkeypatch.setattr(oslo.kernels._triton, "TRITON_MIN_ROWS", 0)
    if torch.cuda.is_available():
        return "cuda"
    from oslo.kernels import triton_interpreter_ready

    if not triton_interpreter_ready():
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set; these cases run in a fresh process "
            "(tests/kernels/test_interpreter_subprocess.py)"
        )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Compare a Triton result with the torch reference, with a tolerance justified by the dtype.

    fp32: the kernels compute in fp32 but may reassociate (row sums, the sigmoid form of tanh-GeLU):
    a few ulp relative, and 1e-5 absolute because torch's tanh-GeLU gradient saturates to exactly 0 for
    x < -5 where the true value (and the sigmoid form's) is still ~1e-6.
    fp16: one rounding of a value computed in fp32: half an ulp plus reassociation, so 2 ulp.
    bf16: Triton's interpreter converts fp32 -> bf16 by truncation, not round-to-nearest: up to 1 ulp
    (2**-7 relative) from that alone, so 2 ulp.
    """
    tolerances = {
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
        torch.float16: {"rtol": 2 * 2**-10, "atol": 1e-4},
        torch.bfloat16: {"rtol": 2 * 2**-7, "atol": 1e-3},
    }[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), **tolerances, msg=lambda m: f"{what}: {m}")


@pytest.fixture
def assert_close_for_dtype():
    """The comparison used for Triton-vs-reference checks (a fixture, so test modules need no imports)."""
    return _assert_close
