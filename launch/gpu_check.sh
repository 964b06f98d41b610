#!/usr/bin/env bash
# The device check: one prepared run on a GPU machine (every GPU it finds, at most 8), or on CPU with --cpu.
#
# Several GPUs (N, even, at most 8):
#   1. megatron-core makes a small Llama-shaped checkpoint at TP=N (the judge's side runs on CPU: its own code)
#   2. dist_convert reshards it TP=N -> TP=2 PP=N/2 and back on N ranks (--backend nccl), the exchange as auto
#      chooses it (shared memory on one node), and once more with every peer's bytes over NCCL (--exchange nccl)
#   3. verify: the round trip is bit-exact, the middle layout equals the source, the two exchanges agree
#   4. speculate adds EAGLE-3 and Medusa at TP=2 on the GPUs; ModelOpt's restore judges each (tests/oracles/spec.py)
#   5. a table: per job the wall time, GB/s per rank, the exchange's share, peak GPU and host memory
# One GPU (the machine this project can be lent: one H200, its own python3, no network; docs/gpu.md):
#   1. megatron-core makes the checkpoint at TP=4 PP=2 (8 CPU ranks over gloo)
#   2. world 1 on the GPU with --backend nccl: TP=4 PP=2 -> TP=1 and back, and back once more with
#      --exchange nccl, which at one rank sends the rank's own bytes through the one-rank NCCL collective (pinned
#      staging, device buffers, device-to-host copies); each verified bit-exact
#   3. world 2 on the one GPU, as a user of a one-GPU box runs it: --backend auto takes gloo on CPU (NCCL refuses
#      two ranks on one device), verified; --backend nccl is refused in one line naming --nproc_per_node
#   4. speculate EAGLE-3 and Medusa on the GPU at TP=1, judged by ModelOpt's restore
#   5. throughput: bench's synthetic bf16 model (GPU_CHECK_BENCH_SIZE, default 16GB: 8B-class) TP=8 -> TP=1 on
#      the GPU against the I/O floor, its table
#   6. the table of 5 above
# usage: bash launch/gpu_check.sh [--cpu | --dry-run] [--python PY] [--out DIR]
#   --cpu      steps 1-3 and 5 of the first list on 2 CPU ranks over gloo with a smaller model (the suite runs it)
#   --dry-run  print the one-GPU mode's commands without running them (the suite checks them)
#   --python   the interpreter (default: .venv/bin/python, else a python3 that has torch, else launch/setup.sh)
#   --out      where the work and the table go (default: $OUT when set, else a temporary directory)
# On the lent machine, in one device call (docs/gpu.md): carry .whl (launch/device_wheels.sh), install the wheels
# to /tmp/site, then `bash launch/gpu_check.sh --python python3` (under 8 minutes).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
MODE=gpu PY="" DRY=0 W=${OUT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --dry-run) DRY=1 ;;
    --python) PY=$2; shift ;;
    --out) W=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (expected --cpu, --dry-run, --python PY or --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python
  elif [ "$MODE" = gpu ] && python3 -c 'import torch' 2>/dev/null; then PY=python3
  elif [ "$DRY" = 1 ]; then PY=python3
  else bash launch/setup.sh; PY=.venv/bin/python
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=ignore
W=${W:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
[ "$DRY" = 1 ] || { rm -rf "$W" && mkdir -p "$W"; }
step() { echo "+ $*" >&2; [ "$DRY" = 1 ] || "$@"; }
torchrun() { "$PY" -m torch.distributed.run --standalone "$@"; }
judge() { CUDA_VISIBLE_DEVICES="" torchrun "$@"; }  # megatron-core and ModelOpt as oracles: on CPU, over gloo

if [ "$MODE" = cpu ]; then
  N=2 BACKEND=gloo HIDDEN=128 LAYERS=4 VOCAB=1000 SRC_TP=2 SRC_PP=1
else
  N=1
  [ "$DRY" = 1 ] || N=$("$PY" -c 'import torch; print(min(8, torch.cuda.device_count()) if torch.cuda.is_available() else 0)')
  if [ "$N" -lt 1 ]; then
    echo "gpu_check.sh: $PY's torch sees no GPU (a CPU-only build or node); run it with --cpu" >&2; exit 2
  fi
  [ "$N" -gt 1 ] && N=$(( N / 2 * 2 ))
  BACKEND=nccl HIDDEN=1024 LAYERS=8 VOCAB=32000 SRC_TP=$N SRC_PP=1
  [ "$N" = 1 ] && MODE=one-gpu SRC_TP=4 SRC_PP=2
fi
echo "== gpu_check ($MODE): $N ranks, --backend $BACKEND, python $PY, work in $W"

[ "$DRY" = 1 ] || cat > "$W/config.json" <<JSON
{"num_layers": $LAYERS, "hidden_size": $HIDDEN, "ffn_hidden_size": $(( HIDDEN * 11 / 4 )),
 "num_attention_heads": 16, "num_query_groups": 8, "swiglu": true, "normalization": "RMSNorm",
 "add_bias_linear": false, "add_qkv_bias": false, "untie_embeddings_and_output_weights": true,
 "vocab_size": $VOCAB, "make_vocab_size_divisible_by": 128, "position_embedding_type": "rope",
 "max_position_embeddings": 128, "seq_length": 128}
JSON
dc() { step torchrun --nproc_per_node="$N" -m dist_convert "$@" --backend "$BACKEND"; }
# verify on the job's ranks on a GPU machine; in the CPU run one process runs all the checks (each reads both sides)
checks() {
  if [ "$MODE" != cpu ]; then
    while [ $# -gt 0 ]; do dc verify "$1" "$2"; shift 2; done
  else
    step "$PY" -c 'import sys; from dist_convert.cli import main
a = sys.argv[1:]
sys.exit(max(main(["verify", x, y]) for x, y in zip(a[::2], a[1::2])))' "$@"
  fi
}

echo "== 1. megatron-core makes the source (TP=$SRC_TP PP=$SRC_PP)"
step judge --nproc_per_node=$(( SRC_TP * SRC_PP )) tests/oracles/mcore.py make --config "$W/config.json" \
  --tp "$SRC_TP" --pp "$SRC_PP" --seed 7 --iteration 1 --out-torch-dist "$W/src" --out-megatron "$W/src_legacy" \
  >/dev/null
if [ "$MODE" = one-gpu ]; then
  MID_TP=1 MID_PP=1
else
  MID_TP=$(( N >= 4 ? 2 : 1 )) MID_PP=$(( N >= 4 ? N / 2 : 2 ))
fi
echo "== 2. reshard TP=$SRC_TP PP=$SRC_PP -> TP=$MID_TP PP=$MID_PP and back on $N rank(s)"
COLL=$([ "$MODE" = cpu ] && echo gloo || echo nccl)
dc reshard "$W/src" "$W/mid" --target-tp "$MID_TP" --target-pp "$MID_PP" --stats-json "$W/mid.json"
dc reshard "$W/mid" "$W/back" --target-tp "$SRC_TP" --target-pp "$SRC_PP" --stats-json "$W/back.json"
dc reshard "$W/mid" "$W/back_coll" --target-tp "$SRC_TP" --target-pp "$SRC_PP" --exchange "$COLL" \
  --stats-json "$W/back_coll.json"
echo "== 3. verify"
checks "$W/src" "$W/back" "$W/src" "$W/mid" "$W/back" "$W/back_coll"
if [ "$MODE" = one-gpu ]; then
  echo "== 3b. two ranks on the one GPU: --backend auto takes gloo; --backend nccl is refused in one line"
  step torchrun --nproc_per_node=2 -m dist_convert reshard "$W/src" "$W/mid2" --target-tp 1 --target-pp 2 \
    --stats-json "$W/mid2.json"
  step torchrun --nproc_per_node=2 -m dist_convert verify "$W/src" "$W/mid2"
  echo "+ torchrun --nproc_per_node=2 -m dist_convert reshard $W/src $W/refused --target-tp 1 --backend nccl" \
    "(must fail in one line: local rank 1 has no GPU of its own)" >&2
  if [ "$DRY" = 0 ] && { torchrun --nproc_per_node=2 -m dist_convert reshard "$W/src" "$W/refused" --target-tp 1 \
      --backend nccl 2>"$W/refused.log" || ! grep -q "local rank 1 has no GPU of its own" "$W/refused.log" \
      || [ -e "$W/refused" ]; }; then
    echo "gpu_check.sh: --backend nccl at 2 ranks on one GPU was not refused in one line (see $W/refused.log)" >&2
    exit 1
  fi
  if [ "$DRY" = 0 ]; then
    "$PY" -c 'import json, sys; assert [s["device"] for s in json.load(open(sys.argv[1]))] == ["cpu", "cpu"]' \
      "$W/mid2.json" || { echo "gpu_check.sh: --backend auto at 2 ranks on one GPU did not take gloo" >&2; exit 1; }
    "$PY" -c 'import json, sys; assert [s["device"] for s in json.load(open(sys.argv[1]))] == ["cuda:0"]' \
      "$W/mid.json" || { echo "gpu_check.sh: --backend nccl at 1 rank did not run on cuda:0" >&2; exit 1; }
  fi
fi
SPEC_TP=$([ "$MODE" = one-gpu ] && echo 1 || echo 2) ALGOS="eagle medusa"
[ "$MODE" = cpu ] && ALGOS=""  # speculate on CPU is tests/test_speculate.py's
[ -n "$ALGOS" ] && echo "== 4. speculate at TP=$SPEC_TP on $N rank(s)"
for algo in $ALGOS; do
  flags=(--eagle-layers 1); [ "$algo" = medusa ] && flags=(--medusa-heads 2 --medusa-layers 1)
  start=$EPOCHREALTIME
  dc speculate "$W/src" "$W/spec_$algo" --target-tp "$SPEC_TP" --target-pp 1 "${flags[@]}"
  [ "$DRY" = 1 ] || "$PY" -c "print($EPOCHREALTIME - $start)" > "$W/spec_$algo.s"
  step judge --nproc_per_node="$SPEC_TP" tests/oracles/spec.py check --config "$W/config.json" --tp "$SPEC_TP" \
    --pp 1 --algo "$algo" --ckpt "$W/spec_$algo" --ref "$W/src" >"$([ "$DRY" = 1 ] && echo /dev/null || echo "$W/spec_$algo.oracle")"
  [ "$DRY" = 1 ] || grep -q "SPEC ORACLE OK" "$W/spec_$algo.oracle"
done
if [ "$MODE" = one-gpu ]; then
  echo "== 5. throughput: a synthetic ${GPU_CHECK_BENCH_SIZE:-16GB} bf16 model, TP=8 -> TP=1 on the GPU"
  step "$PY" -m dist_convert bench --size "${GPU_CHECK_BENCH_SIZE:-16GB}" --src-tp 8 --targets 1x1 --ranks 1 \
    --reps 1 --methods floor,dist_convert --workdir "$W/bench" --json "$W/bench.json" --markdown "$W/bench.md"
fi
[ "$DRY" = 1 ] && { echo "gpu_check dry run ($MODE): the commands above"; exit 0; }
echo "== figures"
"$PY" - "$W" "$MODE" "$N" <<'PY' | tee "$W/table.md"
import json, sys
from pathlib import Path

w, mode, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
coll = "gloo" if mode == "cpu" else "nccl"
jobs = [("mid", "mid", n), ("back", "back", n), ("back_coll", f"back, --exchange {coll}", n)]
if mode == "one-gpu":
    jobs.append(("mid2", "mid, 2 ranks on one GPU (gloo)", 2))
print(f"| job ({mode}) | ranks | wall s | GB/s per rank (min-max) | exchange share | peak GPU | peak host RSS |")
print("|---|---|---|---|---|---|---|")
for name, label, ranks in jobs:
    stats = json.loads((w / f"{name}.json").read_text())
    wall = max(s["wall_s"] for s in stats)
    rates = [(s["read_bytes"] + s["written_bytes"]) / s["wall_s"] / 2**30 for s in stats if s["wall_s"] > 0]
    share = max(s.get("exchange_s", 0.0) / s["wall_s"] for s in stats if s["wall_s"] > 0)
    gpu = max(s.get("peak_gpu", 0) for s in stats) / 2**30
    rss = max(s["peak_rss"] for s in stats) / 2**30
    print(f"| reshard -> {label} | {ranks} | {wall:.2f} | {min(rates):.3g}-{max(rates):.3g} | {share:.0%} | "
          f"{gpu:.2f} GiB | {rss:.2f} GiB |")
for algo in ("eagle", "medusa") if mode != "cpu" else ():
    secs = float((w / f"spec_{algo}.s").read_text())
    verdict = "restored by ModelOpt" if "SPEC ORACLE OK" in (w / f"spec_{algo}.oracle").read_text() else "FAILED"
    print(f"| speculate {algo} | {n} | {secs:.1f} | - | - | - | {verdict} |")
if (w / "bench.md").is_file():
    print()
    print((w / "bench.md").read_text())
PY
echo "gpu_check OK ($MODE)"
