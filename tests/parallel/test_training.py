"""Training under tensor and data parallelism: DDP over model.gpu_modules(), tp-aware dropout,
gradient clipping, the mpu accessors, ``num_items_in_batch``, and what a training call returns. That the
manual's loop at every (tp, pp, dp) equals one process, for every head: tests/models/test_zoo.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

import oslo
from tests.distributed import run_distributed
from tests.helpers import full_grads, full_params, save_reference, tiny_gpt2_config
from tests.models import zoo


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return str(path)


def _global_batch(steps=3, batch=4, length=10):
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 1001, (batch, length), generator=generator) for _ in range(steps)]


FROZEN = "transformer.h.0."


def _train(rank, world_size, path, tp, freeze=False):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp)
    model.train()
    mpu = model.mpu
    wrapped = model.gpu_modules()
    if freeze:  # after gpu_modules(), before DDP: DDP registers the weights the model says train
        for name, param in model.named_parameters():
            param.requires_grad_(not name.startswith(FROZEN))
    ddp = DistributedDataParallel(wrapped, process_group=mpu.get_data_parallel_group())
    # SGD: Adam would amplify float rounding in near-zero gradients into visible update differences.
    optimizer = torch.optim.SGD(model.gpu_parameters(), lr=0.5)
    dp_size, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    losses = []
    for batch in _global_batch():
        local = batch.chunk(dp_size)[dp_rank]  # each replica gets its part of the global batch
        optimizer.zero_grad()
        loss = ddp(input_ids=local, labels=local, gather_logits=False).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=mpu.get_data_parallel_group())
        losses.append(global_loss.item() / dp_size)
    return losses, full_params(model)


def _train_reference(path, freeze=False):
    model = transformers.GPT2LMHeadModel.from_pretrained(path)
    model.train()
    for name, param in model.named_parameters():
        param.requires_grad_(not (freeze and name.startswith(FROZEN)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in _global_batch():
        optimizer.zero_grad()
        # Equal-size replicas: the mean of per-replica mean losses is what DDP optimizes.
        loss = torch.stack([model(input_ids=part, labels=part).loss for part in batch.chunk(2)]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("freeze", [False, True], ids=["", "frozen-after-gpu-modules"])
def test_tp2_dp2_equals_single_process(lm_checkpoint, freeze):
    """DDP over gpu_modules() at tp=2 x dp=2 trains as one process on the global batch; also with the first block
    frozen on the model after gpu_modules() and before DDP wraps it (DDP then waits for none of its gradients)."""
    results = run_distributed(_train, 4, lm_checkpoint, 2, freeze, timeout=180)
    expected_losses, expected_params = _train_reference(lm_checkpoint, freeze)
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses))
        for name, value in expected_params.items():
            torch.testing.assert_close(params[name], value,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _dropout_training(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=world_size, resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3, seed=11
    )
    model.train()
    torch.manual_seed(100 + rank)  # the ranks' global RNGs differ; the model's streams must not care
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in _global_batch():
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    replicated = {n: p.detach() for n, p in model.named_parameters() if "ln_" in n or "wpe" in n
                  or n.endswith("c_proj.bias")}
    # Attention dropout on this rank's heads: masks must differ across ranks.
    with model.parallel_context.rng.split():
        mask = torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True)
    return replicated, mask


def test_dropout_keeps_replicated_parameters_identical(lm_checkpoint):
    (replicated_0, mask_0), (replicated_1, mask_1) = run_distributed(_dropout_training, 2, lm_checkpoint)
    assert replicated_0.keys() == replicated_1.keys() and len(replicated_0) > 8
    for name, value in replicated_0.items():
        assert torch.equal(value, replicated_1[name]), f"{name} drifted apart across tp ranks"
    assert not torch.equal(mask_0, mask_1)


def _clip(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    batch = _global_batch()[0]
    model(input_ids=batch, labels=batch).loss.backward()
    norm = model.clip_grad_norm_(0.5)
    inf_norm = oslo.clip_grad_norm_(model, 1e9, norm_type=float("inf"))
    return norm, inf_norm, full_params(model)["transformer.h.1.mlp.c_fc.weight"]


def test_clip_grad_norm_counts_every_parameter_once(lm_checkpoint):
    reference = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint)
    batch = _global_batch()[0]
    reference(input_ids=batch, labels=batch).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    expected_inf = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type=float("inf"))
    for tp in (1, 2, 4):
        for norm, inf_norm, _ in run_distributed(_clip, tp, lm_checkpoint):
            torch.testing.assert_close(norm, expected)
            torch.testing.assert_close(inf_norm, expected_inf)


def _mpu(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2)
    mpu = model.mpu
    return dict(
        tp=(mpu.get_tensor_parallel_rank(), mpu.get_tensor_parallel_world_size()),
        dp=(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
        pp=(mpu.get_pipeline_parallel_rank(), mpu.get_pipeline_parallel_world_size()),
        mp=(mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
        megatron=(mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
        tp_peers=dist.get_process_group_ranks(mpu.get_tensor_parallel_group()),
        dp_peers=dist.get_process_group_ranks(mpu.get_data_parallel_group()),
        mp_peers=dist.get_process_group_ranks(mpu.get_model_parallel_group()),
    )


def test_mpu_accessors(lm_checkpoint):
    info = run_distributed(_mpu, 4, lm_checkpoint)
    assert [i["tp"] for i in info] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [i["dp"] for i in info] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert all(i["pp"] == (0, 1) for i in info)
    assert [i["mp"] for i in info] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [i["megatron"] for i in info] == [i["tp"] for i in info]
    assert [i["tp_peers"] for i in info] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [i["dp_peers"] for i in info] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [i["mp_peers"] for i in info] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def _gpt2(name: str, zoo_checkpoints) -> tuple[str, dict]:
    """A GPT2 head's zoo checkpoint and its 8-row training batch (padding, -100 labels)."""
    case = next(c for c in zoo.cases_of("gpt2") if c.key == name)
    return f"{zoo_checkpoints('gpt2')}/{case.key}", zoo.training_batch(case)


def _num_items(rank, world_size, path, batch):
    """`num_items_in_batch` (transformers' Trainer passes it) divides the sums instead, as transformers does."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, pipeline_parallel_size=2, micro_batch_size=4
    ).train()
    losses = [out.loss.detach() for out in model(**batch, num_items_in_batch=100) if out.loss.backward() is None]
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    expected = [reference(**{k: v[i : i + 4] for k, v in batch.items()}, num_items_in_batch=100).loss
                for i in (0, 4)]
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected).detach())
    sum(expected).backward()
    theirs = {n: p.grad for n, p in reference.named_parameters()}
    for name, grad in full_grads(model).items():
        source = "transformer.wte.weight" if name == "lm_head.weight" else name
        torch.testing.assert_close(grad, theirs[source], msg=name)


def test_num_items_in_batch_is_honoured(zoo_checkpoints):
    run_distributed(_num_items, 2, *_gpt2("GPT2LMHeadModel", zoo_checkpoints))


def _logits_by_default(rank, world_size, path, batch, double_heads_path, choices):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2).train()
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    expected = reference(**batch)
    trained = model(**batch)  # a training call: the loss, no all-gather of the logits
    torch.testing.assert_close(trained.loss, expected.loss)
    assert "logits" not in trained and trained[0] is trained.loss and len(trained.to_tuple()) == 2  # + the cache
    with pytest.raises(AttributeError, match="logits were not gathered.*Pass gather_logits=True"):
        trained.logits  # noqa: B018
    assert "logits=" not in repr(trained)
    torch.testing.assert_close(model(**batch, gather_logits=True).logits, expected.logits)
    assert model(**batch, gather_logits=False).logits is None
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected.logits)  # evaluation as before
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    torch.testing.assert_close(model(**unlabelled).logits, expected.logits)  # no labels
    torch.testing.assert_close(model.eval()(**batch).logits, expected.logits)  # eval mode
    doubled = oslo.GPT2DoubleHeadsModel.from_pretrained_with_parallel(double_heads_path, tensor_parallel_size=2)
    with pytest.raises(AttributeError, match="gather_logits=True"):
        doubled.train()(**choices).logits  # noqa: B018


def test_training_call_skips_the_logits_gather_and_says_so(zoo_checkpoints):
    run_distributed(_logits_by_default, 2, *_gpt2("GPT2LMHeadModel", zoo_checkpoints),
                    *_gpt2("GPT2DoubleHeadsModel", zoo_checkpoints))


def _ddp_over_the_world(rank, world_size, path, batch):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2).train()
    wrong = DistributedDataParallel(model.gpu_modules())  # the default group: both tensor-parallel ranks
    with pytest.raises(ValueError, match=r"over ranks \[0, 1\], but this rank's data-parallel replicas are ranks "
                                         rf"\[{rank}\].*process_group=model.mpu.get_data_parallel_group"):
        wrong(**batch)


def test_ddp_over_another_group_than_the_data_parallel_one_is_refused(zoo_checkpoints):
    run_distributed(_ddp_over_the_world, 2, *_gpt2("GPT2LMHeadModel", zoo_checkpoints))


def _ddp_of_the_model_itself(rank, world_size, path, batch, tp):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp).train()
    expected = r"cannot reduce the parameters of GPT2LMHeadModel: .* DTensors.*DistributedDataParallel\(model\.gpu_"
    with pytest.raises(ValueError, match=expected):
        DistributedDataParallel(model, process_group=model.mpu.get_data_parallel_group())
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)  # its recipe: prepare() wraps the model in DDP over every process
    with pytest.raises(ValueError, match=expected):
        accelerator.prepare(model)
    if tp == 1:  # handed gpu_modules(), accelerate's DDP is over the data-parallel group: the recipe trains
        accelerator.backward(accelerator.prepare(model.gpu_modules())(**batch).loss)
        assert all(param.grad is not None for param in model.parameters())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_ddp_of_the_model_itself_is_refused_with_the_fix(zoo_checkpoints, tp):
    """DDP (and accelerate's prepare(), which wraps in DDP) cannot reduce DTensor parameters: a clear error at
    construction, before any collective, naming gpu_modules(); before, DDP failed inside DTensor's dispatch
    ("Cannot flatten unevenly sharded tensor")."""
    run_distributed(_ddp_of_the_model_itself, 2, *_gpt2("GPT2LMHeadModel", zoo_checkpoints), tp, timeout=50)


def _accelerate_recipe(rank, world_size, path, directory):
    """accelerate's loop at data parallel 2: prepare(gpu_modules(), optimizer), AdamW steps, save_state and
    load_state, and the model saved as its examples save it."""
    import os

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path).train()
    model_ddp, optimizer = accelerator.prepare(model.gpu_modules(), torch.optim.AdamW(model.parameters(), lr=1e-2))
    batches = _global_batch(steps=3)

    def step(input_ids):
        accelerator.backward(model_ddp(input_ids=input_ids, labels=input_ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        return weights()

    def weights():  # copies: without model parallelism a whole tensor may be the parameter's own memory
        return {name: value.clone() for name, value in full_params(model).items()}

    step(batches[0])
    accelerator.save_state(os.path.join(directory, "state"))
    saved, expected = weights(), step(batches[1])
    step(batches[2])
    accelerator.load_state(os.path.join(directory, "state"))
    restored = weights()
    resumed = step(batches[1])  # AdamW's moments restored too: the same step as before
    accelerator.unwrap_model(model_ddp).save_pretrained(os.path.join(directory, "model"),
                                                        is_main_process=accelerator.is_main_process,
                                                        save_function=accelerator.save)
    accelerator.wait_for_everyone()
    return saved, restored, expected, resumed


@pytest.mark.timeout(90)
def test_accelerate_save_state_and_load_state(lm_checkpoint, tmp_path):
    """accelerate's save_state writes the wrapper's state dict with safetensors: without model parallelism it holds
    plain tensors (DTensors it could not write: "invalid python storage"), and load_state resumes the run."""
    for saved, restored, expected, resumed in run_distributed(_accelerate_recipe, 2, lm_checkpoint, str(tmp_path),
                                                              timeout=80):
        for name in saved:
            torch.testing.assert_close(restored[name], saved[name], msg=lambda m, n=name: f"restored {n}: {m}")
            torch.testing.assert_close(resumed[name], expected[name], msg=lambda m, n=name: f"resumed {n}: {m}")
    written = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "model"))
    for name, param in written.named_parameters():
        torch.testing.assert_close(param, resumed[name], msg=lambda m, n=name: f"{n}: {m}")


def _ddp_pipeline_steps(rank, world_size, path):
    """Three steps of the manual's DDP loop at pp 2 (GPT2's tied wte and lm_head on both stages), the optimizer over
    ``model.parameters()`` (the DTensors: torch's ``zero_grad`` clears their gradients, not the storages' that DDP
    trains). Returns the weights, whole, and transformers' after the same steps on the same batches."""
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2, micro_batch_size=2)
    model.train()
    ddp = DistributedDataParallel(model.gpu_modules(), process_group=model.mpu.get_data_parallel_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = torch.optim.SGD(reference.parameters(), lr=0.5)
    for batch in _global_batch():
        optimizer.zero_grad()
        for micro_output in ddp(input_ids=batch, labels=batch):
            micro_output.loss.backward()
        optimizer.step()
        expected.zero_grad()
        reference(input_ids=batch, labels=batch).loss.backward()
        expected.step()
    ours = full_params(model)
    return {name: (ours[name], param.detach()) for name, param in reference.named_parameters(remove_duplicate=False)
            if name in ours}


def test_ddp_pipeline_steps_after_zero_grad_on_the_dtensors(lm_checkpoint):
    """Each step's snapshot of the tied weights' gradients (so gradients accumulated before a step are not
    summed over the stages twice) sees a gradient the optimizer cleared as cleared: it used to read the storage's
    stale one, and every step after the first got this step's gradient minus the last one's."""
    held = set()
    for weights in run_distributed(_ddp_pipeline_steps, 2, lm_checkpoint, timeout=180):
        held |= set(weights)
        for name, (ours, theirs) in weights.items():
            torch.testing.assert_close(ours, theirs, msg=lambda m, n=name: f"{n}: {m}")
    assert {"transformer.wte.weight", "lm_head.weight"} <= held


def _ddp_wrapper_parameters(rank, world_size, path, batch):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2).train()
    model_ddp = DistributedDataParallel(model.gpu_modules(), process_group=model.mpu.get_data_parallel_group())
    # each weight once: the plain shards DDP trains, not also the model's DTensors (the same memory)
    assert [id(p) for p in model_ddp.parameters()] == [id(p) for p in model.gpu_parameters()]
    assert len(list(model_ddp.parameters())) == len(list(model.parameters()))
    bucket_views = DistributedDataParallel(model.gpu_modules(), process_group=model.mpu.get_data_parallel_group(),
                                           gradient_as_bucket_view=True)
    with pytest.raises(ValueError, match=r"gradient_as_bucket_view=True\) is not supported"):
        bucket_views(**batch)


def test_the_ddp_wrapper_lists_each_weight_once_and_refuses_bucket_views(zoo_checkpoints):
    """``model_ddp.parameters()`` (an optimizer or a norm over the wrapper) sees each weight once;
    ``gradient_as_bucket_view=True``, under which the model's gradients would miss DDP's average, is refused
    with the fix."""
    run_distributed(_ddp_wrapper_parameters, 2, *_gpt2("GPT2LMHeadModel", zoo_checkpoints))


def _ddp_checkpoint(rank, world_size, path, tp, directory):
    """torch's DDP checkpoint recipe on the wrapper of ``gpu_modules()``: one step, then ``model_ddp.module``'s and
    ``model_ddp``'s state dicts saved (each rank its own file: its slices) and loaded into fresh models."""
    import os

    def build():
        model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp).train()
        return model, DistributedDataParallel(model.gpu_modules(), process_group=model.mpu.get_data_parallel_group())

    model, model_ddp = build()
    input_ids = _global_batch(steps=1)[0]
    model_ddp(input_ids=input_ids, labels=input_ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    module_file, ddp_file = (os.path.join(directory, f"{kind}-{rank}.pt") for kind in ("module", "ddp"))
    torch.save(model_ddp.module.state_dict(), module_file)
    torch.save(model_ddp.state_dict(), ddp_file)
    keys = sorted(model.state_dict())
    assert sorted(model_ddp.module.state_dict()) == keys
    assert sorted(model_ddp.state_dict()) == [f"module.{key}" for key in keys]
    trained = full_params(model)
    loaded = []
    for file in (module_file, ddp_file):
        fresh, fresh_ddp = build()
        target = fresh if file == module_file else fresh_ddp
        target.load_state_dict(torch.load(file, weights_only=True))  # strict: every key used, none missing
        loaded.append(full_params(fresh))
    return trained, loaded


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_ddp_checkpoints_hold_the_models_names(lm_checkpoint, tmp_path, tp):
    """``model_ddp.module`` is ``gpu_modules()``' wrapper, whose state dict is the model's, under the model's names,
    as a DDP-wrapped plain model's is: ``torch.save(model_ddp.module.state_dict())`` loads into a fresh model, and
    ``model_ddp.state_dict()`` (``module.`` + those names) into a fresh wrapper. Before, the wrapper's names were
    ``module.`` + the model's, beside its plain shards': loading them into the model failed."""
    for trained, loaded in run_distributed(_ddp_checkpoint, 2, lm_checkpoint, tp, str(tmp_path), timeout=80):
        for params in loaded:
            for name, value in trained.items():
                torch.testing.assert_close(params[name], value, msg=lambda m, n=name: f"{n}: {m}")
