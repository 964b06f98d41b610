#!/usr/bin/env bash
# Set up if needed, then run the test suite (CPU only, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The second runtime and oracle (megatron-core 0.19.2, .venv-mcore19) is set up in the background, beside
# .venv and NeMo and then beside the first tests: the first use of that runtime waits for its set-up's exit
# status (tests/workers.py runtime_python). The two set-ups share nothing but the checkout's editable install,
# which both take a lock for. On a clean machine that was about 2 minutes less (1068 s against 1199 s for
# .ci/run, with the install test 20 s faster): pip is one process, and its
# unpacking and downloads leave a core idle.
tmp19=$(mktemp -d)
export DIST_CONVERT_MCORE19_SETUP_STATUS=$tmp19/status
# its own process group (setsid), so that an exit here ends the whole set-up
setsid bash -c 'rc=0; bash launch/setup_mcore19.sh >"$1/log" 2>&1 || rc=$?; echo "$rc" >"$1/status.part"
                mv "$1/status.part" "$1/status"' _ "$tmp19" &
pid19=$!
echo "launch/setup_mcore19.sh: running in the background (its output is shown if it fails)"
cleanup() {
  if kill -0 "$pid19" 2>/dev/null; then kill -TERM -- "-$pid19" 2>/dev/null || true; wait "$pid19" || true; fi
  rm -rf "$tmp19"
}
trap cleanup EXIT
bash launch/setup.sh
bash launch/setup_nemo.sh  # NeMo 2 in .venv, for the NeMo 2 oracle (tests/nemo2_oracle.py)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check dist_convert tests  # lint: the rule set is in pyproject.toml
set +e
.venv/bin/python -m pytest tests --durations=15 "$@"  # the 15 slowest tests, every run
rc=$?
wait "$pid19"
rc19=$(cat "$tmp19/status" 2>/dev/null || echo 1)
set -e
if [ "$rc19" != 0 ]; then cat "$tmp19/log" >&2; echo "launch/setup_mcore19.sh failed (exit $rc19)" >&2; exit 1; fi
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
