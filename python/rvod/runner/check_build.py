"""The --check-build report: which frameworks, controllers and tensor transports this rvod can use.

Frameworks are looked up without being imported (importing TensorFlow alone takes seconds).
Transports come from the native extension's `build_info()`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

FRAMEWORKS = (("PyTorch", "torch"), ("TensorFlow", "tensorflow"), ("MXNet", "mxnet"), ("Keras", "keras"))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _box(available: bool, name: str) -> str:
    return f"    [{'X' if available else ' '}] {name}"


def _native_build_info() -> tuple[dict[str, Any] | None, str]:
    """The extension's build description, or None and the reason it cannot be loaded."""
    try:
        from rvod._rvod import build_info
    except ImportError as error:
        return None, str(error)
    return build_info(), ""


def package_version() -> str:
    from rvod import __version__

    return __version__


def build_report() -> str:
    info, problem = _native_build_info()
    lines = [f"rvod v{package_version()}:", "", "Available Frameworks:"]
    lines += [_box(_installed(module), name) for name, module in FRAMEWORKS]
    lines += ["", "Available Controllers:", _box(info is not None, "rvod"), "", "Available Tensor Operations:"]
    if info is None:
        lines.append(f"    (none: the native extension rvod._rvod is not built: {problem})")
    else:
        transports = set(info.get("transports", ()))
        lines += [
            _box("tcp" in transports, "TCP"),
            _box("shm" in transports, "shared memory"),
            _box(bool(info.get("nccl", False)), "NCCL"),
        ]
    return "\n".join(lines)
