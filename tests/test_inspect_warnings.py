"""``inspect`` of a Megatron checkpoint says the warnings a conversion to its format says (``readers.reader_warnings``:
a reader of that format, Megatron-LM's model builder from the args, that builds another model), in the same lines;
an HF checkpoint, read by transformers, gets none."""
from __future__ import annotations

import json

import hf_models as hm
from conftest import ok, run_cli


def said(stderr: str) -> str:
    return " ".join(stderr.split())  # as one line, whatever width the console wraps at


def test_inspect_of_a_megatron_checkpoint_says_the_reader_warnings(tmp_path):
    src = hm.make_hf_model(tmp_path, "llama32")  # Llama-3 RoPE scaling, factor 32: Megatron-LM's builder runs 8
    for fmt in ("torch_dist", "megatron"):
        dst = tmp_path / fmt
        convert = said(ok(run_cli("reshard", str(src), str(dst), "--dst-format", fmt)).stderr)
        warnings = json.loads(ok(run_cli("inspect", str(dst), "--json")).stdout)["warnings"]
        assert len(warnings) == 1 and "rope_scaling_factor=32.0" in warnings[0], warnings
        line = f"warning: {warnings[0]}"
        assert line in convert  # the line the conversion said
        text = ok(run_cli("inspect", str(dst)))
        assert said(text.stderr).count("warning:") == 1 and line in said(text.stderr), text.stderr[-3000:]
    proc = ok(run_cli("inspect", str(src)))
    assert "warning:" not in proc.stderr and json.loads(ok(run_cli("inspect", str(src), "--json")).stdout)[
        "warnings"] == [], proc.stderr[-3000:]
