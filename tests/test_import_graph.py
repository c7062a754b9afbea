"""The import graph of egomem, egomem.orchestrator (orchestrator/) and egomem.kernels (kernels/),
built from the source with `ast` (nothing is imported), has no cycle, and points one way between
packages: orchestrator -> egomem -> kernels.

Each edge is labelled by where its import statement runs:
  - "module": at import time (module or class body, including try/except and plain `if` blocks);
  - "type_checking": under `if TYPE_CHECKING:` -- never run, but the two modules still name each
    other, so the design has the cycle the runtime avoids: these count as cycles too;
  - "function": inside a function body, run on first call.
Decision on function-level imports: they do NOT count for cycles. A lazy import is how this code
keeps a load-time choice open (triton must not be imported before TRITON_INTERPRET is read, see
egomem/dialog/kv_cache.py; the CLI imports a subcommand's stack only when it runs), and a
function-level edge cannot make one module see the other half-initialised. They are not invisible
either: cycles closed only by function-level edges are listed by `python tests/test_import_graph.py`
and by this test's failure message, and the one-way rules between packages below count every edge
kind, lazy ones included.

Edges go to the most specific module that exists: `from egomem.memory import store` is an edge to
egomem.memory.store when that is a module, else to egomem.memory (a name its __init__ exports); a
package's __init__ is not implied by importing one of its submodules (the grimp/import-linter rule).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package -> folder, as pyproject.toml's [tool.setuptools] package-dir maps them
PACKAGES = {"egomem": ROOT / "egomem", "egomem.orchestrator": ROOT / "orchestrator", "egomem.kernels": ROOT / "kernels"}
STRICT = ("module", "type_checking")  # edge kinds that count for cycles


def modules() -> dict[str, Path]:
    """Module name -> file, for every .py file of the three packages."""
    found: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in rel:
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            found[".".join((pkg, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """(node, kind) for every import statement, kind as in the module docstring."""

    def walk(nodes, kind):
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, kind
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(ast.iter_child_nodes(node), "function")
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, "type_checking" if kind == "module" else kind)
                yield from walk(node.orelse, kind)
            else:
                yield from walk(ast.iter_child_nodes(node), kind)

    yield from walk(tree.body, "module")


def build_graph() -> dict[tuple[str, str], set[str]]:
    """(importer, imported) -> the kinds of import statement that make the edge (ours only)."""
    mods = modules()
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node, kind in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names]
            for target in targets:
                while target and target not in mods:  # `import egomem.x.y` of a non-module y: its package
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[(name, target)].add(kind)
    return edges


def find_cycles(edges: dict[tuple[str, str], set[str]], kinds: tuple[str, ...]) -> list[list[str]]:
    """Strongly connected components (Tarjan) of more than one module, over edges of these kinds;
    each as one cycle through it, written a -> b -> ... -> a."""
    graph: dict[str, list[str]] = defaultdict(list)
    for (a, b), k in sorted(edges.items()):
        if k & set(kinds):
            graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def strong(v: str) -> None:  # recursion depth is bounded by the module count (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(set(graph) | {b for bs in graph.values() for b in bs}):
        if v not in index:
            strong(v)
    return [_one_cycle(graph, comp) for comp in sorted(sccs)]


def _one_cycle(graph: dict[str, list[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp  # unreachable for a strongly connected component


def describe(cycle: list[str], edges: dict[tuple[str, str], set[str]]) -> str:
    return "".join(f"{a} -[{'+'.join(sorted(edges[(a, b)]))}]-> " for a, b in zip(cycle, cycle[1:])) + cycle[-1]


def report(edges: dict[tuple[str, str], set[str]]) -> str:
    strict = find_cycles(edges, STRICT)
    lazy = [c for c in find_cycles(edges, (*STRICT, "function")) if c not in strict]
    lines = [f"{len(strict)} cycle(s) over module + TYPE_CHECKING imports:"]
    lines += [f"  {describe(c, edges)}" for c in strict]
    lines.append(f"{len(lazy)} more closed only with function-level imports (not counted):")
    lines += [f"  {describe(c, edges)}" for c in lazy]
    return "\n".join(lines)


def test_the_graph_covers_the_three_packages():
    mods = modules()
    edges = build_graph()
    for pkg in PACKAGES:
        assert pkg in mods
    assert ("egomem.dialog.kv_cache", "egomem.kernels") in edges  # `from egomem.kernels import Impl`
    assert edges[("egomem.dialog.kv_cache", "egomem.kernels.decode_attention")] == {"function"}
    assert all(kinds <= {"module", "type_checking", "function"} for kinds in edges.values())


def test_the_cycle_finder_sees_type_checking_cycles_and_skips_lazy_ones():
    edges = {("a", "b"): {"module"}, ("b", "c"): {"module"}, ("c", "a"): {"type_checking"},
             ("d", "e"): {"module"}, ("e", "d"): {"function"}, ("c", "d"): {"module"}}
    assert find_cycles(edges, STRICT) == [["a", "b", "c", "a"]]
    assert find_cycles(edges, (*STRICT, "function")) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert describe(["a", "b", "c", "a"], edges) == "a -[module]-> b -[module]-> c -[type_checking]-> a"


def test_no_import_cycles():
    edges = build_graph()
    cycles = find_cycles(edges, STRICT)
    assert not cycles, "import cycles (edges labelled by kind):\n" + report(edges)


def test_dependencies_point_one_way_between_packages():
    """orchestrator -> egomem -> kernels, for every kind of import (lazy ones included)."""
    wrong = []
    for (a, b), kinds in sorted(build_graph().items()):
        in_orch = a == "egomem.orchestrator" or a.startswith("egomem.orchestrator.")
        in_kernels = a == "egomem.kernels" or a.startswith("egomem.kernels.")
        to_orch = b == "egomem.orchestrator" or b.startswith("egomem.orchestrator.")
        to_kernels = b == "egomem.kernels" or b.startswith("egomem.kernels.")
        if not in_orch and to_orch:
            wrong.append(f"{a} imports {b} ({'+'.join(sorted(kinds))}): egomem must not import the orchestrator")
        if in_kernels and not to_kernels:
            wrong.append(f"{a} imports {b} ({'+'.join(sorted(kinds))}): kernels import nothing of egomem")
    assert not wrong, "\n".join(wrong)


if __name__ == "__main__":
    print(report(build_graph()))
