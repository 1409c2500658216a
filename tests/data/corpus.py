"""Helpers for the data tests: a generated corpus and the token ids the preprocessor must store."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOD = "<|endoftext|>"

_SYLLABLES = ["ka", "to", "ri", "men", "sa", "lo", "pe", "an", "ther", "ing", "ed", "re", "con", "di"]


def make_documents(count: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """Deterministic pseudo-text documents of varying length (including some very short ones)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    documents = []
    for _ in range(count):
        length = rng.randint(1, max_words)
        text = " ".join(rng.choice(words) for _ in range(length))
        documents.append(text.capitalize() + rng.choice([".", "!", "?", ", ünï 42."]))
    return documents


def write_txt(path: Path, documents: list[str]) -> Path:
    path.write_text("".join(document + "\n" for document in documents), encoding="utf-8")
    return path


def write_jsonl(path: Path, documents: list[str], key: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as stream:
        for number, document in enumerate(documents):
            stream.write(json.dumps({key: document, "id": number}) + "\n")
    return path


def expected_tokens(tokenizer, documents: list[str], append_eod: bool = True) -> list[list[int]]:
    """What the preprocessor must store: tokenizer(document) ids, plus EOD, empty documents skipped."""
    rows = []
    for document in documents:
        ids = tokenizer(document)["input_ids"] if document else []
        if ids:
            rows.append(ids + ([tokenizer.eos_token_id] if append_eod else []))
    return rows
