"""Split and merged checkpoints: slice-on-read loading and streaming, crash-safe saving.

Two formats:

* **merged**: a plain Hugging Face checkpoint (``model.safetensors``, sharded with
  ``model.safetensors.index.json``, or ``pytorch_model.bin``). Every rank reads only its slices
  (``safe_open(...).get_slice``), so no rank holds the full model.
* **split**: one ``model_tp={t}_pp={p}.safetensors`` per model-parallel rank with this rank's local
  tensors, plus ``model_parallel.index.json`` recording the layout, global shapes, dtypes and which
  tensors each file holds. At the layout that saved it each rank reads only its own file; at any other
  layout (or stage partition) each rank reads the slices of the saved files that make up its own
  (:class:`SplitSource`). The original OSLO's split files (``pytorch_model_tp_0_pp_0.bin``,
  ``pytorch_model_tp=0_pp=0.bin``, without an index) load through the same path once
  :func:`complete_legacy_index` has described them.

Every weight operation goes through the :class:`~oslo.parallel.plan.ShardSpec` of the parameter.

Files carry their identity: the split index records each file's ranks, size and SHA-256 (and each split
safetensors header its ranks); a merged save records its files' sizes and SHA-256 in ``oslo_checkpoint.json``.
Loading verifies them before any weight is used. Saving is staged beside the target directory and switched in
atomically (see :class:`StagedSave`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from oslo.parallel.collectives import through_cpu
from oslo.parallel.comm import gather_to_first, run_on_all_ranks
from oslo.parallel.context import ParallelContext
from oslo.parallel.dtensor import local_named_parameters
from oslo.parallel.plan import VOCAB, ShardSpec, parameter_specs, specs_by_name
from oslo.parallel.ties import cross_stage_tied_copies, cross_stage_tied_weights, tie_families

logger = logging.getLogger(__name__)

SPLIT_INDEX_NAME = "model_parallel.index.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
MANIFEST_NAME = "oslo_checkpoint.json"  # sizes and SHA-256 of a merged save's files
# A split file's ranks, in oslo's names and in the original OSLO's (``pytorch_model_tp_0_pp_0.bin``).
SPLIT_RANKS_RE = re.compile(r"^(?:model|pytorch_model)_tp[=_](\d+)_pp[=_](\d+)\.(?:safetensors|bin)$")
_MERGED_FILE_RE = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|pytorch_model(-\d{5}-of-\d{5})?\.bin|"
    r"model\.safetensors\.index\.json|pytorch_model\.bin\.index\.json)$"
)
# Weight files a save replaces: a directory holds one checkpoint (split or merged) at a time.
OWNED_FILE_RE = re.compile(
    f"{SPLIT_RANKS_RE.pattern}|{_MERGED_FILE_RE.pattern}|^{re.escape(SPLIT_INDEX_NAME)}$|^{re.escape(MANIFEST_NAME)}$"
)
LEGACY_STAGING_NAME = ".oslo-saving"  # earlier oslo versions staged inside the target: never carried over

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def split_file_name(tensor_parallel_rank: int, pipeline_parallel_rank: int, safe_serialization: bool = True) -> str:
    """File name of one model-parallel rank's shard in a split checkpoint."""
    if safe_serialization:
        return f"model_tp={tensor_parallel_rank}_pp={pipeline_parallel_rank}.safetensors"
    return f"pytorch_model_tp={tensor_parallel_rank}_pp={pipeline_parallel_rank}.bin"


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """What a checkpoint directory holds. Built identically on every rank from the file system."""

    directory: str  # for kind "memory": a few words naming where the tensors come from
    kind: str  # "split", "safetensors", "bin", or "memory" (``state_dict`` holds the full tensors)
    files: list[str]
    split_index: dict | None = None
    manifest: dict | None = None  # oslo_checkpoint.json of a merged save
    state_dict: dict | None = None  # kind "memory": {name: full (unsplit) tensor}
    legacy: bool = False  # split files without an index (the original OSLO's): see complete_legacy_index

    @property
    def layout(self) -> tuple[int, int] | None:
        if self.split_index is None:
            return None
        return self.split_index["tensor_parallel_size"], self.split_index["pipeline_parallel_size"]


def inspect_checkpoint(directory: str) -> Checkpoint:
    """Find the weights in ``directory``: a split checkpoint if its index is there, else a merged one.

    Raises:
        FileNotFoundError: The directory does not exist (saying so when a save to it was interrupted),
            holds no weights, or misses a file its index names.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"checkpoint directory {directory!r} does not exist. {interrupted_save(directory)}Pass the path of "
            "a directory holding config.json and the weights (model.safetensors, pytorch_model.bin, or a split "
            "checkpoint written by save_pretrained_with_parallel)."
        )

    def path(name: str) -> str:
        return os.path.join(directory, name)

    if os.path.isfile(path(SPLIT_INDEX_NAME)):
        with open(path(SPLIT_INDEX_NAME)) as f:
            index = json.load(f)
        files = sorted(index["files"])
        _require_files(directory, files, SPLIT_INDEX_NAME)
        kind = "split"
        return Checkpoint(directory, kind, files, index)
    manifest = None
    if os.path.isfile(path(MANIFEST_NAME)):
        try:
            with open(path(MANIFEST_NAME)) as f:
                manifest = json.load(f)
            if not isinstance(manifest, dict) or not {"save_id", "files"} <= manifest.keys():
                raise ValueError("no save_id and files")
        except ValueError as exc:
            raise OSError(
                f"{path(MANIFEST_NAME)} is corrupt ({exc!r}): it should record the sizes and SHA-256 of the files "
                "of the merged checkpoint oslo saved there. Delete it to load the weights unverified, or save again."
            ) from exc
    for index_name, kind in ((SAFE_WEIGHTS_INDEX_NAME, "safetensors"), (WEIGHTS_INDEX_NAME, "bin")):
        if os.path.isfile(path(index_name)):
            with open(path(index_name)) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            _require_files(directory, files, index_name)
            return Checkpoint(directory, kind, files, manifest=manifest)
    for name, kind in ((SAFE_WEIGHTS_NAME, "safetensors"), (WEIGHTS_NAME, "bin")):
        if os.path.isfile(path(name)):
            return Checkpoint(directory, kind, [name], manifest=manifest)
    legacy = sorted(name for name in os.listdir(directory) if SPLIT_RANKS_RE.match(name))
    if legacy:
        return Checkpoint(directory, "split", legacy, legacy=True)
    raise FileNotFoundError(
        f"no weights found in {directory!r}: expected {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, "
        f"{WEIGHTS_NAME}, {WEIGHTS_INDEX_NAME} or a split checkpoint ({SPLIT_INDEX_NAME})."
    )


def interrupted_save(directory: str) -> str:
    """What the leftovers of an interrupted save beside ``directory`` hold ("" if there are none)."""
    staging, aside = _save_paths(os.path.realpath(directory))[1:]
    if os.path.isdir(aside):
        return (
            f"A save to it was interrupted while it replaced the checkpoint: the previous checkpoint is complete "
            f"in {aside!r} and the new one in {staging!r}. Rename the one you want to {directory!r}, or save "
            "again (the next save puts the previous checkpoint back first). "
        )
    if os.path.isdir(staging):
        return (
            f"A save to it was interrupted before it finished, so nothing was published ({staging!r} holds its "
            "partial output, which the next save removes). "
        )
    return ""


def _require_files(directory: str, files: list[str], index_name: str) -> None:
    missing = [name for name in files if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise FileNotFoundError(
            f"checkpoint {directory!r} is incomplete: {index_name} names {missing}, which "
            f"{'does' if len(missing) == 1 else 'do'} not exist. Copy the missing file(s) next to "
            f"{index_name}, or save the checkpoint again."
        )


def file_ranks(name: str) -> tuple[int, int]:
    """(tensor-parallel rank, pipeline-parallel rank) of a split file, from its name."""
    found = SPLIT_RANKS_RE.match(name)
    return int(found.group(1)), int(found.group(2))


def complete_legacy_index(checkpoint: Checkpoint, model_class: type, config) -> None:
    """Describe split files that have no index (the original OSLO's ``pytorch_model_tp_0_pp_0.bin``): the layout
    from the files' names, each tensor's split from ``model_class`` planned on the meta device at that
    tensor-parallel size, global shapes from the files' local ones. Files are read with ``weights_only=True``.

    Raises:
        ValueError: The files do not form a layout (a missing rank), or hold a tensor ``model_class`` lacks or
            one whose local shape is not the slice of the model's.
    """
    if not checkpoint.legacy or checkpoint.split_index is not None:
        return
    ranks = {file_ranks(name): name for name in checkpoint.files}
    tp = 1 + max(t for t, _ in ranks)
    pp = 1 + max(p for _, p in ranks)
    absent = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in ranks]
    if absent:
        raise ValueError(
            f"the split files of {checkpoint.directory!r} ({checkpoint.files}) do not form a layout: "
            f"tensor_parallel_size={tp}, pipeline_parallel_size={pp} from their names, but the files of (tp, pp) "
            f"ranks {absent} are missing."
        )
    model, specs = specs_by_name(model_class, config, tp, 0)
    prefix = getattr(model, "base_model_prefix", "")
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters(remove_duplicate=False)}
    tensors, files = {}, {}
    for (t, _), name in sorted(ranks.items()):
        source = TensorSource(checkpoint.directory, [name], "bin" if name.endswith(".bin") else "safetensors")
        files[name] = sorted(source.keys())
        if t != 0:
            continue
        for key in sorted(source.keys()):
            param = resolve_key(key, set(specs), prefix)
            if param is None:
                raise ValueError(f"{os.path.join(checkpoint.directory, name)} holds {key!r}, which is no parameter "
                                 f"of {model_class.__name__}: load it with the class that saved it.")
            spec = specs[param]
            local = source.shape(key)
            if local != shapes[param]:
                raise ValueError(
                    f"{key!r} in {os.path.join(checkpoint.directory, name)} has shape {list(local)}, but the slice "
                    f"of tensor-parallel rank 0 of {tp} of {model_class.__name__} with this config has "
                    f"{list(shapes[param])}."
                )
            tensors[key] = {
                "shape": list(spec.global_shape(local) if spec is not None else local),
                "dtype": str(source.dtype(key)).removeprefix("torch."),
                "split": None if spec is None else {"kind": spec.kind, "dim": spec.dim, "chunks": spec.chunks},
            }
    checkpoint.split_index = {"format": "oslo-split", "version": 0, "tensor_parallel_size": tp,
                              "pipeline_parallel_size": pp, "tensors": tensors, "files": files, "tied": {}}


class TensorSource:
    """Lazy access to the tensors of a list of safetensors or torch files.

    safetensors files are opened (memory-mapped) per read and closed right after: a column slice of a
    row-major tensor touches nearly every page of it, and keeping the mapping open would leave those
    pages counted against the rank's memory for the whole load (measured: 3.8x the rank's shard
    bytes at tp=4 on a gpt2-medium checkpoint, against 1.1x when reopening per tensor).
    """

    def __init__(self, directory: str, files: list[str], kind: str) -> None:
        self._paths: dict[str, str] = {}
        self._metadata: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._state_dicts: dict[str, dict] = {}
        for name in files:
            path = os.path.join(directory, name)
            if kind == "bin" or name.endswith(".bin"):
                state = _torch_load(path)
                self._state_dicts.update({key: state for key in state})
            else:
                with _safe_open(path) as handle:
                    for key in handle.keys():
                        view = handle.get_slice(key)
                        self._paths[key] = path
                        self._metadata[key] = (tuple(view.get_shape()), _DTYPES[view.get_dtype()])

    def keys(self) -> set[str]:
        return set(self._paths) | set(self._state_dicts)

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._paths:
            return self._metadata[key][0]
        return tuple(self._state_dicts[key][key].shape)

    def dtype(self, key: str) -> torch.dtype:
        if key in self._paths:
            return self._metadata[key][1]
        return self._state_dicts[key][key].dtype

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor ``key``, or its rows ``[start, stop)`` along ``dim``."""
        if key in self._paths:
            with _safe_open(self._paths[key]) as handle:
                if dim is None:
                    return handle.get_tensor(key)
                index = (slice(None),) * dim + (slice(start, stop),)
                return handle.get_slice(key)[index].clone()
        tensor = self._state_dicts[key][key]
        if dim is None:
            return tensor
        return tensor.narrow(dim, start, stop - start).clone()


class _MemorySource:
    """The :class:`TensorSource` interface over an in-memory state dict of full tensors (``oslo.initialize``)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._tensors = state_dict

    def keys(self) -> set[str]:
        return set(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].dtype

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        tensor = self._tensors[key]
        if dim is None:
            return tensor
        return tensor.narrow(dim, start, stop - start)


class SplitSource:
    """The :class:`TensorSource` interface over a whole split checkpoint, at its global (unsplit) shapes: a read
    of rows ``[start, stop)`` along a tensor's split dimension reads, from each saved rank's file, only the part
    of its slice that falls in them. Loading at another layout or stage partition, and resharding, go through it.
    Files are opened on first use."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        index = checkpoint.split_index
        self._directory = checkpoint.directory
        self._tp = index["tensor_parallel_size"]
        self._tensors = index["tensors"]
        self._tied: dict[str, str] = index.get("tied") or {}  # {copy: source}
        self._names = {file_ranks(name): name for name in checkpoint.files}
        self._stage: dict[str, int] = {}
        for name, keys in sorted(index["files"].items()):
            tp_rank, stage = file_ranks(name)
            if tp_rank == 0:
                for key in keys:
                    self._stage.setdefault(key, stage)
        self._files: dict[tuple[int, int], TensorSource] = {}

    def _file(self, tp_rank: int, stage: int) -> TensorSource:
        if (tp_rank, stage) not in self._files:
            name = self._names[(tp_rank, stage)]
            self._files[(tp_rank, stage)] = TensorSource(self._directory, [name], "split")
        return self._files[(tp_rank, stage)]

    def keys(self) -> set[str]:
        """Every saved tensor but the copies of tied weights (the tie source is saved)."""
        return {key for key in self._tensors if self._tied.get(key) not in self._tensors}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return getattr(torch, self._tensors[key]["dtype"])

    def _spec(self, key: str, rank: int) -> ShardSpec:
        split = self._tensors[key]["split"]
        return ShardSpec(split["kind"], split["dim"], self._tensors[key]["shape"][split["dim"]], self._tp, rank,
                         split.get("chunks", 1))

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stage = self._stage[key]
        split = self._tensors[key]["split"]
        if split is None:
            return self._file(0, stage).read(key, dim, start, stop)
        if dim is None or dim != split["dim"]:
            full = self._specs_merge(key, stage)
            return full if dim is None else full.narrow(dim, start, stop - start)
        pieces = []
        for rank in range(self._tp):
            offset = 0  # where the current range starts in the rank's local tensor
            for first, last, padding in self._spec(key, rank).ranges():
                low, high = max(first, start), min(last, stop)
                if low < high:
                    pieces.append((low, self._file(rank, stage).read(key, dim, offset + low - first,
                                                                     offset + high - first)))
                offset += last - first + padding
        pieces.sort(key=lambda piece: piece[0])
        return torch.cat([piece for _, piece in pieces], dim=dim) if len(pieces) > 1 else pieces[0][1]

    def _specs_merge(self, key: str, stage: int) -> torch.Tensor:
        return self._spec(key, 0).merge([self._file(rank, stage).read(key) for rank in range(self._tp)])


def _safe_open(path: str):
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise OSError(
            f"cannot read {path}: not a valid safetensors file ({exc}). It is probably truncated or "
            "corrupt; save or copy the checkpoint again."
        ) from exc


# What torch's weights-only unpickler says of a pickle that names a function or class to run (not garbage).
_UNSAFE_PICKLE_RE = re.compile(
    r"GLOBAL [A-Za-z_][\w.]* (was not an allowed global|whose module)|Can only create new object .*|"
    r"Trying to call reduce for unrecognized function [^\n]*|Can only build Tensor[^\n]*"
)


def _torch_load(path: str) -> dict:
    """A ``.bin`` state dict, loaded with ``weights_only=True``: memory-mapped when it is a zip archive (torch's
    format since 1.6), read whole when it has the legacy format (``_use_new_zipfile_serialization=False``), which
    cannot be mapped."""
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as exc:
        found = _UNSAFE_PICKLE_RE.search(str(exc))
        if found is None:  # the weights-only unpickler also stops at garbage (a truncated legacy file)
            raise OSError(f"cannot read {path}: {exc}. It is probably truncated or corrupt.") from exc
        raise OSError(
            f"{path} is refused: it would execute code. It holds pickled objects other than tensors "
            f"({found.group(0)}); refusing to load it (weights_only=True: nothing was executed). Convert it to "
            "safetensors in an environment that trusts it."
        ) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise OSError(f"cannot read {path}: {exc!r}. It is probably truncated or corrupt.") from exc
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise OSError(f"{path} is not a state dict (a dict of tensor names to tensors): {type(state).__name__}.")
    return state


def _file_digest(path: str, sync: bool = False) -> dict:
    """``{"size", "sha256"}`` of a file; with ``sync``, its data is also flushed to disk (``fsync``)."""
    sha = hashlib.sha256()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while count := f.readinto(buffer):
            sha.update(view[:count])
        if sync:
            os.fsync(f.fileno())
        size = f.tell()
    return {"size": size, "sha256": sha.hexdigest()}


def _safetensors_metadata(path: str) -> dict:
    """The ``__metadata__`` of a safetensors header ({} if unreadable: the full read reports that)."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > 100 << 20:
                return {}
            metadata = json.loads(f.read(length)).get("__metadata__")
    except (OSError, ValueError, AttributeError):
        return {}
    return metadata if isinstance(metadata, dict) else {}


def _verify_file(directory: str, name: str, records: dict[str, dict], recorded_in: str) -> None:
    """Refuse ``name`` unless its size and SHA-256 are those ``records[name]`` (from ``recorded_in``) holds."""
    record, path = records[name], os.path.join(directory, name)
    size = os.path.getsize(path)
    sha256 = None
    if size == record["size"]:
        sha256 = _file_digest(path)["sha256"]
        if sha256 == record["sha256"]:
            return
    if any(other["size"] == size for other in records.values()):  # maybe another file of the checkpoint
        sha256 = sha256 or _file_digest(path)["sha256"]
        twins = [other for other, entry in records.items() if entry["sha256"] == sha256 and other != name]
        if twins:
            raise OSError(
                f"{path} holds the content {recorded_in} records for {twins[0]}: the files were swapped or "
                "renamed. Give each file its recorded name, or save the checkpoint again."
            )
    if size != record["size"]:
        raise OSError(
            f"{path} has {size} bytes but {recorded_in} records {record['size']}: the file is truncated or corrupt "
            "(or was replaced). Save or copy the checkpoint again."
        )
    raise OSError(
        f"{path} changed since it was saved: its SHA-256 differs from the one {recorded_in} records (same size), "
        "so it is corrupt or another file. Save or copy the checkpoint again."
    )


def verify_split_file(checkpoint: Checkpoint, name: str, tensor_parallel_rank: int, pipeline_parallel_rank: int):
    """Check that this rank's split file is the one the index describes (indexes of version 1 record nothing)."""
    records = checkpoint.split_index.get("digests")
    if not records:
        return
    path = os.path.join(checkpoint.directory, name)
    metadata = _safetensors_metadata(path) if name.endswith(".safetensors") else {}
    if "oslo_tensor_parallel_rank" in metadata:
        ranks = int(metadata["oslo_tensor_parallel_rank"]), int(metadata["oslo_pipeline_parallel_rank"])
        if ranks != (tensor_parallel_rank, pipeline_parallel_rank):
            raise OSError(
                f"{path} holds the shard of tensor-parallel rank {ranks[0]}, pipeline-parallel rank {ranks[1]} (its "
                f"header says so), not of tensor-parallel rank {tensor_parallel_rank}, pipeline-parallel rank "
                f"{pipeline_parallel_rank}: the files were swapped or renamed. Rename each file after the ranks in "
                f"its header ({split_file_name(*ranks, True)}), or save the checkpoint again."
            )
    _verify_file(checkpoint.directory, name, records, SPLIT_INDEX_NAME)


def verify_merged_files(checkpoint: Checkpoint, context: ParallelContext) -> None:
    """Check the files of a merged oslo save against its manifest, each file on one rank (rank ``r`` hashes
    every ``world_size``-th file from the ``r``-th). A manifest that no longer describes the weights (rewritten
    by another program, e.g. transformers' ``save_pretrained``) is skipped with a warning."""
    manifest = checkpoint.manifest
    if manifest is None:
        return
    records = manifest["files"]
    current = set(records) == set(checkpoint.files)
    if current and checkpoint.kind == "safetensors":
        current = any(
            _safetensors_metadata(os.path.join(checkpoint.directory, name)).get("oslo_save_id") == manifest["save_id"]
            for name in checkpoint.files
        )
    if not current:
        if context.rank == 0:
            logger.warning(
                "%s does not describe the weights of %s (rewritten since oslo saved them?): they are not verified. "
                "Delete it, or save the checkpoint with oslo again.", MANIFEST_NAME, checkpoint.directory,
            )
        return
    for name in checkpoint.files[context.rank :: context.world_size]:
        _verify_file(checkpoint.directory, name, records, MANIFEST_NAME)


def resolve_key(name: str, keys: set[str], prefix: str) -> str | None:
    """Checkpoint key of parameter ``name``, allowing for the base-model prefix being on one side only."""
    if name in keys:
        return name
    if prefix and f"{prefix}.{name}" in keys:
        return f"{prefix}.{name}"
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in keys:
        return name[len(prefix) + 1 :]
    return None


def checkpoint_dtype(checkpoint: Checkpoint) -> torch.dtype | None:
    """dtype of the first floating-point tensor of a checkpoint (for ``dtype="auto"``)."""
    if checkpoint.kind == "split":
        for entry in checkpoint.split_index["tensors"].values():
            dtype = getattr(torch, entry["dtype"])
            if dtype.is_floating_point:
                return dtype
        return None
    source = TensorSource(checkpoint.directory, checkpoint.files[:1], checkpoint.kind)
    for key in sorted(source.keys()):
        if source.dtype(key).is_floating_point:
            return source.dtype(key)
    return None


def load_checkpoint(
    model: nn.Module,
    checkpoint: Checkpoint,
    init_missing: Callable[[str, ShardSpec | None, tuple[int, ...]], torch.Tensor],
    allow_vocab_resize: bool = False,
) -> dict[str, list]:
    """Fill ``model``'s (already allocated, local) parameters from ``checkpoint``, reading only this
    rank's slices. Runs on every rank; if any rank fails, all raise. Returns transformers' loading info (the
    same on every rank): ``missing_keys`` (newly initialized), ``unexpected_keys`` (unused), and
    ``mismatched_keys`` and ``error_msgs`` (always empty: a mismatch raises).

    Args:
        model: An oslo model whose parameters have their local shapes (e.g. after ``to_empty``).
        checkpoint: From :func:`inspect_checkpoint`.
        init_missing: ``init_missing(name, spec, global_shape)`` returns the local tensor for a
            parameter the checkpoint lacks (a new head) and the rows added by a vocabulary resize.
        allow_vocab_resize: The vocabulary dimension may differ from the checkpoint's.
    """
    context: ParallelContext = model.parallel_context
    keys, used, missing = run_on_all_ranks(
        context,
        lambda: _load_local(model, checkpoint, init_missing, allow_vocab_resize),
        f"loading {checkpoint.directory}",
    )
    # What is missing or unused is decided over all stages (each holds only its own layers), and
    # reported once.
    if context.pipeline_parallel_size > 1:
        stages: list = [None] * context.pipeline_parallel_size
        dist.all_gather_object(stages, (keys, used, missing), group=context.pipeline_parallel_group)
        keys = set().union(*(stage[0] for stage in stages))
        used = set().union(*(stage[1] for stage in stages))
        missing = [name for stage in stages for name in stage[2]]
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = sorted(k for k in keys - used if not any(p.search(k) for p in ignore))
    if missing and context.rank == 0:
        logger.warning("Newly initialized (not in %s): %s", checkpoint.directory, missing)
    if unexpected and context.rank == 0:
        logger.warning("Unused weights of %s: %s", checkpoint.directory, unexpected)
    return {"missing_keys": sorted(missing), "unexpected_keys": unexpected, "mismatched_keys": [], "error_msgs": []}


def _load_local(model, checkpoint, init_missing, allow_vocab_resize) -> tuple[set[str], set[str], list[str]]:
    """Load this rank's parameters; return (the checkpoint keys this rank saw, those it used, the
    parameters it initialized because the checkpoint lacks them)."""
    context: ParallelContext = model.parallel_context
    specs = parameter_specs(model)
    prefix = getattr(model, "base_model_prefix", "")
    twins = cross_stage_tied_weights(model)
    own = _own_split_file(model, checkpoint, prefix, twins) if checkpoint.kind == "split" and not allow_vocab_resize \
        else None
    if own is not None:  # saved at this layout and partition: this rank's file holds its tensors as they are
        verify_split_file(checkpoint, own, context.tensor_parallel_rank, context.pipeline_parallel_rank)
        source = TensorSource(checkpoint.directory, [own], "split")
    elif checkpoint.kind == "split":  # another layout: read this rank's slices out of the saved ones
        for name in checkpoint.files[context.rank :: context.world_size]:
            verify_split_file(checkpoint, name, *file_ranks(name))
        source = SplitSource(checkpoint)
    elif checkpoint.kind == "memory":
        source = _MemorySource(checkpoint.state_dict)
    else:
        verify_merged_files(checkpoint, context)
        source = TensorSource(checkpoint.directory, checkpoint.files, checkpoint.kind)
    keys = source.keys()
    used, missing = set(), []

    with torch.no_grad():
        for name, param in local_named_parameters(model):
            spec = specs[name]
            global_shape = spec.global_shape(param.shape) if spec is not None else tuple(param.shape)
            key = resolve_key(name, keys, prefix)
            if key is None and name in twins:  # lm_head.weight on the last stage: read the tied wte
                key = resolve_key(twins[name], keys, prefix)
            if key is None:
                missing.append(name)
                value = init_missing(name, spec, global_shape)
            elif own is not None:
                value = source.read(key)
                _check_shape(checkpoint, key, tuple(value.shape), tuple(param.shape), "local ")
            else:
                value = _read_shard(source, key, spec, global_shape, checkpoint, allow_vocab_resize,
                                    lambda a, b, n=name, s=spec, g=global_shape: _rows(init_missing(n, None, g),
                                                                                        s.dim, a, b))
            param.copy_(value)
            used.add(key)
    return keys, used, missing


def _own_split_file(model, checkpoint: Checkpoint, prefix: str, twins: dict[str, str]) -> str | None:
    """This rank's file of a split checkpoint saved at the model's layout, if it holds every tensor of the rank
    (else ``None``: another layout, or another assignment of layers to stages, reads through :class:`SplitSource`)."""
    context: ParallelContext = model.parallel_context
    if checkpoint.legacy or checkpoint.layout != (context.tensor_parallel_size, context.pipeline_parallel_size):
        return None
    own = split_file_name(context.tensor_parallel_rank, context.pipeline_parallel_rank,
                          checkpoint.files[0].endswith(".safetensors"))
    held = set(checkpoint.split_index["files"].get(own, ()))
    for name, _ in local_named_parameters(model):
        if resolve_key(name, held, prefix) is None and resolve_key(twins.get(name, name), held, prefix) is None:
            return None
    return own


def _rows(tensor: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    return tensor.narrow(dim, start, stop - start)


def _read_shard(source, key, spec, global_shape, checkpoint, allow_vocab_resize, fill) -> torch.Tensor:
    saved_shape = source.shape(key)
    if spec is None:
        _check_shape(checkpoint, key, saved_shape, global_shape)
        return source.read(key)
    resizable = allow_vocab_resize and spec.kind == VOCAB
    comparable = [d for d in range(len(global_shape)) if not (resizable and d == spec.dim)]
    if len(saved_shape) != len(global_shape) or any(saved_shape[d] != global_shape[d] for d in comparable):
        _check_shape(checkpoint, key, saved_shape, global_shape)
    return spec.shard(
        lambda start, stop: source.read(key, spec.dim, start, stop),
        available=saved_shape[spec.dim],
        fill=fill,
    )


def _check_shape(checkpoint, key, saved, expected, which: str = "") -> None:
    if tuple(saved) != tuple(expected):
        raise ValueError(
            f"{key!r} in {checkpoint.directory!r} has {which}shape {list(saved)}, but the model expects "
            f"{list(expected)}. The checkpoint does not match the config; check config.json (or pass "
            "resize_token_embeddings=N to change the vocabulary size)."
        )


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
#: Test hook: called as ``_publish_hook(step)`` at each step of a save, so tests can kill the process at every
#: instant that matters. Steps: "prepare" and "write" (every rank, after the staging folder is made and after the
#: rank's files are written), then on rank 0: "index" (index, manifest and config written), "link" (the target's
#: other files linked in), "aside" (rename fallback only: the target moved aside), "swap" (the new checkpoint in
#: place) and "cleanup" (the previous one removed).
_publish_hook: Callable[[str], None] | None = None

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def _reached(step: str) -> None:
    if _publish_hook is not None:
        _publish_hook(step)


def _save_paths(target: str) -> tuple[str, str, str]:
    """(parent, staging folder, aside folder) of a save to the absolute path ``target``."""
    parent, name = os.path.split(target)
    return parent, os.path.join(parent, f".{name}.oslo-saving"), os.path.join(parent, f".{name}.oslo-old")


def _exchange(a: str, b: str) -> None:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``). Raises ``OSError`` with
    ``ENOSYS`` or ``EINVAL`` where the system or the file system does not support it."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError) as exc:
        raise OSError(errno.ENOSYS, "renameat2 is not available") from exc
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), a, None, b)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # no hard links on this file system (or not allowed): copy
        shutil.copy2(source, destination)


def _carry_over(target: str, staging: str) -> None:
    """Hard-link (or copy) what ``target`` holds besides checkpoint files into ``staging``: a tokenizer, the
    user's subdirectories, a config the new save does not rewrite."""
    shutil.copymode(target, staging)
    for entry in os.scandir(target):
        destination = os.path.join(staging, entry.name)
        if entry.name == LEGACY_STAGING_NAME or os.path.lexists(destination):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), destination)
        elif entry.is_dir():
            shutil.copytree(entry.path, destination, symlinks=True, copy_function=_link_or_copy)
        elif not OWNED_FILE_RE.match(entry.name):
            _link_or_copy(entry.path, destination)


def _working_directory() -> str:
    """The process's working directory, or ``""`` where it was deleted."""
    try:
        return os.getcwd()
    except OSError:
        return ""


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)


class StagedSave:
    """One save to ``directory``: staged beside it, published atomically by rank 0.

    Every rank writes into ``<parent>/.<name>.oslo-saving``, and every step ends with an agreement of all ranks
    (:func:`run_on_all_ranks`): a failure anywhere fails the save everywhere, and rank 0 removes the staging
    folder, so the previous checkpoint stays as it was. Publishing, once every file is written and flushed to
    disk: rank 0 hard-links (or copies) the target's other files (a tokenizer, subdirectories) into the staging
    folder, exchanges the two directories in one ``renameat2(RENAME_EXCHANGE)``, and removes the staging path,
    which then holds the previous checkpoint. Killed at any instant, the target holds the complete previous
    checkpoint or the complete new one. Where the exchange is not supported (not Linux, or a file system without
    it), the target is renamed to ``<parent>/.<name>.oslo-old`` and the staging folder into its place: killed
    between the two renames, the target does not exist and loading it says where both copies are. The next save
    removes the leftovers of an interrupted one (after putting a previous checkpoint left aside back in place).
    Symbolic links to the target are resolved: the link keeps pointing at the new checkpoint.
    """

    def __init__(self, context: ParallelContext, directory: str) -> None:
        self.context = context
        self.target = os.path.realpath(directory)
        self.parent, self.staging, self.aside = _save_paths(self.target)
        # Read before any agreement: rank 0 publishes (and removes the previous checkpoint) as soon as the last
        # write step agreed, while another rank may not have reached publish() yet.
        self.cwd = _working_directory()
        self.step(self._prepare, "preparing to save to")
        _reached("prepare")

    def _prepare(self) -> None:
        if os.path.lexists(self.target) and not os.path.isdir(self.target):  # checked on every rank
            raise NotADirectoryError(
                f"cannot save to {self.target!r}: it is a file, not a directory. Pass a directory path."
            )
        if self.context.rank != 0:
            return
        if not os.path.lexists(self.target) and os.path.isdir(self.aside):
            os.rename(self.aside, self.target)  # a save killed between its two renames: the previous checkpoint
        _remove(self.aside)
        _remove(self.staging)
        os.makedirs(self.parent, exist_ok=True)
        try:
            os.mkdir(self.staging)
        except PermissionError as exc:
            raise PermissionError(
                f"cannot save to {self.target!r}: a save is staged beside its target, in {self.parent!r}, which is "
                "not writable. Make it writable, or save to a directory whose parent is."
            ) from exc

    def path(self, name: str) -> str:
        return os.path.join(self.staging, name)

    def step(self, step: Callable[[], object], what: str):
        """Run ``step`` on every rank; if it fails anywhere, remove the staging folder and raise everywhere."""
        try:
            return run_on_all_ranks(self.context, step, f"{what} {self.target}")
        except Exception:
            if self.context.rank == 0:
                shutil.rmtree(self.staging, ignore_errors=True)
            raise

    def gather(self, local: dict) -> dict:
        """The union of every rank's ``local`` dict (after a step that succeeded everywhere)."""
        if self.context.world_size == 1:
            return dict(local)
        parts: list = [None] * self.context.world_size
        dist.all_gather_object(parts, local, group=self.context.world_group)
        return {key: value for part in parts for key, value in part.items()}

    def publish(self) -> None:
        self.step(self._publish, "publishing")
        cwd = self.cwd
        if cwd == self.target or cwd.startswith(self.target + os.sep):
            os.chdir(cwd)  # the process was inside the previous checkpoint: move to the same path in the new one

    def _publish(self) -> None:
        if self.context.rank != 0:
            return
        for entry in os.scandir(self.staging):  # weight files are flushed by their writers already
            if entry.is_file():
                _fsync(entry.path)
        if not os.path.isdir(self.target):
            _fsync(self.staging)
            _reached("link")
            os.rename(self.staging, self.target)
            _fsync(self.parent)
            _reached("swap")
            _reached("cleanup")
            return
        _carry_over(self.target, self.staging)
        _fsync(self.staging)
        _reached("link")
        try:
            _exchange(self.staging, self.target)
            previous = self.staging
        except OSError as exc:
            if exc.errno not in _NO_EXCHANGE:
                raise
            os.rename(self.target, self.aside)
            _reached("aside")
            try:
                os.rename(self.staging, self.target)
            except BaseException:
                os.rename(self.aside, self.target)
                raise
            previous = self.aside
        _fsync(self.parent)
        _reached("swap")
        shutil.rmtree(previous)
        _reached("cleanup")


def _saved_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, ShardSpec | None]]:
    """Parameters to save, tied duplicates once (``named_parameters`` keeps the first owner)."""
    specs = parameter_specs(model)
    for name, param in local_named_parameters(model):
        yield name, param.detach(), specs[name]


@dataclass(frozen=True)
class _Entry:
    """A saved tensor as every rank of the pipeline sees it: which stage holds it, global shape, dtype."""

    stage: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    split: dict | None
    tied_copy: bool  # a tie target whose source lives on another stage (GPT2's lm_head.weight)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * getattr(torch, self.dtype).itemsize


def _pipeline_entries(model: nn.Module, local: list) -> list[_Entry]:
    """The saved tensors of every pipeline stage, in stage order (the same list on every rank)."""
    context: ParallelContext = model.parallel_context
    copies = cross_stage_tied_copies(model)
    mine = [
        _Entry(
            context.pipeline_parallel_rank, name, tuple(spec.global_shape(tensor.shape) if spec else tensor.shape),
            str(tensor.dtype).removeprefix("torch."),
            None if spec is None else {"kind": spec.kind, "dim": spec.dim, "chunks": spec.chunks},
            name in copies,
        )
        for name, tensor, spec in local
    ]
    if context.pipeline_parallel_size == 1:
        return mine
    stages: list[list[_Entry] | None] = [None] * context.pipeline_parallel_size
    dist.all_gather_object(stages, mine, group=context.pipeline_parallel_group)
    return [entry for stage in stages for entry in stage]


def _write(tensors: dict[str, torch.Tensor], path: str, safe_serialization: bool,
           save_function: Callable[[dict, str], None] | None = None, metadata: dict[str, str] | None = None) -> dict:
    """Write a weight file, flushed to disk, and return its ``{"size", "sha256"}``; ``metadata`` goes into a
    safetensors header (``.bin`` files have none)."""
    if safe_serialization:
        return write_safetensors(path, [(name, tensor.dtype, tuple(tensor.shape), lambda t=tensor: t)
                                        for name, tensor in tensors.items()], metadata)
    (save_function or torch.save)({name: tensor.contiguous() for name, tensor in tensors.items()}, path)
    return _file_digest(path, True)


_SAFETENSORS_DTYPES = {dtype: name for name, dtype in _DTYPES.items()}


def write_safetensors(path: str, tensors: list[tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]],
                      metadata: dict[str, str] | None = None) -> dict:
    """Write a safetensors file one tensor at a time: ``tensors`` lists ``(name, dtype, shape, make)`` and
    ``make()`` is called when the tensor's bytes are due, so only one tensor is in memory at a time. Returns the
    file's ``{"size", "sha256"}``, hashed as it is written; the file is flushed to disk (``fsync``).

    The bytes depend only on the tensors and ``metadata`` (``"format": "pt"`` added, as transformers expects): the
    header lists the metadata sorted and the tensors in file order, largest element size first then by name (each
    tensor aligned to its element size). safetensors' own ``save_file`` orders the metadata by hash, so two saves
    of the same tensors differ; these files are reproducible, and a resharded checkpoint is byte for byte the
    one a save at that layout writes.
    """
    order = sorted(tensors, key=lambda entry: (-entry[1].itemsize, entry[0]))
    header: dict = {"__metadata__": dict(sorted({"format": "pt", **(metadata or {})}.items()))}
    offset = 0
    for name, dtype, shape, _ in order:
        size = dtype.itemsize
        for extent in shape:
            size *= extent
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    sha = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(text).to_bytes(8, "little"), text):
            f.write(chunk)
            sha.update(chunk)
        for name, dtype, shape, make in order:
            tensor = make()
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{name!r} was announced as {dtype} {list(shape)} but is {tensor.dtype} "
                                 f"{list(tensor.shape)}")
            if tensor.numel():
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
                f.write(data)
                sha.update(data)
            del tensor
        f.flush()
        os.fsync(f.fileno())
    return {"size": 8 + len(text) + offset, "sha256": sha.hexdigest()}


def _save_config(model, directory: str) -> None:
    model.config.architectures = [type(model).__name__]
    model.config.dtype = next(model.parameters()).dtype
    model.config.save_pretrained(directory)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def save_split(model: nn.Module, directory: str, safe_serialization: bool = True, save_config: bool = True,
               save_function: Callable[[dict, str], None] | None = None) -> None:
    """Each model-parallel rank (of data-parallel replica 0) writes its local tensors to its own file, with its
    ranks in the file's header; the index records every file's ranks, size and SHA-256."""
    context: ParallelContext = model.parallel_context
    entries = list(_saved_parameters(model))
    everything = _pipeline_entries(model, entries)
    tp, pp = context.tensor_parallel_rank, context.pipeline_parallel_rank
    save = StagedSave(context, directory)

    def write() -> dict:
        if context.data_parallel_rank != 0:
            return {}
        name = split_file_name(tp, pp, safe_serialization)
        written = _write({n: t for n, t, _ in entries}, save.path(name), safe_serialization, save_function,
                         {"oslo_tensor_parallel_rank": str(tp), "oslo_pipeline_parallel_rank": str(pp)})
        digest = {"tensor_parallel_rank": tp, "pipeline_parallel_rank": pp, **written}
        _reached("write")
        return {name: digest}

    digests = save.gather(save.step(write, "writing"))

    def index() -> None:
        if context.rank != 0:
            return
        files = {
            split_file_name(t, p, safe_serialization): [e.name for e in everything if e.stage == p]
            for p in range(context.pipeline_parallel_size)
            for t in range(context.tensor_parallel_size)
        }
        tied = tied_keys(model)  # ties within rank 0's stage, and those across stages:
        families = tie_families(model)
        sources = {target: source for source, targets in families.items() for target in targets}
        tied.update({e.name: sources[e.name] for e in everything if e.tied_copy})
        write_split_index(save.path(SPLIT_INDEX_NAME), context.tensor_parallel_size, context.pipeline_parallel_size,
                          {e.name: {"shape": list(e.shape), "dtype": e.dtype, "split": e.split} for e in everything},
                          files, digests, tied)
        if save_config:
            _save_config(model, save.staging)
        _reached("index")

    save.step(index, "indexing")
    save.publish()


def write_split_index(path: str, tensor_parallel_size: int, pipeline_parallel_size: int, tensors: dict,
                      files: dict[str, list[str]], digests: dict[str, dict], tied: dict[str, str]) -> None:
    """``model_parallel.index.json``: the layout, every tensor's global shape, dtype and split, the tensors
    each file holds, each file's ranks, size and SHA-256, and the tied copies (``{copy: source}``)."""
    _write_json(path, {
        "format": "oslo-split",
        "version": 2,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "tensors": tensors,
        "files": files,
        "digests": digests,
        "tied": tied,
    })


def write_merged_records(directory: str, weight_map: dict[str, str], total: int, safe_serialization: bool,
                         save_id: str, digests: dict[str, dict]) -> None:
    """Beside a merged checkpoint's weight files: transformers' index when there are several files, and
    ``oslo_checkpoint.json`` (the save's id and each file's size and SHA-256)."""
    if len(set(weight_map.values())) > 1:
        index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
        _write_json(os.path.join(directory, index_name), {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(os.path.join(directory, MANIFEST_NAME),
                {"format": "oslo-merged", "version": 1, "save_id": save_id, "files": digests})


def merged_file_names(count: int, safe_serialization: bool = True) -> list[str]:
    """The weight files of a merged checkpoint of ``count`` shards, named as transformers names them."""
    weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    if count == 1:
        return [weights_name]
    stem, ext = weights_name.rsplit(".", 1)
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def tied_keys(model: nn.Module) -> dict[str, str]:
    """Each parameter name of ``model`` that is a tied copy, mapped to the first name of the same parameter."""
    owners: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owners:
            tied[name] = owners[id(param)]
        else:
            owners[id(param)] = name
    return tied


def save_merged(
    model: nn.Module,
    directory: str,
    safe_serialization: bool = True,
    max_shard_size: int = 5 * 10**9,
    save_config: bool = True,
    save_function: Callable[[dict, str], None] | None = None,
) -> None:
    """Write a plain Hugging Face checkpoint: every parameter gathered to rank 0, unpadded, unfused.

    Tensor-parallel shards are gathered on their stage's first tensor-parallel rank, which sends the
    full tensor on to rank 0 when the stage is not the first. Gathering streams one shard file at a
    time, so rank 0 holds at most one shard's worth of tensors. Weights tied across stages are saved
    once, as transformers does. ``oslo_checkpoint.json`` records the files' sizes and SHA-256 (hashed
    by rank 0 as it writes them) and each safetensors header the save's id.
    """
    context: ParallelContext = model.parallel_context
    saved = list(_saved_parameters(model))
    local = {name: (tensor, spec) for name, tensor, spec in saved}
    entries = [entry for entry in _pipeline_entries(model, saved) if not entry.tied_copy]
    shards = plan_shards(entries, max_shard_size, lambda entry: entry.nbytes)
    names = merged_file_names(len(shards), safe_serialization)
    first_tp = context.tensor_parallel_global_rank(0)
    writer = context.pipeline_parallel_global_rank(0) if context.tensor_parallel_rank == 0 else None
    device = next((p.device for p in model.parameters()), context.device)
    save = StagedSave(context, directory)
    save_id = uuid.uuid4().hex  # rank 0's is the one written

    def write() -> dict:
        if context.data_parallel_rank != 0:
            return {}
        failure, digests = None, {}
        for file_name, shard in zip(names, shards, strict=True):
            tensors = {}
            for entry in shard:
                full = None
                if entry.stage == context.pipeline_parallel_rank:
                    tensor, spec = local[entry.name]
                    if spec is None:
                        full = tensor
                    else:
                        parts = gather_to_first(tensor, context.tensor_parallel_group, first_tp)
                        full = spec.merge(parts) if parts is not None else None
                    if entry.stage != 0 and context.tensor_parallel_rank == 0:
                        dist.send(full.contiguous(), writer, group=context.pipeline_parallel_group)
                elif context.rank == 0:  # where rank 0's parameters are
                    full = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device=device)
                    dist.recv(full, context.pipeline_parallel_global_rank(entry.stage),
                              group=context.pipeline_parallel_group)
                if context.rank == 0:
                    tensors[entry.name] = full
            if context.rank == 0 and failure is None:
                try:  # after a failure, rank 0 still takes part in the gathers (the others would wait), writing nothing
                    digests[file_name] = _write(tensors, save.path(file_name), safe_serialization, save_function,
                                                {"oslo_save_id": save_id})
                except Exception as exc:  # noqa: BLE001 - raised once the gathers are over
                    failure = exc
        if failure is not None:
            raise failure
        _reached("write")
        return digests  # rank 0's: the files' sizes and SHA-256, hashed as they were written

    digests = save.step(write, "writing")

    def finish() -> None:
        if context.rank != 0:
            return
        weight_map = {entry.name: name for name, shard in zip(names, shards, strict=True) for entry in shard}
        write_merged_records(save.staging, weight_map, sum(entry.nbytes for entry in entries), safe_serialization,
                             save_id, digests)
        if save_config:
            _save_config(model, save.staging)
        _reached("index")

    save.step(finish, "indexing")
    save.publish()


def whole_tensor(local: torch.Tensor, spec: ShardSpec | None, context: ParallelContext) -> torch.Tensor:
    """The whole tensor (transformers' shape, unpadded) of which ``local`` is this rank's part, on every rank of the
    tensor-parallel group (collective over it when the tensor is split: every rank calls it in the same order)."""
    return _gathered(local, spec, context.tensor_parallel_group)


def _gathered(local: torch.Tensor, spec: ShardSpec | None, group) -> torch.Tensor:
    """:func:`whole_tensor` over ``group``, the tensor-parallel group of ``spec``'s ranks."""
    if spec is None:
        return local
    if spec.world_size == 1:
        return spec.merge([local])
    staged = through_cpu(local, group)
    source = (local.cpu() if staged else local).contiguous()
    parts = [torch.empty_like(source) for _ in range(spec.world_size)]
    dist.all_gather(parts, source, group=group)
    whole = spec.merge(parts)
    return whole.to(local.device) if staged else whole


def _whole_module_state_dict(module: nn.Module, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
    """``module.state_dict()`` of a module of one's own built from oslo's layers, every split parameter whole
    (gathered over its layer's tensor-parallel group, in the modules' order: every rank calls it)."""
    split = {}  # a split parameter's every name -> (the parameter, its spec, its layer's group)
    for layer_name, layer in module.named_modules(remove_duplicate=False):
        for name, spec in getattr(layer, "parallel_specs", {}).items():
            param = layer._parameters.get(name)
            if spec is not None and param is not None:
                split[f"{layer_name}.{name}" if layer_name else name] = (param, spec, layer.group)
    state = nn.Module.state_dict(module, destination=destination, prefix=prefix, keep_vars=keep_vars)
    for name, (param, spec, group) in split.items():
        if prefix + name in state:
            local = param._oslo_storage if isinstance(param, DTensor) else param.detach()
            state[prefix + name] = _gathered(local, spec, group)
    return state


def whole_state_dict(model: nn.Module, split: str | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict on every rank, as transformers' model of one process returns it: every
    parameter's name (tied ones included, several names for one tensor), whole tensors in transformers' shapes
    (gathered over the tensor-parallel group, unpadded, and broadcast from the stage that holds them). Collective
    over all ranks of the model, which call it in the same order; each rank ends up holding the whole model, or,
    with ``split`` (a kind of :class:`~oslo.parallel.plan.ShardSpec`: ``"vocab"``), the tensors split that way."""
    context: ParallelContext = model.parallel_context
    saved = list(_saved_parameters(model))
    duplicates = tied_keys(model)
    aliases = {**duplicates, **cross_stage_tied_copies(model)}  # this stage's other names of a tensor
    if split is not None:  # an alias is a parameter of this stage, under its first name or its own
        kinds = {name: None if spec is None else spec.kind for name, _, spec in saved}
        saved = [entry for entry in saved if kinds[entry[0]] == split]
        aliases = {name: source for name, source in aliases.items() if kinds[duplicates.get(name, name)] == split}
    local = {name: (tensor, spec) for name, tensor, spec in saved}
    device = next((p.device for p in model.parameters()), context.device)
    if context.pipeline_parallel_size > 1:
        stages: list[dict | None] = [None] * context.pipeline_parallel_size
        dist.all_gather_object(stages, aliases, group=context.pipeline_parallel_group)
        aliases = {name: source for stage in stages for name, source in stage.items()}
    whole: dict[str, torch.Tensor] = {}
    for entry in _pipeline_entries(model, saved):
        if entry.tied_copy:
            continue
        if entry.stage == context.pipeline_parallel_rank:
            full = whole_tensor(*local[entry.name], context)
        else:  # where this stage's parameters are
            full = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device=device)
        if context.pipeline_parallel_size > 1:
            full = full.contiguous()
            dist.broadcast(full, context.pipeline_parallel_global_rank(entry.stage),
                           group=context.pipeline_parallel_group)
        whole[entry.name] = full
    while aliases:  # a tie's other names (a cross-stage copy's source may itself be another name's copy)
        resolved = {name: whole[source] for name, source in aliases.items() if source in whole}
        if not resolved:
            raise RuntimeError(f"oslo: tied weights without a saved source: {sorted(aliases.items())}")
        whole.update(resolved)
        aliases = {name: source for name, source in aliases.items() if name not in resolved}
    return whole


@contextlib.contextmanager
def save_tensor_parallel(model: nn.Module) -> Iterator[nn.Module]:
    """A context in which ``model`` (an oslo model, split or not) saves as if it had never been split, as the
    ``tensor_parallel`` library's context of this name does:

    - ``model.state_dict()`` returns the whole model as transformers' model of one process returns it (every name,
      tied ones included, whole tensors in transformers' shapes: :func:`whole_state_dict`), on every rank, so
      every rank calls it; ``torch.save(model.state_dict(), path)`` on one rank then writes what transformers'
      ``load_state_dict`` takes;
    - ``model.save_pretrained(directory)`` writes a plain transformers checkpoint (the merged save of
      :meth:`~oslo.models.base.OsloPreTrainedModel.save_pretrained_with_parallel`: every rank calls it, rank 0
      writes), with or without ``is_main_process``.

    Outside the context both are as before (this rank's DTensors; ``save_pretrained`` asking for
    ``is_main_process``).

    ``model`` may also be a module of one's own built from :mod:`oslo.parallel`'s layers: inside the context its
    ``state_dict()`` holds every split parameter whole (gathered over its layer's tensor-parallel group; every rank
    calls it), under the module's own names."""
    if not hasattr(type(model), "save_pretrained_with_parallel"):
        if not isinstance(model, nn.Module) or not any(hasattr(m, "parallel_specs") for m in model.modules()):
            raise TypeError(
                f"save_tensor_parallel takes an oslo model (what from_pretrained_with_parallel, "
                f"from_config_with_parallel or oslo.initialize returned) or a module of your own built from "
                f"oslo.parallel's layers, got {type(model).__name__}: unwrap it first (DDP's .module, PEFT's "
                "get_base_model())."
            )
        previous = model.__dict__.get("state_dict")  # an instance attribute shadows the class's method
        model.__dict__["state_dict"] = functools.partial(_whole_module_state_dict, model)
        try:
            yield model
        finally:
            if previous is None:
                del model.__dict__["state_dict"]
            else:
                model.__dict__["state_dict"] = previous
        return
    depth = model.__dict__.get("_oslo_saving_whole", 0)
    model.__dict__["_oslo_saving_whole"] = depth + 1
    try:
        yield model
    finally:
        model.__dict__["_oslo_saving_whole"] = depth


def saving_whole(model: nn.Module) -> bool:
    """Whether ``model`` is inside :func:`save_tensor_parallel`."""
    return model.__dict__.get("_oslo_saving_whole", 0) > 0


def plan_shards(entries: list, max_shard_size: int, nbytes: Callable[[object], int]) -> list[list]:
    """``entries`` in order, cut into files of at most ``max_shard_size`` bytes (``nbytes(entry)`` each; a larger
    tensor gets a file of its own), as transformers shards a checkpoint."""
    shards, current, current_size = [], [], 0
    for entry in entries:
        if current and current_size + nbytes(entry) > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(entry)
        current_size += nbytes(entry)
    shards.append(current)
    return shards
