#!/usr/bin/env bash
# The device check: one prepared run on a GPU node (every GPU it finds, at most 8), or on CPU with --cpu.
#   1. megatron-core makes a small Llama-shaped checkpoint at TP=N (the judge's side runs on CPU: its own code)
#   2. dist_convert reshards it TP=N -> TP=2 PP=N/2 and back on N ranks (--backend nccl; gloo on CPU), the
#      exchange as auto chooses it (shared memory on one node), and once more with every byte over the
#      collective (--exchange nccl; gloo on CPU)
#   3. verify: the round trip is bit-exact, the middle layout equals the source tensor for tensor, and the two
#      exchanges wrote the same tensors
#   4. speculate adds EAGLE-3 and Medusa at TP=2 (data-parallel N/2) on the ranks' devices; ModelOpt's restore
#      in a process of its own judges each (tests/oracles/spec.py)
#   5. a table: per job the wall time, GB/s per rank, the exchange's share of the wall time, peak GPU and host
#      memory
# usage: bash launch/gpu_check.sh [--cpu] [--out DIR]     (under 5 minutes on one 8-GPU node)
# --cpu: steps 1-3 and 5 on 2 CPU ranks over gloo with a smaller model, the verifies in one process (the suite runs
#        it; speculate on CPU is judged by tests/test_speculate.py with the same flags)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODE=gpu OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --out) OUT=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (expected --cpu or --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
[ -x .venv/bin/python ] || bash launch/setup.sh
PY=.venv/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=ignore
W=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
rm -rf "$W" && mkdir -p "$W"
torchrun() { "$PY" -m torch.distributed.run --standalone "$@"; }
judge() { CUDA_VISIBLE_DEVICES="" torchrun "$@"; }  # megatron-core and ModelOpt as oracles: on CPU, over gloo

if [ "$MODE" = gpu ]; then
  N=$("$PY" -c 'import torch; print(min(8, torch.cuda.device_count()) if torch.cuda.is_available() else 0)')
  if [ "$N" -lt 2 ]; then
    echo "gpu_check.sh: this torch sees $N GPUs; the check needs 2 or more (or run it with --cpu)" >&2; exit 2
  fi
  N=$(( N / 2 * 2 )) BACKEND=nccl HIDDEN=1024 LAYERS=8 VOCAB=32000
else
  N=2 BACKEND=gloo HIDDEN=128 LAYERS=4 VOCAB=1000
fi
TP2=$(( N >= 4 ? 2 : 1 )) PP2=$(( N >= 4 ? N / 2 : 2 ))
echo "== gpu_check ($MODE): $N ranks, --backend $BACKEND, work in $W"

cat > "$W/config.json" <<JSON
{"num_layers": $LAYERS, "hidden_size": $HIDDEN, "ffn_hidden_size": $(( HIDDEN * 11 / 4 )),
 "num_attention_heads": 16, "num_query_groups": 8, "swiglu": true, "normalization": "RMSNorm",
 "add_bias_linear": false, "add_qkv_bias": false, "untie_embeddings_and_output_weights": true,
 "vocab_size": $VOCAB, "make_vocab_size_divisible_by": 128, "position_embedding_type": "rope",
 "max_position_embeddings": 128, "seq_length": 128}
JSON
step() { echo "+ $*" >&2; "$@"; }
dc() { step torchrun --nproc_per_node="$N" -m dist_convert "$@" --backend "$BACKEND"; }
# verify on every rank on a GPU node; in the CPU dry run one process runs all three checks (each reads both
# sides), two launches less
checks() {
  if [ "$MODE" = gpu ]; then
    while [ $# -gt 0 ]; do dc verify "$1" "$2"; shift 2; done
  else
    step "$PY" -c 'import sys; from dist_convert.cli import main
a = sys.argv[1:]
sys.exit(max(main(["verify", x, y]) for x, y in zip(a[::2], a[1::2])))' "$@"
  fi
}

echo "== 1. megatron-core makes the source (TP=$N)"
step judge --nproc_per_node="$N" tests/oracles/mcore.py make --config "$W/config.json" --tp "$N" --pp 1 --seed 7 \
  --iteration 1 --out-torch-dist "$W/src" --out-megatron "$W/src_legacy" >/dev/null
echo "== 2. reshard TP=$N -> TP=$TP2 PP=$PP2 and back"
dc reshard "$W/src" "$W/mid" --target-tp "$TP2" --target-pp "$PP2" --stats-json "$W/mid.json"
dc reshard "$W/mid" "$W/back" --target-tp "$N" --target-pp 1 --stats-json "$W/back.json"
dc reshard "$W/mid" "$W/back_coll" --target-tp "$N" --target-pp 1 --exchange "$BACKEND" \
  --stats-json "$W/back_coll.json"
echo "== 3. verify"
checks "$W/src" "$W/back" "$W/src" "$W/mid" "$W/back" "$W/back_coll"
SPEC_TP=2 ALGOS="eagle medusa"
[ "$MODE" = cpu ] && ALGOS=""  # the suite's dry run: speculate on CPU is tests/test_speculate.py's
[ -n "$ALGOS" ] && echo "== 4. speculate at TP=2 on $N ranks"
for algo in $ALGOS; do
  flags=(--eagle-layers 1); [ "$algo" = medusa ] && flags=(--medusa-heads 2 --medusa-layers 1)
  start=$EPOCHREALTIME
  dc speculate "$W/src" "$W/spec_$algo" --target-tp "$SPEC_TP" --target-pp 1 "${flags[@]}"
  "$PY" -c "print($EPOCHREALTIME - $start)" > "$W/spec_$algo.s"
  step judge --nproc_per_node="$SPEC_TP" tests/oracles/spec.py check --config "$W/config.json" --tp "$SPEC_TP" --pp 1 \
    --algo "$algo" --ckpt "$W/spec_$algo" --ref "$W/src" | tee "$W/spec_$algo.oracle" | grep "SPEC ORACLE OK"
done
echo "== 5. figures"
"$PY" - "$W" "$MODE" "$N" <<'PY'
import json, sys
from pathlib import Path

w, mode, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
print(f"| job ({mode}, {n} ranks) | wall s | GB/s per rank (min-max) | exchange share | peak GPU | peak host RSS |")
print("|---|---|---|---|---|---|")
coll = "nccl" if mode == "gpu" else "gloo"
for name, label in (("mid", "mid"), ("back", "back"), ("back_coll", f"back, --exchange {coll}")):
    stats = json.loads((w / f"{name}.json").read_text())
    wall = max(s["wall_s"] for s in stats)
    rates = [(s["read_bytes"] + s["written_bytes"]) / s["wall_s"] / 2**30 for s in stats if s["wall_s"] > 0]
    share = max(s.get("exchange_s", 0.0) / s["wall_s"] for s in stats if s["wall_s"] > 0)
    gpu = max(s.get("peak_gpu", 0) for s in stats) / 2**30
    rss = max(s["peak_rss"] for s in stats) / 2**30
    print(f"| reshard -> {label} | {wall:.2f} | {min(rates):.3g}-{max(rates):.3g} | {share:.0%} | {gpu:.2f} GiB | "
          f"{rss:.2f} GiB |")
for algo in ("eagle", "medusa") if mode == "gpu" else ():
    secs = float((w / f"spec_{algo}.s").read_text())
    verdict = "restored by ModelOpt" if "SPEC ORACLE OK" in (w / f"spec_{algo}.oracle").read_text() else "FAILED"
    print(f"| speculate {algo} | {secs:.1f} | - | - | - | {verdict} |")
PY
echo "gpu_check OK ($MODE)"
