#!/usr/bin/env bash
# Benchmark dist_convert against the I/O floor, the whole-model single-process path and megatron-core's
# own load + save, on a synthetic Llama-shaped checkpoint (set up first if needed). Arguments go to
# `dist_convert bench`; e.g. bash launch/bench.sh --size 1GB --json bench.json
#                            bash launch/bench.sh --sizes 256MB,512MB,1GB --memory-budget 256MB
#                            bash launch/bench.sh --release llama3-8b --drop-caches --workdir /scratch  # 16 GB, kept
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh
for a in "$@"; do  # --plot draws with matplotlib, an optional dependency
  if [[ $a == --plot ]] && ! .venv/bin/python -c "import matplotlib" 2>/dev/null; then
    .venv/bin/pip install -q matplotlib
  fi
done
export PYTHONWARNINGS=ignore
exec .venv/bin/python -m dist_convert bench "$@"
