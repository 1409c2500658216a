"""Hub names in from_pretrained_with_parallel, resolved through a Hugging Face cache built here (no network:
HF_HUB_OFFLINE=1 from tests/conftest.py), in huggingface_hub's layout: ``models--org--name/refs/<branch>``
holding a commit hash, ``snapshots/<commit>/<file>`` linked to ``blobs/<sha256>``, and optionally the file list
huggingface_hub keeps of a commit (``trees/<commit>.json``)."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import socket
import time

import huggingface_hub
import pytest
import torch
import transformers

import oslo
from oslo import hub
from tests.distributed import run_distributed
from tests.helpers import save_reference, tiny_gpt2_config

INPUT_IDS = torch.tensor([[5, 17, 900, 3, 44, 1000, 8]])
COMMIT_A = hashlib.sha1(b"a").hexdigest()
COMMIT_B = hashlib.sha1(b"b").hexdigest()


def put_in_cache(cache, repo_id, commit, source, refs=("main",), subfolder="", listed=None):
    """Put the files of directory ``source`` in ``cache`` as huggingface_hub stores a download of ``repo_id`` at
    ``commit`` (under ``subfolder`` of the repository), with ``refs`` pointing at it; ``listed``: also write the
    repository's file list as huggingface_hub >= 2 keeps it (``trees/<commit>.json``)."""
    storage = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    target = os.path.join(storage, "snapshots", commit, subfolder)
    os.makedirs(target, exist_ok=True)
    os.makedirs(os.path.join(storage, "blobs"), exist_ok=True)
    for name in sorted(os.listdir(source)):
        with open(os.path.join(source, name), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        blob = os.path.join(storage, "blobs", digest)
        shutil.copyfile(os.path.join(source, name), blob)
        os.symlink(os.path.relpath(blob, target), os.path.join(target, name))
    for ref in refs:
        os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
        with open(os.path.join(storage, "refs", ref), "w") as f:
            f.write(commit)  # no newline: huggingface_hub reads the file as is
    if listed is not None:
        os.makedirs(os.path.join(storage, "trees"), exist_ok=True)
        files = {path: {"size": 1, "blob_id": hashlib.sha1(path.encode()).hexdigest()} for path in listed}
        with open(os.path.join(storage, "trees", f"{commit}.json"), "w") as f:
            json.dump({"format_version": 1, "files": files}, f)
    return os.path.join(storage, "snapshots", commit)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two tiny GPT2 checkpoints with different weights (seeds 0 and 1), and their transformers logits."""
    root = tmp_path_factory.mktemp("hub-sources")
    out = {}
    for seed in (0, 1):
        path = str(root / f"seed{seed}")
        model = save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path, seed=seed)
        with torch.no_grad():
            out[seed] = (path, model(INPUT_IDS).logits)
    return out


@pytest.fixture(scope="module")
def cache(sources, tmp_path_factory):
    """A cache holding ``org/name`` and ``gpt2`` (seed 0) at COMMIT_A on main."""
    cache = str(tmp_path_factory.mktemp("hub-cache"))
    for repo_id in ("org/name", "gpt2"):
        put_in_cache(cache, repo_id, COMMIT_A, sources[0][0])
    return cache


def _logits(model):
    with torch.no_grad():
        return model(INPUT_IDS).logits


@pytest.fixture
def recorded(monkeypatch):
    """Every call of oslo.hub's downloader, as ``(allow_patterns, local_files_only)``."""
    calls = []
    original = hub.snapshot_download

    def recording(*args, **kwargs):
        calls.append((list(kwargs.get("allow_patterns") or []), kwargs.get("local_files_only")))
        return original(*args, **kwargs)

    monkeypatch.setattr(hub, "snapshot_download", recording)
    return calls


def test_is_hub_name(tmp_path):
    (tmp_path / "afile").write_text("")
    assert hub.is_hub_name("gpt2") and hub.is_hub_name("org/name")
    assert not hub.is_hub_name(str(tmp_path))  # a directory
    assert not hub.is_hub_name(str(tmp_path / "afile"))  # any path that exists
    assert not hub.is_hub_name(str(tmp_path / "missing"))  # absolute: no repository id
    assert not hub.is_hub_name("a/b/c") and not hub.is_hub_name("./name")


def test_hub_names_load_like_transformers(sources, cache):
    for name in ("org/name", "gpt2"):
        model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(name, cache_dir=cache)
        reference = transformers.GPT2LMHeadModel.from_pretrained(name, cache_dir=cache).eval()
        torch.testing.assert_close(_logits(model), _logits(reference))
        torch.testing.assert_close(_logits(model), sources[0][1])
    auto = oslo.AutoModelForCausalLM.from_pretrained_with_parallel("org/name", cache_dir=cache)  # its config.json too
    assert type(auto) is oslo.GPT2LMHeadModel
    torch.testing.assert_close(_logits(auto), sources[0][1])


def test_revision_picks_the_snapshot(sources, tmp_path):
    cache = str(tmp_path)
    put_in_cache(cache, "org/name", COMMIT_A, sources[0][0], refs=("main",))
    put_in_cache(cache, "org/name", COMMIT_B, sources[1][0], refs=("v2",))
    for revision, seed in ((None, 0), ("main", 0), ("v2", 1), (COMMIT_A, 0), (COMMIT_B, 1)):
        model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/name", cache_dir=cache, revision=revision)
        torch.testing.assert_close(_logits(model), sources[seed][1], msg=f"revision={revision}")
    reference = transformers.GPT2LMHeadModel.from_pretrained("org/name", cache_dir=cache, revision="v2").eval()
    torch.testing.assert_close(_logits(reference), sources[1][1])
    with pytest.raises(OSError, match="'org/name' is not a local directory.*revision 'v3'"):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/name", cache_dir=cache, revision="v3")


def _load_with_environment(rank, world_size, root):
    # huggingface_hub reads HF_HOME and HF_HUB_CACHE when imported: set them, then import it again (in this
    # forked process only), as a process started with them would.
    os.environ["HF_HOME"] = os.path.join(root, "home")
    importlib.reload(huggingface_hub.constants)
    from_home = oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/name")
    os.environ["HF_HUB_CACHE"] = os.path.join(root, "hub-cache")
    importlib.reload(huggingface_hub.constants)
    from_hub_cache = oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/name")
    return _logits(from_home), _logits(from_hub_cache)


def test_cache_from_the_environment(sources, tmp_path):
    put_in_cache(str(tmp_path / "home" / "hub"), "org/name", COMMIT_A, sources[0][0])
    put_in_cache(str(tmp_path / "hub-cache"), "org/name", COMMIT_A, sources[1][0])
    [(from_home, from_hub_cache)] = run_distributed(_load_with_environment, 1, str(tmp_path))
    torch.testing.assert_close(from_home, sources[0][1])
    torch.testing.assert_close(from_hub_cache, sources[1][1])


def test_local_directory_wins(sources, cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(sources[1][0], tmp_path / "org" / "name")
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/name", cache_dir=cache, revision="ignored")
    torch.testing.assert_close(_logits(model), sources[1][1])
    with pytest.raises(FileNotFoundError, match="does not exist"):  # a path, as before: no Hub look-up
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(str(tmp_path / "absent"), cache_dir=cache)


def test_safetensors_preferred_and_only_what_is_used_fetched(sources, tmp_path, recorded):
    source = tmp_path / "both"
    shutil.copytree(sources[0][0], source)  # config.json, generation_config.json, model.safetensors (seed 0)
    bin_model = transformers.GPT2LMHeadModel.from_pretrained(sources[1][0])
    torch.save(bin_model.state_dict(), source / "pytorch_model.bin")  # other weights: must not be read
    (source / "tokenizer.json").write_text("{}")
    cache = str(tmp_path / "cache")
    put_in_cache(cache, "org/both", COMMIT_A, str(source))
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/both", cache_dir=cache)
    torch.testing.assert_close(_logits(model), sources[0][1])
    fetched = {pattern for patterns, _ in recorded for pattern in patterns}
    assert fetched == {"config.json", "generation_config.json", "model.safetensors"}


@pytest.mark.skipif(hub.get_cached_repo_tree is None, reason="huggingface_hub keeps no file lists before 2.0")
def test_cache_of_an_online_download_loads_offline(sources, tmp_path, recorded):
    # What an online load leaves: the repository's file list, and only the files oslo fetched.
    cache = str(tmp_path)
    listed = ["config.json", "generation_config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json",
              "flax_model.msgpack", "onnx/model.onnx"]
    put_in_cache(cache, "org/name", COMMIT_A, sources[0][0], listed=listed)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/name", cache_dir=cache)
    torch.testing.assert_close(_logits(model), sources[0][1])
    assert {pattern for patterns, _ in recorded for pattern in patterns} == {
        "config.json", "generation_config.json", "model.safetensors"}
    # huggingface_hub itself refuses the snapshot as incomplete when asked for files the download skipped.
    with pytest.raises(huggingface_hub.errors.LocalEntryNotFoundError, match="pytorch_model.bin"):
        huggingface_hub.snapshot_download("org/name", cache_dir=cache, allow_patterns=["*.bin", "*.safetensors"])


def test_split_checkpoint_in_a_subfolder(sources, tmp_path, recorded):
    split = tmp_path / "split"
    oslo.GPT2LMHeadModel.from_pretrained_with_parallel(sources[0][0]).save_pretrained_with_parallel(split)
    assert "model_parallel.index.json" in os.listdir(split)
    cache = str(tmp_path / "cache")
    put_in_cache(cache, "org/name", COMMIT_A, sources[1][0])  # the repository's root: other weights
    put_in_cache(cache, "org/name", COMMIT_A, str(split), subfolder="parallel", refs=())
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/name", cache_dir=cache, subfolder="parallel")
    torch.testing.assert_close(_logits(model), sources[0][1])
    assert {pattern for patterns, _ in recorded for pattern in patterns} == {
        "parallel/config.json", "parallel/generation_config.json", "parallel/model_parallel.index.json",
        "parallel/model_tp=0_pp=0.safetensors"}


def test_missing_name_offline_error(cache):
    with pytest.raises(OSError) as info:
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/absent", cache_dir=cache, local_files_only=True)
    message = str(info.value)
    assert "'org/absent' is not a local directory" in message and "could not be found in the Hugging Face cache" \
        in message and "local_files_only=True" in message and cache in message


def _load_missing(rank, world_size, cache):
    with pytest.raises(OSError) as info:
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/absent", tensor_parallel_size=world_size,
                                                           cache_dir=cache)
    return str(info.value)


def test_missing_name_raises_on_every_rank(cache):
    messages = run_distributed(_load_missing, 2, cache, timeout=60)
    for message in messages:
        assert "'org/absent' is not a local directory" in message, message
        assert "could not be found in the Hugging Face cache" in message and "HF_HUB_OFFLINE=1" in message
    assert "rank 0" in messages[1]  # the rank that waited names the one that looked


def _count_downloads(rank, world_size, cache, local_rank, delay=0.0, fail=False, collective_timeout=None):
    """Load ``org/name`` at tensor_parallel_size=world_size, recording this rank's downloader calls as
    ``(local_files_only, start, end)``; a call that may download first sleeps ``delay`` s (once), or fails."""
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
    calls = []
    original = hub.snapshot_download

    def recording(*args, **kwargs):
        start = time.monotonic()
        if not kwargs.get("local_files_only"):
            if fail:
                raise RuntimeError("injected download failure")
            time.sleep(delay if not calls else 0.0)
        try:
            return original(*args, **kwargs)
        finally:
            calls.append((kwargs.get("local_files_only"), start, time.monotonic()))

    hub.snapshot_download = recording
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/name", tensor_parallel_size=world_size,
                                                               cache_dir=cache, timeout=collective_timeout)
    full = model(INPUT_IDS).logits
    return calls, full


@pytest.mark.parametrize("machines", [1, 2])
def test_one_rank_per_machine_downloads(sources, cache, machines):
    # One machine: LOCAL_RANK is the rank. Two machines of one rank each: LOCAL_RANK 0 on both.
    results = run_distributed(_count_downloads, 2, cache, None if machines == 1 else 0, timeout=60)
    for _, logits in results:
        torch.testing.assert_close(logits, sources[0][1])
    (calls0, _), (calls1, _) = results
    assert calls0 and all(local is False for local, _, _ in calls0)
    if machines == 1:  # rank 1 only reads the cache, after rank 0 has fetched everything
        assert calls1 and all(local is True for local, _, _ in calls1)
        assert min(start for _, start, _ in calls1) > max(end for _, _, end in calls0)
    else:
        assert calls1 and all(local is False for local, _, _ in calls1)


def _load_expecting_failure(rank, world_size, cache):
    with pytest.raises(Exception) as info:
        _count_downloads(rank, world_size, cache, None, fail=rank == 0)
    return type(info.value).__name__, str(info.value)


def test_failed_download_fails_every_rank(cache):
    start = time.monotonic()
    (kind0, message0), (kind1, message1) = run_distributed(_load_expecting_failure, 2, cache, timeout=60)
    assert (kind0, message0) == ("RuntimeError", "injected download failure")
    assert kind1 == "OSError" and "rank 0: RuntimeError: injected download failure" in message1
    assert "'org/name'" in message1
    assert time.monotonic() - start < 30  # not a collective timeout


def test_download_longer_than_the_timeout(sources, cache):
    # The waiting rank hears from the downloading one every timeout/4 s: a 6 s download under a 3 s timeout.
    results = run_distributed(_count_downloads, 2, cache, None, delay=6.0, collective_timeout=3.0, timeout=60)
    for _, logits in results:
        torch.testing.assert_close(logits, sources[0][1])
    (calls0, _), (calls1, _) = results
    assert min(start for _, start, _ in calls1) - min(start for _, start, _ in calls0) > 6.0  # rank 1 waited


def _load_from_own_cache(rank, world_size, caches):
    os.environ["LOCAL_RANK"] = "0"  # one rank per machine, each with its own cache
    with pytest.raises(OSError) as info:
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel("org/name", tensor_parallel_size=world_size,
                                                           cache_dir=caches[rank])
    return str(info.value)


def test_ranks_resolving_different_commits_are_refused(sources, tmp_path):
    caches = [str(tmp_path / "a"), str(tmp_path / "b")]
    put_in_cache(caches[0], "org/name", COMMIT_A, sources[0][0])
    put_in_cache(caches[1], "org/name", COMMIT_B, sources[1][0])
    for message in run_distributed(_load_from_own_cache, 2, caches, timeout=60):
        assert "different commits" in message and COMMIT_A in message and COMMIT_B in message


def test_a_mistyped_relative_path_says_no_such_directory_offline(cache, tmp_path, monkeypatch):
    """``"tiny-gtp2"`` (for ``tiny-gpt2``) has the form of a Hub name: one OSError says both that no directory of
    that name exists (and where it looked) and what the Hub's cache answered."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError) as info:
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel("tiny-gtp2", cache_dir=cache)
    message = str(info.value)
    assert message.startswith(f"'tiny-gtp2' is not a local directory (no directory {str(tmp_path / 'tiny-gtp2')!r} "
                              "exists)"), message
    assert "could not be found in the Hugging Face cache" in message and "HF_HUB_OFFLINE=1" in message, message


def test_a_mistyped_relative_path_says_no_such_directory_when_the_hub_is_unreachable(cache, tmp_path, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on: the connection is refused at once
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(OSError) as info:  # transformers' error type: code that catches it keeps working
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel("tiny-gtp2", cache_dir=cache)
    message = str(info.value)
    assert message.startswith(f"'tiny-gtp2' is not a local directory (no directory {str(tmp_path / 'tiny-gtp2')!r} "
                              "exists)"), message
    assert f"couldn't connect to '{endpoint}'" in message and "Check the path" in message, message
    assert time.monotonic() - start < 30
