"""The package's import graph, read from its source: no cycles.

Every module of the installed package is parsed with `ast` (nothing is imported), so an
import inside a function counts as much as one at the top of a module: a cycle hidden in a
function is still a cycle, it only fails later. Imports under `if TYPE_CHECKING:` never
run and are left out. `import a.b` and `from a import b` (b a module) point at `a.b`;
`from a import name` (name not a module) points at `a`, which for a package is its
`__init__`. The parent packages Python also initialises on the way are not edges: every
package whose `__init__` re-exports its submodules would otherwise be a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from package_source import modules

def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that can run: `if TYPE_CHECKING:` bodies are skipped."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in known else source)
    edges = set()
    for target in targets:
        while target and target not in known:  # `import vlmbatch.x.y` of a name inside x
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[tuple[frozenset[str], list[str]]]:
    """Each strongly connected component of more than one module (Tarjan's algorithm,
    iteratively), with one cycle through it as a path `a -> b -> ... -> a`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return [(frozenset(component), _path_through(component, graph)) for component in components]


def _path_through(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest cycle from the component's first module back to itself."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {sorted(component)}")


def test_the_package_has_no_import_cycles() -> None:
    unexpected = [path for _, path in cycles(import_graph())]
    assert not unexpected, "import cycles (function-level imports included):\n" + "\n".join(
        " -> ".join(path) for path in unexpected
    )


def test_the_cycle_finder_finds_cycles_and_only_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert cycles(graph) == [(frozenset("abc"), ["a", "b", "c", "a"])]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_and_relative_imports_are_edges(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "import pkg\n"  # a package: its __init__
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg import c\n"
        "def f():\n    from . import b\n    from .b import thing\n    import pkg.d.inner\n"
    )
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"}
    assert imports_of("pkg.a", package / "a.py", known) == {"pkg", "pkg.b", "pkg.d"}



# The package layers of docs/structures.md: which packages each may import (itself always).
# `families.<name>` stands for every family's folder; `errors` and `lifeline` are below everything.
LAYERS: dict[str, set[str]] = {
    "cli": {"quantization", "job", "server", "bench", "workers", "engine", "families", "io", "media", "config", "testing"},
    "workers": {"job", "io", "media", "config"},
    "bench": {"quantization", "job", "server", "workers", "engine", "families", "families.<name>", "io", "media", "structured", "config",
              "kernels", "testing", "chat"},
    "server": {"engine", "families", "media", "chat", "config", "structured", "vlmbatch"},
    "job": {"engine", "families", "io", "media", "structured", "chat", "workers", "config"},
    "io": {"structured", "chat", "config", "job"},
    "engine": {"quantization", "families", "kernels", "media", "chat", "config", "structured"},
    "families.<name>": {"engine", "families", "media", "testing", "kernels"},
    "families": {"quantization", "media", "chat"},
    "structured": set(),
    "media": {"config"},
    "chat": set(),
    "config": set(),
    "lifeline": set(),
    "quantization": set(),
    "kernels": set(),
    "testing": {"families", "media", "kernels"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "vlmbatch"
    if parts[1] == "families" and len(parts) > 2 and parts[2] not in ("registry", "prompt", "adapter", "processor_adapter"):
        return "families.<name>"
    return parts[1]


def test_packages_import_only_the_layers_docs_structures_names() -> None:
    """docs/structures.md's layer diagram stays true to the imports."""
    stray = set()
    for module, imported in import_graph().items():
        layer = _layer(module)
        for other in imported:
            target = _layer(other)
            if target not in (layer, "errors", "lifeline") and layer in LAYERS and target not in LAYERS[layer]:
                stray.add(f"{module} -> {other}")
    assert not stray, "imports the layers in docs/structures.md do not allow:\n" + "\n".join(sorted(stray))
