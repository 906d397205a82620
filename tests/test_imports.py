"""The package's import graph, read from the source: every import statement, function-level ones included.

Contracts: no import cycle anywhere in src/nanotitan (DESIGN §2); config/config.py, which every layer reads, imports
nothing of the package but config/errors.py, config/parse.py (values as their types) and config/hf_config.py (pure
config mapping); model/ never imports parallel/ or plan/, data/ never imports model/ or parallel/.

An edge A -> B means that running A's code can import B: `import`/`from ... import` anywhere in A (relative
imports resolved, `from pkg import mod` naming the submodule), plus the `__init__` of every package on B's path
that is not one of A's own (Python runs `plan/__init__.py`, which imports the whole planner, before `plan.cost`).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "nanotitan"


def _modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__.py)."""
    out = {}
    for path in sorted((src / PKG).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(module: str, is_pkg: bool, node: ast.AST, known: set[str]) -> list[str]:
    """The package modules one import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PKG]
    assert isinstance(node, ast.ImportFrom)
    if node.level:  # relative: from the importer's package, one level up per extra dot
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + (node.module.split(".") if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != PKG:
        return []
    # `from pkg import mod` imports the submodule; `from mod import name` the module
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
    return subs + ([target] if len(subs) < len(node.names) else [])


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """{module: modules its code can import} (module docstring), self-edges dropped."""
    mods = _modules(src)
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        is_pkg = path.name == "__init__.py"
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}  # itself and its parents
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(module, is_pkg, node, known):
                    parts = t.split(".")
                    # the target and every package __init__ on its way (a module's own packages already run)
                    edges |= {p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                              if p in known and p not in own}
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan): each one is a knot of cycles."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycle():
    """No module can reach itself through imports, function-level ones included."""
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_config_is_a_leaf():
    """config/config.py imports only errors.py, its value parsing (parse.py), the memory arithmetic of fits.py
    (with hardware.py's host figures and counts.py's parameter counts, which import nothing) and the pure HF config
    mapping, so anything can read the config; the config package's __init__ re-exports config.py alone."""
    graph = import_graph()
    leaf = {f"{PKG}.config.errors", f"{PKG}.config.hf_config", f"{PKG}.config.config", f"{PKG}.config.parse",
            f"{PKG}.config.fits", f"{PKG}.config.hardware", f"{PKG}.config.counts", f"{PKG}.config.tp_rules",
            f"{PKG}.config.cp_rules", f"{PKG}.config.placement_rules", f"{PKG}.config.controls_rules",
            f"{PKG}.config.dispatch_rules", f"{PKG}.config.run_rules", f"{PKG}.config.elastic_rules",
            f"{PKG}.config.layout", f"{PKG}.config.fp8_rules",
            f"{PKG}.config.packed_rules"}
    assert not graph[f"{PKG}.config.counts"] and graph[f"{PKG}.config.layout"] <= {f"{PKG}.config.errors"}
    assert graph[f"{PKG}.config.fits"] <= leaf and graph[f"{PKG}.config.hardware"] <= leaf
    assert graph[f"{PKG}.config.config"] <= leaf
    assert graph[f"{PKG}.config.hf_config"] <= leaf
    assert graph[f"{PKG}.config.parse"] <= {f"{PKG}.config.errors", f"{PKG}.config"}
    assert graph[f"{PKG}.config"] <= leaf


def _fold_products(path: Path) -> list[int]:
    """Lines of `path` whose code multiplies exactly the ep, cp and tp degrees (names or attributes, any order):
    the experts' fold written out (comments and strings are not code)."""
    def leaves(n: ast.AST) -> list[str] | None:
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
            a, b = leaves(n.left), leaves(n.right)
            return None if a is None or b is None else a + b
        name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else None
        return [name] if name else None

    tree = ast.parse(path.read_text())
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)
            and not (isinstance(parents.get(n), ast.BinOp) and isinstance(parents[n].op, ast.Mult))  # whole products
            and sorted(leaves(n) or []) == ["cp", "ep", "tp"]]


def test_the_expert_fold_has_one_home():
    """The rule that a stage's experts are sharded over ep*cp*tp ranks is written once (config/layout.py:
    `expert_ranks`); dims, the shard spec, the config rules and the planner call it, so no copy can drift."""
    homes = {f"{path.relative_to(SRC)}:{line}" for path in _modules().values() for line in _fold_products(path)}
    assert len(homes) == 1 and next(iter(homes)).startswith(f"{PKG}/config/layout.py:"), sorted(homes)


def test_layers_import_downward_only():
    """model/ never imports parallel/ or plan/ (a shard spec receives counts); data/ never imports model/ or parallel/."""
    graph = import_graph()
    for module, edges in graph.items():
        if module.startswith(f"{PKG}.model"):
            assert not {e for e in edges if e.startswith((f"{PKG}.parallel", f"{PKG}.plan"))}, module
        if module.startswith(f"{PKG}.data"):
            assert not {e for e in edges if e.startswith((f"{PKG}.model", f"{PKG}.parallel"))}, module


def test_scanner_sees_function_level_and_package_imports(tmp_path):
    """The scanner itself: a cycle closed only by a function-level relative import through a package __init__
    is found, and `from . import mod` names the submodule."""
    pkg = tmp_path / PKG
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import g\n")
    (pkg / "sub" / "__init__.py").write_text("from .d import h\n")
    (pkg / "sub" / "c.py").write_text("X = 1\n")
    (pkg / "sub" / "d.py").write_text("def h():\n    import nanotitan.a\n")
    graph = import_graph(tmp_path)
    assert graph[f"{PKG}.a"] == {f"{PKG}.b"}
    assert graph[f"{PKG}.b"] == {f"{PKG}.sub", f"{PKG}.sub.c"}
    assert cycles(graph) == [[f"{PKG}.a", f"{PKG}.b", f"{PKG}.sub", f"{PKG}.sub.d"]]


# The floors of the house (docs/architecture.md), bottom up: a module imports only from its own floor or below.
FLOORS = {"config": 0, "model": 1, "data": 1, "parallel": 2, "state": 3, "optim": 3, "interop": 4, "run": 4, "observe": 5,
          "plan": 6, "resolve": 7, "train": 8, "generate": 8, "evaluate": 8, "elastic": 9, "verify": 9, "bench": 10,
          "cli": 10, "hf": 10}
# The one import that runs back up, and why: a dry run builds what a launch at N ranks builds, so it resolves the
# config as the launch does (plan/dryrun.py `launch_config`).
UPWARD = {(f"{PKG}.plan.dryrun", f"{PKG}.resolve")}


def _floor(module: str) -> int:
    return FLOORS[module.split(".")[1]] if module != PKG else max(FLOORS.values())


def test_imports_run_down_the_floors():
    """Every module of the package sits on a floor, and at most one import (UPWARD) runs back up."""
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if m != PKG} <= set(FLOORS), "a new top-level module needs a floor"
    up = {(a, b) for a, edges in graph.items() for b in edges if b != PKG and _floor(b) > _floor(a)}
    assert up == UPWARD, sorted(up - UPWARD)
