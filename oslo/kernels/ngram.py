"""N-gram repeat blocking: ban every token that would complete an n-gram already in the history.

Bans exactly what ``transformers.NoRepeatNGramLogitsProcessor(ngram_size)`` bans: with history
``input_ids[row]`` (prompt included) of length ``cur_len``, the last ``n - 1`` tokens form the prefix;
every earlier window ``input_ids[row, s : s + n]`` whose first ``n - 1`` tokens equal the prefix bans its
last token. With ``cur_len < n`` nothing is banned; with ``n == 1`` every token seen so far is banned.
Token ids outside ``[0, vocab)`` (an embedding larger than the LM head) ban nothing, as in transformers.

Four parts:

1. Triton kernel ``_ngram_block_kernel``: one program per (row, block of windows) compares each
   window with the prefix and writes ``-inf`` at the banned token, in place. No host sync.
2. A NumPy path for CPU tensors (zero-copy views of the same memory). Same algorithm as the torch
   path, but NumPy's SIMD comparisons and ``flatnonzero`` make it about 1.8x faster than torch's on
   CPU at 64 x 1024 ids (``torch.nonzero`` alone costs ~10x ``np.flatnonzero`` on a sparse mask).
3. The custom op ``oslo::no_repeat_ngram_block_`` (in place on the scores; ``torch.compile`` calls it as
   it is): picks Triton (CUDA), NumPy (CPU) or the vectorized torch path (any other device). All are
   batched over rows and windows: no Python loop over tokens or rows, no n-gram dictionaries.
   ``no_repeat_ngram_block`` is its entry point (copying the scores first unless ``inplace``).
4. ``FusedNoRepeatNGramLogitsProcessor``: a ``transformers.LogitsProcessor`` for ``generate()``.

Cost: the ban itself touches only ``batch * windows`` ids and the banned score entries. An
out-of-place call (the default) additionally copies ``scores`` once; pass ``inplace=True`` where the
caller owns ``scores`` (see :class:`FusedNoRepeatNGramLogitsProcessor`).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.generation.logits_process import LogitsProcessor

from oslo.kernels._triton import HAS_TRITON, tl, triton, triton_kernel, use_triton

__all__ = ["FusedNoRepeatNGramLogitsProcessor", "no_repeat_ngram_block", "no_repeat_ngram_block_reference"]


def _check_inputs(input_ids: torch.Tensor, scores: torch.Tensor, ngram_size: int) -> None:
    if isinstance(ngram_size, bool) or not isinstance(ngram_size, int) or ngram_size < 1:
        raise ValueError(
            f"ngram_size={ngram_size!r} is not a positive integer: pass no_repeat_ngram_size >= 1, or do not "
            "add n-gram blocking at all to disable it."
        )
    if input_ids.dim() != 2 or scores.dim() != 2 or input_ids.shape[0] != scores.shape[0]:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and scores {tuple(scores.shape)} must be [rows, cur_len] "
            "and [rows, vocab] with the same number of rows (batch * num_beams)."
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids dtype {input_ids.dtype} is not an integer dtype; pass token ids (long).")


def _prefix_matches(input_ids: torch.Tensor, ngram_size: int) -> torch.Tensor:
    """``[rows, windows]``: window ``s`` (tokens ``s .. s + n - 1``) starts with the current prefix."""
    cur_len = input_ids.shape[1]
    num_windows = cur_len - ngram_size + 1
    prefix_start = cur_len - ngram_size + 1
    if ngram_size == 1:  # empty prefix: every window matches
        return torch.ones(input_ids.shape[0], num_windows, dtype=torch.bool, device=input_ids.device)
    # One [rows, windows] comparison per prefix position (n - 1 of them), each on a plain 2-D slice:
    # 3-4x faster than comparing an unfold() view on CPU, and no loop over tokens or rows.
    matches = input_ids[:, :num_windows] == input_ids[:, prefix_start : prefix_start + 1]
    for position in range(1, ngram_size - 1):
        window_tokens = input_ids[:, position : position + num_windows]
        matches &= window_tokens == input_ids[:, prefix_start + position : prefix_start + position + 1]
    return matches


def _ban_torch(input_ids: torch.Tensor, scores: torch.Tensor, ngram_size: int) -> torch.Tensor:
    """Vectorized torch path; writes -inf into ``scores`` in place and returns it."""
    cur_len = input_ids.shape[1]
    if cur_len < ngram_size or input_ids.shape[0] == 0:
        return scores
    matches = _prefix_matches(input_ids, ngram_size)
    rows, starts = matches.nonzero(as_tuple=True)
    tokens = input_ids[rows, starts + (ngram_size - 1)]
    in_vocab = (tokens >= 0) & (tokens < scores.shape[1])
    scores[rows[in_vocab], tokens[in_vocab]] = float("-inf")
    return scores


def _ban_numpy(input_ids: torch.Tensor, scores: torch.Tensor, ngram_size: int) -> torch.Tensor:
    """CPU path: the torch path's algorithm on NumPy views of the same memory; writes into ``scores``."""
    ids = input_ids.numpy()
    rows, cur_len = ids.shape
    num_windows = cur_len - ngram_size + 1
    if num_windows <= 0 or rows == 0:
        return scores
    if ngram_size == 1:  # empty prefix: every window matches
        flat = np.arange(rows * num_windows)
    else:
        prefix_start = num_windows
        matches = ids[:, :num_windows] == ids[:, prefix_start : prefix_start + 1]
        for position in range(1, ngram_size - 1):
            window_tokens = ids[:, position : position + num_windows]
            matches &= window_tokens == ids[:, prefix_start + position : prefix_start + position + 1]
        flat = np.flatnonzero(matches)
    banned_rows, starts = np.divmod(flat, num_windows)
    tokens = ids[banned_rows, starts + (ngram_size - 1)].astype(np.int64)
    in_vocab = (tokens >= 0) & (tokens < scores.shape[1])
    scores[torch.from_numpy(banned_rows[in_vocab]), torch.from_numpy(tokens[in_vocab])] = float("-inf")
    return scores


def no_repeat_ngram_block_reference(
    input_ids: torch.Tensor, scores: torch.Tensor, ngram_size: int, inplace: bool = False
) -> torch.Tensor:
    """Vectorized torch path of :func:`no_repeat_ngram_block` (any device; the oracle of the Triton tests).

    Args:
        input_ids: ``[rows, cur_len]`` token history, prompt included.
        scores: ``[rows, vocab]`` next-token scores.
        ngram_size: n, at least 1.
        inplace: write into ``scores`` instead of a copy.

    Returns:
        Scores with banned tokens set to ``-inf``.
    """
    _check_inputs(input_ids, scores, ngram_size)
    return _ban_torch(input_ids, scores if inplace else scores.clone(), ngram_size)


if HAS_TRITON:

    @triton_kernel
    def _ngram_block_kernel(
        input_ids_ptr,
        scores_ptr,
        cur_len,
        vocab_size,
        ids_row_stride,
        ids_col_stride,
        scores_row_stride,
        scores_col_stride,
        NGRAM_SIZE: tl.constexpr,
        BLOCK_WINDOWS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        starts = tl.program_id(1) * BLOCK_WINDOWS + tl.arange(0, BLOCK_WINDOWS)
        num_windows = cur_len - NGRAM_SIZE + 1
        matches = starts < num_windows
        ids_row = input_ids_ptr + row * ids_row_stride
        prefix_start = cur_len - NGRAM_SIZE + 1
        for position in tl.static_range(NGRAM_SIZE - 1):
            prefix_token = tl.load(ids_row + (prefix_start + position) * ids_col_stride)
            window_token = tl.load(ids_row + (starts + position) * ids_col_stride, mask=matches, other=-1)
            matches = matches & (window_token == prefix_token)
        banned = tl.load(ids_row + (starts + NGRAM_SIZE - 1) * ids_col_stride, mask=matches, other=-1)
        matches = matches & (banned >= 0) & (banned < vocab_size)
        minus_inf = tl.full((BLOCK_WINDOWS,), float("-inf"), scores_ptr.dtype.element_ty)
        # Several windows may ban the same token: they all write the same value, so the race is benign.
        tl.store(scores_ptr + row * scores_row_stride + banned * scores_col_stride, minus_inf, mask=matches)


_BLOCK_WINDOWS = 256


def _ban_triton(input_ids: torch.Tensor, scores: torch.Tensor, ngram_size: int) -> torch.Tensor:
    rows, cur_len = input_ids.shape
    num_windows = cur_len - ngram_size + 1
    if num_windows <= 0 or rows == 0:
        return scores
    grid = (rows, triton.cdiv(num_windows, _BLOCK_WINDOWS))
    _ngram_block_kernel[grid](
        input_ids,
        scores,
        cur_len,
        scores.shape[1],
        input_ids.stride(0),
        input_ids.stride(1),
        scores.stride(0),
        scores.stride(1),
        NGRAM_SIZE=ngram_size,
        BLOCK_WINDOWS=_BLOCK_WINDOWS,
        num_warps=4,
    )
    return scores


@torch.library.custom_op("oslo::no_repeat_ngram_block_", mutates_args=("scores",))
def _no_repeat_ngram_block_op(input_ids: torch.Tensor, scores: torch.Tensor, ngram_size: int) -> None:
    """Write ``-inf`` into ``scores`` at every token that would repeat an n-gram of ``input_ids``."""
    if use_triton(input_ids, scores):
        _ban_triton(input_ids, scores, ngram_size)
    elif input_ids.device.type == "cpu" and scores.device.type == "cpu":
        _ban_numpy(input_ids, scores, ngram_size)
    else:
        _ban_torch(input_ids, scores, ngram_size)


@_no_repeat_ngram_block_op.register_fake
def _(input_ids, scores, ngram_size):
    return None


def no_repeat_ngram_block(
    input_ids: torch.Tensor, scores: torch.Tensor, ngram_size: int, inplace: bool = False
) -> torch.Tensor:
    """Set to ``-inf`` the scores of tokens that would repeat an n-gram of the history.

    Bans exactly the tokens ``transformers.NoRepeatNGramLogitsProcessor(ngram_size)`` bans (see the
    module docstring). Runs the Triton kernel on CUDA, a NumPy path on CPU, and a vectorized torch path
    on other devices.

    Args:
        input_ids: ``[batch * num_beams, cur_len]`` token history, prompt included (for
            encoder-decoders: the decoder ids).
        scores: ``[batch * num_beams, vocab]`` next-token scores (logits or log-probabilities).
        ngram_size: n, the n-gram length that may occur only once; any n >= 1.
        inplace: write into ``scores`` and return it, instead of returning a modified copy. Saves a
            full copy of ``scores`` per step; only safe when nobody else holds ``scores``.

    Returns:
        The scores with banned tokens set to ``-inf``.
    """
    _check_inputs(input_ids, scores, ngram_size)
    out = scores if inplace else scores.clone()
    _no_repeat_ngram_block_op(input_ids, out, ngram_size)
    return out


class FusedNoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Drop-in for ``transformers.NoRepeatNGramLogitsProcessor``, using :func:`no_repeat_ngram_block`.

    Pass it to ``generate(logits_processor=LogitsProcessorList([...]))`` *instead of*
    ``no_repeat_ngram_size`` (which would add transformers' own processor as well).

    Args:
        ngram_size: n, the n-gram length that may occur only once.
        inplace: modify the scores tensor ``generate()`` passes in rather than returning a copy. In
            transformers 5, ``generate()`` hands processors a fresh tensor (a copy of the last logits,
            or the beam log-probs), so in-place is safe *except* with greedy/sampling and
            ``output_logits=True`` when this is the first processor: the tensor passed in is then also
            stored as the raw logits, which would show the bans.
    """

    def __init__(self, ngram_size: int, inplace: bool = False) -> None:
        if isinstance(ngram_size, bool) or not isinstance(ngram_size, int) or ngram_size < 1:
            raise ValueError(
                f"ngram_size={ngram_size!r} is not a positive integer: pass no_repeat_ngram_size >= 1, or do "
                "not add the processor to disable n-gram blocking."
            )
        self.ngram_size = ngram_size
        self.inplace = inplace

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Return ``scores`` with every token that would repeat an n-gram set to ``-inf``."""
        return no_repeat_ngram_block(input_ids, scores, self.ngram_size, inplace=self.inplace)
