#!/usr/bin/env bash
# Time a reshard against the I/O floor in the same run (median of REPS runs each):
#   floor: dd every source file to a new file on the same disk, then sync;
#   dist_convert at 1, 2 and 4 ranks: wall time of the whole torchrun command (start-up included, then
#   sync) and in-process time (the slowest rank's, from the summary table).
# Usage: bash launch/measure.sh SRC_CHECKPOINT [reshard flags...]    e.g. --target-tp 1 --target-pp 2
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
src=$1; shift
reps=${REPS:-3}
work=$(mktemp -d "${TMPDIR:-/tmp}/dc_measure.XXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
now() { date +%s.%N; }
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
bytes=$(du -sb "$src" | cut -f1)
floor=$(for _ in $(seq "$reps"); do
  rm -rf "$work/floor"; mkdir -p "$work/floor"; sync; t=$(now)
  find "$src" -type f | while read -r f; do dd if="$f" of="$work/floor/$(echo "$f" | md5sum | cut -c1-12)" bs=16M status=none; done
  sync; echo "$(now) - $t" | bc
done | median)
printf '%-26s %8s %8s %8s %12s %12s %s\n' "what" "wall s" "x floor" "GB/s" "in-process s" "x floor" \
  "peak RSS per rank (max)"
printf '%-26s %8.2f %8.2f %8.2f\n' "dd + sync (I/O floor)" "$floor" 1 "$(echo "$bytes / $floor / 1000000000" | bc -l)"
for w in 1 2 4; do
  out=$(for _ in $(seq "$reps"); do
    rm -rf "$work/dst"; sync; t=$(now)
    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node="$w" dist_convert reshard "$src" \
      "$work/dst" "$@" > "$work/log" 2>&1
    sync; wall=$(echo "$(now) - $t" | bc)
    inproc=$(grep -E '^│ +[0-9]+ │' "$work/log" | awk -F'│' '{print $10}' | sort -n | tail -1 | xargs)
    rss=$(grep -E '^│ +[0-9]+ │' "$work/log" | awk -F'│' '{print $11}' | sort -h | tail -1 | xargs)
    echo "$wall $inproc $rss"
  done | sort -n | awk '{a[NR]=$0} END {print a[int((NR+1)/2)]}')
  read -r wall inproc rss <<< "$out"
  printf '%-26s %8.2f %8.2f %8.2f %12.2f %12.2f %s\n' "dist_convert, $w rank(s)" "$wall" \
    "$(echo "$wall / $floor" | bc -l)" "$(echo "$bytes / $wall / 1000000000" | bc -l)" "$inproc" \
    "$(echo "$inproc / $floor" | bc -l)" "$rss"
done
