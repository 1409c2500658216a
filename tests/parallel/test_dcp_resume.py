"""Resume anywhere: PyTorch's documented checkpoint recipe, unchanged, on oslo models —
``get_state_dict(model, optimizer)`` -> ``torch.distributed.checkpoint.save``, then ``dcp.load`` ->
``set_state_dict`` — saved at (tp, pp, dp) = (2, 2, 1) and resumed at other layouts continues as one
process would: the weights after two more AdamW steps equal transformers' after the same three steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

import oslo
from tests.distributed import run_distributed
from tests.helpers import full_params, save_reference, tiny_gpt2_config

ROWS = 8
LR = 1e-2


def batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(3, 1001, (ROWS, 10), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    attention_mask[6, :5] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask,
                labels=input_ids.masked_fill(attention_mask == 0, -100))


def optimizer_and_schedule(parameters):
    # eps 1e-5, not 1e-8: Adam's update of a weight whose gradient g is near zero is about +-lr whatever g's
    # size, and fp32 reduction-order noise d (1e-9) in g moves it by about lr * d / (|g| + eps). At eps 1e-6 that
    # still moved one weight in 4,096 by 1.1e-5 (past assert_close's 1e-5) on an AMD EPYC, whose kernels sum in
    # another order than the machine the test was written on; eps 1e-5 keeps it ten times below.
    optimizer = torch.optim.AdamW(parameters, lr=LR, weight_decay=0.01, eps=1e-5)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(n_layer=4), path)
    return str(path)


def reference_steps(path: str, steps: int) -> dict[str, torch.Tensor]:
    model = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    optimizer, schedule = optimizer_and_schedule(model.parameters())
    for step in range(steps):
        model(**batch(step)).loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return {name: param.detach() for name, param in model.named_parameters()}


def _build(path, tp, pp):
    """The model at (tp, pp), what the loop calls (DDP at pp=1 with replicas), its optimizer and schedule."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=2).train()
    mpu = model.mpu
    call = model
    if mpu.get_data_parallel_world_size() > 1 and pp == 1:
        call = DistributedDataParallel(model.gpu_modules(), process_group=mpu.get_data_parallel_group())
    return model, call, *optimizer_and_schedule(model.parameters())


def _steps(model, call, optimizer, schedule, first_step, last_step):
    """The manual's loop over steps [first_step, last_step): the replica's rows, every micro-batch's loss."""
    mpu = model.mpu
    rows = ROWS // mpu.get_data_parallel_world_size()
    start = mpu.get_data_parallel_rank() * rows
    for step in range(first_step, last_step):
        sample = {name: value[start:start + rows] for name, value in batch(step).items()}
        if mpu.get_pipeline_parallel_world_size() == 1:
            call(**sample).loss.backward()
        else:
            for micro_output in call(**sample):
                micro_output.loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()


def _train(rank, world_size, path, directory, tp, pp, first_step, last_step, resume):
    model, call, optimizer, schedule = _build(path, tp, pp)
    if resume:  # the recipe: the state dicts to fill, dcp.load, set_state_dict
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "schedule": schedule.state_dict(), "step": -1}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        assert state["step"] == first_step, state["step"]
    _steps(model, call, optimizer, schedule, first_step, last_step)
    if not resume:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state, "schedule": schedule.state_dict(),
                  "step": last_step}, checkpoint_id=directory)
    return full_params(model)


@pytest.fixture(scope="module")
def saved(checkpoint, tmp_path_factory):
    """One AdamW step at (tp, pp, dp) = (2, 2, 1), saved with DCP."""
    directory = str(tmp_path_factory.mktemp("dcp") / "step1")
    run_distributed(_train, 4, checkpoint, directory, 2, 2, 0, 1, False)
    return directory


@pytest.mark.parametrize("tp, pp", [(2, 2), (2, 1), (4, 1), (1, 2)], ids=["2-2-1", "2-1-2", "4-1-1", "1-2-2"])
def test_dcp_recipe_resumes_at_any_layout(checkpoint, saved, tp, pp):
    expected = reference_steps(checkpoint, 3)
    for params in run_distributed(_train, 4, checkpoint, saved, tp, pp, 1, 3, True):
        for name, value in params.items():
            source = "transformer.wte.weight" if name == "lm_head.weight" else name
            torch.testing.assert_close(value, expected[source], msg=lambda m, n=name: f"{n}: {m}")


def _wrapper_train(rank, world_size, path, directory, tp, pp, first_step, last_step, resume, fail_second_save):
    """The loop above with oslo's wrapper: scheduler, step counter and random streams travel too."""
    from oslo import checkpoint as ckpt

    model, call, optimizer, schedule = _build(path, tp, pp)
    if resume:
        loaded = oslo.load_training_state(directory, model, optimizer, schedule)
        assert loaded == {"step": first_step, "extra": {"tokens": 80 * first_step}}, loaded
    _steps(model, call, optimizer, schedule, first_step, last_step)
    if not resume:
        oslo.save_training_state(directory, model, optimizer, schedule, step=last_step,
                                 extra={"tokens": 80 * last_step})
        if fail_second_save:  # a later save that dies before publishing leaves this one in place
            ckpt._publish_hook = lambda step: (_ for _ in ()).throw(OSError("disk gone")) if step == "link" else None
            try:
                oslo.save_training_state(directory, model, optimizer, schedule, step=99, extra={"tokens": 0})
            except Exception as exc:  # noqa: BLE001 - every rank must see the failure
                assert "disk gone" in str(exc) or "rank 0" in str(exc), exc
            else:
                raise AssertionError("the failed save did not raise")
            finally:
                ckpt._publish_hook = None
    return full_params(model)


def test_training_state_wrapper_resumes_across_layouts(checkpoint, tmp_path):
    """save_training_state at (2, 2, 1), a later save that fails before publishing, load_training_state at
    (2, 1, 2): the first state comes back (step, extras, scheduler, AdamW state) and training continues as one
    process would."""
    directory = str(tmp_path / "state")
    run_distributed(_wrapper_train, 4, checkpoint, directory, 2, 2, 0, 1, False, True)
    expected = reference_steps(checkpoint, 3)
    for params in run_distributed(_wrapper_train, 4, checkpoint, directory, 2, 1, 1, 3, True, False):
        for name, value in params.items():
            source = "transformer.wte.weight" if name == "lm_head.weight" else name
            torch.testing.assert_close(value, expected[source], msg=lambda m, n=name: f"{n}: {m}")


def _dropout_run(rank, world_size, path, directory, stop_after, resume):
    """Three steps with dropout at tp=2 (seed 0): straight through, or saved after ``stop_after`` steps with
    oslo's wrapper and resumed in fresh processes."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=2, seed=0, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2).train()
    optimizer, schedule = optimizer_and_schedule(model.parameters())
    first = oslo.load_training_state(directory, model, optimizer, schedule)["step"] if resume else 0
    _steps(model, model, optimizer, schedule, first, 3 if resume or stop_after is None else stop_after)
    if stop_after is not None and not resume:
        oslo.save_training_state(directory, model, optimizer, schedule, step=stop_after)
    return full_params(model)


def test_training_state_wrapper_restores_the_random_streams(checkpoint, tmp_path):
    """With dropout on, a run saved after one step and resumed at the same layout draws the masks the
    uninterrupted run draws: its weights after three steps are the same (bit for bit)."""
    directory = str(tmp_path / "state")
    straight = run_distributed(_dropout_run, 2, checkpoint, directory, None, False)
    run_distributed(_dropout_run, 2, checkpoint, directory, 1, False)
    resumed = run_distributed(_dropout_run, 2, checkpoint, directory, 1, True)
    for name, value in straight[0].items():
        torch.testing.assert_close(resumed[0][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def _in_one_process(fn, *args):
    """``fn(0, 1, *args)`` here: a plain process (no launcher variables, no process group), as a user's
    ``python script.py`` is."""
    return fn(0, 1, *args)


def test_dcp_recipe_resumes_in_one_process(checkpoint, saved):
    """The state saved at (2, 2, 1) resumes in one plain process (GPT2's fused c_attn, saved as (in, 3, n / 3)
    blocks by the split model, is shown to DCP as such blocks there too), and continues as one process would."""
    expected = reference_steps(checkpoint, 3)
    params = _in_one_process(_train, checkpoint, saved, 1, 1, 1, 3, True)
    for name, value in params.items():
        source = "transformer.wte.weight" if name == "lm_head.weight" else name
        torch.testing.assert_close(value, expected[source], msg=lambda m, n=name: f"{n}: {m}")


def test_dcp_recipe_saved_in_one_process_resumes_split(checkpoint, tmp_path):
    """The other way: one AdamW step saved in one process, resumed at tensor_parallel_size=2."""
    directory = str(tmp_path / "one")
    _in_one_process(_train, checkpoint, directory, 1, 1, 0, 1, False)
    expected = reference_steps(checkpoint, 3)
    for params in run_distributed(_train, 2, checkpoint, directory, 2, 1, 1, 3, True):
        for name, value in params.items():
            source = "transformer.wte.weight" if name == "lm_head.weight" else name
            torch.testing.assert_close(value, expected[source], msg=lambda m, n=name: f"{n}: {m}")


def test_training_state_wrapper_resumes_in_one_process(checkpoint, tmp_path):
    """oslo.load_training_state of a state saved at (2, 2, 1), in one plain process."""
    directory = str(tmp_path / "state")
    run_distributed(_wrapper_train, 4, checkpoint, directory, 2, 2, 0, 1, False, False)
    expected = reference_steps(checkpoint, 3)
    params = _in_one_process(_wrapper_train, checkpoint, directory, 1, 1, 1, 3, True, False)
    for name, value in params.items():
        source = "transformer.wte.weight" if name == "lm_head.weight" else name
        torch.testing.assert_close(value, expected[source], msg=lambda m, n=name: f"{n}: {m}")


def _adapter_train(rank, world_size, path, directory, tp, resume):
    """A LoRA adapter (on GPT2's fused c_attn too) of the model at tensor_parallel_size ``tp``, trained with the
    optimizer transformers' Trainer builds (a group without weight decay, empty for an adapter): one step then a
    save with PyTorch's recipe, or a load and the second step. Returns the adapter's whole tensors."""
    import peft

    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp).train()
    torch.manual_seed(7 if resume else 5)  # a resumed adapter starts elsewhere: its values come from the state
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"],
                                                       init_lora_weights=False))
    trained = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW([{"params": trained, "weight_decay": 0.01}, {"params": [], "weight_decay": 0.0}],
                                  lr=LR, eps=1e-5)
    for step in (1,) if resume else (0, 1):
        if step == 1:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            if resume:
                dcp.load(state, checkpoint_id=directory)
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            else:
                dcp.save(state, checkpoint_id=directory)
        model(**batch(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.full_tensor() if hasattr(value, "full_tensor") else value
            for name, value in peft.get_peft_model_state_dict(model).items()}


@pytest.mark.timeout(120)
def test_dcp_recipe_resumes_a_peft_adapter(checkpoint, tmp_path):
    """PyTorch's recipe on a PEFT model of a split oslo model: the LoRA B of GPT2's fused c_attn is shown to DCP as
    blocks (as c_attn itself), and an empty parameter group keeps torch's unflattened form (its flattened one
    loses the group: IndexError). The resumed step gives the uninterrupted run's adapter."""
    pytest.importorskip("peft")
    directory = str(tmp_path / "adapter")
    uninterrupted = run_distributed(_adapter_train, 2, checkpoint, directory, 2, False, timeout=100)
    resumed = run_distributed(_adapter_train, 2, checkpoint, directory, 2, True, timeout=100)
    for expected, actual in zip(uninterrupted, resumed, strict=True):
        assert sorted(actual) == sorted(expected)
        for name, value in actual.items():
            torch.testing.assert_close(value, expected[name], msg=lambda m, n=name: f"{n}: {m}")


def _plain_state_dicts(rank, world_size, path, directory, save, tp):
    """``dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})`` after a step at tp=2 (GPT2's
    strided ``c_attn`` included), then, with ``save=False``, ``dcp.load`` into a fresh model's own state dicts at
    ``tp`` and ``load_state_dict``: the weights and the Adam moments are the saved ones; torch's state-dict functions
    (``get_model_state_dict``) read the same files."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp).train()
    optimizer, _ = optimizer_and_schedule(model.parameters())
    model(**batch(0)).loss.backward()
    optimizer.step()
    if save:
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=directory)
        return full_params(model)
    optimizer.zero_grad()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)  # unlike the saved weights
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loaded = full_params(model)
    moments = {name: optimizer.state[param]["exp_avg"].full_tensor() for name, param in model.named_parameters()}
    again = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp)
    model_state = get_model_state_dict(again)
    dcp.load({"model": model_state}, checkpoint_id=directory)
    set_model_state_dict(again, model_state)
    return loaded, moments, full_params(again)


@pytest.mark.parametrize("tp", [2, 4])
def test_plain_state_dicts_through_dcp(checkpoint, tmp_path, tp):
    saved, = run_distributed(_plain_state_dicts, 2, checkpoint, str(tmp_path), True, 2)[:1]
    loaded, moments, through_torch = run_distributed(_plain_state_dicts, tp, checkpoint, str(tmp_path), False, tp)[0]
    model = transformers.GPT2LMHeadModel.from_pretrained(checkpoint).train()
    optimizer, _ = optimizer_and_schedule(model.parameters())
    model(**batch(0)).loss.backward()
    optimizer.step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(through_torch[name], saved[name], rtol=0, atol=0)
        torch.testing.assert_close(moments[name], optimizer.state[param]["exp_avg"], msg=lambda m, n=name: f"{n}: {m}")
