"""Shards torch understands: at tensor parallelism the parameters are DTensors, so the tools users already
run on their models are right on oslo models — torch's ``clip_grad_norm_``, ``state_dict`` /
``load_state_dict``, ``full_tensor()`` — checked against one process on the whole batch."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import oslo
import oslo.parallel.dtensor as dtensor_module
from oslo.parallel.dtensor import parameter_specs, unblock
from tests.distributed import run_distributed
from tests.helpers import full_grads, full_params, save_reference, tiny_gpt2_config

LR = 0.5
MAX_NORM = 0.5  # well under the gradient norm (about 3): every layout must clip by the same factor
ROWS = 8


def global_batch(length: int = 10) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    input_ids = torch.randint(3, 1001, (ROWS, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, padding in enumerate([0, 4, 2, 0, 6, 1, 3, 0]):
        attention_mask[row, :padding] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(n_layer=2), path)
    return str(path)


def reference_clipped_step(path: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """transformers' model, one process, the whole batch: backward, stock clipping, one SGD step."""
    model = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model(**global_batch()).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    return {name: param.detach() for name, param in model.named_parameters()}, norm


def _stock_clipped_step(rank, world_size, path, tp, wrap):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp).train()
    mpu = model.mpu
    call = DistributedDataParallel(model.gpu_modules(), process_group=mpu.get_data_parallel_group()) \
        if wrap else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = ROWS // mpu.get_data_parallel_world_size()
    start = mpu.get_data_parallel_rank() * rows
    call(**{name: value[start:start + rows] for name, value in global_batch().items()}).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # the stock call, unchanged
    optimizer.step()
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return full_params(model), norm


@pytest.mark.parametrize("tp, dp, wrap", [(2, 1, False), (2, 2, True)], ids=["tp2", "tp2-dp2-ddp"])
def test_stock_clip_grad_norm_equals_one_process(checkpoint, tp, dp, wrap):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) gives the whole model's norm on every rank, and
    the clipped step the weights of one process on the global batch (before DTensor parameters each rank
    clipped by its own shard's norm: 5e-3 off)."""
    expected, expected_norm = reference_clipped_step(checkpoint)
    assert expected_norm > 2 * MAX_NORM
    for params, norm in run_distributed(_stock_clipped_step, tp * dp, checkpoint, tp, wrap):
        torch.testing.assert_close(norm, expected_norm)
        for name, value in params.items():
            source = "transformer.wte.weight" if name == "lm_head.weight" else name
            torch.testing.assert_close(value, expected[source], msg=lambda m, n=name: f"{n}: {m}")


def _state_dict_round_trip(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    state = model.state_dict()
    kinds = {name: type(value).__name__ for name, value in state.items()}
    full = {}
    specs = parameter_specs(model)
    for name, value in state.items():  # transformers' shape (GPT2's fused c_attn through strided sharding)
        full[name] = unblock(value.full_tensor(), specs.get(name))  # (blocks where torch cannot plan that)
    attributes = {name: (p.tensor_model_parallel, p.partition_dim, p.partition_stride)
                  for name, p in model.named_parameters()}
    # A model with other weights takes this state dict at the same layout and computes the same logits.
    other = oslo.GPT2LMHeadModel.from_config_with_parallel(model.config, tensor_parallel_size=world_size, seed=5)
    batch = global_batch()
    before = other(input_ids=batch["input_ids"]).logits
    other.load_state_dict(state)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
        loaded = other(input_ids=batch["input_ids"]).logits
    return kinds, full, attributes, (before - logits).abs().max().item(), (loaded - logits).abs().max().item()


def test_state_dict_is_self_describing_and_loads_at_the_same_layout(checkpoint):
    reference = transformers.GPT2LMHeadModel.from_pretrained(checkpoint).state_dict()
    for kinds, full, attributes, before, after in run_distributed(_state_dict_round_trip, 2, checkpoint):
        assert set(kinds.values()) == {"DTensor"}, kinds
        for name, value in full.items():
            torch.testing.assert_close(value, reference[name], msg=lambda m, n=name: f"{n}: {m}")
        # Megatron's attributes, read by DeepSpeed's gradient norm through mpu, apex and NeMo.
        assert attributes["transformer.wte.weight"] == (True, 0, 1)
        assert attributes["transformer.h.0.attn.c_attn.weight"] == (True, 1, 3)
        assert attributes["transformer.h.0.attn.c_proj.weight"] == (True, 0, 1)
        assert attributes["transformer.h.0.ln_1.weight"] == (False, -1, 1)
        assert before > 1e-3 and after == 0.0, (before, after)


def _fsdp2_step(rank, world_size, path, tp, sequence_parallel=False):
    """PyTorch's 2D recipe on an oslo model: fully_shard every block, then the model, over the dp mesh."""
    from torch.distributed.fsdp import fully_shard

    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp,
                                                               sequence_parallel=sequence_parallel).train()
    mpu = model.mpu
    before = sum(p.to_local().numel() for p in model.parameters())
    for block in model.transformer.h:
        fully_shard(block, mesh=model.device_mesh["dp"])
    fully_shard(model, mesh=model.device_mesh["dp"])
    after = sum(p.to_local().numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    rows = ROWS // mpu.get_data_parallel_world_size()
    start = mpu.get_data_parallel_rank() * rows
    model(**{name: value[start:start + rows] for name, value in global_batch().items()}).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    state_elements = sum(v.to_local().numel() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    # under FSDP2 GPT2's c_attn.bias is seen as (3, n / 3) blocks (FSDP2 does not compose with its strided sharding)
    specs = parameter_specs(model)
    full = {name: unblock(p.full_tensor(), specs.get(name)) for name, p in model.named_parameters()}
    full = {name: value.flatten(-2) if name.endswith("c_attn.bias") and value.dim() == 2 else value
            for name, value in full.items()}
    return full, norm.full_tensor(), before, after, state_elements


@pytest.mark.parametrize("tp, dp, sequence_parallel", [(2, 2, False), (1, 4, False), (2, 2, True)],
                         ids=["tp2-dp2", "tp1-dp4", "tp2-dp2-sequence-parallel"])
def test_fsdp2_composes_with_tensor_parallelism(checkpoint, tp, dp, sequence_parallel):
    """fully_shard over model.device_mesh["dp"], stock clipping, AdamW: the weights of one process on the
    global batch (the replicas' rows hold different numbers of label tokens); parameters and optimizer
    state per rank are about 1/dp of the tensor-parallel shard. With sequence parallelism too."""
    model = transformers.GPT2LMHeadModel.from_pretrained(checkpoint).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    model(**global_batch()).loss.backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    expected = dict(model.named_parameters())
    for full, norm, before, after, state_elements in run_distributed(_fsdp2_step, tp * dp, checkpoint, tp,
                                                                      sequence_parallel):
        torch.testing.assert_close(norm, expected_norm)
        for name, value in full.items():
            source = "transformer.wte.weight" if name == "lm_head.weight" else name
            torch.testing.assert_close(value, expected[source].detach(), msg=lambda m, n=name: f"{n}: {m}")
        assert after <= 1.05 * before / dp, (before, after)  # FSDP2 pads each tensor to a multiple of dp rows
        assert state_elements == 2 * after, (state_elements, after)  # exp_avg and exp_avg_sq of the shards


def _accelerate_and_deepspeed_norms(rank, world_size, path):
    """The gradient norm as accelerate's clip_grad_norm_ (what transformers' Trainer calls) and DeepSpeed's
    engine (through mpu, on model.gpu_modules()'s plain shards, as the manual hands them to DeepSpeed) see it."""
    import deepspeed
    from accelerate import Accelerator
    from deepspeed.runtime.utils import clip_grad_norm_ as deepspeed_clip_grad_norm_
    from deepspeed.utils import groups

    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size).train()
    # DeepSpeed's communication layer over torch's gloo group; without its optional shared-memory kernel, a
    # C++ extension it would compile on first use (a minute and a compiler), which collectives do not need.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    groups.mpu = model.mpu  # what deepspeed.initialize(mpu=model.mpu) sets
    module = model.gpu_modules()
    module(**global_batch()).loss.backward()
    # The engine's clipping (ZeRO 0/1 select the same parameters: split ones on every rank, the others on
    # model-parallel rank 0, by Megatron's attributes), on a copy of the gradients.
    grads = [p.grad.clone() for p in module.parameters()]
    deepspeed_norm = deepspeed_clip_grad_norm_(list(module.parameters()), MAX_NORM, mpu=model.mpu)
    for p, grad in zip(module.parameters(), grads, strict=True):
        p.grad.copy_(grad)
    accelerate_norm = Accelerator(cpu=True).clip_grad_norm_(model.parameters(), MAX_NORM)
    accelerate_norm = accelerate_norm.full_tensor() if isinstance(accelerate_norm, DTensor) else accelerate_norm
    return torch.as_tensor(deepspeed_norm, dtype=torch.float32), accelerate_norm


def test_accelerate_and_deepspeed_see_the_whole_model_norm(checkpoint):
    """Before DTensor parameters and Megatron attributes, accelerate's norm was each rank's shard's (2.31 and
    2.27 for 2.78) and DeepSpeed's counted replicated parameters once per rank."""
    _, expected = reference_clipped_step(checkpoint)
    for deepspeed_norm, accelerate_norm in run_distributed(_accelerate_and_deepspeed_norms, 2, checkpoint):
        torch.testing.assert_close(deepspeed_norm, expected)
        torch.testing.assert_close(accelerate_norm, expected)


def _fsdp2_with_pipelines(rank, world_size, path):
    from torch.distributed.fsdp import fully_shard

    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2).train()
    fully_shard(model, mesh=model.device_mesh["dp"])
    batch = global_batch()
    try:
        next(iter(model(**batch)))
    except NotImplementedError as exc:
        return str(exc)
    return None


def test_fsdp2_with_pipelines_is_refused_on_every_rank(checkpoint):
    for message in run_distributed(_fsdp2_with_pipelines, 4, checkpoint):
        assert message is not None and "pipeline_parallel_size=2" in message and "DistributedDataParallel" in message


def _stock_clip_with_pipelines(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2,
                                                              tensor_parallel_size=2).train()
    for micro_output in model(**global_batch()):
        micro_output.loss.backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    except oslo.parallel.PipelineStageNormError as exc:
        refused = str(exc)
    else:
        refused = None
    return refused, model.clip_grad_norm_(MAX_NORM)


def test_stock_clip_with_pipelines_is_refused_and_model_clip_is_right(checkpoint):
    """At pipeline_parallel_size > 1 torch's function would see one stage's gradients: it raises on every rank
    (before any collective), naming model.clip_grad_norm_, which gives the whole model's norm."""
    _, expected = reference_clipped_step(checkpoint)
    for refused, norm in run_distributed(_stock_clip_with_pipelines, 4, checkpoint):
        assert refused is not None and "model.clip_grad_norm_" in refused and "pipeline_parallel_size=2" in refused
        torch.testing.assert_close(norm, expected)


def _shapes(rank, world_size, path, tp, pp):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}, dtensor_module._STRIDED_SHARDING


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)], ids=["2-1", "1-2", "2-2"])
def test_every_parameter_has_transformers_shape(checkpoint, tp, pp):
    """Code that reads shapes (PEFT, custom inits, a checkpoint's metadata) sees transformers' model at every layout:
    GPT2's fused c_attn weight and bias are DTensors of shapes (in, 3 * n) and (3 * n,) whose placement (PyTorch's
    strided sharding) says how q, k and v are split."""
    reference = {name: tuple(p.shape) for name, p in transformers.GPT2LMHeadModel.from_pretrained(checkpoint)
                 .named_parameters(remove_duplicate=False)}
    for shapes, strided in run_distributed(_shapes, tp * pp, checkpoint, tp, pp):
        assert strided  # torch plans strided sharding (2.11 with oslo's fallback, 2.13 itself)
        assert shapes and shapes == {name: reference[name] for name in shapes}


def _load_whole_state_dict(rank, world_size, path):
    """A transformers state dict (whole plain tensors) loaded into a split model with other weights."""
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(reference.config, tensor_parallel_size=world_size,
                                                            seed=5).eval()
    batch = global_batch()
    with torch.no_grad():
        before = model(**batch).logits
        result = model.load_state_dict(reference.state_dict(), strict=False)
        after = model(**batch).logits
        expected = reference(**batch).logits
    assert not result.unexpected_keys, result.unexpected_keys
    assert not torch.allclose(before, expected)
    torch.testing.assert_close(after, expected)
    return True


def _gradients(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size).train()
    model(**global_batch()).loss.backward()
    return full_grads(model), {name: tuple(p.shape) for name, p in model.named_parameters()}


def _without_strided_sharding(rank, world_size, path, worker):
    """``worker`` with oslo's DTensors as it builds them where torch cannot redistribute PyTorch's strided sharding
    (torch 2.11): its answer forced, whatever this torch would say."""
    dtensor_module._probe_strided_sharding.done = True
    dtensor_module._STRIDED_SHARDING = False
    return globals()[worker](rank, world_size, path)


def test_blocks_where_torch_cannot_plan_strided_sharding(checkpoint):
    """The fallback layout, on any torch: GPT2's fused c_attn as DTensors of (in, 3, n) and (3, n) blocks; the
    gradients (through unblock), a state dict round trip and transformers' whole tensors loading, as in the
    strided layout."""
    reference = transformers.GPT2LMHeadModel.from_pretrained(checkpoint).train()
    reference(**global_batch()).loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for grads, shapes in run_distributed(_without_strided_sharding, 2, checkpoint, "_gradients"):
        assert shapes["transformer.h.0.attn.c_attn.weight"] == (32, 3, 32), shapes
        assert shapes["transformer.h.0.attn.c_attn.bias"] == (3, 32), shapes
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], msg=lambda m, n=name: f"{n}: {m}")
    state = reference.state_dict()
    for _, full, _, before, after in run_distributed(_without_strided_sharding, 2, checkpoint,
                                                     "_state_dict_round_trip"):
        for name, value in full.items():
            torch.testing.assert_close(value, state[name], msg=lambda m, n=name: f"{n}: {m}")
        assert before > 1e-3 and after == 0.0, (before, after)
    assert run_distributed(_without_strided_sharding, 2, checkpoint, "_load_whole_state_dict") == [True, True]


def _with_a_planner_that_refuses_strided_sharding(rank, world_size, path):
    """``_gradients`` where torch's graph-based redistribution planner refuses a ``_StridedShard`` that names no
    device order, as torch 2.11's does (its ValueError, word for word), whatever this torch would do."""
    from torch.distributed.tensor._redistribute import DTensorRedistributePlanner
    from torch.distributed.tensor.placement_types import _StridedShard

    def refusing(self, src_spec, dst_spec, *args, **kwargs):
        placements = (*src_spec.placements, *dst_spec.placements)
        if any(isinstance(p, _StridedShard) for p in placements):
            refusing.refused += 1
            raise ValueError(f"use_strided_shard_as_shard_order is True, but placements: {src_spec.placements} is "
                             "unable to be interpreted into a corresponding shard_order")
        return planner(self, src_spec, dst_spec, *args, **kwargs)

    refusing.refused = 0
    planner = DTensorRedistributePlanner.generate_graph_based_transform_infos
    DTensorRedistributePlanner.generate_graph_based_transform_infos = refusing
    dtensor_module._probe_strided_sharding.done = False
    dtensor_module._STRIDED_SHARDING = True
    grads, shapes = _gradients(rank, world_size, path)
    return grads, shapes, refusing.refused


def test_strided_sharding_where_torch_plans_it_only_greedily(checkpoint):
    """torch 2.11 (the GPU image's) carries out ``_StridedShard -> Replicate`` but its graph-based planner refuses to
    plan it on a 1-D mesh; oslo falls back to the greedy plan there, as torch 2.13 does: GPT2's c_attn keeps
    transformers' shape at tp=2 (with the blocks layout an adapter or a Trainer checkpoint saw other shapes) and
    every gathered gradient equals transformers'."""
    reference = transformers.GPT2LMHeadModel.from_pretrained(checkpoint).train()
    reference(**global_batch()).loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for grads, shapes, refused in run_distributed(_with_a_planner_that_refuses_strided_sharding, 2, checkpoint):
        assert refused > 0  # the emulated refusal was met
        assert shapes["transformer.h.0.attn.c_attn.weight"] == (32, 96), shapes
        assert shapes["transformer.h.0.attn.c_attn.bias"] == (96,), shapes
        assert set(grads) == set(expected)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], msg=lambda m, n=name: f"{n}: {m}")


def _shapes_on_two_stages(rank, world_size, path):
    return _shapes(rank, world_size, path, 1, 2)[0]


def test_blocks_only_where_a_fused_parameter_is_split(checkpoint):
    """Where torch cannot plan strided sharding, a fused parameter that one rank holds whole (tensor_parallel_size
    1: pipelines, data parallelism) keeps transformers' shape: PEFT's adapters, the optimizer's state and saved
    checkpoints see transformers' model there (with blocks, an adapter on c_attn got shapes of its own)."""
    reference = {name: tuple(p.shape) for name, p in transformers.GPT2LMHeadModel.from_pretrained(checkpoint)
                 .named_parameters(remove_duplicate=False)}
    for shapes in run_distributed(_without_strided_sharding, 2, checkpoint, "_shapes_on_two_stages"):
        assert any(name.endswith("attn.c_attn.weight") for name in shapes), shapes
        assert shapes == {name: reference[name] for name in shapes}


def test_a_whole_state_dict_loads_into_a_split_model(checkpoint):
    """``load_state_dict`` of transformers' whole tensors at tp=2: each parameter takes its slice (GPT2's fused
    c_attn block by block, the vocabulary padded), as the embedding layers PEFT saves beside an adapter load."""
    assert run_distributed(_load_whole_state_dict, 2, checkpoint) == [True, True]


def _deep_copy(rank, world_size, path, tp, pp):
    """``copy.deepcopy(model)`` (an EMA model, say): the same outputs, then trained on its own: the original's
    outputs do not move, the copy's do."""
    import copy

    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp,
                                                              pipeline_parallel_size=pp, micro_batch_size=4)
    twin = copy.deepcopy(model)
    assert twin.parallel_context is model.parallel_context
    batch = global_batch()
    with torch.no_grad():
        before = model(**batch).logits
        torch.testing.assert_close(twin(**batch).logits, before, rtol=0, atol=0)
    twin.train()
    optimizer = torch.optim.SGD(twin.parameters(), lr=LR)
    output = twin(**batch)
    for micro_output in (output if pp > 1 else [output]):
        micro_output.loss.backward()
    optimizer.step()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, before, rtol=0, atol=0)
        return bool((twin(**batch).logits - before).abs().max() > 1e-3)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_a_deep_copy_is_another_model_on_the_same_groups(checkpoint, tp, pp):
    assert run_distributed(_deep_copy, tp * pp, checkpoint, tp, pp) == [True] * (tp * pp)
