"""Independent test oracle for megatron-core T5 (encoder-decoder) checkpoints, at PP=1.

Uses only megatron-core (never the dist_convert package) and the GPT oracle's megatron-core helpers:
  make     build a T5Model at TP=T (local layer specs, with final layernorms), seed it, and save it
           as torch_dist (dist_checkpointing.save) and/or legacy mp_rank_TT/model_optim_rng.pt
  compare  strictly load a checkpoint and a reference into T5Models at TP=T and compare every tensor
  logits   full-vocabulary logits of a fixed encoder/decoder batch (gathered over TP)

  torchrun --nproc_per_node=T tests/oracles/t5.py make --config C.json --tp T --seed S --iteration I \
      [--out-torch-dist D1] [--out-megatron D2]
  torchrun --nproc_per_node=T tests/oracles/t5.py compare --config C.json --tp T --ckpt X --ref R [--check-args]
  torchrun --nproc_per_node=T tests/oracles/t5.py logits --config C.json --tp T --ckpt X --out F.pt

megatron-core 0.16.1 builds T5 only without pipeline parallelism (its parallel state has no encoder /
decoder split), so PP layouts are checked by converting them back to PP=1 and comparing here.
Config JSON: the GPT oracle's keys plus encoder_num_layers, decoder_num_layers, and
position_embedding_type "learned_absolute" | "relative" | "rope" (relative_attention_num_buckets).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from oracles import mcore as mo
from oracles.common import run_program


def load_config(path):
    cfg = mo.load_config(path)
    cfg.setdefault("encoder_num_layers", cfg["num_layers"])
    cfg.setdefault("decoder_num_layers", cfg["num_layers"])
    cfg.setdefault("relative_attention_num_buckets", 32)
    return cfg


def build_t5(cfg, tp, parallel_output=True):
    import torch
    import torch.nn.functional as F
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec, encoder_model_with_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def config(n):
        return TransformerConfig(
            num_layers=n, hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["ffn_hidden_size"],
            num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_query_groups"],
            kv_channels=cfg["kv_channels"], normalization=cfg["normalization"], layernorm_epsilon=cfg["norm_epsilon"],
            add_bias_linear=cfg["add_bias_linear"], add_qkv_bias=cfg["add_qkv_bias"],
            gated_linear_unit=cfg["swiglu"], activation_func=F.silu if cfg["swiglu"] else F.gelu,
            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
            params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=True)

    ne, nd = cfg["encoder_num_layers"], cfg["decoder_num_layers"]
    # megatron-core's get_t5_*_local_block_spec name TENorm as the final norm (None without TE);
    # T5 models have one, so the blocks here use the local norm megatron-core falls back to.
    enc = TransformerBlockSubmodules([encoder_model_with_local_spec()] * ne, layer_norm=WrappedTorchNorm)
    dec = TransformerBlockSubmodules([decoder_model_with_local_spec()] * nd, layer_norm=WrappedTorchNorm)
    return T5Model(
        config=config(nd), encoder_config=config(ne), transformer_encoder_layer_spec=enc,
        transformer_decoder_layer_spec=dec, vocab_size=mo.padded_vocab(cfg, tp),
        max_sequence_length=cfg["max_position_embeddings"], parallel_output=parallel_output,
        share_embeddings_and_output_weights=not cfg["untie_embeddings_and_output_weights"],
        position_embedding_type=cfg["position_embedding_type"],
        relative_attention_num_buckets=cfg["relative_attention_num_buckets"])


def make_args(cfg, tp, iteration, ckpt_format):
    args = mo.make_args(cfg, tp, 1, None, None, iteration, ckpt_format)
    # Megatron-LM's T5 arguments: num_layers is the default of both stacks
    args.num_layers = cfg["encoder_num_layers"]
    return args


def cmd_make(a, cfg):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    model = build_t5(cfg, a.tp)
    mo.randomize(model, cfg, a.seed)
    it, rank = a.iteration, dist.get_rank()
    if a.out_torch_dist:
        d = os.path.join(a.out_torch_dist, mo.iter_dir_name(it))
        os.makedirs(d, exist_ok=True)
        dist.barrier()
        state = {"model": model.sharded_state_dict(), "args": make_args(cfg, a.tp, it, "torch_dist"),
                 "iteration": it, "checkpoint_version": 3.0}
        dist_checkpointing.save(state, d)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(a.out_torch_dist, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(it))
    if a.out_megatron:
        d = os.path.join(a.out_megatron, mo.iter_dir_name(it))
        f = mo.legacy_rank_file(d, parallel_state.get_tensor_model_parallel_rank(), 0, 1)
        os.makedirs(os.path.dirname(f), exist_ok=True)
        torch.save({"model": model.state_dict(), "args": make_args(cfg, a.tp, it, "torch"),
                    "checkpoint_version": 3.0, "iteration": it}, f)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(a.out_megatron, "latest_checkpointed_iteration.txt"), "w") as fh:
                fh.write(str(it))
    if rank == 0:
        print(f"ORACLE MADE t5 tp={a.tp} padded_vocab={mo.padded_vocab(cfg, a.tp)}", flush=True)
    return 0


def check_args(ck_args, cfg, tp):
    if ck_args is None:
        return ["checkpoint has no args"]
    want = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1,
            "padded_vocab_size": mo.padded_vocab(cfg, tp), "encoder_num_layers": cfg["encoder_num_layers"],
            "decoder_num_layers": cfg["decoder_num_layers"]}
    for k in ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "normalization", "add_bias_linear", "untie_embeddings_and_output_weights", "position_embedding_type"):
        want[k] = cfg[k]
    return [f"args.{k}={getattr(ck_args, k, '<absent>')!r} expected {v!r}" for k, v in want.items()
            if getattr(ck_args, k, "<absent>") != v]


def cmd_compare(a, cfg):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    ck, ref = build_t5(cfg, a.tp), build_t5(cfg, a.tp)
    mo.randomize(ck, cfg, 1_000_003)  # different contents before loading: nothing compares equal by accident
    mo.randomize(ref, cfg, 2_000_003)
    _, fmt_ck, ck_args = mo.load_chunks([ck], a.ckpt, "auto", 1, None)
    _, fmt_ref, _ = mo.load_chunks([ref], a.ref, "auto", 1, None)
    bad = [f"ARGS {p}" for p in check_args(ck_args, cfg, a.tp)] if a.check_args else []
    if a.check_args and fmt_ck == "torch_dist":
        md = dist_checkpointing.load_tensors_metadata(mo.resolve_iter_dir(a.ckpt))
        rows = md["embedding.word_embeddings.weight"].global_shape[0]
        if rows != mo.padded_vocab(cfg, a.tp):
            bad.append(f"SHAPE word embeddings have {rows} rows, padded vocab is {mo.padded_vocab(cfg, a.tp)}")
    nrows = mo.vocab_rows(cfg, a.tp, parallel_state.get_tensor_model_parallel_rank())
    sd_ck, sd_ref = ck.state_dict(), ref.state_dict()
    if set(sd_ck) != set(sd_ref):
        bad.append(f"KEYS differ: {sorted(set(sd_ck) ^ set(sd_ref))}")
    n = 0
    for k in sorted(set(sd_ck) & set(sd_ref)):
        x, y = sd_ck[k], sd_ref[k]
        if not isinstance(x, torch.Tensor) or k.endswith("_extra_state"):
            continue
        if "word_embeddings" in k or "output_layer" in k:
            x, y = x[:nrows], y[:nrows]
        n += 1
        if x.shape != y.shape or not torch.equal(x, y):
            bad.append(f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}" if x.shape != y.shape else
                       f"{k}: max abs diff {(x.double() - y.double()).abs().max().item():.6g}")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ([f"MISMATCH rank={dist.get_rank()} {b}" for b in bad], n))
    if dist.get_rank() == 0:
        lines = [ln for g in gathered for ln in g[0]]
        print("\n".join(lines + [f"ORACLE FAIL {len(lines)} mismatches" if lines else
                                 f"ORACLE OK {sum(g[1] for g in gathered)} tensors (ckpt={fmt_ck}, ref={fmt_ref})"]),
              flush=True)
    return 1 if any(g[0] for g in gathered) else 0


def cmd_logits(a, cfg):
    import torch
    import torch.distributed as dist

    model = build_t5(cfg, a.tp, parallel_output=False)
    mo.randomize(model, cfg, 3_000_017)
    mo.load_chunks([model], a.ckpt, "auto", 1, None)
    model.eval()
    g = torch.Generator().manual_seed(1234)
    b, se, sd = 2, 12, 8
    enc = torch.randint(0, cfg["vocab_size"], (b, se), generator=g)
    dec = torch.randint(0, cfg["vocab_size"], (b, sd), generator=g)
    # boolean masks [b, 1, sq, sk], True = masked: full encoder and cross attention, causal decoder
    causal = torch.triu(torch.ones(sd, sd, dtype=torch.bool), diagonal=1).expand(b, 1, sd, sd)
    with torch.no_grad():
        logits = model(enc, dec, torch.zeros(b, 1, se, se, dtype=torch.bool), causal,
                       torch.zeros(b, 1, sd, se, dtype=torch.bool))
    logits = logits[..., : cfg["vocab_size"]].contiguous()
    if dist.get_rank() == 0:
        torch.save({"logits": logits}, a.out)
        print(f"ORACLE LOGITS {tuple(logits.shape)} std={logits.std().item():.3f} -> {a.out}", flush=True)
    return 0


def main(argv=None, serving=False):
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("make", "compare", "logits"):
        sp = sub.add_parser(name)
        sp.add_argument("--config", required=True)
        sp.add_argument("--tp", type=int, required=True)
        if name == "make":
            sp.add_argument("--seed", type=int, required=True)
            sp.add_argument("--iteration", type=int, required=True)
            sp.add_argument("--out-torch-dist", default=None)
            sp.add_argument("--out-megatron", default=None)
        else:
            sp.add_argument("--ckpt", required=True)
        if name == "compare":
            sp.add_argument("--ref", required=True)
            sp.add_argument("--check-args", action="store_true")
        if name == "logits":
            sp.add_argument("--out", required=True)
    a = p.parse_args(argv)
    mo.apply_cpu_shims()
    import torch.distributed as dist

    cfg = load_config(a.config)
    mo.init_parallel(a.tp, 1)
    try:
        rc = {"make": cmd_make, "compare": cmd_compare, "logits": cmd_logits}[a.cmd](a, cfg)
        dist.barrier()
    finally:
        mo.end_parallel(serving)
    return rc


if __name__ == "__main__":
    run_program(main)
