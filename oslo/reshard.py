"""Convert a checkpoint to another parallel layout in one process, without GPUs or a process group.

:func:`reshard_checkpoint` (and ``python -m oslo reshard``) reads a split checkpoint of any layout (oslo's, or the
original OSLO's ``pytorch_model_tp_0_pp_0.bin`` files), or a plain transformers checkpoint, and writes it as a
split checkpoint of another layout or as a plain transformers checkpoint. It streams: each output tensor is
assembled from the slices of the saved ones that make it up, written, and dropped before the next one is read,
so the process holds about one tensor at a time (benchmarks/reshard.py measures it). The output is the one a
model loaded at that layout would save, byte for byte (oslo writes reproducible safetensors files, see
:func:`oslo.checkpoint.write_safetensors`), with the same index, digests and crash-safe publication.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import uuid

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig
from transformers.utils.hub import convert_file_size_to_int

from oslo import checkpoint as ckpt
from oslo.models import oslo_class
from oslo.parallel.context import ParallelContext, validate_parallel_size
from oslo.parallel.dtensor import local_named_parameters
from oslo.parallel.plan import parameter_specs
from oslo.parallel.ties import tie_families

__all__ = ["reshard_checkpoint"]

HELP = ("Convert a checkpoint to another tensor/pipeline-parallel layout, or to/from a plain transformers "
        "checkpoint, in one process (no GPU, no launcher).")

_CONFIG_FILES = ("config.json", "generation_config.json")


def _planned_stage(cls: type, config, tensor_parallel_size: int, pipeline_parallel_size: int, stage: int):
    """The model's pipeline stage ``stage`` at tensor-parallel rank 0, built on the meta device (nothing is
    allocated and no process group is needed): its parameter names, local shapes and splits."""
    context = ParallelContext.planning()
    context.tensor_parallel_size = tensor_parallel_size
    context.pipeline_parallel_size, context.pipeline_parallel_rank = pipeline_parallel_size, stage
    context._pp_ranks = list(range(pipeline_parallel_size))
    cls._validate_parallel_config(config, tensor_parallel_size)
    with torch.device("meta"):
        return cls(config, parallel_context=context)


def _global_dtype(checkpoint: ckpt.Checkpoint, config) -> torch.dtype:
    """The dtype a model loaded with ``dtype="auto"`` would have (and save in)."""
    dtype = getattr(config, "dtype", None) or ckpt.checkpoint_dtype(checkpoint) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def reshard_checkpoint(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    merged: bool = False,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
) -> None:
    """Write the checkpoint at ``source`` to ``destination`` at another layout, in this process alone.

    Args:
        source: A split checkpoint of any layout (``save_pretrained_with_parallel``, or the original OSLO's
            ``pytorch_model_tp_0_pp_0.bin`` files next to a ``config.json``), or a plain transformers one.
        destination: Target directory; written like ``save_pretrained_with_parallel`` writes it (staged beside
            it and switched in atomically; its other files are kept). May be ``source`` itself.
        tensor_parallel_size: Tensor-parallel size of the split checkpoint to write.
        pipeline_parallel_size: Pipeline stages of the split checkpoint to write.
        merged: Write a plain transformers checkpoint (``model.safetensors``, sharded by ``max_shard_size``)
            instead of a split one; the sizes must then be 1.
        max_shard_size: Largest file of a merged checkpoint (``"5GB"``, ``"200MB"`` or bytes).
        progress: Show a progress bar (bytes written).

    Raises:
        ValueError: Bad sizes (not dividing the heads, more stages than layers), a class oslo does not have, or a
            checkpoint that lacks weights of the model or whose shapes are not the config's.
        FileNotFoundError, OSError: The source is missing, incomplete, or fails its recorded digests.
    """
    tp = validate_parallel_size("tensor_parallel_size", tensor_parallel_size)
    pp = validate_parallel_size("pipeline_parallel_size", pipeline_parallel_size)
    if merged and (tp, pp) != (1, 1):
        raise ValueError(f"merged=True writes a plain transformers checkpoint, which has no layout: leave "
                         f"tensor_parallel_size ({tp}) and pipeline_parallel_size ({pp}) at 1.")
    source, destination = os.fspath(source), os.fspath(destination)
    checkpoint = ckpt.inspect_checkpoint(source)
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise FileNotFoundError(f"{source!r} has no config.json: resharding needs the model's config (its "
                                "`architectures` name the class). Copy the model's config.json into it.")
    cls, config = oslo_class(AutoConfig.from_pretrained(source))
    if pp > 1 and not cls._supports_pipeline_parallel:
        raise ValueError(f"{cls.__name__} does not support pipeline parallelism: use pipeline_parallel_size=1.")
    ckpt.complete_legacy_index(checkpoint, cls, config)
    context = ParallelContext.planning()
    if checkpoint.kind == "split":
        for name in checkpoint.files:
            ckpt.verify_split_file(checkpoint, name, *ckpt.file_ranks(name))
        reader = ckpt.SplitSource(checkpoint)
    else:
        ckpt.verify_merged_files(checkpoint, context)
        reader = ckpt.TensorSource(checkpoint.directory, checkpoint.files, checkpoint.kind)
    dtype = _global_dtype(checkpoint, config)
    stages = [_planned_stage(cls, config, tp, pp, stage) for stage in range(pp)]
    files = _plan_files(stages, reader, dtype, tp, merged, max_shard_size)
    total = sum(nbytes for entries in files.values() for *_, nbytes in entries)
    save = ckpt.StagedSave(context, destination)

    def write() -> dict:
        digests = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="resharding", disable=not progress) as bar:
            for name, entries in files.items():
                metadata = ({"oslo_save_id": save_id} if merged else
                            {"oslo_tensor_parallel_rank": str(ckpt.file_ranks(name)[0]),
                             "oslo_pipeline_parallel_rank": str(ckpt.file_ranks(name)[1])})
                digests[name] = ckpt.write_safetensors(save.path(name), [
                    (key, kind, shape, _progressing(make, bar, nbytes)) for key, kind, shape, make, nbytes in entries
                ], metadata)
        return digests

    save_id = uuid.uuid4().hex
    digests = save.step(write, "writing")

    def finish() -> None:
        _copy_other_files(source, save.staging)
        if merged:
            ckpt.write_merged_records(
                save.staging, {key: name for name, entries in files.items() for key, *_ in entries},
                sum(nbytes for entries in files.values() for *_, nbytes in entries), True, save_id, digests)
        else:
            _write_split_index(save, stages, files, digests, tp, pp, dtype)
        _write_config(stages[0], config, dtype, source, save.staging)

    save.step(finish, "indexing")
    save.publish()


def _progressing(make, bar, nbytes):
    def made() -> torch.Tensor:
        tensor = make()
        bar.update(nbytes)
        return tensor
    return made


def _plan_files(stages, reader, dtype, tp, merged, max_shard_size) -> dict[str, list]:
    """``{file name: [(key, dtype, shape, make, nbytes)]}`` of the output, in the order a save writes them."""
    keys = reader.keys()
    files: dict[str, list] = {}
    missing = []
    for stage, model in enumerate(stages):
        prefix = getattr(model, "base_model_prefix", "")
        twins = model.cross_stage_tied_weights()
        specs = parameter_specs(model)
        copies = model.cross_stage_tied_copies()
        for rank in range(1 if merged else tp):
            entries = files.setdefault(ckpt.split_file_name(rank, stage), []) if not merged else None
            for name, param in local_named_parameters(model):
                if merged and name in copies:
                    continue
                key = ckpt.resolve_key(name, keys, prefix)
                if key is None and name in twins:
                    key = ckpt.resolve_key(twins[name], keys, prefix)
                if key is None:
                    missing.append(name)
                    continue
                spec = specs[name]
                global_shape = spec.global_shape(param.shape) if spec is not None else tuple(param.shape)
                if reader.shape(key) != tuple(global_shape):
                    raise ValueError(f"{key!r} has shape {list(reader.shape(key))} in the checkpoint, but "
                                     f"{type(model).__name__} with its config.json expects {list(global_shape)}.")
                if merged or spec is None:
                    shape, make = global_shape, _reading(reader, key, None, dtype)
                else:
                    spec = dataclasses.replace(spec, rank=rank)
                    shape, make = spec.local_shape(global_shape), _reading(reader, key, spec, dtype)
                nbytes = dtype.itemsize
                for extent in shape:
                    nbytes *= extent
                record = (name, dtype, tuple(shape), make, nbytes)
                if merged:
                    files.setdefault("", []).append(record)
                else:
                    entries.append(record)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weight(s) of {type(stages[0]).__name__}: "
                         f"{sorted(set(missing))[:5]}. Resharding copies weights and never initializes new ones: "
                         "load it with from_pretrained_with_parallel (which does) and save it instead.")
    if not merged:
        return files
    limit = convert_file_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    shards = ckpt.plan_shards(files[""], limit, lambda record: record[-1])
    return dict(zip(ckpt.merged_file_names(len(shards)), shards, strict=True))


def _reading(reader, key: str, spec, dtype: torch.dtype):
    """A function making ``key``'s tensor (the slice ``spec`` describes, or the whole one) in ``dtype``."""
    def make() -> torch.Tensor:
        if spec is None:
            return reader.read(key).to(dtype)
        return spec.shard(lambda start, stop: reader.read(key, spec.dim, start, stop)).to(dtype)
    return make


def _copy_other_files(source: str, staging: str) -> None:
    """The source's files that are not weights or their indexes (a tokenizer, a README) go along."""
    for entry in os.scandir(source):
        target = os.path.join(staging, entry.name)
        if (ckpt.OWNED_FILE_RE.match(entry.name) or entry.name in ("config.json", ckpt.LEGACY_STAGING_NAME)
                or os.path.lexists(target)):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, target, symlinks=True)
        elif entry.is_file(follow_symlinks=False):
            shutil.copy2(entry.path, target)


def _write_split_index(save, stages, files, digests, tp, pp, dtype) -> None:
    tensors, names, tied = {}, {}, ckpt.tied_keys(stages[0])
    for stage, model in enumerate(stages):
        specs = parameter_specs(model)
        sources = {target: source for source, targets in tie_families(model).items() for target in targets}
        copies = model.cross_stage_tied_copies()
        stage_names = [key for key, *_ in files[ckpt.split_file_name(0, stage)]]
        for rank in range(tp):
            names[ckpt.split_file_name(rank, stage)] = stage_names
        for name, param in local_named_parameters(model):
            spec = specs[name]
            tensors[name] = {
                "shape": list(spec.global_shape(param.shape) if spec is not None else param.shape),
                "dtype": str(dtype).removeprefix("torch."),
                "split": None if spec is None else {"kind": spec.kind, "dim": spec.dim, "chunks": spec.chunks},
            }
            if name in copies:
                tied[name] = sources[name]
    ranks = {name: dict(zip(("tensor_parallel_rank", "pipeline_parallel_rank"), ckpt.file_ranks(name), strict=True))
             for name in digests}
    ckpt.write_split_index(save.path(ckpt.SPLIT_INDEX_NAME), tp, pp, tensors, names,
                           {name: {**ranks[name], **digest} for name, digest in digests.items()}, tied)


def _write_config(model, config, dtype, source: str, staging: str) -> None:
    """config.json as a save writes it (architectures, dtype); the source's generation_config.json if it has
    one, else the one a save derives from the config."""
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(staging)
    if os.path.isfile(os.path.join(source, "generation_config.json")):
        return  # copied with the other files
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)


# ---- python -m oslo reshard ---------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SRC", help="checkpoint directory to read (split or plain transformers)")
    parser.add_argument("destination", metavar="DST", help="directory to write (replaced atomically)")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="tensor-parallel size to write")
    parser.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1, help="pipeline stages to write")
    parser.add_argument("--merged", action="store_true", help="write a plain transformers checkpoint")
    parser.add_argument("--max-shard-size", default="5GB", help="largest file of a merged checkpoint (default 5GB)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    try:
        reshard_checkpoint(args.source, args.destination, args.tensor_parallel_size, args.pipeline_parallel_size,
                           merged=args.merged, max_shard_size=args.max_shard_size, progress=not args.no_progress)
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        print(f"python -m oslo reshard: error: {exc}", file=sys.stderr)
        return 2
    layout = "a plain transformers checkpoint" if args.merged else (
        f"tensor_parallel_size={args.tensor_parallel_size}, pipeline_parallel_size={args.pipeline_parallel_size}")
    print(f"wrote {args.destination} ({layout})")
    return 0
