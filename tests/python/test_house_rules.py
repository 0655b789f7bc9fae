"""The import rules of DESIGN.md, checked on the source tree (no engine, no framework is imported).

- Only `rvod.common` (and `rvod.runner`, whose launcher serves the rendezvous store and talks to it)
  imports the native module `rvod._rvod`.
- A framework shim (`rvod.torch`, `rvod.tensorflow`, `rvod.keras`, `rvod.mxnet`, `rvod.numpy`) does not
  import another shim, except for the few edges listed in ALLOWED_SHIM_EDGES, each with its reason.
- The modules of a package in ACYCLIC_PACKAGES do not import each other in a circle, counting imports
  inside functions (`import_cycles` finds the circles of any package).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "rvod"
SHIMS = ("torch", "tensorflow", "keras", "mxnet", "numpy", "jax")
NATIVE_IMPORTERS = ("common", "runner")

# (importing shim, imported shim): why the edge is there.
ALLOWED_SHIM_EDGES = {
    ("tensorflow", "keras"): "rvod.tensorflow.keras is rvod.keras (Horovod's two names for one module), and "
                             "rvod.tensorflow.DistributedOptimizer hands Keras optimizers to rvod.keras's",
    ("keras", "tensorflow"): "rvod.keras reduces gradients through rvod.tensorflow on Keras' TensorFlow backend",
    ("keras", "torch"): "rvod.keras reduces gradients through rvod.torch on Keras' torch backend",
    ("keras", "numpy"): "rvod.keras's value helpers and callbacks work on Keras values converted to NumPy",
}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_of(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ("rvod",) + (parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports (absolute names, relative imports resolved), with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path)[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ((node.module,) if node.module else ()))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if module == "rvod"]
    return found


def test_the_source_tree_is_where_the_rules_expect_it():
    assert (PACKAGE / "common" / "__init__.py").is_file()
    assert len(_sources()) > 40


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_rvod_common_and_the_runner_import_the_native_module(path):
    owner = _module_of(path)[1] if len(_module_of(path)) > 1 else ""
    if owner in NATIVE_IMPORTERS:
        return
    offending = [f"line {line}: {module}" for line, module in _imported_modules(path)
                 if module == "rvod._rvod" or module.startswith("rvod._rvod.")]
    assert not offending, f"{path.relative_to(PACKAGE)} imports the native module outside rvod.common: {offending}"


@pytest.mark.parametrize("path", [p for p in _sources() if _module_of(p)[1:2] and _module_of(p)[1] in SHIMS],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_shims_do_not_import_each_other(path):
    shim = _module_of(path)[1]
    offending = []
    for line, module in _imported_modules(path):
        parts = module.split(".")
        if len(parts) >= 2 and parts[0] == "rvod" and parts[1] in SHIMS and parts[1] != shim:
            if (shim, parts[1]) not in ALLOWED_SHIM_EDGES:
                offending.append(f"line {line}: {module}")
    assert not offending, f"rvod.{shim} imports another shim ({path.relative_to(PACKAGE)}): {offending}"


def test_every_allowed_edge_is_still_used():
    """An exception that is no longer needed is removed from the list, so the list stays the truth."""
    used = set()
    for path in _sources():
        module = _module_of(path)
        if len(module) < 2 or module[1] not in SHIMS:
            continue
        for _, imported in _imported_modules(path):
            parts = imported.split(".")
            if len(parts) >= 2 and parts[0] == "rvod" and parts[1] in SHIMS and parts[1] != module[1]:
                used.add((module[1], parts[1]))
    assert set(ALLOWED_SHIM_EDGES) <= used, f"unused exceptions: {set(ALLOWED_SHIM_EDGES) - used}"


# Packages whose modules import each other without a cycle (DESIGN.md).
ACYCLIC_PACKAGES = ("runner", "keras", "common")


def _package_imports(package: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports, anywhere in its source (inside functions too).
    `from rvod.X import m` and `import rvod.X.m` count as importing the module m, not the package's
    __init__ (which Python runs once, first); a name defined in __init__ counts as importing the package."""
    paths = sorted((PACKAGE / package).rglob("*.py"))
    modules = {".".join(_module_of(path)): path for path in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        here = _module_of(path) if path.name == "__init__.py" else _module_of(path)[:-1]
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
                module = ".".join(part for part in (base, node.module or "") if part)
                for alias in node.names:
                    imported.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
        graph[name] = {module for module in imported if module in modules and module != name}
    return graph


def import_cycles(package: str) -> list[list[str]]:
    """The groups of modules of rvod.`package` that import each other in a circle (strongly connected
    components of the import graph with more than one module), each sorted, short names."""
    graph = _package_imports(package)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for module in graph[todo.pop()] - seen:
                seen.add(module)
                todo.append(module)
        return seen

    reach = {module: reachable(module) for module in graph}
    cycles = {frozenset(module for module in reach[start] if start in reach[module]) for start in graph}
    prefix = f"rvod.{package}."
    return sorted(sorted(name.removeprefix(prefix) for name in cycle) for cycle in cycles if len(cycle) > 1)


def test_the_cycle_finder_finds_cycles_through_imports_inside_functions(tmp_path, monkeypatch):
    package = tmp_path / "rvod" / "demo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from rvod.demo import b\n")
    (package / "b.py").write_text("def f():\n    from rvod.demo.c import g\n")
    (package / "c.py").write_text("from . import a\nimport rvod.demo.d\n")
    (package / "d.py").write_text("from rvod.demo import e\n")
    (package / "e.py").write_text("def f():\n    import rvod.demo.d as d\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "rvod")
    assert import_cycles("demo") == [["a", "b", "c"], ["d", "e"]]


@pytest.mark.parametrize("package", ACYCLIC_PACKAGES)
def test_package_modules_import_each_other_without_cycles(package):
    assert import_cycles(package) == [], f"rvod.{package}'s modules import each other in a circle"
