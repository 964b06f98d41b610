"""``speculate`` under torchrun (gloo, no Transformer Engine): EAGLE-1, EAGLE-3 and Medusa added by
ModelOpt at the target layout, judged by megatron-core + ModelOpt restoring the checkpoint in another
process (tests/oracles/spec.py): base weights equal to the source, real draft weights, a forward
pass with draft outputs."""
from __future__ import annotations

import json

import pytest

from conftest import assert_refused, ok, oracle, run_cli


def spec_oracle(src, dst, tp: int, pp: int, algo: str, draft=None, config=None, runtime: str = "default") -> str:
    extra = ["--draft", str(draft)] if draft else []
    proc = oracle("check", tp * pp, "--config", str(config or src.config), "--tp", str(tp), "--pp", str(pp),
                  "--algo", algo, "--ckpt", str(dst), "--ref", str(src.torch_dist), *extra, program="spec", check=False,
                  runtime=runtime)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and "SPEC ORACLE OK" in proc.stdout, out
    return proc.stdout


# (source format, flags, algorithm, target tp, pp, world size or None = one process without torchrun, export).
# With --export-draft the oracle restores the checkpoint at TP=1 PP=1 (megatron-core reshards it) and
# compares the exported draft with ModelOpt's own TP=1 export (EAGLE) or the restored heads (Medusa).
# Medusa's lm_heads are saved vocab-padded and restore only where the padding is the same: padding to
# a multiple of 64 gives 128 rows at TP=1 and TP=2.
CASES = [
    ("torch_dist", ["--eagle-layers", "1"], "eagle", 2, 1, 2, True),  # EAGLE-3 (ModelOpt default) at TP=2
    ("megatron", ["--eagle-layers", "2", "--eagle-version", "1"], "eagle", 1, 2, 2, False),  # EAGLE-1, 2 stages
    ("torch_dist", ["--medusa-heads", "3", "--medusa-layers", "1", "--make-vocab-size-divisible-by", "64"], "medusa",
     1, 1, 2, True),  # data-parallel 2
    ("megatron", ["--eagle-layers", "1"], "eagle", 1, 1, None, False),  # one process, no torchrun
]


@pytest.mark.parametrize("fmt,flags,algo,tp,pp,world,export", CASES,
                         ids=["eagle3-tp2-export", "eagle1-pp2", "medusa-dp2-export", "eagle3-one-process"])
def test_speculate_restores_in_megatron_core_and_modelopt(gpt_a, tmp_path, fmt, flags, algo, tp, pp, world, export):
    dst, draft = tmp_path / "spec", tmp_path / "draft"
    proc = ok(run_cli("speculate", str(getattr(gpt_a, fmt)), str(dst), "--target-tp", str(tp), "--target-pp", str(pp),
                      *flags, *(["--export-draft", str(draft)] if export else []), nproc=world))
    assert "modelopt_state" in proc.stderr and "peak RSS" in proc.stderr
    assert (dst / "iter_0000100" / "modelopt_state").is_dir() and not list(tmp_path.glob("*.dist_convert_tmp"))
    if export:
        config = tmp_path / "oracle.json"
        flag = "--make-vocab-size-divisible-by"
        divisor = int(flags[flags.index(flag) + 1]) if flag in flags else gpt_a.cfg["make_vocab_size_divisible_by"]
        config.write_text(json.dumps({**gpt_a.cfg, "make_vocab_size_divisible_by": divisor}))
        report = spec_oracle(gpt_a, dst, 1, 1, algo, draft, config)
        assert "exported draft" in report
        config = json.loads((draft / "config.json").read_text())
        assert (config.get("medusa") or {}).get("num_medusa_heads") == 3 if algo == "medusa" else \
            config["architectures"] == ["LlamaForCausalLMEagle3"]
    else:
        report = spec_oracle(gpt_a, dst, tp, pp, algo)
    if pp == 1 or export:
        assert "draft tokens" in report


def test_speculate_bad_input(gpt_a, tmp_path):
    src = str(gpt_a.torch_dist)
    dst = str(tmp_path / "dst")
    assert_refused(run_cli("speculate", src, dst, "--target-tp", "1", "--eagle-layers", "1", "--medusa-heads", "2"),
                   tmp_path, "both --eagle-layers and --medusa-heads")
    assert_refused(run_cli("speculate", src, dst, "--target-tp", "1"), tmp_path, "--eagle-layers", "--medusa-heads")
    assert_refused(run_cli("speculate", src, dst, "--target-tp", "1", "--target-pp", "4", "--medusa-heads", "2",
                           nproc=2), tmp_path,
                   "world size 2 is not a multiple of target TP x PP = 4", "--nproc_per_node")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"algorithm": "lookahead", "config": {}}))
    assert_refused(run_cli("speculate", src, dst, "--target-tp", "1", "--spec-config", str(bad)), tmp_path,
                   "--spec-config")


def test_already_speculative_source_is_refused(gpt_a, tmp_path):
    first = tmp_path / "medusa"
    ok(run_cli("speculate", str(gpt_a.torch_dist), str(first), "--target-tp", "1", "--target-pp", "1",
               "--medusa-heads", "1"))
    assert_refused(run_cli("speculate", str(first), str(tmp_path / "dst"), "--eagle-layers", "1"), tmp_path,
                   "already a speculative model (medusa", "base checkpoint")
    assert_refused(run_cli("reshard", str(first), str(tmp_path / "dst"), "--target-tp", "2"), tmp_path,
                   "is a ModelOpt checkpoint", "restore it with megatron-core + ModelOpt")
