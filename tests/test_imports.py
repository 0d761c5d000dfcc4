"""The package's imports flow one way: the module graph of `src/kvpop` has no cycle (STYLE.md).

Every import counts, at module level or inside a function, absolute or relative: a function-level
import only defers a cycle to the first call, it does not remove it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_graph(src: Path, package: str = "kvpop") -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (a package counts as its `__init__`)."""
    files = {}
    for path in (src / package).rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path

    def known(name: str) -> str | None:
        # `kvpop.ops.target.api.function` -> the longest prefix that is a module of the package
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    # relative: from the module's package, one level up per extra dot
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges |= {t for t in map(known, targets) if t is not None and t != module}
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path `[a, b, ..., a]`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = module_graph(SRC)
    assert {"kvpop.cli", "kvpop.cache", "kvpop.retrofit", "kvpop.train.distill"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    # the detector itself: a cycle closed by a relative import inside a function is found
    pkg = tmp_path / "kvpop"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvpop.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (pkg / "c.py").write_text("import kvpop.a\n")
    graph = module_graph(tmp_path)
    assert graph["kvpop.a"] == {"kvpop.sub.b"} and graph["kvpop.sub.b"] == {"kvpop.a"}
    assert graph["kvpop.c"] == {"kvpop.a"}
    assert find_cycle(graph) in (["kvpop.a", "kvpop.sub.b", "kvpop.a"], ["kvpop.sub.b", "kvpop.a", "kvpop.sub.b"])
    (pkg / "sub" / "b.py").write_text("import os\n")
    assert find_cycle(module_graph(tmp_path)) is None
