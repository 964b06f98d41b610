#!/usr/bin/env bash
# Idempotent set-up of .venv: torch first (the local CPU wheel on machines without a GPU), then
# megatron-core and the package itself. Re-running is a no-op unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON_BIN=${PYTHON:-}
if [ -z "$PYTHON_BIN" ]; then
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null 2>&1; then PYTHON_BIN=$c; break; fi
  done
fi
[ -x .venv/bin/python ] || "$PYTHON_BIN" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.6"          # GPU node: a CUDA build
  else
    "${PIP[@]}" "torch==2.13.0"       # CPU node: the pinned CPU wheel, never a bare 'torch'
  fi
fi

stamp=.venv/.dist_convert_setup
want=$(cat pyproject.toml launch/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # pyproject.toml's dependencies (megatron-core pinned), then its speculative, test and docs extras
  "${PIP[@]}" "megatron-core==0.16.1" "safetensors>=0.4" "rich>=13" "pyyaml>=5.1" psutil \
    "nvidia-modelopt==0.47.0" "transformers>=4.57,<5.15" requests huggingface_hub "pytest>=8" "pytest-xdist>=3.6" \
    "ruff>=0.6" "mkdocs-material>=9.5,<10" "compressed-tensors==0.20.0"
  # the editable install writes dist_convert.egg-info into the checkout: one at a time (launch/test.sh runs
  # setup.sh and setup_mcore19.sh side by side)
  flock pyproject.toml "${PIP[@]}" --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
.venv/bin/python -W ignore -c "import torch, megatron.core, dist_convert; print(f'dist_convert ready: torch {torch.__version__}')"
