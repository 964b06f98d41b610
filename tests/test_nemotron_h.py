"""Nemotron-H / Nemotron-3 (``NemotronHForCausalLM``, dist_convert/models/nemotron_h.py): a hybrid stack of Mamba2,
attention, squared-ReLU MLP and MoE layers, converted under torchrun and judged by code nobody here wrote.

transformers makes a tiny random model (tests/oracles/nemotron_h.py: every tensor random, d_inner != hidden, 2 Mamba
groups, a router correction bias); Megatron-Bridge 0.6.2 imports it at TP 1 on megatron-core 0.19.2 (the names'
truth), and megatron-core's own ``dist_checkpointing`` reshards that import to TP 2 / PP 2: every rank's tensors of
dist_convert's targets must equal those, loaded strictly (torch_dist: no missing or unexpected key or object;
legacy: each rank's own file), and megatron-core's HybridModel gives transformers' logits within 1e-4 (the CPU has
no Mamba kernels: the oracle stands in for mamba_ssm's scan and gated norm with the same math in plain torch, every
projection, split, conv and gate stays megatron-core's). Back to HF: bit-exact, a clean ``from_pretrained``, the
same config. A defect megatron-core's own loader accepts (B and C swapped) must fail the judge.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ok, oracle, run_cli


def nemotron(cmd: str, *args: str, nproc: int = 1, check: bool = True):
    return oracle(cmd, nproc, *args, program="nemotron_h", runtime="mcore19", check=check)


def verdicts(proc) -> dict[str, dict]:
    """The judge's JSON line per checkpoint, by the checkpoint's directory name."""
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {Path(v["ckpt"]).name: v for v in lines if "ckpt" in v}


# target name -> (flags, source name); conversions run in this order, each from the HF model or an earlier target.
# Legacy targets are written for megatron-core 0.19 (--mcore-style 0.19: its Mamba conv1d_weight names), the judge's.
# The vocabulary stays unpadded (300 rows, as Bridge imports it; padding is every family's and tested elsewhere).
UNPADDED = ["--make-vocab-size-divisible-by", "1"]
TARGETS = {
    "td_tp2": (["--dst-format", "torch_dist", "--target-tp", "2", *UNPADDED], "hf"),
    "legacy_tp2": (["--dst-format", "megatron", "--target-tp", "2", "--mcore-style", "0.19", *UNPADDED], "hf"),
    "td_pp2": (["--dst-format", "torch_dist", "--target-tp", "1", "--target-pp", "2",
                "--target-num-layers-in-first-stage", "2", *UNPADDED], "hf"),  # M* | -EM-
    "legacy_pp2": (["--dst-format", "megatron", "--target-tp", "1", "--target-pp", "2", "--mcore-style", "0.19"],
                   "td_tp2"),
    "td_tp1": (["--dst-format", "torch_dist", "--target-tp", "1"], "td_tp2"),  # megatron -> megatron
    "bridge_tp2": (["--dst-format", "bridge", "--target-tp", "2", "--target-pp", "1"], "td_pp2"),  # Bridge: hybrid
    "bridge_carried": (["--dst-format", "bridge", "--target-tp", "2"], "truth"),  # Bridge's own import, resharded
    "hf_back": (["--dst-format", "hf"], "td_tp2"),
    "hf_back_legacy": (["--dst-format", "hf"], "legacy_pp2"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nemotron_h")
    nemotron("make", str(root / "hf"))
    nemotron("bridge-import", str(root / "hf"), str(root / "truth"))
    for name, (flags, src) in TARGETS.items():
        ok(run_cli("reshard", str(root / src), str(root / name), *flags, nproc=2))
    nemotron("mutate", str(root / "truth"), str(root / "mutated_swap_B_C"), "--hf", str(root / "hf"),
             "--kind", "swap_B_C")
    return root


def test_megatron_targets_judged_by_megatron_core(converted):
    """At TP 2 (world 2): the TP2 torch_dist and legacy targets, the TP1 PP2 torch_dist target and the TP1 one made
    from the TP2 one load strictly and equal megatron-core's own reshard of Bridge's import, with transformers'
    logits; so do the Megatron-Bridge targets (TP1 PP2 -> TP2; Bridge's own import resharded, its run_config.yaml
    carried), built by Bridge from their run_config.yaml (HybridModelProvider); the mutated import fails. At TP 1
    PP 2: the legacy PP2 target's rank files load into their stages."""
    root, hf, truth = converted, str(converted / "hf"), str(converted / "truth")
    names = ["td_tp2", "legacy_tp2", "td_pp2", "td_tp1", "bridge_tp2", "bridge_carried", "mutated_swap_B_C"]
    bridges = [str(root / n) for n in names if n.startswith("bridge")]
    proc = nemotron("judge", "--truth", truth, "--hf", hf, "--tp", "2", *(str(root / n) for n in names),
                    "--built-from-run-config", *bridges, nproc=2, check=False)
    got = verdicts(proc)
    assert set(got) == set(names), proc.stdout[-3000:] + proc.stderr[-3000:]
    for n in names[:-1]:
        assert got[n]["ok"] and got[n]["loaded_tensors"] > 0, got[n]
        assert got[n]["logits_max_abs_diff_vs_hf"] < 1e-4, got[n]
    assert (got["td_tp2"]["stored_tp"], got["td_pp2"]["stored_pp"], got["td_tp1"]["stored_tp"]) == (2, 2, 1)
    for n in bridges:  # built by Megatron-Bridge from its run_config.yaml: provider, stack spec, pattern
        bridge = got[Path(n).name]
        assert (bridge["provider"], bridge["mcore_stack"], bridge["pattern"]) == ("HybridModelProvider", True,
                                                                                 "M*-EM-"), bridge
    import yaml

    carried = yaml.safe_load(next((root / "bridge_carried").glob("iter_*/run_config.yaml")).read_text())["model"]
    assert (carried["mamba_chunk_size"], carried["tensor_model_parallel_size"]) == (8, 2)  # Bridge's own, kept
    assert not got["mutated_swap_B_C"]["ok"] and proc.returncode != 0  # the judge can fail
    proc = nemotron("judge", "--truth", truth, "--hf", hf, "--tp", "1", "--pp", "2", str(root / "legacy_pp2"),
                    nproc=2, check=False)
    got = verdicts(proc)
    assert proc.returncode == 0 and got["legacy_pp2"]["ok"] and got["legacy_pp2"]["stored_pp"] == 2, \
        proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("back", ["hf_back", "hf_back_legacy"])
def test_back_to_hf_is_bit_exact(converted, back):
    from safetensors.torch import load_file

    hf, out = converted / "hf", converted / back
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    src, dst = json.loads((hf / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert {k: dst.get(k) for k in src if k != "transformers_version"} == \
        {k: v for k, v in src.items() if k != "transformers_version"}
    if back == "hf_back":
        import transformers

        model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_refused_in_one_line(converted, tmp_path):
    """TP 4 does not divide the Mamba groups (2); an fsdp_dtensor target of a hybrid model is refused."""
    from conftest import assert_refused

    assert_refused(run_cli("reshard", str(converted / "hf"), str(tmp_path / "dst"), "--dst-format", "torch_dist",
                           "--target-tp", "4", nproc=1), tmp_path, "does not divide mamba_num_groups=2", "--target-tp")
    dst = tmp_path / "dst"
    shutil.rmtree(dst, ignore_errors=True)
    assert_refused(run_cli("reshard", str(converted / "td_tp2"), str(dst), "--dst-format", "fsdp_dtensor", nproc=1),
                   tmp_path, "hybrid", "--dst-format")
