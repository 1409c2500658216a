"""``import oslo`` is cheap: the public names are imported when first used (oslo/__init__.py's ``__getattr__``), so
a script that imports oslo pays for DeepSpeed, accelerate, Flask, the data and the deployment machinery only if it
uses them, and ``from oslo import X`` still works for every public name."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import oslo

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("deepspeed", "accelerate", "flask", "oslo.data", "oslo.deployment")


def _imported_after(statement: str) -> list[str]:
    """The modules of ``HEAVY`` (and torch, transformers) that a fresh interpreter holds after ``statement``."""
    names = HEAVY + ("torch", "transformers")
    probe = f"import sys\n{statement}\nprint(' '.join(m for m in {names!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_import_oslo_imports_nothing_heavy():
    assert _imported_after("import oslo") == []


def test_a_model_class_brings_no_optional_machinery():
    # accelerate comes with transformers' own modeling_utils (its DeepSpeed integration), not from oslo
    loaded = _imported_after("from oslo import GPT2LMHeadModel")
    assert "torch" in loaded and "transformers" in loaded
    assert not {"deepspeed", "flask", "oslo.data", "oslo.deployment"} & set(loaded), loaded


@pytest.mark.parametrize("name", oslo.__all__)
def test_every_public_name_resolves(name):
    namespace: dict = {}
    exec(f"from oslo import {name}", namespace)
    assert namespace[name] is getattr(oslo, name)
    assert name in dir(oslo)


def test_the_model_names_are_those_of_oslo_models():
    models = importlib.import_module("oslo.models")
    assert set(oslo._EXPORTS["oslo.models"]) == set(models.__all__) - {"OsloPreTrainedModel"}


def test_submodules_and_unknown_names():
    assert oslo.parallel.ParallelContext is oslo.ParallelContext
    assert oslo.deployment.deploy is importlib.import_module("oslo.deployment").deploy
    with pytest.raises(AttributeError, match="module 'oslo' has no attribute 'GPT3LMHeadModel'"):
        oslo.GPT3LMHeadModel  # noqa: B018
    with pytest.raises(ImportError):
        exec("from oslo import GPT3LMHeadModel", {})
