"""The zoo's test registry: one :class:`Case` per model class, and the checks every case goes through.

An architecture adds its cases in ``tests/models/cases_<arch>.py`` (a module-level ``CASES`` list) and
registers the module in :data:`CASE_MODULES`; ``tests/models/test_zoo.py`` then runs, for every case:

* parity with the transformers class of the same name on the same weights: every output field, the
  loss, every gradient (tensor parallelism), or the no-gradient pass's outputs and a pipeline training
  step's micro-batch losses and gradients (pipeline parallelism);
* ``generate()`` tokens (greedy, beam + ``no_repeat_ngram_size``, sampling, without cache) for the
  causal LMs;
* checkpoints: split save and reload, merged save loaded by transformers with no missing or unexpected
  keys and the same tensors;
* under pipelines, every parameter on exactly one stage, and ``clip_grad_norm_`` seeing the whole model;
* for each architecture's anchor class, eager attention with ``output_attentions=True``: the attention
  maps from every layer and stage (and, without pipelines, the gradients);
* training: the manual's loop at (tp, pp, dp) equals one process's SGD step on the global batch
  (:data:`TRAINING_LAYOUTS` for every anchor, a case's ``training_layouts`` besides).

Every class runs at (tp, pp) = (1, 1), (2, 1), (1, 2); each architecture's anchor class also at (4, 1)
and (2, 2), and a case at its ``extra_layouts``. One distributed launch per (architecture, layout) checks
all its classes.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

import oslo
from oslo.parallel.dtensor import plain
from tests.helpers import CountAllReduces, full_grads, full_params

CASE_MODULES = ["tests.models.cases_gpt2", "tests.models.cases_gpt_neo", "tests.models.cases_bert",
                "tests.models.cases_t5", "tests.models.cases_llama", "tests.models.cases_qwen2",
                "tests.models.cases_mistral"]

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # every class
ANCHOR_LAYOUTS = [(4, 1), (2, 2)]  # each architecture's anchor class
MICRO_BATCH_SIZE = 2  # the batches have 4 rows: two micro-batches per pipeline step
# (tp, pp, dp, micro_batch_size, DistributedDataParallel) of the training check, for every anchor class
TRAINING_LAYOUTS = [(1, 2, 2, 2, False), (2, 1, 2, 4, True)]
CLIP = 0.05  # clip_grad_norm_'s max norm in the pipeline parity check: below every case's gradient norm


@dataclass(frozen=True)
class Case:
    """One model class of the zoo, as its tests build and call it.

    Attributes:
        arch: Architecture (``"gpt2"``, ``"gpt_neo"``, ``"bert"``); names the test launch.
        name: The class name, the same in ``oslo`` and in ``transformers``.
        config: A tiny config for it (dropout 0, a vocabulary that 2 and 4 do not divide).
        batch: The call's keyword arguments (4 rows), targets included.
        objective: The scalar to backpropagate from an output; ``None``: ``output.loss``.
        pipeline_trains: Whether a pipeline training step applies (the batch holds the loss inputs);
            default: when the objective is the loss.
        pipeline_drop: Keys of the batch left out of the pipeline training step.
        generate: Whether ``generate()`` is checked (causal LMs).
        anchor: The class also checked at the anchor layouts.
        extra_layouts: Further ``(tp, pp)`` layouts this case alone is checked at (T5's ``(1, 4)``).
        variant: Tells apart two cases of one class (another config style); names its checkpoint.
        training_layouts: Further ``(tp, pp, dp, micro_batch_size, ddp)`` layouts of the training check for this
            case (anchors also run :data:`TRAINING_LAYOUTS`).
        eager_attentions: Whether the anchor's attention maps are checked under eager attention.
    """

    arch: str
    name: str
    config: Callable[[], Any]
    batch: Callable[[], dict]
    objective: Callable[[Any], torch.Tensor] | None = None
    pipeline_trains: bool | None = None
    pipeline_drop: tuple[str, ...] = ()
    generate: bool = False
    anchor: bool = False
    generate_kwargs: dict = field(default_factory=dict)
    extra_layouts: tuple[tuple[int, int], ...] = ()
    variant: str = ""
    training_layouts: tuple[tuple[int, int, int, int, bool], ...] = ()
    eager_attentions: bool = True

    @property
    def key(self) -> str:
        """The case's name in results and checkpoint directories."""
        return f"{self.name}-{self.variant}" if self.variant else self.name

    def runs_at(self, tp: int, pp: int) -> bool:
        return (tp, pp) in LAYOUTS or (self.anchor and (tp, pp) in ANCHOR_LAYOUTS) or (tp, pp) in self.extra_layouts

    @property
    def trains_in_pipeline(self) -> bool:
        return self.objective is None if self.pipeline_trains is None else self.pipeline_trains

    def loss(self, output) -> torch.Tensor:
        return output.loss if self.objective is None else self.objective(output)


def all_cases() -> list[Case]:
    cases = []
    for module in CASE_MODULES:
        try:
            cases.extend(importlib.import_module(module).CASES)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return cases


def cases_of(arch: str) -> list[Case]:
    return [case for case in all_cases() if case.arch == arch]


def layouts() -> list[tuple[str, int, int]]:
    """``(arch, tp, pp)`` launches: every layout for every architecture, the anchor layouts where an
    architecture has an anchor class."""
    archs = list(dict.fromkeys(case.arch for case in all_cases()))
    result = [(arch, tp, pp) for arch in archs for tp, pp in LAYOUTS]
    result += [(arch, tp, pp) for arch in archs if any(c.anchor for c in cases_of(arch)) for tp, pp in ANCHOR_LAYOUTS]
    result += [(arch, tp, pp) for arch in archs for tp, pp in dict.fromkeys(
        layout for c in cases_of(arch) for layout in c.extra_layouts) if (arch, tp, pp) not in result]
    return result


def save_checkpoints(root: str, arch: str) -> None:
    """Each case's transformers model, seeded, saved under ``root/<class>``."""
    for case in cases_of(arch):
        torch.manual_seed(0)
        getattr(transformers, case.name)(case.config()).save_pretrained(os.path.join(root, case.key))


# ---------------------------------------------------------------------------------------------
# Checks, run on every rank of a launch
# ---------------------------------------------------------------------------------------------
def _compare(actual, expected, what: str, **tolerance) -> None:
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tolerance)
    elif isinstance(expected, tuple) and all(isinstance(item, torch.Tensor) for item in expected):  # () too
        assert isinstance(actual, tuple) and len(actual) == len(expected), f"{what}: {len(actual)} != {len(expected)}"
        for i, (ours, theirs) in enumerate(zip(actual, expected, strict=True)):
            torch.testing.assert_close(ours, theirs, msg=lambda m, i=i: f"{what}[{i}]: {m}", **tolerance)


def compare_outputs(actual, expected, name: str, **tolerance) -> None:
    """Every tensor field of transformers' output (tuples of tensors too) equals oslo's (``tolerance``:
    ``rtol`` and ``atol`` of ``assert_close``, its defaults when not given)."""
    for key, value in expected.items():
        if key in ("cache", "past_key_values"):  # the KV cache (its name before transformers 5.24)
            continue
        _compare(actual[key], value, f"{name}.{key}", **tolerance)


def weight_names(model) -> list[set[str]]:
    """The names of each weight of ``model``: a tied weight's several names in one set."""
    names: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), set()).add(name)
    return list(names.values())


def reference_grads(reference) -> dict[str, torch.Tensor]:
    """The reference's gradients by every name, tied copies included (``lm_head.weight``)."""
    return {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}


def compare_grads(model, reference, name: str) -> list[str]:
    theirs = reference_grads(reference)
    ours = full_grads(model)
    missing = sorted(set(ours) - set(theirs))
    assert not missing, f"{name}: oslo parameters without a transformers twin: {missing}"
    for param_name, grad in ours.items():
        if theirs[param_name] is None:  # outside this objective's graph (a head the step does not train)
            assert grad is None or not grad.any(), f"{name}: {param_name} got a gradient transformers does not"
            continue
        assert grad is not None, f"{name}: no gradient for {param_name}"
        torch.testing.assert_close(grad, theirs[param_name], msg=lambda m, n=param_name: f"{name} gradient of {n}: {m}")
    return sorted(ours)


def check_parity(case: Case, path: str | None, tp: int, pp: int, *, models: tuple | None = None,
                 batch: dict | None = None, **options) -> list[str]:
    """Outputs, losses and gradients of ``case`` at (tp, pp) against transformers (``options``: more build options
    of ``from_pretrained_with_parallel``). ``models``: ``(reference, model)`` already built (by micro-batches of
    ``MICRO_BATCH_SIZE``) instead of loading both from ``path``; ``batch``: another batch than the case's."""
    if models is None:
        reference = getattr(transformers, case.name).from_pretrained(path)
        model = getattr(oslo, case.name).from_pretrained_with_parallel(
            path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=MICRO_BATCH_SIZE, **options)
    else:
        reference, model = models
    batch = case.batch() if batch is None else batch
    expected = reference(**batch, output_hidden_states=True)
    if pp == 1:
        actual = model(**batch, output_hidden_states=True)
        compare_outputs(actual, expected, case.name)
        case.loss(expected).backward()
        case.loss(actual).backward()
        return compare_grads(model, reference, case.name)

    with torch.no_grad():  # one pass: the outputs on every stage
        actual = model(**batch, output_hidden_states=True)
    compare_outputs(actual, expected, case.name)
    if not case.trains_in_pipeline:
        return []
    batch = {k: v for k, v in batch.items() if k not in case.pipeline_drop}
    losses = []
    for micro_output in model(**batch):
        losses.append(micro_output.loss.detach())
        micro_output.loss.backward()
    rows = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
    with torch.no_grad():
        expected_losses = [
            reference(**{k: v[i : i + MICRO_BATCH_SIZE] if isinstance(v, torch.Tensor) else v
                         for k, v in batch.items()}).loss
            for i in range(0, rows, MICRO_BATCH_SIZE)
        ]
    assert len(losses) == len(expected_losses)
    for i, (ours, theirs) in enumerate(zip(losses, expected_losses, strict=True)):  # on every stage
        torch.testing.assert_close(ours, theirs, msg=lambda m, i=i: f"{case.name} micro-batch {i} loss: {m}")
    reference(**batch).loss.backward()  # the step's gradients are the whole batch's
    names = compare_grads(model, reference, case.name)
    # Clipping sees the whole model's norm (every stage's parameters, a tied weight once) and scales alike.
    total = model.clip_grad_norm_(CLIP)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP),
                               msg=lambda m: f"{case.name} clip_grad_norm_: {m}")
    compare_grads(model, reference, f"{case.name} (clipped)")
    return names


def check_attentions(case: Case, path: str, tp: int, pp: int) -> None:
    """Eager attention with ``output_attentions=True``: every output field, the attention maps of every layer
    (gathered from the ranks' heads, and from every stage), and without pipelines the gradients."""
    reference = getattr(transformers, case.name).from_pretrained(path, attn_implementation="eager")
    model = getattr(oslo, case.name).from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=MICRO_BATCH_SIZE,
        attn_implementation="eager")
    batch = case.batch()
    what = f"{case.name} (eager attention)"
    with torch.set_grad_enabled(pp == 1):
        expected = reference(**batch, output_hidden_states=True, output_attentions=True)
        actual = model(**batch, output_hidden_states=True, output_attentions=True)
    maps = [key for key, value in expected.items() if "attentions" in key and value]
    assert maps, f"{what}: transformers returned no attention maps"
    compare_outputs(actual, expected, what)
    if pp == 1:
        case.loss(expected).backward()
        case.loss(actual).backward()
        compare_grads(model, reference, what)


def check_generate(case: Case, path: str, tp: int, pp: int, rank: int, **options) -> None:
    reference = getattr(transformers, case.name).from_pretrained(path)
    model = getattr(oslo, case.name).from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, seed=1234, **options)
    batch = case.batch()
    pad = reference.config.pad_token_id if reference.config.pad_token_id is not None else 0
    common = dict(input_ids=batch["input_ids"][:3, :6], attention_mask=batch["attention_mask"][:3, :6],
                  max_new_tokens=8, pad_token_id=pad, **case.generate_kwargs)
    options = {
        "greedy": dict(do_sample=False),
        "greedy_no_cache": dict(do_sample=False, use_cache=False),
        "beam_ngram": dict(do_sample=False, num_beams=3, no_repeat_ngram_size=2),
        "fused_ngram": dict(do_sample=False, num_beams=2, no_repeat_ngram_size=2),  # oslo's n-gram blocking
    }
    for name, option in options.items():
        expected = reference.generate(**common, **option)
        actual = model.generate(**common, **option, fused_no_repeat_ngram_blocking=name == "fused_ngram")
        assert torch.equal(actual, expected), f"{case.name} {name}: {actual.tolist()} != {expected.tolist()}"
    # Sampling: the ranks start from different global RNG states; the model's replicated stream decides.
    torch.manual_seed(1234)
    expected = reference.generate(**common, do_sample=True, top_k=20)
    torch.manual_seed(rank)
    actual = model.generate(**common, do_sample=True, top_k=20)
    assert torch.equal(actual, expected), f"{case.name} sampling: {actual.tolist()} != {expected.tolist()}"


def _placements(param: torch.Tensor) -> tuple | None:
    return (param.device_mesh.size(), param.placements, param.shape) if isinstance(param, DTensor) else None


def check_checkpoints(case: Case, path: str, tp: int, pp: int, root: str, **options) -> None:
    """Split save + reload at the same layout (the same weights); merged save read by transformers with
    no missing or unexpected keys and the reference's tensors (``options``: more build options)."""
    model = getattr(oslo, case.name).from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **options)
    split, merged = os.path.join(root, f"{case.key}-split"), os.path.join(root, f"{case.key}-merged")
    model.save_pretrained_with_parallel(split)
    model.save_pretrained_with_parallel(merged, save_with_merging=True)
    again = getattr(oslo, case.name).from_pretrained_with_parallel(
        split, tensor_parallel_size=tp, pipeline_parallel_size=pp, **options)
    # The same layout: every rank's shards equal (and laid out alike) is the same weights, without gathering them.
    ours, reloaded = dict(model.named_parameters()), dict(again.named_parameters())
    assert sorted(ours) == sorted(reloaded)
    for name, value in ours.items():
        assert _placements(reloaded[name]) == _placements(value), f"{case.name}: {name} is laid out anew"
        assert torch.equal(plain(reloaded[name]), plain(value)), f"{case.name}: {name} changed through a split save"
    if model.parallel_context.rank == 0:
        loaded, info = getattr(transformers, case.name).from_pretrained(merged, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (case.name, info)
        original = getattr(transformers, case.name).from_pretrained(path).state_dict()
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, original[name]), f"{case.name}: {name} differs in the merged checkpoint"
    if dist.is_initialized():
        dist.barrier()


def run_layout(rank: int, world_size: int, arch: str, tp: int, pp: int, root: str, scratch: str) -> dict:
    """Every check of ``arch``'s cases at one layout, on one rank; returns what was checked and, by case, the
    names of the parameters this rank holds."""
    checked: dict[str, list[str]] = {}
    held: dict[str, list[str]] = {}
    for case in cases_of(arch):
        if not case.runs_at(tp, pp):
            continue
        path = os.path.join(root, case.key)
        done = []
        held[case.key] = check_parity(case, path, tp, pp)
        done.append("parity")
        if case.anchor and case.eager_attentions:
            check_attentions(case, path, tp, pp)
            done.append("attentions")
        if case.generate:
            check_generate(case, path, tp, pp, rank)
            done.append("generate")
        if tp * pp > 1:
            check_checkpoints(case, path, tp, pp, os.path.join(scratch, f"{tp}x{pp}"))
            done.append("checkpoints")
        checked[case.key] = done
    return {"checked": checked, "held": held}


def count_block_all_reduces(rank: int, world_size: int, arch: str) -> tuple[int, int]:
    """All-reduces of one block of ``arch``'s anchor class at tensor parallelism, forward and backward
    (the Megatron minimum is 2 and 2: after the attention's and the MLP's row-parallel layer, and before
    their column-parallel ones)."""
    from oslo.parallel.pipeline import StageLayers

    case = next(c for c in cases_of(arch) if c.anchor)
    model = getattr(oslo, case.name).from_config_with_parallel(case.config(), tensor_parallel_size=world_size,
                                                              seed=0)
    layers = next(m for m in model.modules() if isinstance(m, StageLayers))
    block = next(iter(layers))
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    hidden.requires_grad_()
    extra = {}
    if "position_embeddings" in inspect.signature(block.forward).parameters:  # rotary: the body computes them
        extra["position_embeddings"] = model.base_model.rotary_emb(hidden, torch.arange(7)[None])
    with CountAllReduces() as forward:
        out = block(hidden, **extra)
        out = out[0] if isinstance(out, tuple) else out
    with CountAllReduces() as backward:
        out.square().sum().backward()
    return forward.count, backward.count


# ---------------------------------------------------------------------------------------------
# Training on a layout equals one process on the global batch (the manual's loops, unchanged)
# ---------------------------------------------------------------------------------------------
TRAINING_LR = 0.5


def training_layouts() -> list[tuple[Case, int, int, int, int, bool]]:
    """``(case, tp, pp, dp, micro_batch_size, ddp)`` of the training check: every anchor at
    :data:`TRAINING_LAYOUTS`, and each case's own ``training_layouts``."""
    result = []
    for case in all_cases():
        layouts = (TRAINING_LAYOUTS if case.anchor else []) + list(case.training_layouts)
        result += [(case, *layout) for layout in dict.fromkeys(layouts)]
    return result


def training_batch(case: Case) -> dict:
    """8 rows: the case's batch, then its rows in reverse order with the first 4 positions of every label
    row ignored (-100) and the first of a classification's labels too, so that micro-batches and replicas
    hold different numbers of label items."""
    first = case.batch()
    second = {name: value.flip(0) if isinstance(value, torch.Tensor) else value for name, value in first.items()}
    labels = second.get("labels")
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        second["labels"] = labels.clone()
        if labels.dim() >= 2:
            second["labels"][..., :4] = -100
        else:
            second["labels"][0] = -100
    return {name: torch.cat([value, second[name]]) if isinstance(value, torch.Tensor) else value
            for name, value in first.items()}


def _training_objective(case: Case, pp: int) -> tuple[Callable[[Any], torch.Tensor], tuple[str, ...]]:
    """What a training call at ``pp`` stages backpropagates, and the batch keys it leaves out: under pipelines
    each micro-batch's loss (a case may train only part of its objective there, see ``pipeline_drop``)."""
    if pp == 1:
        return case.loss, ()
    return (lambda output: output.loss), case.pipeline_drop


def _rows(batch: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def reference_training_step(case: Case, path: str, pp: int = 1) -> dict[str, torch.Tensor]:
    """One SGD step of transformers' model on the whole batch, in one process (every name, tied ones too)."""
    objective, drop = _training_objective(case, pp)
    model = getattr(transformers, case.name).from_pretrained(path).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAINING_LR)
    objective(model(**{k: v for k, v in training_batch(case).items() if k not in drop})).backward()
    optimizer.step()
    return {name: param.detach() for name, param in model.named_parameters(remove_duplicate=False)}


def run_training(rank: int, world_size: int, key: str | Case, path: str, tp: int, pp: int, micro_batch_size: int,
                 wrap: bool, checkpointing: bool = False, fuse: bool = False, **options):
    """The manual's loop: the replica's rows of the global batch, the model (or its DDP wrapper) called on
    them, each (micro-batch) loss backpropagated as it is, one SGD step (``key``: a case's key, or the case).
    Returns the full weights, and the
    losses this rank saw with the reference's for its own (micro-)batches (``options``: more build options of
    ``from_pretrained_with_parallel``; ``checkpointing``: activation checkpointing on; ``fuse``: ``model.fuse()``)."""
    from torch.nn.parallel import DistributedDataParallel

    case = key if isinstance(key, Case) else next(c for c in all_cases() if c.key == key)
    objective, drop = _training_objective(case, pp)
    model = getattr(oslo, case.name).from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=micro_batch_size,
        **options).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    if fuse:
        model.fuse()
    mpu = model.mpu
    model_ddp = model
    if wrap:
        model_ddp = DistributedDataParallel(model.gpu_modules(), process_group=mpu.get_data_parallel_group())
    optimizer = torch.optim.SGD(model.gpu_parameters(), lr=TRAINING_LR)
    batch = {k: v for k, v in training_batch(case).items() if k not in drop}
    rows = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0] // mpu.get_data_parallel_world_size()
    start = mpu.get_data_parallel_rank() * rows
    sample = _rows(batch, start, start + rows)
    optimizer.zero_grad()
    losses = []
    for output in model_ddp(**sample) if pp > 1 else [model_ddp(**sample)]:
        loss = objective(output)
        losses.append(loss.detach())
        loss.backward()
    optimizer.step()
    # The loss each rank reports is its own (micro-)batch's, as transformers computes it.
    reference = getattr(transformers, case.name).from_pretrained(path).train()
    step = micro_batch_size if pp > 1 else rows
    with torch.no_grad():
        expected = [objective(reference(**_rows(sample, i, i + step))) for i in range(0, rows, step)]
    return full_params(model), torch.stack(losses), torch.stack(expected)


def check_training(case: Case, path: str, pp: int, results: list) -> None:
    """``run_training``'s results from every rank against one process's step: every weight equals the
    reference's, every parameter of the reference (a tied group by any of its names) is held by some rank, and
    each rank's losses are transformers' on its own (micro-)batches."""
    expected = reference_training_step(case, path, pp)
    seen: set[str] = set()
    for params, losses, own in results:
        assert params and set(params) <= set(expected), sorted(set(params) - set(expected))
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name], msg=lambda m, n=name: f"{case.key} {n}: {m}")
        seen |= set(params)
        torch.testing.assert_close(losses, own, msg=lambda m: f"{case.key} losses: {m}")
    missing = [sorted(names) for names in weight_names(getattr(transformers, case.name).from_pretrained(path))
               if not names & seen]
    assert not missing, f"{case.key}: held by no rank: {missing}"
