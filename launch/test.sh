#!/usr/bin/env bash
# Set up if needed, then run the test suite (CPU only, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The second runtime and oracle (megatron-core 0.19.2, .venv-mcore19) and then the newest-stack runtime (torch
# 2.15, .venv-newest) are set up in the background, beside .venv and NeMo and then beside the first tests: the
# first use of a runtime waits for its set-up's exit status (tests/workers.py runtime_python). The set-ups share
# nothing but the checkout's editable install, which each takes a lock for. On a clean machine that was about
# 2 minutes less (1068 s against 1199 s for .ci/run, with the install test 20 s faster): pip is one process,
# and its unpacking and downloads leave a core idle.
tmp=$(mktemp -d)
export DIST_CONVERT_MCORE19_SETUP_STATUS=$tmp/mcore19 DIST_CONVERT_NEWEST_SETUP_STATUS=$tmp/newest
# its own process group (setsid), so that an exit here ends the whole set-up; each status file appears whole
# shellcheck disable=SC2016  # $1 expands in the inner bash
setsid bash -c 'for r in mcore19 newest; do
                  rc=0; bash "launch/setup_$r.sh" >"$1/$r.log" 2>&1 || rc=$?
                  echo "$rc" >"$1/$r.part"; mv "$1/$r.part" "$1/$r"
                done' _ "$tmp" &
pid=$!
echo "launch/setup_mcore19.sh, launch/setup_newest.sh: running in the background (their output is shown if they fail)"
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  if kill -0 "$pid" 2>/dev/null; then kill -TERM -- "-$pid" 2>/dev/null || true; wait "$pid" || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
bash launch/setup.sh
bash launch/setup_nemo.sh  # NeMo 2 in .venv, for the NeMo 2 oracle (tests/oracles/nemo2.py)
# one intra-op thread in every process of the suite, whatever the caller's environment says: a value computed in the
# pytest process and one computed in a worker are compared bit for bit (tests/conftest.py sets the same)
export OMP_NUM_THREADS=1 DIST_CONVERT_THREADS=1
.venv/bin/ruff check dist_convert tests  # lint: the rule set is in pyproject.toml
set +e
# two pytest processes (pytest-xdist), a test file each at a time: one alone left a core idle for about a third of
# the run (one-rank jobs, pure planning, waits on a timeout); the tests' sources are made once for both (conftest.py
# made_once) and each process keeps a smaller pool of workers (tests/workers.py)
.venv/bin/python -m pytest tests -n 2 --dist loadfile --durations=15 "$@"  # the 15 slowest tests, every run
rc=$?
wait "$pid"
set -e
for r in mcore19 newest; do
  status=$(cat "$tmp/$r" 2>/dev/null || echo 1)
  if [ "$status" != 0 ]; then cat "$tmp/$r.log" >&2; echo "launch/setup_$r.sh failed (exit $status)" >&2; exit 1; fi
done
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
