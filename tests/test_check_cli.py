"""``python -m oslo check``: the real command in subprocesses (it launches its own ranks) on tiny checkpoints.

It passes on GPT2 at tensor parallelism 2 (a transformers checkpoint) and at pipeline parallelism 2 (an oslo
split checkpoint of another layout, merged first), and on BERT at tensor parallelism 2; it fails on a model
whose computation differs from transformers' (the module's test hook ``OSLO_CHECK_PERTURB`` shifts one
parameter of the oslo model after the weights were compared); bad input exits with 2 and a one-line error
before any process starts (one case through the command line, the others through ``main``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import transformers

import oslo
from oslo import check
from tests.distributed import run_distributed
from tests.helpers import save_reference, tiny_gpt2_config
from tests.models.cases_bert import tiny_bert_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300  # each run imports torch and transformers, then forks its ranks


def _cli(*args: str, perturb: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != check.PERTURB_ENV}
    env["OMP_NUM_THREADS"] = "1"
    if perturb is not None:
        env[check.PERTURB_ENV] = perturb
    return subprocess.run([sys.executable, "-m", "oslo", "check", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, cwd=REPO)


def _table_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("batch"))
    rows = []
    for line in lines[start + 1:]:
        fields = line.split()
        if not fields or not fields[0].isdigit():
            break
        rows.append(fields)
    return rows


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return str(path)


def _save_split(rank, world_size, path, target):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    model.save_pretrained_with_parallel(target)


@pytest.fixture(scope="module")
def gpt2_split(gpt2, tmp_path_factory):
    """The GPT2 as an oslo split checkpoint at tensor_parallel_size=2."""
    target = str(tmp_path_factory.mktemp("gpt2-split") / "split")
    run_distributed(_save_split, 2, gpt2, target)
    assert os.path.isfile(os.path.join(target, "model_parallel.index.json"))
    return target


def _assert_passed(result: subprocess.CompletedProcess, batches: int) -> list[list[str]]:
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS (rtol=1.3e-06, atol=1e-05"), result.stdout
    assert "bit-identical" in result.stdout  # the loaded weights
    rows = _table_rows(result.stdout)
    assert [row[0] for row in rows] == [str(i) for i in range(batches)]
    for _, logits, loss, grad, _name in rows:
        assert float(logits) < 1e-5 and float(loss) < 1e-5 and float(grad) < 1e-5
    return rows


def test_gpt2_tensor_parallel_passes(gpt2):
    result = _cli(gpt2, "--tensor-parallel-size", "2", "--batches", "2")
    _assert_passed(result, 2)
    assert "tensor_parallel_size=2 x pipeline_parallel_size=1 = 2 processes" in result.stdout


def test_gpt2_pipeline_passes_on_a_split_checkpoint_of_another_layout(gpt2_split):
    """Saved at tensor parallel 2, checked at pipeline parallel 2 (merged by the model for transformers)."""
    result = _cli(gpt2_split, "--pipeline-parallel-size", "2", "--batches", "2")
    assert "note: split checkpoint saved at tensor_parallel_size=2 x pipeline_parallel_size=1" in result.stdout
    _assert_passed(result, 2)
    assert "micro_batch_size=2" in result.stdout  # two micro-batches of the 4 rows


def test_bert_tensor_parallel_passes(tmp_path):
    save_reference(transformers.BertForMaskedLM, tiny_bert_config(num_hidden_layers=2), tmp_path)
    result = _cli(str(tmp_path), "--tensor-parallel-size", "2", "--batches", "1", "--seq-len", "12")
    _assert_passed(result, 1)
    assert "BertForMaskedLM" in result.stdout and "masked LM" in result.stdout


def test_a_model_that_computes_differently_fails(gpt2_split):
    """The split checkpoint at its own layout (merged by the model for the reference); the test hook shifts
    ln_f.bias of the oslo model after the weights compared equal: logits, losses and gradients differ."""
    result = _cli(gpt2_split, "--tensor-parallel-size", "2", "--batches", "1", perturb="transformer.ln_f.bias=0.01")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("FAIL ("), result.stdout
    assert "bit-identical" in result.stdout  # the weights themselves loaded equal (split, merged for transformers)
    (row,) = _table_rows(result.stdout)
    assert float(row[1]) > 1e-4 and float(row[3]) > 1e-5  # logits and gradients
    assert "batch 0 logits:" in result.stdout and "batch 0 gradient of" in result.stdout


def test_missing_path_exits_2_before_launching(tmp_path):
    result = _cli(str(tmp_path / "nowhere"), "--tensor-parallel-size", "2")
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("python -m oslo check: error:") and "nowhere" in line and "not a directory" in line


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    return check.main(parser.parse_args(argv))


def _config_only(directory, **overrides) -> str:
    tiny_gpt2_config(**overrides).save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("case", ["no_config", "unsupported_class", "no_head", "heads", "stages", "micro_batch"])
def test_bad_input_exits_2_with_one_line(case, gpt2, tmp_path, monkeypatch, capsys):
    def no_launch(*args, **kwargs):
        raise AssertionError("processes were launched")

    monkeypatch.setattr(check, "_launch", no_launch)
    argv, expected = {  # built for the case only: the configs are written into tmp_path
        "no_config": lambda: ([str(tmp_path)], "has no config.json"),
        "unsupported_class": lambda: ([_config_only(tmp_path, architectures=["FalconForCausalLM"])],
                                      "oslo has no parallel class 'FalconForCausalLM'"),
        "no_head": lambda: ([_config_only(tmp_path, architectures=["GPT2Model"])], "GPT2Model has no loss to check"),
        "heads": lambda: ([gpt2, "--tensor-parallel-size", "3"], "does not divide the number of attention heads"),
        "stages": lambda: ([gpt2, "--pipeline-parallel-size", "3"], "exceeds the number of layers"),
        "micro_batch": lambda: ([gpt2, "--pipeline-parallel-size", "2", "--batch-size", "3",
                                 "--micro-batch-size", "2"], "does not divide --batch-size 3"),
    }[case]()
    assert _main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("python -m oslo check: error:") and expected in line, line


def test_cuda_without_enough_devices_exits_2(gpt2, monkeypatch, capsys):
    monkeypatch.setattr(check.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(check.torch.cuda, "device_count", lambda: 0)
    assert _main([gpt2, "--tensor-parallel-size", "2", "--device", "cuda"]) == 2
    assert "--device cuda needs one CUDA device per process, 2 here" in capsys.readouterr().err
