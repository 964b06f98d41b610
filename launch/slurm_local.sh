#!/usr/bin/env bash
# Start a two-node Slurm cluster (nodes n1, n2, partition debug) on this one machine, to try the
# templates in slurm/ by hand; Ctrl-C stops it. Needs root; installs Debian's slurm-wlm and munge when
# missing. Everything (config, munge key and socket, spool, state, logs) lives in DIR; /etc is untouched.
#   bash launch/slurm_local.sh [DIR]        then, in another shell:
#   export SLURM_CONF=DIR/slurm.conf; sinfo
#   NPROC_PER_NODE=2 sbatch --nodes=2 --gpus-per-node=0 --partition=debug slurm/convert.sbatch reshard SRC DST ...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dir=${1:-$(mktemp -d "${TMPDIR:-/tmp}/dc_slurm.XXXX")}
exec "${PYTHON:-.venv/bin/python}" tests/slurm_cluster.py "$dir"
