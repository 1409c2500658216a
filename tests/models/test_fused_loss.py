"""A language-modeling loss whose logits nobody asks for is computed from the hidden states, a chunk of tokens at a
time: every LM head of the zoo, in one process and at tensor_parallel_size=2, against transformers (loss and every
gradient), and no tensor of the logits' shape with more rows than a chunk is ever created in the call, forward
or backward (seen by a dispatch mode: with ``loss_chunk_size=0``, the whole logits, it sees them).

Pipelines take the same path on their last stage: the zoo's pipeline layouts check those losses and gradients
(tests/models/test_zoo.py), as does the manual's loop (``test_training_equals_one_process``)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import oslo
from tests.distributed import run_distributed
from tests.models import zoo

LM_HEADS = ("LMHeadModel", "ForCausalLM", "ForMaskedLM", "ForConditionalGeneration", "ForPreTraining",
            "DoubleHeadsModel")
CHUNK = 4  # tokens per chunk: fewer than any case's batch holds


def lm_cases() -> list[zoo.Case]:
    return [case for case in zoo.all_cases() if case.name.endswith(LM_HEADS)]


def _plain(value) -> bool:
    """A tensor with storage of its own (not a subclass wrapping one, such as a DTensor parameter)."""
    return type(value) in (torch.Tensor, torch.nn.Parameter)


class LogitsRows(TorchDispatchMode):
    """The most rows of any new tensor (not a view of an op's input, as a weight's transpose is) whose last
    dimension is one of ``widths`` (a rank's vocabulary columns, padded or not)."""

    def __init__(self, widths: set[int]) -> None:
        super().__init__()
        self.widths, self.rows = widths, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _plain(t)}
        for tensor in tree_leaves(out):
            if (_plain(tensor) and tensor.dim() >= 2 and tensor.shape[-1] in self.widths
                    and tensor.untyped_storage().data_ptr() not in inputs):
                self.rows = max(self.rows, tensor.numel() // tensor.shape[-1])
        return out


def _check(rank: int, world_size: int, root: str) -> list[str]:
    checked = []
    for case in lm_cases():
        path = os.path.join(root, case.key)
        reference = getattr(transformers, case.name).from_pretrained(path)
        batch = case.batch()
        case.loss(reference(**batch)).backward()
        model = getattr(oslo, case.name).from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
        projection = model._vocab_projection()
        start, stop = projection.weight_spec.vocab_range()
        widths = {projection.weight_spec.local_size, stop - start, model.config.vocab_size}
        labels = batch["labels"]
        tokens = labels.numel()

        model.loss_chunk_size = CHUNK
        with LogitsRows(widths) as seen:
            output = model(**batch, gather_logits=False)  # no logits asked for: the loss from the hidden states
            case.loss(output).backward()
        assert 0 < seen.rows <= CHUNK, f"{case.name}: a tensor of {seen.rows} rows of logits (chunks of {CHUNK})"
        torch.testing.assert_close(output.loss, reference(**batch).loss,
                                   msg=lambda m, name=case.name: f"{name} loss: {m}")
        zoo.compare_grads(model, reference, case.name)

        model.zero_grad()
        model.loss_chunk_size = 0  # the whole logits: what the counter must see
        with LogitsRows(widths) as seen:
            case.loss(model(**batch, gather_logits=False)).backward()
        assert seen.rows >= tokens, f"{case.name}: the counter missed the logits ({seen.rows} < {tokens} rows)"
        checked.append(case.key)
    return checked


@pytest.mark.parametrize("tp", [1, 2])
def test_loss_from_hidden_states(tmp_path, tp):
    for case in lm_cases():
        torch.manual_seed(0)
        getattr(transformers, case.name)(case.config()).save_pretrained(tmp_path / case.key)
    results = run_distributed(_check, tp, str(tmp_path), timeout=300)
    assert results[0] == [case.key for case in lm_cases()]


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "BertForMaskedLM"])
def test_hooks_that_cannot_see_the_logits_keep_the_loss_from_the_hidden_states(name):
    """A forward hook on every module but the one the logits come from (``model._logits_module()`` and its
    children: BERT's ``cls.predictions``, the others' ``lm_head``) cannot see the logits: the loss still comes a
    chunk at a time. One hook on the vocabulary projection could keep them: the whole logits are built."""
    case = next(case for case in lm_cases() if case.key == name)
    model = getattr(oslo, name).from_config_with_parallel(case.config(), seed=0).train()
    model.loss_chunk_size = CHUNK
    batch = case.batch()
    tokens = batch["labels"].numel()
    widths = {model._vocab_projection().weight_spec.local_size, model.config.vocab_size}
    logits_side = set(model._logits_module().modules())
    handles = [module.register_forward_hook(lambda *args: None)
               for module in model.modules() if module not in logits_side]
    assert len(handles) > 10
    with LogitsRows(widths) as seen:
        case.loss(model(**batch)).backward()
    assert 0 < seen.rows <= CHUNK, f"{name}: {seen.rows} rows of logits with hooks away from them"
    handles.append(model._vocab_module().register_forward_hook(lambda *args: None))
    with LogitsRows(widths) as seen:
        case.loss(model(**batch)).backward()
    assert seen.rows >= tokens, f"{name}: a hook on the projection, yet only {seen.rows} rows of logits"
    for handle in handles:
        handle.remove()


def _vocab_rows_per_graph(model, batch, vocab: int) -> list[int]:
    """Compile ``model``'s training call (forward and backward graphs run eagerly, ``fullgraph=True``) and return,
    per graph, the most rows of any tensor in it whose last dimension is ``vocab``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def record(graph, inputs):
        rows = [node.meta["val"].numel() // vocab for node in graph.graph.nodes
                if isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() >= 1
                and node.meta["val"].shape[-1] == vocab]
        seen.append(max(rows, default=0))
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    compiled(**batch).loss.backward()
    return seen


def test_compiled_loss_does_not_build_the_logits():
    """Under ``torch.compile`` with ``loss_chunk_size`` set the loss also comes a chunk at a time: neither the traced
    forward nor the traced backward holds a vocabulary-wide tensor of every token (the lm_head weight's transpose
    is hidden-size rows). By default (``None``) a compiled call builds the whole logits (measured faster)."""
    config = transformers.GPT2Config(vocab_size=1001, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    batch = {"input_ids": torch.randint(3, 1001, (4, 16), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]
    tokens = batch["input_ids"].numel()
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, seed=0).train()
    model.loss_chunk_size = CHUNK
    fused = _vocab_rows_per_graph(model, batch, config.vocab_size)
    assert len(fused) == 2 and max(fused) <= config.n_embd < tokens, fused
    for whole in (0, None):  # the whole logits: the same check sees them
        model.loss_chunk_size = whole
        assert max(_vocab_rows_per_graph(model, batch, config.vocab_size)) == tokens, whole


def test_compiled_chunks_through_the_fused_log_softmax(monkeypatch):
    """One rank's chunks on a GPU take a fused log-softmax (``loss._fused_log_softmax``): forced here on the CPU, a
    compiled call (``fullgraph=True``) with ``loss_chunk_size`` set gives the eager call's loss and gradients."""
    monkeypatch.setattr(oslo.parallel.loss, "_fused_log_softmax", lambda x: True)
    config = transformers.GPT2Config(vocab_size=1001, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    ids = torch.randint(3, 1001, (4, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(ids % 5 == 0, -100)
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, seed=0).train()
    model.loss_chunk_size = CHUNK
    eager = model(input_ids=ids, labels=labels).loss
    eager.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=labels).loss
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=lambda m, n=name: f"{n}: {m}")
