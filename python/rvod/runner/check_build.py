"""The --check-build report: which frameworks, controllers and tensor transports this rvod can use.

Frameworks are looked up without being imported (importing TensorFlow alone takes seconds).
Transports come from the native extension's `build_info()`; the GPU libraries (loaded at run time, never
linked) from its `gpu_libraries()`: where NCCL and the CUDA runtime were found, their versions, and the
driver's answer (the device count, or why there is none); UCX (loaded at run time too) from its
`ucx_library()`: where libucp was found, its version, and the transports and devices it reports.
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


def _native_gpu_libraries() -> tuple[dict[str, Any] | None, str]:
    try:
        from rvod._rvod import gpu_libraries

        return gpu_libraries(), ""
    except (ImportError, ValueError) as error:
        return None, str(error)


def _native_ucx_library() -> tuple[dict[str, Any] | None, str]:
    try:
        from rvod._rvod import ucx_library

        return ucx_library(), ""
    except (ImportError, ValueError) as error:
        return None, str(error)


def ucx_lines(ucx: dict[str, Any]) -> list[str]:
    """The UCX section: the library, what it reports, which of that is RDMA, and the transport setting."""
    if ucx["version"] is None:
        return [f"    libucp: {ucx['error']}", f"    Transport between hosts (RVOD_TRANSPORT): {ucx['transport']}"]
    reported = ", ".join(ucx["resources"]) or f"(not read: {ucx['resources_error']})"
    return [
        f"    libucp: UCX {ucx['version']} from {ucx['path']}",
        f"    Transports and devices: {reported}",
        f"    RDMA: {', '.join(ucx['rdma']) or 'none'}",
        f"    Transport between hosts (RVOD_TRANSPORT): {ucx['transport']}",
    ]


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def gpu_lines(gpu: dict[str, Any]) -> list[str]:
    """The GPU section: one line per library, the driver, the transport setting and what rvod runs."""
    if gpu["nccl_version"]:
        nccl = f"{gpu['nccl_version_text']} (version code {gpu['nccl_version']}) from {gpu['nccl_path']}"
    else:
        nccl = gpu["nccl_error"]
    if gpu["cuda_runtime_version"]:
        cuda = f"{_cuda_version(gpu['cuda_runtime_version'])} from {gpu['cuda_path']}"
    else:
        cuda = gpu["cuda_error"]
    if gpu["device_count"]:
        driver = f"CUDA {_cuda_version(gpu['cuda_driver_version'])}, {gpu['device_count']} device(s)"
    else:
        driver = gpu["device_error"]
    if not gpu["gpu_collectives"]:
        collectives = f"no: {gpu['unavailable']}"
    elif gpu.get("nccl_collectives"):
        collectives = "yes (NCCL, or host staging where ranks share a GPU)"
    else:
        collectives = "yes (host staging, as RVOD_GPU_TRANSPORT=host asks)"
    return [
        f"    NCCL: {nccl}",
        f"    CUDA runtime: {cuda}",
        f"    CUDA driver: {driver}",
        f"    GPU transport (RVOD_GPU_TRANSPORT): {gpu['gpu_transport']}",
        f"    Collectives on GPU tensors: {collectives}",
    ]


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
        ]
        ucx, ucx_problem = _native_ucx_library()
        lines.append(_box(bool(ucx and ucx["version"]), "UCX"))
        gpu, problem = _native_gpu_libraries()
        lines.append(_box(bool(gpu and gpu["gpu_collectives"] and gpu.get("nccl_collectives")), "NCCL"))
        lines += ["", "GPU libraries (loaded at run time):"]
        lines += gpu_lines(gpu) if gpu is not None else [f"    (not read: {problem})"]
        lines += ["", "UCX (loaded at run time; between hosts):"]
        lines += ucx_lines(ucx) if ucx is not None else [f"    (not read: {ucx_problem})"]
    return "\n".join(lines)
