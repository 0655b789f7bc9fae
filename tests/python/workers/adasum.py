"""Adasum through rvod.numpy and rvod.torch on 2 to 5 ranks (rvodrun), against a NumPy reference of the
formula and of the combination order (extra ranks folded into rank r - p first, then the power-of-two
tree), computed on every rank from every rank's inputs (they depend only on the rank).

Cases: numpy allreduce of float16/float32/float64 (one large enough for the ring-sized path), torch
allreduce/allreduce_ of float32 and bfloat16, pre/postscale, orthogonal vectors (they add) and equal ones,
parallel vectors of different magnitudes (the closed form below), grouped allreduce (mixed dtypes) equal to
per-tensor calls, a process set, refusals (integers, reducescatter); then, with the argument ``train`` (3
ranks), torch's DistributedOptimizer(op=Adasum): SGD steps against the reference exactly, on every rank and
on the process set of ranks 0 and 1 (rank 2 stepping alone), and training an MLP on sklearn's digits
(backward_passes_per_step 1 and 2) to well above chance with the same parameters on every rank.
"""

import os
import sys
import time

import numpy as np
import rvod.numpy as hnp
import rvod.torch as hvd
import torch
from _adasum_reference import reference
from _check import check, expect_error, finish

torch.set_num_threads(1)

START = time.perf_counter()
# The ranks but rank 0 (rank 0 alone on one rank), and from 3 ranks on ranks 0 and 1; registered at init.
MEMBERS = list(range(1, int(os.environ["RVOD_SIZE"]))) or [0]
SUBSET = hvd.ProcessSet(MEMBERS)
PAIR = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[SUBSET] + ([PAIR] if int(os.environ["RVOD_SIZE"]) >= 3 else []))
R, N = hvd.rank(), hvd.size()


def data(rank, shape, dtype, salt):
    return np.random.default_rng([rank, salt]).standard_normal(shape).astype(dtype)


def parallel_weights(n):
    """Each rank's weight when rank r holds c_r a (every c_r != 0, no partial result zero): a pair of
    parallel vectors a and c a averages, as a.b = c|a|^2 and |b|^2 = c^2|a|^2 give the coefficients
    1 - c/2 and 1 - 1/(2c), and (1 - c/2) a + (1 - 1/(2c)) c a = (1 + c)/2 a. So with p the largest power
    of two <= n, the ranks the fold pairs up (r < n - p, and r >= p) weigh 1/(2p) and the others 1/p."""
    p = 1 << (n.bit_length() - 1)
    return np.array([0.5 / p if r < n - p or r >= p else 1.0 / p for r in range(n)])


def close(got, want, rtol, label):
    got = np.asarray(got, dtype=np.float64).ravel()
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max()) / scale if got.size else 0.0
    assert got.shape == want.shape and err <= rtol, f"{label}: max error {err:.3g} > {rtol}"


for salt, (dtype, shape, rtol) in enumerate([(np.float32, (5, 7), 1e-6), (np.float64, (100003,), 1e-12),
                                             (np.float16, (33,), 2e-3)]):
    with check(f"numpy {np.dtype(dtype).name} {shape}"):
        out = hnp.allreduce(data(R, shape, dtype, salt), op=hnp.Adasum, name=f"np.{salt}")
        assert out.dtype == dtype and out.shape == shape, (out.dtype, out.shape)
        close(out, reference([data(r, shape, dtype, salt) for r in range(N)]), rtol, "numpy")

with check("numpy scale factors"):
    x = data(R, (9,), np.float64, 10)
    out = hnp.allreduce(x, op=hnp.Adasum, prescale_factor=2.0, postscale_factor=0.25, name="np.scaled")
    close(out, 0.5 * reference([data(r, (9,), np.float64, 10) for r in range(N)]), 1e-12, "scaled")

with check("orthogonal vectors add, equal vectors stay"):
    orthogonal = np.zeros(N, dtype=np.float32)
    orthogonal[R] = R + 1
    assert np.array_equal(hnp.allreduce(orthogonal, op=hnp.Adasum), np.arange(1, N + 1, dtype=np.float32))
    assert np.array_equal(reference(np.diag(np.arange(1.0, N + 1))), np.arange(1.0, N + 1))
    same = np.linspace(-1, 1, 11)
    assert np.allclose(hnp.allreduce(same, op=hnp.Adasum), same, rtol=0, atol=1e-14)

with check("parallel vectors of different magnitudes: the weighted mean of the multiples"):
    direction = data(0, (40,), np.float64, 60)
    multiples = np.array([-2.0 if r == 1 else r + 1.0 for r in range(N)])
    want = float(parallel_weights(N) @ multiples) * direction
    if N in (2, 4):
        assert np.isclose(parallel_weights(N) @ multiples, multiples.mean())
    close(reference([c * direction for c in multiples]), want, 1e-13, "reference")
    close(hnp.allreduce(multiples[R] * direction, op=hnp.Adasum, name="parallel"), want, 1e-12, "parallel")

for salt, dtype in [(20, torch.float32), (21, torch.bfloat16)]:
    with check(f"torch {dtype}"):
        inputs = [torch.from_numpy(data(r, (4, 6), np.float32, salt)).to(dtype) for r in range(N)]
        want = reference([t.double().numpy() for t in inputs])
        out = hvd.allreduce(inputs[R], op=hvd.Adasum, name=f"torch.{salt}")
        assert out.dtype == dtype and out.shape == (4, 6)
        close(out.double().numpy(), want, 1e-6 if dtype == torch.float32 else 2e-2, "torch")
        inplace = inputs[R].clone()
        assert hvd.allreduce_(inplace, op=hvd.Adasum, name=f"torch.{salt}.inplace") is inplace
        assert torch.equal(inplace, out), "allreduce_ and allreduce agree"

with check("grouped (fused) equals per tensor, mixed dtypes"):
    shapes = [(3,), (17, 2), (1,), (130,)]
    group = [torch.from_numpy(data(R, s, np.float32 if i != 2 else np.float64, 30 + i)) for i, s in enumerate(shapes)]
    group[3] = torch.linspace(0, 1, 130)  # equal on every rank: Adasum gives it back
    fused = hvd.grouped_allreduce(group, op=hvd.Adasum, name="grouped")
    single = [hvd.allreduce(t, op=hvd.Adasum, name=f"single.{i}") for i, t in enumerate(group)]
    for i, (f, s, t) in enumerate(zip(fused, single, group)):
        assert f.dtype == t.dtype and f.shape == t.shape, (i, f.dtype, f.shape)
        close(f.double().numpy(), s.double().numpy().ravel(), 1e-6, f"tensor {i}")
    close(fused[3].numpy(), group[3].double().numpy(), 1e-6, "equal tensor")
    close(fused[0].numpy(), reference([data(r, (3,), np.float32, 30) for r in range(N)]), 1e-6, "tensor 0")
    in_place = [t.clone() for t in group]
    hvd.grouped_allreduce_(in_place, op=hvd.Adasum, name="grouped.inplace")
    for f, t in zip(fused, in_place):
        assert torch.equal(f, t)

if R in MEMBERS:
    with check("process set of the ranks but rank 0"):
        out = hnp.allreduce(data(R, (50,), np.float32, 40), op=hnp.Adasum, name="subset", process_set=SUBSET)
        close(out, reference([data(r, (50,), np.float32, 40) for r in MEMBERS]), 1e-6, "subset")

with check("refusals"):
    expect_error(ValueError, r"Adasum.*'allreduce\.ints'.*int32", hnp.allreduce, np.arange(4, dtype=np.int32),
                 op=hnp.Adasum, name="ints")
    expect_error(ValueError, "Adasum", hvd.grouped_allreduce, [torch.ones(2), torch.arange(3)], op=hvd.Adasum)
    expect_error(ValueError, "(?i)Reducescatter currently only supports Average and Sum", hnp.reducescatter,
                 np.ones(2 * N, dtype=np.float32), op=hnp.Adasum)


def train(passes, epochs):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]
    mine = torch.arange(R, 1500, N)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                   named_parameters=[(f"p{passes}.{k}", v) for k, v in model.named_parameters()],
                                   op=hvd.Adasum, backward_passes_per_step=passes)
    batch = 16
    for _ in range(epochs):
        for start in range(0, len(mine) - batch * passes + 1, batch * passes):
            opt.zero_grad()
            for k in range(passes):
                idx = mine[start + k * batch:start + (k + 1) * batch]
                torch.nn.functional.cross_entropy(model(train_x[idx]), train_y[idx]).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    flat = torch.cat([p.detach().ravel() for p in model.parameters()])
    return accuracy, flat


# ---- torch DistributedOptimizer(op=Adasum): only with the argument "train" (the first optimizer step
# alone costs seconds of imports inside torch).
print(f"rank {R}: collectives done after {time.perf_counter() - START:.1f} s", flush=True)
if sys.argv[1:] == ["train"]:
    with check("one SGD step combines the updates with Adasum"):
        weights = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([weights], lr=1.0), named_parameters=[("w", weights)],
                                       op=hvd.Adasum)
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
        slopes = [torch.from_numpy(data(r, (6,), np.float64, 50)) for r in range(N)]
        (weights * slopes[R]).sum().backward()
        opt.step()
        # Each rank's update is -slope; Adasum is linear in a common sign, so the result is -Adasum(slopes).
        want = -reference([s.numpy() for s in slopes]) if N > 1 else -slopes[0].numpy()
        close(weights.detach().numpy(), want, 1e-12, "one step")
        expect_error(AssertionError, "Skipping synchronization is not supported", opt.skip_synchronize().__enter__)

    if N >= 3:
        with check("two SGD steps on the process set of ranks 0 and 1: rank 2 steps alone"):
            weights = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
            opt = hvd.DistributedOptimizer(torch.optim.SGD([weights], lr=1.0), named_parameters=[("w.pair", weights)],
                                           op=hvd.Adasum, process_set=PAIR)
            slopes = [torch.from_numpy(data(r, (6,), np.float64, 51)) for r in range(N)]
            for _ in range(2):
                opt.zero_grad()
                (weights * slopes[R]).sum().backward()
                opt.step()
            update = -reference([slopes[r].numpy() for r in (0, 1)]) if R in (0, 1) else -slopes[R].numpy()
            close(weights.detach().numpy(), 2 * update, 1e-12, "process set")

    for passes, epochs in [(1, 4), (2, 4)]:
        with check(f"digits training, backward_passes_per_step={passes}"):
            accuracy, flat = train(passes, epochs)
            everyone = hvd.allgather(flat.unsqueeze(0), name=f"params.{passes}")
            assert all(torch.equal(everyone[r], flat) for r in range(N)), "parameters differ across ranks"
            assert accuracy > 0.8, f"test accuracy {accuracy:.3f}"
            print(f"rank {R}: digits accuracy {accuracy:.3f} (backward_passes_per_step={passes}) "
                  f"after {time.perf_counter() - START:.1f} s", flush=True)

hvd.shutdown()
finish(R)
