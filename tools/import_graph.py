"""oslo's import graph: the import cycles among its modules, and the private names that cross modules.

Usage: ``python tools/import_graph.py [ROOT]`` (from anywhere; standard library only; ROOT: the directory holding
``oslo/``, by default this repository). Exit status 1 if it finds a cycle or a private name imported from another
module, 0 otherwise.

What it counts, reading every ``oslo/**.py`` with :mod:`ast` (nothing is imported):

* An edge A -> B for each import in A of an oslo module B, wherever the import statement is: at module level
  (class bodies and ``try`` blocks included) or inside a function (a *lazy* import, run at the first call).
  Imports under ``if TYPE_CHECKING:`` are never run; they are listed as typing-only and left out of the graph.
* Relative imports are resolved. ``from oslo.a import x`` is an edge to ``oslo.a.x`` when that is a module; when
  ``oslo.a`` is a package whose ``__init__`` re-exports ``x`` from one of its submodules, it is an edge to that
  submodule (the module that defines ``x``), not to the package: otherwise a submodule taking a sibling's name
  through the package would look like a cycle with the package's ``__init__`` that it does not have (at run time
  it works when the ``__init__`` imports the defining submodule first, and fails at once otherwise). ``import
  oslo.a`` (or ``from oslo import a``) of a package is an edge to its ``__init__``, which imports what it imports.
  Python runs a package's ``__init__`` before any of its submodules; that implicit step is not an edge.
* A cycle is a strongly connected component of more than one module, lazy edges included: a lazy import that
  closes a cycle only hides it. For each one the script prints a shortest cycle through the component, each edge
  with its place and kind. Lazy imports that close no cycle (of an optional or heavy dependency, or to keep
  ``import oslo`` cheap) are fine; they are listed for information.
* A private import is ``from oslo.a import _x`` (or ``mod._x`` on a name bound to an imported oslo module), where
  ``_x`` starts with an underscore, is not a dunder, and is defined in another module than the importer; or any
  name taken from a private module (``oslo.kernels._triton``) outside the package that holds it.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "oslo"


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    kind: str  # "module", "lazy" or "typing"


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted module name: path}`` of every module of the package."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Reader(ast.NodeVisitor):
    """The oslo imports of one module, with the names they bind (for ``mod._x``)."""

    def __init__(self, name: str, is_package: bool, modules: dict[str, Path]) -> None:
        self.name, self.is_package, self.modules = name, is_package, modules
        self.imports: list[tuple[str, str | None, int, str]] = []  # (module, name taken from it or None, line, kind)
        self.bound: dict[str, str] = {}  # local name -> oslo module it refers to
        self.attributes: list[tuple[str, str, int]] = []  # (module, private attribute, line)
        self._depth = 0
        self._typing = 0

    def _kind(self) -> str:
        return "typing" if self._typing else "lazy" if self._depth else "module"

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        typing_only = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
        if not typing_only:
            self.generic_visit(node)
            return
        self._typing += 1
        for child in node.body:
            self.visit(child)
        self._typing -= 1
        for child in node.orelse:
            self.visit(child)

    def _existing(self, dotted: str) -> str | None:
        """The longest prefix of ``dotted`` that is an oslo module."""
        parts = dotted.split(".")
        while parts:
            if ".".join(parts) in self.modules:
                return ".".join(parts)
            parts.pop()
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            module = self._existing(alias.name)
            if module is None:
                continue
            self.imports.append((module, None, node.lineno, self._kind()))
            if alias.asname:
                self.bound[alias.asname] = module

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.name.split(".")
            if not self.is_package:
                package.pop()
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if self._existing(base) != base:
            return
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in self.modules:
                self.imports.append((submodule, None, node.lineno, self._kind()))
                self.bound[alias.asname or alias.name] = submodule
            else:
                self.imports.append((base, alias.name, node.lineno, self._kind()))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and _is_private(node.attr):
            self.attributes.append((node.value.id, node.attr, node.lineno))
        self.generic_visit(node)


def read(modules: dict[str, Path]) -> dict[str, _Reader]:
    readers = {}
    for name, path in modules.items():
        reader = _Reader(name, path.name == "__init__.py", modules)
        reader.visit(ast.parse(path.read_text(), str(path)))
        readers[name] = reader
    return readers


def defining_module(module: str, name: str, readers: dict[str, _Reader], seen: frozenset = frozenset()) -> str:
    """The module that defines ``name`` when it is taken from ``module``: a package's ``__init__`` that re-exports
    it (a module-level ``from <submodule> import name``) hands it on to that submodule."""
    reader = readers[module]
    if not reader.is_package or module in seen:
        return module
    for source, taken, _, kind in reader.imports:
        if taken == name and kind == "module" and source.startswith(module + "."):
            return defining_module(source, name, readers, seen | {module})
    return module


def graph(readers: dict[str, _Reader], root: Path = ROOT) -> tuple[list[Edge], list[str]]:
    """The edges between oslo modules, and the private names that cross modules (as printable lines)."""
    edges, private = [], []
    for name, reader in readers.items():
        path = reader.modules[name].relative_to(root)
        for module, taken, line, kind in reader.imports:
            target = defining_module(module, taken, readers) if taken else module
            if target != name:
                edges.append(Edge(name, target, line, kind))
            owner = target.rsplit(".", 1)[0]  # a private module is its package's own
            inside = name == owner or name.startswith(owner + ".")
            if any(_is_private(part) for part in target.split(".")) and not inside:
                private.append(f"{path}:{line}: {target}{'.' + taken if taken else ''} (a private module)")
            elif taken and _is_private(taken) and target != name:
                private.append(f"{path}:{line}: from {module} import {taken}")
        for alias, attribute, line in reader.attributes:
            module = reader.bound.get(alias)
            if module is not None and module != name:
                private.append(f"{path}:{line}: {alias}.{attribute} ({module}.{attribute})")
    return edges, private


def components(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    successors: dict[str, list[str]] = {node: [] for node in nodes}
    for edge in edges:
        successors[edge.source].append(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(successors[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(successors[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def shortest_cycle(component: list[str], edges: list[Edge]) -> list[Edge]:
    """A shortest cycle through the component's first module (breadth-first search inside the component)."""
    members = set(component)
    inside = [e for e in edges if e.source in members and e.target in members]
    start = component[0]
    came_by: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in inside:
            if edge.source != node:
                continue
            if edge.target == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, came_by[path[0].source])
                return path
            if edge.target not in came_by:
                came_by[edge.target] = edge
                queue.append(edge.target)
    return []


def main(root: Path = ROOT) -> int:
    modules = module_files(root)
    readers = read(modules)
    edges, private = graph(readers, root)
    runtime = [e for e in edges if e.kind != "typing"]
    cycles = components(sorted(modules), runtime)
    component_of = {module: i for i, component in enumerate(cycles) for module in component}

    def where(edge: Edge) -> str:
        return f"{modules[edge.source].relative_to(root)}:{edge.line}"

    for component in cycles:
        print(f"cycle among {len(component)} modules: {', '.join(component)}")
        for edge in shortest_cycle(component, runtime):
            print(f"  {edge.source} -> {edge.target}  ({edge.kind}, {where(edge)})")
    for line in private:
        print(f"private name: {line}")
    lazy = sorted({(e.source, e.target, where(e)) for e in runtime if e.kind == "lazy"})
    for source, target, place in lazy:
        closes = source in component_of and component_of[source] == component_of.get(target)
        note = "  <- closes a cycle" if closes else ""
        print(f"lazy import: {source} -> {target}  ({place}){note}")
    for edge in (e for e in edges if e.kind == "typing"):
        print(f"typing-only import: {edge.source} -> {edge.target}  ({where(edge)})")
    distinct = {(e.source, e.target) for e in runtime}
    print(f"{len(modules)} modules, {len(distinct)} imports, {len(cycles)} cycles, {len(private)} private imports")
    return 1 if cycles or private else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT))
