"""Compressed allreduces (``Compression.int8``, ``.onebit``, ``.powersgd``) through rvod.numpy and rvod.torch
on 2 or 3 ranks, against NumPy references (workers/_compression_reference.py).

With ``RVOD_COMPRESSION_WITHIN_HOST=1`` (argument ``forced``): one step of int8 and 1-bit equals the
reference of the algorithm; error feedback makes the mean of many steps of the same values converge to the
exact sum (what was dropped is sent later); vectors and tensors under 1,024 values travel exactly; PowerSGD recovers a low-rank sum and sums vectors exactly;
float16/bfloat16/float64 keep their dtype; Average is Sum over n; integers pass through exactly; every rank
gets the same bits; refusals (Max, a mismatch between ranks naming both, a bad PowerSGD rank). Without it
(argument ``default``): one host's shared memory reduces exactly, so the results equal uncompressed ones.
Across two hosts of two ranks (argument ``hosts``): each host's sum is exact and the hosts' sums are
compressed between them, with error feedback, as the reference of two ranks holding those sums.
"""

import functools
import sys

import numpy as np
import rvod.numpy as hnp
import rvod.torch as hvd
import torch
from _check import check, expect_error, finish
from _compression_reference import encode_decode, low_rank, quantized_allreduce

hvd.init()
R, N = hvd.rank(), hvd.size()
MODE = sys.argv[1]
FORCED = MODE == "forced"
C = hnp.Compression


def values(rank, shape, salt, dtype=np.float32):
    return (np.random.default_rng([rank, salt]).standard_normal(shape) * (1 + rank)).astype(dtype)


def every(shape, salt, dtype=np.float32):
    return [values(r, shape, salt, dtype) for r in range(N)]


def same_on_every_rank(result, label):
    gathered = hnp.allgather(np.ascontiguousarray(result).reshape(1, -1), name=f"same.{label}")
    assert all(np.array_equal(gathered[0], row) for row in gathered), f"{label}: ranks got different bits"


if FORCED:
    for kind, compressor in [("int8", C.int8), ("onebit", C.onebit)]:
        with check(f"{kind}: one step equals the reference"):
            shape = (1, 3 * 256 * N + 77)  # chunks of whole blocks and a short last block
            got = hnp.allreduce(values(R, shape, 1), op=hnp.Sum, name=f"step.{kind}", compression=compressor)
            want = quantized_allreduce(every(shape, 1), kind, f"allreduce.step.{kind}")
            assert got.dtype == np.float32 and got.shape == shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
            same_on_every_rank(got, kind)

    for kind, compressor in [("int8", C.int8), ("onebit", C.onebit)]:
        with check(f"{kind}: vectors and tensors under 1,024 values exactly, matrices compressed"):
            shapes = [(40, 30), (1500,), (4, 1, 3, 3)]
            mine = [values(R, shape, 14 + i) for i, shape in enumerate(shapes)]
            got = hnp.grouped_allreduce(mine, op=hnp.Sum, name=f"exact.{kind}", compression=compressor)
            everyone = [every(shape, 14 + i) for i, shape in enumerate(shapes)]
            # Summed in rank order in float32, as the rank reducing each part sums its contributions.
            in_order = [functools.reduce(np.add, rows, np.zeros(rows[0].shape, np.float32)) for rows in everyone]
            np.testing.assert_array_equal(got[1], in_order[1])
            np.testing.assert_array_equal(got[2], in_order[2])
            want = quantized_allreduce(everyone[0], kind, f"grouped_allreduce.exact.{kind}_0")
            np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
            assert not np.array_equal(got[0], in_order[0]), "the matrix was not compressed"

    with check("round trips of the block codecs"):
        block = np.array([-3.0, 1.0, 0.0, 2.0], dtype=np.float32)
        # 1-bit's scale is the block's root mean square: (1 + 1 + 9 + 25) / 4 = 9.
        np.testing.assert_allclose(encode_decode(np.array([1, -1, 3, -5], np.float32), "onebit"), [3, -3, 3, -3])
        assert np.abs(encode_decode(block, "int8") - block).max() <= 3.0 / 127 / 2 + 1e-7

    for kind, compressor in [("int8", C.int8), ("onebit", C.onebit)]:
        with check(f"{kind}: error feedback carries exactly what each step dropped"):
            mine, every_rank = values(R, (40, 30), 2), every((40, 30), 2)
            got = [hnp.allreduce(mine, op=hnp.Sum, name=f"feedback.{kind}", compression=compressor)
                   for _ in range(8)]
            want = quantized_allreduce(every_rank, kind, f"allreduce.feedback.{kind}", steps=8)
            for step, (g, w) in enumerate(zip(got, want)):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg=f"step {step}")
            assert not np.array_equal(got[0], got[1]), "the second step sent nothing of the first's residual"

    with check("int8: the mean of many steps converges to the exact sum"):
        mine, exact = values(R, (40, 30), 2), np.sum(every((40, 30), 2), axis=0)
        results = [hnp.allreduce(mine, op=hnp.Sum, name="mean.int8", compression=C.int8) for _ in range(20)]
        one_step, drift = np.abs(results[0] - exact).max(), np.abs(np.mean(results, axis=0) - exact).max()
        # Without feedback every step would drop the same, and the mean would stay one step's error away.
        assert drift < one_step / 5, f"mean of 20 steps {drift:.3g} off, one step {one_step:.3g}"

    with check("powersgd recovers a low-rank sum and sums vectors exactly"):
        a = low_rank((96, 80), 2, seed=7)
        matrix, vector = (R + 1) * a, values(R, (80,), 3)
        got_matrix, got_vector = hnp.grouped_allreduce([matrix, vector], op=hnp.Sum, name="psgd",
                                                       compression=C.powersgd(rank=4))
        exact = sum(range(1, N + 1)) * a
        assert got_matrix.shape == (96, 80) and got_vector.shape == (80,)
        assert np.abs(got_matrix - exact).max() <= 1e-4 * np.abs(exact).max(), np.abs(got_matrix - exact).max()
        np.testing.assert_allclose(got_vector, np.sum(every((80,), 3), axis=0), rtol=1e-6, atol=1e-6)
        same_on_every_rank(got_matrix, "psgd")

    with check("powersgd of a full-rank matrix approximates it and feedback catches up"):
        mine = values(R, (64, 48), 4)
        exact = np.sum(every((64, 48), 4), axis=0)
        results = [hnp.allreduce(mine, op=hnp.Sum, name="psgd.full", compression=C.powersgd(rank=4))
                   for _ in range(40)]
        first, drift = np.abs(results[0] - exact).max(), np.abs(np.mean(results, axis=0) - exact).max()
        assert drift < first / 3, f"mean of 40 steps {drift:.3g} off, first step {first:.3g}"

    with check("powersgd into a new tensor with scale factors, and in place by the optimizer: the same bits"):
        # PowerSGD reads and writes float32 tensors itself (no copy through the op's buffer). Its result
        # depends on the tensor's name (the first Q is seeded by it) and on the name's state, so each path
        # runs two steps (the second uses the first's residual and Q) of the same name, its state reset in
        # between by an allreduce of that name with another compression, against numpy's plain Sum.
        shape, psgd = (64, 48), hvd.Compression.powersgd(rank=4)

        def reset():
            hnp.allreduce(np.ones(8, dtype=np.float32), name="psgd.same", compression=C.int8)

        plain = [hnp.allreduce(values(R, shape, 13 + s), op=hnp.Sum, name="psgd.same", compression=C.powersgd(rank=4))
                 for s in range(2)]
        reset()
        for s in range(2):
            scaled = hvd.allreduce(torch.tensor(values(R, shape, 13 + s)), op=hvd.Average, prescale_factor=2.0,
                                   name="psgd.same", compression=psgd)
            want = plain[s] * np.float32(2.0) * np.float32(1.0 / N)
            np.testing.assert_allclose(scaled.numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        reset()
        model = torch.nn.Linear(48, 64, bias=False)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), compression=psgd,
                                             named_parameters=[("psgd.same", model.weight)], op=hvd.Sum)
        for s in range(2):
            grad = torch.tensor(values(R, shape, 13 + s))
            model.weight.grad = grad
            optimizer.step()
            assert model.weight.grad is grad, "the optimizer reduces the gradient in place"
            np.testing.assert_array_equal(grad.numpy(), plain[s])

    with check("dtypes are kept and Average is Sum over the ranks"):
        for dtype in [np.float16, np.float64]:
            got = hnp.allreduce(values(R, (30, 40), 5, dtype), op=hnp.Average, name=f"avg.{np.dtype(dtype).name}",
                                compression=C.int8)
            want = quantized_allreduce([v.astype(np.float32) for v in every((30, 40), 5, dtype)], "int8",
                                        f"allreduce.avg.{np.dtype(dtype).name}") / N
            assert got.dtype == dtype, got.dtype
            np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
        t = torch.tensor(values(R, (30, 40), 6)).to(torch.bfloat16)
        got = hvd.allreduce(t, op=hvd.Sum, name="bf16", compression=hvd.Compression.int8)
        assert got.dtype == torch.bfloat16 and got.shape == (30, 40)

    with check("integers pass through uncompressed"):
        got = hnp.allreduce(np.arange(1000, dtype=np.int64) * (R + 1), op=hnp.Sum, name="ints",
                            compression=C.int8)
        np.testing.assert_array_equal(got, np.arange(1000) * sum(range(1, N + 1)))

    with check("torch allreduce, in place and async, and its gradient"):
        x = torch.tensor(values(R, (35, 40), 8), requires_grad=True)
        y = hvd.allreduce(x, op=hvd.Sum, name="torch.int8", compression=hvd.Compression.int8)
        want = quantized_allreduce(every((35, 40), 8), "int8", "allreduce.torch.int8")
        np.testing.assert_allclose(y.detach().numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        y.backward(torch.ones(35, 40))
        # The gradient of a sum-allreduce is the sum-allreduce of the output gradients: N everywhere.
        np.testing.assert_allclose(x.grad.numpy(), np.full((35, 40), N, dtype=np.float32), rtol=1e-2)

    with check("refusals name the problem"):
        expect_error(hnp.RvodInvalidArgumentError, r"int8 compression applies to Sum and Average allreduces, "
                     r"not to Max", hnp.allreduce, values(R, (10,), 9), op=hnp.Max, name="max", compression=C.int8)
        expect_error(ValueError, r"powersgd rank must be an integer from 1 to 255, got 0", C.powersgd, rank=0)
        mine = C.int8 if R == 0 else C.none
        message = expect_error(hnp.RvodMismatchError, r"compressions", hnp.allreduce, values(R, (512,), 10),
                               name="mixed", compression=mine)
        assert "int8" in message and "none" in message, message
        after = hnp.allreduce(np.ones(4, dtype=np.float32), op=hnp.Sum, name="after")
        np.testing.assert_array_equal(after, np.full(4, N, dtype=np.float32))
elif MODE == "hosts":
    def host_sums(shape, salt):
        """Each host's exact sum (ranks 0, 1 on the first host, 2, 3 on the second)."""
        rows = every(shape, salt)
        return [rows[0] + rows[1], rows[2] + rows[3]]

    for kind, compressor in [("int8", C.int8), ("onebit", C.onebit)]:
        with check(f"{kind} across hosts: exact inside each, compressed between, feedback kept"):
            got = [hnp.allreduce(values(R, (40, 50), 12), op=hnp.Sum, name=f"hosts.{kind}", compression=compressor)
                   for _ in range(3)]
            want = quantized_allreduce(host_sums((40, 50), 12), kind, f"allreduce.hosts.{kind}", steps=3)
            for step, (g, w) in enumerate(zip(got, want)):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg=f"step {step}")
            same_on_every_rank(got[-1], f"hosts.{kind}")

    with check("several tensors in one op, carried by both ranks of each host: each as if alone"):
        # Biggest first, so each local rank carries some (a tensor goes to the rank carrying least so far);
        # float16 goes through the engine's conversion to float32 and back.
        shapes = [(40, 50), (64, 33), (1500,), (30, 40), (20, 60), (7,)]
        for dtype in (np.float32, np.float16):
            mine = [values(R, shape, 20 + i, dtype) for i, shape in enumerate(shapes)]
            name = f"hosts.group.{np.dtype(dtype).name}"
            got = [hnp.grouped_allreduce(mine, op=hnp.Sum, name=name, compression=C.int8) for _ in range(2)]
            for i, shape in enumerate(shapes):
                rows = [v.astype(np.float32) for v in every(shape, 20 + i, dtype)]
                sums = [rows[0] + rows[1], rows[2] + rows[3]]
                compressed = len(shape) > 1 and np.prod(shape) >= 1024
                want = (quantized_allreduce(sums, "int8", f"grouped_allreduce.{name}_{i}", steps=2) if compressed
                        else [sums[0] + sums[1]] * 2)
                for step in range(2):
                    g, w = got[step][i], want[step].astype(dtype)
                    assert g.dtype == dtype and g.shape == shape, (g.dtype, g.shape)
                    tolerance = 1e-4 if dtype == np.float32 else 2e-3
                    np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=tolerance,
                                               atol=tolerance * float(np.abs(w).max()),
                                               err_msg=f"{np.dtype(dtype).name} tensor {i} {shape}, step {step}")
            same_on_every_rank(np.concatenate([g.reshape(-1) for g in got[-1]]), name)

    with check("powersgd across hosts recovers a low-rank sum"):
        a = low_rank((96, 80), 2, seed=13)
        got = hnp.allreduce((R + 1) * a, op=hnp.Average, name="hosts.psgd", compression=C.powersgd(rank=4))
        want = np.float32(sum(range(1, N + 1)) / N) * a
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()
        same_on_every_rank(got, "hosts.psgd")
else:
    with check("one host's shared memory reduces exactly unless forced"):
        for compressor in [C.int8, C.onebit, C.powersgd(rank=2)]:
            mine = values(R, (64, 40), 11)
            got = hnp.allreduce(mine, op=hnp.Sum, name=f"exact.{compressor!r}", compression=compressor)
            exact = hnp.allreduce(mine, op=hnp.Sum, name=f"plain.{compressor!r}")
            np.testing.assert_array_equal(got, exact)

finish(R)
