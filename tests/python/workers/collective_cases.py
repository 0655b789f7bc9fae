"""Runs cases of ../collective_cases.py for one framework: one body per behaviour, written against a small
adapter per framework (NumPy array in, framework tensor out, and back).

    rvodrun -np N python collective_cases.py FRAMEWORK
with RVOD_TEST_CASES naming a JSON file of case ids (every rank gets the same list and runs it in that
order) and RVOD_TEST_RESULTS naming a directory, where rank r writes rank{r}.json: case id ->
{"failure": null (passed) or the failure's text, "seconds": how long the case took}.

Each rank knows what every rank contributes (the data depend only on the rank, the dtype, the shape and a
seed; see _expected.contribution), so it knows the exact result. Values are small integers or halves,
exact in every dtype including float16 and bfloat16, and sums are multiples of the job size, so Average
is exact too. A body issues all of its collectives before it judges anything: a wrong value on one rank
never leaves a peer waiting for a collective this rank skipped.
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the case table lives next to the tests
import _expected  # noqa: E402
from _check import say, wait_done  # noqa: E402
from _expected import alltoall_blocks  # noqa: E402
from collective_cases import FRAMEWORKS, case_table  # noqa: E402

# Empty, fewer elements than ranks, many elements not a multiple of anything, several dimensions.
SHAPES = [(0,), (1,), (4097,), (3, 5, 2)]


# ------------------------------------------------------------------------------------------------ adapters

class NumpyAdapter:
    even_async_returns_splits = False  # rvod.numpy's alltoall returns received splits only when given splits
    received_splits_as_list = True  # a list of ints (the other shims give an int32 tensor of their own)

    def __init__(self):
        import rvod.numpy

        self.hvd = rvod.numpy

    def tensor(self, values, dtype):
        return values.astype(np.bool_ if dtype == "bool" else dtype)

    def is_tensor(self, value):
        return type(value) is np.ndarray

    def dtype_of(self, tensor):
        return tensor.dtype.name

    def values(self, tensor):
        return np.array(tensor)

    def address(self, tensor):
        return tensor.ctypes.data

    def splits(self, splits):
        return np.array(splits, dtype=np.int32)


class TorchAdapter:
    even_async_returns_splits = True  # horovod.torch's synchronize of an alltoall always returns both
    received_splits_as_list = False

    def __init__(self):
        import torch

        import rvod.torch

        torch.set_num_threads(1)
        self.torch, self.hvd = torch, rvod.torch

    def tensor(self, values, dtype):
        source = values.astype(np.float32) if dtype == "bfloat16" else values
        return self.torch.from_numpy(np.array(source, order="C")).to(getattr(self.torch, dtype))

    def is_tensor(self, value):
        return isinstance(value, self.torch.Tensor) and value.device.type == "cpu"

    def dtype_of(self, tensor):
        return str(tensor.dtype).removeprefix("torch.")

    def values(self, tensor):
        tensor = tensor.detach()
        return (tensor.float() if tensor.dtype == self.torch.bfloat16 else tensor).numpy().copy()

    def address(self, tensor):
        return tensor.data_ptr()

    def splits(self, splits):
        return self.torch.tensor(splits, dtype=self.torch.int32)


class TensorFlowAdapter:
    even_async_returns_splits = False
    received_splits_as_list = False

    def __init__(self):
        import tensorflow as tf

        import rvod.tensorflow

        tf.config.threading.set_intra_op_parallelism_threads(1)
        self.tf, self.hvd = tf, rvod.tensorflow

    def tensor(self, values, dtype):
        if dtype == "bool":
            return self.tf.constant(values.astype(np.bool_))
        return self.tf.cast(self.tf.constant(values.astype(np.float64)), getattr(self.tf, dtype))

    def is_tensor(self, value):
        return isinstance(value, self.tf.Tensor)

    def dtype_of(self, tensor):
        return tensor.dtype.name

    def values(self, tensor):
        if tensor.dtype == self.tf.bfloat16:
            return self.tf.cast(tensor, self.tf.float64).numpy()
        return tensor.numpy()

    def address(self, tensor):
        return None  # immutable tensors: every op is out of place

    def splits(self, splits):
        return self.tf.constant(splits, dtype=self.tf.int32)


class JaxAdapter:
    even_async_returns_splits = False
    received_splits_as_list = False

    def __init__(self):
        import jax

        jax.config.update("jax_enable_x64", True)  # int64, uint16 and float64 arrays
        import jax.numpy as jnp

        import rvod.jax

        self.jax, self.jnp, self.hvd = jax, jnp, rvod.jax

    def tensor(self, values, dtype):
        # Converted by NumPy (ml_dtypes has bfloat16) and put on the device: eagerly, jnp.asarray and jnp's
        # conversions compile an XLA program per shape and dtype.
        return self.jax.device_put(values.astype(np.bool_ if dtype == "bool" else self.jnp.dtype(dtype)))

    def is_tensor(self, value):
        return isinstance(value, self.jax.Array) and {d.platform for d in value.devices()} == {"cpu"}

    def dtype_of(self, tensor):
        return tensor.dtype.name

    def values(self, tensor):
        values = np.asarray(tensor)
        return values.astype(np.float32) if tensor.dtype == self.jnp.bfloat16 else values

    def address(self, tensor):
        return None  # immutable arrays: every op is out of place

    def splits(self, splits):
        return self.jax.device_put(np.asarray(splits, dtype=np.int32))


class MXNetAdapter:
    BFLOAT16 = np.dtype([("bfloat16", np.uint16)])  # how MXNet 1.9 spells bfloat16
    even_async_returns_splits = False
    received_splits_as_list = False

    def __init__(self):
        import mxnet

        import rvod.mxnet

        self.mx, self.hvd = mxnet, rvod.mxnet

    def tensor(self, values, dtype):
        mx_dtype = self.BFLOAT16 if dtype == "bfloat16" else dtype
        if values.size == 0:  # MXNet 1.9 runs no op (casts included) on empty arrays
            return self.mx.nd.empty(values.shape, dtype=mx_dtype)
        if dtype == "bfloat16":
            return self.mx.nd.array(values.astype(np.float32), dtype=np.float32).astype(self.BFLOAT16)
        return self.mx.nd.array(values, dtype=dtype)

    def is_tensor(self, value):
        return isinstance(value, self.mx.nd.NDArray) and value.context == self.mx.cpu()

    def dtype_of(self, tensor):
        return "bfloat16" if np.dtype(tensor.dtype) == self.BFLOAT16 else np.dtype(tensor.dtype).name

    def values(self, tensor):
        if np.dtype(tensor.dtype) == self.BFLOAT16:
            return np.zeros(tensor.shape) if tensor.size == 0 else tensor.astype(np.float32).asnumpy()
        return tensor.asnumpy()

    def address(self, tensor):
        return None  # MXNet's engine owns the memory; rvod.mxnet copies in place results back

    def splits(self, splits):
        return self.mx.nd.array(splits, dtype=np.int32)


ADAPTERS = {"numpy": NumpyAdapter, "torch": TorchAdapter, "tensorflow": TensorFlowAdapter, "jax": JaxAdapter,
            "mxnet": MXNetAdapter}
FRAMEWORK = sys.argv[1]
A = ADAPTERS[FRAMEWORK]()
hvd = A.hvd
hvd.init()
R, N = hvd.rank(), hvd.size()
OP = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}


# --------------------------------------------------------------------------------------- data and checks

def data(dtype, shape, rank, seed=0, product=False):
    """What `rank` contributes, as NumPy (bfloat16 data are made in float32, where they are exact)."""
    numpy_dtype = {"bool": np.bool_, "bfloat16": np.float32}.get(dtype) or np.dtype(dtype).type
    return _expected.contribution(numpy_dtype, shape, rank, seed, product, n=N)


def mine(dtype, shape, seed=0, product=False):
    return A.tensor(data(dtype, shape, R, seed, product), dtype)


def expected_reduce(dtype, shape, op, seed=0, pre=1.0, post=1.0):
    """The exact reduction, as float64 (bool for bool)."""
    stack = np.stack([data(dtype, shape, r, seed, op == "product") for r in range(N)])
    if dtype == "bool":
        return (np.logical_or if op in ("sum", "max") else np.logical_and).reduce(stack, axis=0)
    values = stack.astype(np.float64) * pre
    reduced = {"sum": lambda v: v.sum(0), "average": lambda v: v.sum(0) / N, "min": lambda v: v.min(0),
               "max": lambda v: v.max(0), "product": lambda v: v.prod(0)}[op](values) * post
    assert np.array_equal(reduced * 256, np.round(reduced * 256)), "test data must stay exact"
    return reduced


def my_rows(total):
    base, extra = divmod(total, N)
    start = R * base + min(R, extra)
    return slice(start, start + base + (1 if R < extra else 0))


class Checks:
    """Judges results without raising, so a body always issues all of its collectives."""

    def __init__(self):
        self.failures = []

    def equal(self, label, tensor, expected, dtype):
        """`tensor` is a tensor of the framework, on the CPU, of `dtype`, with `expected`'s shape and values."""
        if not A.is_tensor(tensor):
            self.failures.append(f"{label}: result is {type(tensor).__name__}, not a CPU tensor of {FRAMEWORK}")
            return
        if A.dtype_of(tensor) != dtype:
            self.failures.append(f"{label}: dtype {A.dtype_of(tensor)}, expected {dtype}")
            return
        got = A.values(tensor)
        expected = np.asarray(expected)
        if tuple(got.shape) != expected.shape:
            self.failures.append(f"{label}: shape {tuple(got.shape)}, expected {expected.shape}")
            return
        if dtype != "bool":
            got, expected = got.astype(np.float64), expected.astype(np.float64)
        if not np.array_equal(got, expected):
            bad = np.flatnonzero(got.reshape(-1) != expected.reshape(-1))
            self.failures.append(f"{label}: {bad.size} wrong elements, first at {bad[:5].tolist()}: got "
                                 f"{got.reshape(-1)[bad[:5]].tolist()}, expected {expected.reshape(-1)[bad[:5]].tolist()}")

    def received_splits(self, label, got, expected):
        """The splits an alltoall received: an int32 tensor of the framework, or a list of ints (NumPy)."""
        if A.received_splits_as_list:
            self.true(f"{label}: {got!r}, expected the list {expected.tolist()}",
                      type(got) is list and all(type(v) is int for v in got) and got == expected.tolist())
        else:
            self.equal(label, got, expected, "int32")

    def true(self, label, condition):
        if not condition:
            self.failures.append(label)

    def verdict(self):
        if self.failures:
            raise AssertionError("\n".join(self.failures))


def call(variant, name, inputs, *args, **kwargs):
    """Runs op `name` of the shim as `variant`: out of place, in place (`name_`), asynchronously (`name_async`,
    polled until done, then synchronized) or both (`name_async_`)."""
    if variant == "outofplace":
        return getattr(hvd, name)(inputs, *args, **kwargs)
    if variant == "inplace":
        return getattr(hvd, name + "_")(inputs, *args, **kwargs)
    if variant == "async":
        handle = getattr(hvd, name + "_async")(inputs, *args, **kwargs)
        wait_done(hvd.poll, handle)
        assert hvd.poll(handle) is True
        return hvd.synchronize(handle)
    if variant == "async-inplace":
        return hvd.synchronize(getattr(hvd, name + "_async_")(inputs, *args, **kwargs))
    raise ValueError(f"unknown variant {variant}")


def in_place(variant):
    return variant in ("inplace", "async-inplace")


def call_on(variant, name, tensor, *args, **kwargs):
    """`call`, and the address of `tensor`'s memory before the op (None where the framework has none)."""
    address = A.address(tensor)
    return call(variant, name, tensor, *args, **kwargs), address


def check_input(checks, label, variant, result, tensor, dtype, before, address):
    """In place, the op returns its input, which holds the result in the same memory (zero copy); otherwise
    the input keeps its values and the result has memory of its own."""
    if in_place(variant):
        checks.true(f"{label}: the in-place op did not return its input", result is tensor)
        if address is not None:
            checks.true(f"{label}: the in-place result moved", A.address(tensor) == address)
    else:
        checks.true(f"{label}: the result is the input", result is not tensor)
        checks.equal(f"{label}: input", tensor, before, dtype)
        if address is not None and before.size:
            checks.true(f"{label}: the result shares the input's memory", A.address(result) != address)


# ----------------------------------------------------------------------------------------------- bodies

def shapes_for(variant, every):
    """`every` shape (0-d too where the framework has it) for the synchronous ops; one for the handle's path."""
    if variant.startswith("async"):
        return [(7,)]
    return every + ([()] if FRAMEWORKS[FRAMEWORK].zero_dim else [])


def allreduce(case, checks):
    """The result's dtype, shape and values; the input kept (out of place) or overwritten and returned
    (in place). Scaled: one shape."""
    scaled = (case.prescale, case.postscale) != (1.0, 1.0)
    shapes = [(4, 3)] if scaled else shapes_for(case.variant, SHAPES)
    product = case.op == "product"
    for shape in shapes:
        seed = 4 if scaled else 1
        x = mine(case.dtype, shape, seed, product)
        out, address = call_on(case.variant, "allreduce", x, op=OP[case.op], prescale_factor=case.prescale,
                               postscale_factor=case.postscale)
        label = f"shape {shape}"
        checks.equal(label, out, expected_reduce(case.dtype, shape, case.op, seed, case.prescale, case.postscale),
                     case.dtype)
        check_input(checks, label, case.variant, out, x, case.dtype, data(case.dtype, shape, R, seed, product),
                    address)


def grouped_allreduce(case, checks):
    """A group of an empty, a 1-element, a 7-element and a 4097-element tensor."""
    shapes = [(0,), (1,), (7,), (4097,)]
    product = case.op == "product"
    group = [mine(case.dtype, s, 3 + k, product) for k, s in enumerate(shapes)]
    addresses = [A.address(x) for x in group]
    outs = call(case.variant, "grouped_allreduce", group, op=OP[case.op])
    checks.true(f"the result is a list of {len(group)}: {type(outs).__name__}",
                isinstance(outs, list) and len(outs) == len(group))
    for k, (shape, out, x, address) in enumerate(zip(shapes, outs, group, addresses)):
        label = f"member {k} {shape}"
        checks.equal(label, out, expected_reduce(case.dtype, shape, case.op, 3 + k), case.dtype)
        check_input(checks, label, case.variant, out, x, case.dtype, data(case.dtype, shape, R, 3 + k, product),
                    address)


def gathered_rows():
    return [2, 0] if N == 2 else [3, 0, 2][:N] + [r + 1 for r in range(3, N)]


def allgather(case, checks):
    """Ranks contribute different numbers of rows (one rank none), with trailing dimensions."""
    rows = gathered_rows()
    for trailing in [(), (3,), (2, 2)]:
        parts = [data(case.dtype, (rows[r], *trailing), r, 10) for r in range(N)]
        x = A.tensor(parts[R], case.dtype)
        out = call(case.variant, "allgather", x)
        checks.equal(f"trailing {trailing}", out, np.concatenate(parts), case.dtype)
        checks.equal(f"trailing {trailing}: input", x, parts[R], case.dtype)


def grouped_allgather(case, checks):
    """A group whose members' first dimensions differ across ranks, one of them 4097 rows on rank 0 only."""
    rows = gathered_rows()
    shapes = [lambda r: (rows[r], 2), lambda r: (r + 1,), lambda r: (4097 if r == 0 else 1,)]
    group = [mine(case.dtype, s(R), 11 + k) for k, s in enumerate(shapes)]
    outs = call(case.variant, "grouped_allgather", group)
    checks.true(f"the result is a list of {len(group)}: {type(outs).__name__}",
                isinstance(outs, list) and len(outs) == len(group))
    for k, (s, out) in enumerate(zip(shapes, outs)):
        checks.equal(f"member {k}", out, np.concatenate([data(case.dtype, s(r), r, 11 + k) for r in range(N)]),
                     case.dtype)


def broadcast(case, checks):
    """The root's values (a broadcast moves bytes: an empty tensor, a matrix, a long vector)."""
    shapes = shapes_for(case.variant, [(0,), (5, 3), (4097,)])
    for shape in shapes:
        x = mine(case.dtype, shape, 13)
        out, address = call_on(case.variant, "broadcast", x, case.root)
        label = f"shape {shape}"
        checks.equal(label, out, data(case.dtype, shape, case.root, 13), case.dtype)
        check_input(checks, label, case.variant, out, x, case.dtype, data(case.dtype, shape, R, 13), address)


# SPLITS[s][d]: the rows rank s sends to rank d (zeros included).
SPLITS = {2: [[0, 3], [2, 1]], 3: [[1, 0, 2], [2, 3, 0], [0, 1, 1]]}.get(N) or [[(s + d) % 3 for d in range(N)]
                                                                              for s in range(N)]


def alltoall(case, checks):
    """Even split (no splits given), or uneven splits with zeros given as a list and as an int32 tensor of
    the framework, which also return the splits this rank received."""
    matrix = SPLITS if case.splits else [[2] * N for _ in range(N)]
    received = np.array([matrix[s][R] for s in range(N)], dtype=np.int32)
    for trailing in [(), (2,)]:
        def sent(rank):
            return data(case.dtype, (sum(matrix[rank]), *trailing), rank, 18)

        expected = np.concatenate(alltoall_blocks(sent, matrix, R))
        x = A.tensor(sent(R), case.dtype)
        if not case.splits:
            result = call(case.variant, "alltoall", x)
            if case.variant == "async" and A.even_async_returns_splits:
                checks.true(f"trailing {trailing}: the result is not (output, received splits)",
                            isinstance(result, tuple) and len(result) == 2)
                result, got = result
                checks.received_splits(f"trailing {trailing}: received splits", got, received)
            checks.equal(f"trailing {trailing}", result, expected, case.dtype)
        else:
            for kind, splits in (("list", matrix[R]), ("tensor", A.splits(matrix[R]))):
                result = call(case.variant, "alltoall", x, splits=splits)
                label = f"trailing {trailing}, splits as a {kind}"
                checks.true(f"{label}: the result is not (output, received splits)",
                            isinstance(result, tuple) and len(result) == 2)
                out, got = result
                checks.equal(label, out, expected, case.dtype)
                checks.received_splits(f"{label}: received splits", got, received)
        checks.equal(f"trailing {trailing}: input", x, sent(R), case.dtype)


def reducescatter(case, checks):
    """Shapes whose first dimension is not a multiple of the size (the first ranks get the extra row),
    equal to the size, and smaller than it."""
    for shape in [(2 * N + 1,), (2 * N + 1, 3), (N, 2), (1, 2)]:
        x = mine(case.dtype, shape, 20)
        out = call(case.variant, "reducescatter", x, op=OP[case.op], prescale_factor=case.prescale,
                   postscale_factor=case.postscale)
        expected = expected_reduce(case.dtype, shape, case.op, 20, case.prescale, case.postscale)[my_rows(shape[0])]
        checks.equal(f"shape {shape}", out, expected, case.dtype)
        checks.equal(f"shape {shape}: input", x, data(case.dtype, shape, R, 20), case.dtype)


def grouped_reducescatter(case, checks):
    shapes = [(2 * N + 1, 2), (N * 3,), (4097,)]
    group = [mine(case.dtype, s, 22 + k) for k, s in enumerate(shapes)]
    outs = call(case.variant, "grouped_reducescatter", group, op=OP[case.op])
    checks.true(f"the result is a list of {len(group)}: {type(outs).__name__}",
                isinstance(outs, list) and len(outs) == len(group))
    for k, (s, out) in enumerate(zip(shapes, outs)):
        checks.equal(f"member {k} {s}", out, expected_reduce(case.dtype, s, case.op, 22 + k)[my_rows(s[0])],
                     case.dtype)


BODIES = {body.__name__: body for body in (allreduce, grouped_allreduce, allgather, grouped_allgather, broadcast,
                                           alltoall, reducescatter, grouped_reducescatter)}

# ------------------------------------------------------------------------------------------------- main

wanted = os.environ.get("RVOD_TEST_TRANSPORT")
if wanted:
    from rvod import _rvod

    assert wanted == _rvod.transport_kind(), f"the job runs over {_rvod.transport_kind()}, not {wanted}"
table = case_table(FRAMEWORK, N)
ids = json.loads(Path(os.environ["RVOD_TEST_CASES"]).read_text())
results = {}
started = time.monotonic()
for case_id in ids:
    case = table[case_id]
    checks = Checks()
    case_started = time.monotonic()
    try:
        BODIES[case.behaviour](case, checks)
        checks.verdict()
    except Exception:  # noqa: BLE001 - every failure is reported by its case
        failure = traceback.format_exc()
    else:
        failure = None
    results[case_id] = {"failure": failure, "seconds": round(time.monotonic() - case_started, 4)}
hvd.shutdown()
Path(os.environ["RVOD_TEST_RESULTS"], f"rank{R}.json").write_text(json.dumps(results))
failed = sum(result["failure"] is not None for result in results.values())
say(f"rank {R}: {len(results) - failed} cases passed, {failed} failed in {time.monotonic() - started:.1f} s")
