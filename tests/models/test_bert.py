"""What is BERT's own: two all-reduces per block each way with three q/k/v weights, eager attention weights,
the position and token-type buffers, the fused path (``model.fuse()``) and the activations it may fuse,
the masked-LM loss on vocabulary-split logits, decoder bias ties (tied and untied checkpoints), seeded
initialization across layouts, no KV cache for an encoder in a pipeline pass, and bad input.
Every class at every layout, pipeline training, generate() and checkpoints: tests/models/test_zoo.py
(cases in tests/models/cases_bert.py)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.cache_utils import DynamicCache

import oslo
from oslo.models.compat import CACHE_FIELD
from oslo.parallel.layers import VocabParallelLMHead
from tests.distributed import run_distributed
from tests.helpers import CountAllReduces, full_grads, save_reference, tiny_gpt2_config
from tests.models import zoo
from tests.models.cases_bert import VOCAB, causal_lm_batch, masked_lm_batch, tiny_bert_config, tokens

SEED = 7


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    saved = {}
    for name, cls, config in [
        ("mlm", transformers.BertForMaskedLM, tiny_bert_config()),
        ("lm", transformers.BertLMHeadModel, tiny_bert_config(is_decoder=True)),
        ("pretraining", transformers.BertForPreTraining, tiny_bert_config()),  # has the pooler
    ]:
        saved[name] = str(root / name)
        save_reference(cls, config, saved[name])
    # Untied: the decoder has its own weight and bias (the latter used; cls.predictions.bias is not).
    torch.manual_seed(1)
    untied = transformers.BertForMaskedLM(tiny_bert_config(tie_word_embeddings=False))
    with torch.no_grad():
        untied.cls.predictions.decoder.bias.normal_()
        untied.cls.predictions.bias.normal_()
    saved["untied"] = str(root / "untied")
    untied.save_pretrained(saved["untied"])
    saved["scratch"] = str(root / "scratch")
    return saved


def _untied_case() -> zoo.Case:
    return zoo.Case("bert-untied", "BertForMaskedLM", lambda: tiny_bert_config(tie_word_embeddings=False),
                    masked_lm_batch)


def _check_untied_parity(path: str, tp: int, pp: int) -> None:
    """The zoo's parity check on the untied checkpoint (its ``cls.predictions.bias`` is outside the graph:
    transformers uses the decoder's own bias, so neither has a gradient for it)."""
    zoo.check_parity(_untied_case(), path, tp, pp)


class _CountCaches:
    """Counts the ``DynamicCache`` objects built and the keys/values written into any of them."""

    def __enter__(self):
        self.built, self.updates = 0, 0
        self.init, self.update = DynamicCache.__init__, DynamicCache.update
        counter = self

        def init(cache, *args, **kwargs):
            counter.built += 1
            counter.init(cache, *args, **kwargs)

        def update(cache, *args, **kwargs):
            counter.updates += 1
            return counter.update(cache, *args, **kwargs)

        DynamicCache.__init__, DynamicCache.update = init, update
        return self

    def __exit__(self, *exc):
        DynamicCache.__init__, DynamicCache.update = self.init, self.update


def _outputs_and_grads(model, batch, **kwargs):
    model.zero_grad()
    output = model(**batch, output_hidden_states=True, **kwargs)
    output.loss.backward()
    return output, full_grads(model)


def _assert_same(actual, expected, what):
    (ours, our_grads), (theirs, their_grads) = actual, expected
    zoo.compare_outputs(ours, theirs, what)
    assert sorted(our_grads) == sorted(their_grads)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], msg=lambda m, n=name: f"{what} gradient of {n}: {m}")


# ---- tensor parallelism: one launch, several checks ------------------------------------------------
def _tensor_parallel_checks(rank, world_size, paths):
    tp = world_size
    # Two all-reduces forward (attention.output.dense, output.dense) and two backward (the input of q/k/v,
    # shared by the three column-parallel weights, and the input of intermediate.dense) per block.
    model = oslo.BertForMaskedLM.from_pretrained_with_parallel(paths["mlm"], tensor_parallel_size=tp)
    layer = model.bert.encoder.layer[1]
    hidden = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(3)).requires_grad_()
    with CountAllReduces() as forward:
        out, _ = layer(hidden)
    with CountAllReduces() as backward:
        out.square().sum().backward()
    assert (forward.count, backward.count) == (2, 2), (forward.count, backward.count)

    # The buffers hold transformers' values after the meta-device build; calls without token types or
    # positions read them, with eager attention the weights are the reference's (all heads, gathered).
    embeddings = model.bert.embeddings
    assert torch.equal(embeddings.position_ids, torch.arange(64)[None])
    assert torch.equal(embeddings.token_type_ids, torch.zeros(1, 64, dtype=torch.long))
    for name, key, batch in [("BertForMaskedLM", "mlm", masked_lm_batch()),
                             ("BertLMHeadModel", "lm", causal_lm_batch())]:
        batch = {k: v for k, v in batch.items() if k != "token_type_ids"}
        reference = getattr(transformers, name).from_pretrained(paths[key], attn_implementation="eager")
        model = getattr(oslo, name).from_pretrained_with_parallel(paths[key], tensor_parallel_size=tp,
                                                                  attn_implementation="eager")
        expected = reference(**batch, output_hidden_states=True, output_attentions=True)
        actual = model(**batch, output_hidden_states=True, output_attentions=True)
        assert len(actual.attentions) == 4 and actual.attentions[0].shape == (4, 4, 10, 10)
        zoo.compare_outputs(actual, expected, name)
        expected.loss.backward()
        actual.loss.backward()
        zoo.compare_grads(model, reference, name)

    # fuse() computes what the unfused model does (sdpa's boolean and eager's additive masks; bidirectional
    # and causal), gradients included, in training mode.
    for name, key, batch in [("BertForMaskedLM", "mlm", masked_lm_batch()),
                             ("BertLMHeadModel", "lm", causal_lm_batch())]:
        for attn in ("sdpa", "eager"):
            plain = getattr(oslo, name).from_pretrained_with_parallel(paths[key], tensor_parallel_size=tp,
                                                                      attn_implementation=attn).train()
            fused = getattr(oslo, name).from_pretrained_with_parallel(paths[key], tensor_parallel_size=tp,
                                                                      attn_implementation=attn).train().fuse()
            layer = fused.bert.encoder.layer[0]
            assert layer.attention.self.fused and layer.attention.output.fused and layer.output.fused
            assert layer.intermediate.gelu_approximation == "none"  # hidden_act="gelu" is the erf GeLU
            _assert_same(_outputs_and_grads(fused, batch, gather_logits=True),
                         _outputs_and_grads(plain, batch, gather_logits=True), f"fused {name} ({attn})")

    # A training call computes the masked-LM loss on the vocabulary-split logits: nothing gathers them.
    model = oslo.BertForMaskedLM.from_pretrained_with_parallel(paths["mlm"], tensor_parallel_size=tp).train()
    gather = VocabParallelLMHead.gather
    VocabParallelLMHead.gather = lambda *args: pytest.fail("the logits were gathered")
    try:
        output = model(**masked_lm_batch())
        output.loss.backward()
    finally:
        VocabParallelLMHead.gather = gather
    with pytest.raises(AttributeError, match="gather_logits=True"):
        output.logits  # noqa: B018

    # An encoder keeps no cache, even when asked for one; only a decoder does.
    model = oslo.BertModel.from_pretrained_with_parallel(paths["mlm"], tensor_parallel_size=tp)
    with torch.no_grad(), _CountCaches() as caches:
        assert model(**tokens(), use_cache=True).get(CACHE_FIELD) is None
    assert (caches.built, caches.updates) == (0, 0)

    # Untied decoder weight and bias (tie_word_embeddings=False): parity, merged checkpoint for transformers.
    _check_untied_parity(paths["untied"], tp, 1)
    zoo.check_checkpoints(_untied_case(), paths["untied"], tp, 1, os.path.join(paths["scratch"], f"tp{tp}"))

    # Seeded initialization: the merged weights are the same at every layout (compared in the test).
    model = oslo.BertForPreTraining.from_config_with_parallel(tiny_bert_config(), tensor_parallel_size=tp, seed=SEED)
    model.save_pretrained_with_parallel(os.path.join(paths["scratch"], f"init-tp{tp}"), save_with_merging=True)

    # Bad input raises on every rank, before any collective.
    model = oslo.BertForMaskedLM.from_pretrained_with_parallel(paths["mlm"], tensor_parallel_size=tp)
    batch = tokens()
    with pytest.raises(IndexError, match=r"token_type_ids hold 2 .*type_vocab_size=2"):
        model(**{**batch, "token_type_ids": batch["token_type_ids"] * 2})
    with pytest.raises(NotImplementedError, match="cross-attention"):
        model(**batch, encoder_hidden_states=torch.zeros(4, 10, 32))
    with pytest.raises(ValueError, match=r"labels hold the token id 1003"):
        model(**batch, labels=torch.full((4, 10), VOCAB))
    choices = oslo.BertForMultipleChoice.from_pretrained_with_parallel(paths["mlm"], tensor_parallel_size=tp)
    with pytest.raises(ValueError, match=r"\(batch, choices, length\) input_ids"):
        choices(**batch)
    return True


def _assert_seeded_like_one_process(directory: str) -> None:
    """Same seed, same merged weights as one process builds; the padding token's embedding is zero, the
    decoder bias starts at zero, the decoder is the word embedding."""
    model = oslo.BertForPreTraining.from_config_with_parallel(tiny_bert_config(), seed=SEED)
    ours = {name: param.detach() for name, param in model.named_parameters()}
    assert not ours["bert.embeddings.word_embeddings.weight"][0].any()
    assert not ours["cls.predictions.bias"].any()
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    theirs = load_file(os.path.join(directory, "model.safetensors"))
    assert sorted(theirs) == sorted(ours)
    for name, value in theirs.items():
        assert torch.equal(value, ours[name]), name


def test_tensor_parallel(paths):
    assert run_distributed(_tensor_parallel_checks, 2, paths, timeout=120) == [True, True]
    _assert_seeded_like_one_process(os.path.join(paths["scratch"], "init-tp2"))


# ---- pipeline parallelism: one launch ----------------------------------------------------------------
def _pipeline_checks(rank, world_size, paths):
    # The no-gradient pass of an encoder builds no cache on any stage, and returns none; a decoder's does.
    for name in ("BertModel", "BertForMaskedLM"):
        model = getattr(oslo, name).from_pretrained_with_parallel(paths["mlm"], pipeline_parallel_size=2)
        with torch.no_grad(), _CountCaches() as caches:
            output = model(**tokens(), use_cache=True) if name == "BertModel" else model(**tokens())
        assert output.get(CACHE_FIELD) is None
        assert (caches.built, caches.updates) == (0, 0), (name, caches.built, caches.updates)
    model = oslo.BertLMHeadModel.from_pretrained_with_parallel(paths["lm"], pipeline_parallel_size=2)
    with torch.no_grad(), _CountCaches() as caches:
        output = model(**tokens(left_padding=True))
    assert output.get(CACHE_FIELD) is not None and caches.built == 1 and caches.updates == 2  # this stage's layers

    _check_untied_parity(paths["untied"], 1, 2)
    zoo.check_checkpoints(_untied_case(), paths["untied"], 1, 2, os.path.join(paths["scratch"], "pp2"))

    model = oslo.BertForPreTraining.from_config_with_parallel(tiny_bert_config(), pipeline_parallel_size=2, seed=SEED)
    model.save_pretrained_with_parallel(os.path.join(paths["scratch"], "init-pp2"), save_with_merging=True)

    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 exceeds the number of layers \(1\)"):
        oslo.BertForMaskedLM.from_config_with_parallel(tiny_bert_config(num_hidden_layers=1), pipeline_parallel_size=2)
    return True


def test_pipeline(paths):
    assert run_distributed(_pipeline_checks, 2, paths, timeout=120) == [True, True]
    _assert_seeded_like_one_process(os.path.join(paths["scratch"], "init-pp2"))


# ---- single process ------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden_act, fused_as", [("gelu", "none"), ("gelu_new", "tanh"), ("relu", None)])
def test_activation_is_honoured_fused_or_not(tmp_path, hidden_act, fused_as):
    """Each activation is transformers' (erf GeLU is not the tanh approximation); fuse() uses the bias-GeLU
    kernel only for the GeLU it computes exactly, and leaves any other activation unfused."""
    config = tiny_bert_config(hidden_act=hidden_act)
    reference = save_reference(transformers.BertForMaskedLM, config, tmp_path)
    batch = masked_lm_batch()
    expected = reference(**batch, output_hidden_states=True)
    for fuse in (False, True):
        model = oslo.BertForMaskedLM.from_pretrained_with_parallel(str(tmp_path))
        if fuse:
            model.fuse()
            assert model.bert.encoder.layer[0].intermediate.gelu_approximation == fused_as
        zoo.compare_outputs(model(**batch, output_hidden_states=True), expected, f"{hidden_act} fuse={fuse}")


def test_model_without_pooler_and_positional_flag(paths):
    """``add_pooling_layer`` as in transformers, by keyword or in its positional place."""
    config = tiny_bert_config()
    for model in (oslo.BertModel(config, False), oslo.BertModel(config, add_pooling_layer=False)):
        assert model.pooler is None and not any(name.startswith("pooler") for name, _ in model.named_parameters())
        assert model(**tokens()).pooler_output is None


def test_bad_configurations(paths, tmp_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4.*\[1, 2, 4\]"):
        oslo.BertForMaskedLM.from_pretrained_with_parallel(paths["mlm"], tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4"):
        oslo.BertForMaskedLM.from_config_with_parallel(tiny_bert_config(), tensor_parallel_size=3)
    with pytest.raises(NotImplementedError, match="add_cross_attention=True"):
        oslo.BertLMHeadModel.from_config_with_parallel(tiny_bert_config(is_decoder=True, add_cross_attention=True))
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), tmp_path)
    with pytest.raises(ValueError, match=r"holds a 'gpt2' checkpoint, but BertForMaskedLM is a 'bert' model"):
        oslo.BertForMaskedLM.from_pretrained_with_parallel(str(tmp_path))


def test_inputs_embeds_and_gradient_checkpointing(paths, tmp_path):
    """``inputs_embeds`` (multiple choice's ``(batch, choices, length, hidden)`` too) and activation
    checkpointing give transformers' outputs and gradients."""
    batch = tokens()
    embeds = torch.randn(4, 10, 32, generator=torch.Generator().manual_seed(4))
    reference = transformers.BertModel.from_pretrained(paths["pretraining"])
    model = oslo.BertModel.from_pretrained_with_parallel(paths["pretraining"])
    inputs = {**batch, "input_ids": None, "inputs_embeds": embeds}
    zoo.compare_outputs(model(**inputs), reference(**inputs), "BertModel(inputs_embeds)")

    reference = save_reference(transformers.BertForMultipleChoice, tiny_bert_config(), tmp_path)
    model = oslo.BertForMultipleChoice.from_pretrained_with_parallel(str(tmp_path))
    choices = {name: value.view(2, 2, *value.shape[1:]) for name, value in {**inputs, "input_ids": embeds}.items()}
    choices = {**choices, "input_ids": None, "inputs_embeds": choices["input_ids"], "labels": torch.tensor([1, 0])}
    zoo.compare_outputs(model(**choices), reference(**choices), "BertForMultipleChoice(inputs_embeds)")

    reference = transformers.BertForMaskedLM.from_pretrained(paths["mlm"]).train()
    model = oslo.BertForMaskedLM.from_pretrained_with_parallel(paths["mlm"]).train()
    model.activation_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model.bert.encoder.layer)
    reference(**masked_lm_batch()).loss.backward()
    model(**masked_lm_batch()).loss.backward()
    zoo.compare_grads(model, reference, "BertForMaskedLM (gradient checkpointing)")
