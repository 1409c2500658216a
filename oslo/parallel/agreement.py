"""What the ranks of one model must agree on, checked with one small collective each.

* **The inputs.** Every rank of a tensor- and pipeline-parallel group computes on the same batch: each
  tensor-parallel rank holds part of every layer, each pipeline stage part of the layers. Different
  batches on these ranks (a sampler sharded over the whole world instead of the data-parallel group)
  would train on a silent mix, different shapes would end in a collective mismatch deep inside a
  layer. :func:`check_same_inputs` compares a fingerprint of every input across the model-parallel
  group before the model communicates, and raises on every rank, naming the input and the ranks.
* **Ids inside the embeddings.** A vocabulary-split embedding embeds an id no rank holds (``-1``,
  ``vocab_size``) as a zero vector where transformers' embedding raises ``IndexError``. :func:`embedding_index_error`
  finds such token ids and positions; the outermost call hands its verdict to :func:`check_same_inputs`,
  whose one all-gather carries it, so every rank raises, even the ones given other (in-range) ids.
* **Non-finite gradients.** A gradient scaler skips the optimizer step when a gradient overflowed.
  Each rank sees only its shards and its stage, so one rank may find an overflow that the others do
  not, skip alone, and let copies of replicated weights (and the stages) drift apart.
  :func:`agree_on_nonfinite_gradients` makes the decision common: if any rank of the group has a
  non-finite gradient, every rank's gradients are made non-finite, so every scaler skips.
"""

from __future__ import annotations

import inspect
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from oslo.parallel import failure, traced
from oslo.parallel.collectives import group_size
from oslo.parallel.context import ParallelContext
from oslo.parallel.errors import naming_timeouts
from oslo.parallel.random import generator_state, set_generator_state

__all__ = [
    "InputMismatchError", "agree_on_nonfinite_gradients", "agreed_inputs", "check_same_inputs", "embedding_index_error",
    "forget_verified_inputs",
    "read_label_bounds",
]

_BLOCK = 1 << 16
_weight_blocks: dict[tuple[str, int], torch.Tensor] = {}


class InputMismatchError(ValueError):
    """Ranks of one model-parallel group were given different inputs."""


def _weights(count: int, device: torch.device) -> torch.Tensor:
    """``count`` fixed pseudo-random int64 weights, the same on every rank: blocks of a seeded stream,
    so the first ``n`` never depend on how many were asked for before."""
    blocks = []
    for block in range((count + _BLOCK - 1) // _BLOCK):
        key = (str(device), block)
        if key not in _weight_blocks:
            generator = torch.Generator().manual_seed(0x5EED + block)
            values = torch.randint(-(2**62), 2**62, (_BLOCK,), dtype=torch.int64, generator=generator)
            _weight_blocks[key] = values.to(device)
        blocks.append(_weight_blocks[key])
    return torch.cat(blocks)[:count] if len(blocks) > 1 else blocks[0][:count]


def _content_hash(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 digest of the tensor's values (a weighted sum, wrapping): equal values give equal digests."""
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.float().view(torch.int32)  # the exact bits
    elif flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1).float().view(torch.int32)
    flat = flat.to(torch.int64)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    return (flat * _weights(flat.numel(), flat.device)).sum()


def cached_positions(cache) -> int:
    """How many positions a KV cache holds, the same on every pipeline stage: the count the model recorded in it
    under pipelines (see :func:`oslo.models.runner.forward_with_head`), else its length."""
    recorded = getattr(cache, "_oslo_positions", None)
    return recorded if recorded is not None else cache.get_seq_length()


def _describe(value: Any) -> tuple[str, torch.Tensor | None]:
    """(what the value is, in words that must match across ranks; the tensor to digest, if any)."""
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} of shape {tuple(value.shape)}", value
    if isinstance(value, _Described):
        return str(value), None
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value), None
    if isinstance(value, torch.dtype):
        return str(value), None
    if hasattr(value, "get_seq_length"):  # a KV cache: its length, not its contents (each stage has its own)
        return f"{type(value).__name__} holding {cached_positions(value)} positions", None
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (list, tuple, dict)) for v in value):
        parts = [_describe(v) for v in value]
        tensors = [t for _, t in parts if t is not None]
        digest = torch.stack([_content_hash(t).to(tensors[0].device) for t in tensors]) if tensors else None
        return f"{type(value).__name__}[{', '.join(text for text, _ in parts)}]", digest
    return type(value).__name__, None


def _inputs(args: tuple, kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    named = [(f"positional argument {i}", value) for i, value in enumerate(args)]
    return named + [(key, kwargs[key]) for key in sorted(kwargs)]


def check_same_inputs(
    context: ParallelContext, args: tuple, kwargs: Mapping[str, Any], error: Exception | None = None,
    draws_on: torch.device | None = None, draws_across: str = "tensor",
) -> None:
    """Raise :class:`InputMismatchError` on every rank of the model-parallel group unless all of them
    got the same ``args`` and ``kwargs`` (shapes, dtypes, values and options).

    ``error`` is what this rank found wrong with its inputs (e.g. :func:`embedding_index_error`): if any
    rank has one, every rank raises it instead (this rank's own, or one of the same type naming the rank
    that found it), so that no rank goes on alone into a collective.

    ``draws_on``: the call draws from the default generator of this device (the model follows torch's
    generator, see :mod:`oslo.parallel.random`), whose state must then be the same on the ranks that draw
    alike: those of each tensor-parallel group (``draws_across="tensor"``: dropout on replicated activations) or
    of the whole model-parallel group (``"model"``: sampling in ``generate()``). Where it is not (a script that
    did not seed its processes alike: each starts from its own seed), the group's first rank's state is given
    to the others (one broadcast), as a model with a seed of its own seeds its streams from rank 0's.

    One all-gather of four int64 per rank when they agree (a digest of the structure, one of the
    values, the error flag, one of the generator's state); a second, describing the inputs or the error,
    only when they do not. Call it on every rank of the group before any other communication of the model.
    """
    group = context.model_parallel_group
    if group_size(group) == 1:
        if error is not None:
            raise error
        return
    texts, digests = [], []  # per input: its description; its values' digest (None for non-tensors)
    for name, value in _inputs(args, kwargs):
        text, tensor = _describe(value)
        texts.append(f"{name}: {text}")
        digests.append(None if tensor is None else _content_hash(tensor).to(context.device))
    structure = zlib.crc32("\n".join(texts).encode())
    weighted = [digest * (2 * i + 3) for i, digest in enumerate(digests) if digest is not None]
    values = torch.stack(weighted).sum() if weighted else torch.zeros((), dtype=torch.int64, device=context.device)
    header = torch.tensor([structure, int(error is not None)], dtype=torch.int64, device=context.device)
    generator = _content_hash(generator_state(draws_on)).to(context.device) if draws_on is not None \
        else torch.zeros((), dtype=torch.int64, device=context.device)
    mine = torch.cat([header, values.reshape(1), generator.reshape(1)])
    gathered = [torch.empty_like(mine) for _ in range(group_size(group))]
    with naming_timeouts(context, "comparing the inputs of a model call across the model-parallel group",
                         "call the model on every rank of its tensor- and pipeline-parallel group", group):
        failure.wait(dist.all_gather(gathered, mine, group=group, async_op=True), group,
                     "comparing the inputs of a model call across the model-parallel group")
    failed = [index for index, g in enumerate(gathered) if g[1]]
    if failed:
        _raise_on_every_rank(context, error, failed)
    if all(torch.equal(g[:3], gathered[0][:3]) for g in gathered):
        if draws_on is not None:
            _same_generators(context, [int(g[3]) for g in gathered], draws_on, draws_across)
        return

    # They differ: find out which input, on which ranks (every rank takes this path).
    per_input = [text if digest is None else f"{text}, values digest {int(digest)}"
                 for text, digest in zip(texts, digests, strict=True)]
    described: list[list[str] | None] = [None] * group_size(group)
    with naming_timeouts(context, "describing inputs that differ across the model-parallel group", group=group):
        dist.all_gather_object(described, per_input, group=group)
    values_only = all(g[0] == gathered[0][0] for g in gathered)  # same structure, shapes and dtypes
    raise InputMismatchError(_mismatch_message(context, described, values_only))


def draws_dropout(model: torch.nn.Module) -> bool:
    """Whether a call of ``model`` draws dropout masks: in training mode, with a dropout of nonzero rate."""
    return model.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def _same_generators(context: ParallelContext, digests: list[int], device: torch.device, across: str) -> None:
    """Where the digests of the default generators of ``device`` (one per rank of the model-parallel group, in its
    order: stage by stage, tensor-parallel rank fastest) differ within a tensor-parallel group (``across="tensor"``)
    or within the model-parallel group (``"model"``), give that group's first rank's state to its other ranks.
    Every rank reads the same digests, so the ranks of a group all take part in its broadcast or none does."""
    if across == "model":
        if len(set(digests)) > 1:
            _give_first_rank_s_state(context, context.model_parallel_group, device)
        return
    tp = context.tensor_parallel_size
    first = context.pipeline_parallel_rank * tp
    if len(set(digests[first:first + tp])) > 1:
        _give_first_rank_s_state(context, context.tensor_parallel_group, device)


def _give_first_rank_s_state(context: ParallelContext, group, device: torch.device) -> None:
    state = generator_state(device).to(context.device)
    with naming_timeouts(context, "giving the random generator's state to the ranks that draw alike", group=group):
        dist.broadcast(state, src=dist.get_global_rank(group, 0), group=group)
    set_generator_state(state.cpu(), device)


class _Described(str):
    """An input of a traced call that is not a tensor, as :func:`_describe` put it when the call was traced."""


_RNG_INPUT = "the default random generator (dropout draws from it in a compiled call)"


def agreed_inputs(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """:func:`check_same_inputs` for a call of ``model`` that ``torch.compile`` traces: the compiled program runs
    the same check, with the same errors, when it reaches this point (a :mod:`~oslo.parallel.traced` call), and
    goes on with the returned copies of the tensor inputs. Tensors are compared by value; what is not a tensor,
    as it was when the call was traced (a change traces the program again). A model in training mode with
    dropout also compares the state of the device's default random generator, which dropout in a compiled call
    draws from: it must be the same on every tensor-parallel rank, or their replicated activations would differ
    (seed it alike on every rank: ``torch.manual_seed(0)`` at the start)."""
    tensors, lines = [], []
    for name, value in _inputs(args, kwargs):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            lines.append(f"{name}\0")
        else:
            lines.append(f"{name}\0{_describe(value)[0]}")
    copies = iter(traced.call("check_same_inputs", model, tensors, "\n".join(lines)))
    positional = [next(copies) if isinstance(value, torch.Tensor) else value for value in args]
    named = {key: next(copies) if isinstance(kwargs[key], torch.Tensor) else kwargs[key] for key in sorted(kwargs)}
    return tuple(positional), named


@traced.eager("check_same_inputs")
def _check_traced(model: torch.nn.Module, tensors: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    given = iter(tensors)
    named: dict[str, Any] = {}
    for line in spec.split("\n"):
        name, text = line.split("\0")
        named[name] = next(given) if text == "" else _Described(text)
    watch = failure.call_watch(model.parallel_context)
    if watch is not None:  # refuses the call if an earlier one left the ranks out of step
        watch.begin_call()
    if draws_dropout(model):
        device = tensors[0].device if tensors else model.parallel_context.device
        named[_RNG_INPUT] = generator_state(device)
    check_same_inputs(model.parallel_context, (), named)
    return tensors


def _raise_on_every_rank(context: ParallelContext, error: Exception | None, failed: list[int]) -> None:
    """Raise ``error`` here, or, on a rank without one, the first failing rank's error under its name
    (``failed``: the group indices of the ranks that found one, the same list on every rank)."""
    group = context.model_parallel_group
    if len(failed) < group_size(group):  # some ranks found nothing: they need the message
        found = (type(error), str(error)) if error is not None else None
        errors: list[tuple[type, str] | None] = [None] * group_size(group)
        with naming_timeouts(context, "telling the model-parallel group about an error in the inputs",
                             group=group):
            dist.all_gather_object(errors, found, group=group)
        if error is None:
            kind, message = errors[failed[0]]
            raise kind(
                f"{_rank_name(context, failed[0])}: {message} (this rank, "
                f"{_rank_name(context, dist.get_rank(group))}, found its own inputs fine: the ranks were given "
                "different inputs, and every rank of a model-parallel group must get the same batch)"
            )
    raise error


_parameter_names_of: dict[Callable, tuple[str, ...]] = {}


@torch.compiler.assume_constant_result
def _parameter_names(forward: Callable) -> tuple[str, ...]:
    """The parameter names of a model class's ``forward``, without ``self`` (looked up once per class).

    A compiled call takes the names as a constant of its program: Dynamo runs this while tracing rather than
    tracing ``inspect.signature`` (a sixth of a traced call's bytecode), and does not guard on the cache,
    whose contents other classes' first calls change."""
    names = _parameter_names_of.get(forward)
    if names is None:
        names = _parameter_names_of[forward] = tuple(inspect.signature(forward).parameters)[1:]
    return names


class _Verified(threading.local):
    """``ranges``: the id tensors the current outermost (eager) model call found in range, as (tensor, low, high):
    a call nested in it (a head's body, generate()'s steps calling the head and the head its body) does not read
    the same tensor again. ``labels``: the call's ``labels`` and their smallest and largest value (``-100`` counted
    as 0), read with the ids, for :func:`oslo.parallel.loss.check_labels`."""

    def __init__(self) -> None:
        self.ranges: list[tuple[torch.Tensor, int, int]] = []
        self.labels: tuple[torch.Tensor, int, int] | None = None


_verified = _Verified()


def forget_verified_inputs() -> None:
    """The end of an outermost model call: its inputs are no longer known to be in range (nor kept alive)."""
    _verified.ranges = []
    _verified.labels = None


def read_label_bounds(labels: torch.Tensor) -> tuple[int, int] | None:
    """The smallest and largest value of ``labels`` (``-100`` counted as 0) if the current model call's input check
    read them with its ids (one wait for a GPU for both), else ``None``."""
    known = _verified.labels
    return (known[1], known[2]) if known is not None and known[0] is labels else None


def _checkable(values: torch.Tensor) -> bool:
    return not (values.is_floating_point() or values.is_complex() or values.dtype == torch.bool or values.numel() == 0)


def _read(scalars: list[torch.Tensor]) -> list[int]:
    """The values of integer 0-dim tensors, read at once where they share a device (one wait for a GPU)."""
    if not scalars:
        return []
    if len({scalar.device for scalar in scalars}) == 1:
        return torch.stack([scalar.to(torch.int64) for scalar in scalars]).tolist()
    return [int(scalar) for scalar in scalars]


def _range_error(checks: list[tuple[torch.Tensor, int, int, str]], nested: bool,
                 also: list[torch.Tensor] = ()) -> tuple[IndexError | None, list[int]]:
    """The ``IndexError`` for the first of ``checks`` (an integer tensor, ``low``, ``high``, a message) that holds a
    value outside ``[low, high)``, or ``None``: the message with ``{found}`` replaced by ``"<value> at index
    <index>"``; and the values of ``also`` (integer 0-dim tensors). The minima and maxima of all the tensors and
    ``also`` are read together (one wait for a GPU, not one per tensor); a ``nested`` call skips a tensor that its
    outermost call found in range.

    Under ``torch.compile``, which cannot branch on the values, the compiled program asserts the ranges instead
    (a ``RuntimeError`` when it runs, the message saying ``"an id at some index"``) and this returns ``None``
    (``also`` is then empty: it is not read)."""
    if torch.compiler.is_compiling():
        for values, low, high, message in checks:
            torch._assert_async(((values >= low) & (values < high)).all(), message.format(found="an id at some index"))
        return None, []
    verified = _verified.ranges
    if not nested:
        verified = _verified.ranges = []
    else:
        checks = [check for check in checks if not any(
            known is check[0] and check[1] <= low and high <= check[2] for known, low, high in verified)]
    values_read = _read([bound for values, *_ in checks for bound in torch.aminmax(values)] + list(also))
    bounds, extra = values_read[:2 * len(checks)], values_read[2 * len(checks):]
    for (values, low, high, message), smallest, largest in zip(checks, bounds[::2], bounds[1::2], strict=True):
        if smallest < low or largest >= high:
            index = tuple(((values < low) | (values >= high)).nonzero()[0].tolist())
            return IndexError(message.format(found=f"{int(values[index])} at index {index}")), extra
        verified.append((values, low, high))
    return None, extra


_DEFAULT_ID_INPUTS = {"input_ids": "vocab_size", "inputs": "vocab_size", "token_type_ids": "vocab_size"}


def embedding_index_error(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any],
                          nested: bool = False) -> IndexError | None:
    """The ``IndexError`` that transformers' embeddings raise for this call of ``model``
    (``model(*args, **kwargs)`` or ``model.generate(*args, **kwargs)``), with the value, the range and
    the fix; ``None`` when every id is in range. Cheap: a min and a max per id tensor.

    Each id input must lie in the table that embeds it, as the model's ``_id_inputs`` declares
    (``{input name: config attribute of the table's size}``; by default ``input_ids`` / ``inputs`` of
    generate and ``token_type_ids`` in ``[0, vocab_size)``, as GPT2 embeds token types with the token
    embedding; BERT's token types use ``type_vocab_size``), ``position_ids`` in ``[0, max_position_embeddings)``.
    Without ``position_ids`` the input's length after the cached positions must fit as well: counted
    as the forward pass counts it (``nested``: a call inside a model call, e.g. a generate() step), or,
    for an outermost call, which may be ``generate()`` (it numbers a padded prompt's positions by its
    attention mask), from the attention mask when one is given: this never refuses a valid call.

    Under ``torch.compile`` the checks of values (ids, positions, the attention mask's counts) become assertions
    of the compiled program, which raise ``RuntimeError`` with the message (without the value) when it runs; an
    input longer than the positions is seen while tracing, and compiling fails naming it.
    """
    config = model.config
    names = _parameter_names(type(model).forward)
    named = {**dict(zip(names, args, strict=False)), **kwargs}
    positions = getattr(config, "max_position_embeddings", None)
    id_inputs = getattr(model, "_id_inputs", None) or _DEFAULT_ID_INPUTS
    checks = []  # (ids, low, high, message), read together
    for name, attribute in id_inputs.items():
        values = named.get(name)
        if not isinstance(values, torch.Tensor) or not _checkable(values):
            continue  # not given: no config read, no message (each is traced under torch.compile)
        size = getattr(config, attribute)
        if attribute == "vocab_size":
            what = "token types" if name == "token_type_ids" else "tokens"
            message = (
                f"{name} hold {{found}}, outside the vocabulary [0, {size}) of this model "
                f"(vocab_size={size}; {type(model).__name__} embeds its {what} with the token embedding): "
                f"pass ids in [0, {size}). Check that the tokenizer matches the model (or build the model "
                "with resize_token_embeddings=len(tokenizer))."
            )
        else:
            message = (
                f"{name} hold {{found}}, outside [0, {size}) ({attribute}={size}: "
                f"{type(model).__name__} embeds {size} of them): pass {name} in [0, {size})."
            )
        checks.append((values, 0, size, message))
    position_ids = named.get("position_ids") if positions is not None else None
    if isinstance(position_ids, torch.Tensor) and _checkable(position_ids):
        checks.append((position_ids, 0, positions, (
            f"position_ids hold {{found}}, outside [0, {positions}) "
            f"(max_position_embeddings={positions}): the model embeds {positions} positions. Pass "
            f"position_ids in [0, {positions}): at most {positions} tokens, prompt and new tokens of "
            "generate() included (max_new_tokens)."
        )))
    # Read with the ids, so that a training call waits for the device once: the labels' bounds (for check_labels,
    # which the head calls) and the attention mask's longest row (below).
    eager_outermost = not nested and not torch.compiler.is_compiling()
    labels = named.get("labels") if eager_outermost else None
    if not (isinstance(labels, torch.Tensor) and _checkable(labels)):
        labels = None
    also = [] if labels is None else list(torch.aminmax(labels.masked_fill(labels == -100, 0)))
    ids = next((named.get(name) for name in ("input_ids", "inputs", "inputs_embeds")
                if isinstance(named.get(name), torch.Tensor)), None)
    mask = named.get("attention_mask")
    counts_mask = (positions is not None and not isinstance(position_ids, torch.Tensor) and ids is not None
                   and not nested and isinstance(mask, torch.Tensor) and mask.ndim == 2 and bool(mask.numel()))
    if counts_mask and eager_outermost:
        also.append(mask.sum(-1).max())
    error, extra = _range_error(checks, nested, also)
    if labels is not None:
        _verified.labels = (labels, extra[0], extra[1])
    if error is not None or positions is None or isinstance(position_ids, torch.Tensor):
        return error
    if ids is None:
        return None
    length = ids.shape[-2] if ids.is_floating_point() else ids.shape[-1]  # embeddings: (..., T, C)
    cache = named.get("cache", named.get("past_key_values"))  # its name before transformers 5.24
    past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
    message = (
        f"the input reaches {{found}}, outside [0, {positions}) (max_position_embeddings={positions}): the "
        f"model embeds {positions} positions. Truncate the input to at most {positions} tokens in all, e.g. "
        f"tokenizer(..., truncation=True, max_length={positions})."
    )
    if counts_mask:
        if torch.compiler.is_compiling():  # no branching on the mask's values: the compiled program asserts
            found = f"a position (a row of its attention mask holds more than {positions} tokens)"
            torch._assert_async(mask.sum(-1).max() <= positions, message.format(found=found))
            return None
        needed = extra[-1]  # the mask's longest row, read with the ids: it covers the cached positions too
        counted = f"a row of its attention mask holds {needed} tokens"
    else:
        needed = past + length
        counted = None  # written only for an error: formatting a compiled call's length would fix it to one value
    if needed <= positions:
        return None
    if counted is None:
        counted = f"{length} tokens after {past} cached"
    return IndexError(message.format(found=f"position {needed - 1} ({counted})"))


def _rank_name(context: ParallelContext, index: int) -> str:
    stage, tensor_rank = divmod(index, context.tensor_parallel_size)
    where = []
    if context.tensor_parallel_size > 1:
        where.append(f"tensor-parallel rank {tensor_rank}")
    if context.pipeline_parallel_size > 1:
        where.append(f"pipeline stage {stage}")
    return f"global rank {context.get_model_parallel_src_rank() + index} ({', '.join(where)})"


def _mismatch_message(context: ParallelContext, described: list[list[str]], values_only: bool = False) -> str:
    """The error's text; ``values_only``: the inputs have the same structure, shapes and dtypes on every rank."""
    reference = described[0]
    lines = []
    for index, inputs in enumerate(described[1:], start=1):
        if inputs == reference:
            continue
        differing = [(a, b) for a, b in zip(reference, inputs, strict=False) if a != b]
        if len(inputs) != len(reference) and not differing:
            differing = [(" / ".join(reference), " / ".join(inputs))]
        ours, theirs = differing[0]
        lines.append(f"{_rank_name(context, index)} got [{theirs}] where {_rank_name(context, 0)} got [{ours}]")
    seeding = (
        " The inputs have the same shapes and dtypes and differ only in their values: a batch drawn from an "
        "unseeded random generator (torch.randint, torch.randn, a shuffling DataLoader) differs on every "
        "process, as each process starts from its own random seed. Seed it before drawing the batch, with the "
        "same seed on every rank: torch.manual_seed(1234) (or generator=torch.Generator().manual_seed(1234)); "
        "to give each data-parallel replica its own batch, add model.mpu.get_data_parallel_rank() to the seed."
    ) if values_only else ""
    return (
        "the ranks of one tensor/pipeline-parallel group were given different inputs: "
        + "; ".join(lines)
        + ". Every rank of a model-parallel group must get the same batch (each holds part of the model): "
        "shard the data over the data-parallel group only, e.g. DistributedSampler(dataset, "
        "num_replicas=model.mpu.get_data_parallel_world_size(), rank=model.mpu.get_data_parallel_rank()), "
        "and pass the same options on every rank."
        + seeding
    )


def agree_on_nonfinite_gradients(
    gradients: Iterable[torch.Tensor], context: ParallelContext, scan: bool = True
) -> bool:
    """Make one decision for the whole model-parallel group about non-finite gradients.

    Each rank looks at its own ``gradients``, then one all-reduce of a flag tells every rank whether any
    rank found an ``inf`` or ``nan``. If one did, every rank fills its gradients with ``nan``, so that a
    gradient scaler skips the step on every rank (and lowers its scale alike), as it would on one
    process. With ``scan=False`` nothing happens (no look, no communication): the ranks must take the
    same decision, from what they share (the loss scale seeding the backward pass, the compute dtype).

    Returns:
        Whether some rank of the group had a non-finite gradient.
    """
    if not scan:
        return False
    gradients = [g for g in gradients if g is not None]
    found = torch.zeros(1, device=context.device)
    if gradients:
        total = torch.nn.utils.get_total_norm(gradients, norm_type=float("inf"))
        found.fill_(float(not bool(torch.isfinite(total))))
    if group_size(context.model_parallel_group) > 1:
        with naming_timeouts(context, "agreeing on non-finite gradients at the end of a backward pass",
                             group=context.model_parallel_group):
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=context.model_parallel_group)
    if not bool(found):
        return False
    for gradient in gradients:
        gradient.detach().fill_(float("nan"))
    return True
