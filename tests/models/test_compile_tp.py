"""``torch.compile(model, fullgraph=True)`` on every class of the zoo at tensor_parallel_size 2 (two gloo ranks; of
Qwen2 and Mistral, whose heads are Llama's classes, the causal LMs):
the training call and the inference call trace without a graph break and give the eager call's loss, outputs and
gradients, as ``tests/models/test_compile.py`` checks at size 1 (each architecture's anchor class's training call
through AOTAutograd, the other classes' with Dynamo's graph run as it is).

A compiled call keeps the eager call's guarantees by running oslo's eager code from inside the compiled program
(:mod:`oslo.parallel.traced`): the input agreement (an ``InputMismatchError`` on every rank), the collectives'
failure watch, the overflow agreement at the end of the backward pass. Those are checked here too, compiled:
different inputs on the ranks raise on both, and a float16 overflow on one rank is seen by both.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import oslo
from oslo.parallel import InputMismatchError
from oslo.parallel.dtensor import plain
from tests.distributed import run_distributed
from tests.models.test_compile import (
    ANCHORS,
    CASES,
    EXPECTED_COUNTS,
    _small_config,
    check_compiled_calls,
    compile_counts,
)

ARCHS = list(dict.fromkeys(case.arch for case in CASES))


def _compiled_equal_eager(rank, world_size, arch):
    checked = []
    for case in (c for c in CASES if c.arch == arch):
        torch._dynamo.reset()
        model = getattr(oslo, case.name).from_config_with_parallel(
            _small_config(case), tensor_parallel_size=2, seed=0).train()
        # The anchors through AOTAutograd (the graphs a compiler backend gets), the others with Dynamo's graph as
        # it is (the graph breaks are Dynamo's; half the time): the classes of an architecture share their layers.
        check_compiled_calls(model, case, backend="aot_eager" if case.anchor else "eager")
        checked.append(case.key)
    return checked


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_calls_equal_eager_at_tp2(arch):
    expected = [case.key for case in CASES if case.arch == arch]
    assert run_distributed(_compiled_equal_eager, 2, arch, timeout=900) == [expected, expected]


def _sequence_parallel_compiled(rank, world_size, arch):
    case = next(c for c in CASES if c.arch == arch and c.anchor)
    torch._dynamo.reset()
    model = getattr(oslo, case.name).from_config_with_parallel(
        _small_config(case), tensor_parallel_size=2, seed=0, sequence_parallel=True).train()
    check_compiled_calls(model, case, inference=False)
    return case.key


@pytest.mark.parametrize("arch", ["gpt2", "bert", "t5", "llama"])
def test_sequence_parallel_compiles_whole_at_tp2(arch):
    """sequence_parallel=True under torch.compile(fullgraph=True): a training call (shards gathered and
    reduce-scattered inside the graph) equals eager, outputs and gradients, for the anchors of GPT2, BERT, T5 and
    Llama (GPT-Neo, Qwen2 and Mistral compile the same mappings)."""
    case = next(c for c in CASES if c.arch == arch and c.anchor)
    assert run_distributed(_sequence_parallel_compiled, 2, arch, timeout=900) == [case.key] * 2


TRACED_AT_TP2 = [case for case in ANCHORS if case.arch == "gpt2"]


def _compile_counts(rank, world_size):
    counts = {}
    for case in TRACED_AT_TP2:
        torch._dynamo.reset()
        model = getattr(oslo, case.name).from_config_with_parallel(
            _small_config(case), tensor_parallel_size=2, seed=0).train()
        counts[case.arch] = compile_counts(model, case)
    return counts


def test_a_compiled_model_is_traced_once_per_shape_and_mode_at_tp2():
    """As at size 1 (``tests/models/test_compile.py``): steps, other lengths, evaluation. What tensor parallelism
    adds (the DTensor parameters' per-call views) is the same code in every architecture: GPT2 stands for them
    (each architecture is checked at size 1)."""
    expected = {case.arch: EXPECTED_COUNTS for case in TRACED_AT_TP2}
    assert run_distributed(_compile_counts, 2, timeout=600) == [expected, expected]


def _static_cache_generate(rank, world_size, tp, pp):
    from transformers import CompileConfig

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=32)
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        config, tensor_parallel_size=tp, pipeline_parallel_size=pp, seed=0).eval()
    ids = torch.randint(1, 101, (2, 6), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    eager = model.generate(ids, disable_compile=True, **options)
    # Counted through a closure, not test_compile's counting object: CompileConfig deep-copies its backend when
    # generate() compiles, and a function's copy is the function itself.
    traced = []

    def backend(graph, example_inputs, **options):  # transformers passes its mode ("reduce-overhead") too
        traced.append(graph)
        return graph.forward

    compile_config = CompileConfig(backend=backend, fullgraph=True)
    compile_config._compile_all_devices = True  # what a CUDA device means to transformers' generate()
    compiled = model.generate(ids, compile_config=compile_config, **options)
    return torch.equal(compiled, eager), len(traced)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_generate_with_a_static_cache_as_on_a_gpu(tp, pp):
    """On a GPU, transformers' generate() compiles the decoding step by itself when the cache is static. With
    tensor parallelism the compiled steps give eager's tokens; with pipelines, whose calls cannot be traced, the
    steps stay eager (they would fail to compile) and give the same tokens."""
    results = run_distributed(_static_cache_generate, tp * pp, tp, pp, timeout=300)
    for same, traced in results:
        assert same
        assert (traced > 0) == (pp == 1)


def _ddp_steps(rank, world_size, compiled):
    from torch.nn.parallel import DistributedDataParallel

    model = _gpt2().train()
    model_ddp = DistributedDataParallel(model.gpu_modules(), process_group=model.mpu.get_data_parallel_group())
    call = torch.compile(model_ddp, backend="eager") if compiled else model_ddp
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randint(0, 101, (3, 2, 8), generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for ids in data:
            call(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return {name: plain(p).detach().clone() for name, p in model.named_parameters()}


def test_compiled_ddp_wrapper_trains_as_eager():
    """``torch.compile(DistributedDataParallel(model.gpu_modules()))`` (tp 2; DDP's own graph breaks, as with
    any model) trains to the eager wrapper's weights without tracing a function once per parameter: no frame is
    compiled more than twice (Dynamo's limit is 8, after which it runs the frame eagerly with a warning)."""
    eager = run_distributed(_ddp_steps, 2, False)
    compiled = run_distributed(_ddp_steps, 2, True, timeout=300)
    for rank in range(2):
        for name, weight in eager[rank].items():
            torch.testing.assert_close(compiled[rank][name], weight, msg=lambda m, n=name: f"{n}: {m}")


def _gpt2(dropout: float = 0.0):
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=32,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=2, seed=0)


def _explained_breaks(rank, world_size):
    model = _gpt2(dropout=0.1).train()
    torch.manual_seed(0)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    training = torch._dynamo.explain(lambda ids: model(input_ids=ids, labels=ids).loss)(ids)

    def inference(ids):
        with torch.no_grad():
            return model.eval()(input_ids=ids, labels=ids)

    evaluation = torch._dynamo.explain(inference)(ids)
    return [[b.reason for b in training.break_reasons], [b.reason for b in evaluation.break_reasons]]


def test_no_graph_breaks_with_dropout_at_tp2():
    assert run_distributed(_explained_breaks, 2) == [[[], []], [[], []]]


def _compiled_guarantees(rank, world_size):
    model = _gpt2().train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled(input_ids=ids, labels=ids).loss.backward()
    seen = []
    # Different values on the ranks (a batch drawn unseeded): InputMismatchError on both, naming the input.
    try:
        compiled(input_ids=ids + rank, labels=ids)
    except InputMismatchError as exc:
        seen.append("input_ids" in str(exc) and "unseeded" in str(exc))
    # An id outside the vocabulary on one rank only: the agreement raises first, on both ranks.
    bad = ids.clone()
    if rank == 1:
        bad[0, 3] = 101
    try:
        compiled(input_ids=bad, labels=ids)
    except InputMismatchError:
        seen.append(True)
    # The same bad id on both ranks: both raise the range check's assertion.
    bad[0, 3] = 101
    try:
        compiled(input_ids=bad, labels=ids)
    except RuntimeError as exc:
        seen.append("outside the vocabulary [0, 101)" in str(exc))
    # Dropout in a compiled call draws from the default generator: it must agree across the ranks.
    model.config.resid_pdrop = 0.1
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.manual_seed(rank)
    try:
        compiled(input_ids=ids, labels=ids)
    except InputMismatchError as exc:
        seen.append("default random generator" in str(exc))
    torch.manual_seed(0)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    seen.append(loss.item())
    # An overflow in one rank's gradients: the backward's agreement makes both ranks' gradients non-finite.
    model.zero_grad(set_to_none=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    if rank == 0:
        model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: g * float("inf"))
    (loss * 1024.0).backward()  # a loss scale: the agreement looks at the gradients
    seen.append(all(not torch.isfinite(plain(p.grad)).all() for p in model.parameters() if p.grad is not None))
    return seen


def test_compiled_call_keeps_the_guarantees_at_tp2():
    first, second = run_distributed(_compiled_guarantees, 2, timeout=300)
    assert first[:4] == second[:4] == [True] * 4
    assert first[4] == second[4]  # the same loss on both ranks: the same replicated dropout masks
    assert first[5:] == second[5:] == [True]


def test_a_copy_of_a_model_is_another_model_for_compiled_calls():
    """A compiled call runs eager code on its model by key (oslo.parallel.traced): a deep copy (an EMA model, say)
    must not run it on the original."""
    import copy

    from oslo.parallel import traced

    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=101, n_positions=32)
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, seed=0)
    twin = copy.deepcopy(model)
    assert twin._oslo_traced_key != model._oslo_traced_key
    assert traced._lookup(twin._oslo_traced_key) is twin and traced._lookup(model._oslo_traced_key) is model
