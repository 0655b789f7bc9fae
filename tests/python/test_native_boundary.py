"""What crosses the native boundary has one source, and the typed stub says what the module exports.

Checks the installed wheel: it ships ``rvod/_rvod.pyi`` and ``rvod/py.typed``; every name ``rvod._rvod``
exports is in the stub and every name in the stub is exported, functions and constructors with the
parameter names and defaults of their ``#[pyo3(signature)]`` (read from ``__text_signature__``), class
members likewise; mypy's stubtest agrees (when mypy is installed: scripts/run-tests.sh installs it). The
codes Python uses (collective kinds in ``rvod.common.ops``, dtypes in the NumPy adapter and the shims'
tables, Horovod's reduce-op constants) are the module's, and the build facts ``hvd.*_built()`` are its
``build_info()``. Single process; about 1 s, plus about 5 s for stubtest and the imports of torch and
TensorFlow (about 17 s alone; nothing in a full run, where test_conformance_shims imported them already).
The MXNet table is checked only where MXNet is installed (not in CI's main environment)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rvod
from rvod import _rvod

PACKAGE = Path(rvod.__file__).resolve().parent
STUB = PACKAGE / "_rvod.pyi"

# Horovod's public values (horovod-api.md: "Average=0, Sum=1, Adasum=2, Min=3, Max=4, Product=5").
HOROVOD_REDUCE_OPS = {"Average": 0, "Sum": 1, "Adasum": 2, "Min": 3, "Max": 4, "Product": 5}
ENGINE_DTYPE_NAMES = {"uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                      "bool", "uint16"}


def stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def stub_names(body) -> dict[str, ast.AST]:
    """Top-level names a stub body declares: functions, classes, annotated constants."""
    names = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def exported_names(namespace) -> set[str]:
    """Names besides Python's own dunders: private hooks (``_set_tuned_values``) are checked too."""
    return {name for name in vars(namespace) if not name.startswith("__")}


def stub_parameters(function: ast.FunctionDef, skip_first: bool) -> list[tuple[str, object]]:
    """(name, default) per parameter; default is ``inspect.Parameter.empty`` when there is none and
    ``Ellipsis`` when the stub writes ``...``."""
    args = function.args.args[1:] if skip_first else function.args.args
    defaults = [inspect.Parameter.empty] * (len(args) - len(function.args.defaults)) + [
        ast.literal_eval(d) for d in function.args.defaults
    ]
    return [(a.arg, d) for a, d in zip(args, defaults)]


def runtime_parameters(obj) -> list[tuple[str, object]]:
    """(name, default) per parameter from pyo3's ``__text_signature__``; pyo3 writes ``...`` for a default
    that is not a Python literal (``Vec::new()``)."""
    return [(p.name, p.default) for p in inspect.signature(obj).parameters.values()]


def assert_same_parameters(what: str, stub: list, runtime: list):
    assert [n for n, _ in stub] == [n for n, _ in runtime], f"{what}: parameters differ (stub vs module)"
    for (name, stub_default), (_, runtime_default) in zip(stub, runtime):
        if runtime_default is Ellipsis:
            assert stub_default is not inspect.Parameter.empty, f"{what}({name}): the module has a default"
        else:
            assert stub_default == runtime_default, f"{what}({name}): default {stub_default!r} in the stub, " \
                                                    f"{runtime_default!r} in the module"


def test_the_wheel_ships_the_stub_and_the_typed_marker():
    assert STUB.is_file(), f"{STUB} is not installed"
    assert (PACKAGE / "py.typed").is_file(), "py.typed is not installed"


def stub_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"]:
            return ast.literal_eval(node.value)
    raise AssertionError("_rvod.pyi declares no __all__")


def test_the_stub_declares_exactly_what_the_module_exports():
    tree = stub_tree()
    declared = set(stub_names(tree.body))
    exported = exported_names(_rvod) | {"__version__"}
    assert exported - declared == set(), "exported by rvod._rvod but missing from _rvod.pyi"
    assert declared - exported == set(), "in _rvod.pyi but not exported by rvod._rvod"
    assert sorted(stub_all(tree)) == sorted(_rvod.__all__) == sorted(exported)


def test_every_function_has_the_stubs_parameters_and_defaults():
    checked = 0
    for name, node in stub_names(stub_tree().body).items():
        if isinstance(node, ast.FunctionDef):
            assert_same_parameters(name, stub_parameters(node, skip_first=False), runtime_parameters(getattr(_rvod, name)))
            checked += 1
    assert checked == len([n for n in exported_names(_rvod) if inspect.isbuiltin(getattr(_rvod, n))]) > 0


def test_every_class_has_the_stubs_constructor_and_members():
    classes = [node for node in stub_names(stub_tree().body).values() if isinstance(node, ast.ClassDef)]
    assert sorted(c.name for c in classes) == ["RendezvousServer", "StoreClient"]
    for node in classes:
        cls = getattr(_rvod, node.name)
        members = stub_names(node.body)
        assert set(members) - {"__new__"} == exported_names(cls), f"{node.name}: members differ (stub vs module)"
        assert_same_parameters(f"{node.name}()", stub_parameters(members["__new__"], skip_first=True),
                               runtime_parameters(cls))
        for member, function in members.items():
            if member == "__new__":
                continue
            is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in function.decorator_list)
            runtime = inspect.getattr_static(cls, member)
            if is_property:
                assert inspect.isgetsetdescriptor(runtime), f"{node.name}.{member} is not a property in the module"
            else:
                assert_same_parameters(f"{node.name}.{member}", stub_parameters(function, skip_first=True),
                                       runtime_parameters(getattr(cls, member))[1:])


@pytest.mark.timeout(120)
def test_mypy_stubtest_accepts_the_stub():
    if importlib.util.find_spec("mypy") is None:
        if os.environ.get("CI"):
            pytest.fail("mypy is not installed: scripts/run-tests.sh installs it for CI")
        pytest.skip("mypy is not installed (scripts/run-tests.sh installs it)")
    result = subprocess.run([sys.executable, "-m", "mypy.stubtest", "rvod._rvod"], capture_output=True, text=True,
                            timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr


def test_reduce_op_codes_are_horovods_on_both_sides():
    from rvod.common import reduce_ops

    assert _rvod.REDUCE_OPS == HOROVOD_REDUCE_OPS
    assert {name: getattr(reduce_ops, name) for name in HOROVOD_REDUCE_OPS} == HOROVOD_REDUCE_OPS


def test_a_drifted_reduce_op_code_stops_the_import():
    from rvod.common import reduce_ops

    drifted = dict(HOROVOD_REDUCE_OPS, Adasum=6)
    with pytest.raises(ImportError, match=r"numbers its reduce ops .*'Adasum': 6.*different builds"):
        reduce_ops._check_engine_codes(drifted)
    reduce_ops._check_engine_codes(dict(HOROVOD_REDUCE_OPS))


def test_collective_kinds_are_the_modules():
    from rvod.common import ops

    kinds = _rvod.COLLECTIVE_KINDS
    assert sorted(kinds) == ["allgather", "allreduce", "alltoall", "barrier", "broadcast", "join", "reducescatter"]
    assert sorted(kinds.values()) == list(range(7))
    assert (ops.ALLREDUCE, ops.ALLGATHER, ops.BROADCAST, ops.ALLTOALL, ops.REDUCESCATTER, ops.BARRIER, ops.JOIN) == (
        kinds["allreduce"], kinds["allgather"], kinds["broadcast"], kinds["alltoall"], kinds["reducescatter"],
        kinds["barrier"], kinds["join"])


def test_dtype_codes_are_distinct_and_every_adapter_names_engine_dtypes():
    import numpy as np

    from rvod.common import numpy_adapter

    assert set(_rvod.DTYPES) == ENGINE_DTYPE_NAMES
    assert sorted(_rvod.DTYPES.values()) == list(range(len(ENGINE_DTYPE_NAMES)))
    assert {d.name for d in numpy_adapter._SUPPORTED} == ENGINE_DTYPE_NAMES - {"bfloat16"}
    assert all(isinstance(d, np.dtype) for d in numpy_adapter._SUPPORTED)


def test_the_torch_tables_name_only_engine_dtypes():
    torch = pytest.importorskip("torch")
    from rvod.torch import adapter

    names = {str(d).replace("torch.", "") for d in adapter.SUPPORTED_DTYPES}
    assert names <= ENGINE_DTYPE_NAMES and names >= ENGINE_DTYPE_NAMES - {"uint16"}
    assert ("uint16" in names) == hasattr(torch, "uint16")


def test_the_tensorflow_tables_name_only_engine_dtypes():
    pytest.importorskip("tensorflow")
    from rvod.tensorflow import adapter

    assert {d.name for d in adapter.SUPPORTED_DTYPES} == ENGINE_DTYPE_NAMES


def test_a_tensorflow_tensor_on_a_gpu_crosses_as_a_host_copy(monkeypatch):
    """TensorFlow's DLPack gives no stream to order the engine's reads after, so a GPU tensor is copied to the
    host (by TensorFlow, in its stream order) and the copy crosses; a host tensor crosses as it is. (No GPU
    build of TensorFlow runs here or on the lent GPU machine: the device is what the tensor reports.)"""
    tf = pytest.importorskip("tensorflow")
    from rvod.tensorflow import adapter

    host = tf.constant([1.5, -2.0])
    assert adapter.on_host(host) is host
    capsule, kept = adapter.TensorFlowAdapter().export(host)
    assert kept is host

    class OnGpu:
        device = "/job:localhost/replica:0/task:0/device:GPU:1"

    copies = []

    def identity(tensor):
        copies.append(tensor)
        return host

    monkeypatch.setattr(adapter.tf, "identity", identity)
    gpu = OnGpu()
    assert adapter.on_host(gpu) is host
    assert copies == [gpu]
    OnGpu.device = "/job:worker/replica:0/task:1/device:CPU:0"
    assert adapter.on_host(gpu) is gpu and copies == [gpu]


def test_the_mxnet_tables_name_only_engine_dtypes():
    pytest.importorskip("mxnet")
    from rvod.mxnet import adapter

    names = {adapter.dtype_name(d) for d in adapter.SUPPORTED_DTYPES}
    assert names <= ENGINE_DTYPE_NAMES


def test_build_facts_are_the_modules():
    from rvod.common import basics

    info = _rvod.build_info()
    assert info["version"] == rvod.__version__
    for library in ("mpi", "gloo", "ddl", "ccl", "rocm"):
        assert getattr(basics, f"{library}_built")() is info[library] is False
    # CUDA and NCCL are loaded at run time; what was found is gpu_libraries()'s (tests/python/test_gpu.py).
    gpu = _rvod.gpu_libraries()
    assert basics.nccl_built() == gpu["nccl_version"]
    assert basics.cuda_built() is (gpu["cuda_runtime_version"] > 0)


_STORE_WAIT = """
import signal, time
# A child inherits an ignored or blocked SIGINT from whatever started it (Python then installs no
# KeyboardInterrupt handler): give this one Ctrl-C as a terminal gives it, and say what it inherited.
inherited = "ignored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "handled"
blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
from rvod import _rvod
server = _rvod.RendezvousServer("127.0.0.1", 0, b"secret")
client = _rvod.StoreClient("127.0.0.1", server.port, b"secret", 5.0)
print("waiting", flush=True)
print(f"inherited SIGINT: {inherited}, blocked: {blocked}", flush=True)
start = time.monotonic()
try:
    client.get("never/set", 60.0)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.1f} s", flush=True)
"""


@pytest.mark.timeout(60)
def test_ctrl_c_interrupts_a_store_wait():
    """StoreClient.get waits for a key with the GIL released and turns Ctrl-C into KeyboardInterrupt within
    a slice, not after its timeout (60 s here)."""
    import signal
    import time

    child = subprocess.Popen([sys.executable, "-c", _STORE_WAIT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "waiting"
        inherited = child.stdout.readline().strip()
        time.sleep(0.5)
        child.send_signal(signal.SIGINT)
        try:
            out, err = child.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            pytest.fail(f"Ctrl-C did not interrupt the store wait within 20 s ({inherited}); output: {out!r} {err!r}")
    finally:
        child.kill()
    assert out.startswith("interrupted after "), (inherited, out, err)
    assert float(out.split()[2]) < 10, out
