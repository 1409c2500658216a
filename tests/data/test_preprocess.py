"""DatasetPreprocessor: the stored tokens, the three input kinds, the impls, workers, and bad input."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from oslo.data import DatasetPreprocessor, IndexedDataset, JsonKeyError

from .corpus import expected_tokens, write_jsonl, write_txt


def _stored(prefix, impl="mmap"):
    dataset = IndexedDataset(prefix, impl)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("impl", ["mmap", "lazy", "cached"])
def test_round_trip_every_impl(dataset_prefixes, tokenizer, documents, impl):
    assert _stored(dataset_prefixes[impl], impl) == expected_tokens(tokenizer, documents)


def test_impls_store_identical_tokens(dataset_prefixes):
    streams = []
    for impl in ("mmap", "lazy", "cached"):
        with open(dataset_prefixes[impl] + ".bin", "rb") as stream:
            streams.append(stream.read())
    assert streams[0] == streams[1] == streams[2]


def test_worker_pool_matches_in_process(tmp_path, tokenizer, documents, dataset_prefixes):
    # small chunks so the pool handles many out-of-order completions
    preprocessor = DatasetPreprocessor(tokenizer, chunk_size=7, num_workers=2)
    stats = preprocessor.preprocess(documents, str(tmp_path / "pool"), progress_bar=False)
    for suffix in (".bin", ".idx"):
        with open(dataset_prefixes["mmap"] + suffix, "rb") as reference:
            assert (tmp_path / f"pool{suffix}").read_bytes() == reference.read()
    assert stats.documents == len(documents)
    assert stats.tokens == sum(map(len, expected_tokens(tokenizer, documents)))


def test_txt_and_jsonl_sources(tmp_path, tokenizer, documents):
    expected = expected_tokens(tokenizer, documents[:50])
    preprocessor = DatasetPreprocessor(tokenizer, chunk_size=16, num_workers=2)
    with open(write_txt(tmp_path / "c.txt", documents[:50]), encoding="utf-8") as source:
        preprocessor.preprocess(source, str(tmp_path / "txt"), progress_bar=False)
    jsonl = preprocessor.open_jsonl(str(write_jsonl(tmp_path / "c.jsonl", documents[:50])), json_key="text")
    preprocessor.preprocess(jsonl, str(tmp_path / "jsonl"), progress_bar=False)
    assert _stored(str(tmp_path / "txt")) == expected
    assert _stored(str(tmp_path / "jsonl")) == expected
    assert list(jsonl) == documents[:50]
    # named without its extension, as OSLO's manual names its corpora
    assert list(preprocessor.open_jsonl(str(tmp_path / "c"), json_key="text")) == documents[:50]


def test_spawn_start_method(tmp_path, tokenizer, documents):
    preprocessor = DatasetPreprocessor(tokenizer, chunk_size=64, num_workers=1, start_method="spawn")
    preprocessor.preprocess(documents[:100], str(tmp_path / "spawn"), progress_bar=False)
    assert _stored(str(tmp_path / "spawn")) == expected_tokens(tokenizer, documents[:100])


def test_raw_tokenizers_tokenizer_without_eod(tmp_path, backend_tokenizer, tokenizer, documents):
    preprocessor = DatasetPreprocessor(backend_tokenizer, append_eod=False, num_workers=0)
    preprocessor.preprocess(documents[:30], str(tmp_path / "raw"), progress_bar=False)
    assert _stored(str(tmp_path / "raw")) == expected_tokens(tokenizer, documents[:30], append_eod=False)


def test_empty_documents_are_skipped(tmp_path, tokenizer):
    texts = ["alpha beta", "", "gamma", ""]
    stats = DatasetPreprocessor(tokenizer, num_workers=0).preprocess(
        texts, str(tmp_path / "e"), progress_bar=False
    )
    assert (stats.documents, stats.skipped_documents) == (2, 2)
    assert _stored(str(tmp_path / "e")) == expected_tokens(tokenizer, texts)


def test_text_lines_lose_only_their_line_break(tmp_path, tokenizer):
    path = tmp_path / "l.txt"
    path.write_bytes(b"  indented line\r\nplain line\n\nlast line without break")
    preprocessor = DatasetPreprocessor(tokenizer, num_workers=0)
    with open(path, encoding="utf-8", newline="") as source:
        preprocessor.preprocess(source, str(tmp_path / "l"), progress_bar=False)
    expected = expected_tokens(tokenizer, ["  indented line", "plain line", "last line without break"])
    assert _stored(str(tmp_path / "l")) == expected


def test_large_vocabulary_uses_int32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[UNK]"] = 70_000
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    preprocessor = DatasetPreprocessor(big, eod_token_id=69_999, num_workers=0)
    assert preprocessor.dtype == np.int32
    preprocessor.preprocess(["w1 w66000", "w65535 w3"], str(tmp_path / "big"), progress_bar=False)
    assert _stored(str(tmp_path / "big")) == [[1, 66000, 69_999], [65535, 3, 69_999]]
    assert IndexedDataset(str(tmp_path / "big")).dtype == np.int32


def test_progress_is_logged_without_a_bar(tmp_path, tokenizer, documents, caplog):
    with caplog.at_level(logging.INFO, logger="oslo.data.preprocess"):
        DatasetPreprocessor(tokenizer, chunk_size=50, num_workers=0).preprocess(
            documents, str(tmp_path / "log"), log_interval=100, progress_bar=False
        )
    progress = [r.getMessage() for r in caplog.records if "tokens/s" in r.getMessage()]
    assert len(progress) == 5  # at 100, 200, 300, 400 documents, plus the summary
    assert "400 documents" in progress[-1]


def test_progress_bar_shows_documents_and_tokens(tmp_path, tokenizer, documents, capsys):
    DatasetPreprocessor(tokenizer, chunk_size=50, num_workers=0).preprocess(
        documents, str(tmp_path / "bar"), log_interval=100
    )
    err = capsys.readouterr().err
    assert "400" in err and "tokens=" in err and "tok_per_s=" in err


def test_progress_bar_ends_on_the_returned_counts(tmp_path, tokenizer, documents, capsys):
    """The bar's tokens were refreshed every log_interval documents only: its last line showed the count at the
    last multiple of log_interval (134,984 where 137,245 were written). It ends on the returned counts."""
    stats = DatasetPreprocessor(tokenizer, chunk_size=50, num_workers=0).preprocess(
        documents[:350], str(tmp_path / "bar"), log_interval=100
    )
    last = capsys.readouterr().err.split("\r")[-1]
    assert f" {stats.documents}doc " in last, last
    assert f"tokens={stats.tokens:,}" in last, (last, stats)


# -- bad input ------------------------------------------------------------------------------------


def test_missing_jsonl_file(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl' does not exist.*existing \.jsonl"):
        DatasetPreprocessor(tokenizer).open_jsonl(str(tmp_path / "nope.jsonl"))


def test_wrong_json_key_fails_at_open(tmp_path, tokenizer, documents):
    path = write_jsonl(tmp_path / "c.jsonl", documents[:5], key="content")
    message = r"line 1 of .* no json_key 'text' \(found keys: \['content', 'id'\]\).*json_key="
    with pytest.raises(KeyError, match=message):
        DatasetPreprocessor(tokenizer).open_jsonl(str(path), json_key="text")


def test_wrong_json_key_in_a_later_record_fails_in_the_worker(tmp_path, tokenizer, documents):
    path = write_jsonl(tmp_path / "c.jsonl", documents[:40])
    with open(path, "a", encoding="utf-8") as stream:
        stream.write(json.dumps({"body": "no text here"}) + "\n")
    preprocessor = DatasetPreprocessor(tokenizer, chunk_size=8, num_workers=2)
    with pytest.raises(JsonKeyError, match=r"line 41 of .* no json_key 'text' \(found keys: \['body'\]\)"):
        preprocessor.preprocess(preprocessor.open_jsonl(str(path)), str(tmp_path / "out"), progress_bar=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]  # no partial output left


def test_invalid_json_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    preprocessor = DatasetPreprocessor(tokenizer, num_workers=0)
    with pytest.raises(ValueError, match=r"line 2 of .* not valid JSON"):
        preprocessor.preprocess(preprocessor.open_jsonl(str(path)), str(tmp_path / "out"), progress_bar=False)


def test_path_string_instead_of_open_file(tmp_path, tokenizer):
    with pytest.raises(TypeError, match=r"got the str 'corpus\.txt'.*pass open\(path\)"):
        DatasetPreprocessor(tokenizer).preprocess("corpus.txt", str(tmp_path / "out"))


def test_binary_file_source(tmp_path, tokenizer, documents):
    path = write_txt(tmp_path / "c.txt", documents[:3])
    with open(path, "rb") as source, pytest.raises(TypeError, match="binary mode; open it in text mode"):
        DatasetPreprocessor(tokenizer).preprocess(source, str(tmp_path / "out"))


def test_non_string_document(tmp_path, tokenizer):
    preprocessor = DatasetPreprocessor(tokenizer, num_workers=0)
    with pytest.raises(TypeError, match="document 1 of the source is of type int, not str"):
        preprocessor.preprocess(["ok", 5], str(tmp_path / "o"), progress_bar=False)


def test_missing_output_directory(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"directory .*missing' does not exist.*Create it"):
        DatasetPreprocessor(tokenizer, num_workers=0).preprocess(["a"], str(tmp_path / "missing" / "out"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"binarization_impl": "fast"}, r"binarization_impl='fast'.*\['mmap', 'lazy', 'cached'\]"),
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
        ({"num_workers": -1}, "num_workers must be an int >= 0"),
        ({"start_method": "teleport"}, "start_method='teleport' is not available"),
        ({"eod_token_id": -3}, "eod_token_id must be a non-negative int, got -3"),
    ],
)
def test_bad_constructor_arguments(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        DatasetPreprocessor(tokenizer, **kwargs)


def test_append_eod_without_eos_token(backend_tokenizer):
    with pytest.raises(ValueError, match=r"no eos_token_id\. Pass eod_token_id=<id> or append_eod=False"):
        DatasetPreprocessor(backend_tokenizer, append_eod=True)


def test_not_a_tokenizer():
    with pytest.raises(TypeError, match="tokenizer must be a Hugging Face tokenizer"):
        DatasetPreprocessor(object(), append_eod=False)


def test_bad_log_interval(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="log_interval must be a positive int"):
        DatasetPreprocessor(tokenizer).preprocess(["a"], str(tmp_path / "o"), log_interval=0)


class WordLengthTokenizer:
    """A pure-Python stand-in for a slow Hugging Face tokenizer: one id (the word length) per word."""

    eos_token_id = 99

    def __len__(self) -> int:
        return 100

    def __call__(self, texts):
        if isinstance(texts, str):
            return {"input_ids": [len(word) for word in texts.split()]}
        return {"input_ids": [[len(word) for word in text.split()] for text in texts]}


def test_python_tokenizer_runs_in_the_worker_pool(tmp_path, documents):
    tokenizer = WordLengthTokenizer()
    preprocessor = DatasetPreprocessor(tokenizer, chunk_size=10, num_workers=2)
    preprocessor.preprocess(documents[:60], str(tmp_path / "py"), progress_bar=False)
    assert _stored(str(tmp_path / "py")) == expected_tokens(tokenizer, documents[:60])
