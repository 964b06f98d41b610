"""Fill the generated regions of the docs from the code, so they cannot drift from it:

* ``<!-- generated: flags CMD -->``: the flag table of subcommand CMD, from ``dist_convert.cli.build_parser()``;
* ``<!-- generated: errors -->``: every ``ConvertError`` the package can raise (its cause and fix as written in the
  code, ``<...>`` where a value is filled in at run time), by module, read from the source with ``ast``;
* ``<!-- generated: settings -->``: the audit of megatron-core's settings (``dist_convert.features.audit``): each
  setting read, the record field holding it and the Hugging Face families that write a value other than the plain
  one; the settings refused on read; those known not to change the forward pass, by reason.

Each region runs from its marker line to ``<!-- end generated -->``.

  python docs/generate.py           # rewrite the regions of README.md and docs/**/*.md in place
  python docs/generate.py --check   # exit 1 and name the stale files (tests/test_docs.py runs this)
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dist_convert"
REGION = re.compile(r"(<!-- generated: (?P<what>[^>]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


# ---- flags ------------------------------------------------------------------------------------------------------

def subparsers() -> dict[str, argparse.ArgumentParser]:
    sys.path.insert(0, str(ROOT))
    from dist_convert.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def flag_table(cmd: str) -> str:
    rows = ["| argument | values | default | meaning |", "|---|---|---|---|"]
    for action in subparsers()[cmd]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest.upper()}` (positional)"
        if action.choices:
            values = ", ".join(f"`{c}`" for c in action.choices)
        elif action.nargs == 0:
            values = "(switch)"
        else:
            values = f"`{action.metavar or action.dest.upper()}`"
        default = action.default
        shown = "" if default in (None, False, [], argparse.SUPPRESS) or not action.option_strings else f"`{default}`"
        rows.append(f"| {name} | {values} | {shown} | {_cell(action.help or '')} |")
    return "\n".join(rows) + "\n"


# ---- errors -----------------------------------------------------------------------------------------------------

def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level ``NAME = "..."`` strings (and f-strings), so a shared fix text is shown, not its name."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant | ast.JoinedStr)):
            out[node.targets[0].id] = node.value
    return out


def _placeholder(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return f"<{node.id}>"
    if isinstance(node, ast.Attribute):
        return f"<{node.attr}>"
    return "<...>"


def _text(node: ast.expr | None, consts: dict[str, ast.expr]) -> str:
    """What an argument of ConvertError reads as: strings as written, run-time values as ``<name>``."""
    if node is None:
        return ""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else _placeholder(v.value) for v in node.values)
    if isinstance(node, ast.Name) and node.id in consts:
        return _text(consts[node.id], consts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left, consts) + _text(node.right, consts)
    if isinstance(node, ast.IfExp):
        return f"{_text(node.body, consts)} / {_text(node.orelse, consts)}"
    return _placeholder(node)


def convert_errors(path: Path) -> Iterator[tuple[str, str]]:
    """(cause, fix) of every ``ConvertError(...)`` call in ``path``, in source order."""
    tree = ast.parse(path.read_text(), str(path))
    consts = _constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ConvertError":
            args = {**dict(zip(("cause", "fix"), node.args, strict=False)), **{k.arg: k.value for k in node.keywords}}
            yield _text(args.get("cause"), consts), _text(args.get("fix"), consts)


def _md(text: str) -> str:
    text = " ".join(text.split())
    for ch in "\\`*_[]":
        text = text.replace(ch, "\\" + ch)
    return text.replace("<", "&lt;").replace(">", "&gt;")


def error_list() -> str:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        seen, items = set(), []
        for cause, fix in convert_errors(path):
            if (cause, fix) not in seen:
                seen.add((cause, fix))
                items.append(f"- **{_md(cause)}**" + (f"<br>fix: {_md(fix)}" if fix else ""))
        if items:
            out += [f"### `{path.relative_to(ROOT)}`", "", *items, ""]
    return "\n".join(out)


# ---- the settings audit -----------------------------------------------------------------------------------------

def settings_table() -> str:
    sys.path.insert(0, str(ROOT))
    import dataclasses

    from dist_convert.config import RECORDS, ModelConfig
    from dist_convert.features import LAYOUT, NUMERICS, SETTING, SIZE
    from dist_convert.features.audit import COVERED, NOT_MATH, UNCONVERTED
    from dist_convert.models import FAMILIES, PREFERENCE

    kinds = {SETTING: "setting", SIZE: "size", LAYOUT: "layout", NUMERICS: "precision"}

    def writes_other(allowed: object, plain: object) -> bool:
        return callable(allowed) or not isinstance(allowed, (set, frozenset, tuple, list)) or \
            any(v != plain for v in allowed)

    def short(arch: str) -> str:  # Gemma3ForConditionalGeneration: Gemma 3 with images, beside the text Gemma3
        name = arch.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration")
        return name if arch.endswith("ForCausalLM") or "VL" in name else f"{name} (images)"

    def families(key: str, plain: object = False, held: tuple[str, str] | None = None) -> str:
        """The families writing ``key`` at another value than ``plain``; ``held``: (the key of the field holding the
        record the setting is a field of, that record's kind), which the family must write too."""
        names = [short(a) for a in PREFERENCE
                 if key in FAMILIES[a].expresses() and writes_other(FAMILIES[a].expresses()[key], plain)
                 and (held is None or held[1] in FAMILIES[a].expresses().get(held[0], ()))]
        return ", ".join(names) or "none (refused on export to hf)"

    rows = ["| field | Megatron-LM args | megatron-core | kind | what | HF families writing other values |",
            "|---|---|---|---|---|---|"]
    fields = [(f.name, f, None) for f in dataclasses.fields(ModelConfig) if f.name not in RECORDS]
    for name, cls in RECORDS.items():
        for f in cls.all_fields():  # each vision tower's too
            fields.append((f"{name}.{f.name}", f, None))
            for held in (f.metadata["record"].variants() if f.metadata.get("record") else ()):  # a RoPE scaling kind's
                fields += [(f"{name}.{f.name}.{g.name}", g, (f"{name}.{f.name}", held.name))
                           for g in dataclasses.fields(held)]
    for key, f, held in fields:
        kind = f.metadata.get("kind", "")
        fams = (families(key, f.default, held) if kind == SETTING else
                "every family that has the feature" if kind == SIZE else "-")
        rows.append(f"| `{key}` | {', '.join(f'`{a}`' for a in f.metadata.get('arg', ())) or '-'} | "
                    f"{', '.join(f'`{a}`' for a in f.metadata.get('config', ())) or '-'} | {kinds.get(kind, kind)} | "
                    f"{_md(f.metadata.get('what', ''))} | {fams} |")
    out = ["Every field of `ModelConfig`'s core and feature records:", "", *rows, "",
           "Optional features (a record present or not) a family writes: "
           + "; ".join(f"`{name}`: {families(name)}" for name in RECORDS if RECORDS[name].what), "",
           "Refused on read (a stored layout or structure dist_convert does not convert):", ""]
    out += [f"- `{name}` ({_md(why)})" for name, (_, why) in UNCONVERTED.items()]
    out += ["", "Meaningful only with a setting that is read: "
            + ", ".join(f"`{name}` (with `{by}`)" for name, by in COVERED.items()), "",
            "Known not to change the forward pass:", ""]
    for reason in dict.fromkeys(NOT_MATH.values()):
        out.append(f"- {_md(reason)}: " + ", ".join(f"`{n}`" for n, r in NOT_MATH.items() if r == reason))
    return "\n".join(out) + "\n"


# ---- regions ----------------------------------------------------------------------------------------------------

def render(what: str) -> str:
    kind, _, arg = what.partition(" ")
    if kind == "flags":
        return flag_table(arg)
    if kind == "errors":
        return error_list()
    if kind == "settings":
        return settings_table()
    raise SystemExit(f"unknown generated region {what!r}")


def regenerate(text: str) -> str:
    return REGION.sub(lambda m: m.group(1) + render(m.group("what")) + m.group(4), text)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fill the docs' generated regions from the code")
    p.add_argument("--check", action="store_true", help="only name the stale files (exit 1 if any)")
    a = p.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(page)
            if not a.check:
                page.write_text(new)
    for page in stale:
        print(f"{'stale' if a.check else 'regenerated'}: {page.relative_to(ROOT)}")
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
