"""The import rules of DESIGN.md, checked on the source tree (no engine, no framework is imported).

- Only `rvod.common` (and `rvod.runner`, whose launcher serves the rendezvous store and talks to it)
  imports the native module `rvod._rvod`.
- A framework shim (`rvod.torch`, `rvod.tensorflow`, `rvod.keras`, `rvod.mxnet`, `rvod.numpy`) does not
  import another shim, except for the few edges listed in ALLOWED_SHIM_EDGES, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "rvod"
SHIMS = ("torch", "tensorflow", "keras", "mxnet", "numpy")
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
