"""The docs: the site builds strictly (mkdocs-material: every page in the nav, every link and anchor resolves), the
generated regions (flag tables, the troubleshooting list of every ConvertError) are current, every dist_convert
command line in README.md and docs/ parses with the real parser, README stays a page, and the shell scripts are
shellcheck-clean. The runnable examples run in tests/test_examples.py."""
from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys

import pytest

from dist_convert.cli import build_parser

from conftest import ENV, ROOT
from slurm_cluster import ensure_debian

spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BASH = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)


def test_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env={**ENV, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()
    assert (tmp_path / "site" / "cli" / "reshard" / "index.html").is_file()


def test_generated_regions_are_current():
    stale = [str(p.relative_to(ROOT)) for p in PAGES if generate.regenerate(p.read_text()) != p.read_text()]
    assert not stale, f"stale generated regions in {stale}: run python docs/generate.py"


def test_every_convert_error_is_listed():
    """The generator sees every ConvertError(...) of the package (none hidden behind another name), and the
    troubleshooting page shows each cause."""
    calls = [(p, c) for p in generate.PACKAGE.rglob("*.py") for c in generate.convert_errors(p)]
    call = re.compile(r"(?<!class )\bConvertError\(")
    written = sum(len(call.findall(p.read_text())) for p in generate.PACKAGE.rglob("*.py"))
    assert len(calls) == written > 300
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert all(generate._md(cause) in page for _, (cause, _) in calls)


def test_flag_tables_name_every_flag():
    """Each subcommand has its page, and the page's table holds every flag (a page without the region fails)."""
    for cmd, parser in generate.subparsers().items():
        page = (ROOT / "docs" / "cli" / f"{cmd}.md").read_text()
        for action in parser._actions[1:]:  # after -h
            for flag in action.option_strings:
                assert f"`{flag}`" in page, (cmd, flag)


def _dist_convert_lines() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for block in BASH.findall(page.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                words = shlex.split(line, comments=True) if line.strip() else []
                if "dist_convert" in words:
                    at = words.index("dist_convert")
                    if words[at + 1:at + 2] and not words[at + 1].startswith("<"):
                        out.append((f"{page.relative_to(ROOT)}: {line.strip()}", words[at + 1:]))
    return out


def test_every_command_line_parses():
    """Every dist_convert command in a bash block of README.md and docs/ (runnable or not) is one the parser takes:
    a renamed or removed flag shows here, on every page that still names it."""
    lines = _dist_convert_lines()
    assert len(lines) > 100
    parser, bad = build_parser(), []
    for where, argv in lines:
        try:
            parser.parse_args(argv)
        except SystemExit:
            bad.append(where)
    assert not bad, "\n".join(bad)


def test_readme_is_a_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 210
    for target in re.findall(r"\]\(((?:docs/)[^)#]+)", readme):
        assert (ROOT / target).is_file(), target
    assert "bash launch/test.sh" in readme and "bash launch/quickstart.sh" in readme


def test_shell_scripts_are_shellcheck_clean():
    reason = ensure_debian("shellcheck", ["shellcheck"], ["shellcheck"])
    if reason:
        pytest.skip(reason)
    scripts = sorted([*ROOT.glob("launch/*.sh"), *ROOT.glob("slurm/*"), ROOT / ".ci" / "run"])
    proc = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
