"""Horovod's Adasum small-model experiment (its examples/adasum/adasum_small_model.py) for rvod: the same
command line, the same samples and the same one-line result, so a sweep written for Horovod's script (its
adasum_bench notebook runs it over --x_max, --op and --learning_rate) runs this one under rvodrun.

Every rank fits the lower coefficients of a polynomial to one sample per step, x uniform in
[-x_max, x_max] from NumPy's legacy generator seeded with 1 + rank:

- ``--mode square``: x^2 + b x + c, from (b, c) = (1, -1), to x^2 - 20 x + 50;
- ``--mode cubic``: 10 x^3 + a x^2 + b x + c, from (1, -1, 1), to 10 x^3 + 5 x^2 - 20 x - 5 (Horovod's
  script evaluates the square model in this mode as well; this one fits the cubic).

The gradient of the squared error is combined with ``hvd.allreduce(op=hvd.Average)`` or ``op=hvd.Adasum``
(``--op``), then plain SGD steps with ``--learning_rate``. Training stops once the combined gradient has
been exactly zero on two steps in a row, or after 50 steps. Rank 0 prints
``x_max op learning_rate ranks steps``, with 100 for steps when 50 were not enough.

    rvodrun -np 2 python examples/adasum_small_model.py --op=Adasum --learning_rate=0.5
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F

import rvod.torch as hvd

MAX_STEPS = 50
NOT_CONVERGED = 100
# Coefficients from the highest power down: what each mode fits to, where its parameters start, and the
# fixed leading coefficient of its model.
TARGETS = {"square": (1.0, -20.0, 50.0), "cubic": (10.0, 5.0, -20.0, -5.0)}
STARTS = {"square": (1.0, -1.0), "cubic": (1.0, -1.0, 1.0)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="square", choices=["square", "cubic"])
    parser.add_argument("--op", default="Average", choices=["Average", "Adasum"])
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--x_max", type=float, default=1.0)
    return parser.parse_args(argv)


def polynomial(coefficients, x):
    """The sum of ``c * x * ... * x`` from the highest power down, added left to right (float32 results
    depend on the order; this is the order of Horovod's script)."""
    total = 0.0
    degree = len(coefficients) - 1
    for i, coefficient in enumerate(coefficients):
        term = coefficient
        for _ in range(degree - i):
            term = term * x
        total = total + term
    return total


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    op = hvd.Adasum if args.op == "Adasum" else hvd.Average
    params = torch.nn.Parameter(torch.tensor(STARTS[args.mode], dtype=torch.float32))
    optimizer = torch.optim.SGD([params], lr=args.learning_rate)
    samples = np.random.RandomState(1 + hvd.rank())
    lead = TARGETS[args.mode][0]

    steps, zero_before = NOT_CONVERGED, False
    for step in range(1, MAX_STEPS + 1):
        x = torch.tensor(samples.rand(1) * 2 * args.x_max - args.x_max, dtype=torch.float32)
        optimizer.zero_grad()
        loss = F.mse_loss(polynomial([lead, *params], x), polynomial(TARGETS[args.mode], x))
        loss.backward()
        params.grad = hvd.allreduce(params.grad, name="gradient", op=op)
        optimizer.step()
        zero = not params.grad.any()
        if zero and zero_before:
            steps = step
            break
        zero_before = zero

    if hvd.rank() == 0:
        print(args.x_max, args.op, args.learning_rate, hvd.size(), steps, flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
