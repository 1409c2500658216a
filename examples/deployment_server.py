"""A text-generation web server on a model split over worker processes (oslo's deployment launcher).

    python examples/deployment_server.py CHECKPOINT --tensor-parallel-size 2 --port 5000

Started with plain ``python`` (no ``torchrun``): ``deployment=True`` starts the model's processes. Flask's
threaded server answers requests on several threads; the deployed model runs their calls one at a time.

    curl -X POST localhost:5000/generate -H 'Content-Type: application/json' \\
         -d '{"input_ids": [5, 6, 7, 8], "max_new_tokens": 8, "num_beams": 5, "no_repeat_ngram_size": 4}'
    {"output_ids": [[5, 6, 7, 8, ...]]}

``"text": "..."`` instead of ``input_ids`` works when the checkpoint directory has a tokenizer (the
answer then has ``"text"`` too). ``GET /health`` answers ``{"ok": true}`` once the model is loaded.

A request the server cannot run is the client's error: HTTP 400 with ``{"error": "<the reason>"}`` (a body
that is not a JSON object, neither or both of ``input_ids`` and ``text``, empty or non-integer ids, ids
outside the vocabulary, ``text`` without a tokenizer, an unknown field, an option of the wrong type or
range, a prompt plus ``max_new_tokens`` longer than the model's positions).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from flask import Flask, jsonify, request

import oslo

# option -> (its type, the check of its value, the rule in words)
GENERATE_OPTIONS = {
    "max_new_tokens": (int, lambda v: v >= 1, "an integer >= 1"),
    "num_beams": (int, lambda v: v >= 1, "an integer >= 1"),
    "no_repeat_ngram_size": (int, lambda v: v >= 0, "an integer >= 0"),
    "do_sample": (bool, lambda v: True, "true or false"),
    "top_k": (int, lambda v: v >= 0, "an integer >= 0"),
    "top_p": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "temperature": (float, lambda v: v > 0, "a number > 0"),
}
DEFAULT_MAX_NEW_TOKENS = 16


class BadRequest(ValueError):
    """A request the server cannot run; its message is the reason sent back with HTTP 400."""


def _has_type(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON true is no number
        return False
    return isinstance(value, int) if kind is int else isinstance(value, (int, float))


def _input_ids(ids: Any, vocab_size: int | None) -> torch.Tensor:
    """``input_ids`` of a request: a non-empty list of token ids, or a list of such lists of one length."""
    rows = ids if isinstance(ids, list) and ids and all(isinstance(row, list) for row in ids) else [ids]
    for row in rows:
        if not isinstance(row, list) or not row:
            raise BadRequest(f"input_ids must be a non-empty list of token ids (or a list of such lists), got "
                             f"{row!r}: send e.g. {{\"input_ids\": [5, 6, 7]}}")
        wrong = next((value for value in row if not _has_type(value, int)), None)
        if wrong is not None:
            raise BadRequest(f"input_ids must hold integer token ids, got {wrong!r}")
    if len({len(row) for row in rows}) > 1:
        raise BadRequest(f"the rows of input_ids have different lengths {[len(row) for row in rows]}: send rows of "
                         "one length, or one request per prompt")
    if vocab_size is not None:
        outside = next((value for row in rows for value in row if not 0 <= value < vocab_size), None)
        if outside is not None:
            raise BadRequest(f"input_ids hold {outside}, outside the vocabulary [0, {vocab_size}) of this model")
    return torch.tensor(rows, dtype=torch.long)


def parse_generate_request(body: Any, config: Any, tokenizer: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The prompt and ``generate()`` options of a ``/generate`` request body (parsed JSON).

    Raises:
        BadRequest: naming what is wrong with the request and what to send instead.
    """
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object such as {"input_ids": [5, 6, 7], "max_new_tokens": 8}, got '
                         f"{'no JSON' if body is None else type(body).__name__}")
    known = {"input_ids", "text", *GENERATE_OPTIONS}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}: the fields are {sorted(known)}")
    if "input_ids" in body and "text" in body:
        raise BadRequest("send input_ids or text, not both")
    if "input_ids" not in body and "text" not in body:
        alternative = " or text (a string)" if tokenizer is not None else ""
        raise BadRequest(f"send input_ids (a list of token ids){alternative}")
    vocab_size = getattr(config, "vocab_size", None)
    if "text" in body:
        text = body["text"]
        if tokenizer is None:
            raise BadRequest("this server has no tokenizer (the checkpoint has no tokenizer files): send input_ids "
                             "(a list of token ids) instead of text")
        if not isinstance(text, str) or not text:
            raise BadRequest(f"text must be a non-empty string, got {text!r}")
        ids = tokenizer(text)["input_ids"]
        if not ids:
            raise BadRequest(f"the text {text!r} encodes to no tokens: send some text the tokenizer knows")
        input_ids = _input_ids(ids, vocab_size)
    else:
        input_ids = _input_ids(body["input_ids"], vocab_size)
    options = {}
    for name, (kind, valid, rule) in GENERATE_OPTIONS.items():
        if name not in body:
            continue
        value = body[name]
        if not _has_type(value, kind) or not valid(value):
            raise BadRequest(f"{name} must be {rule}, got {value!r}")
        options[name] = value
    options.setdefault("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and input_ids.shape[1] + options["max_new_tokens"] > positions:
        raise BadRequest(f"the prompt's {input_ids.shape[1]} tokens plus max_new_tokens={options['max_new_tokens']} "
                         f"exceed the {positions} positions of this model: send a shorter prompt or fewer new tokens")
    return input_ids, options


def create_app(model, tokenizer=None) -> Flask:
    app = Flask(__name__)

    @app.get("/health")
    def health():
        return jsonify(ok=True)

    @app.post("/generate")
    def generate():
        try:
            input_ids, options = parse_generate_request(request.get_json(force=True, silent=True), model.config,
                                                        tokenizer)
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **options)
        except BadRequest as exc:
            return jsonify(error=str(exc)), 400
        except (IndexError, ValueError) as exc:  # what the model refuses (options that clash): the client's fault
            return jsonify(error=f"{type(exc).__name__}: {exc}"), 400
        answer = {"output_ids": output.tolist()}
        if tokenizer is not None:
            answer["text"] = tokenizer.batch_decode(output, skip_special_tokens=True)
        return jsonify(answer)

    return app


def load_tokenizer(checkpoint: str):
    """The checkpoint's tokenizer, or ``None`` when it has none: ``AutoTokenizer`` builds a tokenizer with an empty
    vocabulary from a directory that holds only a model's files, which would turn every text into no tokens."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    except Exception:  # noqa: BLE001 - no tokenizer: token ids only
        return None
    if not tokenizer("Hello world")["input_ids"]:
        return None
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory (merged or split) or a Hub name")
    parser.add_argument("--model-class", default="GPT2LMHeadModel", help="an oslo class with generate()")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--fuse", action="store_true", help="fuse kernels (model.fuse())")
    args = parser.parse_args()

    model = getattr(oslo, args.model_class).from_pretrained_with_parallel(
        args.checkpoint, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, deployment=True)
    if args.fuse:
        model.fuse()
    tokenizer = load_tokenizer(args.checkpoint)
    if tokenizer is None:
        print(f"no tokenizer in {args.checkpoint}: requests must send input_ids", file=sys.stderr, flush=True)
    with model:
        print(f"serving {args.model_class} on http://{args.host}:{args.port} (workers {model.worker_pids})",
              flush=True)
        create_app(model, tokenizer).run(host=args.host, port=args.port, threaded=True)


if __name__ == "__main__":  # required: the model's worker processes import this module
    main()
