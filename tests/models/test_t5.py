"""What is T5's own: collectives per encoder and decoder block, decoding steps that skip the encoder's
stages, a weight tied over three stages, the position tables shipped between stages, EOS pooling's check,
fused n-gram blocking, activation checkpointing, dropout across tensor-parallel ranks, and bad input.
Every class at every layout, pipeline training, generate() and checkpoints: tests/models/test_zoo.py
(cases in tests/models/cases_t5.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

import oslo
from oslo.parallel.plan import parameter_specs
from tests.distributed import run_distributed
from tests.helpers import CountAllReduces, full_grads, full_params, save_reference
from tests.models.cases_t5 import EOS, seq2seq_batch, tiny_t5_config, tokens


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("t5")
    save_reference(transformers.T5ForConditionalGeneration, tiny_t5_config(), directory)
    return str(directory)


def _block_all_reduces(rank, world_size, path):
    """(forward, backward) all-reduces of an encoder block and of a decoder block (the encoder's output
    given as the body passes it: already in the tensor-parallel region)."""
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, 32, generator=generator).requires_grad_()
    encoder_states = torch.randn(2, 5, 32, generator=generator).requires_grad_()
    counts = {}
    for name, block, args in [("encoder", model.encoder.block[1], ()),
                              ("decoder", model.decoder.block[1], (None, None, encoder_states))]:
        with CountAllReduces() as forward:
            out = block(hidden, *args)[0]
        with CountAllReduces() as backward:
            out.square().sum().backward()
        counts[name] = (forward.count, backward.count)
    return counts


def test_collectives_per_block(path):
    """Megatron's minimum: 2 + 2 per encoder block, 3 + 3 per decoder block (cross-attention's query input
    and output; its keys and values read the encoder's output, copied into the region once per stage)."""
    results = run_distributed(_block_all_reduces, 2, path)
    assert results == [{"encoder": (2, 2), "decoder": (3, 3)}] * 2, results


def _decoding_skips_encoder_stages(rank, world_size, path):
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(path, pipeline_parallel_size=4)
    calls = {}
    for stack in ("encoder", "decoder"):
        for block in getattr(model, stack).block:
            index = next(i for i, b in getattr(model, stack).block._modules.items() if b is block)
            block.register_forward_hook(lambda *_, key=(stack, int(index)): calls.update({key: calls.get(key, 0) + 1}))
    batch = tokens()
    model.generate(input_ids=batch["input_ids"][:2], attention_mask=batch["attention_mask"][:2], max_new_tokens=5,
                   min_new_tokens=5, do_sample=False)
    return model.parallel_context.pipeline_parallel_rank, calls


def test_decoding_steps_skip_the_encoders_stages(path):
    """At pp=4 (e0 | e1 e2 | d0 | d1: the shared embedding weighs on stage 0, and the largest stage, a
    decoder block with the tied LM head or the decoder's copy of the embedding, is as small as it can be):
    generate() runs each encoder block once and each decoder block once per step (5 steps); the encoder's
    stages take no part in the steps."""
    results = dict(run_distributed(_decoding_skips_encoder_stages, 4, path))
    assert results == {
        0: {("encoder", 0): 1},
        1: {("encoder", 1): 1, ("encoder", 2): 1},
        2: {("decoder", 0): 5},
        3: {("decoder", 1): 5},
    }, results


def _hand_written_decoding(rank, world_size, path, tp, pp):
    """Greedy decoding written by hand, passing the returned cache back with the encoder's output (as transformers'
    docs decode step by step): every step's logits, oslo's and transformers'."""
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp).eval()
    reference = transformers.T5ForConditionalGeneration.from_pretrained(path).eval()
    input_ids = seq2seq_batch()["input_ids"][:2]
    steps = {"oslo": [], "transformers": []}
    with torch.no_grad():
        for name, decoder in (("oslo", model), ("transformers", reference)):
            next_ids = torch.zeros(2, 1, dtype=torch.long)  # the decoder's start token
            output = decoder(input_ids=input_ids, decoder_input_ids=next_ids, use_cache=True)
            encoder_outputs = (output.encoder_last_hidden_state,)
            for _ in range(4):
                steps[name].append(output.logits[:, -1])
                next_ids = output.logits[:, -1:].argmax(-1)
                output = decoder(encoder_outputs=encoder_outputs, decoder_input_ids=next_ids,
                                 past_key_values=output.past_key_values, use_cache=True)
            steps[name].append(output.logits[:, -1])
    return steps


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_a_hand_written_decoding_loop_with_pipelines(path, tp, pp):
    """Under pipelines the encoder's stages hold no decoder layer and cache nothing, yet every stage must describe
    the cache it is given alike (the input check compares it across the ranks): each records the positions cached
    so far. Before, the second decoding step raised InputMismatchError ("holding 0 positions" against 1)."""
    for steps in run_distributed(_hand_written_decoding, tp * pp, path, tp, pp, timeout=80):
        for step, (ours, theirs) in enumerate(zip(steps["oslo"], steps["transformers"], strict=True)):
            torch.testing.assert_close(ours, theirs, msg=lambda m, s=step: f"step {s}: {m}")


def _tie_and_tables(rank, world_size, path):
    """Gradients of a pipeline training step at pp=4: the embedding tied over stages 0 (shared), 2 (the
    decoder's embed_tokens) and 3 (lm_head) gets the sum of the three uses on each; the position tables
    (held by stages 0 and 2) get the gradients of the layers on later stages, which they never hold."""
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(path, pipeline_parallel_size=4,
                                                                           micro_batch_size=2).train()
    for micro_output in model(**seq2seq_batch()):
        micro_output.loss.backward()
    return {name: param.grad for name, param in model.named_parameters(remove_duplicate=False)}


def test_tied_embedding_over_three_stages_and_shipped_position_tables(path):
    reference = transformers.T5ForConditionalGeneration.from_pretrained(path).train()
    reference(**seq2seq_batch()).loss.backward()
    grads = run_distributed(_tie_and_tables, 4, path)
    copies = {0: "shared.weight", 2: "decoder.embed_tokens.weight", 3: "lm_head.weight"}
    for stage, name in copies.items():
        torch.testing.assert_close(grads[stage][name], reference.shared.weight.grad, msg=lambda m, n=name: f"{n}: {m}")
    for name in ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"):
        holder = 0 if name.startswith("encoder") else 2
        assert all(name not in grads[stage] for stage in range(4) if stage != holder)
        torch.testing.assert_close(grads[holder][name], reference.get_parameter(name).grad)


def _eos_check(rank, world_size, path, tp, pp):
    model = oslo.T5ForSequenceClassification.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_labels=3)
    batch = tokens()
    batch["input_ids"][2, 3] = EOS  # row 2 now holds two EOS tokens, the others one
    with pytest.raises(ValueError, match=r"same number of <eos> tokens.*\[1, 1, 2, 1\]"):
        model(**batch, labels=torch.tensor([0, 1, 2, 0]))
    del batch["input_ids"]
    with pytest.raises(NotImplementedError, match="input embeddings"):
        model(inputs_embeds=torch.zeros(4, 10, 32), **batch)
    return True


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_rows_with_different_eos_counts_raise_on_every_rank(path, tp, pp):
    assert run_distributed(_eos_check, tp * pp, path, tp, pp) == [True] * (tp * pp)


def _fused_ngram_and_checkpointing(rank, world_size, path):
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    reference = transformers.T5ForConditionalGeneration.from_pretrained(path)
    batch = tokens()
    common = dict(input_ids=batch["input_ids"][:3], attention_mask=batch["attention_mask"][:3], max_new_tokens=8,
                  num_beams=3, no_repeat_ngram_size=2, do_sample=False)
    expected = reference.generate(**common)
    assert torch.equal(model.generate(**common, fused_no_repeat_ngram_blocking=True), expected)

    # Activation checkpointing recomputes the blocks in the backward pass: the same loss and gradients.
    model.train()
    model(**seq2seq_batch()).loss.backward()
    plain = full_grads(model)
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(**seq2seq_batch()).loss.backward()
    for name, grad in full_grads(model).items():
        torch.testing.assert_close(grad, plain[name], msg=lambda m, n=name: f"{n}: {m}")
    return True


def test_fused_ngram_blocking_and_activation_checkpointing(path):
    assert run_distributed(_fused_ngram_and_checkpointing, 2, path) == [True, True]


def _dropout_steps(rank, world_size, path):
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(
        path, tensor_parallel_size=world_size, dropout_rate=0.3).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(**seq2seq_batch()).loss.backward()
        optimizer.step()
    specs = parameter_specs(model)
    replicated = {name: param.detach() for name, param in model.named_parameters() if specs[name] is None}
    return replicated, full_params(model)


def test_replicated_weights_stay_identical_with_dropout(path):
    """With dropout on (attention probabilities and feed-forward columns drawn per rank, everything else
    alike), three AdamW steps at tp=2 leave the replicated weights (layer norms) bit-identical on the ranks."""
    (first, _), (second, _) = run_distributed(_dropout_steps, 2, path)
    assert first and sorted(first) == sorted(second)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name


def _bad_layout(rank, world_size, path, error, fragments, **kwargs):
    with pytest.raises(error) as info:
        oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(path, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"
    return True


def test_heads_not_divisible_and_too_many_stages(path, tmp_path):
    run_distributed(_bad_layout, 3, path, ValueError, ["tensor_parallel_size=3", "num_heads=4", "[1, 2, 4]"],
                    tensor_parallel_size=3)
    run_distributed(_bad_layout, 6, path, ValueError, ["pipeline_parallel_size=6 exceeds the number of layers (5)"],
                    pipeline_parallel_size=6)
    save_reference(transformers.BertForMaskedLM, transformers.BertConfig(
        vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32), tmp_path)
    with pytest.raises(ValueError, match="holds a 'bert' checkpoint, but T5ForConditionalGeneration is a 't5' model"):
        oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(str(tmp_path))


def _random_init(rank, world_size, name, tp, pp):
    model = getattr(oslo, name).from_config_with_parallel(tiny_t5_config(num_labels=3), tensor_parallel_size=tp,
                                                          pipeline_parallel_size=pp, seed=5)
    return full_params(model), sorted(dict(model.named_parameters(remove_duplicate=False)))


@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "T5ForSequenceClassification"])
def test_random_init_is_the_same_at_every_layout(name):
    """from_config_with_parallel(seed=...) gives the same weights at (1, 1), (2, 1) and (1, 2); the copies of
    the tied embedding on later stages (the decoder's, lm_head) start as shared does, nested models too."""
    (single, _), = run_distributed(_random_init, 1, name, 1, 1)
    for tp, pp in [(2, 1), (1, 2)]:
        for params, _ in run_distributed(_random_init, tp * pp, name, tp, pp):
            for param_name, value in params.items():
                source = param_name if param_name in single else param_name.replace(
                    "decoder.embed_tokens", "shared").replace("lm_head", "shared")
                torch.testing.assert_close(value, single[source], rtol=0, atol=0,
                                           msg=lambda m, n=param_name, at=(tp, pp): f"{n} at {at}: {m}")


def _encoder_alone(rank, world_size, path, tp, pp):
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(path, tensor_parallel_size=tp,
                                                                           pipeline_parallel_size=pp)
    batch = tokens()
    with torch.no_grad():
        return (model.encoder(**batch, output_hidden_states=True),
                model.get_encoder()(**batch, return_dict=False)[0])


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_the_encoder_alone_on_every_rank(path, tp, pp):
    """model.encoder(...) and model.get_encoder()(...), as transformers users call them: the encoder's output
    (and hidden states) on every rank, over the stages that hold the encoder."""
    reference = transformers.T5ForConditionalGeneration.from_pretrained(path)
    expected = reference.encoder(**tokens(), output_hidden_states=True)
    for output, plain in run_distributed(_encoder_alone, tp * pp, path, tp, pp):
        torch.testing.assert_close(output.last_hidden_state, expected.last_hidden_state)
        torch.testing.assert_close(plain, expected.last_hidden_state)
        assert len(output.hidden_states) == len(expected.hidden_states) == 4
        for ours, theirs in zip(output.hidden_states, expected.hidden_states, strict=True):
            torch.testing.assert_close(ours, theirs)


def _per_layer_outputs_under_pipelines(rank, world_size, path, encoder_path):
    """Hidden states and attentions at pipeline_parallel_size 2 where some stages run no layer: a call given the
    encoder's output (the encoder's stage runs nothing; generate()'s decoding steps make this call), and
    T5EncoderModel (transformers' encoder stack returns an empty cross_attentions with its attentions)."""
    from transformers.modeling_outputs import BaseModelOutput

    from tests.models.zoo import compare_outputs

    reference = transformers.T5ForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(
        path, pipeline_parallel_size=2, attn_implementation="eager", timeout=60)
    batch = tokens()
    decoder_input_ids = batch["input_ids"][:, :3]
    with torch.no_grad():
        encoder_outputs = BaseModelOutput(last_hidden_state=reference.encoder(**batch).last_hidden_state)
        for flags in ({"output_hidden_states": True}, {"output_attentions": True}):
            call = dict(encoder_outputs=encoder_outputs, attention_mask=batch["attention_mask"],
                        decoder_input_ids=decoder_input_ids, **flags)
            compare_outputs(model(**call), reference(**call), f"encoder_outputs given, {flags}")
        options = dict(max_new_tokens=3, output_hidden_states=True, output_attentions=True,
                       return_dict_in_generate=True)
        ours, theirs = model.generate(**batch, **options), reference.generate(**batch, **options)
        torch.testing.assert_close(ours.sequences, theirs.sequences)
        for field in ("decoder_hidden_states", "decoder_attentions", "cross_attentions"):
            for step, (mine, expected) in enumerate(zip(getattr(ours, field), getattr(theirs, field), strict=True)):
                compare_outputs({field: mine}, {field: expected}, f"generate, step {step}")
        encoder = oslo.T5EncoderModel.from_pretrained_with_parallel(
            encoder_path, pipeline_parallel_size=2, attn_implementation="eager", timeout=60)
        expected = transformers.T5EncoderModel.from_pretrained(encoder_path, attn_implementation="eager")(
            **batch, output_attentions=True, output_hidden_states=True)
        compare_outputs(encoder(**batch, output_attentions=True, output_hidden_states=True), expected,
                        "T5EncoderModel")
    return "ok"


def test_per_layer_outputs_when_a_stage_runs_no_layer(path, tmp_path):
    save_reference(transformers.T5EncoderModel, tiny_t5_config(), str(tmp_path))
    assert run_distributed(_per_layer_outputs_under_pipelines, 2, path, str(tmp_path), timeout=120) == ["ok"] * 2


def _static_cache_generation(rank, world_size, path, tp, pp):
    reference = transformers.T5ForConditionalGeneration.from_pretrained(path).eval()
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(path, tensor_parallel_size=tp,
                                                                           pipeline_parallel_size=pp)
    batch = tokens()
    options = dict(max_new_tokens=6, cache_implementation="static")
    with torch.no_grad():
        torch.testing.assert_close(model.generate(**batch, **options), reference.generate(**batch, **options))
    return "ok"


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_generate_with_a_static_cache(path, tp, pp):
    """``cache_implementation="static"`` (a fixed-size cache, what a compiled generate uses): the decoder's
    position bias spans every slot of the cache, as its keys and mask do (the unfilled ones masked)."""
    assert run_distributed(_static_cache_generation, tp * pp, path, tp, pp) == ["ok"] * (tp * pp)


def _float16(rank, world_size, path, tp, pp):
    reference = transformers.T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float16).eval()
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype=torch.float16)
    dtypes = {name: param.dtype for name, param in model.named_parameters()}
    expected = {name: param.dtype for name, param in reference.named_parameters(remove_duplicate=False)}
    assert dtypes == {name: expected[name] for name in dtypes}
    assert {dtype for name, dtype in dtypes.items() if ".wo." in name} == {torch.float32}
    batch = seq2seq_batch()
    with torch.no_grad():
        # tensor parallelism sums float16 partial products in another order: float16's resolution, not fp32's
        tolerance = {} if tp == 1 else {"atol": 2e-3, "rtol": 1e-2}
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, **tolerance)
    return "ok"


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_float16_keeps_wo_in_float32(path, tp, pp):
    """transformers' ``_keep_in_fp32_modules = ["wo"]``: loaded in float16, T5's feed-forward output projections
    stay float32 (real T5 checkpoints overflow float16 there), and the logits are transformers' float16 ones."""
    assert run_distributed(_float16, tp * pp, path, tp, pp) == ["ok"] * (tp * pp)


def test_generate_ignores_labels_as_transformers_does(path):
    """``generate(..., labels=...)`` (Seq2SeqTrainer's ``predict_with_generate`` passes the batch's labels):
    transformers' encoder ignores them, and so does oslo's."""
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(path)
    reference = transformers.T5ForConditionalGeneration.from_pretrained(path)
    batch = seq2seq_batch()
    with torch.no_grad():
        torch.testing.assert_close(model.generate(**batch, max_new_tokens=4),
                                   reference.generate(**batch, max_new_tokens=4))


def _more_decoder_layers(rank, world_size, path, tp, pp):
    reference = transformers.T5ForConditionalGeneration.from_pretrained(path).eval()
    model = oslo.T5ForConditionalGeneration.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp).eval()
    batch = seq2seq_batch()
    with torch.no_grad():
        ours = model(**batch, use_cache=True)
        theirs = reference(**batch, use_cache=True)
    torch.testing.assert_close(ours.logits, theirs.logits)
    if pp == 1:
        assert len(ours.past_key_values.self_attention_cache.layers) == 4
    options = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=5,
                   do_sample=False)
    # transformers' own generate() builds its cache from num_layers (the encoder's 1) and fails on the decoder's
    # second layer: the tokens it would give are its uncached ones.
    for beams in (1, 2):
        torch.testing.assert_close(model.generate(**options, num_beams=beams),
                                   reference.generate(**options, num_beams=beams, use_cache=False))
    return "ok"


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_more_decoder_layers_than_encoder_layers(tmp_path, tp, pp):
    """``num_decoder_layers`` above ``num_layers`` (as in the t5-efficient ``dl`` checkpoints): a call with
    ``use_cache=True`` caches each of the decoder's layers, as transformers' decoder stack does, and generate()
    gives transformers' tokens, greedy and beam."""
    save_reference(transformers.T5ForConditionalGeneration, tiny_t5_config(num_layers=1, num_decoder_layers=4),
                   tmp_path)
    assert run_distributed(_more_decoder_layers, tp * pp, str(tmp_path), tp, pp, timeout=120) == ["ok"] * (tp * pp)
