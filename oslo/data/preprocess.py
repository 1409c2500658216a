"""Tokenize a text corpus in parallel and binarize it into Megatron-LM's indexed-dataset format."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from oslo.data.indexed_dataset import (
    IndexedDatasetBuilder,
    best_fitting_dtype,
    check_binarization_impl,
    normalize_prefix,
)

logger = logging.getLogger(__name__)

# A chunk is closed after this many characters even if it has fewer than chunk_size documents, so
# that corpora of very long documents do not pile up large chunks in flight.
_MAX_CHUNK_CHARS = 8 << 20
# Chunks handed to the pool but not yet written; bounds memory however long the input is.
_CHUNKS_IN_FLIGHT_PER_WORKER = 4


class JsonKeyError(KeyError):
    """A ``.jsonl`` record lacks the requested ``json_key``."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


@dataclass
class PreprocessStats:
    """What :meth:`DatasetPreprocessor.preprocess` wrote.

    Attributes:
        save_file_name: the dataset prefix (``.bin``/``.idx`` appended).
        documents: documents written (one sequence each).
        skipped_documents: empty documents left out (empty string or no tokens).
        tokens: tokens written, end-of-document tokens included.
        seconds: wall-clock time of the whole run.
    """

    save_file_name: str
    documents: int
    skipped_documents: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Tokens written per second of wall-clock time."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


class JsonlSource:
    """Documents of a JSON-lines file, one JSON object per line (Megatron-LM's input format).

    Iterating yields the ``json_key`` field of every record. Inside
    :meth:`DatasetPreprocessor.preprocess` the lines are parsed in the worker processes instead.
    Create it with :meth:`DatasetPreprocessor.open_jsonl`.

    Args:
        path: the ``.jsonl`` file.
        json_key: field of each record that holds the document text.
    """

    def __init__(self, path: str | os.PathLike, json_key: str = "text") -> None:
        self.path = os.fspath(path)
        self.json_key = json_key
        if not os.path.isfile(self.path) and os.path.isfile(self.path + ".jsonl"):
            self.path += ".jsonl"  # a corpus named without its extension, as OSLO's manual names them
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"JSON-lines file '{self.path}' does not exist (nor '{self.path}.jsonl'); pass the path of an "
                "existing .jsonl file to open_jsonl."
            )
        # Check the first record now, so a wrong json_key fails before any work starts.
        with open(self.path, encoding="utf-8") as stream:
            for line_number, line in enumerate(stream, start=1):
                if line.strip():
                    _text_of_record(line, line_number, self.path, json_key)
                    break

    def raw_lines(self) -> Iterator[str]:
        """Yield the unparsed lines of the file."""
        with open(self.path, encoding="utf-8") as stream:
            yield from stream

    def __iter__(self) -> Iterator[str]:
        for line_number, line in enumerate(self.raw_lines(), start=1):
            if line.strip():
                yield _text_of_record(line, line_number, self.path, self.json_key)

    def __repr__(self) -> str:
        return f"JsonlSource(path={self.path!r}, json_key={self.json_key!r})"


def _text_of_record(line: str, line_number: int, path: str, json_key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"line {line_number} of '{path}' is not valid JSON ({error.msg}); each line of a .jsonl "
            'file must be one JSON object such as {"text": "..."}.'
        ) from None
    if not isinstance(record, dict) or json_key not in record:
        keys = sorted(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise JsonKeyError(
            f"line {line_number} of '{path}' has no json_key {json_key!r} (found keys: {keys}); pass "
            "the field that holds the text, e.g. open_jsonl(path, json_key=...)."
        )
    text = record[json_key]
    if not isinstance(text, str):
        raise TypeError(
            f"line {line_number} of '{path}': json_key {json_key!r} holds a {type(text).__name__}, "
            "not a string; point json_key at the field that holds the document text."
        )
    return text


# -- encoding, shared by the worker processes and the in-process path ---------------------------


class _Encoder:
    """Turns a list of texts into lists of token ids, like ``tokenizer(texts)["input_ids"]``."""

    def __init__(self, spec: tuple[str, Any]) -> None:
        kind, payload = spec
        self._backend = None
        self._tokenizer = None
        if kind == "backend":
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(payload)
            # A tokenizer.json may carry truncation/padding settings; transformers clears them for
            # a plain call, and so must we, or long documents would be cut.
            backend.no_truncation()
            backend.no_padding()
            self._backend = backend
            self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        else:
            self._tokenizer = payload

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self._backend is not None:
            return [encoding.ids for encoding in self._encode_batch(texts, add_special_tokens=True)]
        return list(self._tokenizer(texts)["input_ids"])


@dataclass
class _WorkerConfig:
    encoder_spec: tuple[str, Any]
    dtype: str
    append_eod: bool
    eod_token_id: int | None


# One unit of work: (kind of items, items, number of the first item, source name, json_key), where
# kind is "texts" (strings as given), "lines" (lines of a text file) or "jsonl" (unparsed records).
_Task = tuple[str, list, int, str, "str | None"]

_WORKER: dict[str, Any] = {}


def _init_worker(config: _WorkerConfig) -> None:
    _WORKER["encoder"] = _Encoder(config.encoder_spec)
    _WORKER["config"] = config


def _encode_task(task: _Task) -> tuple[np.ndarray, np.ndarray, int]:
    """Encode one chunk of documents; returns (concatenated tokens, sizes, skipped count)."""
    return _encode_chunk(task, _WORKER["encoder"], _WORKER["config"])


def _encode_chunk(
    task: _Task, encoder: _Encoder, config: _WorkerConfig
) -> tuple[np.ndarray, np.ndarray, int]:
    kind, items, first, origin, json_key = task
    if kind == "lines":
        texts = [line.rstrip("\r\n") for line in items]
    elif kind == "jsonl":
        texts = [
            _text_of_record(line, first + offset, origin, json_key)
            for offset, line in enumerate(items)
            if line.strip()
        ]
    else:
        texts = items
        for offset, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(
                    f"document {first + offset} of {origin} is of type {type(text).__name__}, not str; "
                    "the source must yield strings (decode bytes, or use open_jsonl for .jsonl)."
                )
    texts = [text for text in texts if text]
    skipped = len(items) - len(texts)
    ids = encoder(texts) if texts else []
    if config.append_eod:
        for row in ids:
            if row:
                row.append(config.eod_token_id)
    sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    if sizes.size and sizes.min() == 0:
        skipped += int(np.count_nonzero(sizes == 0))
        sizes = sizes[sizes > 0]
    dtype = np.dtype(config.dtype)
    try:
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(sizes.sum()))
    except OverflowError:
        raise ValueError(
            f"a token id in documents {first}..{first + len(items) - 1} of {origin} does not fit the "
            f"dataset dtype {dtype}; the tokenizer reports a vocabulary smaller than the ids it "
            "produces. Pass a tokenizer whose len() covers every id."
        ) from None
    return tokens, sizes, skipped


# -- the preprocessor ----------------------------------------------------------------------------


class DatasetPreprocessor:
    """Tokenizes, encodes and binarizes text corpora for training.

    Documents are tokenized in chunks by a pool of worker processes, written to disk as they come
    back, and stored in Megatron-LM's indexed-dataset format (``.bin`` + ``.idx``), so the files
    can be read by :class:`~oslo.data.DatasetForCausalLM` or by Megatron-LM, and Megatron-LM's files
    can be read by oslo. The input is streamed: memory use does not grow with the corpus size.

    Token ids are exactly ``tokenizer(document)["input_ids"]`` (special tokens included, no
    truncation), followed by ``eod_token_id`` when ``append_eod`` is set. Empty documents are
    skipped. Ids are stored as ``uint16`` when the vocabulary has fewer than 65,500 entries and as
    ``int32`` otherwise.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow) or a ``tokenizers.Tokenizer``.
        chunk_size: documents per unit of work sent to a worker process.
        binarization_impl: ``"mmap"`` (Megatron's ``MMIDIDX`` index, the default and the one
            Megatron-LM uses today), ``"lazy"`` or ``"cached"`` (the legacy ``TNTIDX`` index).
        append_eod: append the end-of-document token to every document, so that documents stay
            separable once concatenated into training samples.
        eod_token_id: the end-of-document id; defaults to ``tokenizer.eos_token_id``.
        num_workers: tokenizer processes; defaults to the number of usable CPUs. ``0`` tokenizes in
            the calling process (with the tokenizer's own threading).
        start_method: multiprocessing start method (``"fork"``, ``"spawn"``, ``"forkserver"``);
            defaults to ``"fork"`` on Linux and the platform default elsewhere. Under ``"spawn"``
            call ``preprocess`` from inside an ``if __name__ == "__main__":`` block.
    """

    def __init__(
        self,
        tokenizer: Any,
        chunk_size: int = 1024,
        binarization_impl: str = "mmap",
        append_eod: bool = True,
        eod_token_id: int | None = None,
        num_workers: int | None = None,
        start_method: str | None = None,
    ) -> None:
        check_binarization_impl(binarization_impl)
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int (documents per chunk), got {chunk_size!r}.")
        if num_workers is None:
            num_workers = _usable_cpus()
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"num_workers must be an int >= 0 (0 tokenizes in this process), got {num_workers!r}."
            )
        if start_method is not None and start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start_method={start_method!r} is not available here; use one of "
                f"{multiprocessing.get_all_start_methods()} or None for the default."
            )
        if eod_token_id is None and append_eod:
            eod_token_id = getattr(tokenizer, "eos_token_id", None)
            if eod_token_id is None:
                raise ValueError(
                    "append_eod=True needs an end-of-document token, but eod_token_id was not given "
                    "and the tokenizer has no eos_token_id. Pass eod_token_id=<id> or append_eod=False."
                )
        if eod_token_id is not None and (not isinstance(eod_token_id, int) or eod_token_id < 0):
            raise ValueError(f"eod_token_id must be a non-negative int, got {eod_token_id!r}.")

        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        self.binarization_impl = binarization_impl
        self.append_eod = append_eod
        self.eod_token_id = eod_token_id
        self.num_workers = num_workers
        self.start_method = start_method
        self._encoder_spec = _encoder_spec(tokenizer)
        vocab_size = _vocab_size(tokenizer)
        if append_eod:
            vocab_size = max(vocab_size, eod_token_id + 1)
        self.dtype = best_fitting_dtype(vocab_size)

    @staticmethod
    def open_jsonl(path: str | os.PathLike, json_key: str = "text") -> JsonlSource:
        """Open a JSON-lines corpus (one ``{"text": ...}`` object per line) for :meth:`preprocess`.

        Args:
            path: the ``.jsonl`` file (or its path without the extension, as OSLO's manual names corpora).
            json_key: field that holds each document's text.

        Returns:
            A :class:`JsonlSource`; iterating it yields the documents' texts.

        Raises:
            FileNotFoundError: the file does not exist.
            JsonKeyError: (a ``KeyError``) the first record has no ``json_key`` field.
        """
        return JsonlSource(path, json_key=json_key)

    def preprocess(
        self,
        source: Iterable[str] | io.TextIOBase | JsonlSource,
        save_file_name: str | os.PathLike,
        log_interval: int = 1000,
        progress_bar: bool = True,
    ) -> PreprocessStats:
        """Tokenize every document of ``source`` and write ``save_file_name`` ``.bin`` and ``.idx``.

        Args:
            source: an open text file (one document per line, line break removed), the result of
                :meth:`open_jsonl`, or any iterable of strings (one document each).
            save_file_name: output path without suffix.
            log_interval: refresh the progress statistics (documents, tokens, tokens/s) every this
                many documents; shown on a progress bar, or logged at INFO level without one.
            progress_bar: show a ``tqdm`` progress bar on stderr.

        Returns:
            A :class:`PreprocessStats` with the counts and the elapsed time.
        """
        if not isinstance(log_interval, int) or log_interval < 1:
            raise ValueError(f"log_interval must be a positive int (documents), got {log_interval!r}.")
        tasks = self._tasks(source)
        prefix = normalize_prefix(save_file_name)
        started = time.perf_counter()
        documents = skipped = tokens = 0
        next_report = log_interval

        from tqdm.auto import tqdm

        with (
            IndexedDatasetBuilder(prefix, self.dtype, self.binarization_impl) as builder,
            tqdm(desc=f"preprocess {os.path.basename(prefix)}", unit="doc", disable=not progress_bar) as bar,
            contextlib.closing(self._encode_all(tasks)) as encoded,
        ):
            for chunk_tokens, sizes, chunk_skipped in encoded:
                builder.add_documents(chunk_tokens, sizes)
                documents += sizes.size
                skipped += chunk_skipped
                tokens += chunk_tokens.size
                bar.update(sizes.size)
                if documents >= next_report:
                    next_report = (documents // log_interval + 1) * log_interval
                    rate = tokens / max(time.perf_counter() - started, 1e-9)
                    if progress_bar:
                        bar.set_postfix(tokens=f"{tokens:,}", tok_per_s=f"{rate:,.0f}", refresh=False)
                    else:
                        logger.info(
                            "%s: %d documents, %d tokens, %.0f tokens/s", prefix, documents, tokens, rate
                        )
            # The bar's last line shows the counts returned below, not those of the last log_interval boundary.
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            bar.set_postfix(tokens=f"{tokens:,}", tok_per_s=f"{rate:,.0f}", refresh=False)
        stats = PreprocessStats(prefix, documents, skipped, tokens, time.perf_counter() - started)
        logger.info(
            "Preprocessed %s: %d documents (%d empty skipped), %d tokens in %.1fs (%.0f tokens/s)",
            prefix,
            documents,
            skipped,
            tokens,
            stats.seconds,
            stats.tokens_per_second,
        )
        return stats

    # -- internals ------------------------------------------------------------------------------

    def _tasks(self, source: Any) -> Iterator[_Task]:
        if isinstance(source, (str, bytes, os.PathLike)):
            raise TypeError(
                f"source must be an open text file, preprocessor.open_jsonl(path) or an iterable of "
                f"strings, got the {type(source).__name__} {source!r}. For a .txt file pass "
                "open(path); for a .jsonl file pass preprocessor.open_jsonl(path)."
            )
        if isinstance(source, JsonlSource):
            return self._chunked(source.raw_lines(), "jsonl", 1, source.path, source.json_key)
        if isinstance(source, (io.RawIOBase, io.BufferedIOBase)) or "b" in str(getattr(source, "mode", "")):
            raise TypeError(
                f"source {getattr(source, 'name', source)!r} is opened in binary mode; open it in "
                "text mode, e.g. open(path, encoding='utf-8')."
            )
        if isinstance(source, io.TextIOBase):
            return self._chunked(iter(source), "lines", 1, f"file '{getattr(source, 'name', '?')}'", None)
        try:
            iterator = iter(source)
        except TypeError:
            raise TypeError(
                f"source must be an open text file, preprocessor.open_jsonl(path) or an iterable of "
                f"strings, got a {type(source).__name__}."
            ) from None
        return self._chunked(iterator, "texts", 0, "the source", None)

    def _chunked(
        self, items: Iterator, kind: str, first: int, origin: str, json_key: str | None
    ) -> Iterator[_Task]:
        chunk: list = []
        chars = 0
        for item in items:
            chunk.append(item)
            if isinstance(item, str):
                chars += len(item)
            if len(chunk) >= self.chunk_size or chars >= _MAX_CHUNK_CHARS:
                yield kind, chunk, first, origin, json_key
                first += len(chunk)
                chunk, chars = [], 0
        if chunk:
            yield kind, chunk, first, origin, json_key

    def _worker_config(self) -> _WorkerConfig:
        return _WorkerConfig(self._encoder_spec, self.dtype.str, self.append_eod, self.eod_token_id)

    def _encode_all(self, tasks: Iterator) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """Encode the chunks in order, in worker processes, with a bounded number in flight."""
        config = self._worker_config()
        if self.num_workers == 0:
            encoder = _Encoder(config.encoder_spec)
            for task in tasks:
                yield _encode_chunk(task, encoder, config)
            return
        method = self.start_method
        if method is None and sys.platform.startswith("linux"):
            method = "fork"
        context = multiprocessing.get_context(method)
        with _single_threaded_tokenizers():
            pool = context.Pool(self.num_workers, initializer=_init_worker, initargs=(config,))
        try:
            window = self.num_workers * _CHUNKS_IN_FLIGHT_PER_WORKER
            pending: deque = deque()
            for task in tasks:
                pending.append(pool.apply_async(_encode_task, (task,)))
                if len(pending) >= window:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()
            pool.close()
            pool.join()
        finally:
            pool.terminate()


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """Start workers with ``TOKENIZERS_PARALLELISM=false``.

    Each worker already owns a CPU, so the Rust tokenizer's own thread pool would only
    oversubscribe it; and a forked child whose parent used that pool prints a warning unless the
    variable is set at fork time. The parent's environment is restored afterwards.
    """
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


_PROBE_TEXTS = ["Hello world.", "  two  spaces and\ttabs", "line one\nline two", "ünïcödé 123"]


def _encoder_spec(tokenizer: Any) -> tuple[str, Any]:
    """Describe how workers rebuild the tokenizer: the Rust backend's JSON when it is equivalent."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return ("backend", tokenizer.to_str())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if callable(tokenizer):
        if isinstance(backend, Tokenizer):
            spec = ("backend", backend.to_str())
            # The backend alone must reproduce the full tokenizer (some add tokens in Python).
            # Run single-threaded so the probe leaves the Rust thread pool of the user's process
            # unused (older tokenizers releases warn on every later fork once it has been used).
            with _single_threaded_tokenizers():
                expected = [list(ids) for ids in tokenizer(_PROBE_TEXTS)["input_ids"]]
                matches = _Encoder(spec)(_PROBE_TEXTS) == expected
            if matches:
                return spec
            logger.info("Tokenizer backend differs from the full tokenizer; workers use the full tokenizer.")
        return ("object", tokenizer)
    raise TypeError(
        f"tokenizer must be a Hugging Face tokenizer or a tokenizers.Tokenizer, got "
        f"{type(tokenizer).__name__}; load one with transformers.AutoTokenizer.from_pretrained(...)."
    )


def _vocab_size(tokenizer: Any) -> int:
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer.get_vocab_size(with_added_tokens=True)
    with contextlib.suppress(TypeError):
        return len(tokenizer)
    size = getattr(tokenizer, "vocab_size", None)
    if isinstance(size, int):
        return size
    raise TypeError(
        f"cannot tell the vocabulary size of {type(tokenizer).__name__} (no len() or vocab_size), "
        "which picks the token dtype; pass a Hugging Face tokenizer or a tokenizers.Tokenizer."
    )
