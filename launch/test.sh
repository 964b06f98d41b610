#!/usr/bin/env bash
# Set up if needed, then run the test suite (CPU only, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh
bash launch/setup_nemo.sh  # NeMo 2 in .venv, for the NeMo 2 oracle (tests/nemo2_oracle.py)
bash launch/setup_mcore19.sh  # the second runtime and oracle (megatron-core 0.19.2)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check dist_convert tests  # lint: the rule set is in pyproject.toml
set +e
.venv/bin/python -m pytest tests --durations=15 "$@"  # the 15 slowest tests, every run
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
