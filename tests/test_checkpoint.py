"""Split and merged checkpoints: round trips, plain-transformers compatibility, crash safety."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

import oslo
from oslo import checkpoint as ckpt
from tests.distributed import RankError, run_distributed
from tests.helpers import full_params, save_reference, tiny_gpt2_config

INPUT_IDS = torch.tensor([[5, 17, 900, 3, 44, 1000, 8], [9, 9, 250, 31, 7, 600, 12]])


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return str(path)


def _reference_logits(path):
    return transformers.GPT2LMHeadModel.from_pretrained(path).eval()(INPUT_IDS).logits


def _save(rank, world_size, source, target, merged, options):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(source, tensor_parallel_size=world_size)
    model.save_pretrained_with_parallel(target, save_with_merging=merged, **options)


def _load_logits(rank, world_size, path, tp):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp)
    return model(INPUT_IDS).logits


@pytest.mark.parametrize("tp", [2, 4])
def test_split_round_trip(lm_checkpoint, tmp_path, tp):
    run_distributed(_save, tp, lm_checkpoint, str(tmp_path), False, {})
    names = sorted(os.listdir(tmp_path))
    expected_files = [f"model_tp={t}_pp=0.safetensors" for t in range(tp)]
    assert set(expected_files) <= set(names)
    assert "config.json" in names and ckpt.SPLIT_INDEX_NAME in names
    assert not any(name.startswith(".oslo") for name in names)

    index = json.loads((tmp_path / ckpt.SPLIT_INDEX_NAME).read_text())
    assert (index["tensor_parallel_size"], index["pipeline_parallel_size"]) == (tp, 1)
    assert sorted(index["files"]) == expected_files
    assert index["tensors"]["transformer.wte.weight"]["shape"] == [1001, 32]
    assert index["tensors"]["transformer.h.0.attn.c_attn.weight"]["split"] == {"kind": "column", "dim": 1,
                                                                              "chunks": 3}
    assert "lm_head.weight" not in index["tensors"]  # tied to transformer.wte.weight
    with safe_open(str(tmp_path / expected_files[0]), "pt") as f:
        assert f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape() == [32, 96 // tp]

    logits = run_distributed(_load_logits, tp, str(tmp_path), tp)
    torch.testing.assert_close(logits[0], _reference_logits(lm_checkpoint))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merged_checkpoint_loads_in_plain_transformers(lm_checkpoint, tmp_path, tp):
    run_distributed(_save, tp, lm_checkpoint, str(tmp_path), True, {})
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".json")) == ["model.safetensors"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert type(model) is transformers.GPT2LMHeadModel
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(model.eval()(INPUT_IDS).logits, _reference_logits(lm_checkpoint))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_slice("transformer.wte.weight").get_shape() == [1001, 32]  # unpadded
        assert "lm_head.weight" not in f.keys()


def test_merged_sharded_and_bin_checkpoints(lm_checkpoint, tmp_path):
    sharded, binary = tmp_path / "sharded", tmp_path / "bin"
    run_distributed(_save, 2, lm_checkpoint, str(sharded), True, {"max_shard_size": "60KB"})
    shards = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (sharded / ckpt.SAFE_WEIGHTS_INDEX_NAME).exists()
    run_distributed(_save, 2, lm_checkpoint, str(binary), True, {"safe_serialization": False})
    assert (binary / ckpt.WEIGHTS_NAME).exists()
    for path in (sharded, binary):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
        torch.testing.assert_close(model(INPUT_IDS).logits, _reference_logits(lm_checkpoint))
        # ...and oslo reads them back, slicing per rank.
        logits = run_distributed(_load_logits, 2, str(path), 2)
        torch.testing.assert_close(logits[1], _reference_logits(lm_checkpoint))


def _save_and_die(rank, world_size, source, target):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(source, tensor_parallel_size=world_size)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    original = ckpt._write

    def failing_write(tensors, path, *args):
        if rank == 1:
            raise OSError("disk full (simulated)")
        return original(tensors, path, *args)

    ckpt._write = failing_write
    model.save_pretrained_with_parallel(target)


def test_failed_save_keeps_previous_checkpoint(lm_checkpoint, tmp_path):
    run_distributed(_save, 2, lm_checkpoint, str(tmp_path), False, {})
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    with pytest.raises(RankError, match="disk full"):
        run_distributed(_save_and_die, 2, lm_checkpoint, str(tmp_path))
    after = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    assert after == before


def _seeded_weights(rank, world_size, seed):
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        tiny_gpt2_config(), tensor_parallel_size=world_size, seed=seed
    )
    return full_params(model)


def test_from_config_same_seed_same_weights_at_any_tp():
    weights = {tp: run_distributed(_seeded_weights, tp, 7)[0] for tp in (1, 2, 4)}
    other_seed = run_distributed(_seeded_weights, 1, 8)[0]
    for name, value in weights[1].items():
        torch.testing.assert_close(weights[2][name], value, rtol=0, atol=0)
        torch.testing.assert_close(weights[4][name], value, rtol=0, atol=0)
    assert not torch.equal(other_seed["transformer.h.0.attn.c_attn.weight"],
                           weights[1]["transformer.h.0.attn.c_attn.weight"])
    # The GPT-2 initialization scheme: residual projections scaled by 1/sqrt(2 * n_layer).
    std = weights[1]["transformer.h.0.mlp.c_proj.weight"].std().item()
    assert 0.02 / 2 * 0.8 < std < 0.02 / 2 * 1.2
    assert torch.equal(weights[1]["transformer.ln_f.weight"], torch.ones(32))


def _resized(rank, world_size, path, size):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=world_size, resize_token_embeddings=size, seed=3
    )
    assert model.config.vocab_size == size
    logits = model(INPUT_IDS.clamp(max=size - 1)).logits  # ids the (shrunk) vocabulary holds
    assert logits.shape[-1] == size
    return full_params(model)["transformer.wte.weight"], logits


def test_resize_token_embeddings(lm_checkpoint):
    original = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint).transformer.wte.weight.detach()
    (grown_1, logits_1), = run_distributed(_resized, 1, lm_checkpoint, 1030)
    grown_2, logits_2 = run_distributed(_resized, 2, lm_checkpoint, 1030)[0]
    assert grown_1.shape == (1030, 32)
    torch.testing.assert_close(grown_1[:1001], original)
    torch.testing.assert_close(grown_2, grown_1)  # new rows: same seed, same values at any tp
    assert grown_1[1001:].abs().sum() > 0
    torch.testing.assert_close(logits_2, logits_1)
    (shrunk, _), = run_distributed(_resized, 2, lm_checkpoint, 900)[:1]
    torch.testing.assert_close(shrunk, original[:900])


def _dtype_and_overrides(rank, world_size, path):
    half = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size,
                                                              torch_dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    other = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size,
                                                               dtype="float64", pad_token_id=7)
    assert {p.dtype for p in other.parameters()} == {torch.float64}
    assert other.config.pad_token_id == 7
    with pytest.raises(TypeError, match="not_a_config_field"):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size,
                                                           not_a_config_field=1)


def test_dtype_and_config_overrides(lm_checkpoint):
    run_distributed(_dtype_and_overrides, 2, lm_checkpoint)


def _plain_save_refused(rank, world_size, path, target):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    with pytest.raises(RuntimeError, match=r"is_main_process=\(rank == 0\).*save_pretrained_with_parallel"):
        model.save_pretrained(target)


def _save_pretrained_on_every_rank(rank, world_size, path, target, tp, pp):
    """transformers' way of saving a model it split itself, and accelerate's recipe: every rank calls
    ``save_pretrained`` with ``is_main_process``."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp,
                                                               pipeline_parallel_size=pp)
    with torch.no_grad():  # weights of its own: not those of the checkpoint it was built from
        for param in model.parameters():
            param.mul_(1.5)
    model.save_pretrained(target, is_main_process=rank == 0, max_shard_size="100KB")
    return full_params(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_save_pretrained_on_every_rank_writes_a_transformers_checkpoint(lm_checkpoint, tmp_path, tp, pp):
    """A split model's save_pretrained, called on every rank with is_main_process (as transformers saves a
    tensor-parallel model), writes the plain transformers checkpoint of the whole model (sharded here by
    max_shard_size); called without it, it raises (test_transformers_entry_points)."""
    target = tmp_path / "saved"
    weights = {}
    for stage_weights in run_distributed(_save_pretrained_on_every_rank, tp * pp, lm_checkpoint, str(target), tp, pp):
        weights.update(stage_weights)  # with pipelines each stage has its own layers
    assert (target / "model.safetensors.index.json").is_file()
    saved = transformers.GPT2LMHeadModel.from_pretrained(str(target))
    for name, param in saved.named_parameters():
        torch.testing.assert_close(param, weights[name], msg=lambda m, n=name: f"{n}: {m}")


def test_transformers_entry_points(lm_checkpoint, tmp_path):
    # Unsplit, the transformers methods work as usual...
    model = oslo.GPT2LMHeadModel.from_pretrained(lm_checkpoint)
    torch.testing.assert_close(model(INPUT_IDS).logits, _reference_logits(lm_checkpoint))
    model.save_pretrained(tmp_path / "plain")
    torch.testing.assert_close(_reference_logits(str(tmp_path / "plain")), _reference_logits(lm_checkpoint))
    # ...split, save_pretrained without is_main_process (a call on the main process alone would wait for the
    # others): refused, naming the two ways that work.
    run_distributed(_plain_save_refused, 2, lm_checkpoint, str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()


def _save_with_function(rank, world_size, source, target, merged):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(source, tensor_parallel_size=world_size)
    written = []

    def save_function(tensors, path):  # transformers' save_pretrained argument, as the manual promises
        written.append(os.path.basename(path))
        torch.save(tensors, path)

    model.save_pretrained_with_parallel(target, save_with_merging=merged, save_function=save_function)
    with pytest.raises(ValueError, match="pass one of them"):
        model.save_pretrained_with_parallel(target, save_function=save_function, safe_serialization=True)
    return written


def test_save_function_writes_the_weight_files(lm_checkpoint, tmp_path):
    split = run_distributed(_save_with_function, 2, lm_checkpoint, str(tmp_path / "split"), False)
    assert split == [["pytorch_model_tp=0_pp=0.bin"], ["pytorch_model_tp=1_pp=0.bin"]]
    merged = run_distributed(_save_with_function, 2, lm_checkpoint, str(tmp_path / "merged"), True)
    assert merged == [["pytorch_model.bin"], []]
    torch.testing.assert_close(_reference_logits(str(tmp_path / "merged")), _reference_logits(lm_checkpoint))
    assert run_distributed(_load_logits, 2, str(tmp_path / "split"), 2)[0].shape == (2, 7, 1001)


def _save_without_config(rank, world_size, source, target):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(source, tensor_parallel_size=2)
    model.save_pretrained_with_parallel(target, save_config=False)
    with pytest.raises(FileNotFoundError, match="has no config.json .* Pass config=GPT2Config"):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(target, tensor_parallel_size=2)
    loaded = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        target, tensor_parallel_size=2, config=model.config, resid_pdrop=0.0
    )
    return loaded(INPUT_IDS).logits


def test_split_save_without_config_loads_with_config_given(lm_checkpoint, tmp_path):
    logits = run_distributed(_save_without_config, 2, lm_checkpoint, str(tmp_path))
    torch.testing.assert_close(logits[0], _reference_logits(lm_checkpoint))


def test_checkpoint_of_another_architecture_is_named(tmp_path):
    config = transformers.GPTNeoConfig(vocab_size=1001, hidden_size=32, num_layers=2, num_heads=4,
                                       attention_types=[[["global", "local"], 1]], max_position_embeddings=64)
    transformers.GPTNeoForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a 'gpt_neo' checkpoint, but GPT2LMHeadModel is a 'gpt2' model"):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(str(tmp_path))


def _load_with_extra(rank, world_size, path):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("oslo.checkpoint").addHandler(handler)
    oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2)
    return records


def test_unused_weights_are_decided_over_all_stages(lm_checkpoint, tmp_path):
    """A checkpoint with one stray tensor beside block 1 (on the second stage): rank 0 reports it, and
    only it; no stage's own layers are reported as unused by another stage."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(lm_checkpoint, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["transformer.h.1.stray.weight"] = torch.zeros(3)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    records = run_distributed(_load_with_extra, 2, str(tmp_path))
    assert records[1] == []  # reported once, by rank 0
    assert records[0] == [f"Unused weights of {tmp_path}: ['transformer.h.1.stray.weight']"]


def _groups_used(rank, world_size, path, target):
    """oslo's own collectives (load, save, merge) name a group of the model's context, never the
    default group, so other users of torch.distributed in the process never meet them."""
    import torch.distributed as dist

    used = []
    names = ("all_gather_object", "send", "recv", "broadcast", "all_reduce", "all_to_all_single", "all_gather",
             "gather", "barrier")
    originals = {name: getattr(dist, name) for name in names}

    def recording(name):
        def call(*args, **kwargs):
            used.append((name, kwargs.get("group")))
            return originals[name](*args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, recording(name))
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2)
    model.save_pretrained_with_parallel(target, save_with_merging=True)
    model.save_pretrained_with_parallel(target + "-split")
    return [(name, group is None or group is dist.group.WORLD) for name, group in used]


def test_oslo_collectives_use_the_contexts_groups(lm_checkpoint, tmp_path):
    for calls in run_distributed(_groups_used, 2, lm_checkpoint, str(tmp_path / "out")):
        assert calls and not [name for name, default in calls if default], calls


def _train_and_save_on_rank_0(rank, world_size, path, target):
    """transformers' data-parallel idiom: two replicas of an unsplit model (its parameters are DTensors), one SGD
    step, ``save_pretrained`` on rank 0 only."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss.backward()
    optimizer.step()
    if rank == 0:
        model.save_pretrained(target)
    return full_params(model)


def test_save_pretrained_with_data_parallel_replicas(lm_checkpoint, tmp_path):
    weights = run_distributed(_train_and_save_on_rank_0, 2, lm_checkpoint, str(tmp_path))[0]
    saved = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path))
    for name, param in saved.named_parameters():
        torch.testing.assert_close(param.detach(), weights[name], rtol=0, atol=0, msg=name)


def _save_other_weights(rank, world_size, path) -> None:
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path, seed=1)


def _load_transformers_state_dict(rank, world_size, path, other, tp, pp):
    from safetensors.torch import load_file

    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp,
                                                              pipeline_parallel_size=pp)
    model.load_state_dict(load_file(os.path.join(other, "model.safetensors")), strict=False)
    with torch.no_grad():
        return model(INPUT_IDS).logits


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_a_transformers_state_dict_reaches_the_tied_copy_under_pipelines(lm_checkpoint, tmp_path, tp, pp):
    """transformers' files hold GPT2's wte, not the tied lm_head (in one process the same parameter): under
    pipelines the last stage's copy takes wte's value from the state dict too, and the logits are the file's."""
    run_distributed(_save_other_weights, 1, str(tmp_path))
    results = run_distributed(_load_transformers_state_dict, tp * pp, lm_checkpoint, str(tmp_path), tp, pp)
    expected = _reference_logits(str(tmp_path))
    for logits in results:
        torch.testing.assert_close(logits, expected)


# The tensor_parallel manual's saving context: its cases (the anchors of every architecture, and the tied Llama).
WHOLE_CASES = ("gpt2", "gpt_neo", "bert", "t5", "llama", "llama_tied")


def _whole_cases():
    from tests.models import zoo

    anchors = {case.arch: case for case in zoo.all_cases() if case.anchor}
    tied = next(case for case in zoo.all_cases() if case.key == "LlamaForCausalLM-tied")
    return {**anchors, "llama_tied": tied}


def _saved_whole(rank, world_size, roots, tp, pp, target):
    checked = []
    for name in WHOLE_CASES:
        case = _whole_cases()[name]
        path = os.path.join(roots[case.arch], case.key)
        model = getattr(oslo, case.name).from_pretrained_with_parallel(
            path, tensor_parallel_size=tp, pipeline_parallel_size=pp)
        expected = getattr(transformers, case.name).from_pretrained(path).state_dict()
        with oslo.save_tensor_parallel(model):
            whole = model.state_dict()
            prefixed = model.state_dict(prefix="model.")
            directory = os.path.join(target, case.key)
            model.save_pretrained(directory)  # no is_main_process: every rank takes part, rank 0 writes
        assert sorted(whole) == sorted(expected), (case.key, sorted(set(whole) ^ set(expected)))
        for key, value in expected.items():
            assert torch.equal(whole[key], value), f"{case.key}: {key}"
            assert prefixed["model." + key] is whole[key] or torch.equal(prefixed["model." + key], value)
        if rank == 0:
            file = os.path.join(target, f"{case.key}.pt")
            torch.save(whole, file)
            plain = getattr(transformers, case.name).from_pretrained(path)
            plain.load_state_dict(torch.load(file, weights_only=True), strict=True)  # what the manual's user does
            for key, value in plain.state_dict().items():
                assert torch.equal(value, expected[key]), f"{case.key}: {key} through torch.save"
            loaded, info = getattr(transformers, case.name).from_pretrained(directory, output_loading_info=True)
            assert not info["missing_keys"] and not info["unexpected_keys"], (case.key, info)
            for key, value in loaded.state_dict().items():
                assert torch.equal(value, expected[key]), f"{case.key}: {key} through save_pretrained"
        if tp * pp > 1:  # outside the context: this rank's parameters again
            assert sorted(model.state_dict()) != sorted(expected) or any(
                isinstance(value, torch.distributed.tensor.DTensor) for value in model.state_dict().values())
        checked.append(case.key)
    return checked


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_save_tensor_parallel_saves_as_if_never_split(zoo_checkpoints, tmp_path, tp, pp):
    """``with oslo.save_tensor_parallel(model):`` (the tensor_parallel manual's context), then ``torch.save(
    model.state_dict(), ...)`` or ``model.save_pretrained(...)``: what transformers' model of one process saves, its
    every key (tied ones included) and tensor, at every layout."""
    roots = {case.arch: zoo_checkpoints(case.arch) for case in _whole_cases().values()}
    expected = [_whole_cases()[name].key for name in WHOLE_CASES]
    results = run_distributed(_saved_whole, tp * pp, roots, tp, pp, str(tmp_path), timeout=240)
    assert results == [expected] * (tp * pp)


class _PlainBlocks(torch.nn.Module):
    """The reference of :class:`_OwnBlocks`: transformers-style modules of one process, the same names."""

    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(7, 8)
        self.positions = torch.nn.Embedding(5, 8)
        self.up = torch.nn.Linear(8, 12)
        self.down = torch.nn.Linear(12, 8)
        self.norm = torch.nn.LayerNorm(8)


class _OwnBlocks(torch.nn.Module):
    """A module of one's own built from oslo.parallel's layers (the manual's building blocks): every kind of split,
    a vocabulary of 7 rows that 2 ranks hold padded, a replicated norm."""

    def __init__(self, context):
        super().__init__()
        from oslo.parallel import (
            ColumnParallelEmbedding,
            ColumnParallelLinear,
            RowParallelLinear,
            VocabParallelEmbedding,
        )

        self.tokens = VocabParallelEmbedding(7, 8, parallel_context=context)
        self.positions = ColumnParallelEmbedding(5, 8, parallel_context=context)
        self.up = ColumnParallelLinear(8, 12, parallel_context=context)
        self.down = RowParallelLinear(12, 8, parallel_context=context)
        self.norm = torch.nn.LayerNorm(8)
        self.register_buffer("steps", torch.tensor(3))


def _own_module_saved_whole(rank, world_size, target):
    from oslo.parallel import ParallelContext

    torch.manual_seed(0)
    reference = _PlainBlocks()
    expected = {**reference.state_dict(), "steps": torch.tensor(3)}
    model = _OwnBlocks(ParallelContext(tensor_parallel_size=world_size))
    with torch.no_grad():  # each rank's slices of the reference's weights
        for layer_name, layer in model.named_children():
            for name, param in layer.named_parameters(recurse=False):
                spec = getattr(layer, "parallel_specs", {}).get(name)
                whole = expected[f"{layer_name}.{name}"]
                param.copy_(whole if spec is None else spec.slice_of(whole))
    local = model.state_dict()
    with oslo.save_tensor_parallel(model):
        whole = model.state_dict()
        with oslo.save_tensor_parallel(model):  # nested, and inside a module of one process: still whole
            again = torch.nn.ModuleDict({"blocks": model}).state_dict()
    assert sorted(whole) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(whole[key], value), key
        assert torch.equal(again["blocks." + key], value), key
    after = model.state_dict()  # outside the context: this rank's slices again
    assert sorted(after) == sorted(local) and all(torch.equal(after[k], local[k]) for k in local)
    if rank == 0:
        torch.save(whole, target)
        plain = _PlainBlocks()
        plain.register_buffer("steps", torch.tensor(0))
        plain.load_state_dict(torch.load(target, weights_only=True), strict=True)
        assert all(torch.equal(plain.state_dict()[k], v) for k, v in expected.items())
    with pytest.raises(TypeError, match="built from oslo.parallel's layers"):
        with oslo.save_tensor_parallel(reference):
            pass
    return [key for key, value in local.items() if value.shape != expected[key].shape]


def test_save_tensor_parallel_takes_a_module_of_one_s_own(tmp_path):
    """The tensor_parallel manual's ``save_tensor_parallel`` on a module built from oslo.parallel's layers: its
    ``state_dict()`` is the whole module's on every rank (split weights gathered, the vocabulary unpadded), nested
    or not, and ``torch.save`` of it loads into the same module of one process; outside, the slices again."""
    split = run_distributed(_own_module_saved_whole, 2, str(tmp_path / "whole.pt"), timeout=120)
    assert split == [["tokens.weight", "positions.weight", "up.weight", "up.bias", "down.weight"]] * 2


def _save_with_transformers_options(rank, world_size, source, target):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(source, tensor_parallel_size=world_size)
    # accelerate's is_main_process and the hub options' defaults, as a transformers script passes them
    model.save_pretrained_with_parallel(target, save_with_merging=True, is_main_process=rank == 0,
                                        push_to_hub=False, token=None, variant=None)
    with pytest.raises(ValueError, match="upload_folder"):
        model.save_pretrained_with_parallel(target, push_to_hub=True)
    return True


def test_save_takes_transformers_options(lm_checkpoint, tmp_path):
    """``is_main_process`` (every rank saves all the same), ``push_to_hub=False``, ``token``, ``variant=None`` are
    taken; an upload is refused with the way to do it. The merged save is transformers' weights."""
    assert run_distributed(_save_with_transformers_options, 2, lm_checkpoint, str(tmp_path)) == [True, True]
    torch.testing.assert_close(_reference_logits(str(tmp_path)), _reference_logits(lm_checkpoint))
