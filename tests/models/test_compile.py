"""``torch.compile(model, fullgraph=True)`` on every class of the zoo at tensor_parallel_size 1: the training
call (the case's objective, then backward) and the inference call (eval, no gradients) trace without a graph
break (``fullgraph=True`` raises on any) and give eager's loss, outputs and gradients.

The training call compiles with ``aot_eager`` (the forward and backward graphs that a compiler backend gets,
run by eager kernels); the inference call with ``eager`` (Dynamo's graph as it is), which costs less: this file's
time is almost all compile time. The models have one layer (GPT-Neo two: a global and a local one): compile
time grows with the layers, which all run the same code. Dropout is off: a compiled call draws its masks from
the default generator, an eager one from the model's streams (see :class:`~oslo.parallel.random.ParallelRNG`).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch._dynamo.testing import CompileCounter

import oslo
from oslo.parallel.dtensor import plain
from tests.models.zoo import Case, all_cases, compare_outputs

# Qwen2's and Mistral's heads are Llama's classes over their bodies: their causal LMs stand for them here.
CASES = [case for case in all_cases() if case.arch not in ("qwen2", "mistral") or case.anchor]


def _small_config(case: Case):
    config = case.config()
    if isinstance(config, transformers.GPTNeoConfig):
        config.attention_types = [[["global", "local"], 1]]
        config.attention_layers = ["global", "local"]
        config.num_layers = 2
    elif isinstance(config, transformers.T5Config):
        config.num_layers = config.num_decoder_layers = 1
    elif getattr(config, "layer_types", None) is not None:  # Qwen2: one layer type per layer, checked on assignment
        config = type(config)(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": config.layer_types[:1]})
    else:
        config.num_hidden_layers = 1
    config.classifier_dropout = 0.0  # GPT2's classification heads default to 0.1 (no dropout in its config)
    config.summary_first_dropout = 0.0  # GPT2DoubleHeadsModel's multiple-choice head: 0.1 by default
    return config


def _gradients(model) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient on this rank (a DTensor's local tensor), copied; ``None`` where there is none."""
    return {name: None if p.grad is None else plain(p.grad).clone() for name, p in model.named_parameters()}


def assert_same_gradients(actual: dict, expected: dict, key: str) -> None:
    """The compiled call's gradients (``None`` where there is none) are eager's."""
    for name, grad in actual.items():
        if expected[name] is None:
            assert grad is None, f"{key}: {name} got a gradient only when compiled"
        else:
            torch.testing.assert_close(grad, expected[name], msg=lambda m, n=name: f"{key} {n}: {m}")


def check_compiled_calls(model, case: Case, backend: str = "aot_eager", inference: bool = True) -> None:
    """A training call of ``model`` (in training mode) under ``torch.compile(fullgraph=True, backend=backend)``
    gives the eager call's loss, outputs and gradients (this rank's); then, with ``inference``, an inference call
    compiled with Dynamo's graph as it is gives eager's outputs."""
    batch = case.batch()
    expected = model(**batch)
    case.loss(expected).backward()
    expected_grads = _gradients(model)
    model.zero_grad(set_to_none=True)
    actual = torch.compile(model, fullgraph=True, backend=backend)(**batch)
    case.loss(actual).backward()
    torch.testing.assert_close(case.loss(actual), case.loss(expected))
    compare_outputs(actual, expected, case.key)
    assert_same_gradients(_gradients(model), expected_grads, case.key)
    if inference:
        model.eval()
        with torch.no_grad():
            compare_outputs(torch.compile(model, fullgraph=True, backend="eager")(**batch), model(**batch),
                            f"{case.key} (inference)")


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.key)
def test_compiled_calls_equal_eager(case):
    torch._dynamo.reset()
    check_compiled_calls(getattr(oslo, case.name).from_config_with_parallel(_small_config(case), seed=0).train(),
                         case)


ANCHORS = [case for case in CASES if case.anchor]


def compile_counts(model, case, backend=None, device: str = "cpu") -> list[int]:
    """How many graphs ``torch.compile(model, fullgraph=True)`` has traced after each of: three training steps on
    the case's batch (two accumulated calls each, then an optimizer step), then batches cut to three other
    lengths, then an evaluation call and a training call again. Dynamo's own rule for what a user should see:
    one graph for the steps; one more at the second length, whose sequence dimension it then makes dynamic, and
    none after; one for evaluation mode, kept beside the training one. ``backend``: the compiler each traced graph
    goes to (``None``: none, the graph runs as traced); ``device``: where the batch goes."""
    counter = CompileCounter() if backend is None else _CountingBackend(backend)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = {name: value.to(device) for name, value in case.batch().items()}
    counts = []
    for _ in range(3):
        for _ in range(2):
            case.loss(compiled(**batch)).backward()
        optimizer.step()
        optimizer.zero_grad()
        counts.append(counter.frame_count)
    for cut in (1, 2, 3):
        shorter = {name: value[:, :value.shape[1] - cut] for name, value in batch.items()}
        case.loss(compiled(**shorter)).backward()
        counts.append(counter.frame_count)
    model.eval()
    with torch.no_grad():
        compiled(**batch)
    counts.append(counter.frame_count)
    model.train()
    case.loss(compiled(**batch)).backward()
    counts.append(counter.frame_count)
    return counts


class _CountingBackend:
    """A compiler backend that counts the graphs it is handed (``frame_count``, as ``CompileCounter``) and compiles
    them with ``backend``."""

    def __init__(self, backend) -> None:
        self.backend, self.frame_count = backend, 0

    def __call__(self, graph, example_inputs):
        self.frame_count += 1
        return self.backend(graph, example_inputs)


EXPECTED_COUNTS = [1, 1, 1, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("case", ANCHORS, ids=lambda case: case.arch)
def test_a_compiled_model_is_traced_once_per_shape_and_mode(case):
    """A compiled model is not traced again by its own calls: the state oslo keeps between calls (a cache of
    forward signatures, the per-call parameter views) and the input checks' messages (which would fix a length
    to one value) stay out of Dynamo's guards. On a GPU each trace is an inductor compile."""
    torch._dynamo.reset()
    model = getattr(oslo, case.name).from_config_with_parallel(_small_config(case), seed=0).train()
    assert compile_counts(model, case) == EXPECTED_COUNTS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_session.sh runs it)")
def test_compiled_with_inductor_on_cuda_is_traced_once_per_shape_and_mode():
    """As above, compiled by inductor on a CUDA device, as a GPU user compiles (each trace is an inductor compile
    there): Llama's causal LM."""
    from torch._inductor.compile_fx import compile_fx

    case = next(case for case in ANCHORS if case.arch == "llama")
    torch._dynamo.reset()
    model = getattr(oslo, case.name).from_config_with_parallel(_small_config(case), seed=0).cuda().train()
    assert compile_counts(model, case, backend=compile_fx, device="cuda") == EXPECTED_COUNTS


def _gpt2_with_dropout():
    """The issue's model: GPT2's default dropout (0.1 everywhere), in training mode."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=32)
    return oslo.GPT2LMHeadModel.from_config_with_parallel(config, seed=0).train()


def test_no_graph_breaks_with_dropout():
    """``torch._dynamo.explain`` counts no break in a training call (dropout drawn, no stream swap) nor in an
    inference call."""
    torch._dynamo.reset()
    model = _gpt2_with_dropout()
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    training = torch._dynamo.explain(lambda ids: model(input_ids=ids, labels=ids).loss)(ids)
    assert training.graph_break_count == 0, [b.reason for b in training.break_reasons]

    def inference(ids):
        with torch.no_grad():
            return model.eval()(input_ids=ids, labels=ids)

    evaluation = torch._dynamo.explain(inference)(ids)
    assert evaluation.graph_break_count == 0, [b.reason for b in evaluation.break_reasons]


def test_compiled_call_checks_its_inputs():
    """The checks that raise in eager (ids outside the embeddings, labels outside the vocabulary) cannot branch
    on values in a compiled call: the compiled program asserts them and raises ``RuntimeError`` with the same
    message, without the value. An input longer than the positions fails at compile time, naming it."""
    torch._dynamo.reset()
    model = _gpt2_with_dropout().eval()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled(input_ids=ids, labels=ids)
    with pytest.raises(IndexError, match=r"input_ids hold 101 at index \(0, 3\), outside the vocabulary \[0, 101\)"):
        model(input_ids=torch.cat([ids[:, :3], torch.full((2, 1), 101), ids[:, 4:]], dim=1), labels=ids)
    with pytest.raises(RuntimeError, match=r"input_ids hold an id at some index, outside the vocabulary \[0, 101\)"):
        compiled(input_ids=torch.cat([ids[:, :3], torch.full((2, 1), 101), ids[:, 4:]], dim=1), labels=ids)
    with pytest.raises(RuntimeError, match=r"labels hold a token id, outside the vocabulary \[0, 101\)"):
        compiled(input_ids=ids, labels=ids.masked_fill(ids == ids[1, 2], 500))
    with pytest.raises(RuntimeError, match=r"position_ids hold an id at some index, outside \[0, 32\)"):
        compiled(input_ids=ids, labels=ids, position_ids=torch.arange(8)[None] + 30)
    with pytest.raises(Exception, match=r"the input reaches position 39 \(40 tokens after 0 cached\)"):
        compiled(input_ids=torch.randint(0, 101, (2, 40)))


def _compiled_gradients(checkpointed: bool) -> list[torch.Tensor]:
    torch._dynamo.reset()
    model = _gpt2_with_dropout()
    if checkpointed:
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)  # a compiled call draws dropout from the default generator
    torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids).loss.backward()
    return [param.grad for param in model.parameters()]


def test_activation_checkpointing_compiles_whole():
    """A model with activation checkpointing traces whole (``fullgraph=True``), and the compiled recomputation
    replays the forward's dropout masks: the gradients are those of the compiled model without checkpointing."""
    for checkpointed, plain_run in zip(_compiled_gradients(True), _compiled_gradients(False), strict=True):
        torch.testing.assert_close(checkpointed, plain_run)
