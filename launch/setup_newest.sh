#!/usr/bin/env bash
# Idempotent set-up of .venv-newest: the newest-stack runtime (Python 3.12, the newest torch the registry
# serves, 2.15.0, which is what `torch>=2.6` resolves to on a user's GPU node; its CUDA build runs on a CPU
# machine as it is; megatron-core 0.19.2). tests/test_newest_torch.py runs dist_convert, torch's own DCP and
# megatron-core's save under it, and checks what crosses between it and torch 2.13 (.venv, .venv-mcore19). It also
# holds transformers 5.23.0, the newest release, whose Kimi-K2.5 classes judge that family (tests/oracles/kimi_k25.py).
# Re-running is a no-op unless this script or pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=launch/_python312.sh
source launch/_python312.sh
V=.venv-newest
TORCH=2.15.0
[ -x "$V/bin/python" ] || "$PY312" -m venv "$V"
# machines that cap pip's torch with a constraints file (the releases on their disk) would refuse 2.15.0
export PIP_CONSTRAINT=/dev/null
PIP=("$V/bin/python" -m pip install -q --disable-pip-version-check)
stamp=$V/.dist_convert_setup
want=$(cat pyproject.toml launch/setup_newest.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "${PIP[@]}" "torch==$TORCH"
  "${PIP[@]}" "megatron-core==0.19.2" numpy packaging psutil "pyyaml>=5.1" "safetensors>=0.4" "rich>=13" "pytest>=8" \
    "transformers==5.23.0"
  flock pyproject.toml "${PIP[@]}" --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
"$V/bin/python" -W ignore -c "import torch, megatron.core, dist_convert
assert torch.__version__.startswith('$TORCH'), torch.__version__
print(f'newest runtime ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}')"
