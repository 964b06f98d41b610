"""The package's imports form no cycle: every ``import`` / ``from ... import`` between dist_convert modules,
at module level or inside a function (a lazy import is still a dependency), is an edge; only imports under
``if TYPE_CHECKING:`` are left out. Pure: reads the sources with ``ast``, imports nothing."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dist_convert"


def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if init else parts)] = (path, init)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _absolute(module: str, init: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.split(".")[:None if init else -1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(module: str, path: Path, init: bool, known: dict[str, tuple[Path, bool]]) -> dict[str, int]:
    """The package modules ``module`` imports (each: the line of its first import), leaving out
    ``if TYPE_CHECKING:`` blocks. ``from pkg import name`` is an edge to ``pkg.name`` where that is a module,
    else to ``pkg`` (or the longest module name it starts with)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, init, node.level, node.module)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.setdefault(name, node.lineno)
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {m: imports(m, path, init, known) for m, (path, init) in known.items()}


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"d": 5}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_imports_count_lazy_ones_and_skip_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n"
                              "def f():\n    from .sub import b\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    known = modules(pkg)
    assert imports("pkg.a", *known["pkg.a"], known) == {"pkg.sub.b": 5}
    assert imports("pkg.c", *known["pkg.c"], known) == {"pkg.a": 1}


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    detail = ["; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in comp for b in graph[a] if b in comp)
              for comp in found]
    assert not found, "import cycles (move the shared piece to a module both can import):\n" + "\n".join(detail)


def test_model_config_and_layout_do_not_import_each_other():
    """A record checks its own layout limits by the layout's attributes and the layout reads a config's: neither
    ``config`` nor ``features`` imports the layout package, and no layout module imports ``config`` (type hints
    aside)."""
    graph = import_graph()
    model = ("dist_convert.config", "dist_convert.features")
    up = {(a, b) for a, edges in graph.items() for b in edges
          if a.startswith(model) and b.startswith("dist_convert.layout")
          or a.startswith("dist_convert.layout") and b == "dist_convert.config"}
    assert not up, sorted(up)
