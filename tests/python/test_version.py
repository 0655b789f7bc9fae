"""The version is written in one place, Cargo.toml, and everything a user can ask agrees with it.

Checks the installed package: its metadata, ``rvod.__version__``, the native module's and ``rvodrun
--version``, against Cargo.toml; pyproject.toml declares the version dynamic (taken from Cargo.toml by
maturin); CHANGELOG.md has a section for it. Single process, about a second.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import rvod

tomllib = pytest.importorskip("tomllib", reason="reading Cargo.toml needs Python >= 3.11")

ROOT = Path(__file__).resolve().parents[2]


def cargo_version() -> str:
    return tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]


def test_every_version_a_user_sees_is_cargo_tomls():
    version = cargo_version()
    assert rvod.__version__ == version
    assert importlib.metadata.version("rvod") == version
    from rvod import _rvod

    assert _rvod.__version__ == version
    assert _rvod.build_info()["version"] == version
    result = subprocess.run([sys.executable, "-m", "rvod.runner", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"rvod {version}"


def test_pyproject_takes_the_version_from_cargo_toml():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project, "the version is written once, in Cargo.toml"
    assert "version" in project.get("dynamic", [])


def test_changelog_has_a_section_for_this_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"\n## {cargo_version()}\n" in changelog
