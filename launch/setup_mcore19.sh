#!/usr/bin/env bash
# Idempotent set-up of .venv-mcore19: the second runtime and oracle (Python 3.12 + megatron-core 0.19.2,
# and Megatron-Bridge 0.6.2 to judge targets). The tests run dist_convert under it and make and load
# checkpoints with it. It stays on torch 2.13.0: megatron-core 0.19.2's strict load fails under torch 2.15
# (launch/setup_newest.sh, docs/testing.md). Re-running is a no-op unless this script or pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=launch/_python312.sh
source launch/_python312.sh
V=.venv-mcore19
[ -x "$V/bin/python" ] || "$PY312" -m venv "$V"
PIP=("$V/bin/python" -m pip install -q --disable-pip-version-check)
stamp=$V/.dist_convert_setup
want=$(cat pyproject.toml launch/setup_mcore19.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "${PIP[@]}" "torch==2.13.0"   # on CPU machines the registry's CUDA build runs on CPU as it is
  "${PIP[@]}" "megatron-core==0.19.2" numpy packaging psutil "pyyaml>=5.1" "safetensors>=0.4" "rich>=13" "pytest>=8"
  # Megatron-Bridge 0.6.2 without its deps (they pin CUDA-only packages), then what its import path needs
  "${PIP[@]}" --no-deps "megatron-bridge==0.6.2"
  "${PIP[@]}" "transformers>=5.8,<=5.12.1" "peft==0.21.2" accelerate omegaconf einops "hydra-core>=1.3.4,<1.4" tqdm regex six \
    "nvidia-modelopt==0.47.0" requests datasets "megatron-energon~=7.0" tensorboard
  # the editable install writes dist_convert.egg-info into the checkout: one at a time (launch/test.sh runs
  # setup.sh and setup_mcore19.sh side by side)
  flock pyproject.toml "${PIP[@]}" --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
"$V/bin/python" -W ignore -c "import torch, megatron.core, dist_convert
print(f'second runtime ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}')"
