"""Checkpoint files carry their identity (ranks, size, SHA-256); legacy .bin files load, pickle payloads do not."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open

import oslo
from oslo import checkpoint as ckpt
from oslo.parallel.comm import RankFailedError
from tests.distributed import run_distributed
from tests.helpers import save_reference, tiny_gpt2_config

INPUT_IDS = torch.tensor([[5, 17, 900, 3, 44, 1000, 8]])
TP0, TP1 = "model_tp=0_pp=0.safetensors", "model_tp=1_pp=0.safetensors"


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return str(path)


@pytest.fixture(scope="module")
def reference_logits(lm_checkpoint):
    return transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint).eval()(INPUT_IDS).logits


def _save(rank, world_size, source, target, **options):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(source, tensor_parallel_size=world_size)
    model.save_pretrained_with_parallel(target, **options)


@pytest.fixture(scope="module")
def saved(lm_checkpoint, tmp_path_factory):
    """A split (tp=2), a split .bin (tp=2) and a merged checkpoint in 3 shard files, saved by oslo."""
    root = tmp_path_factory.mktemp("saved")
    run_distributed(_save, 2, lm_checkpoint, str(root / "split"))
    run_distributed(_save, 2, lm_checkpoint, str(root / "split-bin"), safe_serialization=False)
    run_distributed(_save, 2, lm_checkpoint, str(root / "merged"), save_with_merging=True, max_shard_size="60KB")
    return root


def _copy(saved, kind, tmp_path):
    return shutil.copytree(saved / kind, tmp_path / kind)


def _load_logits(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    return model(INPUT_IDS).logits


def _expect(rank, world_size, path, fragments):
    """Loading fails on this rank with every fragment in the message; returns (error type, message)."""
    with pytest.raises((OSError, RankFailedError)) as info:
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"
    return type(info.value).__name__, str(info.value)


def test_split_files_record_their_ranks_size_and_digest(saved):
    index = json.loads((saved / "split" / ckpt.SPLIT_INDEX_NAME).read_text())
    assert index["version"] == 2
    for tp, name in enumerate((TP0, TP1)):
        data = (saved / "split" / name).read_bytes()
        assert index["digests"][name] == {"tensor_parallel_rank": tp, "pipeline_parallel_rank": 0,
                                          "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        with safe_open(str(saved / "split" / name), "pt") as f:
            assert f.metadata() == {"format": "pt", "oslo_tensor_parallel_rank": str(tp),
                                    "oslo_pipeline_parallel_rank": "0"}


def test_swapped_split_files_fail_every_rank_naming_the_file(saved, tmp_path):
    path = _copy(saved, "split", tmp_path)
    os.rename(path / TP0, path / "x")
    os.rename(path / TP1, path / TP0)
    os.rename(path / "x", path / TP1)
    errors = run_distributed(_expect, 2, str(path), ["swapped or renamed"])
    for rank, (kind, message) in enumerate(errors):  # each rank names the file it reads
        assert kind == "OSError" and f"{path / (TP0, TP1)[rank]} holds the shard of tensor-parallel rank " \
            f"{1 - rank}" in message


def test_swapped_bin_split_files_are_named_by_their_digest(saved, tmp_path):
    path = _copy(saved, "split-bin", tmp_path)
    first, second = (path / f"pytorch_model_tp={t}_pp=0.bin" for t in (0, 1))
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)
    errors = run_distributed(_expect, 2, str(path), ["swapped or renamed"])
    assert f"{first} holds the content model_parallel.index.json records for {second.name}" in errors[0][1]


@pytest.mark.parametrize("damage", ["byte", "truncate"])
def test_damaged_split_file_fails_every_rank_naming_the_file(saved, tmp_path, damage):
    path = _copy(saved, "split", tmp_path)
    victim = path / TP1
    data = bytearray(victim.read_bytes())
    if damage == "byte":
        data[-10] ^= 0x01  # a bit of a weight: the file still parses
    else:
        data = data[:-100]
    victim.write_bytes(bytes(data))
    fragment = "changed since it was saved" if damage == "byte" else "truncated or corrupt"
    errors = run_distributed(_expect, 2, str(path), [str(victim), fragment])
    assert [kind for kind, _ in errors] == ["RankFailedError", "OSError"]


def test_missing_split_file_fails_every_rank_naming_it(saved, tmp_path):
    path = _copy(saved, "split", tmp_path)
    os.remove(path / TP0)
    errors = run_distributed(_expect, 2, str(path), [f"names ['{TP0}'], which does not exist"])
    assert [kind for kind, _ in errors] == ["FileNotFoundError", "FileNotFoundError"]


def test_split_index_version_1_without_digests_still_loads(saved, tmp_path, reference_logits):
    path = _copy(saved, "split", tmp_path)
    index = json.loads((path / ckpt.SPLIT_INDEX_NAME).read_text())
    del index["digests"]
    index["version"] = 1
    (path / ckpt.SPLIT_INDEX_NAME).write_text(json.dumps(index))
    torch.testing.assert_close(run_distributed(_load_logits, 2, str(path))[0], reference_logits)


def test_merged_save_writes_a_manifest(saved):
    manifest = json.loads((saved / "merged" / ckpt.MANIFEST_NAME).read_text())
    shards = sorted(n for n in os.listdir(saved / "merged") if n.endswith(".safetensors"))
    assert len(shards) == 3 and sorted(manifest["files"]) == shards
    for name in shards:
        data = (saved / "merged" / name).read_bytes()
        assert manifest["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        with safe_open(str(saved / "merged" / name), "pt") as f:
            assert f.metadata() == {"format": "pt", "oslo_save_id": manifest["save_id"]}


def _hashed_while_loading(rank, world_size, path):
    hashed = []
    digest = ckpt._file_digest
    ckpt._file_digest = lambda file, *args: hashed.append(os.path.basename(file)) or digest(file, *args)
    oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    return hashed


def test_merged_files_are_verified_once_each_spread_over_the_ranks(saved):
    hashed = run_distributed(_hashed_while_loading, 2, str(saved / "merged"))
    shards = sorted(n for n in os.listdir(saved / "merged") if n.endswith(".safetensors"))
    assert hashed == [shards[0::2], shards[1::2]]


@pytest.mark.parametrize("damage", ["byte", "truncate", "swap"])
def test_damaged_merged_file_fails_every_rank_naming_the_file(saved, tmp_path, damage):
    path = _copy(saved, "merged", tmp_path)
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    victim = path / shards[1]  # verified by rank 1
    data = bytearray(victim.read_bytes())
    if damage == "byte":
        data[-10] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-8]))
    else:
        shutil.copy(path / shards[2], victim)  # the content of another shard under this name
    fragment = {"byte": "changed since it was saved", "truncate": "truncated or corrupt",
                "swap": f"holds the content {ckpt.MANIFEST_NAME} records for {shards[2]}"}[damage]
    errors = run_distributed(_expect, 2, str(path), [str(victim)])  # rank 0 fails too when it reads the file
    assert errors[1][0] == "OSError" and fragment in errors[1][1]


def _load_and_log(rank, world_size, path):
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("oslo.checkpoint").addHandler(handler)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    return model(INPUT_IDS).logits, records


def test_merged_checkpoint_rewritten_by_transformers_still_loads(saved, tmp_path, lm_checkpoint):
    """A stale manifest (transformers' save_pretrained rewrote the weights beside it) is not held against
    the new weights: they load, with a warning."""
    path = _copy(saved, "merged", tmp_path)
    other = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    for name in os.listdir(path):
        if name.startswith("model"):
            os.remove(path / name)
    other.save_pretrained(path, max_shard_size="60KB")
    assert (path / ckpt.MANIFEST_NAME).exists()
    results = run_distributed(_load_and_log, 2, str(path))
    torch.testing.assert_close(results[0][0], other.eval()(INPUT_IDS).logits)
    assert any("oslo_checkpoint.json does not describe the weights" in r for r in results[0][1])
    assert results[1][1] == []


# ---- .bin files ---------------------------------------------------------------------------
def _bin_checkpoint(lm_checkpoint, directory, state, **save_options):
    os.makedirs(directory)
    shutil.copy(os.path.join(lm_checkpoint, "config.json"), directory)
    torch.save(state, os.path.join(directory, "pytorch_model.bin"), **save_options)
    return str(directory)


def test_legacy_bin_checkpoint_loads(lm_checkpoint, tmp_path, reference_logits):
    state = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint).state_dict()
    path = _bin_checkpoint(lm_checkpoint, tmp_path / "legacy", state, _use_new_zipfile_serialization=False)
    assert not open(os.path.join(path, "pytorch_model.bin"), "rb").read(4).startswith(b"PK")
    hf_logits = transformers.GPT2LMHeadModel.from_pretrained(path).eval()(INPUT_IDS).logits  # as transformers does
    torch.testing.assert_close(hf_logits, reference_logits)
    torch.testing.assert_close(run_distributed(_load_logits, 2, path)[0], reference_logits)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_bin_pickle_payload_is_refused_as_code(lm_checkpoint, tmp_path, legacy):
    marker = tmp_path / "executed"
    state = dict(transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint).state_dict(), evil=_Payload(str(marker)))
    path = _bin_checkpoint(lm_checkpoint, tmp_path / "ckpt", state, _use_new_zipfile_serialization=not legacy)
    errors = run_distributed(_expect, 2, path, ["pytorch_model.bin is refused: it would execute code",
                                                f"GLOBAL {open.__module__}.open",  # io (3.11), _io (3.12)
                                                "nothing was executed"])
    assert all("corrupt" not in message for _, message in errors)
    assert not marker.exists()


def test_truncated_legacy_bin_is_corrupt_not_code(lm_checkpoint, tmp_path):
    state = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint).state_dict()
    path = _bin_checkpoint(lm_checkpoint, tmp_path / "legacy", state, _use_new_zipfile_serialization=False)
    weights = os.path.join(path, "pytorch_model.bin")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])
    errors = run_distributed(_expect, 2, path, ["pytorch_model.bin", "truncated or corrupt"])
    assert all("execute code" not in message for _, message in errors)
