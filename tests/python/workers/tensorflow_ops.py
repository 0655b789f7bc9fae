"""rvod.tensorflow beyond the collective cases every shim runs eagerly (collective_cases.py: every op x
dtype): every op and dtype inside a tf.function, the one-off arguments (scale factors, default op, names,
0-d, compression, grouped, sparse, topology ops) eagerly and traced, the gradients Horovod defines;
DistributedGradientTape (dense, sparse, groups, compression, local sources); broadcast helpers and objects;
mismatch and argument errors; all checked against exact expected values. Run by rvodrun with 2 ranks.

Each rank knows what every rank contributes (the data depend only on the rank, the dtype and the shape).
Values are small integers, exact in every dtype, and sums are multiples of the job size, so Average
results are exact too. Each section builds one function of many ops and runs it eagerly and traced.
"""

import numpy as np
import tensorflow as tf
from _check import check, expect_error, finish

import rvod.tensorflow as hvd
from rvod import _rvod
from rvod.exceptions import RvodMismatchError

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
R, N = hvd.rank(), hvd.size()
assert N >= 2, "run with at least 2 ranks"

INTS = [tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64]
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
NUMERIC = INTS + FLOATS
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
MODES = ("eager", "graph")


def contribution(dtype, count, rank, product=False):
    """base + N * ((rank + i) % N): the sum over ranks is a multiple of N; min and max come from different
    ranks for different elements. For Product, small factors."""
    i = np.arange(count)
    if dtype == tf.bool:
        return (i + rank) % 3 == 0
    if product:
        table = np.array([1, 2, 3, 1, 2] if dtype == tf.uint8 else [1, -2, 2, -1, 1, 3, -1])
        return table[(i + 2 * rank) % len(table)]
    base = (i * 5) % 11 - (0 if dtype == tf.uint8 else 5)
    return base + N * ((rank + i) % N)


def tensor(dtype, count, rank=R, product=False):
    return tf.cast(tf.constant(contribution(dtype, count, rank, product).astype(np.float64)), dtype)


def expected_reduce(dtype, count, op):
    stack = np.stack([contribution(dtype, count, r, op == hvd.Product).astype(np.float64) for r in range(N)])
    reduced = {hvd.Sum: stack.sum(0), hvd.Average: stack.sum(0) / N, hvd.Min: stack.min(0), hvd.Max: stack.max(0),
               hvd.Product: stack.prod(0)}[op]
    return reduced


def assert_values(out, expected, dtype, label):
    out = tf.convert_to_tensor(out)
    assert out.dtype == dtype, f"{label}: dtype {out.dtype.name} != {dtype.name}"
    expected = np.asarray(expected)
    assert tuple(out.shape) == expected.shape, f"{label}: shape {tuple(out.shape)} != {expected.shape}"
    got = out.numpy().astype(np.float64) if dtype != tf.bfloat16 else tf.cast(out, tf.float64).numpy()
    assert np.array_equal(got, expected.astype(np.float64)), f"{label}: {got.tolist()} != {expected.tolist()}"


def both(fn):
    """``fn``'s results eagerly and from a tf.function tracing it."""
    return {"eager": fn(), "graph": tf.function(fn)()}


# -------------------------------------------------------------------------------------------- allreduce

def every_dtype():
    """Allreduce with every op, allgather and broadcast, in every dtype: the collective cases run these
    eagerly (test_collectives.py), so they run here inside a tf.function only."""
    out = {}
    for dtype in NUMERIC:
        for op_name, op in OPS.items():
            out[f"{dtype.name} {op_name}"] = hvd.allreduce(tensor(dtype, 7, product=op == hvd.Product), op=op)
    for dtype in NUMERIC + [tf.bool]:
        mine = tf.cast(rows(R, R + 1, dtype), dtype)
        out[f"allgather {dtype.name}"] = hvd.allgather(mine)
        sent = mine if R == ROOT else tf.zeros([ROOT + 1, 2], dtype)
        out[f"broadcast {dtype.name}"] = hvd.broadcast(sent, root_rank=ROOT)
    return out


def allreduces():
    out = {}
    out["scaled"] = hvd.allreduce(tensor(tf.float32, 7), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    out["default"] = hvd.allreduce(tensor(tf.float64, 7))
    out["named"] = hvd.allreduce(tensor(tf.int32, 3), op=hvd.Sum, name="named_allreduce")
    out["scalar"] = hvd.allreduce(tf.constant(float(R + 1)), op=hvd.Sum)
    out["empty"] = hvd.allreduce(tf.zeros([0, 3]), op=hvd.Sum)
    out["fp16"] = hvd.allreduce(tensor(tf.float32, 7), op=hvd.Sum, compression=hvd.Compression.fp16)
    out["bf16"] = hvd.allreduce(tensor(tf.float32, 7), op=hvd.Sum, compression=hvd.Compression.bf16)
    out["grouped"] = hvd.grouped_allreduce([tensor(tf.float32, 7), tensor(tf.int64, 4), tensor(tf.float16, 2)],
                                           op=hvd.Sum)
    return out


for mode, out in both(allreduces).items():
    with check(f"allreduce {mode}: factors, default Average, names, scalar, empty, compression"):
        assert_values(out["scaled"], expected_reduce(tf.float32, 7, hvd.Sum) / 2, tf.float32, "scaled")
        assert_values(out["default"], expected_reduce(tf.float64, 7, hvd.Average), tf.float64, "default")
        assert_values(out["named"], expected_reduce(tf.int32, 3, hvd.Sum), tf.int32, "named")
        assert_values(out["scalar"], np.float64(N * (N + 1) / 2), tf.float32, "scalar")
        assert_values(out["empty"], np.zeros((0, 3)), tf.float32, "empty")
        assert_values(out["fp16"], expected_reduce(tf.float32, 7, hvd.Sum), tf.float32, "fp16")
        assert_values(out["bf16"], expected_reduce(tf.float32, 7, hvd.Sum), tf.float32, "bf16")
    with check(f"grouped_allreduce {mode}"):
        for value, (dtype, count) in zip(out["grouped"], [(tf.float32, 7), (tf.int64, 4), (tf.float16, 2)]):
            assert_values(value, expected_reduce(dtype, count, hvd.Sum), dtype, f"grouped {dtype.name}")


# ---------------------------------------------------------------------- allgather, broadcast, alltoall, ...

def rows(rank, count, dtype):
    """`count` rows of 2 values that name their rank and row."""
    values = np.arange(count * 2).reshape(count, 2) + 10 * rank
    return values % 2 == 0 if dtype == tf.bool else values


SPLITS = [j + 1 for j in range(N)]  # rank r sends j + 1 rows to rank j
ROOT = N - 1


def movers():
    out = {}
    out["grouped_allgather"] = hvd.grouped_allgather([tf.constant(rows(R, R + 1, tf.int32), tf.int32),
                                                      tf.fill([1], float(R))])
    sent = tf.constant(rows(R, sum(SPLITS), tf.float32), tf.float32)
    out["alltoall"] = hvd.alltoall(sent, splits=SPLITS)
    out["alltoall even"] = hvd.alltoall(tf.constant(rows(R, 2 * N, tf.int64)))
    out["reducescatter"] = hvd.reducescatter(tensor(tf.float32, 10), op=hvd.Sum)
    out["reducescatter avg"] = hvd.reducescatter(tf.reshape(tensor(tf.float64, 10), [5, 2]))
    out["grouped_reducescatter"] = hvd.grouped_reducescatter([tensor(tf.int32, 5), tensor(tf.float32, 2 * N)],
                                                             op=hvd.Sum)
    slices = tf.IndexedSlices(tf.fill([R + 1, 2], float(R + 1)), tf.range(R + 1), tf.constant([N + 1, 2]))
    sparse = hvd.allreduce(slices, op=hvd.Average)
    out["sparse values"], out["sparse indices"] = sparse.values, sparse.indices
    out["barrier"] = hvd.barrier()
    out["size_op"], out["rank_op"] = hvd.size_op(), hvd.rank_op()
    out["local ops"] = (hvd.local_size_op(), hvd.local_rank_op(), hvd.process_set_included_op())
    return out


def share(count, rank):
    """Rows [start, end) of `count` that reducescatter gives `rank`."""
    base, extra = divmod(count, N)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


traced = tf.function(every_dtype)()
with check("allreduce in a tf.function: every dtype and op"):
    for dtype in NUMERIC:
        for op_name, op in OPS.items():
            assert_values(traced[f"{dtype.name} {op_name}"], expected_reduce(dtype, 7, op), dtype,
                          f"{dtype.name} {op_name}")
with check("allgather in a tf.function: variable first dimension, every dtype"):
    for dtype in NUMERIC + [tf.bool]:
        expected = np.concatenate([rows(r, r + 1, dtype) for r in range(N)])
        assert_values(traced[f"allgather {dtype.name}"], expected, dtype, f"allgather {dtype.name}")
with check("broadcast in a tf.function: every dtype"):
    for dtype in NUMERIC + [tf.bool]:
        assert_values(traced[f"broadcast {dtype.name}"], rows(ROOT, ROOT + 1, dtype), dtype, f"bcast {dtype.name}")

for mode, out in both(movers).items():
    with check(f"grouped_allgather {mode}"):
        first, second = out["grouped_allgather"]
        assert_values(first, np.concatenate([rows(r, r + 1, tf.int32) for r in range(N)]), tf.int32, "first")
        assert_values(second, np.arange(N), tf.float32, "second")
    with check(f"alltoall {mode}: splits and even"):
        output, received = out["alltoall"]
        expected = np.concatenate([rows(j, sum(SPLITS), tf.float32)[sum(SPLITS[:R]):sum(SPLITS[:R + 1])]
                                   for j in range(N)])
        assert_values(output, expected, tf.float32, "alltoall")
        assert_values(received, np.full(N, R + 1), tf.int32, "received splits")
        expected = np.concatenate([rows(j, 2 * N, tf.int64)[2 * R:2 * R + 2] for j in range(N)])
        assert_values(out["alltoall even"], expected, tf.int64, "alltoall even")
    with check(f"reducescatter {mode}: Sum, Average, grouped"):
        start, end = share(10, R)
        assert_values(out["reducescatter"], expected_reduce(tf.float32, 10, hvd.Sum)[start:end], tf.float32, "rs")
        start, end = share(5, R)
        avg = expected_reduce(tf.float64, 10, hvd.Average).reshape(5, 2)[start:end]
        assert_values(out["reducescatter avg"], avg, tf.float64, "rs avg")
        first, second = out["grouped_reducescatter"]
        start, end = share(5, R)
        assert_values(first, expected_reduce(tf.int32, 5, hvd.Sum)[start:end], tf.int32, "grouped rs 1")
        start, end = share(2 * N, R)
        assert_values(second, expected_reduce(tf.float32, 2 * N, hvd.Sum)[start:end], tf.float32, "grouped rs 2")
    with check(f"allreduce of tf.IndexedSlices {mode}: gathered, values averaged"):
        values = np.concatenate([np.full([r + 1, 2], (r + 1) / N) for r in range(N)])
        assert_values(out["sparse values"], values, tf.float32, "sparse values")
        assert_values(out["sparse indices"], np.concatenate([np.arange(r + 1) for r in range(N)]), tf.int32, "idx")
    with check(f"barrier and topology ops {mode}"):
        assert bool(out["barrier"])
        assert int(out["size_op"]) == N and int(out["rank_op"]) == R
        assert [int(v) for v in out["local ops"]] == [hvd.local_size(), hvd.local_rank(), 1]


with check("static shapes inside tf.function"):
    shapes = {}

    @tf.function
    def traced():
        x = tf.ones([5, 3])
        shapes["allreduce"] = hvd.allreduce(x).shape.as_list()
        shapes["allgather"] = hvd.allgather(x).shape.as_list()
        shapes["reducescatter"] = hvd.reducescatter(x).shape.as_list()
        shapes["alltoall"] = hvd.alltoall(tf.ones([2 * N, 3])).shape.as_list()
        return 0

    traced()
    start, end = share(5, R)
    assert shapes == {"allreduce": [5, 3], "allgather": [None, 3], "reducescatter": [end - start, 3],
                      "alltoall": [None, 3]}, shapes


# -------------------------------------------------------------------------------------------- gradients

X = tf.Variable(tf.constant(np.arange(4, dtype=np.float32) + R))


def gradients():
    out, x = {}, X
    weight = tf.constant(np.arange(4, dtype=np.float32) * (R + 1))
    with tf.GradientTape(persistent=True) as tape:
        summed = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * weight)
        averaged = tf.reduce_sum(hvd.allreduce(x, op=hvd.Average, prescale_factor=3.0) * weight)
        grouped = tf.reduce_sum(hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)[1] * weight)
        gathered = hvd.allgather(tf.reshape(x, [2, 2]))
        gather_loss = tf.reduce_sum(gathered * tf.reshape(tf.range(4 * N, dtype=tf.float32), [2 * N, 2]) * (R + 1))
        bcast = tf.reduce_sum(hvd.broadcast(x, root_rank=ROOT) * weight)
        exchanged, _ = hvd.alltoall(tf.reshape(tf.tile(x, [sum(SPLITS)]), [sum(SPLITS), 4]), splits=SPLITS)
        a2a = tf.reduce_sum(exchanged) * (R + 1)
        scattered = tf.reduce_sum(hvd.reducescatter(tf.reshape(tf.tile(x, [N]), [N, 4]), op=hvd.Sum)) * (R + 1)
    for key, loss in [("summed", summed), ("averaged", averaged), ("grouped", grouped), ("gathered", gather_loss),
                      ("bcast", bcast), ("a2a", a2a), ("scattered", scattered)]:
        out[key] = tape.gradient(loss, x)
    return out


def weights(rank):
    return np.arange(4) * (rank + 1)


for mode, out in both(gradients).items():
    with check(f"gradients {mode}: allreduce, grouped_allreduce"):
        total = sum(weights(r) for r in range(N))
        assert_values(out["summed"], total, tf.float32, "Sum")
        assert_values(out["averaged"], 3.0 * total / N, tf.float32, "Average with prescale")
        assert_values(out["grouped"], 2 * total, tf.float32, "grouped")
    with check(f"gradients {mode}: allgather keeps this rank's rows of the averaged gradient"):
        coefficient = np.mean([np.arange(4 * N).reshape(2 * N, 2) * (r + 1) for r in range(N)], axis=0)
        assert_values(out["gathered"], coefficient[2 * R:2 * R + 2].reshape(-1), tf.float32, "allgather")
    with check(f"gradients {mode}: broadcast averaged on the root, zero elsewhere"):
        expected = np.mean([weights(r) for r in range(N)], axis=0) if R == ROOT else np.zeros(4)
        assert_values(out["bcast"], expected, tf.float32, "broadcast")
    with check(f"gradients {mode}: alltoall sends the gradient back"):
        # Rank r's rows for rank j come back with rank j's factor j + 1, j + 1 rows of them.
        expected = sum((j + 1) * (j + 1) for j in range(N)) * np.ones(4)
        assert_values(out["a2a"], expected, tf.float32, "alltoall")
    with check(f"gradients {mode}: reducescatter (Sum) allgathers times the size"):
        expected = sum(r + 1 for r in range(N)) * N * np.ones(4)
        assert_values(out["scattered"], expected, tf.float32, "reducescatter")


# ------------------------------------------------------------------------------ DistributedGradientTape

W, TABLE, LOCAL = tf.Variable(tf.ones([3])), tf.Variable(tf.ones([N + 2, 2])), tf.Variable(tf.ones([2]))


def tape_gradients():
    out, w, table, local = {}, W, TABLE, LOCAL
    x = tf.constant([1.0, 2.0, 3.0]) * (R + 1)
    ids = tf.range(R + 1)
    for label, options in [("default", {}), ("sum", {"op": hvd.Sum}), ("dense", {"sparse_as_dense": True}),
                           ("groups", {"groups": 2, "compression": hvd.Compression.fp16}),
                           ("predivide", {"gradient_predivide_factor": 2.0})]:
        with tf.GradientTape() as plain:
            loss = tf.reduce_sum(w * x) + tf.reduce_sum(tf.gather(table, ids)) + tf.reduce_sum(local * (R + 1))
        tape = hvd.DistributedGradientTape(plain, **options)
        if label == "default":
            tape.register_local_source(local)
        out[label] = tape.gradient(loss, {"w": w, "table": table, "local": local})
    return out


for mode, out in both(tape_gradients).items():
    mean_factor = sum(r + 1 for r in range(N)) / N
    sparse_dense = np.zeros([N + 2, 2])
    for r in range(N):
        sparse_dense[:r + 1] += 1.0 / N
    with check(f"DistributedGradientTape {mode}: Average, sparse gradients gathered, local source kept"):
        grads = out["default"]
        assert_values(grads["w"], np.array([1.0, 2.0, 3.0]) * mean_factor, tf.float32, "w")
        assert isinstance(grads["table"], tf.IndexedSlices), type(grads["table"])
        assert_values(tf.convert_to_tensor(grads["table"]), sparse_dense, tf.float32, "table")
        assert_values(grads["local"], np.full(2, (R + 1) / N), tf.float32, "local source scaled by 1/size")
    with check(f"DistributedGradientTape {mode}: Sum, sparse_as_dense, groups + fp16, predivide"):
        assert_values(out["sum"]["w"], np.array([1.0, 2.0, 3.0]) * mean_factor * N, tf.float32, "Sum")
        assert not isinstance(out["dense"]["table"], tf.IndexedSlices)
        assert_values(out["dense"]["table"], sparse_dense, tf.float32, "sparse_as_dense")
        for label in ("groups", "predivide"):
            assert_values(out[label]["w"], np.array([1.0, 2.0, 3.0]) * mean_factor, tf.float32, label)
            assert_values(out[label]["local"], np.full(2, mean_factor), tf.float32, label)

with check("DistributedGradientTape: wrapped before recording, nested sources, argument errors"):
    v = tf.Variable([1.0, 2.0])
    with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = tf.reduce_sum(v * v) * (R + 1)
    grads = tape.gradient(loss, [[v]])
    assert_values(grads[0][0], np.array([2.0, 4.0]) * sum(r + 1 for r in range(N)) / N, tf.float32, "nested")
    assert type(tape).__name__ == "GradientTape" and isinstance(tape, tf.GradientTape)
    expect_error(TypeError, "tf.GradientTape", hvd.DistributedGradientTape, object())
    w = tf.Variable(tf.zeros([N]))
    with hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum) as tape:
        loss = tf.reduce_sum(w * tf.constant(np.eye(N)[R] * (R + 1), tf.float32))
    # Orthogonal gradients: Adasum adds them.
    assert_values(tape.gradient(loss, [w])[0], np.arange(1, N + 1), tf.float32, "Adasum tape")
    expect_error(ValueError, "Average or Sum", hvd.DistributedGradientTape, tf.GradientTape(), op=hvd.Min)
    expect_error(ValueError, "gradient_predivide_factor", hvd.DistributedGradientTape, tf.GradientTape(),
                 op=hvd.Sum, gradient_predivide_factor=2.0)
    expect_error(TypeError, "Keras optimizer", hvd.DistributedOptimizer, object())


# --------------------------------------------------------------------------------- variables, objects

with check("broadcast_variables eagerly and in tf.function; broadcast_"):
    a = tf.Variable(tf.fill([3], float(R)))
    b = tf.Variable(tf.fill([2, 2], R), dtype=tf.int32)
    assert hvd.broadcast_variables([a, b], root_rank=ROOT) is None
    assert_values(a, np.full(3, ROOT), tf.float32, "a")
    assert_values(b, np.full([2, 2], ROOT), tf.int32, "b")
    c = tf.Variable(tf.fill([4], float(R)))

    @tf.function
    def broadcast_in_graph():
        assert isinstance(hvd.broadcast_variables([c], root_rank=0), tf.Operation)

    broadcast_in_graph()
    assert_values(c, np.zeros(4), tf.float32, "c")
    d = tf.Variable(tf.fill([2], float(R) + 5))
    assert hvd.broadcast_([d], root_rank=ROOT)[0] is d
    assert_values(d, np.full(2, ROOT + 5), tf.float32, "d")

with check("broadcast_object, broadcast_object_fn and allgather_object"):
    obj = {"rank": R, "payload": list(range(R + 3))} if R == ROOT else None
    assert hvd.broadcast_object(obj, root_rank=ROOT) == {"rank": ROOT, "payload": list(range(ROOT + 3))}
    assert hvd.broadcast_object_fn(root_rank=0)(("from", R)) == ("from", 0)
    assert hvd.allgather_object({"r": R, "s": "x" * R}) == [{"r": r, "s": "x" * r} for r in range(N)]
    expect_error(RuntimeError, "does not support eager", hvd.broadcast_global_variables, 0)


# -------------------------------------------------------------------------------------- errors, join

with check("mismatched shapes eagerly: MismatchError (RvodMismatchError and FailedPreconditionError)"):
    try:
        hvd.allreduce(tf.ones([2 + R]), name="mismatch.eager")
    except hvd.MismatchError as error:
        assert isinstance(error, RvodMismatchError) and isinstance(error, tf.errors.FailedPreconditionError)
        assert isinstance(error, ValueError)
        assert "[2]" in str(error) and "[3]" in str(error), str(error)
    else:
        raise AssertionError("no error raised")

with check("mismatched dtypes inside tf.function: tf.errors.InvalidArgumentError naming the dtypes"):
    mismatched = tf.function(lambda: hvd.allreduce(tf.ones([2], tf.float32 if R == 0 else tf.float64),
                                                   name="mismatch.graph"))
    message = expect_error(tf.errors.InvalidArgumentError, "MismatchError", mismatched)
    assert "float32" in message and "float64" in message, message

with check("the job goes on after mismatches"):
    assert_values(hvd.allreduce(tf.ones([3]), op=hvd.Sum), np.full(3, N), tf.float32, "after")

with check("Adasum eagerly and in tf.function: orthogonal vectors add, equal vectors stay"):
    onehot = tf.constant(np.eye(N)[R] * (R + 1), tf.float32)
    same = tf.constant([0.5, -1.0, 2.0], tf.float64)
    assert_values(hvd.allreduce(onehot, op=hvd.Adasum), np.arange(1, N + 1), tf.float32, "eager")
    traced = tf.function(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Adasum))(onehot, same)
    assert_values(traced[0], np.arange(1, N + 1), tf.float32, "graph")
    assert_values(traced[1], same.numpy(), tf.float64, "graph, equal vectors")

with check("argument errors before anything is sent"):
    expect_error(ValueError, "not supported", hvd.allreduce, tf.constant(["a"]))
    expect_error(ValueError, "not supported", hvd.allgather, tf.constant([1 + 2j]))
    expect_error(ValueError, "Adasum.*int32", hvd.allreduce, tf.ones([2], tf.int32), op=hvd.Adasum)
    expect_error(ValueError, "Average and Sum", hvd.reducescatter, tf.ones([2]), op=hvd.Max)
    expect_error(ValueError, "supersedes", hvd.allreduce, tf.ones([2]), average=True, op=hvd.Sum)
    expect_error(NotImplementedError, "Sum and Average",
                 hvd.allreduce, tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([2, 2])), op=hvd.Min)
    expect_error(TypeError, "ProcessSet", hvd.allreduce, tf.ones([2]), process_set=[0, 1])
    unregistered = hvd.ProcessSet([0])
    expect_error(ValueError, "not been registered", hvd.allgather, tf.ones([2]), process_set=unregistered)
    assert hvd.is_homogeneous() is True and hvd.mpi_built() is False
    assert hvd.nccl_built() == _rvod.gpu_libraries()["nccl_version"]

with check("join: the others' allreduces complete with zeros from the joined rank"):
    if R == 0:
        last = hvd.join()
    else:
        assert_values(hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="during.join"), np.full(2, N - 1), tf.float32,
                      "during join")
        last = hvd.join()
    assert last.dtype == tf.int32 and int(last) != 0, last

hvd.shutdown()
finish(R)
