#!/usr/bin/env bash
# The suite (or part of it) on another torch than CI's, in a virtual environment of its own. The GPU machines'
# image holds torch 2.11 and Python 3.12: run `PYTHON=python3.12 bash tools/other_torch.sh 2.11.0` before a GPU
# session to find there what differs from CI's 2.13.
#
#   bash tools/other_torch.sh TORCH_VERSION [pytest arguments...]
#
# torch comes from PyPI (on Linux x86-64 its CUDA build: about 3 GB with NVIDIA's libraries; it runs on a CPU too),
# transformers at the lowest release setup.cfg accepts unless TRANSFORMERS names another. The environment is
# .venv-torch-VERSION (VENV: another path), kept for the next run.
set -euo pipefail
version=${1:?usage: bash tools/other_torch.sh TORCH_VERSION [pytest arguments...]}
shift
cd "$(dirname "$0")/.."
venv=${VENV:-.venv-torch-$version}
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/pip" install -q "torch==$version"
    "$venv/bin/pip" install -q -e ".[test,triton]" "transformers==${TRANSFORMERS:-5.23.0}"
fi
"$venv/bin/python" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch",
torch.__version__, "transformers", transformers.__version__)'
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
