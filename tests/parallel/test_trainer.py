"""transformers' ``Trainer`` on an oslo model: tensor parallel 2, and 2 x data parallel 2, give the weights of
one process training transformers' model on the global batch with the same Trainer settings.

accelerate (1.15) takes a ``ParallelismConfig`` on GPUs and other accelerators only; on CPU the Trainer is
refused with an error naming the loop to write instead. The parity runs lift accelerate's check for
``MULTI_CPU`` (the one difference from a GPU run: everything else, accelerate's mesh and data sharding, the
Trainer's loss scaling and oslo's gradient averaging, is the code a GPU run takes)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import oslo
from tests.distributed import run_distributed
from tests.helpers import full_params, save_reference, tiny_gpt2_config

ROWS = 8  # the global batch
STEPS = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-trainer")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return str(path)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count: int = ROWS * STEPS, seed: int = 11) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(3, 1001, (count, 10), generator=generator)
        # Unequal label counts per row: the replicas' batches hold different numbers of tokens.
        self.labels = self.input_ids.clone()
        cuts = [0, 4, 2, 0, 6, 1, 3, 0]
        for row in range(count):
            self.labels[row, :cuts[row % len(cuts)]] = -100

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def _arguments(output_dir: str, per_device_rows: int) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=per_device_rows, max_steps=STEPS, learning_rate=0.5,
        lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.5, report_to=[],
        save_strategy="no", logging_steps=1, use_cpu=True, dataloader_drop_last=True, seed=0,
    )


def _fresh_accelerate_state() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _accelerate_takes_cpu(monkeypatch_target) -> None:
    """Let accelerate's Accelerator take a ParallelismConfig for MULTI_CPU, as it does for MULTI_GPU."""
    from accelerate.utils import DistributedType

    multi_device = monkeypatch_target.multi_device.fget
    monkeypatch_target.multi_device = property(lambda self: multi_device(self) or (
        self.use_distributed and self.distributed_type == DistributedType.MULTI_CPU))


def _refusal(model, arguments) -> str | None:
    """The message of the ``NotImplementedError`` that ``Trainer(model=model, ...)`` raises, or ``None``."""
    try:
        transformers.Trainer(model=model, args=arguments, train_dataset=_Rows())
    except NotImplementedError as exc:
        return str(exc)
    return None


def _assert_same_weights(params: dict, expected: dict) -> None:
    """oslo's whole weights equal transformers' (the last stage's tied lm_head is transformers' wte)."""
    for name, value in params.items():
        source = "transformer.wte.weight" if name == "lm_head.weight" else name
        torch.testing.assert_close(value, expected[source], msg=lambda m, n=name: f"{n}: {m}")


def _trainer_run(rank, world_size, path, output_dir, tp):
    from accelerate import Accelerator

    _fresh_accelerate_state()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp)
    dp = world_size // tp
    arguments = _arguments(output_dir, ROWS // dp)
    refused = _refusal(model, arguments)
    _fresh_accelerate_state()
    _accelerate_takes_cpu(Accelerator)
    trainer = transformers.Trainer(model=model, args=_arguments(output_dir, ROWS // dp), train_dataset=_Rows())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return refused, losses, full_params(model)


def _reference_run(rank, world_size, path, output_dir):
    _fresh_accelerate_state()
    model = transformers.GPT2LMHeadModel.from_pretrained(path)
    trainer = transformers.Trainer(model=model, args=_arguments(output_dir, ROWS), train_dataset=_Rows())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {name: param.detach() for name, param in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory):
    # In a forked process: accelerate's state is a per-process singleton, which the ranks must not inherit.
    (result,) = run_distributed(_reference_run, 1, checkpoint, str(tmp_path_factory.mktemp("reference")))
    return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp, dp", [(2, 1), (2, 2)], ids=["tp2", "tp2-dp2"])
def test_trainer_equals_one_process(checkpoint, reference, tmp_path, tp, dp):
    expected_losses, expected = reference
    for refused, losses, params in run_distributed(_trainer_run, tp * dp, checkpoint, str(tmp_path), tp, timeout=110):
        # On CPU, accelerate refuses the ParallelismConfig: a clear error at Trainer(...), naming the loop.
        assert refused is not None and "MULTI_CPU" in refused and "model.gpu_modules()" in refused, refused
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        _assert_same_weights(params, expected)


def _pipeline_trainer(rank, world_size, path, output_dir):
    _fresh_accelerate_state()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2)
    try:
        transformers.Trainer(model=model, args=_arguments(output_dir, ROWS), train_dataset=_Rows())
    except NotImplementedError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_trainer_with_pipelines_is_refused(checkpoint, tmp_path):
    for message in run_distributed(_pipeline_trainer, 2, checkpoint, str(tmp_path), timeout=50):
        assert message is not None and "pipeline_parallel_size=2" in message and "micro_output" in message


def _peft_config(method: str):
    import peft

    if method == "lora":  # B random too (PEFT's debugging init): the adapter changes the outputs from the start
        return peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj", "c_fc"], init_lora_weights=False)
    return peft.IA3Config(task_type="CAUSAL_LM", init_ia3_weights=False)


def _adapter_trained(model, method: str, output_dir: str, per_device_rows: int):
    import peft

    torch.manual_seed(5)  # after the model is built: the adapter one process draws, on every layout
    model = peft.get_peft_model(model, _peft_config(method))
    trainer = transformers.Trainer(model=model, args=_arguments(output_dir, per_device_rows), train_dataset=_Rows())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    state = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
             for name, value in peft.get_peft_model_state_dict(model).items()}
    return losses, state


def _peft_trainer_run(rank, world_size, path, output_dir, tp, method):
    from accelerate import Accelerator

    _fresh_accelerate_state()
    _accelerate_takes_cpu(Accelerator)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp)
    return _adapter_trained(model, method, output_dir, ROWS // (world_size // tp))


def _peft_reference_run(rank, world_size, path, output_dir, method):
    _fresh_accelerate_state()
    return _adapter_trained(transformers.GPT2LMHeadModel.from_pretrained(path), method, output_dir, ROWS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_trainer_with_peft_equals_one_process(checkpoint, tmp_path, method):
    """The usual PEFT fine-tuning recipe (``get_peft_model``, then transformers' ``Trainer``) at tp=2 with two
    data-parallel replicas: the Trainer hands accelerate the PEFT model, and the adapter's gradients are still
    averaged over the replicas; losses and the trained adapter are one process's on the global batch."""
    pytest.importorskip("peft")
    (expected_losses, expected), = run_distributed(_peft_reference_run, 1, checkpoint, str(tmp_path / "reference"),
                                                   method, timeout=60)
    for losses, state in run_distributed(_peft_trainer_run, 4, checkpoint, str(tmp_path), 2, method, timeout=110):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert sorted(state) == sorted(expected)
        for name, value in state.items():
            torch.testing.assert_close(value, expected[name], msg=lambda m, n=name: f"{n}: {m}")


def _data_parallel_trainer(rank, world_size, path, output_dir):
    _fresh_accelerate_state()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path)
    arguments = _arguments(output_dir, ROWS // world_size)
    refused = _refusal(model, arguments)
    _fresh_accelerate_state()
    arguments = _arguments(output_dir, ROWS // world_size)
    trainer = transformers.Trainer(model=model.gpu_modules(), args=arguments, train_dataset=_Rows())
    trainer.train()
    return refused, full_params(model)


@pytest.mark.timeout(120)
def test_trainer_with_data_parallel_replicas_only(checkpoint, reference, tmp_path):
    """Tensor parallel size 1, two replicas: accelerate wraps the model in its own DDP, which cannot reduce DTensor
    parameters, so Trainer(model=model) is refused naming model.gpu_modules(); handed that, the Trainer gives one
    process's weights (each weight once in its gradient norm and clipping). (The logged loss is accelerate's mean
    of the replicas' means, as for transformers' model under DDP, not the global batch's mean.)"""
    _, expected = reference
    for refused, params in run_distributed(_data_parallel_trainer, 2, checkpoint, str(tmp_path), timeout=110):
        assert refused is not None and "Trainer(model=model.gpu_modules()" in refused, refused
        _assert_same_weights(params, expected)


def _smoothed_run(rank, world_size, path, output_dir, tp):
    from accelerate import Accelerator

    _fresh_accelerate_state()
    if tp > 1:
        _accelerate_takes_cpu(Accelerator)
        model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp)
    else:
        model = transformers.GPT2LMHeadModel.from_pretrained(path)
    arguments = _arguments(output_dir, ROWS // (world_size // tp))
    arguments.label_smoothing_factor = 0.1
    transformers.Trainer(model=model, args=arguments, train_dataset=_Rows()).train()
    return full_params(model) if tp > 1 else {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.timeout(120)
def test_a_loss_the_trainer_computes_itself_is_averaged_over_the_replicas(checkpoint, tmp_path):
    """With label smoothing (or a compute_loss_func) the Trainer calls the model without labels and computes the
    loss from the logits: the backward through them averages the gradients over the data-parallel replicas too
    (tensor parallel 2 x data parallel 2 against one process on the global batch)."""
    (expected,) = run_distributed(_smoothed_run, 1, checkpoint, str(tmp_path / "reference"), 1)
    for params in run_distributed(_smoothed_run, 4, checkpoint, str(tmp_path / "oslo"), 2, timeout=110):
        _assert_same_weights(params, expected)


@pytest.fixture(scope="module")
def dropout_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-trainer-dropout")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(resid_pdrop=0.1, attn_pdrop=0.1), path)
    return str(path)


def _trained_state(model, trained) -> dict[str, torch.Tensor]:
    """The model's whole weights, or, for a PEFT model, its adapter's whole tensors (PEFT's names)."""
    if trained is model:
        return full_params(model)
    import peft

    return {name: value.full_tensor() if hasattr(value, "full_tensor") else value
            for name, value in peft.get_peft_model_state_dict(trained).items()}


def _checkpointed_run(rank, world_size, path, output_dir, tp, variant, seed=None):
    """The Trainer's default way of saving (a checkpoint every ``save_steps``, the optimizer's state with it) over two
    steps, then a fresh model resumed from the first checkpoint for the second step. Returns the trained state, the
    resumed one, and what the second checkpoint's files hold."""
    import safetensors.torch
    from accelerate import Accelerator

    states = []
    for resume in (None, os.path.join(output_dir, "checkpoint-1")):
        _fresh_accelerate_state()
        if tp > 1:
            _accelerate_takes_cpu(Accelerator)
        model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp, seed=seed).train()
        if resume is not None:  # as a new process would: the dropout streams stand elsewhere until resumed
            if seed is None:  # dropout draws from torch's generator (the Trainer's rng_state files restore it)
                torch.manual_seed(999)
            else:  # the model's own streams (oslo's optimizer state in the checkpoint restores them)
                model.parallel_context.manual_seed(999)
        trained = model
        if variant.startswith("lora"):
            import peft

            torch.manual_seed(5)
            trained = peft.get_peft_model(model, _peft_config("lora"))
        # At tensor_parallel_size=1 the Trainer takes gpu_modules(), a PEFT model's too (accelerate's DDP then
        # averages its plain shards).
        handed = trained.gpu_modules() if tp == 1 else trained
        arguments = _arguments(output_dir, ROWS // (world_size // tp))
        arguments.save_strategy, arguments.save_steps = "steps", 1
        arguments.optim_args = "momentum=0.9"  # SGD with state of its own; its steps follow the dropout masks
        arguments.__post_init__()  # the save strategy and optimizer are parsed into their enums there
        trainer = transformers.Trainer(model=handed, args=arguments, train_dataset=_Rows())
        trainer.train(resume_from_checkpoint=resume)
        states.append(_trained_state(model, trained))
        if resume is None:
            name = "adapter_model.safetensors" if variant.startswith("lora") else "model.safetensors"
            saved = safetensors.torch.load_file(os.path.join(output_dir, "checkpoint-2", name))
    return states[0], states[1], saved


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp, variant, seed", [(2, "model", None), (2, "model", 3), (2, "lora", None),
                                               (1, "model", None), (1, "lora", None)],
                         ids=["tp2", "tp2-own-streams", "tp2-lora", "dp2-gpu_modules", "dp2-lora-gpu_modules"])
def test_trainer_checkpoints_resume_as_one_run(dropout_checkpoint, tmp_path, tp, variant, seed):
    """transformers' Trainer checkpoints a model split over two processes as it checkpoints one of one process
    (``save_strategy="steps"``, the default; the optimizer's momentum and the dropout streams included): its
    checkpoints hold the plain transformers files (the whole model, or PEFT's adapter), and a run resumed from the
    first one finishes with the weights of the uninterrupted run. (Before, the main process alone called
    save_pretrained: a split model raised, a PEFT model waited for the other ranks forever.) At data parallel 2 the
    Trainer gets ``gpu_modules()``, a PEFT model's too."""
    if variant == "lora":
        pytest.importorskip("peft")
    for trained, resumed, saved in run_distributed(_checkpointed_run, 2, dropout_checkpoint, str(tmp_path), tp,
                                                   variant, seed, timeout=170):
        assert sorted(resumed) == sorted(trained)
        for name, value in trained.items():
            torch.testing.assert_close(resumed[name], value, msg=lambda m, n=name: f"resumed {n}: {m}")
        if variant == "lora":  # PEFT's adapter file, also when the Trainer got gpu_modules()
            assert sorted(saved) == sorted(trained)
        else:  # transformers' files hold the tied lm_head once, as wte
            assert sorted(saved) == sorted(name for name in trained if name != "lm_head.weight")
        for name, value in saved.items():
            torch.testing.assert_close(value, trained[name], msg=lambda m, n=name: f"saved {n}: {m}")


def _best_model_run(rank, world_size, path, output_dir, variant):
    import safetensors.torch
    from accelerate import Accelerator

    _fresh_accelerate_state()
    if variant == "tp2":
        _accelerate_takes_cpu(Accelerator)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2 if variant == "tp2" else 1)
    trained = model
    if variant == "dp2-lora-gpu_modules":
        import peft

        torch.manual_seed(5)
        trained = peft.get_peft_model(model, _peft_config("lora"))
    arguments = _arguments(output_dir, ROWS if variant == "tp2" else ROWS // 2)
    arguments.save_strategy = arguments.eval_strategy = "steps"
    arguments.save_steps = arguments.eval_steps = 1
    # "Best" is the first checkpoint's model, not the last one's: the highest evaluation loss of the model (whose
    # loss falls at the second step), the lowest of the adapter (whose loss rises at the second step, at lr 0.5).
    arguments.load_best_model_at_end, arguments.metric_for_best_model = True, "loss"
    arguments.greater_is_better = trained is model
    arguments.__post_init__()
    trainer = transformers.Trainer(model=trained if variant == "tp2" else trained.gpu_modules(), args=arguments,
                                   train_dataset=_Rows(), eval_dataset=_Rows())
    trainer.train()
    losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(losses) == 2 and (losses[0] > losses[1]) == (trained is model), losses
    name = "model.safetensors" if trained is model else "adapter_model.safetensors"
    best = safetensors.torch.load_file(os.path.join(trainer.state.best_model_checkpoint, name))
    return os.path.basename(trainer.state.best_model_checkpoint), best, _trained_state(model, trained)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["tp2", "dp2-lora-gpu_modules"])
def test_trainer_loads_the_best_checkpoint_at_the_end(checkpoint, tmp_path, variant):
    """``load_best_model_at_end`` puts the best checkpoint's weights back into a split model (every rank reads its
    slices of the transformers files the checkpoint holds), or its adapter into a PEFT model's replicas handed to
    the Trainer as ``gpu_modules()``."""
    if variant != "tp2":
        pytest.importorskip("peft")
    for name, best, params in run_distributed(_best_model_run, 2, checkpoint, str(tmp_path), variant, timeout=110):
        assert name == "checkpoint-1"
        assert sorted(best) == sorted(key for key in params if key != "lm_head.weight")
        for key, value in best.items():
            torch.testing.assert_close(params[key], value, msg=lambda m, k=key: f"{k}: {m}")


def _merged_adapter_run(rank, world_size, path, output_dir):
    import peft

    _fresh_accelerate_state()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path)
    torch.manual_seed(5)
    adapted = peft.get_peft_model(model, _peft_config("lora"))
    merged = adapted.merge_and_unload()  # the PEFT model is left behind, around the plain model
    merged.requires_grad_(True)  # PEFT froze the base weights: train them all now
    arguments = _arguments(output_dir, ROWS // world_size)
    arguments.save_strategy, arguments.save_steps = "steps", 1
    arguments.__post_init__()
    transformers.Trainer(model=merged.gpu_modules(), args=arguments, train_dataset=_Rows()).train()
    return sorted(os.listdir(os.path.join(output_dir, "checkpoint-2")))


@pytest.mark.timeout(60)
def test_a_merged_adapter_saves_the_model(checkpoint, tmp_path):
    """After merge_and_unload() the model is plain again, though the PEFT model that adapted it still exists: the
    Trainer's checkpoints of its gpu_modules() hold the model's transformers files, not an adapter."""
    pytest.importorskip("peft")
    for files in run_distributed(_merged_adapter_run, 2, checkpoint, str(tmp_path), timeout=50):
        assert "model.safetensors" in files and "adapter_model.safetensors" not in files, files


def _SevenRows() -> _Rows:  # noqa: N802 - a dataset, named as one
    """Seven rows: the last evaluation batch of two replicas is cut (accelerate repeats rows to fill it)."""
    return _Rows(count=7, seed=5)


def _evaluation_arguments(output_dir: str, per_device_rows: int) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir=output_dir, per_device_eval_batch_size=per_device_rows,
                                          report_to=[], use_cpu=True)


def _predicted(trainer) -> tuple:
    output = trainer.predict(_SevenRows())
    evaluated = trainer.evaluate(_SevenRows())
    return output.predictions, output.label_ids, output.metrics["test_loss"], evaluated["eval_loss"]


def _predict_run(rank, world_size, path, output_dir, tp):
    from accelerate import Accelerator

    _fresh_accelerate_state()
    _accelerate_takes_cpu(Accelerator)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp)
    trainer = transformers.Trainer(model=model, args=_evaluation_arguments(output_dir, 2))
    predicted = _predicted(trainer)
    restored = [trainer.gather_function == trainer.accelerator.gather_for_metrics]

    def failing(logits, labels):  # called in the loop, between two gathers
        raise ValueError("a metric that fails")

    trainer.preprocess_logits_for_metrics = failing
    with pytest.raises(ValueError, match="a metric that fails"):
        trainer.predict(_SevenRows())
    restored.append(trainer.gather_function == trainer.accelerator.gather_for_metrics)  # after a failed loop too
    return (*predicted, restored)


def _reference_predict_run(rank, world_size, path, output_dir, rows):
    _fresh_accelerate_state()
    model = transformers.GPT2LMHeadModel.from_pretrained(path)
    return _predicted(transformers.Trainer(model=model, args=_evaluation_arguments(output_dir, rows)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp, dp", [(2, 1), (2, 2)], ids=["tp2", "tp2-dp2"])
def test_trainer_predicts_each_row_once(checkpoint, tmp_path, tp, dp):
    """predict() and evaluate() at tensor parallel 2 give what transformers' model gives on as many replicas: each
    row once (the ranks of a tensor-parallel group hold the same rows), in order, the same logits, labels and loss
    (of two replicas, the Trainer's own average: the last batch's repeated row counts in the loss)."""
    expected = run_distributed(_reference_predict_run, dp, checkpoint, str(tmp_path / "reference"), 2)[0]
    for predictions, labels, loss, eval_loss, restored in run_distributed(_predict_run, tp * dp, checkpoint,
                                                                          str(tmp_path / "oslo"), tp, timeout=100):
        assert restored == [True, True]  # the Trainer's own gather again once a loop ends, or fails
        assert predictions.shape == expected[0].shape == (7, 10, 1001)
        torch.testing.assert_close(torch.from_numpy(predictions), torch.from_numpy(expected[0]))
        assert (labels == expected[1]).all()
        torch.testing.assert_close(loss, expected[2])
        torch.testing.assert_close(eval_loss, expected[3])


# Layouts a Trainer run saves at and resumes at: (processes, tensor_parallel_size); data parallel 2 through
# gpu_modules(), one process without a launcher.
RESUME_LAYOUTS = {"tp2": (2, 2), "dp2": (2, 1), "one process": (1, 1)}


def _momentum_run(rank, world_size, path, output_dir, tp, resume):
    """Two steps of SGD with momentum, a checkpoint after each; resumed from ``resume`` when given. Returns the
    model's whole weights at the end."""
    from accelerate import Accelerator

    _fresh_accelerate_state()
    if tp > 1:
        _accelerate_takes_cpu(Accelerator)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp).train()
    arguments = _arguments(output_dir, ROWS // (world_size // tp))
    arguments.save_strategy, arguments.save_steps = "steps", 1
    arguments.optim_args = "momentum=0.9"
    arguments.__post_init__()
    handed = model.gpu_modules() if world_size > tp else model
    transformers.Trainer(model=handed, args=arguments, train_dataset=_Rows()).train(resume_from_checkpoint=resume)
    return {name: value.clone() for name, value in full_params(model).items()}


@pytest.fixture(scope="module")
def uninterrupted_runs(checkpoint, tmp_path_factory):
    """Each layout's two-step run: its checkpoints' directory and its final weights."""
    runs = {}
    for name, (world_size, tp) in RESUME_LAYOUTS.items():
        output_dir = str(tmp_path_factory.mktemp(f"momentum-{name.replace(' ', '-')}"))
        runs[name] = output_dir, run_distributed(_momentum_run, world_size, checkpoint, output_dir, tp, None,
                                                 timeout=100)[0]
    return runs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("saved, resumed", [("tp2", "dp2"), ("dp2", "tp2"), ("tp2", "one process"),
                                            ("one process", "tp2")])
def test_trainer_resumes_at_another_layout(checkpoint, uninterrupted_runs, tmp_path, saved, resumed):
    """A Trainer checkpoint of an oslo model resumes at any layout (the optimizer's state goes through
    torch.distributed.checkpoint under the model's parameter names, in one process too): the run resumed from the
    first checkpoint at another layout ends with the weights of the uninterrupted run. (Before, a checkpoint of
    tensor parallel 2 failed at data parallel 2, its names being gpu_modules()' own, and in one process, which looked
    for optimizer.pt.)"""
    directory, expected = uninterrupted_runs[saved]
    world_size, tp = RESUME_LAYOUTS[resumed]
    for weights in run_distributed(_momentum_run, world_size, checkpoint, str(tmp_path), tp,
                                   os.path.join(directory, "checkpoint-1"), timeout=100):
        assert sorted(weights) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, msg=lambda m, n=name: f"resumed {n}: {m}")
