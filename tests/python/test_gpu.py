"""GPU tensors (issue 20): what this machine can check without a GPU, and the tests a GPU must pass.

Runs here (no GPU, no driver needed): what ``nccl_built()``/``cuda_built()`` report and where the libraries
were found (the NVIDIA Python packages PyTorch installs, RVOD_NCCL_LIBRARY / RVOD_CUDA_LIBRARY), the
``--check-build`` GPU section, a bad RVOD_GPU_TRANSPORT, and the refusal of an array on a CUDA device
naming the tensor and the reason. Single process or ``python -c`` subprocesses (loading happens once per
process); about 10 s.

Needs a GPU (skipped with the reason where ``torch.cuda.is_available()`` is False): workers/gpu_ops.py with
1 rank (NCCL) and 2 and 4 ranks sharing the GPU (host staging), each asserting the route the ranks announced. Host
staging passed on an NVIDIA H200 (2026-11-28); scripts/gpu-check.sh runs these where a GPU is lent.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import PYTHON, WORKERS, assert_worker_job

from rvod import _rvod

GPU = _rvod.gpu_libraries()


def _cuda_available() -> tuple[bool, str]:
    if importlib.util.find_spec("torch") is None:
        return False, "no CUDA device: PyTorch is not installed"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device: torch.cuda.is_available() is False"
    return True, ""


HAS_GPU, NO_GPU = _cuda_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason=NO_GPU)
not_yet = pytest.mark.xfail(not GPU["gpu_collectives"], strict=True,
                            reason="this rvod version refuses GPU tensors (issue 20: the GPU path has not run on a GPU)")


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)


def test_the_report_is_consistent_and_every_shim_answers_from_it():
    import rvod.numpy as hvd
    from rvod.common import basics

    assert isinstance(GPU["nccl_version"], int) and isinstance(GPU["cuda_runtime_version"], int)
    assert basics.nccl_built() == hvd.nccl_built() == GPU["nccl_version"]
    assert basics.cuda_built() is hvd.cuda_built() is (GPU["cuda_runtime_version"] > 0)
    if GPU["nccl_version"]:
        assert Path(GPU["nccl_path"]).exists() and GPU["nccl_error"] is None
        major, minor, patch = map(int, GPU["nccl_version_text"].split("."))
        assert GPU["nccl_version"] == major * 10000 + minor * 100 + patch
    else:
        assert GPU["nccl_path"] is None and "NCCL (libnccl) not found; looked for" in GPU["nccl_error"]
    if GPU["device_count"] == 0:
        assert GPU["device_error"], "no device, and a reason why"
        assert GPU["unavailable"] == GPU["device_error"] or GPU["unavailable"] == GPU["cuda_error"]
    assert GPU["gpu_transport"] == os.environ.get("RVOD_GPU_TRANSPORT", "auto")
    assert GPU["gpu_collectives"] is (GPU["unavailable"] is None)
    for shim in ("rvod.torch",):
        if importlib.util.find_spec(shim.split(".")[1]) is not None:
            module = importlib.import_module(shim)
            assert module.nccl_built is basics.nccl_built and module.cuda_built is basics.cuda_built


def test_loading_is_lazy_and_cpu_paths_never_need_the_libraries():
    code = """
import numpy as np
import rvod.numpy as hvd
def loaded():
    maps = open("/proc/self/maps").read()
    return [name for name in ("libnccl", "libcudart") if name in maps]
hvd.init()
print("after init and an allreduce:", hvd.allreduce(np.ones(3, np.float32), name="x").tolist(), loaded())
hvd.nccl_built()
print("after nccl_built:", loaded())
hvd.shutdown()
"""
    result = python(code)
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.splitlines()
    assert before == "after init and an allreduce: [1.0, 1.0, 1.0] []", "nothing GPU is loaded until asked"
    expected = [name for name, found in (("libnccl", GPU["nccl_version"]), ("libcudart", GPU["cuda_runtime_version"]))
                if found]
    assert after == f"after nccl_built: {expected}"
    missing = python(code, RVOD_NCCL_LIBRARY="/nonexistent/libnccl.so.2", RVOD_CUDA_LIBRARY="/nonexistent/x.so")
    assert missing.returncode == 0 and missing.stdout.splitlines() == [before, "after nccl_built: []"], missing.stderr


def _installed_package(*names: str) -> tuple[str, str] | None:
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@pytest.mark.skipif(_installed_package("nvidia-nccl-cu13", "nvidia-nccl-cu12") is None,
                    reason="no nvidia-nccl-cu12/cu13 Python package in this environment")
def test_nccl_from_the_python_package_pytorch_installed():
    package, version = _installed_package("nvidia-nccl-cu13", "nvidia-nccl-cu12")
    if "RVOD_NCCL_LIBRARY" in os.environ:
        pytest.skip("RVOD_NCCL_LIBRARY is set")
    nvidia = importlib.util.find_spec("nvidia").submodule_search_locations
    expected = [str(Path(d) / "nccl" / "lib" / "libnccl.so.2") for d in nvidia]
    assert GPU["nccl_path"] in expected, (GPU, package)
    assert GPU["nccl_version_text"] == ".".join(version.split(".")[:3]), (package, version)


def test_settings_name_the_library_and_a_failure_says_where_it_looked():
    code = ("import rvod.numpy as hvd; from rvod import _rvod; g = _rvod.gpu_libraries(); "
            "print(hvd.nccl_built(), hvd.cuda_built()); print(g['nccl_error']); print(g['cuda_error']); "
            "print(g['unavailable'])")
    result = python(code, RVOD_NCCL_LIBRARY="/nonexistent/libnccl.so.2", RVOD_CUDA_LIBRARY="/nonexistent/libcudart.so")
    assert result.returncode == 0, result.stderr
    built, nccl_error, cuda_error, unavailable = result.stdout.splitlines()
    assert built == "0 False"
    assert nccl_error == ("NCCL (libnccl) not found; looked for /nonexistent/libnccl.so.2 (from RVOD_NCCL_LIBRARY): "
                          "no such file")
    assert cuda_error == ("the CUDA runtime (libcudart) not found; looked for /nonexistent/libcudart.so "
                          "(from RVOD_CUDA_LIBRARY): no such file")
    assert unavailable == cuda_error
    if GPU["nccl_path"]:  # the setting loads what it names
        result = python(code, RVOD_NCCL_LIBRARY=GPU["nccl_path"])
        assert result.stdout.split()[0] == str(GPU["nccl_version"]), result.stderr


def test_a_bad_gpu_transport_is_an_error_naming_the_variable():
    result = python("import rvod.numpy as hvd; hvd.nccl_built()", RVOD_GPU_TRANSPORT="mpi")
    assert result.returncode != 0
    assert 'ValueError: invalid environment variable RVOD_GPU_TRANSPORT="mpi": expected auto, nccl or host' \
        in result.stderr, result.stderr
    result = python("from rvod import _rvod; print(_rvod.gpu_libraries()['gpu_transport'])", HOROVOD_GPU_TRANSPORT="host")
    assert result.stdout.strip() == "host", result.stderr


def test_check_build_says_what_was_found():
    result = subprocess.run([sys.executable, "-m", "rvod.runner", "--check-build"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    section = lines[lines.index("GPU libraries (loaded at run time):") + 1:]
    nccl_box = "X" if GPU["gpu_collectives"] and GPU["nccl_collectives"] else " "
    assert f"    [{nccl_box}] NCCL" in lines, "NCCL is ticked only where rvod runs GPU collectives through it"
    if GPU["nccl_version"]:
        assert section[0] == (f"    NCCL: {GPU['nccl_version_text']} (version code {GPU['nccl_version']}) "
                              f"from {GPU['nccl_path']}")
    else:
        assert section[0] == f"    NCCL: {GPU['nccl_error']}"
    assert section[1].startswith("    CUDA runtime: ")
    if GPU["cuda_runtime_version"]:
        assert section[1].endswith(f" from {GPU['cuda_path']}")
    if GPU["device_count"] == 0:
        assert section[2] == f"    CUDA driver: {GPU['device_error']}"
    assert section[3] == "    GPU transport (RVOD_GPU_TRANSPORT): auto"
    if GPU["gpu_collectives"]:
        assert GPU["nccl_collectives"], "RVOD_GPU_TRANSPORT is auto here"
        assert section[4] == "    Collectives on GPU tensors: yes (NCCL, or host staging where ranks share a GPU)"
    else:
        assert section[4] == f"    Collectives on GPU tensors: no: {GPU['unavailable']}"


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal where there is no usable GPU")
def test_no_cuda_driver_is_named_in_the_report():
    if GPU["cuda_runtime_version"] and GPU["device_count"] == 0:
        assert GPU["device_error"].startswith(("no CUDA driver: ", "no CUDA device: ", "cudaGetDeviceCount failed: "))


@pytest.mark.timeout(60)
def test_an_array_on_a_cuda_device_is_refused_naming_it_and_why():
    """Where no GPU is usable, the reason is the machine's (no driver, no library); where GPUs are, the array
    claims one past the last (device_count), and the reason is CUDA's own for that ordinal."""
    ordinal = max(1, GPU["device_count"]) if GPU["gpu_collectives"] else 1
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import numpy as np
import rvod.numpy as hvd
from rvod import _rvod
from cuda_capsule import FakeCudaArray
hvd.init()
for call in (lambda: hvd.allreduce(FakeCudaArray({ordinal}), name="grads.w"),
             lambda: hvd.broadcast(FakeCudaArray({ordinal}), 0, name="grads.w")):
    try:
        call()
    except RuntimeError as error:  # Horovod's callers catch RuntimeError; rvod's tree says ValueError too
        assert isinstance(error, ValueError)
        print(type(error).__name__, error)
    else:
        print("no error")
print("after:", hvd.allreduce(np.ones(3, np.float32), name="cpu").tolist())
print("unavailable:", _rvod.gpu_libraries()["unavailable"])
hvd.shutdown()
"""
    result = python(code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    reason = lines[-1].removeprefix("unavailable: ")
    if GPU["gpu_collectives"]:
        reason = f"cudaSetDevice failed on GPU {ordinal}: invalid device ordinal (cudaErrorInvalidDevice)"
    for line, op in zip(lines[:2], ("allreduce", "broadcast")):
        assert re.match(rf"RvodInvalidArgumentError {op} '[^']*grads\.w': the tensor is on CUDA device {ordinal}, and rvod cannot run "
                        "collectives on it here: ", line), line
        assert reason in line and line.endswith("Move the tensor to the CPU (e.g. tensor.cpu())."), line
    assert lines[2] == "after: [1.0, 1.0, 1.0]", "the engine keeps working after the refusal"


@pytest.mark.timeout(60)
def test_a_dlpack_shape_too_large_for_memory_is_refused_not_wrapped():
    """A capsule whose shape's byte count overflows is a ValueError naming it, at the engine's boundary (NumPy
    and torch refuse such capsules themselves; before, the engine's length wrapped to a small number)."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import numpy as np
import rvod.numpy as hvd
from rvod import _rvod
from rvod.common import ops
from cuda_capsule import FakeCudaArray
hvd.init()
for shape in ((2**40, 2**40), (2**62, 1), (2**31, 2**31, 2**31)):
    capsule = FakeCudaArray(shape=shape, device_type=1).__dlpack__()
    try:
        _rvod.submit(ops.ALLREDUCE, ["huge"], [capsule], False, 1, 1.0, 1.0, -1, 0)
    except ValueError as error:
        print(type(error).__name__, error)
    else:
        print("no error")
print("after:", hvd.allreduce(np.ones(2, np.float32), name="cpu").tolist())
hvd.shutdown()
"""
    result = python(code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for line in lines[:3]:
        assert re.match(r"RvodInvalidArgumentError allreduce '[^']*huge': shape \[.*\] describes more bytes than fit in memory$",
                        line), line
    assert lines[3] == "after: [1.0, 1.0]", "the engine keeps working after the refusal"


# --- on a GPU -------------------------------------------------------------------------------------------

GPU_OPS = str(WORKERS / "gpu_ops.py")
GPU_OPS_CHECKS = 154  # the `check` blocks workers/gpu_ops.py runs (the same on CPU and GPU)


@pytest.mark.timeout(300)
def test_the_gpu_worker_itself_runs_on_cpu_tensors(run_rvodrun, job_env):
    """A dry run of workers/gpu_ops.py on CPU tensors (RVOD_TEST_GPU_OPS_DEVICE=cpu), 2 ranks: the GPU tests'
    own logic (reference results, training equivalence, SyncBatchNorm against BatchNorm) is right, so on a
    GPU only the GPU path is under test."""
    job_env["RVOD_TEST_GPU_OPS_DEVICE"] = "cpu"
    result = run_rvodrun(["-np", "2", PYTHON, GPU_OPS], timeout=240)
    assert_worker_job(result, {0: GPU_OPS_CHECKS, 1: GPU_OPS_CHECKS})


@needs_gpu
@not_yet
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("ranks", "handed_back_early"), [(1, False), (1, True), (2, False), (4, False)],
                         ids=["1-rank-nccl", "1-rank-nccl-async-completion", "2-ranks-share-one-gpu-host-staging",
                              "4-ranks-share-one-gpu-host-staging"])
def test_cuda_tensors_match_the_cpu_results(run_rvodrun, job_env, ranks, handed_back_early):
    """Every op x dtype x variant, stream order, DistributedOptimizer and SyncBatchNorm (workers/gpu_ops.py), on
    the route the ranks must choose: NCCL for one rank with the GPU to itself, host staging for two sharing it.
    With RVOD_ENABLE_ASYNC_COMPLETION, NCCL ops complete once queued: the framework's stream must still wait."""
    job_env.pop("RVOD_LOG_LEVEL", None)
    if handed_back_early:
        job_env["RVOD_ENABLE_ASYNC_COMPLETION"] = "1"
    result = run_rvodrun(["-np", str(ranks), "--verbose", PYTHON, GPU_OPS], timeout=240)
    assert_worker_job(result, dict.fromkeys(range(ranks), GPU_OPS_CHECKS))
    route = "via NCCL" if ranks == 1 else "via host staging"
    for rank in range(ranks):
        assert re.search(rf"^\[{rank}\]<stderr>:.*process set 0: GPU collectives {route} \(rank {rank} on GPU 0",
                         result.stderr, re.MULTILINE), result.stderr[-4000:]


@needs_gpu
def test_a_cuda_tensor_with_a_driver_is_refused_as_not_yet_supported():
    import torch

    import rvod.torch as hvd

    if GPU["gpu_collectives"]:
        pytest.skip("this rvod runs GPU collectives")
    hvd.init()
    try:
        with pytest.raises(ValueError, match=r"does not run collectives on GPU tensors yet"):
            hvd.allreduce(torch.ones(2, device="cuda"), name="cuda.refused")
    finally:
        hvd.shutdown()
