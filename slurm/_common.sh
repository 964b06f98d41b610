# shellcheck shell=bash
# Shared by the sbatch templates in this directory (sourced, not run). The templates set the #SBATCH
# lines; this file starts dist_convert on every node of the allocation and reports the outcome.
#
# Variables (set them in the environment of `sbatch`, which passes them on, or edit the defaults in
# the template that sources this file):
#   REPO              dist_convert checkout on a filesystem every node sees (default: the checkout
#                     holding the submitted template, else the submit directory)
#   PYTHON            interpreter with torch + dist_convert on the nodes (default: REPO/.venv/bin/python,
#                     else python3; inside a container usually just python)
#   NPROC_PER_NODE    ranks per node (GPUS_PER_NODE is read too; default: the GPUs Slurm gave the node,
#                     else min(4, CPUs): CPU-only nodes run with gloo)
#   CONTAINER_IMAGE   run each node's torchrun in this image (needs the pyxis/enroot srun plugin); empty: none
#   CONTAINER_MOUNTS  pyxis mounts, SRC:DST[,SRC:DST...]: mount REPO and the checkpoints at the same paths
#   RDZV_HOST         c10d rendezvous address (default: NodeAddr of the allocation's first node)
#   RDZV_PORT         rendezvous port (default: 29500 + job id % 1000, so jobs sharing a node differ)
#   LOG_DIR           per-rank stdout/stderr files (default: <submit dir>/<job name>-<job id>.ranks);
#                     the job's own log is the #SBATCH --output file
#   LOG_RANKS         local ranks shown in the job log: all (default) or a list like 0
#   SRUN_ARGS         extra srun arguments (word-split), e.g. "--cpu-bind=none"

dc_die() { echo "dist_convert job: $*" >&2; exit 2; }

# First node of the allocation and the address the others reach it at. Node names need not resolve
# (e.g. several slurmd on one host); NodeAddr is what slurmd itself is reached by.
dc_rendezvous_host() {
  local head addr
  head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  addr=$(scontrol show node "$head" -o | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  echo "${addr:-$head}"
}

# srun one launch/convert.sh per node (it runs torchrun there); any rank failing fails the job.
#   dc_run SUBCOMMAND [ARGS...]
dc_run() {
  [ $# -ge 1 ] || dc_die "no dist_convert subcommand given (e.g. sbatch slurm/convert.sbatch reshard SRC DST ...)"
  [ -n "${SLURM_JOB_ID:-}" ] || dc_die "run this with sbatch (no SLURM_JOB_ID)"
  [ -f "$REPO/launch/convert.sh" ] || dc_die "REPO=$REPO is not a dist_convert checkout; set REPO"
  export REPO
  export LOG_RANKS=${LOG_RANKS:-all}
  export LOG_DIR=${LOG_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/${SLURM_JOB_NAME:-dist_convert}-$SLURM_JOB_ID.ranks}
  if [ -n "${GPUS_PER_NODE:-}" ] && [ -z "${NPROC_PER_NODE:-}" ]; then export NPROC_PER_NODE=$GPUS_PER_NODE; fi
  if [ -n "${PYTHON:-}" ]; then export PYTHON; fi
  local nnodes=${SLURM_NNODES:-1}
  if [ "$nnodes" -gt 1 ]; then
    export NNODES=$nnodes RDZV_ID=$SLURM_JOB_ID
    export RDZV_ENDPOINT=${RDZV_HOST:-$(dc_rendezvous_host)}:${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
  else
    unset RDZV_ENDPOINT NNODES RDZV_ID
  fi

  # one task per node that may use all the node's CPUs of the job (torchrun forks the ranks from it)
  local -a srun_args=(--label --kill-on-bad-exit=1 --nodes="$nnodes" --ntasks-per-node=1)
  if [ -n "${SLURM_CPUS_ON_NODE:-}" ]; then srun_args+=(--cpus-per-task="$SLURM_CPUS_ON_NODE"); fi
  if [ -n "${CONTAINER_IMAGE:-}" ]; then
    srun_args+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$PWD")
    if [ -n "${CONTAINER_MOUNTS:-}" ]; then srun_args+=(--container-mounts="$CONTAINER_MOUNTS"); fi
  fi
  local -a extra=()
  if [ -n "${SRUN_ARGS:-}" ]; then read -r -a extra <<< "$SRUN_ARGS"; fi

  echo "dist_convert job $SLURM_JOB_ID: $nnodes node(s) [$SLURM_JOB_NODELIST] x ${NPROC_PER_NODE:-auto} rank(s)," \
    "rendezvous ${RDZV_ENDPOINT:-standalone}, repo $REPO, rank logs $LOG_DIR"
  echo "dist_convert job $SLURM_JOB_ID: command: dist_convert $*"
  local rc=0
  srun "${srun_args[@]}" "${extra[@]}" bash "$REPO/launch/convert.sh" "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "dist_convert job $SLURM_JOB_ID: OK"
  else
    echo "dist_convert job $SLURM_JOB_ID: FAILED (exit $rc); see the lines above and $LOG_DIR" >&2
  fi
  return "$rc"
}
