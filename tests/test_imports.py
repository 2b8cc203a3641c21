"""The package's import graph: no circle among modules, no import from a lower layer to a
higher one (foundation < parts < engine < presentation < commands). Imports under
`if TYPE_CHECKING:` do not count (they never run); `from pkg import submodule` is an edge to
the submodule, not to the package's __init__.

KNOWN lists what is left to untangle (nothing now); the test fails on anything new, and on
a listed item that is gone (so the list only shrinks)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvbench

ROOT = Path(kvbench.__file__).parent
LAYERS = (
    ("foundation", ("kvbench", "kvbench.errors", "kvbench.units", "kvbench.console",
                    "kvbench.schema", "kvbench.paths", "kvbench.store", "kvbench.timing",
                    "kvbench.envinfo", "kvbench.registry", "kvbench.options",
                    "kvbench.topology", "kvbench.native", "kvbench.memory", "kvbench.plots")),
    ("parts", ("kvbench.kernels", "kvbench.models", "kvbench.probes", "kvbench.strategies",
               "kvbench.runtime.context", "kvbench.runtime.trace",
               "kvbench.runtime.breakdown", "kvbench.hwmodel")),
    ("engine", ("kvbench.runtime", "kvbench.suite", "kvbench.suite_spec", "kvbench.suite_jobs",
                "kvbench.suite_units",
                "kvbench.fleet", "kvbench.prefix", "kvbench.plan", "kvbench.compare",
                "kvbench.noise", "kvbench.derive", "kvbench.compare_study",
                "kvbench.probes.serve_sim",  # a probe that runs the model (kvbench.prefix)
                "kvbench.hwmodel.sweep")),  # projections at kvbench.plan's largest batch
    ("presentation", ("kvbench.render", "kvbench.report", "kvbench.summary",
                      "kvbench.html_report", "kvbench.plots.budget", "kvbench.present")),
    ("commands", ("kvbench.cli", "kvbench.experiment", "kvbench.experiment_spec")),
)
KNOWN_CIRCLES: set[tuple[str, ...]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test)
                       for stmt in node.body for n in ast.walk(stmt)}
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            else:
                continue
            edges[m] |= {t for t in targets if t in mods and t != m}
    return edges


def circles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(tuple(sorted(comp)))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    """The layer of the longest prefix that names the module."""
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1]


def upward(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, d) for m, ds in edges.items() for d in ds if layer(d) > layer(m)}


def test_no_new_import_circle() -> None:
    assert circles(graph()) == KNOWN_CIRCLES


def test_no_new_import_from_a_lower_layer_to_a_higher_one() -> None:
    assert upward(graph()) == KNOWN_UPWARD


def test_the_checks_can_fail() -> None:
    """A circle and an upward edge planted in a copy of the graph are found."""
    edges = {m: set(ds) for m, ds in graph().items()}
    edges["kvbench.units"].add("kvbench.schema")
    edges["kvbench.schema"].add("kvbench.units")
    assert ("kvbench.schema", "kvbench.units") in circles(edges)
    edges["kvbench.strategies.quest"].add("kvbench.cli")
    assert ("kvbench.strategies.quest", "kvbench.cli") in upward(edges)
