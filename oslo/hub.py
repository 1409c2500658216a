"""Hugging Face Hub names in ``from_pretrained_with_parallel``: ``"gpt2"``, ``"org/name"``.

A name that is not a local path is resolved through the Hugging Face cache as transformers' ``from_pretrained``
resolves it, with its keyword arguments (``revision=``, ``cache_dir=``, ``token=``, ``local_files_only=``,
``force_download=``, ``proxies=``, ``subfolder=``) and its environment (``HF_HUB_OFFLINE=1``, ``HF_HOME``,
``HF_HUB_CACHE``): files missing from the cache are downloaded, and offline only the cache is read. A path that
exists always wins, as in transformers. Only what oslo loads is fetched: ``config.json``,
``generation_config.json`` and one set of weights, chosen as transformers chooses them (safetensors before
``.bin``; a split checkpoint of :meth:`save_pretrained_with_parallel` first), with its index and oslo's
manifest; tokenizer files are not.

The ranks do not race for the same files: **one process per machine downloads**, the one whose ``LOCAL_RANK``
is 0 (``torchrun`` and ``deepspeed`` set it; without it, global rank 0, i.e. every rank is taken to share one
machine or one file system). The other ranks wait for it, trading a status message with it every few seconds
(so a download longer than the model's ``timeout=`` does not fail them), then find the same files in their
machine's cache with ``local_files_only=True``. A failure on any rank raises on every rank, and ranks that
resolved the name to different commits (a branch moved between two machines' downloads) are refused.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from oslo import checkpoint as ckpt
from oslo.parallel.context import ParallelContext
from oslo.parallel.errors import naming_timeouts

try:  # huggingface_hub >= 2: the repository's file list as the last download saw it (no network)
    from huggingface_hub import get_cached_repo_tree
except ImportError:  # pragma: no cover - older huggingface_hub
    get_cached_repo_tree = None

logger = logging.getLogger(__name__)

# The keyword arguments of ``from_pretrained_with_parallel`` that go to the Hub (transformers' names).
HUB_OPTIONS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "subfolder")
CONFIG_FILES = ("config.json", "generation_config.json")
_SHARD_PATTERNS = {ckpt.SAFE_WEIGHTS_INDEX_NAME: "model-*.safetensors", ckpt.WEIGHTS_INDEX_NAME: "pytorch_model-*.bin"}
_POLL_SECONDS = 2.0  # how often waiting ranks hear from a rank still downloading


def is_hub_name(name_or_path: str | os.PathLike) -> bool:
    """Whether ``name_or_path`` is resolved through the Hub: no such path exists, it has the form of a repository
    id (``"gpt2"``, ``"org/name"``), and no interrupted save left a checkpoint beside it (then the local error,
    which says where the checkpoint is, is the useful one)."""
    path = os.fspath(name_or_path)
    if os.path.exists(path):
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return not ckpt.interrupted_save(path)


def resolve_checkpoint(
    name_or_path: str | os.PathLike,
    context: ParallelContext | None = None,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: bool | str | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    proxies: dict[str, str] | None = None,
    subfolder: str | None = "",
) -> str:
    """The local directory of the checkpoint ``name_or_path``: the path itself when it exists (joined with
    ``subfolder``), else the Hugging Face cache's snapshot of the Hub repository of that name, downloading what
    is missing. Call it on every rank of ``context`` (collective for a Hub name); ``None`` is a single process.

    Args:
        name_or_path: A directory, or a Hub repository id (``"gpt2"``, ``"org/name"``).
        context: The ranks that load the model: one process per machine downloads, the others wait for it.
        revision: Branch, tag or commit hash (default ``"main"``).
        cache_dir: The cache (default ``HF_HUB_CACHE``, i.e. ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``).
        token: Token for private or gated repositories (``True``: the one saved by ``hf auth login``).
        local_files_only: Read the cache only, as with ``HF_HUB_OFFLINE=1``.
        force_download: Download the files again even if they are cached.
        proxies: Passed on to huggingface_hub (which ignores them since 1.0: set ``HTTPS_PROXY``).
        subfolder: Folder of the repository (or of the directory) that holds the checkpoint.

    Raises:
        OSError: On every rank, when the name is neither a local directory nor in the cache (offline or
            ``local_files_only``), when the Hub does not know it or the revision, or when any rank failed.
    """
    path = os.fspath(name_or_path)
    subfolder = subfolder or ""
    if not is_hub_name(path):
        return os.path.join(path, subfolder) if subfolder else path
    options = dict(revision=revision, cache_dir=cache_dir, token=token, force_download=force_download,
                   proxies=proxies, subfolder=subfolder)
    what = f"resolving {path!r} through the Hugging Face cache"
    world_size = 1 if context is None else context.world_size
    downloads = world_size == 1 or int(os.environ.get("LOCAL_RANK", context.rank)) == 0
    if not downloads:
        logger.info("%s: waiting for the rank with LOCAL_RANK 0 to fetch it", what)

    def fetch() -> str:
        return _fetch(path, local_files_only=local_files_only, **options)

    def read_cache() -> str:
        return _fetch(path, local_files_only=True, reader=True, **{**options, "force_download": False})

    me = 0 if context is None else context.rank
    fetched = _on_every_rank(context, fetch if downloads else None, what)[me]
    snapshots = _on_every_rank(context, (lambda: fetched) if downloads else read_cache, what)
    commits: dict[str, list[int]] = {}
    for rank, snapshot in enumerate(snapshots):
        commits.setdefault(os.path.basename(snapshot), []).append(rank)
    if len(commits) > 1:
        found = "; ".join(f"commit {commit} on ranks {ranks}" for commit, ranks in commits.items())
        raise OSError(
            f"the ranks resolved {path!r} (revision {revision or constants.DEFAULT_REVISION!r}) to different commits: "
            f"{found}. The branch moved while the machines downloaded it, or their caches hold different commits "
            "offline; pass revision=<commit hash> to load the same weights everywhere."
        )
    snapshot = snapshots[me]
    return os.path.join(snapshot, subfolder) if subfolder else snapshot


def _offline() -> bool:
    check = getattr(constants, "is_offline_mode", None)
    return bool(check()) if callable(check) else bool(constants.HF_HUB_OFFLINE)


def _fetch(repo_id: str, *, revision, cache_dir, token, local_files_only: bool, force_download: bool, proxies,
           subfolder: str, reader: bool = False) -> str:
    """Download (or find in the cache) what oslo loads of ``repo_id``; returns the snapshot directory (named by
    its commit hash). huggingface_hub's errors become transformers' ``OSError`` messages."""
    offline = local_files_only or _offline()

    def download(names: list[str], at: str | None) -> str:
        extra = {} if proxies is None else {"proxies": proxies}
        return snapshot_download(
            repo_id, revision=at, cache_dir=cache_dir, token=token, local_files_only=local_files_only,
            force_download=force_download, allow_patterns=[glob.escape(_join(subfolder, name)) for name in names],
            **extra,
        )

    try:
        # 1. The configs: resolves the revision to a commit (and, online, caches the repository's file list).
        snapshot = download(list(CONFIG_FILES), revision)
        commit = os.path.basename(snapshot)
        names = _repo_files(repo_id, commit, cache_dir, token, offline, snapshot, subfolder)
        index, files = _choose_weights(names)
        if index is None and not files:
            raise OSError(
                f"{repo_id!r} (revision {revision or constants.DEFAULT_REVISION!r}, commit {commit}"
                f"{', subfolder ' + repr(subfolder) if subfolder else ''}) has no weights oslo can load: expected "
                f"{ckpt.SAFE_WEIGHTS_NAME}, {ckpt.SAFE_WEIGHTS_INDEX_NAME}, {ckpt.WEIGHTS_NAME}, "
                f"{ckpt.WEIGHTS_INDEX_NAME} or a split checkpoint ({ckpt.SPLIT_INDEX_NAME}); "
                + (f"its cached snapshot {snapshot!r} holds {sorted(names)} (offline, only the cache is read)."
                   if offline else f"it holds {sorted(names)}.")
            )
        # 2. The weights, at that commit: the index first when there is one, then the files it names.
        if index is not None:
            download([index], commit)
            files = _index_files(os.path.join(snapshot, subfolder, index), index, names)
            files.append(index)
        return download(files, commit)
    except (RevisionNotFoundError, RepositoryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError,
            HFValidationError) as exc:
        raise _hub_error(exc, repo_id, revision, cache_dir, local_files_only, offline, reader) from exc


def _join(subfolder: str, name: str) -> str:
    return f"{subfolder.strip('/')}/{name}" if subfolder else name


def _repo_files(repo_id: str, commit: str, cache_dir, token, offline: bool, snapshot: str,
                subfolder: str) -> list[str]:
    """The files of the repository at ``commit`` (in ``subfolder``, not below): from the file list the cache
    keeps, else (online) from the Hub, else those of the cached snapshot."""
    paths = None
    if get_cached_repo_tree is not None:
        try:
            paths = [entry.path for entry in get_cached_repo_tree(repo_id, revision=commit, cache_dir=cache_dir)]
        except Exception:  # noqa: BLE001 - no cached list (an older download, a cache built by hand)
            paths = None
    if paths is None and not offline:  # an older huggingface_hub: ask the Hub
        paths = HfApi(token=token).list_repo_files(repo_id, revision=commit)
    if paths is None:
        root = os.path.join(snapshot, subfolder)
        return sorted(name for name in os.listdir(root) if os.path.isfile(os.path.join(root, name))) \
            if os.path.isdir(root) else []
    prefix = subfolder.strip("/") + "/" if subfolder else ""
    return sorted(path[len(prefix):] for path in paths if path.startswith(prefix) and "/" not in path[len(prefix):])


def _choose_weights(names: list[str]) -> tuple[str | None, list[str]]:
    """``(index, files)``: the weights oslo loads among ``names``, in transformers' preference (safetensors
    before ``.bin``) after oslo's split checkpoints: an index whose files are read from it once downloaded, or
    the files themselves. The manifest of a merged oslo save comes along."""
    present = set(names)
    if ckpt.SPLIT_INDEX_NAME in present:
        return ckpt.SPLIT_INDEX_NAME, []
    manifest = [ckpt.MANIFEST_NAME] if ckpt.MANIFEST_NAME in present else []
    for index, single in ((ckpt.SAFE_WEIGHTS_INDEX_NAME, ckpt.SAFE_WEIGHTS_NAME),
                          (ckpt.WEIGHTS_INDEX_NAME, ckpt.WEIGHTS_NAME)):
        if index in present:
            return index, manifest
        if single in present:
            return None, [single, *manifest]
    return None, [name for name in sorted(names) if ckpt.SPLIT_RANKS_RE.match(name)]  # the original OSLO's, no index


def _index_files(path: str, index: str, names: list[str]) -> list[str]:
    """The weight files an index names (split index: its ``files``; merged: its ``weight_map``), or, if it
    cannot be read, the repository's files of that kind (loading then reports what is wrong)."""
    try:
        with open(path) as f:
            content = json.load(f)
        files = content["files"] if index == ckpt.SPLIT_INDEX_NAME else content["weight_map"].values()
        return sorted({str(name) for name in files})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        if index == ckpt.SPLIT_INDEX_NAME:
            return [name for name in sorted(names) if ckpt.SPLIT_RANKS_RE.match(name)]
        return [name for name in sorted(names) if fnmatch.fnmatchcase(name, _SHARD_PATTERNS[index])]


def _not_a_directory(name: str) -> str:
    """The first half of an error for a name that is neither here nor on the Hub: where it was looked for on disk
    (a mistyped relative path, ``"tiny-gtp2"``, becomes a Hub name; the user must learn that no such directory
    exists before reading why the Hub did not have it)."""
    return f"{name!r} is not a local directory (no directory {os.path.abspath(name)!r} exists)"


def _hub_error(exc: Exception, repo_id: str, revision, cache_dir, local_files_only: bool, offline: bool,
               reader: bool) -> OSError:
    """transformers' message for a failed Hub look-up, naming the repository; when the name was not found, the
    message says first that no local directory of that name exists, and where it looked."""
    revision = revision or constants.DEFAULT_REVISION
    cache = os.fspath(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    here = _not_a_directory(repo_id)
    if isinstance(exc, RevisionNotFoundError):
        return OSError(
            f"{revision!r} is not a valid git identifier (branch name, tag name or commit id) that exists for the "
            f"model {repo_id!r}. Check the model page at 'https://huggingface.co/{repo_id}' for available revisions."
        )
    if isinstance(exc, GatedRepoError):
        return OSError(
            f"{repo_id!r} is a gated repository: request access at https://huggingface.co/{repo_id} and pass "
            f"token=<your token> (or log in with `hf auth login`).\n{exc}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return OSError(
            f"{here}, and it is not a valid model identifier listed on 'https://huggingface.co/models'. Check the "
            "path (relative paths start from the working directory) or the name; if this is a private repository, "
            "pass a token having permission to it (token=<your token>, or log in with `hf auth login`)."
        )
    if isinstance(exc, LocalEntryNotFoundError):
        if reader:
            return OSError(
                f"{repo_id!r} (revision {revision!r}) was fetched by this machine's downloading rank (LOCAL_RANK 0), "
                f"but this rank could not find it in its Hugging Face cache ({cache}): every rank of a machine must "
                f"use the same cache (cache_dir=, HF_HOME, HF_HUB_CACHE) and the same LOCAL_RANK numbering.\n{exc}"
            )
        if offline:
            why = "local_files_only=True" if local_files_only else "HF_HUB_OFFLINE=1"
            return OSError(
                f"{here}, and it could not be found in the Hugging Face cache ({cache}, revision {revision!r}) "
                f"with {why}: nothing is downloaded in that mode. Check the path (relative paths start from the "
                f"working directory), pass the path of a checkpoint directory, or download the model once with "
                f"network access (`hf download {repo_id}`, or this call without {why}).\n{exc}"
            )
        return OSError(
            f"{here}, and looking it up on the Hugging Face Hub failed: we couldn't connect to "
            f"'{constants.ENDPOINT}' to load {repo_id!r}, and couldn't find it in the Hugging Face cache ({cache}, "
            f"revision {revision!r}). Check the path (relative paths start from the working directory); for a Hub "
            "model, check your internet connection, or see how to run offline at "
            f"'https://huggingface.co/docs/transformers/installation#offline-mode'.\n{exc}"
        )
    if isinstance(exc, HFValidationError):
        return OSError(f"{here}, and it is not a valid Hub repository id either: {exc}")
    return OSError(f"{here}, and there was a connection error when trying to load it from the Hugging Face Hub:\n{exc}")


def _on_every_rank(context: ParallelContext | None, step: Callable[[], Any] | None, what: str) -> list[Any]:
    """Run ``step`` on this rank (``None``: nothing, the result is ``None``) and return every rank's result.
    If it failed anywhere, raise everywhere: the failed rank its own error, the others an ``OSError`` naming it.

    The step runs in a thread while the ranks trade their status (running, failed, done) every few seconds,
    so the collectives each last far less than the context's timeout however long a download takes, and a
    rank whose download failed is heard at once. Every rank ends after the same exchange."""
    if context is None or context.world_size == 1:
        return [step() if step is not None else None]
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = step()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = exc

    worker = None
    if step is not None:
        worker = threading.Thread(target=run, name="oslo-hub-download", daemon=True)
        worker.start()
    poll = min(_POLL_SECONDS, context.timeout.total_seconds() / 4)
    while True:
        if worker is not None:
            worker.join(poll)
        if worker is not None and worker.is_alive():
            status = ("running", None)
        elif "error" in outcome:
            status = ("failed", f"{type(outcome['error']).__name__}: {outcome['error']}")
        else:
            status = ("done", outcome.get("value"))
        statuses: list = [None] * context.world_size
        with naming_timeouts(context, what, "from_pretrained_with_parallel with the same name on every rank",
                             context.world_group):
            dist.all_gather_object(statuses, status, group=context.world_group)
        if all(state != "running" for state, _ in statuses):
            break
    if "error" in outcome:
        raise outcome["error"]
    failed = [(rank, message) for rank, (state, message) in enumerate(statuses) if state == "failed"]
    if failed:
        details = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
        raise OSError(f"{what} failed on {len(failed)} other rank(s), so this rank stops too: {details}")
    return [value for _, value in statuses]
