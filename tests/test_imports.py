"""Imports flow one way: no import cycle anywhere in the package or the benchmarks, and the dispatch core is layered.

Every import statement counts, wherever it stands: at module level, inside a function (a "late" import hides a cycle,
it does not remove it) and under ``if TYPE_CHECKING:``. ``from pkg import name`` counts as an import of the submodule
``pkg.name`` when there is one, else of ``pkg``. The implicit import of parent packages does not count (every module
of ours would then import ``fly_lightning/__init__``, which imports the public API).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import fly_lightning

ROOT = Path(fly_lightning.__file__).resolve().parents[1]
# installed name -> folder
PACKAGES = {"fly_lightning": "fly_lightning"}

# The dispatch core, bottom first: each module may import only those before it.
CORE = ["_files", "backends", "registry", "policy", "tuning", "dispatch_log", "dispatch", "dtensor"]
# Above the core, in order; a layer may import its own modules and every layer below, never one above.
LAYERS = [
    [f"fly_lightning.{m}" for m in CORE],
    ["fly_lightning.quant.formats"],  # number formats (torch only), under the MX operators
    ["fly_lightning.ops"],
    ["fly_lightning.kernels"],
    ["fly_lightning.modules"],
    ["fly_lightning.transform"],
    ["fly_lightning.quant"],  # the MX config and module, on the MX operators
    ["fly_lightning.strategies", "fly_lightning.support"],
    ["fly_lightning.callbacks", "fly_lightning.recipes", "fly_lightning"],
]


def _modules(packages: dict[str, str]) -> dict[str, Path]:
    out = {}
    for name, folder in packages.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts]) if parts else name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` (at ``path``) imports, by any import statement in the file."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = subs if len(subs) == len(node.names) else [*subs, base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` names module a.b.c; a.b.c.attr -> a.b.c
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache
def _graph_of(packages: tuple[tuple[str, str], ...]) -> dict[str, set[str]]:
    mods = _modules(dict(packages))
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _graph(packages: dict[str, str]) -> dict[str, set[str]]:
    return _graph_of(tuple(packages.items()))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        scc.append(w)
                        if w == v:
                            break
                    if len(scc) > 1:
                        out.append(sorted(scc))
    return out


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_finder_sees_late_and_type_checking_imports(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n"
        "def f():\n    from p.b import x\n    import p.c\n"
    )
    assert _imports("p.m", mod, {"p", "p.a", "p.b", "p.c", "p.m"}) == {"p.a", "p.b", "p.c"}


def test_no_import_cycle_in_the_package():
    assert _cycles(_graph(PACKAGES)) == []


def test_no_import_cycle_in_the_benchmarks():
    assert _cycles(_graph({"benchmarks": "benchmarks"})) == []


def test_benchmark_scripts_import_no_private_names_of_each_other():
    mods = _modules({"benchmarks": "benchmarks"})
    bad = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
                bad += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []


@pytest.mark.parametrize("module", sorted(_graph(PACKAGES)))
def test_imports_flow_down_the_layers(module):
    graph = _graph(PACKAGES)
    up = sorted(t for t in graph[module] if _layer(t) > _layer(module))
    assert up == [], f"{module} imports from a layer above it"
    if module.startswith("fly_lightning.") and module.removeprefix("fly_lightning.") in CORE:
        rank = CORE.index(module.removeprefix("fly_lightning."))
        core_deps = [t.removeprefix("fly_lightning.") for t in graph[module] if _layer(t) == 0]
        assert [d for d in core_deps if CORE.index(d) >= rank] == [], f"{module} imports a core module above it"
