"""A text-generation web server on a model split over worker processes (oslo's deployment launcher).

    python examples/deployment_server.py CHECKPOINT --tensor-parallel-size 2 --port 5000

Started with plain ``python`` (no ``torchrun``): ``deployment=True`` starts the model's processes. Flask's
threaded server answers requests on several threads; the deployed model runs their calls one at a time.

    curl -X POST localhost:5000/generate -H 'Content-Type: application/json' \\
         -d '{"input_ids": [5, 6, 7, 8], "max_new_tokens": 8, "num_beams": 5, "no_repeat_ngram_size": 4}'
    {"output_ids": [[5, 6, 7, 8, ...]]}

``"text": "..."`` instead of ``input_ids`` works when the checkpoint directory has a tokenizer (the
answer then has ``"text"`` too). ``GET /health`` answers ``{"ok": true}`` once the model is loaded.
"""

from __future__ import annotations

import argparse

import torch
from flask import Flask, jsonify, request

import oslo

GENERATE_OPTIONS = {"max_new_tokens": int, "num_beams": int, "no_repeat_ngram_size": int, "do_sample": bool,
                    "top_k": int, "top_p": float, "temperature": float}


def create_app(model, tokenizer=None) -> Flask:
    app = Flask(__name__)

    @app.get("/health")
    def health():
        return jsonify(ok=True)

    @app.post("/generate")
    def generate():
        body = request.get_json(force=True)
        if "input_ids" in body:
            ids = body["input_ids"]
            input_ids = torch.tensor(ids if ids and isinstance(ids[0], list) else [ids], dtype=torch.long)
        elif "text" in body and tokenizer is not None:
            input_ids = tokenizer(body["text"], return_tensors="pt")["input_ids"]
        else:
            return jsonify(error="send input_ids (a list of token ids)"
                           + (" or text" if tokenizer is not None else "")), 400
        options = {name: kind(body[name]) for name, kind in GENERATE_OPTIONS.items() if name in body}
        options.setdefault("max_new_tokens", 16)
        try:
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **options)
        except (IndexError, ValueError) as exc:  # out-of-vocabulary ids, bad options: the client's fault
            return jsonify(error=f"{type(exc).__name__}: {exc}"), 400
        answer = {"output_ids": output.tolist()}
        if tokenizer is not None:
            answer["text"] = tokenizer.batch_decode(output, skip_special_tokens=True)
        return jsonify(answer)

    return app


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
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    except Exception:  # noqa: BLE001 - no tokenizer: token ids only
        pass
    with model:
        print(f"serving {args.model_class} on http://{args.host}:{args.port} (workers {model.worker_pids})",
              flush=True)
        create_app(model, tokenizer).run(host=args.host, port=args.port, threaded=True)


if __name__ == "__main__":  # required: the model's worker processes import this module
    main()
