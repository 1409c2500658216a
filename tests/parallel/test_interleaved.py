"""Interleaved 1F1B (``virtual_pipeline_size``) against one process, for every architecture's anchor class at
pipeline_parallel_size=2: the weights after the manual's step at v=2 and v=3 with 2, 4 and 6 micro-batches
(each micro-batch's loss too); the no-gradient pass's outputs, a step's gradients, generate() and checkpoints
at v=2; the schedule's order (no deadlock, the bubble it predicts); and the layouts it refuses."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import oslo
from oslo.parallel.pipeline import check_interleaved, interleaved_order
from tests.distributed import run_distributed
from tests.helpers import full_params
from tests.models import zoo

# Six layers, so that 2 stages x 3 chunks each hold one (T5: three encoder and three decoder layers).
SIX_LAYERS = {"gpt2": dict(n_layer=6), "gpt_neo": dict(num_layers=6, attention_types=[[["global", "local"], 3]]),
              "bert": dict(num_hidden_layers=6), "t5": dict(num_layers=3, num_decoder_layers=3),
              "llama": dict(num_hidden_layers=6), "qwen2": dict(num_hidden_layers=6),
              "mistral": dict(num_hidden_layers=6)}
ROWS = 12  # 2, 4 and 6 micro-batches of 6, 3 and 2 rows


def _anchor(arch: str) -> zoo.Case:
    return next(case for case in zoo.cases_of(arch) if case.anchor)


def _six_layer_checkpoint(arch: str, root) -> str:
    case = _anchor(arch)
    values = case.config().to_dict()
    values.pop("attention_layers", None)  # GPT-Neo's, derived from attention_types
    if values.get("layer_types") is not None:  # Qwen2's: one kind of layer in the zoo's config
        values["layer_types"] = values["layer_types"][:1] * 6
    values.update(SIX_LAYERS[arch])
    config = type(case.config()).from_dict(values)
    torch.manual_seed(0)
    path = os.path.join(str(root), case.key)
    getattr(transformers, case.name)(config).save_pretrained(path)
    return path


def _batch(case: zoo.Case) -> dict:
    """12 rows: the training batch (its -100 labels included), then the case's batch again."""
    first, second = zoo.training_batch(case), case.batch()
    return {name: torch.cat([value, second[name]]) if isinstance(value, torch.Tensor) else value
            for name, value in first.items()}


def _train(rank, world_size, arch, path):
    """The manual's loop at pp=2 for every (v, m); each step from the checkpoint's weights."""
    case = _anchor(arch)
    batch = _batch(case)
    results = {}
    for chunks in (2, 3):
        for count in (2, 4, 6):
            model = getattr(oslo, case.name).from_pretrained_with_parallel(
                path, pipeline_parallel_size=2, micro_batch_size=ROWS // count,
                virtual_pipeline_size=chunks).train()
            optimizer = torch.optim.SGD(model.gpu_parameters(), lr=zoo.TRAINING_LR)
            losses = []
            for micro_output in model(**batch):
                losses.append(micro_output.loss.detach())
                micro_output.loss.backward()
            optimizer.step()
            results[chunks, count] = (losses, full_params(model))
    return results


def _check_calls(rank, world_size, arch, path, scratch):
    case = _anchor(arch)
    zoo.check_parity(case, path, 1, 2, virtual_pipeline_size=2)
    if case.generate:
        zoo.check_generate(case, path, 1, 2, rank, virtual_pipeline_size=2)
    zoo.check_checkpoints(case, path, 1, 2, scratch, virtual_pipeline_size=2)


ARCHS = ["gpt2", "gpt_neo", "bert", "t5", "llama", "qwen2", "mistral"]


@pytest.mark.parametrize("arch", ARCHS)
def test_interleaved_training_equals_one_process(tmp_path, arch):
    case = _anchor(arch)
    path = _six_layer_checkpoint(arch, tmp_path)
    results = run_distributed(_train, 2, arch, path, timeout=300)
    reference = getattr(transformers, case.name).from_pretrained(path).train()
    batch = _batch(case)
    with torch.no_grad():
        expected_losses = {count: [case.loss(reference(**{k: v[i : i + ROWS // count] if isinstance(v, torch.Tensor)
                                                          else v for k, v in batch.items()}))
                                   for i in range(0, ROWS, ROWS // count)] for count in (2, 4, 6)}
    optimizer = torch.optim.SGD(reference.parameters(), lr=zoo.TRAINING_LR)
    case.loss(reference(**batch)).backward()
    optimizer.step()
    expected = {name: param.detach() for name, param in reference.named_parameters(remove_duplicate=False)}
    for stage, by_layout in enumerate(results):
        for (chunks, count), (losses, params) in by_layout.items():
            where = f"{case.name} stage {stage} v={chunks} m={count}"
            assert len(losses) == count, where
            for i, (ours, theirs) in enumerate(zip(losses, expected_losses[count], strict=True)):
                torch.testing.assert_close(ours, theirs, msg=lambda m, i=i, w=where: f"{w} micro-batch {i} loss: {m}")
            assert params and set(params) <= set(expected), where
            for name, value in params.items():
                torch.testing.assert_close(value, expected[name], msg=lambda m, n=name, w=where: f"{w} {n}: {m}")
        held = set().union(*(params for _, params in by_layout.values()))
        assert held, f"stage {stage} holds nothing"
    covered = set().union(*(set(params) for by_layout in results for _, params in by_layout.values()))
    missing = [sorted(names) for names in zoo.weight_names(reference) if not names & covered]
    assert not missing, missing


@pytest.mark.parametrize("arch", ARCHS)
def test_interleaved_calls_equal_transformers(tmp_path, arch):
    """The no-gradient pass (hidden states in layer order across the chunks), a step's gradients, generate()
    with its per-stage KV cache, and split / merged checkpoints, at pp=2 with two chunks per stage."""
    path = _six_layer_checkpoint(arch, tmp_path)
    run_distributed(_check_calls, 2, arch, path, str(tmp_path / "saved"), timeout=300)


def _check_mixed_layers(rank, world_size, path, scratch):
    case = next(c for c in zoo.cases_of("qwen2") if c.variant == "mixed")
    zoo.check_parity(case, path, 1, 2, virtual_pipeline_size=2)
    zoo.check_generate(case, path, 1, 2, rank, virtual_pipeline_size=2)
    zoo.check_checkpoints(case, path, 1, 2, scratch, virtual_pipeline_size=2)


def test_interleaved_stages_holding_both_kinds_of_layers(zoo_checkpoints, tmp_path):
    """Qwen2 with full layers 0-1 and sliding-window layers 2-3 at pp=2 with two chunks per stage: each stage holds
    one layer of each kind, and its KV cache one slot of each (generate() decodes past the window of 4 keys)."""
    path = os.path.join(zoo_checkpoints("qwen2"), "Qwen2ForCausalLM-mixed")
    run_distributed(_check_mixed_layers, 2, path, str(tmp_path / "saved"), timeout=300)


def _simulate(size: int, chunks: int, count: int) -> list[float]:
    """Run every rank's :func:`interleaved_order` with unit forwards, backwards of 2 and instant transfers;
    returns each rank's idle fraction of the step's span. Fails on a deadlock (no rank can go on)."""
    orders = [interleaved_order(size, chunks, count, stage) for stage in range(size)]
    last = size * chunks - 1
    done: dict[tuple[str, int, int], float] = {}
    position, free, busy = [0] * size, [0.0] * size, [0.0] * size
    while any(position[s] < len(orders[s]) for s in range(size)):
        progressed = False
        for stage in range(size):
            while position[stage] < len(orders[stage]):
                phase, chunk, i = orders[stage][position[stage]]
                virtual = chunk * size + stage
                if phase == "forward":
                    needs = ("forward", virtual - 1, i) if virtual > 0 else None
                else:
                    needs = ("backward", virtual + 1, i) if virtual < last else ("forward", virtual, i)
                if needs is not None and needs not in done:
                    break
                start = max(free[stage], done.get(needs, 0.0))
                cost = 1.0 if phase == "forward" else 2.0
                done[(phase, virtual, i)] = free[stage] = start + cost
                busy[stage] += cost
                position[stage] += 1
                progressed = True
        assert progressed, f"deadlock at P={size} v={chunks} m={count}: {position}"
    assert len(done) == 2 * size * chunks * count
    span = max(free)
    return [1 - b / span for b in busy]


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16])
def test_interleaved_order_runs_every_micro_batch_without_deadlock(size, chunks, count):
    """Every order that check_interleaved accepts runs to its end (simulated); it accepts every multiple of P."""
    try:
        check_interleaved(size, chunks, count)
    except ValueError as error:
        assert count % size and count > size, error
        assert f"cannot run {count} micro-batches" in str(error) and "pipeline_parallel_size divides" in str(error)
        with pytest.raises(AssertionError, match="deadlock"):
            _simulate(size, chunks, count)
        return
    orders = [interleaved_order(size, chunks, count, stage) for stage in range(size)]
    for order in orders:
        assert sorted(order) == sorted((phase, c, i) for phase in ("forward", "backward") for c in range(chunks)
                                       for i in range(count))
        backwards = [i for phase, c, i in order if phase == "backward" and c == chunks - 1]
        assert backwards == list(range(count))  # the user's loop backpropagates the micro-batches in order
    idle = _simulate(size, chunks, count)
    if count % size == 0:  # full groups: Megatron's bubble, (P - 1) / (v m + P - 1) of a stage's step
        bubble = (size - 1) / (chunks * count + size - 1)
        for fraction in idle:
            assert fraction == pytest.approx(bubble, abs=1e-9), (idle, bubble)


def _refused(rank, world_size):
    from tests.helpers import tiny_gpt2_config

    with pytest.raises(ValueError, match="virtual_pipeline_size=3 x pipeline_parallel_size=2 = 6 virtual stages"):
        oslo.GPT2LMHeadModel.from_config_with_parallel(tiny_gpt2_config(n_layer=4), pipeline_parallel_size=2,
                                                       virtual_pipeline_size=3)
    context = oslo.ParallelContext(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="virtual_pipeline_size=1 but virtual_pipeline_size=2 was requested"):
        oslo.GPT2LMHeadModel.from_config_with_parallel(tiny_gpt2_config(n_layer=4), pipeline_parallel_size=2,
                                                       virtual_pipeline_size=2, parallel_context=context)


def test_refused_layouts():
    with pytest.raises(ValueError, match="virtual_pipeline_size=2 needs pipeline_parallel_size > 1"):
        oslo.ParallelContext(virtual_pipeline_size=2)
    with pytest.raises(TypeError, match="virtual_pipeline_size must be a positive integer"):
        oslo.ParallelContext(virtual_pipeline_size=1.5)
    run_distributed(_refused, 2, timeout=120)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tp, wrap, options", [
    (2, False, {"sequence_parallel": True}),
    (1, True, {}),
], ids=["tp2-pp2-sequence-parallel", "pp2-dp2-ddp"])
def test_interleaved_with_tensor_sequence_and_data_parallelism(zoo_checkpoints, arch, tp, wrap, options):
    """Two chunks per stage at tp=2 x pp=2 with sequence parallelism, and at pp=2 x dp=2 under DDP (the manual's
    3D loop): the weights after the step are one process's on the global batch."""
    case = _anchor(arch)
    path = os.path.join(zoo_checkpoints(arch), case.key)
    results = run_distributed(zoo.run_training, 4, case.key, path, tp, 2, zoo.MICRO_BATCH_SIZE, wrap,
                              virtual_pipeline_size=2, timeout=240, **options)
    zoo.check_training(case, path, 2, results)


def _split_checkpoint_across_chunks(rank, world_size, path, saved):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2,
                                                               virtual_pipeline_size=2)
    model.save_pretrained_with_parallel(saved)
    return [full_params(oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        saved, pipeline_parallel_size=2, virtual_pipeline_size=chunks)) for chunks in (1, 2, 3)]


def test_a_split_checkpoint_loads_at_another_virtual_pipeline_size(tmp_path):
    """Saved split with two chunks per stage (stage 0 holds the first and third of four pieces), loaded with
    one, two and three: every rank holds the checkpoint's weights."""
    path = _six_layer_checkpoint("gpt2", tmp_path)
    expected = dict(transformers.GPT2LMHeadModel.from_pretrained(path).named_parameters(remove_duplicate=False))
    for loads in run_distributed(_split_checkpoint_across_chunks, 2, path, str(tmp_path / "split"), timeout=120):
        for params in loads:
            assert params
            for name, value in params.items():
                assert torch.equal(value, expected[name]), name
