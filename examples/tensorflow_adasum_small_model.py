"""The Adasum small-model experiment with a TensorFlow 1 optimizer: where examples/adasum_small_model.py
(Horovod's experiment, PyTorch) combines gradients with ``hvd.allreduce``, this TensorFlow 1 graph run by a
Session wraps GradientDescentOptimizer in ``hvd.DistributedOptimizer``, which with ``op=hvd.Adasum`` combines
the ranks' parameter updates.

Every rank fits the quadratic y = 3 x^2 - 2 x + 1 from its own samples of x in [-x_max, x_max], wrapping the
optimizer in ``hvd.DistributedOptimizer(opt, op=hvd.Adasum)`` (or ``op=hvd.Average`` without
--use-adasum). Rank 0 prints the loss on a common test set as training goes, the step at which it fell
below --target-loss, and whether the parameters are identical on every rank.

    rvodrun -np 2 python examples/tensorflow_adasum_small_model.py --use-adasum
"""

import argparse

import numpy as np
import rvod.tensorflow as hvd
import tensorflow as tf

v1 = tf.compat.v1
COEFFICIENTS = (3.0, -2.0, 1.0)


def samples(rng, count, x_max):
    x = rng.uniform(-x_max, x_max, count)
    return x, np.polyval(COEFFICIENTS, x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--use-adasum", action="store_true", help="combine the ranks' updates with Adasum")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--x-max", type=float, default=1.0)
    parser.add_argument("--target-loss", type=float, default=1e-3)
    args = parser.parse_args()

    hvd.init()
    v1.disable_eager_execution()
    rng = np.random.default_rng(hvd.rank())
    test_x, test_y = samples(np.random.default_rng(1234), 256, args.x_max)

    x = v1.placeholder(tf.float64, [None])
    y = v1.placeholder(tf.float64, [None])
    a, b, c = (v1.Variable(0.0, dtype=tf.float64, name=name) for name in "abc")
    loss = tf.reduce_mean(tf.square(a * x * x + b * x + c - y))
    op = hvd.Adasum if args.use_adasum else hvd.Average
    opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(args.learning_rate), op=op)
    train = opt.minimize(loss)
    gathered = hvd.allgather(tf.stack([a, b, c])[None])

    reached = None
    with v1.Session() as session:
        session.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
        session.run(hvd.broadcast_global_variables(0))
        for step in range(1, args.steps + 1):
            batch_x, batch_y = samples(rng, args.batch_size, args.x_max)
            session.run(train, {x: batch_x, y: batch_y})
            test_loss = session.run(loss, {x: test_x, y: test_y})
            if reached is None and test_loss < args.target_loss:
                reached = step
            if hvd.rank() == 0 and step % 50 == 0:
                print(f"step {step}: test loss {test_loss:.6f}", flush=True)
        every_rank = session.run(gathered)
    identical = all(np.array_equal(every_rank[0], row) for row in every_rank)
    if hvd.rank() == 0:
        fitted = ", ".join(f"{v:.6f}" for v in every_rank[0])
        print(f"{'Adasum' if args.use_adasum else 'Average'} on {hvd.size()} ranks: test loss {test_loss:.6g} "
              f"after {args.steps} steps; below {args.target_loss} from step {reached}; fitted ({fitted}); "
              f"parameters identical on every rank: {identical}", flush=True)


if __name__ == "__main__":
    main()
