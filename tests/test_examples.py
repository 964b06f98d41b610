"""The docs' runnable examples, run: every ```bash block of README.md and docs/**/*.md whose fence follows a
``<!-- runnable -->`` line. The blocks of a page run in order in one fresh workspace holding two tiny checkpoints,
so a renamed flag or a changed default breaks the suite, not a reader:

* ``llama-tp2/``: a Llama-style GPT (4 layers, hidden 64, 8 heads, 4 query groups, SwiGLU, RMSNorm, RoPE, untied)
  saved by megatron-core 0.16.1 as torch_dist at TP=2 PP=1, iteration 100 (tests/oracles/mcore.py);
* ``llama-hf/``: a Hugging Face Llama of the same shape, saved by transformers.

``dist_convert ...``, ``python -m dist_convert ...`` and ``torchrun --nproc_per_node=N dist_convert ...`` run in
the session's CLI workers in that workspace (N capped at 2: the layouts a command writes do not depend on the
ranks that write them); any other command runs in bash there. Every command must exit 0."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ENV, ROOT, WORKERS, oracle
from hf_models import make_hf_model

MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^<!-- runnable -->\n```bash\n(.*?)^```", re.M | re.S)
LLAMA = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 8, "num_query_groups": 4,
         "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False, "add_qkv_bias": False,
         "untie_embeddings_and_output_weights": True, "vocab_size": 100, "make_vocab_size_divisible_by": 16,
         "position_embedding_type": "rope", "max_position_embeddings": 32, "seq_length": 32}
MAX_RANKS = 2
VENV_BIN = Path(sys.executable).parent  # python, dist_convert


MARKER_LINE = re.compile(rf"^{re.escape(MARKER)}$", re.M)  # a line of its own (prose may name the marker)


def pages() -> list[Path]:
    return [p for p in (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
            if MARKER_LINE.search(p.read_text())]


def blocks(page: Path) -> list[str]:
    text = page.read_text()
    found = FENCE.findall(text)
    assert len(found) == len(MARKER_LINE.findall(text)), f"{page}: a {MARKER} line not directly above a ```bash fence"
    return found


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comment lines and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def cli_call(command: str) -> tuple[int | None, list[str]] | None:
    """(world, argv) of a dist_convert command (world None: one process); None for any other command."""
    words = shlex.split(command, comments=True)
    if words[:1] == ["dist_convert"]:
        return None, words[1:]
    if words[:3] == ["python", "-m", "dist_convert"]:
        return None, words[3:]
    if words[:1] == ["torchrun"] and "dist_convert" in words:
        at = words.index("dist_convert")
        nproc = next((int(w.split("=", 1)[1]) for w in words[1:at] if w.startswith("--nproc_per_node=")), 1)
        return min(nproc, MAX_RANKS), words[at + 1:]
    return None if "dist_convert" not in words else pytest.fail(f"unsupported dist_convert command: {command}")


@pytest.fixture(scope="session")
def workspace_base(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("examples")
    config = base / "llama.json"
    config.write_text(json.dumps(LLAMA))
    oracle("make", 2, "--config", str(config), "--tp", "2", "--pp", "1", "--seed", "1234", "--iteration", "100",
           "--out-torch-dist", str(base / "llama-tp2"))
    make_hf_model(base, "llama_docs").rename(base / "llama-hf")
    config.unlink()
    return base


def test_the_marker_finds_the_examples():
    """The pages hold runnable blocks (so the test below cannot pass by finding none), and each parses."""
    found = {p.relative_to(ROOT): blocks(p) for p in pages()}
    assert sum(map(len, found.values())) >= 10, found
    assert Path("docs/getting-started.md") in found


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_examples_run(tmp_path, workspace_base, page):
    ws = tmp_path / "ws"
    shutil.copytree(workspace_base, ws)
    for block in blocks(page):
        for command in commands(block):
            call = cli_call(command)
            if call is None:
                proc = subprocess.run(["bash", "-c", command], cwd=ws, env={**ENV, "PATH": f"{VENV_BIN}:{ENV['PATH']}"},
                                      capture_output=True, text=True, timeout=120)
            else:
                proc = WORKERS.run("cli", call[0], call[1], 600, cwd=str(ws))
            assert proc.returncode == 0, f"{page.name}: `{command}` exit {proc.returncode}\n" \
                                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
