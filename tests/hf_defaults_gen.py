"""Generates ``dist_convert/models/hf_defaults.py``: for every architecture dist_convert reads, the config.json keys
whose absence changes what it imports, each with the value transformers' own config class gives when the key is
absent, taken from the class itself.

For each family's config class (``AutoConfig.for_model(model_type)``) and each key of its default ``to_dict()``: the
class is built with the key removed, twice, from two configs of different sizes; a key whose default is the same
both times (a constant, not derived from other keys) and whose absence changes the family's own reading
(``Family.from_hf`` without the table: another model, or a failure) is listed with that default. ``rope_theta`` inside
``rope_parameters`` is listed as ``rope.rope_theta``. Run under each transformers release the runtimes carry; where
two releases disagree the key is listed as ``DISAGREE`` (an absent key is then refused).

  python tests/hf_defaults_gen.py --json OUT.json        this runtime's table as JSON
  python tests/hf_defaults_gen.py --write A.json B.json  merge the runtimes' tables into the module
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODULE = ROOT / "dist_convert" / "models" / "hf_defaults.py"
BOOKKEEPING = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path"}
# the second config's sizes: a default derived from these differs between the two builds
DERIVED = object()  # a runtime whose class derives the key (or lacks it)
RESIZED = {"hidden_size": 2, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 2,
           "vocab_size": 2}


def _reading(fam, hf: dict) -> Any:
    """The family's own reading of ``hf``, without the defaults table: the model config, or the failure."""
    try:
        return fam.from_hf(hf, None).cfg
    except Exception as e:  # noqa: BLE001 - a failure is a reading too: the key matters
        return f"{type(e).__name__}"


def _absent(cls, full: dict, key: str) -> Any:
    """What ``cls`` gives for ``key`` when a config.json without it is read (``rope.rope_theta``: inside
    ``rope_parameters``)."""
    if key == "rope.rope_theta":
        params = {k: v for k, v in full["rope_parameters"].items() if k != "rope_theta"}
        return cls(**{**full, "rope_parameters": params}).to_dict()["rope_parameters"].get("rope_theta")
    return cls(**{k: v for k, v in full.items() if k != key}).to_dict().get(key)


def _without(full: dict, key: str) -> dict:
    if key == "rope.rope_theta":
        return {**full, "rope_parameters": {k: v for k, v in full["rope_parameters"].items() if k != "rope_theta"}}
    return {k: v for k, v in full.items() if k != key}


def _with(hf: dict, key: str, value: Any) -> dict:
    if key == "rope.rope_theta":
        return {**hf, "rope_parameters": {**hf["rope_parameters"], "rope_theta": value}}
    return {**hf, key: value}


def _resized(cls, full: dict) -> dict:
    """The class's defaults at other sizes; per-layer lists (``layer_types``, ...) derived again for them."""
    bigger = {k: full[k] * f for k, f in RESIZED.items() if isinstance(full.get(k), int)}
    per_layer = [k for k, v in full.items() if isinstance(v, list) and len(v) == full.get("num_hidden_layers")]
    built = cls(**{**{k: v for k, v in full.items() if k not in per_layer}, **bigger})
    return {k: v for k, v in built.to_dict().items() if k not in BOOKKEEPING}


def text_class(cls, fam) -> Any:
    """A vision-language config class's text config class (None for a text model's): its ``text_config`` class, or,
    where that is any class (Mistral 3's AutoConfig), the one of the family's own text model."""
    import transformers

    text_cls = getattr(cls, "sub_configs", {}).get("text_config")
    if text_cls is transformers.AutoConfig:
        return type(transformers.AutoConfig.for_model(fam.text.model_type))
    return text_cls


def config_classes() -> list[tuple[str, Any, Any]]:
    """(model_type, config class, reading of a config.json of that class) for every config class dist_convert reads:
    each family's, and a vision-language family's text config class (its ``text_config``, read by its text family
    as the vision-language family hands it over)."""
    import transformers

    from dist_convert.models import FAMILIES

    out = []
    for arch, fam in FAMILIES.items():
        if fam.model_type not in transformers.CONFIG_MAPPING:  # a class newer than this release (Kimi-K2.5 before
            continue  # 5.14): its text config class, the one read here, is judged through the families that have it
        cls = type(transformers.AutoConfig.for_model(fam.model_type))
        text_cls = text_class(cls, fam)
        if text_cls is None:
            out.append((fam.model_type, cls, lambda hf, fam=fam, arch=arch: _reading(fam, {**hf, "architectures": [
                arch]})))
            continue

        def text_reading(hf: dict, fam=fam) -> Any:
            try:
                return fam.text.from_hf(fam.text_config({"architectures": [fam.architecture], "text_config": hf}),
                                        None).cfg
            except Exception as e:  # noqa: BLE001 - a failure is a reading too
                return f"{type(e).__name__}"

        out.append((text_cls().model_type, text_cls, text_reading))
    return out


def table() -> dict[str, dict[str, dict[str, Any]]]:
    """This runtime's transformers: {"defaults": model_type -> {key: constant default}, "matters": model_type ->
    {key: True} for the keys whose absence changes the family's reading}."""
    defaults: dict[str, dict[str, Any]] = {}
    matters: dict[str, dict[str, Any]] = {}
    aliases: dict[str, dict[str, list[str]]] = {}
    for model_type, cls, reading in config_classes():
        for alias, key in sorted(getattr(cls, "attribute_map", {}).items()):  # config.json's other name for key
            aliases.setdefault(model_type, {}).setdefault(key, []).append(alias)
        full = {k: v for k, v in cls().to_dict().items() if k not in BOOKKEEPING}
        resized = _resized(cls, full)
        keys = list(full)
        if isinstance(full.get("rope_parameters"), dict) and "rope_theta" in full["rope_parameters"]:
            keys.append("rope.rope_theta")
        for key in keys:
            try:
                default = _absent(cls, full, key)
                if default != _absent(cls, resized, key):
                    continue  # derived from other keys: the family derives it (checked by the test)
            except Exception:  # noqa: BLE001 - the class itself requires the key: nothing to default
                continue
            defaults.setdefault(model_type, {})[key] = default
            minus = _without(full, key)
            if reading(minus) != reading(_with(minus, key, default)):
                matters.setdefault(model_type, {})[key] = True
    return {"defaults": defaults, "matters": matters, "aliases": aliases}


def merge_aliases(runs: list[dict[str, dict[str, Any]]], keys: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The other names, in any runtime's class, of the keys of the table (``keys``): present, they give the key."""
    out: dict[str, dict[str, list[str]]] = {}
    for run in runs:
        for model_type, names in run.get("aliases", {}).items():
            for key, others in names.items():
                if key in keys.get(model_type, {}):
                    known = out.setdefault(model_type, {}).setdefault(key, [])
                    known.extend(a for a in others if a not in known)
    return {m: {k: tuple(sorted(v)) for k, v in sorted(r.items())} for m, r in sorted(out.items())}


def merge(runs: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """One table from the runtimes': every key that matters in one of them, with its default, ``DISAGREE`` where a
    release gives another default (or derives it)."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        for model_type, keys in run["matters"].items():
            for key in keys:
                values = [r["defaults"].get(model_type, {}).get(key, DERIVED) for r in runs]
                same = all(v == values[0] for v in values) and values[0] is not DERIVED
                out.setdefault(model_type, {})[key] = values[0] if same else "DISAGREE"
    return {m: dict(sorted(r.items())) for m, r in sorted(out.items())}


def render(merged: dict[str, dict[str, Any]], releases: list[str], aliases: dict[str, Any]) -> str:
    rows = []
    for model_type, keys in merged.items():
        items = [f"{k!r}: {'DISAGREE' if v == 'DISAGREE' else repr(v)}," for k, v in keys.items()]
        lines, line = [f"    {model_type!r}: {{"], ""
        for item in items:
            if line and len(line) + len(item) + 9 > 120:
                lines.append("        " + line.rstrip())
                line = ""
            line += item + " "
        lines.append("        " + line.rstrip())
        lines.append("    },")
        rows.append("\n".join(lines))
    body = "\n".join(rows)
    alias_rows = "\n".join(f"    {m!r}: {names!r}," for m, names in aliases.items())
    return f'''"""What transformers reads for a config.json key that is absent, per config class (``model_type``):
generated by ``tests/hf_defaults_gen.py`` from transformers {", ".join(releases)}, never edited by hand.

Only the keys whose absence changes what dist_convert imports are listed, each with the default its config class gives
(constants only: a default derived from other keys is derived by the family as transformers derives it, which
``tests/test_hf_defaults.py`` checks). ``DISAGREE``: the releases give different defaults, so an absent key is refused.
"""
from __future__ import annotations

from typing import Any

DISAGREE = "DISAGREE"
DEFAULTS: dict[str, dict[str, Any]] = {{
{body}
}}
# a key's other names in its config class (``attribute_map``): present in config.json, they give the key's value
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {{
{alias_rows}
}}
'''


def main() -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--write", nargs="+")
    a = p.parse_args()
    if a.json:
        import transformers

        Path(a.json).write_text(json.dumps({"release": transformers.__version__, "table": table()}, indent=1))
    if a.write:
        runs = [json.loads(Path(f).read_text()) for f in a.write]
        tables = [r["table"] for r in runs]
        merged = merge(tables)
        text = render(merged, sorted(r["release"] for r in runs), merge_aliases(tables, merged))
        MODULE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
