"""Mixed precision: the stock torch.amp.GradScaler loop, with an overflow in one rank's shard or one
pipeline stage only, skips the step on every rank (weights stay identical everywhere, scales stay
equal); float16 and bfloat16 autocast train like transformers under the same autocast."""

from __future__ import annotations

import pytest
import torch
import transformers

import oslo
from tests.distributed import run_distributed
from tests.helpers import full_params, save_reference, tiny_gpt2_config

LR = 0.5


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm-amp")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(n_layer=4), path)
    return str(path)


def _batch(seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1001, (4, 10), generator=generator)
    return dict(input_ids=ids, labels=ids)


def _model(path, world_size, tp):
    return oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=world_size // tp, micro_batch_size=2
    ).train()


def _step(model, scaler, optimizer, batch, pipelined):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        for micro_output in model(**batch) if pipelined else [model(**batch)]:
            scaler.scale(micro_output.loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _overflow_on_one_rank(rank, world_size, path, tp):
    pp = world_size // tp
    model = _model(path, world_size, tp)
    optimizer = torch.optim.SGD(model.gpu_parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # the stock scaler, as the manual uses it
    before = full_params(model)
    # One split weight of the last rank overflows (its tensor-parallel peers and the other stages'
    # weights do not): only that rank's own scaler would see it.
    hook = None
    if rank == world_size - 1:
        hook = model.transformer.h[-1].mlp.c_fc.weight.register_hook(lambda grad: grad * float("inf"))
    _step(model, scaler, optimizer, _batch(0), pp > 1)
    if hook is not None:
        hook.remove()
    skipped = full_params(model)
    scale_after_overflow = scaler.get_scale()
    _step(model, scaler, optimizer, _batch(1), pp > 1)
    return before, skipped, scale_after_overflow, scaler.get_scale(), full_params(model)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(lm_checkpoint, tp, pp):
    results = run_distributed(_overflow_on_one_rank, tp * pp, lm_checkpoint, tp)
    reference = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint).train()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**9)  # the scale every rank has after its skip
    _step(reference, scaler, optimizer, _batch(1), False)
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    for before, skipped, scale_after_overflow, scale, after in results:
        assert scale_after_overflow == 2.0**9 and scale == 2.0**9  # every rank skipped once, and only once
        for name, value in skipped.items():
            assert torch.equal(value, before[name]), f"{name} changed in a skipped step"
        for name, value in after.items():
            source = "transformer.wte.weight" if name == "lm_head.weight" else name
            # float16 matmuls and sums: a gradient of order 1 is good to float16's 2^-11 (4.9e-4) per rounding, and
            # lr 0.5 carries that into the weight; sums in another order differ by a few roundings (1.2e-4 seen on
            # a bias of 32 summed over 80 tokens, on an AMD EPYC). rtol 1e-3 as torch's float16 default.
            torch.testing.assert_close(value, expected[source], rtol=1e-3, atol=5e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")
    for stage in range(pp):  # replicated weights stay bit-identical across tensor-parallel ranks
        ranks = results[stage * tp : (stage + 1) * tp]
        for name, value in ranks[0][4].items():
            if name.endswith(("ln_1.weight", "ln_2.bias", "c_proj.bias", "wpe.weight")):
                assert all(torch.equal(value, other[4][name]) for other in ranks[1:]), name


def _bf16_step(rank, world_size, path, tp):
    pp = world_size // tp
    model = _model(path, world_size, tp)
    optimizer = torch.optim.SGD(model.gpu_parameters(), lr=LR)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for micro_output in model(**_batch(2)) if pp > 1 else [model(**_batch(2))]:
            micro_output.loss.backward()
    optimizer.step()
    return full_params(model)


def test_bfloat16_autocast_trains_like_transformers(lm_checkpoint):
    results = run_distributed(_bf16_step, 4, lm_checkpoint, 2)
    reference = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint).train()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference(**_batch(2)).loss.backward()
    optimizer.step()
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    for params in results:
        for name, value in params.items():
            source = "transformer.wte.weight" if name == "lm_head.weight" else name
            # bfloat16 matmuls summed in another order on split ranks: torch's bfloat16 tolerance.
            torch.testing.assert_close(value, expected[source], rtol=1.6e-2, atol=1e-3, msg=name)
