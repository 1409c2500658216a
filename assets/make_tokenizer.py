"""Train the small byte-level BPE tokenizer bundled in ``assets/tokenizer/``.

GPT-2 style: ByteLevel pre-tokenizer / decoder / post-processor, one special
token ``<|endoftext|>`` (id 0) used as bos/eos/unk/pad, 2001 tokens in all
(odd on purpose, so tensor-parallel vocab padding is exercised).

Training is deterministic: the same corpus gives a byte-identical
``tokenizer.json``.  Run from anywhere::

    python assets/make_tokenizer.py

Requires ``tokenizers`` and ``transformers``.  The demo uses the bundled
output and does not need to run this.
"""

import json
import os
from pathlib import Path

# Deterministic and quiet; a single thread also keeps it reproducible.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.txt"
OUT_DIR = HERE / "tokenizer"
VOCAB_SIZE = 2001
SPECIAL = "<|endoftext|>"
MODEL_MAX_LENGTH = 128


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    return tok


def main() -> None:
    tok = build()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL,
        eos_token=SPECIAL,
        unk_token=SPECIAL,
        pad_token=SPECIAL,
        model_max_length=MODEL_MAX_LENGTH,
    )
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(OUT_DIR))
    # Name the class by its long-standing public alias rather than the
    # v5-internal "TokenizersBackend", so AutoTokenizer resolves it in any
    # transformers release.
    config_path = OUT_DIR / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"saved {OUT_DIR}: vocab size {len(fast)}, {SPECIAL} id {fast.convert_tokens_to_ids(SPECIAL)}")


if __name__ == "__main__":
    main()
