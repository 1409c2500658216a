"""Publishing a save atomically: killed at any step, the target holds the complete old or new checkpoint."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time

import pytest
import torch
import transformers

import oslo
from oslo import checkpoint as ckpt
from tests.distributed import RankError, run_distributed
from tests.helpers import full_params, tiny_gpt2_config

OLD_SEED, NEW_SEED = 1, 2
USER_FILES = {"tokenizer.json": "{\"user\": 1}", os.path.join("extra", "notes.txt"): "kept"}
STEPS = ["prepare", "write", "index", "link", "swap", "cleanup"]


def _model(seed, world_size):
    return oslo.GPT2LMHeadModel.from_config_with_parallel(tiny_gpt2_config(), tensor_parallel_size=world_size,
                                                          seed=seed, timeout=30)


def _save(rank, world_size, seed, target, merged, kill_at=None, no_exchange=False):
    """Save the model of ``seed``; with ``kill_at``, rank 0 SIGKILLs itself when the save reaches that step."""
    model = _model(seed, world_size)
    if kill_at is not None:
        ckpt._publish_hook = lambda step: os.kill(os.getpid(), signal.SIGKILL) if step == kill_at and rank == 0 \
            else None
    if no_exchange:  # a file system without renameat2(RENAME_EXCHANGE)
        def unsupported(a, b):
            raise OSError(errno.EINVAL, "Invalid argument")
        ckpt._exchange = unsupported
    model.save_pretrained_with_parallel(target, save_with_merging=merged, max_shard_size="100KB")


def _oslo_weights(rank, world_size, path):
    """The full weights oslo loads from ``path`` at tp=2, or the error it raises (type, message)."""
    try:
        model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size, timeout=30)
    except Exception as exc:  # noqa: BLE001 - the caller judges the error
        return type(exc).__name__, str(exc)
    return full_params(model)


def _full_weights(rank, world_size, seed):
    return full_params(_model(seed, world_size))


@pytest.fixture(scope="module")
def references():
    return {seed: run_distributed(_full_weights, 1, seed)[0] for seed in (OLD_SEED, NEW_SEED)}


@pytest.fixture(scope="module")
def old_checkpoints(tmp_path_factory):
    """The previous checkpoint (split and merged, tp=2), with a user's tokenizer and subdirectory beside it."""
    root = tmp_path_factory.mktemp("old")
    for kind in ("split", "merged"):
        run_distributed(_save, 2, OLD_SEED, str(root / kind), kind == "merged")
        for name, text in USER_FILES.items():
            os.makedirs(os.path.dirname(root / kind / name), exist_ok=True)
            (root / kind / name).write_text(text)
    return root


def _which(weights, references):
    """"old", "new" or "MIX" for full weights; the error for an error."""
    if isinstance(weights, tuple):
        return weights
    for seed, name in ((OLD_SEED, "old"), (NEW_SEED, "new")):
        if weights.keys() == references[seed].keys() and all(torch.equal(weights[k], references[seed][k])
                                                             for k in weights):
            return name
    return "MIX"


def _transformers_weights(path):
    try:
        model = transformers.GPT2LMHeadModel.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _transformers_which(path, references):
    weights = _transformers_weights(path)
    if not isinstance(weights, tuple):
        weights = {name: weights[name] for name in references[OLD_SEED]}
    return _which(weights, references)


def _user_files_intact(path):
    return all(os.path.isfile(os.path.join(path, n)) and open(os.path.join(path, n)).read() == text
               for n, text in USER_FILES.items())


def _leftovers(tmp_path):
    return sorted(n for n in os.listdir(tmp_path) if n.startswith("."))


@pytest.mark.parametrize("old_kind,merged", [("split", False), ("split", True)], ids=["split", "merged-over-split"])
@pytest.mark.parametrize("step", STEPS)
def test_killed_save_leaves_old_or_new_checkpoint(old_checkpoints, references, tmp_path, old_kind, merged, step):
    target = tmp_path / "ckpt"
    shutil.copytree(old_checkpoints / old_kind, target)
    with pytest.raises(RankError, match="exited without a result"):
        run_distributed(_save, 2, NEW_SEED, str(target), merged, step, timeout=60)
    expected = "new" if step in ("swap", "cleanup") else "old"
    assert _which(run_distributed(_oslo_weights, 2, str(target), timeout=60)[0], references) == expected
    if merged and expected == "new":  # plain transformers reads the merged checkpoint
        assert _transformers_which(str(target), references) == "new"
    assert _user_files_intact(target)
    if step == "cleanup":
        assert _leftovers(tmp_path) == []
    # The next save removes the leftovers and publishes.
    run_distributed(_save, 2, NEW_SEED, str(target), merged, timeout=60)
    assert _leftovers(tmp_path) == []
    assert _which(run_distributed(_oslo_weights, 2, str(target), timeout=60)[0], references) == "new"
    assert _user_files_intact(target)
    owned = sorted(n for n in os.listdir(target) if ckpt.OWNED_FILE_RE.match(n))
    assert all(("_tp=" in n) != merged for n in owned if n.endswith(".safetensors")), owned  # no stale format


def _save_killed_after_renames(rank, world_size, seed, target, merged, renames):
    """Rank 0 SIGKILLs itself right after the save's ``renames``-th rename (``os.replace``, ``os.rename`` or
    the directory exchange): a kill between the steps of publishing, however a save publishes."""
    model = _model(seed, world_size)
    done = []

    def killing(rename):
        def call(*args, **kwargs):
            result = rename(*args, **kwargs)
            done.append(args)
            if rank == 0 and len(done) == renames:
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        return call

    os.replace, os.rename = killing(os.replace), killing(os.rename)
    if hasattr(ckpt, "_exchange"):
        ckpt._exchange = killing(ckpt._exchange)
    model.save_pretrained_with_parallel(target, save_with_merging=merged)


@pytest.mark.parametrize("renames", [1, 2, 3])
@pytest.mark.parametrize("old_kind,merged", [("split", False), ("split", True)], ids=["split", "merged-over-split"])
def test_kill_between_renames_never_mixes(old_checkpoints, references, tmp_path, old_kind, merged, renames):
    """The issue's case: publishing one os.replace at a time, a kill between two left new and old files side by
    side (split: tp=0 new, tp=1 old; merged over split: both formats), and readers loaded the mix."""
    target = tmp_path / "ckpt"
    shutil.copytree(old_checkpoints / old_kind, target)
    old_files = sorted(os.listdir(target))
    try:
        run_distributed(_save_killed_after_renames, 2, NEW_SEED, str(target), merged, renames, timeout=60)
    except RankError as error:  # killed; with fewer renames than `renames`, the save completes
        assert "exited without a result" in str(error)
    found = _which(run_distributed(_oslo_weights, 2, str(target), timeout=60)[0], references)
    assert found in ("old", "new")
    owned = sorted(n for n in os.listdir(target) if ckpt.OWNED_FILE_RE.match(n))
    if found == "old":
        assert owned == [n for n in old_files if ckpt.OWNED_FILE_RE.match(n)]
    elif merged:  # only the merged files: no split index left to take precedence for oslo
        assert owned == ["model.safetensors", ckpt.MANIFEST_NAME]
        assert _transformers_which(str(target), references) == "new"


@pytest.mark.parametrize("step", ["link", "aside", "swap", "cleanup"])
def test_rename_fallback_killed_between_renames_errors_clearly(old_checkpoints, references, tmp_path, step):
    """Without RENAME_EXCHANGE the target is missing between the two renames: loading says where both
    copies are, and the next save puts the previous checkpoint back before saving."""
    target = tmp_path / "ckpt"
    shutil.copytree(old_checkpoints / "merged", target)
    with pytest.raises(RankError, match="exited without a result"):
        run_distributed(_save, 2, NEW_SEED, str(target), True, step, True, timeout=60)
    if step == "aside":
        kind, message = run_distributed(_oslo_weights, 2, str(target), timeout=60)[0]
        assert kind == "FileNotFoundError"
        assert "interrupted while it replaced the checkpoint" in message
        assert f".ckpt.oslo-old' and the new one in '{os.path.realpath(tmp_path)}/.ckpt.oslo-saving'" in message
        assert _transformers_which(str(target), references)[0] == "OSError"
        assert _which(run_distributed(_oslo_weights, 2, str(tmp_path / ".ckpt.oslo-old"))[0], references) == "old"
        assert _which(run_distributed(_oslo_weights, 2, str(tmp_path / ".ckpt.oslo-saving"))[0], references) == "new"
    else:
        expected = "old" if step == "link" else "new"
        assert _which(run_distributed(_oslo_weights, 2, str(target), timeout=60)[0], references) == expected
        assert _transformers_which(str(target), references) == expected
        assert _user_files_intact(target)
    run_distributed(_save, 2, NEW_SEED, str(target), True, None, True, timeout=60)
    assert _leftovers(tmp_path) == []
    assert _which(run_distributed(_oslo_weights, 2, str(target), timeout=60)[0], references) == "new"
    assert _user_files_intact(target)  # put back from the aside copy when the kill left none in place


def test_interrupted_first_save_says_nothing_was_published(references, tmp_path):
    target = tmp_path / "fresh"
    with pytest.raises(RankError, match="exited without a result"):
        run_distributed(_save, 2, NEW_SEED, str(target), False, "index", timeout=60)
    kind, message = run_distributed(_oslo_weights, 2, str(target), timeout=60)[0]
    assert kind == "FileNotFoundError" and "interrupted before it finished, so nothing was published" in message


def _save_through_symlink_from_inside(rank, world_size, link):
    os.chdir(link)  # a process working inside the checkpoint directory
    _save(rank, world_size, NEW_SEED, link, False)
    return os.listdir(".")


def _save_from_inside_arriving_late(rank, world_size, link):
    """As above, but rank 1 reaches publish() a second after rank 0, which has published and removed the
    previous checkpoint (rank 1's working directory) by then."""
    if rank == 1:
        publish = ckpt.StagedSave.publish

        def late(self):
            time.sleep(1.0)
            publish(self)

        ckpt.StagedSave.publish = late
    return _save_through_symlink_from_inside(rank, world_size, link)


@pytest.mark.parametrize("arrival", ["together", "rank 1 late"])
def test_symlinked_target_and_working_directory_follow_the_new_checkpoint(old_checkpoints, references, tmp_path,
                                                                          arrival):
    real = tmp_path / "runs" / "ckpt"
    shutil.copytree(old_checkpoints / "merged", real)
    os.symlink(real, tmp_path / "latest")
    fn = _save_through_symlink_from_inside if arrival == "together" else _save_from_inside_arriving_late
    listed = run_distributed(fn, 2, str(tmp_path / "latest"), timeout=60)
    assert os.path.islink(tmp_path / "latest")
    assert ckpt.SPLIT_INDEX_NAME in listed[0] and ckpt.SPLIT_INDEX_NAME in listed[1]
    assert _which(run_distributed(_oslo_weights, 2, str(tmp_path / "latest"), timeout=60)[0], references) == "new"
    assert _leftovers(tmp_path / "runs") == []


def _save_to_file(rank, world_size, path):
    with pytest.raises(NotADirectoryError, match="it is a file, not a directory"):
        _save(rank, world_size, NEW_SEED, path, False)


def test_save_to_a_file_is_refused_on_every_rank(tmp_path):
    (tmp_path / "file").write_text("x")
    run_distributed(_save_to_file, 2, str(tmp_path / "file"), timeout=60)


def test_fault_script_quick_variant(tmp_path):
    """A few runs of benchmarks/publish_faults.py: external SIGKILLs at random instants, never a mix."""
    from benchmarks import publish_faults

    counts = publish_faults.run(runs=4, seed=0, directory=str(tmp_path))
    assert sum(counts["oslo"].values()) == 4
    assert counts["oslo"].get("MIX", 0) == 0 and counts["transformers"].get("MIX", 0) == 0
    assert counts["oslo"].get("LOST", 0) == 0


def _merged_save_failing_on_rank_0(rank, world_size, target):
    model = _model(NEW_SEED, world_size)
    original = ckpt._write

    def failing_write(tensors, path, *args):
        if rank == 0:
            raise OSError("disk full (simulated)")
        return original(tensors, path, *args)

    ckpt._write = failing_write
    model.save_pretrained_with_parallel(target, save_with_merging=True, max_shard_size="100KB")


def test_merged_save_failing_on_its_writer_fails_every_rank_and_keeps_the_checkpoint(old_checkpoints, tmp_path):
    """Rank 0 fails writing the first of several shards while rank 1 still has shards to gather: rank 0 keeps
    taking part in the gathers, then every rank raises; the previous checkpoint is untouched."""
    target = tmp_path / "ckpt"
    shutil.copytree(old_checkpoints / "merged", target)
    before = {n: (target / n).read_bytes() for n in os.listdir(target) if (target / n).is_file()}
    with pytest.raises(RankError, match="disk full") as info:
        run_distributed(_merged_save_failing_on_rank_0, 2, str(target), timeout=60)
    assert "writing" in str(info.value) or "rank 0 failed" in str(info.value)
    assert {n: (target / n).read_bytes() for n in os.listdir(target) if (target / n).is_file()} == before
    assert _leftovers(tmp_path) == []
