#!/usr/bin/env bash
# Run dist_convert on one node with torchrun: one process per GPU, else a few CPU processes (gloo).
# The subcommand and its arguments pass through unchanged:
#   bash launch/convert.sh reshard /ckpt/gpt-tp8 /ckpt/gpt-tp4-pp2 --target-tp 4 --target-pp 2
#   NPROC_PER_NODE=2 bash launch/convert.sh verify /ckpt/a /ckpt/b
# Variables (all optional):
#   NPROC_PER_NODE  processes on this node (GPUS_PER_NODE is read too); default: the GPUs Slurm gave
#                   this node (SLURM_GPUS_ON_NODE), else those in CUDA_VISIBLE_DEVICES, else those
#                   nvidia-smi lists, else min(4, CPUs)
#   PYTHON          interpreter with dist_convert and torch (default: REPO/.venv/bin/python, else python3)
#   LOG_RANKS       local ranks whose output the console shows: 0 (default), a list like 0,1, or all
#   LOG_DIR         every rank's stdout/stderr files go to LOG_DIR/<node>/ (default: a torchelastic_*
#                   temp dir); the console shows LOG_RANKS, the files keep all ranks
# Multi-node (slurm/_common.sh sets these on every node; or set them by hand on each node):
#   NNODES, RDZV_ENDPOINT=HOST:PORT, RDZV_ID   c10d rendezvous instead of --standalone
#   RDZV_IS_HOST    1 on the node that hosts the rendezvous store (default under srun: node 0)
# Every rank first prints one line "dist_convert rank R/W on NODE (local rank L)".
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi

default_nproc() {
  local gpus=${SLURM_GPUS_ON_NODE:-0}
  if [ "$gpus" -eq 0 ] 2>/dev/null && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  elif [ "$gpus" -eq 0 ] 2>/dev/null && command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  if [ "${gpus:-0}" -gt 0 ] 2>/dev/null; then
    echo "$gpus"
  else
    local cpus
    cpus=$(nproc)
    echo $((cpus < 4 ? cpus : 4))
  fi
}
NPROC_PER_NODE=${NPROC_PER_NODE:-${GPUS_PER_NODE:-$(default_nproc)}}

args=(--nproc_per_node="$NPROC_PER_NODE" --tee=3)
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  if [ -z "${RDZV_IS_HOST:-}" ] && [ -n "${SLURM_NODEID:-}" ]; then
    if [ "$SLURM_NODEID" = 0 ]; then RDZV_IS_HOST=1; else RDZV_IS_HOST=0; fi
  fi
  args+=(--nnodes="${NNODES:?NNODES must be set with RDZV_ENDPOINT}" --rdzv_backend=c10d
         --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="${RDZV_ID:?RDZV_ID must be set with RDZV_ENDPOINT}")
  if [ -n "${RDZV_IS_HOST:-}" ]; then args+=(--rdzv_conf="is_host=$RDZV_IS_HOST"); fi
else
  args+=(--standalone)
fi
LOG_RANKS=${LOG_RANKS:-0}
if [ "$LOG_RANKS" != all ]; then args+=(--local-ranks-filter="$LOG_RANKS"); fi
node=${SLURMD_NODENAME:-$(hostname)}
if [ -n "${LOG_DIR:-}" ]; then mkdir -p "$LOG_DIR/$node" && args+=(--log-dir="$LOG_DIR/$node"); fi

# console lines of rank r start with [rank r]; the package is importable from the checkout too
# shellcheck disable=SC2016  # ${rank} is torchrun's template macro, not a shell variable
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=${TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE:-'[rank${rank}]: '}
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
# OpenMP's own pool stays small; each rank sets its intra-op threads (casts, FP8) from the cores it was given:
# its affinity mask capped by SLURM_CPUS_PER_TASK, shared by the node's ranks (runtime.threads_per_rank)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export DIST_CONVERT_NODE=$node

# shellcheck disable=SC2016  # expanded by the bash of each rank, not here
exec "$PYTHON" -m torch.distributed.run "${args[@]}" --no-python bash -c \
  'echo "dist_convert rank $RANK/$WORLD_SIZE on $DIST_CONVERT_NODE (local rank $LOCAL_RANK)" >&2; exec "$@"' \
  dist_convert_rank "$PYTHON" -m dist_convert "$@"
