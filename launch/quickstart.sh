#!/usr/bin/env bash
# Set up (if needed), make a small demo GPT checkpoint with megatron-core, reshard it with torchrun,
# and verify the result: by dist_convert's own comparison and by megatron-core loading it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=ignore
PY=.venv/bin/python
DEMO=${DEMO_DIR:-demo}
rm -rf "$DEMO" && mkdir -p "$DEMO"
run() { echo "+ $*" >&2; "$@"; }
torchrun() { "$PY" -m torch.distributed.run --standalone "$@"; }

cat > "$DEMO/config.json" <<'JSON'
{"num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 352, "num_attention_heads": 8, "num_query_groups": 2,
 "swiglu": true, "normalization": "RMSNorm", "add_bias_linear": false, "add_qkv_bias": false,
 "untie_embeddings_and_output_weights": true, "vocab_size": 1000, "make_vocab_size_divisible_by": 128,
 "position_embedding_type": "rope", "max_position_embeddings": 128, "seq_length": 128}
JSON

echo "== 1. a demo Llama-style GPT checkpoint at TP=2 PP=2, saved by megatron-core in both formats"
run torchrun --nproc_per_node=4 tests/oracles/mcore.py make --config "$DEMO/config.json" --tp 2 --pp 2 \
    --seed 0 --iteration 100 --out-torch-dist "$DEMO/src_torch_dist" --out-megatron "$DEMO/src_megatron" >/dev/null
run "$PY" -m dist_convert inspect "$DEMO/src_torch_dist"

echo "== 2. reshard with torchrun: TP=2 PP=2 -> TP=1 PP=4 (torch_dist) and -> TP=2 PP=1 (legacy megatron)"
run torchrun --nproc_per_node=2 dist_convert reshard "$DEMO/src_torch_dist" "$DEMO/tp1_pp4" --target-tp 1 --target-pp 4
run torchrun --nproc_per_node=2 dist_convert reshard "$DEMO/src_torch_dist" "$DEMO/tp2_pp1_megatron" \
    --target-tp 2 --target-pp 1 --dst-format megatron

echo "== 3. verify: every logical tensor equal, and megatron-core loads each output at its layout"
run torchrun --nproc_per_node=2 dist_convert verify "$DEMO/src_megatron" "$DEMO/tp1_pp4"
run torchrun --nproc_per_node=2 dist_convert verify "$DEMO/tp1_pp4" "$DEMO/tp2_pp1_megatron"
run torchrun --nproc_per_node=4 tests/oracles/mcore.py compare --config "$DEMO/config.json" --tp 1 --pp 4 \
    --ckpt "$DEMO/tp1_pp4" --ref "$DEMO/src_torch_dist"
run torchrun --nproc_per_node=2 tests/oracles/mcore.py compare --config "$DEMO/config.json" --tp 2 --pp 1 \
    --ckpt "$DEMO/tp2_pp1_megatron" --ref "$DEMO/src_torch_dist"

echo "== 4. export to Hugging Face safetensors, import it back at TP=2, verify both"
run torchrun --nproc_per_node=2 dist_convert reshard "$DEMO/tp1_pp4" "$DEMO/hf" --dst-format hf
run torchrun --nproc_per_node=2 dist_convert reshard "$DEMO/hf" "$DEMO/from_hf_tp2" --target-tp 2 \
    --dst-format torch_dist --target-spec local
run torchrun --nproc_per_node=2 dist_convert verify "$DEMO/hf" "$DEMO/src_megatron"
run torchrun --nproc_per_node=2 dist_convert verify "$DEMO/from_hf_tp2" "$DEMO/src_torch_dist"
echo "quickstart OK: outputs in $DEMO/"
