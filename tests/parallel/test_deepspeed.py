"""DeepSpeed as the manual writes it: ``deepspeed.initialize(model=model.gpu_modules(),
model_parameters=model.gpu_parameters(), mpu=model.mpu, config=ds_config)``, then ``engine(...)``,
``engine.backward(loss)``, ``engine.step()`` (with pipelines, ``engine.backward(micro_output.loss)`` per
micro-batch). ZeRO 0/1/2 with DeepSpeed's gradient clipping give the weights of one process on the global batch."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import transformers

import oslo
from tests.distributed import run_distributed
from tests.helpers import full_params, save_reference, tiny_gpt2_config
from tests.scripts.train_dp import ROWS, global_batch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")
import deepspeed  # noqa: E402 - after DS_ACCELERATOR; imported once here: the forked ranks inherit it

STEPS, LR, EPS, MAX_NORM = 2, 1e-2, 1e-5, 0.5  # the batches: the manual's data-parallel loop's (train_dp.py)
# EPS 1e-5: Adam's update of a weight whose gradient g is near zero moves by about lr * d / (|g| + eps) for
# reduction-order noise d in g; at 1e-6 one weight in 32,032 moved by 1.008e-5 (past 1e-5) on an AMD EPYC.


def ds_config(stage: int, rows: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": MAX_NORM,
        "steps_per_print": 10**9,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-deepspeed")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return str(path)


@pytest.fixture(scope="module")
def expected(checkpoint):
    """transformers' model, one process, the global batch, stock clipping, torch's AdamW."""
    model = transformers.GPT2LMHeadModel.from_pretrained(checkpoint).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(**global_batch(step)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _without_shm_kernel() -> None:
    # DeepSpeed's CPU communication would JIT-compile an optional shared-memory kernel on first use (a minute
    # and a compiler); torch's gloo collectives do not need it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _deepspeed_steps(rank, world_size, path, tp, pp, stage, sequence_parallel=False):
    _without_shm_kernel()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=2,
        sequence_parallel=sequence_parallel).train()
    mpu = model.mpu
    rows = ROWS // mpu.get_data_parallel_world_size()
    engine, _, _, _ = deepspeed.initialize(model=model.gpu_modules(), model_parameters=model.gpu_parameters(),
                                           mpu=model.mpu, config=ds_config(stage, rows))
    start = mpu.get_data_parallel_rank() * rows
    for step in range(STEPS):
        batch = {name: value[start:start + rows] for name, value in global_batch(step).items()}
        if pp == 1:
            engine.backward(engine(**batch).loss)
        else:
            for micro_output in engine(**batch):
                engine.backward(micro_output.loss)
        engine.step()
    return full_params(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp, pp, dp, stage, sequence_parallel",
                         [(2, 1, 2, 0, False), (2, 1, 2, 1, False), (2, 1, 2, 2, False), (1, 2, 2, 0, False),
                          (1, 2, 2, 1, False), (2, 1, 2, 2, True)],
                         ids=["tp2-dp2-zero0", "tp2-dp2-zero1", "tp2-dp2-zero2", "pp2-dp2-zero0", "pp2-dp2-zero1",
                              "tp2-dp2-zero2-sequence-parallel"])
def test_deepspeed_equals_one_process(checkpoint, expected, tp, pp, dp, stage, sequence_parallel):
    for params in run_distributed(_deepspeed_steps, tp * pp * dp, checkpoint, tp, pp, stage, sequence_parallel,
                                  timeout=110):
        for name, value in params.items():
            source = "transformer.wte.weight" if name == "lm_head.weight" else name
            torch.testing.assert_close(value, expected[source], msg=lambda m, n=name: f"{n}: {m}")


def _zero2_with_pipelines(rank, world_size, path):
    _without_shm_kernel()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2, micro_batch_size=2)
    engine, _, _, _ = deepspeed.initialize(model=model.gpu_modules(), model_parameters=model.gpu_parameters(),
                                           mpu=model.mpu, config=ds_config(2, ROWS))
    try:
        engine(**global_batch(0))
    except NotImplementedError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_zero2_with_pipelines_is_refused(checkpoint):
    for message in run_distributed(_zero2_with_pipelines, 2, checkpoint, timeout=50):
        assert message is not None and "ZeRO stage 2" in message and "stage 0 or 1" in message, message


def _lora_config():
    import peft

    return peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj"], init_lora_weights=False)


def _peft_reference(rank, world_size, path):
    import peft

    model = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    torch.manual_seed(0)
    model = peft.get_peft_model(model, _lora_config())
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, eps=EPS, weight_decay=0.0)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(**global_batch(step)).loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, MAX_NORM)
        optimizer.step()
    return peft.get_peft_model_state_dict(model)


def _peft_deepspeed_steps(rank, world_size, path, tp, stage):
    import peft

    _without_shm_kernel()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp).train()
    torch.manual_seed(0)
    adapted = peft.get_peft_model(model, _lora_config())
    mpu = model.mpu
    rows = ROWS // mpu.get_data_parallel_world_size()
    engine, _, _, _ = deepspeed.initialize(
        model=adapted.gpu_modules(), model_parameters=[p for p in adapted.gpu_parameters() if p.requires_grad],
        mpu=mpu, config=ds_config(stage, rows))
    start = mpu.get_data_parallel_rank() * rows
    for step in range(STEPS):
        batch = {name: value[start:start + rows] for name, value in global_batch(step).items()}
        engine.backward(engine(**batch).loss)
        engine.step()
    return {name: value.full_tensor() if hasattr(value, "full_tensor") else value
            for name, value in peft.get_peft_model_state_dict(adapted).items()}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tp, processes, stage", [(2, 4, 1), (1, 2, 2)], ids=["tp2-dp2-zero1", "dp2-zero2"])
def test_a_peft_adapter_trains_under_deepspeed_as_in_one_process(checkpoint, tp, processes, stage):
    """A LoRA adapter (the base model frozen) under DeepSpeed as the manual writes it: the frozen weights take no
    gradient hooks (registering one on a tensor that takes no gradient raised), and the trained adapter is the one
    one process trains on the global batch."""
    pytest.importorskip("peft")
    expected, = run_distributed(_peft_reference, 1, checkpoint, timeout=100)
    for state in run_distributed(_peft_deepspeed_steps, processes, checkpoint, tp, stage, timeout=180):
        assert sorted(state) == sorted(expected)
        for name, value in state.items():
            torch.testing.assert_close(value, expected[name], msg=lambda m, n=name: f"{n}: {m}")
