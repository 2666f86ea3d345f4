"""The import graph of edgeserve/ against the layers of README "Project layout": no import circles, and
no module importing a layer above its own.

The graph is read from the source with `ast`, so nothing is imported: `import a.b`, `from a import b`
(b a module or a name in a), relative imports, and `importlib.import_module("<constant>")`, wherever they
stand (module level, inside a function, under `if TYPE_CHECKING:`; a type-only import is a dependency
too). Importing `a.b.c` runs the `__init__.py` of `a` and `a.b` as well; those are not counted, so a
package's `__init__.py` stays free of imports that would run up (every one of them is small today).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "edgeserve"

# Bottom to top. A layer holds units (a name and the modules it is made of); a unit imports only from
# the units of lower layers, never from another unit of its own layer nor from above. A module belongs
# to the unit with the longest matching prefix: `edgeserve.hardware.probes` (pure reads of the box, which
# backends/ needs) is not part of `edgeserve.hardware` (the runtime plan, which loads models through
# backends/ and repository/), and `edgeserve.frontends.shm` (owned by the data plane) is not part of the
# frontends. README "Project layout" states the same table.
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    {  # 1: the vocabulary everything speaks
        "protocol": ("edgeserve.protocol",),
        "fsutil": ("edgeserve.fsutil",),
        "logs": ("edgeserve.logs",),
        "version": ("edgeserve",),  # edgeserve/__init__.py: __version__ only
        "probes": ("edgeserve.hardware.probes",),
    },
    {  # 2
        "config": ("edgeserve.config", "edgeserve.config_sections", "edgeserve.config_allowlist",
                   "edgeserve.settings_tools", "edgeserve.settings_reference"),
    },
    {"backends": ("edgeserve.backends",), "shm": ("edgeserve.frontends.shm",)},  # 3
    {"scheduling": ("edgeserve.scheduling",)},  # 4
    {"server": ("edgeserve.server",), "metrics": ("edgeserve.metrics",)},  # 5: the data plane
    {"repository": ("edgeserve.repository",), "frontends": ("edgeserve.frontends",)},  # 6
    {"hardware": ("edgeserve.hardware",), "client": ("edgeserve.client",),  # 7
     "settings_warnings": ("edgeserve.settings_warnings",)},
    {"app": ("edgeserve.app",), "bench": ("edgeserve.bench",), "video": ("edgeserve.video",)},  # 8
    {"ota": ("edgeserve.ota",)},  # 9
    {"fleet": ("edgeserve.fleet",)},  # 10
    {"supervisor": ("edgeserve.supervisor",)},  # 11
    {  # 12: every entry point: `edgeserve ...`, each package's command module, the Mender scripts
        "commands": ("edgeserve.__main__", "edgeserve.cli", "edgeserve.samples", "edgeserve.hardware.cli",
                     "edgeserve.repository.residency_cli", "edgeserve.bench.cli", "edgeserve.video.cli",
                     "edgeserve.ota.cli", "edgeserve.ota.mender_module", "edgeserve.ota.mender_inventory",
                     "edgeserve.fleet.fleet_cli"),
    },
)  # fmt: skip

# What still runs against the rules, each with the plan beside it. An entry that no longer applies
# fails too: they only shrink.
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()
KNOWN_CIRCLES: frozenset[frozenset[str]] = frozenset()


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a name imported from a module counts as that module)
    line: int

    def where(self) -> str:
        return f"{module_path(self.source)}:{self.line}"


def module_path(module: str) -> str:
    path = PACKAGE.parent / module.replace(".", "/")
    return f"{path.relative_to(PACKAGE.parent)}{'/__init__.py' if path.is_dir() else '.py'}"


@cache
def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _module_of(name: str) -> str | None:
    """The module that `name` (a module, or a name inside one) lives in, if it is one of ours."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.AST, module: str, path: Path) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:  # a submodule, or a name defined in `base`
            yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        yield node.args[0].value


@cache
def imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for name in _imported(node, module, path):
                target = _module_of(name) if name.startswith("edgeserve") else None
                if target is not None and target != module:
                    found.append(Import(module, target, getattr(node, "lineno", 0)))
    return tuple(dict.fromkeys(found))


def unit_of(module: str) -> tuple[int, str]:
    """(layer index, unit name) of a module: the unit whose prefix matches it longest."""
    best: tuple[int, int, str] | None = None
    for index, units in enumerate(LAYERS):
        for unit, prefixes in units.items():
            for prefix in prefixes:
                inside = module == prefix or module.startswith(prefix + ".")
                if inside and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), index, unit)
    assert best is not None, f"{module_path(module)} is in no layer: add it to LAYERS in tests/test_layers.py"
    return best[1], best[2]


def upward_imports(edges: Iterable[Import]) -> list[Import]:
    """Imports from one unit into another of the same or a higher layer."""
    found = []
    for edge in edges:
        (source_layer, source_unit), (target_layer, target_unit) = unit_of(edge.source), unit_of(edge.target)
        if source_unit != target_unit and target_layer >= source_layer:
            found.append(edge)
    return found


def circles(edges: Iterable[Import]) -> list[frozenset[str]]:
    """The modules that import each other in a loop (strongly connected components, Tarjan)."""
    graph: dict[str, list[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the module count (~250)
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, []):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def shortest_loop(circle: frozenset[str], edges: Iterable[Import]) -> list[Import]:
    """One shortest loop of imports in a circle: a big circle is told by one loop, not all its edges."""
    inside: dict[str, list[Import]] = {}
    for edge in edges:
        if edge.source in circle and edge.target in circle:
            inside.setdefault(edge.source, []).append(edge)
    best: list[Import] = []
    for start in sorted(circle):  # breadth first from each module back to itself
        paths: dict[str, list[Import]] = {start: []}
        frontier = [start]
        loop: list[Import] = []
        while frontier and not loop:
            following = []
            for node, edge in ((n, e) for n in frontier for e in inside.get(n, [])):
                if edge.target == start:
                    loop = [*paths[node], edge]
                    break
                if edge.target not in paths:
                    paths[edge.target] = [*paths[node], edge]
                    following.append(edge.target)
            frontier = following
        if loop and (not best or len(loop) < len(best)):
            best = loop
    return best


def _unit_name(module: str) -> str:
    layer, unit = unit_of(module)
    return f"{unit} (layer {layer + 1})"


def test_every_module_has_a_layer() -> None:
    for module in modules():
        unit_of(module)


def test_no_import_circles() -> None:
    problems = []
    for circle in circles(imports()):
        if circle in KNOWN_CIRCLES:
            continue
        ties = "".join(f"\n  {e.where()} imports {e.target}" for e in shortest_loop(circle, imports()))
        problems.append(
            f"import circle ({len(circle)} modules), for one:{ties}\n  fix: one side must not know the "
            "other: move what both need into a module below them, or hand the lower one a callback or a "
            "small Protocol instead of the higher one"
        )
    assert not problems, "\n".join(problems)


def test_no_upward_imports() -> None:
    problems = []
    for e in upward_imports(imports()):
        if (e.source, e.target) in KNOWN_UPWARD:
            continue
        source, target = _unit_name(e.source), _unit_name(e.target)
        same = unit_of(e.source)[0] == unit_of(e.target)[0]
        problems.append(
            f"{e.where()}: {e.source} in {source} imports {e.target} in {target}"
            f"{', a unit of the same layer' if same else ''}; fix: move what it takes from there down into "
            f"{source} or below, or pass it in (a callback or a small Protocol)"
        )
    assert not problems, "each unit imports only from the layers below its own:\n" + "\n".join(problems)


def test_known_exceptions_still_apply() -> None:
    """A fixed exception leaves its list, so the lists only shrink."""
    fixed = KNOWN_UPWARD - {(e.source, e.target) for e in upward_imports(imports())}
    assert not fixed, f"fixed: remove from KNOWN_UPWARD: {sorted(fixed)}"
    closed = KNOWN_CIRCLES - set(circles(imports()))
    assert not closed, f"fixed: remove from KNOWN_CIRCLES: {[sorted(c) for c in closed]}"


def test_the_graph_is_read() -> None:
    """Module-level, function-level and TYPE_CHECKING imports, `from package import module`, and
    importlib.import_module with a constant are all found; a name imported from a module counts as it."""
    found = {(e.source, e.target) for e in imports()}
    assert ("edgeserve.cli", "edgeserve.supervisor.supervisor") in found  # inside a function
    assert ("edgeserve.repository.served", "edgeserve.server.contracts") in found  # TYPE_CHECKING
    assert ("edgeserve.server.ensemble_steps", "edgeserve.server.validation") in found  # a module
    assert ("edgeserve.config", "edgeserve.config_sections") in found  # names from a module
    assert ("edgeserve.frontends.http.routes", "edgeserve.metrics") in found  # importlib


def test_relative_imports_are_read() -> None:
    tree = ast.parse(
        "from .validation import compiled\nfrom .. import logs\nfrom ..protocol.errors import Status"
    )
    path = PACKAGE / "server" / "dataplane.py"
    names = [name for node in tree.body for name in _imported(node, "edgeserve.server.dataplane", path)]
    assert names == ["edgeserve.server.validation", "edgeserve.logs", "edgeserve.protocol.errors"]


def test_a_new_violation_fails() -> None:
    """The checks catch what they are for: one import added to the real graph, from protocol/ (layer 1)
    up to the command line, which imports protocol/ already, is both an upward import and a circle."""
    edges = (*imports(), Import("edgeserve.protocol.errors", "edgeserve.cli", 1))
    assert ("edgeserve.protocol.errors", "edgeserve.cli") in {
        (e.source, e.target) for e in upward_imports(edges)
    }
    assert any({"edgeserve.protocol.errors", "edgeserve.cli"} <= circle for circle in circles(edges))


def test_packages_above_a_lower_unit_import_nothing() -> None:
    """Importing edgeserve.hardware.probes runs edgeserve/hardware/__init__.py first, which the graph
    does not count: such an __init__.py (of a package in a higher layer than a unit inside it) must stay
    a docstring, or importing the lower unit would pull in the higher layer."""
    parents = {
        parent
        for layer, units in enumerate(LAYERS)
        for prefixes in units.values()
        for parent in (prefix.rpartition(".")[0] for prefix in prefixes)
        if parent in modules() and unit_of(parent)[0] > layer
    }
    assert "edgeserve.hardware" in parents  # probes/ sits below it
    importing = sorted(e.where() for e in imports() if e.source in parents)
    assert not importing, f"keep these __init__.py files free of imports: {importing}"
