"""``python -m oslo check PATH``: an oslo model at a parallel layout against transformers on the same weights.

The command launches ``tensor_parallel_size x pipeline_parallel_size`` processes on this machine (gloo on CPU;
NCCL with one GPU per process when that many CUDA devices are visible), loads the checkpoint at ``PATH`` with
the oslo class that ``config.json``'s ``architectures[0]`` names, and loads the same weights into the
transformers class of that name on rank 0 (float32 both; dropout off in both: the config's dropout
probabilities set to 0 and every ``nn.Dropout`` at ``p=0``).
Then, for a few batches of random token ids (padding and ``-100`` labels where the architecture has them):

* a forward pass without gradients (``model.eval()``): every tensor field of the output (``logits``,
  ``start_logits``, T5's ``encoder_last_hidden_state``...) and the loss, as transformers computes them;
* a training step (``model.train()``; under pipelines the 1F1B loop over micro-batches, each micro-batch's loss
  against transformers' on those rows): the loss and the gradient of every parameter, the shards merged into
  the full tensors (:meth:`~oslo.parallel.plan.ShardSpec.merge`), against transformers' gradients of the
  whole batch's loss.

Before the batches, the loaded weights themselves are compared. A table gives, per batch, the largest
``|oslo - transformers|`` of the outputs, of the loss and of the gradients (with the parameter where it
occurs); the last line is ``PASS`` or ``FAIL`` with the tolerances. Exit code 0: pass, 1: fail (a value
beyond tolerance, or a rank that raised), 2: a usage error found before any process starts (a missing
path or ``config.json``, a class that oslo or this check does not support, sizes the model cannot be
split into, ``--device cuda`` without enough GPUs).

Tolerances follow ``torch.testing.assert_close`` per tensor: ``|actual - expected| <= atol + rtol *
|expected|`` elementwise (defaults: its float32 ones, ``rtol=1.3e-6``, ``atol=1e-5``). Gradients are sums
over the whole batch whose terms tensor parallelism adds in another order, so their rounding grows with the
size of the terms: for a gradient tensor ``atol`` is multiplied by ``max(1, max |expected|)`` of that
tensor (unchanged for gradients below 1 in magnitude). Weights must load bit-identically.

A split checkpoint (of any layout) is loaded as it is by the oslo model, and merged into a temporary
directory for the transformers reference by :func:`oslo.reshard_checkpoint` (in this process, before the
ranks start).

Test hook: the environment variable ``OSLO_CHECK_PERTURB=<parameter name>[=<delta>]`` (default delta
``1e-3``) adds ``delta`` to that parameter of the oslo model only, on every rank that holds a part of it,
after the weights were compared: a model whose computation differs from transformers', which the check
must report as ``FAIL``. It exists for oslo's own tests (``tests/test_check_cli.py``). (A constant added to a
weight that reads a LayerNorm's output, zero-mean over the features, hardly moves the outputs: shift a bias.)
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch

from oslo import launch

HELP = "Compare an oslo model at a parallel layout with transformers on the same weights (logits, loss, gradients)."

PERTURB_ENV = "OSLO_CHECK_PERTURB"  # test hook, see the module docstring
_DEFAULT_PERTURBATION = 1e-3
_PROG = "python -m oslo check"
_SKIPPED_OUTPUTS = {"loss", "cache", "past_key_values"}
_MAX_PROBLEMS_SHOWN = 12


class UsageError(Exception):
    """A problem with the command line or the checkpoint, found before any process starts (exit code 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH",
                        help="checkpoint directory: config.json and the weights (a transformers checkpoint, or an "
                             "oslo split or merged one)")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="T",
                        help="tensor-parallel ranks (default 1)")
    parser.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1, metavar="P",
                        help="pipeline stages (default 1); T x P processes are launched")
    parser.add_argument("--batches", type=int, default=3, help="random batches to compare (default 3)")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per batch (default 4)")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per row (default 16)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="rows per pipeline micro-batch (default: half the batch, so that the schedule runs "
                             "at least two)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--rtol", type=float, default=1.3e-6,
                        help="relative tolerance (default 1.3e-6, torch.testing.assert_close's for float32)")
    parser.add_argument("--atol", type=float, default=1e-5,
                        help="absolute tolerance (default 1e-5; for gradients scaled by max(1, max|expected|) "
                             "per tensor)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto (default): one CUDA device per process if that many are visible, else CPU")
    parser.add_argument("--attn-implementation", choices=("eager", "sdpa"), default=None,
                        help="attention implementation of both models (default: each class's default)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a rank waits for the others in a collective before failing (default 600)")


# ---------------------------------------------------------------------------------------------
# What to run: everything checked before any process starts
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    path: str  # the checkpoint the check loads
    class_name: str
    kind: str  # how inputs and labels are made, see _make_batch
    tp: int
    pp: int
    micro_batch_size: int
    batches: int
    batch_size: int
    seq_len: int
    seed: int
    rtol: float
    atol: float
    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or "cuda"
    timeout: float
    attn_implementation: str | None
    overrides: dict = field(default_factory=dict)  # config attributes changed in both models
    reference_path: str | None = None  # a split checkpoint's merged copy, for transformers (else ``path``)
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


# class-name suffix -> kind of inputs (the first match wins; LMHeadModel also matches GPT2's and BERT's)
_KINDS = (
    ("ForConditionalGeneration", "seq2seq"),
    ("ForMaskedLM", "masked"),
    ("ForPreTraining", "pretraining"),
    ("ForNextSentencePrediction", "next_sentence"),
    ("ForSequenceClassification", "sequence"),
    ("ForTokenClassification", "token"),
    ("ForQuestionAnswering", "question_answering"),
    ("ForMultipleChoice", "multiple_choice"),
    ("ForCausalLM", "causal"),
    ("LMHeadModel", "causal"),
)

_KIND_TEXT = {
    "causal": "causal LM: left padding on odd rows, labels = input ids, -100 on padding",
    "masked": "masked LM: right padding on odd rows, labels on a quarter of the real tokens, -100 elsewhere",
    "pretraining": "masked LM labels as for ForMaskedLM, and random next-sentence labels",
    "next_sentence": "right padding on odd rows, random next-sentence labels",
    "seq2seq": "encoder inputs right-padded on odd rows; labels of half the length, -100 after 2/3 in row 1 "
               "(the decoder reads them shifted right)",
    "sequence": "right padding on odd rows, one random label per row",
    "token": "right padding on odd rows, a random label per token, -100 on padding",
    "question_answering": "right padding on odd rows, random answer spans inside the real tokens",
    "multiple_choice": "2 choices per row, right padding on odd rows, a random choice label",
    "generic": "labels = input ids as for a causal LM (the class is no known kind but its forward takes "
               "input_ids and labels); left padding on odd rows, -100 on padding",
}


def _kind(class_name: str, transformers_cls: type) -> str:
    for suffix, kind in _KINDS:
        if class_name.endswith(suffix):
            return kind
    parameters = inspect.signature(transformers_cls.forward).parameters
    if "input_ids" in parameters and "labels" in parameters:
        return "generic"
    raise UsageError(
        f"{class_name} has no loss to check (its forward takes no labels: a model body without a head); check "
        "a class with a head on the same weights instead (e.g. the ...LMHeadModel / ...ForCausalLM / "
        "...ForMaskedLM / ...ForConditionalGeneration class), setting config.json's architectures to it."
    )


def _max_positions(config) -> int | None:
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _dropout_overrides(config) -> dict:
    """Every dropout probability of the config that is not 0, set to 0 (in both models)."""
    out = {}
    for name, value in config.to_dict().items():
        lowered = name.lower()
        if ("dropout" in lowered or "pdrop" in lowered) and isinstance(value, float) and value != 0.0:
            out[name] = 0.0
    return out


def _dropout_off(model: torch.nn.Module) -> None:
    """Every ``nn.Dropout`` of the model at ``p=0`` (a classifier's dropout that transformers takes as 0.1 when
    the config names none, GPT2's for token classification, is in no config attribute to override)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _choose_backend(device: str, world_size: int) -> tuple[str, str]:
    """``(backend, device type)`` for ``world_size`` processes, or a usage error if they cannot launch."""
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    if device == "cuda":
        if count < world_size:
            raise UsageError(
                f"--device cuda needs one CUDA device per process, {world_size} here, but {count} "
                f"{'is' if count == 1 else 'are'} visible; use --device cpu (gloo) or smaller sizes."
            )
        return "nccl", "cuda"
    if device == "auto" and count >= world_size:
        return "nccl", "cuda"
    return "gloo", "cpu"


def _prepare(args: argparse.Namespace) -> _Plan:
    import transformers
    from transformers import AutoConfig, PretrainedConfig

    import oslo.checkpoint as ckpt
    from oslo.models import oslo_class
    from oslo.models.build import validate_pipeline_size

    for name in ("tensor_parallel_size", "pipeline_parallel_size", "batches", "batch_size", "seq_len"):
        value = getattr(args, name)
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.seq_len < 2:
        raise UsageError(f"--seq-len must be at least 2 (padding and labels need two tokens), got {args.seq_len}")
    for name in ("rtol", "atol"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{name} must be a finite number >= 0, got {value}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")

    path = os.path.abspath(args.path)
    if not os.path.isdir(path):
        raise UsageError(f"{args.path!r} is not a directory: pass a checkpoint directory (config.json and weights)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{args.path!r} has no config.json: the check needs it to know the model class and sizes")
    try:
        names = PretrainedConfig.get_config_dict(path)[0].get("architectures") or []
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"cannot read {os.path.join(args.path, 'config.json')}: {exc}") from exc
    if not names:
        raise UsageError(f"{os.path.join(args.path, 'config.json')} names no architectures: set \"architectures\": "
                         "[\"<class name>\"] (e.g. GPT2LMHeadModel) so that the check knows the class")
    config.architectures = list(names)
    try:
        cls, _ = oslo_class(config)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    transformers_cls = getattr(transformers, cls.__name__, None)
    if transformers_cls is None:
        raise UsageError(f"transformers has no class {cls.__name__!r} to compare with")
    kind = _kind(cls.__name__, transformers_cls)

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    micro = args.micro_batch_size
    if micro is None:
        micro = max(d for d in range(1, max(1, args.batch_size // 2) + 1) if args.batch_size % d == 0)
    if micro < 1:
        raise UsageError(f"--micro-batch-size must be a positive integer, got {micro}")
    if pp > 1 and args.batch_size % micro != 0:
        raise UsageError(f"--micro-batch-size {micro} does not divide --batch-size {args.batch_size}")
    try:
        cls._validate_parallel_config(config, tp)
        validate_pipeline_size(cls, pp, micro)
        if pp > 1:
            cls.pipeline_partition(config, pp)  # refuses more stages than layers
    except (ValueError, NotImplementedError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    limit = _max_positions(config)
    if limit is not None and args.seq_len > limit:
        raise UsageError(f"--seq-len {args.seq_len} is longer than the model's {limit} positions")
    try:
        checkpoint = ckpt.inspect_checkpoint(path)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(str(exc)) from exc
    backend, device = _choose_backend(args.device, tp * pp)

    overrides = _dropout_overrides(config)
    notes = ["dropout off in both models: every nn.Dropout at p=0"
             + (f", and {', '.join(f'{k}=0' for k in overrides)} in the config" if overrides else "")]
    if kind == "sequence" and getattr(config, "pad_token_id", None) is None:
        overrides["pad_token_id"] = 0  # transformers pools each row at its last non-padding token
        notes.append("config has no pad_token_id: set to 0 in both models (classification pools per row)")
    if checkpoint.kind == "split":
        layout = checkpoint.layout
        notes.append("split checkpoint" + ("" if layout is None else f" saved at tensor_parallel_size={layout[0]} x "
                                                                     f"pipeline_parallel_size={layout[1]}"))
    return _Plan(
        path=path, class_name=cls.__name__, kind=kind, tp=tp, pp=pp, micro_batch_size=micro,
        batches=args.batches, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed, rtol=args.rtol,
        atol=args.atol, backend=backend, device=device, timeout=args.timeout,
        attn_implementation=args.attn_implementation, overrides=overrides, notes=tuple(notes),
    )


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
def _special_ids(config) -> set[int]:
    ids = set()
    for name in ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id", "sep_token_id",
                 "cls_token_id", "mask_token_id", "unk_token_id"):
        value = getattr(config, name, None)
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, int):
                ids.add(item)
    return ids


def _tokens(generator: torch.Generator, config, shape: tuple[int, ...]) -> torch.Tensor:
    """Random ids of the vocabulary other than the special tokens (an EOS inside a row would change how
    T5's classifier pools)."""
    vocab = config.vocab_size
    special = _special_ids(config)
    low = 3 if vocab > 16 else 0
    ids = torch.randint(low, vocab, shape, generator=generator)
    safe = next((i for i in range(low, vocab) if i not in special), low)
    for value in special:
        ids[ids == value] = safe
    return ids


def _pad_lengths(generator: torch.Generator, rows: int, length: int) -> list[int]:
    """Padding per row: none on even rows, 1 to a quarter of the row on odd ones."""
    most = max(1, length // 4)
    return [0 if r % 2 == 0 else int(torch.randint(1, most + 1, (1,), generator=generator)) for r in range(rows)]


def _encoder_tokens(generator, config, rows: int, length: int) -> dict:
    """Right-padded rows; an encoder-decoder's rows end their real tokens with EOS (as its tokenizers do)."""
    input_ids = _tokens(generator, config, (rows, length))
    attention_mask = torch.ones_like(input_ids)
    pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
    eos = getattr(config, "eos_token_id", None)
    for row, n in enumerate(_pad_lengths(generator, rows, length)):
        if n:
            input_ids[row, length - n:] = pad
            attention_mask[row, length - n:] = 0
        if getattr(config, "is_encoder_decoder", False) and isinstance(eos, int):
            input_ids[row, length - n - 1] = eos
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if (getattr(config, "type_vocab_size", 0) or 0) > 1:  # BERT: a second segment from the middle
        token_type_ids = torch.zeros_like(input_ids)
        token_type_ids[:, length // 2:] = 1
        batch["token_type_ids"] = token_type_ids * attention_mask
    return batch


def _make_batch(plan: _Plan, config, index: int) -> dict:
    """The ``index``-th batch of random inputs (CPU tensors), the same on every rank."""
    generator = torch.Generator().manual_seed(plan.seed * 1_000_003 + index)
    rows, length = plan.batch_size, plan.seq_len
    kind = plan.kind
    if kind in ("causal", "generic"):
        input_ids = _tokens(generator, config, (rows, length))
        attention_mask = torch.ones_like(input_ids)
        pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
        for row, n in enumerate(_pad_lengths(generator, rows, length)):
            input_ids[row, :n] = pad
            attention_mask[row, :n] = 0
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if kind == "seq2seq":
        batch = _encoder_tokens(generator, config, rows, length)
        target = max(2, length // 2)
        labels = _tokens(generator, config, (rows, target))
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, int):
            labels[:, -1] = eos
        if rows > 1:
            labels[1, max(1, 2 * target // 3):] = -100
        return {**batch, "labels": labels}
    if kind == "multiple_choice":
        choices = [_encoder_tokens(generator, config, rows, length) for _ in range(2)]
        batch = {name: torch.stack([c[name] for c in choices], dim=1) for name in choices[0]}
        return {**batch, "labels": torch.randint(0, 2, (rows,), generator=generator)}
    batch = _encoder_tokens(generator, config, rows, length)
    real = batch["attention_mask"].bool()
    if kind in ("masked", "pretraining"):
        chosen = (torch.rand((rows, length), generator=generator) < 0.25) & real
        chosen[:, 0] = True  # at least one label per row
        batch["labels"] = batch["input_ids"].masked_fill(~chosen, -100)
        if kind == "pretraining":
            batch["next_sentence_label"] = torch.randint(0, 2, (rows,), generator=generator)
        return batch
    if kind == "next_sentence":
        return {**batch, "labels": torch.randint(0, 2, (rows,), generator=generator)}
    if kind == "token":
        labels = torch.randint(0, config.num_labels, (rows, length), generator=generator)
        return {**batch, "labels": labels.masked_fill(~real, -100)}
    if kind == "question_answering":
        lengths = real.sum(dim=1)
        start = (torch.rand(rows, generator=generator) * lengths).long()
        end = start + (torch.rand(rows, generator=generator) * (lengths - start)).long()
        return {**batch, "start_positions": start, "end_positions": end}
    if kind == "sequence":
        problem = getattr(config, "problem_type", None)
        if problem == "regression" or (problem is None and config.num_labels == 1):
            labels = torch.randn(rows, config.num_labels, generator=generator).squeeze(-1)
        elif problem == "multi_label_classification":
            labels = torch.randint(0, 2, (rows, config.num_labels), generator=generator).float()
        else:
            labels = torch.randint(0, config.num_labels, (rows,), generator=generator)
        return {**batch, "labels": labels}
    raise AssertionError(f"unknown kind {kind!r}")


# ---------------------------------------------------------------------------------------------
# Comparisons (rank 0)
# ---------------------------------------------------------------------------------------------
@dataclass
class _Difference:
    max_abs: float
    problem: str | None  # None: within tolerance


def _difference(actual, expected, rtol: float, atol: float, scaled: bool = False) -> _Difference:
    """``torch.testing.assert_close``'s rule per tensor (``scaled``: atol times ``max(1, max|expected|)``)."""
    if not isinstance(actual, torch.Tensor):
        return _Difference(math.inf, f"oslo gave {type(actual).__name__}, transformers a tensor")
    a = actual.detach().to("cpu", torch.float32)
    e = expected.detach().to("cpu", torch.float32)
    if a.shape != e.shape:
        return _Difference(math.inf, f"shape {tuple(a.shape)} != transformers' {tuple(e.shape)}")
    if a.numel() == 0:
        return _Difference(0.0, None)
    diff = (a - e).abs()
    diff = torch.where(a == e, torch.zeros_like(diff), diff)  # equal infinities
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)  # NaN on either side
    magnitude = e.abs().nan_to_num(nan=0.0, posinf=0.0)
    scale = max(1.0, float(magnitude.max())) if scaled else 1.0
    allowed = atol * scale + rtol * magnitude
    bad = int((diff > allowed).sum())
    largest = float(diff.max())
    if not bad:
        return _Difference(largest, None)
    tolerance = f"atol {atol * scale:.2e}" + (f" (= {atol:g} x max|expected| {scale:.3g})" if scale > 1 else "")
    return _Difference(largest, f"{bad} of {a.numel()} values beyond tolerance (max |Δ| {largest:.3e}; "
                                f"{tolerance}, rtol {rtol:g})")


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3e}"


# ---------------------------------------------------------------------------------------------
# Gathering the oslo model's tensors
# ---------------------------------------------------------------------------------------------
def _full_tensors(model, tensors: dict) -> dict:
    """Whole tensors from each tensor-parallel rank's parts (collective over the stage's tensor-parallel
    group, which every rank of it calls in the same order); ``None`` stays ``None``."""
    from torch.distributed.tensor import DTensor

    from oslo.checkpoint import whole_tensor
    from oslo.parallel.dtensor import unblock
    from oslo.parallel.plan import parameter_specs

    specs = parameter_specs(model)
    out = {}
    for name, local in tensors.items():
        spec = specs.get(name)
        if local is None:
            out[name] = None
        elif isinstance(local, DTensor):  # torch assembles it; a fused bias is seen as (chunks, size / chunks)
            out[name] = unblock(local.full_tensor(), spec)
        else:
            out[name] = whole_tensor(local, spec, model.parallel_context)
    return out


def _gather_to_first(model, tensors: dict) -> dict | None:
    """Every stage's whole tensors, on global rank 0 (CPU); ``None`` elsewhere. Collective over all ranks."""
    import torch.distributed as dist

    full = _full_tensors(model, tensors)
    context = model.parallel_context
    mine = {name: None if t is None else t.detach().cpu() for name, t in full.items()}
    if context.world_size == 1:
        return mine
    everyone = [None] * context.world_size if context.rank == 0 else None
    dist.gather_object(mine if context.tensor_parallel_rank == 0 else None, everyone, dst=0)
    if context.rank != 0:
        return None
    merged = {}
    for part in everyone:
        merged.update(part or {})
    return merged


def _perturbation() -> tuple[str, float] | None:
    value = os.environ.get(PERTURB_ENV)
    if not value:
        return None
    name, _, delta = value.partition("=")
    return name, float(delta) if delta else _DEFAULT_PERTURBATION


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------
class _Reference:
    """Rank 0's side: transformers' model on the same weights, and every comparison with the oslo model."""

    def __init__(self, plan: _Plan, path: str, device: torch.device, emit) -> None:
        import transformers

        kwargs = dict(plan.overrides)
        if plan.attn_implementation is not None:
            kwargs["attn_implementation"] = plan.attn_implementation
        model, info = getattr(transformers, plan.class_name).from_pretrained(
            path, dtype=torch.float32, output_loading_info=True, **kwargs)
        self.model = model.to(device)
        _dropout_off(self.model)
        self.missing = set(info.get("missing_keys") or ())
        self.plan, self.emit = plan, emit
        self.problems: list[str] = []

    def header(self) -> None:
        plan, emit = self.plan, self.emit
        world = plan.world_size
        emit(f"oslo check: {plan.class_name} from {plan.path}")
        emit(f"layout: tensor_parallel_size={plan.tp} x pipeline_parallel_size={plan.pp} = {world} process"
             f"{'es' if world > 1 else ''} ({plan.backend if world > 1 else 'single process'} on {plan.device})"
             + (f", micro_batch_size={plan.micro_batch_size}" if plan.pp > 1 else "")
             + f"; reference: transformers.{plan.class_name} on rank 0; float32")
        for note in plan.notes:
            emit(f"note: {note}")
        emit(f"inputs: {plan.batches} batch{'es' if plan.batches > 1 else ''} of {plan.batch_size} x {plan.seq_len} "
             f"random tokens, seed {plan.seed} ({_KIND_TEXT[plan.kind]})")

    def weights(self, weights: dict) -> None:
        """oslo's loaded weights (whole tensors) must be transformers' bit for bit. Those the checkpoint lacks
        were initialized on each side its own way: transformers gets oslo's."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        copied, worst, worst_name = [], 0.0, ""
        for name, value in weights.items():
            if name not in params:
                self.problems.append(f"weights: oslo parameter {name} has no transformers parameter of that name")
            elif name in self.missing:
                with torch.no_grad():
                    params[name].copy_(value.to(params[name].device))
                copied.append(name)
            else:
                difference = _difference(value, params[name], 0.0, 0.0)
                if difference.max_abs > worst or not worst_name:
                    worst, worst_name = difference.max_abs, name
                if difference.problem:
                    self.problems.append(f"weights: {name} loaded differently: {difference.problem}")
        if copied:
            self.emit(f"note: {len(copied)} tensor(s) missing from the checkpoint, initialized by oslo from the seed "
                      f"and copied into the reference: {', '.join(sorted(copied)[:5])}"
                      f"{' ...' if len(copied) > 5 else ''}")
        self.emit(f"weights: {len(weights) - len(copied)} tensors loaded, max |Δ| {_fmt(worst)}"
                  + (f" ({worst_name})" if worst > 0 else " (bit-identical)"))
        # Each parameter of transformers' (tied copies once) must be compared under one of its names.
        by_tensor: dict[int, list[str]] = {}
        for name, param in params.items():
            by_tensor.setdefault(id(param), []).append(name)
        uncovered = [names[0] for names in by_tensor.values() if not set(names) & set(weights)]
        if uncovered:
            self.problems.append(f"transformers parameters the oslo model lacks on every rank: {uncovered[:5]}")

    def _record(self, what: str, difference: _Difference) -> float:
        if difference.problem:
            self.problems.append(f"{what}: {difference.problem}")
        return difference.max_abs

    def forward(self, index: int, batch: dict, output) -> tuple[float, float]:
        """Every tensor field of the output (largest |Δ|) and the loss, without gradients."""
        plan = self.plan
        self.model.eval()
        with torch.no_grad():
            expected = self.model(**batch)
        fields, loss = 0.0, 0.0
        for key, value in expected.items():
            if key not in _SKIPPED_OUTPUTS and isinstance(value, torch.Tensor):
                difference = _difference(output.get(key), value, plan.rtol, plan.atol)
                fields = max(fields, self._record(f"batch {index} {key}", difference))
        if expected.get("loss") is not None:
            difference = _difference(output.get("loss"), expected["loss"], plan.rtol, plan.atol)
            loss = self._record(f"batch {index} loss (forward)", difference)
        return fields, loss

    def training(self, index: int, batch: dict, losses: list, grads: dict) -> tuple[float, float, str]:
        """The training step's losses (each micro-batch's under pipelines) and every gradient of the whole
        batch's loss: the largest loss |Δ|, gradient |Δ| and the gradient's name."""
        plan, model = self.plan, self.model
        model.train()
        model.zero_grad(set_to_none=True)
        full_loss = model(**batch).loss
        full_loss.backward()
        if plan.pp == 1:
            expected_losses = [full_loss.detach()]
        else:  # each micro-batch's own loss, on its rows
            with torch.no_grad():
                expected_losses = [model(**{k: v[i:i + plan.micro_batch_size] for k, v in batch.items()}).loss
                                   for i in range(0, plan.batch_size, plan.micro_batch_size)]
        loss_max = 0.0
        if len(losses) != len(expected_losses):
            self.problems.append(f"batch {index}: {len(losses)} training losses, expected {len(expected_losses)}")
        for i, (ours, theirs) in enumerate(zip(losses, expected_losses, strict=False)):
            what = "training loss" if plan.pp == 1 else f"micro-batch {i} loss"
            loss_max = max(loss_max, self._record(f"batch {index} {what}", _difference(ours, theirs, plan.rtol,
                                                                                         plan.atol)))
        expected_grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
        grad_max, grad_name = 0.0, "-"
        for name, grad in grads.items():
            if name not in expected_grads:
                continue  # reported with the weights
            theirs = expected_grads[name]
            if theirs is None or grad is None:
                if (grad is None) != (theirs is None) and (grad is None or bool(grad.any())):
                    owner = "oslo" if theirs is None else "transformers"
                    self.problems.append(f"batch {index} gradient of {name}: only {owner} has one")
                    grad_max, grad_name = math.inf, name
                continue
            difference = _difference(grad, theirs, plan.rtol, plan.atol, scaled=True)
            if difference.max_abs > grad_max or grad_name == "-":
                grad_max, grad_name = difference.max_abs, name
            self._record(f"batch {index} gradient of {name}", difference)
        return loss_max, grad_max, grad_name


def _perturb(model, weights: dict | None) -> str | None:
    """The test hook (see the module docstring): shift the named parameter of the oslo model on every rank
    that holds a part of it. Returns the note to print, or ``None`` without the hook."""
    from oslo.parallel.dtensor import local_named_parameters

    perturbation = _perturbation()
    if perturbation is None:
        return None
    name, delta = perturbation
    if weights is not None and name not in weights:
        raise ValueError(f"{PERTURB_ENV}={name!r}: the model has no parameter of that name")
    with torch.no_grad():
        for local_name, tensor in local_named_parameters(model):
            if local_name == name:
                tensor.add_(delta)
    return f"note: test hook {PERTURB_ENV}: added {delta:g} to {name} in the oslo model only"


def _run_rank(rank: int, plan: _Plan, emit) -> dict | None:
    """The check on one rank; ``emit(line)`` prints on the parent. Returns the problems found on rank 0."""
    import torch.distributed as dist
    import transformers

    import oslo.models as models

    world = plan.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    transformers.logging.set_verbosity_error()  # its loading notices; oslo's own warnings still show
    transformers.logging.disable_progress_bar()
    if world > 1 and not dist.is_initialized():
        if plan.backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(plan.backend, init_method="env://", timeout=timedelta(seconds=plan.timeout))
    model = getattr(models, plan.class_name).from_pretrained_with_parallel(
        plan.path, tensor_parallel_size=plan.tp, pipeline_parallel_size=plan.pp,
        micro_batch_size=plan.micro_batch_size, seed=plan.seed, dtype=torch.float32,
        attn_implementation=plan.attn_implementation, timeout=plan.timeout, **plan.overrides,
    )
    _dropout_off(model)
    device = model.parallel_context.device
    if world == 1 and plan.device == "cuda":
        device = torch.device("cuda", 0)
        model.to(device)
    reference_path = plan.reference_path or plan.path

    weights = _gather_to_first(model, {name: p.detach() for name, p in model.named_parameters()})
    reference = _Reference(plan, reference_path, device, emit) if rank == 0 else None
    if reference is not None:
        reference.header()
        reference.weights(weights)
    note = _perturb(model, weights)
    if reference is not None:
        if note:
            emit(note)
        emit("")
        emit(f"{'batch':>5}  {'logits max|Δ|':>13}  {'loss |Δ|':>10}  {'grad max|Δ|':>11}  worst gradient")

    for index in range(plan.batches):
        batch = {k: v.to(device) for k, v in _make_batch(plan, model.config, index).items()}
        model.eval()
        with torch.no_grad():
            output = model(**batch)
        if reference is not None:
            fields, forward_loss = reference.forward(index, batch, output)
        model.train()
        model.zero_grad(set_to_none=True)
        if plan.pp == 1:
            loss = model(**batch).loss
            loss.backward()
            losses = [loss.detach()]
        else:  # the 1F1B schedule: each micro-batch's output, backpropagated before taking the next
            losses = []
            for micro_output in model(**batch):
                losses.append(micro_output.loss.detach())
                micro_output.loss.backward()
        grads = _gather_to_first(model, {name: p.grad for name, p in model.named_parameters()})
        if reference is not None:
            loss, grad, grad_name = reference.training(index, batch, losses, grads)
            emit(f"{index:>5}  {_fmt(fields):>13}  {_fmt(max(forward_loss, loss)):>10}  {_fmt(grad):>11}  {grad_name}")
    return None if reference is None else {"problems": reference.problems}


# ---------------------------------------------------------------------------------------------
# Launching the ranks
# ---------------------------------------------------------------------------------------------
def _rank_main(rank: int, world_size: int, plan: _Plan) -> dict | None:
    return _run_rank(rank, plan, launch.report)


def _launch(plan: _Plan, grace: float = 10.0) -> dict | None:
    """Run the check on ``plan.world_size`` ranks; returns rank 0's verdict (lines printed as they come).
    Raises :class:`~oslo.launch.RankFailedError` with the first rank's error (the others are stopped after
    ``grace`` s)."""
    if plan.world_size == 1:  # no process group: this process is the rank
        try:
            return _run_rank(0, plan, lambda line: print(line, flush=True))
        except Exception as exc:  # noqa: BLE001 - reported like a rank's failure
            raise launch.RankFailedError(0, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc
    # Forked ranks start at once with torch and transformers imported; CUDA needs fresh processes.
    return launch.run(_rank_main, plan.world_size, (plan,), grace=grace,
                      start_method="spawn" if plan.backend == "nccl" else "fork",
                      on_message=lambda rank, line: print(line, flush=True))[0]


def _tolerance_text(plan: _Plan) -> str:
    return (f"rtol={plan.rtol:g}, atol={plan.atol:g}: |Δ| <= atol + rtol·|expected| per tensor, as "
            "torch.testing.assert_close; gradients with atol x max(1, max|expected|) of each tensor; "
            "weights bit-identical")


def main(args: argparse.Namespace) -> int:
    try:
        plan = _prepare(args)
    except UsageError as exc:
        print(f"{_PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    import oslo.checkpoint as ckpt
    from oslo.reshard import reshard_checkpoint

    with tempfile.TemporaryDirectory(prefix="oslo-check-") as scratch:
        merged = os.path.join(scratch, "merged")
        checkpoint = ckpt.inspect_checkpoint(plan.path)
        try:
            if checkpoint.kind == "split":  # transformers reads a merged copy
                try:
                    reshard_checkpoint(plan.path, merged, merged=True, progress=False)
                except (ValueError, OSError) as exc:
                    print(f"{_PROG}: error: cannot merge the split checkpoint for transformers: "
                          f"{' '.join(str(exc).split())}", file=sys.stderr)
                    return 2
                plan = replace(plan, reference_path=merged)
            verdict = _launch(plan)
        except launch.RankFailedError as failure:
            print(f"rank {failure.rank} failed"
                  + (f" (then ranks {failure.others} too)" if failure.others else "") + f":\n{failure.text}",
                  file=sys.stderr)
            first_line = failure.text.splitlines()[0] if failure.text else ""
            print(f"FAIL: rank {failure.rank} raised {first_line}", flush=True)
            return 1
    problems = verdict["problems"]
    if problems:
        print("")
        for problem in problems[:_MAX_PROBLEMS_SHOWN]:
            print(f"  {problem}")
        if len(problems) > _MAX_PROBLEMS_SHOWN:
            print(f"  ... and {len(problems) - _MAX_PROBLEMS_SHOWN} more")
        print(f"FAIL ({len(problems)} comparison{'s' if len(problems) > 1 else ''} failed; {_tolerance_text(plan)})",
              flush=True)
        return 1
    print(f"PASS ({_tolerance_text(plan)})", flush=True)
    return 0


if __name__ == "__main__":  # python -m oslo.check PATH ...: the same as python -m oslo check PATH ...
    _parser = argparse.ArgumentParser(prog=_PROG, description=HELP)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
