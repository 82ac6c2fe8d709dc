"""The import graph of one of our packages, read from the source with ast (issue 19 item 6).

Every import counts, at the top of a module or inside a function: a lazy import still makes the importing
module depend on the imported one, so a circle it closes is a circle. Three readings make the graph say
what Python does rather than what the text looks like:

- A submodule's parent packages are imported before it, whatever it writes: importing `codecs.base` from
  outside runs `codecs/__init__` first (kvquant's codec registry, which imports every family), so it is an
  edge to `codecs` as well as to `codecs.base`. Inside a package its own `__init__` is already running or
  done, so `from . import x` in `codecs/fp8.py` is an edge to `codecs.x` alone, never to `codecs`.
- A package `__init__` that imports its submodules (kvquant.paging, kvquant.codecs) is a node like any
  other: importing a name from it (`from kvquant.paging import KVStore`) is an edge to the package, and so
  through it to every submodule it imports.
- A facade (kvquant's own `__init__`, PEP 562, names resolved from strings on first use) is a table of names,
  not a module of its own: `from kvquant import QuantizedCache`, and `kvquant.QuantizedCache` after
  `import kvquant`, are edges to the module that defines the name (kvquant.cache), read from the facade's
  table. The facade itself is no node.

Names are relative to the package: `cache`, `paging.pool`, `codecs.base`.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_names(root: Path, mounts: dict[str, Path] | None = None) -> dict[str, Path]:
    """module name relative to the package (`paging` for paging/__init__.py, "" for the root's) -> path.
    mounts: subpackages installed from another folder (setuptools package-dir), such as
    `{"kernels": REPO / "kernels"}` for kvquant.kernels."""
    out = {}
    for prefix, folder in [("", root), *(mounts or {}).items()]:
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([*([prefix] if prefix else []), *parts])] = path
    return out


def _package_of(name: str, path: Path) -> str:
    """The package a module's relative imports start from: itself for an __init__, else its parent."""
    if path.name == "__init__.py":
        return name
    return name.rsplit(".", 1)[0] if "." in name else ""


def _resolve_from(node: ast.ImportFrom, package: str, absolute: str) -> str | None:
    """The module a `from X import ...` reads (relative to our package), or None if it is not ours."""
    if node.level:
        base = package.split(".") if package else []
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join([*base, *([node.module] if node.module else [])])
    if node.module == absolute:
        return ""
    if node.module and node.module.startswith(absolute + "."):
        return node.module.removeprefix(absolute + ".")
    return None


def _attribute_uses(tree: ast.AST, alias: str) -> set[str]:
    """`alias.a.b` chains in a module: {"a", "a.b"} (what `import kvquant` is then used for)."""
    out = set()
    for node in ast.walk(tree):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == alias and parts:
            parts.reverse()
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node of a module except what sits under `if TYPE_CHECKING:` (imports for annotations only,
    which never run: no circle at import time, and the usual way to name a type without importing it)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_edges(
    root: Path, absolute: str, facade: dict[str, str] | None = None, mounts: dict[str, Path] | None = None
) -> dict[str, dict[str, list[int]]]:
    """module -> {imported module: the lines that import it}, module names relative to `absolute`.

    root: the package's folder; absolute: its import name (`kvquant`, `kvquant.eval`); facade: when the
    root `__init__` is a PEP 562 facade, its table of public name -> defining module (kvquant._LAZY);
    mounts: subpackages from other folders (`module_names`)."""
    modules = module_names(root, mounts)

    def targets_of(mod: str, names: list[str]) -> list[str]:
        """What `from <mod> import <names>` depends on: each name that is a module, else <mod> itself."""
        out = []
        for n in names:
            full = f"{mod}.{n}" if mod else n
            if full in modules:
                out.append(full)
            elif mod == "" and facade is not None and n in facade:
                out.append(facade[n])
            else:
                out.append(mod)
        return out

    nodes = [m for m in modules if m or facade is None]
    edges: dict[str, dict[str, list[int]]] = {m: {} for m in nodes}
    for name in nodes:
        path = modules[name]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = _package_of(name, path)
        found: list[tuple[str, int]] = []
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.ImportFrom):
                mod = _resolve_from(node, package, absolute)
                if mod is not None:
                    found += [(t, node.lineno) for t in targets_of(mod, [a.name for a in node.names])]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == absolute:  # `import kvquant`: what it is used for (kvquant.memory.x)
                        uses = _attribute_uses(tree, a.asname or a.name)
                        found += [(u, node.lineno) for u in uses if u in modules]
                        if facade is not None:
                            found += [(facade[u], node.lineno) for u in uses if u in facade]
                    elif a.name.startswith(absolute + "."):
                        found.append((a.name.removeprefix(absolute + "."), node.lineno))
        ancestors = {".".join(name.split(".")[:i]) for i in range(name.count(".") + 1)}
        for target, line in found:
            # importing codecs.base runs codecs/__init__ first (there: the codec registry) — an edge too
            parents = [".".join(target.split(".")[:i]) for i in range(1, target.count(".") + 1)]
            for t in (*parents, target):
                if t in edges and t != name and t not in ancestors:
                    lines = edges[name].setdefault(t, [])
                    if line not in lines:
                        lines.append(line)
    return edges


def import_graph(
    root: Path, absolute: str, facade: dict[str, str] | None = None, mounts: dict[str, Path] | None = None
) -> dict[str, set[str]]:
    """module -> the modules of the package it imports anywhere (see `import_edges`)."""
    return {m: set(targets) for m, targets in import_edges(root, absolute, facade, mounts).items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def edges_within(edges: dict[str, dict[str, list[int]]], component: list[str]) -> list[str]:
    """The edges `a -> b (lines)` inside one circle, for a failure message that says what to cut."""
    members = set(component)
    return [f"{a} -> {b} (line {', '.join(map(str, sorted(set(edges[a][b]))))})"
            for a in sorted(members) for b in sorted(edges[a].keys() & members)]
