"""The command line's flags: ``build_parser`` (every subcommand and its options) and ``format_options`` (the
formats' options from the parsed flags). It imports no torch: ``--help`` and ``--version`` stay fast."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from .bench.args import add_bench_parser
from .defaults import DEFAULT_BUDGET, MODEL_CLASSES
from .sizes import parse_size

if TYPE_CHECKING:  # the formats are imported when a command runs, not to parse
    from .formats.base import FormatOptions

FORMAT_CHOICES = ("auto", "torch_dist", "fsdp_dtensor", "megatron", "hf", "nemo", "nemo2", "bridge", "peft",
                  "bridge_lora")
FORMATS_HELP = "auto: detected from the files"
DTYPE_HELP = ("cast the model's tensors to this dtype on CPU while reading, before anything moves (tensors "
              "megatron-core keeps in fp32, the MoE router's expert_bias, stay fp32; an FP8 / MXFP4 hf source "
              "dequantizes to it). Default keep: each tensor's stored dtype (bf16 for a quantized source)")
DEFAULT_TIMEOUT_S = 1800.0
DESCRIPTION = """\
Reshard and convert Megatron-Core LLM checkpoints (torch_dist, fsdp_dtensor,
legacy megatron rank files, Hugging Face, NeMo 1 and 2, Megatron-Bridge, LoRA
adapters): every rank reads and writes only its share. reshard, speculate,
inspect and verify run as a torchrun job (or start N local workers with
--nproc N); plan and bench run in one process."""
EPILOG = """\
examples:
  torchrun --nproc_per_node=8 dist_convert reshard SRC DST --target-tp 4 --target-pp 2
  python -m dist_convert reshard HF_DIR DST --dst-format torch_dist --target-tp 2 --nproc 2
  python -m dist_convert plan SRC --target-tp 8 --world 64
  python -m dist_convert inspect CKPT --tensors
  torchrun --nproc_per_node=2 dist_convert verify A B --atol 1e-2 --rtol 1e-2

'dist_convert COMMAND --help' describes each command and its flags."""
# (distribution, how --version names it): read from the installed metadata, never imported
VERSION_OF = (("torch", "torch"), ("megatron-core", "megatron-core"))


def version_text() -> str:
    """``dist_convert <version>`` and, one a line, the installed torch and megatron-core (metadata only: no import)."""
    from importlib.metadata import PackageNotFoundError, version

    lines = [f"dist_convert {__version__}"]
    for dist, name in VERSION_OF:
        try:
            lines.append(f"{name} {version(dist)}")
        except PackageNotFoundError:
            lines.append(f"{name} not installed")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    """``--version``: prints ``version_text()`` and exits; the versions are read only when it is given."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_text())  # stdout, as argparse's own "version" action prints
        parser.exit()


def _process_flags(p: argparse.ArgumentParser) -> None:
    """The subcommands that run as a job of ranks: how it starts and how its ranks talk."""
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="start N local worker processes (as torchrun --standalone --nproc_per_node=N would) and "
                        "run in them; without it: one process, or the ranks of the torchrun job it runs in")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="collective backend (auto: nccl when every local rank has a GPU of its own, else gloo on "
                        "CPU; nccl needs a GPU per local rank)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="seconds a rank waits for the others in a collective (gloo and NCCL alike) before it "
                        "reports a hung or lost rank (default 1800); waits for a phase only rank 0 works in "
                        "(packaging a .nemo, the final rename) are not bounded by it")


def _source_flags(p: argparse.ArgumentParser, key_policy: bool = True) -> None:
    """How a source is read. ``key_policy``: also --allow-missing / --ignore-unexpected (not for inspect, which
    refuses neither and notes both)."""
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="true (unpadded) vocabulary size when the checkpoint args lack it")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow arbitrary pickled objects in .pt files and torch_dist .metadata (only for files you "
                        "trust)")
    if key_policy:
        p.add_argument("--allow-missing", action="append", default=[], metavar="PATTERN",
                       help="let the source lack the tensors whose stored key or logical name matches this glob "
                            "(repeatable); they are left out of the conversion (default: refuse missing tensors)")
        p.add_argument("--ignore-unexpected", action="append", default=[], metavar="PATTERN",
                       help="skip the source tensors the model does not have whose stored key matches this glob "
                            "(repeatable; default: refuse unknown tensors)")


def _budget_flag(p: argparse.ArgumentParser) -> None:
    """The subcommands that move tensor bytes in waves (or plan them)."""
    p.add_argument("--memory-budget", type=parse_size, default=DEFAULT_BUDGET, metavar="SIZE",
                   help="bytes in flight per rank per exchange wave, e.g. 256MB or 1G (default 256M; smaller: less "
                        "memory, more waves)")


def _exchange_flag(p: argparse.ArgumentParser) -> None:
    """reshard and verify: how bytes cross ranks (dist_convert/transport.py, docs/exchange.md)."""
    p.add_argument("--exchange", choices=("auto", "shm", "gloo", "nccl"), default="auto",
                   help="how bytes cross ranks (auto: shared memory within a node, NCCL across nodes with GPUs, else "
                        "gloo; shm: same-node peers through /dev/shm; gloo or nccl: every peer over that collective)")


def format_options(ns: argparse.Namespace) -> FormatOptions:
    """Reader/writer options from the flags of any subcommand (flags it lacks keep the FormatOptions defaults)."""
    import torch

    from .formats.base import FormatOptions

    cast = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # --dtype (keep: None)
    d = FormatOptions()
    quantize = getattr(ns, "quantize", "none")
    return FormatOptions(trust_pickle=getattr(ns, "trust_pickle", d.trust_pickle),
                         max_shard_size=getattr(ns, "max_shard_size", d.max_shard_size),
                         tokenizer_dir=getattr(ns, "tokenizer_dir", d.tokenizer_dir),
                         tokenizer_model=getattr(ns, "tokenizer_model", d.tokenizer_model),
                         tokenizer_vocab_file=getattr(ns, "tokenizer_vocab_file", d.tokenizer_vocab_file),
                         nemo_style=getattr(ns, "nemo_style", d.nemo_style),
                         torch_dist_style=getattr(ns, "torch_dist_style", d.torch_dist_style),
                         allow_missing=tuple(getattr(ns, "allow_missing", d.allow_missing)),
                         dtype=cast.get(getattr(ns, "dtype", "keep"), d.dtype),
                         quantize=None if quantize in (None, "none") else quantize,
                         ignore_unexpected=tuple(getattr(ns, "ignore_unexpected", d.ignore_unexpected)),
                         optimizer=getattr(ns, "optimizer", d.optimizer), base=getattr(ns, "base", d.base))


def _layer_split_flags(r: argparse.ArgumentParser) -> None:
    """The target's TP and PP, and uneven pipeline stages (``reshard``, ``plan``, ``speculate``)."""
    r.add_argument("--target-tp", type=int, default=None, metavar="TP", help="target tensor-parallel size "
                                                                             "(default: the source TP)")
    r.add_argument("--target-pp", type=int, default=None, metavar="PP", help="target pipeline-parallel size "
                                                                             "(default: the source PP)")
    r.add_argument("--target-num-layers-in-first-stage", type=int, default=None, dest="target_first", metavar="N",
                   help="uneven pipeline: decoder layers on the first stage, as megatron-core's "
                        "--decoder-first-pipeline-num-layers (default: even stages)")
    r.add_argument("--target-num-layers-in-last-stage", type=int, default=None, dest="target_last", metavar="N",
                   help="uneven pipeline: decoder layers on the last stage, as megatron-core's "
                        "--decoder-last-pipeline-num-layers (default: even stages)")
    r.add_argument("--make-vocab-size-divisible-by", type=int, default=None, dest="vocab_divisible_by",
                   metavar="N", help="vocabulary padding multiple per TP rank (default: the source's; 128 from hf)")


def _target_flags(r: argparse.ArgumentParser) -> None:
    """The flags that say what a reshard produces (``reshard`` and ``plan``)."""
    r.add_argument("--src-format", choices=FORMAT_CHOICES, default="auto", help=f"source format ({FORMATS_HELP})")
    r.add_argument("--dst-format", choices=FORMAT_CHOICES[1:], default=None,
                   help="target format (default: the source format; an adapter source's hf / torch_dist target is "
                        "its peft / Bridge LoRA form)")
    _layer_split_flags(r)
    r.add_argument("--target-vpp", type=int, default=None, metavar="V",
                   help="virtual pipeline stages per PP rank (interleaved; default: the source's when PP is kept; "
                        "1: none)")
    r.add_argument("--target-pipeline-layout", default=None, metavar="STR",
                   help="megatron-core pipeline_model_parallel_layout string placing layers on stages, e.g. "
                        "'Et|ttt|tL' (VPP = its stages / --target-pp; default: the source's when PP is kept; "
                        "none: no string)")
    r.add_argument("--target-ep", type=int, default=None, metavar="EP",
                   help="MoE: expert-parallel size, routed experts spread evenly over EP ranks (default: the source's)")
    r.add_argument("--target-etp", type=int, default=None, metavar="ETP",
                   help="MoE: expert-tensor-parallel size of routed experts (default: the source's when it differs "
                        "from its TP, else the target TP)")
    r.add_argument("--target-pipeline-split-rank", type=int, default=None, dest="target_split", metavar="S",
                   help="encoder-decoder (T5) with PP > 1: the first decoder stage; encoder stages come before it "
                        "(default: the source's when PP is kept)")
    r.add_argument("--target-spec", choices=("te", "local"), default=None,
                   help="layer-spec naming of the target (default: the source's)")
    r.add_argument("--target-model", choices=MODEL_CLASSES, default=None,
                   help="megatron-core model class of the target: gpt (GPTModel) or hybrid (HybridModel: each GPT "
                        "layer becomes its attention (*) or Gated DeltaNet (G) layer and its MLP (-) or MoE (E) "
                        "layer; default: the source's "
                        "class; gpt for an HF source, and for an HF target where no HF family holds the hybrid model)")
    r.add_argument("--dtype", choices=("keep", "bf16", "fp16", "fp32"), default="keep", help=DTYPE_HELP)
    r.add_argument("--max-shard-size", type=parse_size, default=5 * 10**9, metavar="SIZE",
                   help="hf target: bytes per *.safetensors shard (default 5GB)")
    r.add_argument("--quantize", choices=("none", "fp8-block", "fp8-channel", "int4", "mxfp4", "nvfp4"),
                   default="none",
                   help="hf target: fp8-block writes linear weights as float8_e4m3fn with 128x128-block fp32 "
                        "<name>_scale_inv, as DeepSeek-V3's FP8 release stores them; fp8-channel as "
                        "compressed-tensors' float-quantized FP8, a scale per output channel; int4 the routed "
                        "experts' linears as compressed-tensors' pack-quantized INT4 (group 32, as Kimi-K2-Thinking); "
                        "mxfp4 writes gpt-oss's expert weights as MXFP4 <name>_blocks / <name>_scales, as OpenAI's "
                        "release does; nvfp4 the MLP linears as ModelOpt's weight-only NVFP4 (W4A16_NVFP4, group 16, "
                        "as its export writes them) (default: none)")
    r.add_argument("--tokenizer-dir", type=Path, default=None, metavar="DIR",
                   help="hf, bridge, nemo2 targets: copy tokenizer files from here (default: the source's)")
    r.add_argument("--tokenizer-model", type=Path, default=None, metavar="FILE",
                   help="nemo target: put this tokenizer model into the archive (overrides the source's)")
    r.add_argument("--tokenizer-vocab-file", type=Path, default=None, metavar="FILE",
                   help="nemo target: put this tokenizer vocab file into the archive (overrides the source's)")
    r.add_argument("--nemo-style", choices=("mcore", "legacy", "megatron_legacy"), default=None,
                   help="nemo target: megatron-core keys, legacy NeMo Megatron keys, or legacy keys with the "
                        "megatron_legacy QKV layout (default: the source's for a .nemo source, else mcore)")
    r.add_argument("--mcore-style", "--torch-dist-style", dest="torch_dist_style", choices=("0.16", "0.19"),
                   default=None,
                   help="the megatron-core line a torch_dist or megatron target is written for. torch_dist: where the "
                        "common state (args) goes; 0.16: common.pt, which megatron-core 0.14-0.20 all load; 0.19: a "
                        "common_state item inside the DCP, as megatron-core 0.19+ saves (0.16-0.18 cannot load it). "
                        "megatron (legacy rank files): a Mamba2 mixer's conv1d is named conv1d.weight (0.16) or "
                        "conv1d_weight (0.19+). Default: the source's style, else 0.16")
    r.add_argument("--lora", type=Path, default=None, metavar="ADAPTER",
                   help="merge this LoRA adapter into the model as it is written (W + alpha/r * B @ A, each rank its "
                        "own slices, in float32 before any cast): an HF peft directory or a Megatron-Bridge LoRA PEFT "
                        "checkpoint of the source model")
    r.add_argument("--base", type=Path, default=None,
                   help="adapter sources: the model the adapter adapts (any format; its config and names), when the "
                        "adapter does not name a local one")
    r.add_argument("--optimizer", action="store_true",
                   help="convert the distributed optimizer's state too (master params and Adam moments; "
                        "dp_reshardable, fully_reshardable, non-distributed or legacy distrib_optim.pt sources) into "
                        "a torch_dist target in model space (fully_reshardable), so training resumes at the new "
                        "layout; without it the optimizer state is dropped")


def _add(sub: Any, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """A subcommand: ``summary`` in the command list, ``summary`` and ``description`` in its own --help."""
    return sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}. {description}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dist_convert", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of dist_convert, torch and megatron-core and exit")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    r = _add(sub, "reshard", "change the TP/PP/EP layout and/or the format of a checkpoint",
             "Every rank reads only the source bytes its share of the target needs, exchanges them with the other "
             "ranks in waves bounded by --memory-budget, and writes its target files; DST appears atomically when "
             "all are written. Any world size works with any source and target layout.")
    r.add_argument("src", type=Path, help="source checkpoint: a Megatron-LM directory (tracker file and iter_*), an "
                                          "iteration directory, a Hugging Face directory, a .nemo file, a NeMo 2 or "
                                          "Megatron-Bridge checkpoint, or a LoRA adapter")
    r.add_argument("dst", type=Path, help="target path to create (refused when it exists, unless --overwrite)")
    _target_flags(r)
    r.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST (and discard an interrupted run's DST.dist_convert_tmp)")
    r.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: keep the target files it finished (checksums checked), "
                        "convert the rest (same arguments and world size)")
    r.add_argument("--stats-json", type=Path, default=None, metavar="FILE",
                   help="rank 0 also writes the per-rank summary table here as JSON")
    _process_flags(r)
    _source_flags(r)
    _budget_flag(r)
    _exchange_flag(r)

    pl = _add(sub, "plan", "predict what a reshard would read, write, send and hold per rank at a world size, and "
                           "how long it would take",
              "Runs in one process (no torchrun, no --nproc): it indexes the source and plans the reshard the flags "
              "describe for --world ranks with the same planner, without reading tensors or writing anything.")
    pl.add_argument("src", type=Path, help="source checkpoint, as reshard takes it")
    _target_flags(pl)
    pl.add_argument("--world", type=int, required=True, metavar="N", help="ranks of the planned run")
    pl.add_argument("--read-gbps", type=float, default=1.0, metavar="GBPS",
                    help="storage read speed per rank, GB/s (default 1)")
    pl.add_argument("--write-gbps", type=float, default=None, metavar="GBPS",
                    help="storage write speed per rank, GB/s (default: --read-gbps)")
    pl.add_argument("--network-gbps", type=float, default=10.0, metavar="GBPS",
                    help="exchange speed per rank, GB/s (default 10: NCCL within a node; gloo is ~0.5-2)")
    pl.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every figure here as JSON")
    _source_flags(pl)
    _budget_flag(pl)

    s = _add(sub, "speculate", "add EAGLE draft layers or Medusa heads with ModelOpt and save the model sharded",
             "Builds the source model with megatron-core on every rank (its share of the target layout), adds the "
             "draft modules ModelOpt's EAGLE or Medusa conversion makes, and saves torch_dist or nemo2; "
             "--export-draft also writes the draft for serving engines.")
    s.add_argument("src", type=Path, help="source checkpoint (any format reshard reads)")
    s.add_argument("dst", type=Path, help="target path to create (refused when it exists, unless --overwrite)")
    s.add_argument("--src-format", choices=FORMAT_CHOICES, default="auto", help=f"source format ({FORMATS_HELP})")
    s.add_argument("--dst-format", choices=("torch_dist", "nemo2"), default=None,
                   help="torch_dist (Megatron-LM) or nemo2 (weights/ + context/); default: nemo2 for a NeMo 2 source")
    _layer_split_flags(s)
    s.add_argument("--eagle-layers", type=int, default=None, metavar="N", help="EAGLE draft decoder layers")
    s.add_argument("--eagle-version", type=int, default=3, choices=(1, 3),
                   help="3: ModelOpt's EAGLE-3 defaults; 1: no aux hidden states, no last layernorm")
    s.add_argument("--medusa-heads", type=int, default=None, metavar="N", help="Medusa heads")
    s.add_argument("--medusa-layers", type=int, default=1, metavar="N", help="residual layers per Medusa head")
    s.add_argument("--spec-config", type=Path, default=None, metavar="FILE",
                   help='a full ModelOpt config: {"algorithm": "eagle"|"medusa", "config": {...}}')
    s.add_argument("--export-draft", type=Path, default=None, metavar="DIR",
                   help="also write the draft for serving engines (config.json + safetensors), offline")
    s.add_argument("--dtype", choices=("keep", "bf16", "fp16", "fp32"), default="keep", help=DTYPE_HELP)
    s.add_argument("--seed", type=int, default=None,
                   help="seed of the draft modules' initialisation (default: the source's Megatron-LM --seed, else "
                        "1234); each pipeline stage adds 100 x its rank, as Megatron-LM does")
    s.add_argument("--overwrite", action="store_true", help="replace an existing DST / --export-draft")
    _process_flags(s)
    _source_flags(s)
    _budget_flag(s)

    i = _add(sub, "inspect", "describe a checkpoint",
             "Prints its format, iteration, layout, the model config fields the model uses, bytes, dtypes and "
             "notes; --tensors lists every logical tensor. It refuses neither missing nor unexpected tensors: "
             "its notes name them (a reshard needs --allow-missing / --ignore-unexpected for them).")
    i.add_argument("ckpt", type=Path, help="the checkpoint to describe (any format reshard reads)")
    i.add_argument("--format", choices=FORMAT_CHOICES, default="auto", help=f"its format ({FORMATS_HELP})")
    i.add_argument("--json", action="store_true",
                   help="print JSON instead of a table (config: the used fields; config_all: every field)")
    i.add_argument("--tensors", action="store_true",
                   help="also list every logical tensor: name, global shape, stored dtypes, how TP splits it, its "
                        "expert (EP rank), how many stored pieces hold it and, reading every value once, its NaN and "
                        "infinite values (a column only where any; JSON: under tensors)")
    i.add_argument("--base", type=Path, default=None,
                   help="an adapter: the model it adapts, when its config names no local one")
    _process_flags(i)
    _source_flags(i, key_policy=False)

    v = _add(sub, "verify", "compare every logical tensor of two checkpoints, or check one's checksums",
             "A and B may differ in format and layout: each rank assembles its share of every logical tensor from "
             "both and compares them (exactly, or within --atol/--rtol). --checksums checks the files dist_convert "
             "wrote against their manifest instead (with B: then compares too).")
    v.add_argument("a", type=Path, help="first checkpoint (any format reshard reads)")
    v.add_argument("b", type=Path, nargs="?", default=None,
                   help="second checkpoint to compare A with (may be omitted with --checksums)")
    v.add_argument("--checksums", action="store_true",
                   help="check the size and SHA-256 of every file against the manifest dist_convert wrote (of A, "
                        "and of B when given); fast, no source needed")
    v.add_argument("--a-format", choices=FORMAT_CHOICES, default="auto", help=f"format of A ({FORMATS_HELP})")
    v.add_argument("--b-format", choices=FORMAT_CHOICES, default="auto", help=f"format of B ({FORMATS_HELP})")
    v.add_argument("--atol", type=float, default=0.0,
                   help="absolute tolerance: |a - b| <= atol + rtol * |b| passes (default 0: bit-exact)")
    v.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (see --atol; default 0)")
    v.add_argument("--base", type=Path, default=None,
                   help="adapters: the model they adapt, when their config names no local one")
    _process_flags(v)
    _source_flags(v)
    _budget_flag(v)
    _exchange_flag(v)
    add_bench_parser(sub, parse_size, DEFAULT_BUDGET)
    return parser
