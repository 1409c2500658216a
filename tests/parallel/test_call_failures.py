"""A rank that raises inside a model call, an exception the user catches, a micro-batch loop left
half-way: every rank either goes on cleanly or raises at once, naming the rank that failed; none waits
until the timeout, none mixes the collectives of two calls."""

from __future__ import annotations

import pytest
import torch

import oslo
from oslo.parallel.comm import RankFailedError
from oslo.parallel.failure import ModelUnusableError
from oslo.parallel.pipeline import PipelineAbortedError
from tests.distributed import run_distributed
from tests.helpers import tiny_gpt2_config

TIMEOUT = 120  # the model's collective timeout is 300 s: a hang fails the test, it cannot turn into a timeout error


class Boom(RuntimeError):
    pass


def build(tp: int, pp: int, layers: int = 4, chunks: int = 1):
    torch.manual_seed(0)
    return oslo.GPT2LMHeadModel.from_config_with_parallel(
        tiny_gpt2_config(n_layer=layers), tensor_parallel_size=tp, pipeline_parallel_size=pp, timeout=300,
        micro_batch_size=2, virtual_pipeline_size=chunks,
    )


def batch(seed: int):
    ids = torch.randint(3, 1001, (4, 8), generator=torch.Generator().manual_seed(seed))
    return dict(input_ids=ids, labels=ids)


def raise_in(module, when):
    """Make ``module``'s forward raise :class:`Boom` while ``when()`` holds."""
    def hook(*_):
        if when():
            raise Boom("injected failure")
    return module.register_forward_hook(hook)


def train_step(model, inputs):
    output = model(**inputs)
    if model.parallel_context.pipeline_parallel_size == 1:
        output.loss.backward()
        return float(output.loss)
    for micro_output in output:
        micro_output.loss.backward()
    return float(micro_output.loss)


def _rank_1_fails_once(rank, world_size, tp, pp, evaluate=False):
    """Three calls (training steps, or no-gradient passes); in the second, global rank 1 raises inside
    its stage's first block. Returns each call's "ok" or (error type, message)."""
    model = build(tp=tp, pp=pp)
    calls = [0]
    raise_in(next(iter(model.transformer.h)).mlp, lambda: rank == 1 and calls[0] == 1)
    outcomes = []
    for call in range(3):
        calls[0] = call
        try:
            if evaluate:
                with torch.no_grad():
                    model(**batch(call))
            else:
                train_step(model, batch(call))
            outcomes.append("ok")
        except Exception as exc:  # noqa: BLE001 - "skip the bad batch"
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


def test_one_tensor_parallel_rank_failing_stops_both_and_names_it():
    outcomes = run_distributed(_rank_1_fails_once, 2, 2, 1, timeout=TIMEOUT)
    for rank, (first, second, third) in enumerate(outcomes):
        assert first == "ok"
        if rank == 1:
            assert second[0] == "Boom"
        else:  # the peer stops waiting in the collective the failed rank never joined, and says who failed
            assert second[0] == "RankFailedError" and "rank 1: Boom: injected failure" in second[1]
        # later calls refuse at once on every rank, naming the failure, instead of mixing collectives
        assert third[0] == "ModelUnusableError" and "rank 1" in third[1]


def _every_rank_fails_at_tp(rank, world_size):
    model = build(tp=2, pp=1)
    calls = [0]
    raise_in(model.transformer.h[1].mlp, lambda: calls[0] == 1)
    outcomes = []
    for call in range(3):
        calls[0] = call
        try:
            outcomes.append(train_step(model, batch(call)))
        except Boom:
            outcomes.append("Boom")
    return outcomes


def test_an_error_on_every_rank_leaves_the_model_usable():
    """The same error on every rank (a bad batch every rank sees) leaves nobody inside a collective:
    catching it and going on to the next batch works."""
    outcomes = run_distributed(_every_rank_fails_at_tp, 2, timeout=TIMEOUT)
    assert outcomes[0][1] == outcomes[1][1] == "Boom"
    assert outcomes[0][2] == pytest.approx(outcomes[1][2])


def _reference_losses(rank, world_size, pp, calls, chunks=1):
    model = build(tp=1, pp=pp, chunks=chunks)
    return [train_step(model, batch(call)) for call in calls]


def _stage_fails_mid_forward(rank, world_size, failing_stage, chunks=1):
    model = build(tp=1, pp=2, chunks=chunks)
    calls = [0]
    stage = model.parallel_context.pipeline_parallel_rank
    block = 0 if stage == 0 else 3
    raise_in(model.transformer.h[block].mlp, lambda: stage == failing_stage and calls[0] == 1)
    outcomes = []
    for call in range(3):
        calls[0] = call
        try:
            outcomes.append(train_step(model, batch(call)))
        except (Boom, PipelineAbortedError) as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


@pytest.mark.parametrize("chunks", [1, 2], ids=["1F1B", "interleaved"])
@pytest.mark.parametrize("failing_stage", [0, 1])
def test_a_stage_failing_mid_forward_is_skippable(failing_stage, chunks):
    """"Skip the bad batch" at pp=2: the failing stage raises its error, the other one learns it
    (naming the stage), and the next step trains as if the failed one had not happened — weights
    included, since the optimizer never stepped: the losses equal a run without the failed batch. The same
    with two chunks per stage (interleaved 1F1B: the stages form a ring, several streams share a link)."""
    outcomes = run_distributed(_stage_fails_mid_forward, 2, failing_stage, chunks, timeout=TIMEOUT)
    for stage, (first, second, third) in enumerate(outcomes):
        assert isinstance(first, float) and isinstance(third, float)
        if stage == failing_stage:
            assert second[0] == "Boom"
        else:
            assert second[0] == "PipelineAbortedError" and f"stage {failing_stage}" in second[1]
    # The failed step's partial gradients are left in .grad (as on one process); this loop never steps,
    # so the losses of calls 0 and 2 are those of a clean run.
    reference = run_distributed(_reference_losses, 2, 2, [0, 2], chunks, timeout=TIMEOUT)
    assert outcomes[0][0] == pytest.approx(reference[0][0]) and outcomes[0][2] == pytest.approx(reference[0][1])


def _abandoned_loop(rank, world_size, then, chunks=1):
    model = build(tp=1, pp=2, chunks=chunks)
    for micro_output in model(**batch(0)):
        micro_output.loss.backward()
        break  # every rank leaves the loop after the first micro-batch
    if then == "eval":
        with torch.no_grad():
            return float(model(**batch(1)).loss)
    return train_step(model, batch(1))


@pytest.mark.parametrize("chunks", [1, 2], ids=["1F1B", "interleaved"])
@pytest.mark.parametrize("then", ["train", "eval"])
def test_a_loop_left_half_way_does_not_hang_the_next_call(then, chunks):
    losses = run_distributed(_abandoned_loop, 2, then, chunks, timeout=TIMEOUT)
    reference = run_distributed(_reference_losses, 2, 2, [1], chunks, timeout=TIMEOUT)
    assert losses[0] == pytest.approx(losses[1])
    if then == "train":
        assert losses[0] == pytest.approx(reference[0][0])


def _one_stage_leaves_the_loop(rank, world_size, chunks=1):
    model = build(tp=1, pp=2, chunks=chunks)
    stage = model.parallel_context.pipeline_parallel_rank
    try:
        for micro_output in model(**batch(0)):
            micro_output.loss.backward()
            if stage == 1:
                break
        outcome = "finished"
    except PipelineAbortedError as exc:
        outcome = str(exc)
    return outcome, train_step(model, batch(1))


@pytest.mark.parametrize("chunks", [1, 2], ids=["1F1B", "interleaved"])
def test_a_stage_leaving_the_loop_alone_stops_the_others(chunks):
    (first, loss0), (last, loss1) = run_distributed(_one_stage_leaves_the_loop, 2, chunks, timeout=TIMEOUT)
    assert "stage 1" in first and "left the step" in first
    assert last == "finished"
    assert loss0 == pytest.approx(loss1)


def _empty_batch(rank, world_size):
    model = build(tp=1, pp=2)
    empty = dict(input_ids=torch.zeros(0, 8, dtype=torch.long), labels=torch.zeros(0, 8, dtype=torch.long))
    try:
        for micro_output in model(**empty):
            micro_output.loss.backward()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_empty_batch_in_a_pipelined_training_call_raises():
    for message in run_distributed(_empty_batch, 2, timeout=TIMEOUT):
        assert "empty" in message and "batch" in message


def test_errors_are_exported():
    assert issubclass(ModelUnusableError, RuntimeError) and issubclass(RankFailedError, RuntimeError)


@pytest.mark.parametrize("evaluate", [False, True], ids=["training step", "no-gradient pass"])
def test_one_rank_failing_at_tp_2_pp_2_stops_every_rank(evaluate):
    """The failed rank's tensor-parallel peer stops waiting (store record), the other stage learns it
    from the pipeline; nobody waits for the timeout, and every later call raises on every rank."""
    outcomes = run_distributed(_rank_1_fails_once, 4, 2, 2, evaluate, timeout=TIMEOUT)
    for rank, (first, second, third) in enumerate(outcomes):
        assert first == "ok", (rank, first)
        assert second[0] != "PeerTimeoutError" and (second[0] == "Boom") == (rank == 1), (rank, second)
        assert "rank 1" in second[1] or rank == 1, (rank, second)
        # (the other stage may find ranks 0 and 1 gone: they raise at once and this test's processes end)
        assert third[0] in ("ModelUnusableError", "RankFailedError", "PeerLostError"), (rank, third)
        assert "rank 1" in third[1] or third[0] == "PeerLostError", (rank, third)


def _call_inside_the_loop(rank, world_size):
    model = build(tp=1, pp=2)
    step = model(**batch(0))
    first = next(step)
    first.loss.backward()
    with torch.no_grad():  # another call while the step is open: the step ends on both stages
        evaluation = float(model(**batch(1)).loss)
    try:
        next(step)
        return "went on", evaluation
    except RuntimeError as exc:
        return str(exc), evaluation


def test_calling_the_model_inside_an_open_step_ends_it_loudly():
    (message0, eval0), (message1, eval1) = run_distributed(_call_inside_the_loop, 2, timeout=TIMEOUT)
    assert "ended early" in message0 and "ended early" in message1
    assert eval0 == pytest.approx(eval1)


def _last_stage_fails_handing_out_the_outputs(rank, world_size):
    """Three no-gradient passes at pp 2; in the second, the last stage raises while it hands its outputs to the
    other stage (after the stages settled the pass: their own failure exchange is over)."""
    from oslo.parallel.pipeline import StageLink

    model = build(tp=1, pp=2)
    calls, original = [0], StageLink.broadcast_from

    def broadcast_from(self, stage, tensor):
        if rank == 1 and calls[0] == 1:
            raise Boom("injected failure")
        return original(self, stage, tensor)

    StageLink.broadcast_from = broadcast_from
    outcomes = []
    for call in range(3):
        calls[0] = call
        try:
            with torch.no_grad():
                model(**batch(call))
            outcomes.append("ok")
        except Exception as exc:  # noqa: BLE001
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


def test_a_stage_failing_after_the_pass_stops_the_others():
    """The stage waiting for the outputs stops at once, naming the failed rank (not after the model's timeout
    of 300 s, which would outlast the test's)."""
    (first0, second0, third0), (first1, second1, third1) = run_distributed(
        _last_stage_fails_handing_out_the_outputs, 2, timeout=TIMEOUT)
    assert first0 == first1 == "ok"
    assert second1[0] == "Boom"
    assert second0[0] == "RankFailedError" and "rank 1: Boom: injected failure" in second0[1]
    assert third0[0] == third1[0] == "ModelUnusableError"
