"""Resharding in one process, loading split checkpoints at other layouts, and the original OSLO's split files.

The oracle of resharding is a save: a checkpoint resharded to a layout must be, file for file and byte for byte,
the one a model loaded at that layout saves (weights, index with its digests, config). The oracle of loading at
another layout is transformers on the same weights.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

import oslo
from oslo import checkpoint as ckpt
from tests.distributed import run_distributed
from tests.helpers import save_reference, tiny_gpt2_config
from tests.models import zoo

INPUT_IDS = torch.tensor([[5, 17, 900, 3, 44, 1000, 8], [9, 9, 250, 31, 7, 600, 12]])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _anchor(arch: str) -> zoo.Case:
    return next(case for case in zoo.cases_of(arch) if case.anchor)


def _save_layouts(rank, world_size, name, source, target, layouts):
    """Load ``source`` at each layout (the 4 ranks: data parallel where tp*pp < 4) and save it split."""
    for tp, pp in layouts:
        context = oslo.ParallelContext(tp, pp)
        model = getattr(oslo, name).from_pretrained_with_parallel(source, tensor_parallel_size=tp,
                                                                  pipeline_parallel_size=pp, parallel_context=context)
        model.save_pretrained_with_parallel(f"{target}/{tp}x{pp}")


def _assert_same_files(expected: str, actual: str) -> None:
    assert sorted(os.listdir(expected)) == sorted(os.listdir(actual))
    for name in sorted(os.listdir(expected)):
        assert filecmp.cmp(os.path.join(expected, name), os.path.join(actual, name), shallow=False), name


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neo", "bert", "t5", "llama", "qwen2"])
def test_round_trip_is_bit_identical_to_saving_at_each_layout(tmp_path, arch):
    """(2,2) -> (4,1) -> merged -> (1,2) -> (2,2): each step equals the save at that layout, the merged one holds
    the transformers model's tensors exactly, and the last step gives back the files it started from."""
    case = _anchor(arch)
    torch.manual_seed(0)
    reference = getattr(transformers, case.name)(case.config()).eval()
    reference.save_pretrained(tmp_path / "hf")
    run_distributed(_save_layouts, 4, case.name, str(tmp_path / "hf"), str(tmp_path / "saved"),
                    [(2, 2), (4, 1), (1, 2)], timeout=240)
    saved, out = tmp_path / "saved", tmp_path / "out"

    oslo.reshard_checkpoint(saved / "2x2", out / "4x1", 4, 1, progress=False)
    _assert_same_files(saved / "4x1", out / "4x1")
    oslo.reshard_checkpoint(out / "4x1", out / "merged", merged=True, progress=False)
    merged = load_file(out / "merged" / "model.safetensors")
    expected = reference.state_dict()
    assert set(merged) <= set(expected)
    for key, tensor in merged.items():
        assert torch.equal(tensor, expected[key]), key
    loaded = getattr(transformers, case.name).from_pretrained(out / "merged")  # no missing weights
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[key]), key
    oslo.reshard_checkpoint(out / "merged", out / "1x2", 1, 2, progress=False)
    _assert_same_files(saved / "1x2", out / "1x2")
    oslo.reshard_checkpoint(out / "1x2", out / "2x2", 2, 2, progress=False)
    _assert_same_files(saved / "2x2", out / "2x2")


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(n_layer=4), path)
    return str(path)


def _reference_logits(path):
    return transformers.GPT2LMHeadModel.from_pretrained(path).eval()(INPUT_IDS).logits


def _save(rank, world_size, source, target, tp, pp):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(source, tensor_parallel_size=tp,
                                                               pipeline_parallel_size=pp)
    model.save_pretrained_with_parallel(target)


def _logits(rank, world_size, path, tp, pp, model_class="GPT2LMHeadModel", **kwargs):
    model = getattr(oslo, model_class).from_pretrained_with_parallel(path, tensor_parallel_size=tp,
                                                                     pipeline_parallel_size=pp, **kwargs)
    output = model(INPUT_IDS)
    if output is None:  # not the last pipeline stage
        return None
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


@pytest.fixture(scope="module")
def split_2x2(lm_checkpoint, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("split-2x2"))
    run_distributed(_save, 4, lm_checkpoint, path, 2, 2)
    return path


@pytest.mark.parametrize("tp, pp", [(1, 1), (4, 1), (1, 2), (2, 1)])
def test_split_checkpoint_loads_at_another_layout(lm_checkpoint, split_2x2, tp, pp):
    results = run_distributed(_logits, tp * pp, split_2x2, tp, pp)
    torch.testing.assert_close(results[-1], _reference_logits(lm_checkpoint))


def test_split_checkpoint_of_another_stage_partition_loads(split_2x2, lm_checkpoint):
    """The LM head's weight puts two blocks on each stage; GPT2Model puts one and three: its second stage reads
    block 1 from the first stage's file."""
    results = run_distributed(_logits, 2, split_2x2, 1, 2, "GPT2Model")
    expected = transformers.GPT2Model.from_pretrained(lm_checkpoint).eval()(INPUT_IDS).last_hidden_state
    torch.testing.assert_close(results[-1], expected)


def test_split_checkpoint_loads_with_a_resized_vocabulary(split_2x2, lm_checkpoint):
    results = run_distributed(_logits, 2, split_2x2, 2, 1, resize_token_embeddings=1010)
    reference = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint).eval()
    torch.testing.assert_close(results[0][..., :1001], reference(INPUT_IDS).logits)
    assert results[0].shape[-1] == 1010


def test_loading_at_another_layout_verifies_the_files(split_2x2, tmp_path):
    """Every file is checked against the index's digests (each by one rank) before any weight is used."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(split_2x2, broken)
    path = broken / "model_tp=1_pp=1.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="SHA-256"):
        run_distributed(_logits, 1, str(broken), 1, 1)
    with pytest.raises(OSError, match="SHA-256"):
        oslo.reshard_checkpoint(broken, tmp_path / "out", 2, 1, progress=False)


def test_resharded_checkpoint_loads_and_its_digests_hold(split_2x2, lm_checkpoint, tmp_path):
    out = tmp_path / "4x1"
    oslo.reshard_checkpoint(split_2x2, out, 4, 1, progress=False)
    index = json.loads((out / ckpt.SPLIT_INDEX_NAME).read_text())
    for name, record in index["digests"].items():
        assert ckpt._file_digest(str(out / name)) == {"size": record["size"], "sha256": record["sha256"]}
    results = run_distributed(_logits, 4, str(out), 4, 1)
    torch.testing.assert_close(results[0], _reference_logits(lm_checkpoint))


def test_reshard_in_place_keeps_other_files(split_2x2, tmp_path):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(split_2x2, path)
    (path / "tokenizer.json").write_text("{}")
    oslo.reshard_checkpoint(path, path, 1, 1, progress=False)
    assert ckpt.inspect_checkpoint(str(path)).layout == (1, 1)
    assert (path / "tokenizer.json").read_text() == "{}"
    assert not any(name.startswith("model_tp=1") for name in os.listdir(path))


def test_reshard_refuses_bad_requests(lm_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="merged=True"):
        oslo.reshard_checkpoint(lm_checkpoint, tmp_path / "a", 2, 1, merged=True)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        oslo.reshard_checkpoint(lm_checkpoint, tmp_path / "a", 3, 1)
    with pytest.raises(FileNotFoundError):
        oslo.reshard_checkpoint(tmp_path / "missing", tmp_path / "a", 2, 1)
    assert not os.path.exists(tmp_path / "a")


def test_reshard_command_line(lm_checkpoint, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-m", "oslo", "reshard", lm_checkpoint, str(tmp_path / "out"), "--tensor-parallel-size", "2",
         "--pipeline-parallel-size", "2", "--no-progress"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr
    assert ckpt.inspect_checkpoint(str(tmp_path / "out")).layout == (2, 2)


def test_reshard_command_line_error_exits_2(tmp_path, capsys):
    from oslo.__main__ import main

    assert main(["reshard", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- the original OSLO's split files ---------------------------------------------------------------------------
def _legacy_files(source: str, target: str, tp: int, pp: int, style: str) -> None:
    """Write ``source``'s weights as the original OSLO named its split files: each rank's local tensors (the
    oslo split layout) under the Hugging Face names, pickled with torch.save, next to config.json."""
    os.makedirs(target)
    reference = transformers.GPT2LMHeadModel.from_pretrained(source)
    state = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    stages = oslo.GPT2LMHeadModel.pipeline_partition(reference.config, pp)
    for t in range(tp):
        local = oslo.convert_state_dict(state, reference, tp, t)
        for p, layers in enumerate(stages):
            first, last = p == 0, p == pp - 1
            keep = {k: v for k, v in local.items()
                    if (k.startswith("transformer.h.") and int(k.split(".")[2]) in layers)
                    or (first and k.startswith(("transformer.wte", "transformer.wpe")))
                    or (last and k.startswith("transformer.ln_f"))}
            torch.save(keep, os.path.join(target, f"pytorch_model_tp{style}{t}_pp{style}{p}.bin"))
    reference.config.save_pretrained(target)


@pytest.mark.parametrize("style", ["_", "="])
def test_original_oslo_split_files_load_at_any_layout(lm_checkpoint, tmp_path, style):
    _legacy_files(lm_checkpoint, str(tmp_path / "legacy"), 2, 2, style)
    expected = _reference_logits(lm_checkpoint)
    for tp, pp in [(2, 2), (1, 1)]:
        results = run_distributed(_logits, tp * pp, str(tmp_path / "legacy"), tp, pp)
        torch.testing.assert_close(results[-1], expected)
    oslo.reshard_checkpoint(tmp_path / "legacy", tmp_path / "merged", merged=True, progress=False)
    merged = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(merged(INPUT_IDS).logits, expected)


def test_original_oslo_split_files_are_read_weights_only(lm_checkpoint, tmp_path):
    _legacy_files(lm_checkpoint, str(tmp_path / "legacy"), 2, 1, "_")

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Payload()}, tmp_path / "legacy" / "pytorch_model_tp_1_pp_0.bin")
    with pytest.raises(OSError, match="would execute code"):
        oslo.reshard_checkpoint(tmp_path / "legacy", tmp_path / "out", progress=False)


def test_original_oslo_split_files_with_a_missing_rank_are_refused(lm_checkpoint, tmp_path):
    _legacy_files(lm_checkpoint, str(tmp_path / "legacy"), 2, 1, "_")
    os.remove(tmp_path / "legacy" / "pytorch_model_tp_1_pp_0.bin")
    (tmp_path / "legacy" / "pytorch_model_tp_3_pp_0.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"do not form a layout.*\(1, 0\)"):
        oslo.reshard_checkpoint(tmp_path / "legacy", tmp_path / "out", progress=False)


def test_saving_over_original_oslo_split_files_replaces_them(lm_checkpoint, tmp_path):
    """A save into their directory replaces them like any checkpoint files (not carried over beside it)."""
    _legacy_files(lm_checkpoint, str(tmp_path / "legacy"), 2, 1, "_")
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(str(tmp_path / "legacy"))
    model.save_pretrained_with_parallel(str(tmp_path / "legacy"))
    assert not [name for name in os.listdir(tmp_path / "legacy") if name.startswith("pytorch_model_tp")]
    torch.testing.assert_close(model(INPUT_IDS).logits, _reference_logits(lm_checkpoint))
