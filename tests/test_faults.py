"""Faults and bad values (issue 56): non-finite quantization scales refused on read, non-finite weights noted (and
refused by ``--quantize``), a target inside its source refused, full and read-only file systems under 2 ranks
(one line, nothing left that looks complete, repeated to catch a cleanup race), and SIGINT / SIGTERM to the
``--nproc`` launcher, its process group or one worker (exit 130, one line, the staging directory removed or kept
for ``--resume``)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gemma3 import GEMMA3

from dist_convert.config import config_from_args
from dist_convert.errors import ConvertError
from dist_convert.features import DSA, MoE, Position
from dist_convert.staging import refuse_overlap, write_error

from conftest import ENV, PY, ROOT, assert_refused, ok, run_cli
from hf_models import hf_logits, make_hf_model

TMP = ".dist_convert_tmp"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny bf16 Llama (transformers' save_pretrained)."""
    return make_hf_model(tmp_path_factory.mktemp("faults"), "llama", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def nvfp4(llama, tmp_path_factory) -> Path:
    """Its NVFP4 export (``--quantize nvfp4``: ModelOpt's W4A16_NVFP4 layout, tests/test_nvfp4.py)."""
    out = tmp_path_factory.mktemp("nvfp4") / "release"
    ok(run_cli("reshard", str(llama), str(out), "--dst-format", "hf", "--quantize", "nvfp4"))
    return out


def edited(src: Path, dst: Path, key: str, edit) -> Path:
    """A copy of the one-file checkpoint ``src`` with tensor ``key`` changed by ``edit`` (in place)."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    edit(sd[key])
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


GATE = "model.layers.0.mlp.gate_proj.weight"
PROJ = "model.layers.1.self_attn.o_proj.weight"


def _first(value: float):
    return lambda t: t.view(-1)[0].fill_(value)


# case -> (source: "llama" or "nvfp4", tensor, edit, extra flags, what the one error line names)
BAD_VALUES = {
    "NVFP4 weight_scale_2 NaN": ("nvfp4", GATE + "_scale_2", _first(float("nan")), [],
                                 [f"{GATE}_scale_2 in model.safetensors is NaN or infinite", "re-download"]),
    "NVFP4 weight_scale_2 zero": ("nvfp4", GATE + "_scale_2", _first(0.0), [],
                                  [f"{GATE}_scale_2 in model.safetensors is zero", "re-download"]),
    "NVFP4 weight_scale NaN": ("nvfp4", GATE + "_scale", lambda t: t.view(torch.uint8).view(-1)[5:7].fill_(0x7F), [],
                               [f"{GATE}_scale in model.safetensors is NaN or infinite (2 of"]),
    "NaN weight, --quantize fp8-channel": ("llama", PROJ, _first(float("nan")), ["--quantize", "fp8-channel"],
                                           [f"--quantize fp8-channel: {PROJ} holds 1 NaN and 0 infinite values",
                                            "drop --quantize"]),
    "Inf weight, --quantize nvfp4": ("llama", GATE, lambda t: t[3, :2].fill_(float("-inf")), ["--quantize", "nvfp4"],
                                     [f"--quantize nvfp4: {GATE} holds 0 NaN and 2 infinite values"]),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_are_refused_in_one_line(llama, nvfp4, tmp_path, case):
    which, key, edit, flags, needles = BAD_VALUES[case]
    src = edited({"llama": llama, "nvfp4": nvfp4}[which], tmp_path / "src", key, edit)
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst"), "--dst-format", "hf", *flags, nproc=2),
                   tmp_path, *needles)


def _nan_inf(t: torch.Tensor) -> None:
    t[0, :3] = float("nan")
    t[1, 0] = float("inf")


def test_nonfinite_weights_are_carried_with_a_note(llama, tmp_path):
    """No quantization: the values pass as they are (bit for bit, NaN included), said in one note line counted as
    they were read; verify says it of both sides and finds them equal."""
    src = edited(llama, tmp_path / "src", PROJ, _nan_inf)
    dst = tmp_path / "dst"
    proc = ok(run_cli("reshard", str(src), str(dst), "--dst-format", "torch_dist", "--target-tp", "2", nproc=2))
    notes = [line for line in proc.stderr.splitlines() if "non-finite" in line]
    assert notes == [f"note: 1 source tensors hold non-finite values, carried as they are: model.safetensors: {PROJ} "
                     "(3 NaN, 1 inf)"], proc.stderr[-2000:]
    proc = ok(run_cli("verify", str(src), str(dst), nproc=2))
    name = "decoder.layers.1.self_attention.linear_proj.weight"
    for side in "AB":
        assert f"note: {side}: 1 logical tensors hold non-finite values: {name} (3 NaN, 1 inf)" in proc.stderr
    assert "verify OK" in proc.stderr
    clean = ok(run_cli("reshard", str(llama), str(tmp_path / "clean"), "--dst-format", "torch_dist"))
    assert "non-finite" not in clean.stderr


def test_inspect_tensors_counts_nonfinite_values_per_tensor(llama, tmp_path):
    """``inspect --tensors`` reads every value once over the ranks and counts, per logical tensor, its NaN and
    infinite values (summed over its stored pieces: TP halves, an HF tensor that is part of a fused one), with
    verify's note; a checkpoint whose values are all finite gets no word of it."""
    src = edited(llama, tmp_path / "src", PROJ, _nan_inf)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.0.self_attn.k_proj.weight"][2, 5] = float("-inf")  # k rows of the fused linear_qkv
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    ok(run_cli("reshard", str(src), str(tmp_path / "tp2"), "--dst-format", "torch_dist", "--target-tp", "2", nproc=2))
    want = {"decoder.layers.1.self_attention.linear_proj.weight": (3, 1),
            "decoder.layers.0.self_attention.linear_qkv.weight": (0, 1)}
    for path in (src, tmp_path / "tp2"):
        info = json.loads(ok(run_cli("inspect", str(path), "--tensors", "--json", nproc=2)).stdout)
        assert {r["name"]: (r["nan"], r["inf"]) for r in info["tensors"] if r["nan"] or r["inf"]} == want, path
        assert "2 logical tensors hold non-finite values: decoder.layers.0.self_attention.linear_qkv.weight (0 NaN, " \
               "1 inf), decoder.layers.1.self_attention.linear_proj.weight (3 NaN, 1 inf)" in info["notes"]
    table = ok(run_cli("inspect", str(tmp_path / "tp2"), "--tensors")).stdout
    assert "non-finite" in table and "3 NaN, 1 inf" in table, table[-3000:]
    clean = ok(run_cli("inspect", str(llama), "--tensors")).stdout
    assert "non-finite" not in clean and "NaN" not in clean, clean[-3000:]


HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    """A tiny bf16 Llama with tied embeddings (save_pretrained stores no lm_head.weight for it)."""
    return make_hf_model(tmp_path_factory.mktemp("tied"), "llama", dtype=torch.bfloat16,
                         family=("LlamaConfig", {"tie_word_embeddings": True}))


def with_head(src: Path, dst: Path, head) -> Path:
    """A copy of the tied ``src`` that also stores lm_head.weight, made from the embedding by ``head``."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    sd[HEAD] = head(sd[EMBED])
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_tied_head_stored_with_other_values_is_kept_as_transformers_keeps_it(tied, tmp_path):
    """transformers ties only copies it finds equal: a stored head that differs stays the model's output layer. The
    conversion reads it so (untied), says so in one note on rank 0, and the model comes back as transformers ran it;
    a stored head equal to the embedding is the tied model, without a word."""
    src = with_head(tied, tmp_path / "src", lambda e: e * 2)
    proc = ok(run_cli("reshard", str(src), str(tmp_path / "td"), "--dst-format", "torch_dist", "--target-tp", "2",
                      nproc=2))
    said = " ".join(proc.stderr.split())  # as one line, whatever width the console wraps at
    assert said.count("note: config.json ties") == 1, proc.stderr[-3000:]
    assert (f"note: config.json ties the output layer to the embedding (tie_word_embeddings), but model.safetensors "
            f"stores {HEAD} with values that differ from {EMBED}: both are kept and the model is read untied") in said
    ok(run_cli("reshard", str(tmp_path / "td"), str(tmp_path / "hf"), "--dst-format", "hf"))
    tokens = torch.tensor([[1, 7, 42, 99, 3]])
    assert torch.equal(hf_logits(tmp_path / "hf", tokens), hf_logits(src, tokens))
    same = with_head(tied, tmp_path / "same", torch.clone)
    proc = ok(run_cli("reshard", str(same), str(tmp_path / "td_same"), "--dst-format", "torch_dist"))
    assert "tie_word_embeddings" not in proc.stderr, proc.stderr[-3000:]
    info = json.loads(ok(run_cli("inspect", str(tmp_path / "td_same"), "--json")).stdout)
    assert info["config"]["untie_embeddings_and_output_weights"] is False  # still the tied model


@pytest.mark.parametrize("where", ["dst = src", "dst inside src", "src inside dst"])
def test_target_overlapping_its_source_is_refused(llama, tmp_path, where):
    src = tmp_path / "outer" / "src" if where == "src inside dst" else tmp_path / "src"
    shutil.copytree(llama, src)
    dst = {"dst = src": src, "dst inside src": src / "dst", "src inside dst": tmp_path / "outer"}[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for flags in ([], ["--overwrite"]):
        proc = run_cli("reshard", str(src), str(dst), "--dst-format", "torch_dist", *flags)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("dist_convert: error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
        assert "--overwrite never allows this" in errors[0] and str(src) in errors[0], errors[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written or removed


def test_refuse_overlap_and_write_errors_are_pure():
    refuse_overlap(Path("/a/b"), Path("/a/bc"))  # a sibling whose name starts alike is fine
    with pytest.raises(ConvertError, match="lies inside the source"):
        refuse_overlap(Path("/a/b"), Path("/a/b/../b/c"))
    for code, needle in ((30, "writable file system"), (13, "may not write"), (28, "df -h")):
        err = write_error(OSError(code, os.strerror(code), "/x/f"), Path("/x"))
        assert str(err).startswith(f"writing /x/f failed: {os.strerror(code)}; ") and needle in str(err), str(err)


def test_the_watchdog_never_ends_the_process_while_the_line_is_being_written(monkeypatch):
    """The main thread says the interrupted line while the watchdog, about to ``os._exit``, calls ``announce`` too:
    the watchdog's call returns only once the line is out (a CI run once ended with exit 130 and no line)."""
    from dist_convert import interrupts

    said: list[str] = []
    writing = threading.Event()

    def slow_say(text: str) -> None:
        writing.set()
        time.sleep(0.3)  # a write into a full pipe
        said.append(text)

    monkeypatch.setattr(interrupts, "_state", interrupts._State(say=slow_say, signum=signal.SIGTERM))
    main = threading.Thread(target=interrupts.announce)
    main.start()
    assert writing.wait(10)
    interrupts.announce()  # the watchdog: what it would exit right after
    assert said == ["interrupted (SIGTERM); nothing written"]
    main.join()
    assert said == ["interrupted (SIGTERM); nothing written"]  # once


def test_the_error_line_starts_a_line_of_its_own_while_a_progress_bar_is_unfinished(capsys):
    """A signal can cut a progress bar's last render short, or the watchdog speak while the main thread renders it
    (a CI run once printed ``converting 0.0/149.1 kB ? -:--:--dist_convert: error: interrupted ...``): while a bar
    is shown, the one error line begins with a newline; once it finished, none is added."""
    from dist_convert.cli import _say
    from dist_convert.runtime import ProgressBar

    with ProgressBar(100, "converting", True):
        _say("interrupted (SIGINT); nothing written")
    _say("after")
    err = capsys.readouterr().err
    assert "\ndist_convert: error: interrupted (SIGINT); nothing written\n" in err
    assert err.endswith("\ndist_convert: error: after\n") and "\n\ndist_convert: error: after" not in err

# -- file-system faults: a real small tmpfs and a real read-only bind mount (root only) --------------------------
def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def mounts(tmp_path):
    """(a 96 KB tmpfs, a read-only bind mount) under tmp_path; skipped where this user may not mount. The tmpfs is
    smaller than any target file (the ranks' 113 KB and 134 KB): no file can finish, whatever order the ranks write in
    (on 200 KB, a rank that wrote while the other lagged finished its file, which the run keeps for --resume)."""
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=96k", "tmpfs", str(full)):
        pytest.skip("mounting a tmpfs needs root")
    made = [full]
    if _mount("--bind", str(ro), str(ro)):
        made.append(ro)
        if not _mount("-o", "remount,ro,bind", str(ro)):
            pytest.skip("no read-only bind mount here")
    yield full, ro
    for m in reversed(made):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


REPEATS = 4  # rank 0's clean-up once raced rank 1's journal: every run must give one line and leave nothing


def test_full_and_read_only_file_systems_fail_cleanly_every_time(llama, mounts):
    full, ro = mounts
    cases = [(full / "dst", "No space left on device", "df -h")] * REPEATS + \
            [(ro / "dst", "Read-only file system", "writable file system")] * 2
    for dst, cause, fix in cases:
        proc = run_cli("reshard", str(llama), str(dst), "--dst-format", "torch_dist", "--target-tp", "2", nproc=2)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("dist_convert: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"{dst}{TMP}" in errors[0] and cause in errors[0] and fix in errors[0], errors[0]
        assert not list(dst.parent.iterdir()), (errors[0], list(dst.parent.iterdir()))  # no DST, no staging directory


# -- interrupts: a launch of its own per case, a signal mid-run -------------------------------------------------
def _launch(args: list[str], fault: str) -> subprocess.Popen:
    env = {**ENV, "DIST_CONVERT_FAULT": fault}
    return subprocess.Popen([PY, "-m", "dist_convert", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _workers(launcher: subprocess.Popen, n: int, timeout: float = 60) -> list[int]:
    """The launcher's worker pids, rank order (their RANK variable), once they are running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        if len(kids) == n:
            ranks = {}
            for pid in kids:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                ranks[int(next(e for e in env if e.startswith(b"RANK="))[5:])] = int(pid)
            return [ranks[r] for r in range(n)]
        time.sleep(0.1)
    raise AssertionError("the workers did not start")


def _reached(path: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


# case -> (fault that holds the run, what appears when the run is held there, who gets the signal, signal, kept)
INTERRUPTS = {
    "Ctrl-C to the process group before any file": ("hang:rank=1:wave=1", "converting", "group", signal.SIGINT,
                                                    False),
    "SIGTERM to the launcher after every file": ("sleep60:rank=0:package=1", "checksums", "launcher",
                                                 signal.SIGTERM, True),
    "SIGINT to worker 1 alone": ("hang:rank=0:wave=1", "converting", "worker1", signal.SIGINT, False),
}


@pytest.mark.parametrize("case", list(INTERRUPTS))
def test_interrupt_stops_every_process_with_one_line(llama, tmp_path, case):
    fault, held, who, sig, kept = INTERRUPTS[case]
    dst, tmp = tmp_path / "dst", tmp_path / f"dst{TMP}"
    launcher = _launch(["reshard", str(llama), str(dst), "--dst-format", "torch_dist", "--target-tp", "2",
                        "--nproc", "2"], fault)
    try:
        workers = _workers(launcher, 2)
        _reached(tmp / ("dist_convert_checksums.json" if held == "checksums" else ".dist_convert_journal"))
        time.sleep(1.0)  # inside the held step
        t0 = time.monotonic()
        if who == "group":
            os.killpg(launcher.pid, sig)
        elif who == "launcher":
            launcher.send_signal(sig)
        else:
            os.kill(workers[1], sig)
        _, err = launcher.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    errors = [line for line in err.splitlines() if line.startswith("dist_convert: error:")]
    assert launcher.returncode == 130 and len(errors) == 1, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "memory" not in err, err[-3000:]
    assert errors[0].startswith("dist_convert: error: interrupted (SIG"), errors[0]
    assert took < 20, took  # seconds, not --timeout
    assert all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
               for pid in workers)
    assert not dst.exists()
    if kept:
        assert f"{tmp} kept with 2 finished target files" in errors[0] and "--resume" in errors[0], errors[0]
        ok(run_cli("reshard", str(llama), str(dst), "--dst-format", "torch_dist", "--target-tp", "2", "--resume",
                   nproc=2))
        ok(run_cli("verify", str(llama), str(dst)))
    else:
        assert f"nothing written, {tmp} removed" in errors[0], errors[0]
        assert not tmp.exists()


def with_config(src: Path, dst: Path, change) -> Path:
    """A copy of ``src`` whose config.json is ``change(config)`` (the weights as they are)."""
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(change(json.loads((src / "config.json").read_text()))))
    return dst


def _sliding(cfg: dict, window) -> dict:
    return {**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window}


def _experts(cfg: dict, experts: int, topk: int) -> dict:
    return {**cfg, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
            "num_experts_per_tok": topk}


# case -> (config.json made from the llama's, what the one error line names): values no reader gives a meaning,
# refused where config.json is read, before anything is written (the weights are the llama's: never reached)
BAD_CONFIGS = {
    "Mistral sliding_window 0": (lambda c: _sliding(c, 0),
                                 ["sliding_window = 0 in config.json has no meaning", "window the model was trained"]),
    "Gemma 3 sliding_window 0": (lambda c: {**GEMMA3, "sliding_window": 0},
                                 ["sliding_window = 0 in config.json has no meaning"]),
    "no attention heads": (lambda c: {**c, "num_attention_heads": 0},
                           ["num_attention_heads = 0 in config.json has no meaning"]),
    "no key/value heads": (lambda c: {**c, "num_key_value_heads": 0},
                           ["num_key_value_heads = 0 in config.json has no meaning"]),
    "RoPE theta 0": (lambda c: {**c, "rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
                     ["rotary_base = 0.0 has no meaning: the RoPE base (theta) must be above 0", "config.json"]),
    "MoE top-k above the experts": (lambda c: _experts(c, 4, 5),
                                    ["moe_router_topk = 5 has no meaning: experts per token must be at most "
                                     "num_experts (4)"]),
    "MoE without experts": (lambda c: _experts(c, 0, 2), ["num_experts = 0 has no meaning"]),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_config_values_without_meaning_are_refused_where_read(llama, tmp_path, case):
    change, needles = BAD_CONFIGS[case]
    src = with_config(llama, tmp_path / "src", change)
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst"), "--dst-format", "torch_dist"), tmp_path,
                   *needles)


def _moe(**kw) -> dict:
    return {"num_layers": 2, "hidden_size": 64, "num_experts": 4, **kw}


# case -> (reader of Megatron-LM args, args, args that make them mean something, what the error says): generated from
# the records' declared ranges (features.base.setting's low / above / high), checked as the record is read
BAD_ARGS = {
    "DSA top-k 0": (DSA.from_args, {"experimental_attention_variant": "dsa", "dsa_indexer_topk": 0},
                    {"dsa_indexer_topk": 4}, "dsa_indexer_topk = 0 has no meaning: .* must be at least 1"),
    "DSA top-k frequency 0": (DSA.from_args, {"experimental_attention_variant": "dsa", "dsa_indexer_topk_freq": 0},
                              {"dsa_indexer_topk_freq": 4}, "dsa_indexer_topk_freq = 0 has no meaning: .* at least 1"),
    "DSA indexer heads -1": (DSA.from_args, {"experimental_attention_variant": "dsa", "dsa_indexer_n_heads": -1},
                             {"dsa_indexer_n_heads": 4}, "dsa_indexer_n_heads = -1 has no meaning: .* at least 1"),
    "MoE top-k above the experts": (MoE.from_args, _moe(moe_router_topk=5), {"moe_router_topk": 4},
                                    r"moe_router_topk = 5 has no meaning: experts per token must be at most "
                                    r"num_experts \(4\)"),
    "MoE top-k 0": (MoE.from_args, _moe(moe_router_topk=0), {"moe_router_topk": 1},
                    "moe_router_topk = 0 .* at least 1"),
    "group top-k above the groups": (MoE.from_args, _moe(moe_router_num_groups=2, moe_router_group_topk=3),
                                     {"moe_router_group_topk": 2}, r"moe_router_group_topk = 3 .* at most "
                                                                   r"moe_router_num_groups \(2\)"),
    "RoPE base below 0": (Position.from_args, {"position_embedding_type": "rope", "rotary_base": -1.0},
                          {"rotary_base": 500000.0}, "rotary_base = -1.0 has no meaning: .* must be above 0"),
    "no attention heads": (lambda a: config_from_args(a, None, None, 1),
                           {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 0, "vocab_size": 100},
                           {"num_attention_heads": 4}, "num_attention_heads = 0 in the checkpoint args has no meaning"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_args_values_without_meaning_are_refused_where_read(case):
    read, args, fixed, pattern = BAD_ARGS[case]
    with pytest.raises(ConvertError, match=pattern):
        read(argparse.Namespace(**args))
    assert read(argparse.Namespace(**{**args, **fixed})) is not None


def test_a_window_of_zero_tokens_before_the_query_is_kept():
    """megatron-core's window_size (0, 0) has a meaning (each query sees itself alone: utils.is_layer_window_attention
    takes any tuple): carried as it is, and written to config.json as transformers' sliding_window 1, which means the
    same; config.json's sliding_window 0 has none (refused above)."""
    from dist_convert.features import Attention
    from dist_convert.models.base import hf_window

    assert Attention.from_args(argparse.Namespace(window_size=(0, 0))).window == (0, 0) == hf_window(1)


class _Payload:
    """Unpickled by plain pickle, this would create ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_code_in_a_legacy_pt_is_named_and_not_run(tmp_path):
    from dist_convert.safe_load import load_pt

    f, marker = tmp_path / "model_optim_rng.pt", tmp_path / "pwned"
    torch.save({"model": {}, "x": _Payload(marker)}, f)
    with pytest.raises(ConvertError) as e:
        load_pt(f, trust_pickle=False)
    assert str(e.value) == (f"{f} references posix.system, outside the safe allow-list (not executed); pass "
                            "--trust-pickle only if you trust this file")
    assert not marker.exists()
