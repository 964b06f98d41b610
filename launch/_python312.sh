#!/usr/bin/env bash
# Sourced by launch/setup_mcore19.sh and launch/setup_newest.sh: sets PY312 to a Python 3.12 (megatron-core 0.17+
# needs it): $PYTHON312, else one under pyenv or on PATH that runs (a pyenv shim exists even where no 3.12 is
# selected); exits 1 with a one-line error when there is none.
PY312=${PYTHON312:-}
if [ -z "$PY312" ]; then
  for c in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3.12; do
    if "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" >/dev/null 2>&1; then PY312=$c; break; fi
  done
fi
if [ -z "$PY312" ]; then
  echo "$(basename "$0"): Python 3.12 not found (megatron-core 0.17+ needs it); set PYTHON312=/path/to/python3.12" >&2
  exit 1
fi
export PY312
