"""No import circles: the import graph of the installed packages has no cycle.

The graph is read from the source with ``ast`` (nothing is imported: the tests
take a fraction of a second): every ``import`` and ``from ... import`` anywhere in
a module counts, at the top, inside a function, or under ``TYPE_CHECKING``. A
circle that only type checking or a late import closes still ties the modules
together: neither can be read, tested or replaced without the other.

The folders are laid out as pyproject's ``package-dir`` installs them:
``engine/``, ``sessions/`` and ``clients/`` are ``wsinfer.engine``,
``wsinfer.sessions`` and ``wsinfer.clients``.

Run as a script (``python tests/test_import_graph.py``) to print every cycle.
"""

from __future__ import annotations

import ast
import functools
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Import name -> folder, as pyproject's package-dir maps them.
PACKAGES = {
    "wsinfer": ROOT / "wsinfer",
    "wsinfer.engine": ROOT / "engine",
    "wsinfer.sessions": ROOT / "sessions",
    "wsinfer.clients": ROOT / "clients",
}

# Folders under a package that hold no Python of ours.
SKIPPED_DIRS = {"__pycache__", "node_modules"}

# Circles tolerated, each as its modules in import order from the smallest name
# (as the failure prints them). Empty since the last ones were removed; never
# to be added to: a cycle not listed here fails the test.
ALLOWED_CYCLES: set[tuple[str, ...]] = set()

Graph = dict[str, set[str]]


def module_files() -> dict[str, Path]:
    """Every module of the installed packages, by its import name."""
    modules: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder)
            if SKIPPED_DIRS.intersection(relative.parts):
                continue
            parts = list(relative.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _base(module: str, is_package: bool, level: int) -> str:
    # A relative import's anchor: the module's package, then one up per dot.
    parts = module.split(".")
    if not is_package:
        parts.pop()
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    # The dotted names one import statement may bind to a module.
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = _base(module, is_package, node.level)
            target = f"{base}.{node.module}" if node.module else base
        else:
            target = node.module or ""
        yield target
        for alias in node.names:
            yield f"{target}.{alias.name}"


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    # Every statement, however deeply nested (an import is always one); the
    # expressions, nine nodes in ten, are not walked.
    holders = (ast.stmt, ast.excepthandler, ast.match_case)
    work: list[ast.AST] = [tree]
    while work:
        node = work.pop()
        yield node
        work.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, holders))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    # The most specific module of ours that the name is or lies in.
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.cache  # read once per run: the tests share it and never change it
def import_graph() -> Graph:
    """Module -> the modules of ours it imports (anywhere in its source)."""
    modules = module_files()
    graph: Graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _statements(tree):
            for name in _imported(node, module, is_package):
                target = _resolve(name, modules)
                if target is not None and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def _components(graph: Graph) -> list[list[str]]:
    # Tarjan's strongly connected components, iteratively (no recursion limit).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _canonical(cycle: list[str]) -> tuple[str, ...]:
    # One spelling per cycle: rotated to start at its smallest module.
    start = cycle.index(min(cycle))
    return tuple(cycle[start:] + cycle[:start])


def cycles(graph: Graph) -> set[tuple[str, ...]]:
    """Every elementary cycle of the graph, each in its canonical rotation.

    Within each strongly connected component, a depth-first walk from each
    member finds the cycles whose smallest module it is. The components here
    have a handful of modules, so the full enumeration is cheap; a large one
    is a failure in its own right.
    """
    found: set[tuple[str, ...]] = set()
    for component in _components(graph):
        if len(component) < 2:
            continue
        members = set(component)
        for start in component:
            allowed = {m for m in members if m >= start}
            path = [start]
            work = [iter(sorted(graph[start] & allowed))]
            while work:
                child = next(work[-1], None)
                if child is None:
                    work.pop()
                    path.pop()
                elif child == start:
                    found.add(_canonical(list(path)))
                elif child not in path:
                    path.append(child)
                    work.append(iter(sorted(graph[child] & allowed)))
    return found


def _spell(cycle: tuple[str, ...]) -> str:
    return " -> ".join([*cycle, cycle[0]])


def test_the_graph_reads_every_package() -> None:
    # A wrong folder mapping would read an empty graph and pass for nothing.
    graph = import_graph()
    for package in PACKAGES:
        assert package in graph
    assert "wsinfer.sessions.store" in graph["wsinfer.handlers"]
    assert any(target.startswith("wsinfer.engine.") for target in graph["wsinfer.engine.process"])


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    new = sorted(found - ALLOWED_CYCLES)
    assert not new, "import cycles:\n" + "\n".join(_spell(cycle) for cycle in new)
    gone = sorted(ALLOWED_CYCLES - found)
    if gone:
        # Not a failure (the change that removed it may land before the one
        # that shortens this list), but the entry should go.
        stale = "; ".join(map(_spell, gone))
        warnings.warn(f"no longer a cycle, remove from ALLOWED_CYCLES: {stale}", stacklevel=1)


def test_allowed_cycles_are_spelt_as_found() -> None:
    # An entry in another rotation would never match, and its cycle would fail.
    for cycle in ALLOWED_CYCLES:
        assert cycle == _canonical(list(cycle)), _spell(cycle)


def test_the_doors_never_import_the_server() -> None:
    # server.py builds the doors and hands them protocols (wsinfer/services.py);
    # the base fan-in never picks its cluster subclass (server.py does).
    graph = import_graph()
    doors = [m for m in graph if m.startswith("wsinfer.http") or m == "wsinfer.plain_routes"]
    assert doors
    for module in doors:
        assert "wsinfer.server" not in graph[module], module
    assert "wsinfer.fanin_cluster" not in graph["wsinfer.fanin"]


def test_the_graph_sees_late_and_type_checking_imports() -> None:
    # Both kinds close circles too: a reader that missed them would pass them.
    graph = import_graph()
    assert "wsinfer.clients.client" in graph["wsinfer"]  # inside __getattr__
    assert "wsinfer.server" in graph["wsinfer.startup"]  # under TYPE_CHECKING


if __name__ == "__main__":
    everything = sorted(cycles(import_graph()))
    print("\n".join(_spell(cycle) for cycle in everything) or "no cycles")
    sys.exit(1 if set(everything) - ALLOWED_CYCLES else 0)
