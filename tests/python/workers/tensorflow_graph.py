"""rvod.tensorflow in TensorFlow 1 graph mode, as a Horovod TF1 script uses it: eager execution disabled,
ops built into a tf.compat.v1 graph and run by a Session. Checks every collective against exact values,
their gradients (tf.gradients), broadcast_global_variables, broadcast_variables and broadcast_,
BroadcastGlobalVariablesHook in a MonitoredTrainingSession, DistributedOptimizer wrapping
tf.compat.v1.train optimizers (training identical on every rank and equal to one process on the whole
batch), the object helpers and a mismatch. Run by rvodrun with 2 ranks.

Values are small integers, exact in every dtype; sums are multiples of the job size, so averages are exact.
"""

import numpy as np
import tensorflow as tf
from _check import check, expect_error, finish

import rvod.tensorflow as hvd

tf.compat.v1.disable_eager_execution()
hvd.init()
R, N = hvd.rank(), hvd.size()
assert N >= 2, "run with at least 2 ranks"
v1 = tf.compat.v1

INTS = [tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64]
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
NUMERIC = INTS + FLOATS
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
ROOT = N - 1


def contribution(dtype, count, rank, product=False):
    i = np.arange(count)
    if product:
        table = np.array([1, 2, 3, 1, 2] if dtype == tf.uint8 else [1, -2, 2, -1, 1, 3, -1])
        return table[(i + 2 * rank) % len(table)]
    base = (i * 5) % 11 - (0 if dtype == tf.uint8 else 5)
    return base + N * ((rank + i) % N)


def tensor(dtype, count, rank=R, product=False):
    return tf.cast(tf.constant(contribution(dtype, count, rank, product).astype(np.float64)), dtype)


def expected_reduce(dtype, count, op):
    stack = np.stack([contribution(dtype, count, r, op == hvd.Product).astype(np.float64) for r in range(N)])
    return {hvd.Sum: stack.sum(0), hvd.Average: stack.sum(0) / N, hvd.Min: stack.min(0), hvd.Max: stack.max(0),
            hvd.Product: stack.prod(0)}[op]


def assert_values(got, expected, label, dtype=None):
    got = np.asarray(got)
    if dtype is not None:
        assert got.dtype == dtype.as_numpy_dtype, f"{label}: dtype {got.dtype} != {dtype.name}"
    expected = np.asarray(expected)
    assert got.shape == expected.shape, f"{label}: shape {got.shape} != {expected.shape}"
    assert np.array_equal(got.astype(np.float64), expected.astype(np.float64)), \
        f"{label}: {got.tolist()} != {expected.tolist()}"


def rows(rank, count, dtype=None):
    values = np.arange(count * 2).reshape(count, 2) + 10 * rank
    return values % 2 == 0 if dtype == tf.bool else values


def share(count, rank):
    base, extra = divmod(count, N)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# ------------------------------------------------------------------------ every op, one Session.run each

with check("graph mode: ops are graph tensors, not eager ones"):
    assert not tf.executing_eagerly()
    with tf.Graph().as_default():
        out = hvd.allreduce(tf.ones([2]))
        assert isinstance(out, tf.Tensor) and not hasattr(out, "numpy") and out.graph is v1.get_default_graph()

graph = tf.Graph()
with graph.as_default():
    ops = {}
    for dtype in NUMERIC:
        for op_name, op in OPS.items():
            ops[f"allreduce {dtype.name} {op_name}"] = hvd.allreduce(tensor(dtype, 7, product=op == hvd.Product),
                                                                     op=op)
    ops["scaled"] = hvd.allreduce(tensor(tf.float32, 7), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    ops["default"] = hvd.allreduce(tensor(tf.float64, 7))
    ops["named"] = hvd.allreduce(tensor(tf.int32, 3), op=hvd.Sum, name="named_allreduce")
    ops["fp16"] = hvd.allreduce(tensor(tf.float32, 7), op=hvd.Sum, compression=hvd.Compression.fp16)
    ops["grouped"] = hvd.grouped_allreduce([tensor(tf.float32, 7), tensor(tf.int64, 4)], op=hvd.Sum)
    placeholder = v1.placeholder(tf.float32, [None])
    ops["fed"] = hvd.allreduce(placeholder, op=hvd.Sum)
    movers = {}
    for dtype in NUMERIC + [tf.bool]:
        values = rows(R, R + 1, dtype)
        mine = tf.constant(values) if dtype == tf.bool else tf.cast(tf.constant(values), dtype)
        movers[f"allgather {dtype.name}"] = hvd.allgather(mine)
        sent = mine if R == ROOT else tf.zeros([ROOT + 1, 2], dtype)
        movers[f"broadcast {dtype.name}"] = hvd.broadcast(sent, root_rank=ROOT)
    movers["grouped_allgather"] = hvd.grouped_allgather([tf.constant(rows(R, R + 1), tf.int32), tf.fill([1], float(R))])
    splits = [j + 1 for j in range(N)]
    movers["alltoall"] = hvd.alltoall(tf.constant(rows(R, sum(splits)), tf.float32), splits=splits)
    movers["alltoall even"] = hvd.alltoall(tf.constant(rows(R, 2 * N), tf.int64))
    movers["reducescatter"] = hvd.reducescatter(tensor(tf.float32, 10), op=hvd.Sum)
    movers["grouped_reducescatter"] = hvd.grouped_reducescatter([tensor(tf.int32, 5), tensor(tf.float64, 2 * N)],
                                                             op=hvd.Sum)
    slices = tf.IndexedSlices(tf.fill([R + 1, 2], float(R + 1)), tf.range(R + 1), tf.constant([N + 1, 2]))
    sparse = hvd.allreduce(slices, op=hvd.Average)
    movers["sparse values"], movers["sparse indices"] = sparse.values, sparse.indices
    movers["barrier"] = hvd.barrier()
    movers["topology"] = [hvd.size_op(), hvd.rank_op(), hvd.local_size_op(), hvd.local_rank_op(),
                       hvd.process_set_included_op()]

with v1.Session(graph=graph) as session:
    feed = {placeholder: np.full(3, float(R + 1), np.float32)}
    results = {}
    with check("every allreduce in one Session.run, then every other op in another"):
        results = session.run(ops, feed_dict=feed)
        results.update(session.run(movers))
    with check("graph allreduce: every dtype and op, exact"):
        for dtype in NUMERIC:
            for op_name, op in OPS.items():
                assert_values(results[f"allreduce {dtype.name} {op_name}"], expected_reduce(dtype, 7, op),
                              f"{dtype.name} {op_name}", dtype)
    with check("graph allreduce: factors, default Average, named, fp16, grouped, fed placeholder"):
        assert_values(results["scaled"], expected_reduce(tf.float32, 7, hvd.Sum) / 2, "scaled", tf.float32)
        assert_values(results["default"], expected_reduce(tf.float64, 7, hvd.Average), "default", tf.float64)
        assert_values(results["named"], expected_reduce(tf.int32, 3, hvd.Sum), "named", tf.int32)
        assert_values(results["fp16"], expected_reduce(tf.float32, 7, hvd.Sum), "fp16", tf.float32)
        assert_values(results["grouped"][0], expected_reduce(tf.float32, 7, hvd.Sum), "grouped 0", tf.float32)
        assert_values(results["grouped"][1], expected_reduce(tf.int64, 4, hvd.Sum), "grouped 1", tf.int64)
        assert_values(results["fed"], np.full(3, N * (N + 1) / 2), "fed", tf.float32)
    with check("graph allgather and broadcast: every dtype"):
        for dtype in NUMERIC + [tf.bool]:
            expected = np.concatenate([rows(r, r + 1, dtype) for r in range(N)])
            assert_values(results[f"allgather {dtype.name}"], expected, f"allgather {dtype.name}", dtype)
            assert_values(results[f"broadcast {dtype.name}"], rows(ROOT, ROOT + 1, dtype), f"bcast {dtype.name}",
                          dtype)
        first, second = results["grouped_allgather"]
        assert_values(first, np.concatenate([rows(r, r + 1) for r in range(N)]), "grouped_allgather", tf.int32)
        assert_values(second, np.arange(N), "grouped_allgather 2", tf.float32)
    with check("graph alltoall: splits and even"):
        output, received = results["alltoall"]
        expected = np.concatenate([rows(j, sum(splits))[sum(splits[:R]):sum(splits[:R + 1])] for j in range(N)])
        assert_values(output, expected, "alltoall", tf.float32)
        assert_values(received, np.full(N, R + 1), "received splits", tf.int32)
        expected = np.concatenate([rows(j, 2 * N)[2 * R:2 * R + 2] for j in range(N)])
        assert_values(results["alltoall even"], expected, "alltoall even", tf.int64)
    with check("graph reducescatter and grouped_reducescatter"):
        start, end = share(10, R)
        assert_values(results["reducescatter"], expected_reduce(tf.float32, 10, hvd.Sum)[start:end], "rs",
                      tf.float32)
        first, second = results["grouped_reducescatter"]
        start, end = share(5, R)
        assert_values(first, expected_reduce(tf.int32, 5, hvd.Sum)[start:end], "grs 1", tf.int32)
        start, end = share(2 * N, R)
        assert_values(second, expected_reduce(tf.float64, 2 * N, hvd.Sum)[start:end], "grs 2", tf.float64)
    with check("graph allreduce of tf.IndexedSlices, barrier, topology ops"):
        values = np.concatenate([np.full([r + 1, 2], (r + 1) / N) for r in range(N)])
        assert_values(results["sparse values"], values, "sparse values", tf.float32)
        assert_values(results["sparse indices"], np.concatenate([np.arange(r + 1) for r in range(N)]), "idx")
        assert bool(results["barrier"])
        assert [int(v) for v in results["topology"]] == [N, R, hvd.local_size(), hvd.local_rank(), 1]
    with check("the same graph runs again, one op at a time, with another feed"):
        for step in range(3):
            feed = {placeholder: np.full(2, float(R + step), np.float32)}
            assert_values(session.run(ops["fed"], feed_dict=feed), np.full(2, sum(r + step for r in range(N))),
                          f"step {step}")
            assert_values(session.run(ops["named"]), expected_reduce(tf.int32, 3, hvd.Sum), f"named {step}")


# ------------------------------------------------------------------------------------ gradients in a graph

with tf.Graph().as_default(), v1.Session() as session:
    x = tf.constant(np.arange(4, dtype=np.float32) + R)
    weight = tf.constant(np.arange(4, dtype=np.float32) * (R + 1))
    losses = {
        "summed": tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * weight),
        "gathered": tf.reduce_sum(hvd.allgather(tf.reshape(x, [2, 2]))
                                  * tf.reshape(tf.range(4 * N, dtype=tf.float32), [2 * N, 2]) * (R + 1)),
        "bcast": tf.reduce_sum(hvd.broadcast(x, root_rank=ROOT) * weight),
        "scattered": tf.reduce_sum(hvd.reducescatter(tf.reshape(tf.tile(x, [N]), [N, 4]), op=hvd.Sum)) * (R + 1),
    }
    grads = {key: tf.gradients(loss, x)[0] for key, loss in losses.items()}
    with check("graph gradients: allreduce, allgather, broadcast, reducescatter (tf.gradients)"):
        got = session.run(grads)
        weights = [np.arange(4) * (r + 1) for r in range(N)]
        assert_values(got["summed"], sum(weights), "allreduce Sum")
        coefficient = np.mean([np.arange(4 * N).reshape(2 * N, 2) * (r + 1) for r in range(N)], axis=0)
        assert_values(got["gathered"], coefficient[2 * R:2 * R + 2].reshape(-1), "allgather")
        assert_values(got["bcast"], np.mean(weights, axis=0) if R == ROOT else np.zeros(4), "broadcast")
        assert_values(got["scattered"], sum(r + 1 for r in range(N)) * N * np.ones(4), "reducescatter")


# ------------------------------------------------------------------------- variables: broadcast helpers

with tf.Graph().as_default():
    a = v1.get_variable("a", initializer=tf.fill([3], float(R)))
    b = v1.get_variable("b", initializer=tf.fill([2, 2], R), dtype=tf.int32)
    ref = v1.Variable(tf.fill([2], float(R) + 3), use_resource=False, name="ref")
    local = v1.get_variable("local", initializer=tf.fill([1], float(R)), collections=[v1.GraphKeys.LOCAL_VARIABLES])
    bcast_global = hvd.broadcast_global_variables(ROOT)
    c = tf.Variable(tf.fill([4], float(R) + 7))
    bcast_c = hvd.broadcast_variables([c], root_rank=0)
    d = tf.Variable(tf.fill([2], float(R) + 5))
    bcast_d = hvd.broadcast_([d], root_rank=ROOT)
    with v1.Session() as session:
        session.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
        with check("broadcast_global_variables: every global variable (resource and ref) gets root's value"):
            assert isinstance(bcast_global, tf.Operation), type(bcast_global)
            assert_values(session.run(a), np.full(3, float(R)), "a before the op runs")
            session.run(bcast_global)
            assert_values(session.run(a), np.full(3, float(ROOT)), "a", tf.float32)
            assert_values(session.run(b), np.full([2, 2], ROOT), "b", tf.int32)
            assert_values(session.run(ref), np.full(2, ROOT + 3.0), "ref variable", tf.float32)
            assert_values(session.run(local), np.full(1, float(R)), "local variable untouched")
        with check("broadcast_variables returns an op; broadcast_ returns the new values"):
            session.run(bcast_c)
            assert_values(session.run(c), np.full(4, 7.0), "c")
            values = session.run(bcast_d)
            assert isinstance(values, list) and len(values) == 1
            assert_values(values[0], np.full(2, ROOT + 5.0), "broadcast_ value")
            assert_values(session.run(d), np.full(2, ROOT + 5.0), "d")

with check("BroadcastGlobalVariablesHook in a MonitoredTrainingSession"):
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=tf.fill([3], float(R + 1)))
        step = v1.train.get_or_create_global_step()
        increment = step.assign_add(1)
        hook = hvd.BroadcastGlobalVariablesHook(0)
        assert isinstance(hook, v1.train.SessionRunHook)
        with v1.train.MonitoredTrainingSession(hooks=[hook]) as session:
            assert_values(session.run(w), np.full(3, 1.0), "w after the hook")
            session.run(increment)
        # A second session on the same graph reuses the hook's op; on a new graph it builds a new one.
        first_op = hook.bcast_op
        with v1.train.MonitoredTrainingSession(hooks=[hook]) as session:
            assert hook.bcast_op is first_op
            assert_values(session.run(w), np.full(3, 1.0), "w, second session")
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=tf.fill([2], float(R + 10)))
        with v1.train.MonitoredTrainingSession(hooks=[hook]) as session:
            assert hook.bcast_op is not first_op
            assert_values(session.run(w), np.full(2, 10.0), "w on a new graph")


# --------------------------------------------------------------- DistributedOptimizer (tf.compat.v1.train)

FEATURES, BATCH, STEPS = 3, 8, 5
rng = np.random.default_rng(7)  # the same data on every rank; each rank trains on its half
DATA_X = rng.normal(size=[N * BATCH, FEATURES]).astype(np.float32)
DATA_Y = (DATA_X @ np.array([1.5, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
INIT_W = rng.normal(size=[FEATURES, 1]).astype(np.float32)
IDS = np.array([[0, 1], [1, 2]] * (N * BATCH // 2), np.int32)


def train(make_optimizer, xs, ys, ids, distributed, how, **options):
    """Weights after STEPS steps of a linear model with an embedding (sparse gradients) on (xs, ys)."""
    with tf.Graph().as_default(), v1.Session() as session:
        w = v1.get_variable("w", initializer=INIT_W + (0 if not distributed else R))  # rank-dependent start
        bias = v1.get_variable("bias", initializer=np.zeros([1], np.float32))
        table = v1.get_variable("table", initializer=np.ones([4, 1], np.float32))
        x, y = tf.constant(xs), tf.constant(ys)
        embedded = tf.reduce_sum(tf.gather(table, tf.constant(ids)), axis=1)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + bias + embedded - y[:, None]))
        optimizer = make_optimizer()
        if distributed:
            optimizer = hvd.DistributedOptimizer(optimizer, **options)
        if how == "minimize":
            train_op = optimizer.minimize(loss, global_step=v1.train.get_or_create_global_step())
        else:
            pairs = optimizer.compute_gradients(loss)
            assert isinstance(pairs, list) and all(len(p) == 2 for p in pairs)
            assert isinstance(dict((v.name, g) for g, v in pairs)["table:0"], tf.IndexedSlices) or \
                options.get("sparse_as_dense")
            train_op = optimizer.apply_gradients(pairs)
        session.run(v1.global_variables_initializer())
        if distributed:
            session.run(hvd.broadcast_global_variables(0))
        for _ in range(STEPS):
            session.run(train_op)
        return session.run([w, bias, table]), optimizer


def my_half(array):
    return array[R * BATCH:(R + 1) * BATCH]


for label, make, how, options in [
    ("GradientDescent, minimize", lambda: v1.train.GradientDescentOptimizer(0.05), "minimize", {}),
    ("Momentum, compute/apply_gradients", lambda: v1.train.MomentumOptimizer(0.05, 0.9), "compute", {}),
    ("Adam, sparse_as_dense", lambda: v1.train.AdamOptimizer(0.01), "compute", {"sparse_as_dense": True}),
]:
    with check(f"v1 DistributedOptimizer ({label}): equal on every rank and to one process on the whole batch"):
        (w, bias, table), optimizer = train(make, my_half(DATA_X), my_half(DATA_Y), my_half(IDS), True, how,
                                            **options)
        (w1, bias1, table1), _ = train(make, DATA_X, DATA_Y, IDS, False, how)
        everyone = hvd.allgather_object([w, bias, table])
        for other in everyone:
            for mine, theirs in zip([w, bias, table], other):
                assert np.array_equal(mine, theirs), "ranks differ"
        for name, got, single in [("w", w, w1), ("bias", bias, bias1), ("table", table, table1)]:
            np.testing.assert_allclose(got, single, rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.allclose(w, INIT_W), "training changed nothing"
        assert isinstance(optimizer, v1.train.Optimizer) and optimizer.get_name() == \
            f"Distributed{type(optimizer._optimizer).__name__}"

with check("v1 DistributedOptimizer: register_local_var keeps a gradient local; get_slot and variables delegate"):
    with tf.Graph().as_default(), v1.Session() as session:
        shared = v1.get_variable("shared", initializer=np.zeros([2], np.float32))
        mine = v1.get_variable("mine", initializer=np.zeros([2], np.float32))
        loss = tf.reduce_sum(shared * (R + 1.0)) + tf.reduce_sum(mine * (R + 1.0))
        optimizer = hvd.DistributedOptimizer(v1.train.MomentumOptimizer(1.0, 0.5), op=hvd.Sum)
        optimizer.register_local_var(mine)
        pairs = optimizer.compute_gradients(loss)
        train_op = optimizer.apply_gradients(pairs)
        session.run(v1.global_variables_initializer())
        grads = session.run([g for g, _ in pairs])
        assert_values(grads[0], np.full(2, sum(r + 1.0 for r in range(N))), "shared gradient summed")
        assert_values(grads[1], np.full(2, (R + 1.0) / N), "local gradient divided by the size")
        session.run(train_op)
        assert optimizer.get_slot_names() == ["momentum"]
        assert optimizer.get_slot(shared, "momentum") is not None
        assert len(optimizer.variables()) == 2

MICRO = [(rng.normal(size=[N * BATCH, FEATURES]).astype(np.float32), rng.normal(size=[N * BATCH]).astype(np.float32))
         for _ in range(4)]


def linear_model(initial):
    x, y = v1.placeholder(tf.float32, [None, FEATURES]), v1.placeholder(tf.float32, [None])
    w = v1.get_variable("w", initializer=initial)
    bias = v1.get_variable("bias", initializer=np.zeros([1], np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + bias - y[:, None]))
    return x, y, w, bias, loss


for average in (False, True):
    with check(f"v1 DistributedOptimizer backward_passes_per_step=2 (average_aggregated_gradients={average}): "
               f"applies every second run the reduced sum of the gradients"):
        with tf.Graph().as_default(), v1.Session() as session:
            x, y, w, bias, loss = linear_model(INIT_W + R)
            step = v1.train.get_or_create_global_step()
            optimizer = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(0.05), backward_passes_per_step=2,
                                                 average_aggregated_gradients=average)
            train_op = optimizer.minimize(loss, global_step=step)
            session.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
            session.run(hvd.broadcast_global_variables(0))
            history = []
            for xs, ys in MICRO:
                session.run(train_op, feed_dict={x: my_half(xs), y: my_half(ys)})
                history.append(session.run(w))
            trained = session.run([w, bias, step])
        assert np.array_equal(history[0], INIT_W) and np.array_equal(history[2], history[1]), "applied too early"
        assert not np.array_equal(history[1], INIT_W) and not np.array_equal(history[3], history[2])
        assert trained[2] == 2, f"global step {trained[2]}"
        with tf.Graph().as_default(), v1.Session() as session:
            x, y, w, bias, loss = linear_model(INIT_W)
            # One step on the two micro-batches of a window: their losses summed (or averaged).
            x2, y2 = v1.placeholder(tf.float32, [None, FEATURES]), v1.placeholder(tf.float32, [None])
            loss2 = tf.reduce_mean(tf.square(tf.matmul(x2, w) + bias - y2[:, None]))
            total = (loss + loss2) / (2.0 if average else 1.0)
            step_op = v1.train.GradientDescentOptimizer(0.05).minimize(total)
            session.run(v1.global_variables_initializer())
            for first in (0, 2):
                session.run(step_op, feed_dict={x: MICRO[first][0], y: MICRO[first][1], x2: MICRO[first + 1][0],
                                                y2: MICRO[first + 1][1]})
            single = session.run([w, bias])
        everyone = hvd.allgather_object(trained[:2])
        assert all(np.array_equal(a, b) for other in everyone for a, b in zip(other, trained[:2])), "ranks differ"
        for name, got, expected in zip(["w", "bias"], trained[:2], single):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)

with check("Horovod's TF1 training loop: MonitoredTrainingSession, BroadcastGlobalVariablesHook, StopAtStepHook"):
    with tf.Graph().as_default():
        x, y, w, bias, loss = linear_model(INIT_W * (R + 1))  # different initial weights on every rank
        step = v1.train.get_or_create_global_step()
        train_op = hvd.DistributedOptimizer(v1.train.AdamOptimizer(0.01 * hvd.size())).minimize(loss,
                                                                                                 global_step=step)
        class FinalWeights(v1.train.SessionRunHook):
            def end(self, session):
                self.values = session.run([w, bias])

        final = FinalWeights()
        hooks = [hvd.BroadcastGlobalVariablesHook(0), v1.train.StopAtStepHook(last_step=4), final]
        runs = 0
        with v1.train.MonitoredTrainingSession(hooks=hooks) as session:
            while not session.should_stop():
                xs, ys = MICRO[runs % len(MICRO)]
                session.run(train_op, feed_dict={x: my_half(xs), y: my_half(ys)})
                runs += 1
        trained = final.values
        everyone = hvd.allgather_object(trained)  # the finalized graph takes no new op: the helpers add none
    assert runs == 4, runs
    assert all(np.array_equal(a, b) for other in everyone for a, b in zip(other, trained)), "ranks differ"
    assert not np.allclose(trained[0], INIT_W), "rank 0's start should have moved"

with check("v1 DistributedOptimizer argument errors"):
    # Adasum wraps v1 optimizers too (its values are checked in tests/python/test_adasum.py).
    assert isinstance(hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum),
                      v1.train.Optimizer)
    expect_error(ValueError, "backward_passes_per_step", hvd.DistributedOptimizer,
                 v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=0)
    expect_error(ValueError, "Average or Sum", hvd.DistributedOptimizer, v1.train.GradientDescentOptimizer(0.1),
                 op=hvd.Max)
    expect_error(ValueError, "tf.compat.v1.train.Optimizer or a Keras optimizer", hvd.DistributedOptimizer,
                 object())


# ---------------------------------------------------------------------------- objects, errors, eager-only

with tf.Graph().as_default(), v1.Session() as session:
    with check("broadcast_object, broadcast_object_fn, allgather_object while building a graph"):
        big = {"rank": R, "payload": list(range(300))}
        assert hvd.broadcast_object(big if R == ROOT else None, root_rank=ROOT) == {"rank": ROOT,
                                                                                     "payload": list(range(300))}
        broadcast_fn = hvd.broadcast_object_fn(root_rank=0, session=session)
        assert broadcast_fn(("from", R)) == ("from", 0)
        assert broadcast_fn(("again", R)) == ("again", 0)
        assert hvd.allgather_object({"r": R}, session=session) == [{"r": r} for r in range(N)]
        assert v1.get_default_graph().get_operations() == [], "the object helpers added ops to the graph"
    with check("mismatched shapes in a Session: tf.errors.InvalidArgumentError naming both shapes"):
        mismatched = hvd.allreduce(tf.ones([2 + R]), name="graph.mismatch")
        message = expect_error(tf.errors.InvalidArgumentError, "MismatchError", session.run, mismatched)
        assert "[2]" in message and "[3]" in message, message
    with check("the job goes on after a mismatch"):
        assert_values(session.run(hvd.allreduce(tf.ones([3]), op=hvd.Sum)), np.full(3, N), "after")

with check("join in a graph"):
    with tf.Graph().as_default(), v1.Session() as session:
        joined = hvd.join()
        if R == 0:
            last = session.run(joined)
        else:
            assert_values(session.run(hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="during.join")), np.full(2, N - 1),
                          "during join")
            last = session.run(joined)
        assert int(last) != 0, last

hvd.shutdown()
finish(R)
