#!/usr/bin/env bash
# Set up if needed, then run the test suite (CPU only, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The second runtime and oracle (megatron-core 0.19.2, .venv-mcore19) is set up beside .venv and NeMo: the
# two share nothing but the checkout's editable install, which both scripts take a lock for. On a clean
# machine that is about 2 minutes less (pip is one process; its downloads and unpacking leave a core idle).
log19=$(mktemp)
setsid bash launch/setup_mcore19.sh >"$log19" 2>&1 &  # its own process group, so that an exit here ends it
pid19=$!
cleanup() {
  if kill -0 "$pid19" 2>/dev/null; then kill -TERM -- "-$pid19" 2>/dev/null || true; wait "$pid19" || true; fi
  rm -f "$log19"
}
trap cleanup EXIT
bash launch/setup.sh
bash launch/setup_nemo.sh  # NeMo 2 in .venv, for the NeMo 2 oracle (tests/nemo2_oracle.py)
rc19=0
wait "$pid19" || rc19=$?
cat "$log19"
if [ "$rc19" -ne 0 ]; then echo "launch/setup_mcore19.sh failed (exit $rc19)" >&2; exit "$rc19"; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check dist_convert tests  # lint: the rule set is in pyproject.toml
set +e
.venv/bin/python -m pytest tests --durations=15 "$@"  # the 15 slowest tests, every run
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
