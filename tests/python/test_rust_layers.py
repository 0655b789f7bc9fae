"""DESIGN.md's layer order of the Rust crate, checked on the source tree (nothing is built or run).

A module of src/ may use (``crate::...`` paths, in ``use`` lines or inline) only modules of its own layer or
of a lower one. The order is written once, here, in DESIGN.md's words (LAYERS). The edges that break it
today are listed in KNOWN_UPWARD_EDGES, each with the step that removes it; the list may only shrink: an
edge that is gone must leave the list (so it stays the truth), and a new upward edge fails the test.

Each folder's module doc (``lib.rs``, ``mod.rs``) names every submodule it declares (unit-test modules
aside).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# DESIGN.md section 2, bottom to top: a module uses only modules of its own layer or below.
LAYERS = {
    "base": ("types", "tensor", "memory", "error", "launched", "private_file", "config", "exit_signals"),
    "wire": ("protocol", "transport"),
    "work": ("ring", "fusion", "gpu", "timeline"),
    "decide": ("coordinator", "autotune"),
    "run": ("engine", "launch"),
    "bind": ("py",),
}
LAYER_OF = {module: level for level, modules in enumerate(LAYERS.values()) for module in modules}

# (file, the higher module it uses): the step of issue 29 that removes the edge.
KNOWN_UPWARD_EDGES: dict[tuple[str, str], str] = {}


def _code(text: str) -> str:
    """Source text without comments (doc links name modules without using them)."""
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def _top_level_names(group: str) -> list[str]:
    """`a::b, c::{d, e}` (inside the braces of `crate::{...}`) -> ['a', 'c']."""
    names, depth, current = [], 0, ""
    for char in group:
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "," and depth == 0:
            names.append(current)
            current = ""
            continue
        if depth == 0 and char not in "{}":
            current += char
    names.append(current)
    return [name.strip().split("::")[0].strip() for name in names if name.strip()]


def used_modules(code: str) -> set[str]:
    """The crate's top-level modules that `code` names through `crate::` paths."""
    used = set()
    for match in re.finditer(r"\bcrate::(\{[^;]*?\}(?=\s*;)|[A-Za-z_][A-Za-z_0-9]*)", code):
        found = match.group(1)
        used.update(_top_level_names(found[1:-1]) if found.startswith("{") else [found])
    return used


def _module_of(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".rs")


def upward_edges() -> set[tuple[str, str]]:
    edges = set()
    for path in sorted(SRC.rglob("*.rs")):
        module = _module_of(path)
        if module == "lib":
            continue
        for used in used_modules(_code(path.read_text())):
            if used in LAYER_OF and LAYER_OF[used] > LAYER_OF[module]:
                edges.add((str(path.relative_to(SRC)), used))
    return edges


def test_every_top_level_module_has_a_layer():
    declared = {path.relative_to(SRC).parts[0].removesuffix(".rs") for path in SRC.iterdir()
                if path.suffix == ".rs" or path.is_dir()} - {"lib"}
    assert declared <= set(LAYER_OF), f"modules without a layer: {sorted(declared - set(LAYER_OF))}"


def test_the_path_reader_sees_grouped_and_inline_uses():
    code = ("use crate::{coordinator::message::{Request, Response}, types};\n"
            "use crate::ring::{self, allreduce};\nfn f() { crate::gpu::load(); }\n// crate::py is a comment")
    assert used_modules(_code(code)) == {"coordinator", "types", "ring", "gpu"}


def test_modules_use_only_their_own_layer_or_lower_ones():
    new = sorted(upward_edges() - set(KNOWN_UPWARD_EDGES))
    described = [f"src/{path} ({_module_of(SRC / path)}, layer {list(LAYERS)[LAYER_OF[_module_of(SRC / path)]]}) "
                 f"uses {used} (layer {list(LAYERS)[LAYER_OF[used]]})" for path, used in new]
    assert not new, "upward uses across DESIGN.md's layers:\n" + "\n".join(described)


def test_every_known_upward_edge_is_still_there():
    """An edge that is gone leaves KNOWN_UPWARD_EDGES, so the list stays the truth."""
    gone = sorted(set(KNOWN_UPWARD_EDGES) - upward_edges())
    assert not gone, f"remove from KNOWN_UPWARD_EDGES (no longer used): {gone}"


def _folder_docs() -> list[Path]:
    return [SRC / "lib.rs"] + sorted(SRC.rglob("mod.rs"))


@pytest.mark.parametrize("path", _folder_docs(), ids=lambda p: str(p.relative_to(SRC)))
def test_a_folder_doc_names_every_submodule_it_declares(path):
    text = path.read_text()
    doc = "\n".join(line for line in text.splitlines() if line.startswith("//!"))
    declared = re.findall(r"^\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+([a-z_0-9]+)\s*;", text, flags=re.M)
    missing = [name for name in declared if name != "tests" and not re.search(rf"`{name}`|\[`{name}`\]|\b{name}\b", doc)]
    assert not missing, f"src/{path.relative_to(SRC)}'s module doc does not name: {missing}"
