#!/usr/bin/env bash
# Idempotent set-up of NVIDIA NeMo 2 (nemo_toolkit 2.6.0) in .venv, for the NeMo 2 oracle
# (tests/oracles/nemo2.py); run after launch/setup.sh. NeMo goes into .venv (megatron-core 0.16.1) only: it
# does not import with megatron-core 0.19.2. Its own deps pin CUDA-only and conflicting packages, so what
# `from nemo.collections import llm` and `nemo.lightning.io` import comes first (nvidia-modelopt, which NeMo's
# checkpoint save imports, comes with launch/setup.sh), then nemo_toolkit, nemo_run and leptonai without their
# deps; torch and transformers stay as launch/setup.sh left them.
# Re-running is a no-op unless this script changed (or .venv was made anew).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

[ -x .venv/bin/python ] || { echo "setup_nemo: no .venv; run launch/setup.sh first" >&2; exit 1; }
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
stamp=.venv/.dist_convert_setup_nemo
want=$(sha256sum launch/setup_nemo.sh | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  torch=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
  hf=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
  # what the imports of nemo_toolkit, leptonai and nemo_run need (the rest comes with these); torch,
  # transformers and megatron-core held where they are. lightning 2.6 breaks nv-one-logger's Lightning
  # integration (a signature TypeError at import).
  "${PIP[@]}" "torch==$torch" "transformers==$hf" "megatron-core==0.16.1" \
    "fiddle==0.3.1" "cloudpickle==3.1.3" "lightning==2.5.6" "pytorch-lightning==2.5.6" \
    "nv-one-logger-pytorch-lightning-integration==2.3.1" "fastapi==0.165.0" "uvicorn==0.54.0" \
    "prometheus-fastapi-instrumentator==8.1.0" "hydra-core==1.3.8" "wget==3.2" "onnx==1.23.2" "einops==0.8.2" \
    "sentencepiece==0.2.3" "datasets==5.2.0" "catalogue==2.0.10" "fabric==3.2.3" "torchx==0.7.0" "loguru==0.7.3" \
    "contextlib2==21.6.0" "exceptiongroup==1.3.2" "ledoc-ui==0.1.0" "tiktoken==0.14.0" "tensorstore==0.1.86" \
    "pillow==13.0.0"
  # last, without their deps: pip then reports none of the conflicts they declare (CUDA-only pins)
  "${PIP[@]}" --no-deps "nemo_toolkit==2.6.0" "leptonai==0.27.3" "nemo_run==0.11.1"
  # the imports the oracle makes (about 15 s: checked after an install only)
  check="from nemo.collections import llm; from nemo.lightning.io import load_context"
  if ! out=$(.venv/bin/python -W ignore -c "$check" 2>&1); then
    echo "$out" >&2; echo "setup_nemo: NeMo does not import" >&2; exit 1
  fi
  echo "$want" > "$stamp"
fi
v=$(.venv/bin/python -c "from importlib.metadata import version; print(version('nemo_toolkit'))")
echo "NeMo ready: nemo_toolkit $v"
