"""rvod.jax's DistributedOptimizer against JAX's own multi-process CPU collectives, in the same two processes.

    rvodrun -np 2 python benches/jax_training.py [--rounds 7]

Both ranks hold an rvod engine and a ``jax.distributed`` runtime at once (a local coordinator, one CPU device
per process, XLA's cross-process collectives over gloo: ``jax_cpu_collectives_implementation``), and with
one XLA thread each alternate between the contenders in every round, so machine noise hits all of them
alike:

- rvod: a jitted, donating optax step on this rank's batch whose updates ``hvd.DistributedOptimizer``
  averages (one grouped allreduce, an ordered host callback inside the compiled step);
- jax.distributed: the same step jitted over global arrays, the batch sharded across the two processes'
  devices and the parameters replicated, so XLA inserts the gradient all-reduce itself (SPMD, gloo);
- one process: rank 0 steps on its batch alone while rank 1 waits (for E(2) = t(1) / t(2), same batch per
  rank).

Models: an MLP on digits-sized inputs (64 features, 10 classes) with hidden layers of ``--small-width``,
and one of ``--width`` (3 hidden layers), where communication matters. Every time is the slower rank's.
Printed: each round, then the median of the per-round ratios with their min-max, and how far the two
distributed contenders' parameters are apart after the run (same data, same number of steps).
"""

import argparse
import importlib.util
import os
import socket
import statistics
import time
from pathlib import Path

# One XLA CPU thread per rank, as the PyTorch benches run one thread per rank (set before jax starts).
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                 "--xla_cpu_multi_thread_eigen=false"]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rvod.jax as hvd  # noqa: E402

FEATURES, CLASSES = 64, 10  # scikit-learn's digits: 8x8 images, 10 classes
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "jax_digits.py"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per contender and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each timed block")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--small-width", type=int, default=128, help="hidden width of the digits-sized MLP (1 layer)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the larger MLP (3 layers)")
    return parser.parse_args()


def digits_model():
    """examples/jax_digits.py's MLP: its ``init_params(sizes, seed)`` and ``loss_fn(params, x, y)``."""
    spec = importlib.util.spec_from_file_location("jax_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.init_params, module.loss_fn


init_params, loss = digits_model()


def make_step(tx):
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def slowest(seconds):
    """The largest of every rank's ``seconds`` (exchanged outside any timed region)."""
    return max(hvd.allgather_object(seconds, name="bench.seconds"))


class Contender:
    """One contender's parameters, optimizer state and jitted step; ``run`` times its steps."""

    def __init__(self, step, params, opt_state, x, y):
        self.step, self.state, self.x, self.y = step, (params, opt_state), x, y

    def run(self, warmup, steps):
        for _ in range(warmup):
            self.state = self.step(*self.state, self.x, self.y)
        jax.block_until_ready(self.state)
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            self.state = self.step(*self.state, self.x, self.y)
        jax.block_until_ready(self.state)
        return time.perf_counter() - start


def contenders(sizes, batch_size, mesh):
    """(rvod, jax.distributed, one process) for an MLP of ``sizes``, from the same parameters and data."""
    rng = np.random.default_rng(1 + hvd.rank())  # this rank's batch
    x = rng.standard_normal((batch_size, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, batch_size).astype(np.int32)
    # The same on every rank; as NumPy, so each contender's device_put makes its own copy (the steps donate).
    params = jax.tree_util.tree_map(np.asarray, init_params(sizes, 0))

    def sgd():
        return optax.sgd(0.01, momentum=0.9)

    local = jax.tree_util.tree_map(jax.device_put, params)
    rvod_tx = hvd.DistributedOptimizer(sgd())
    rvod = Contender(make_step(rvod_tx), local, jax.jit(rvod_tx.init)(local), jax.device_put(x), jax.device_put(y))

    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    shared = jax.tree_util.tree_map(
        lambda p: jax.make_array_from_callback(p.shape, replicated, lambda index: p[index]), params)
    spmd = Contender(make_step(sgd()), shared, jax.jit(sgd().init)(shared),
                     jax.make_array_from_process_local_data(batch, x),
                     jax.make_array_from_process_local_data(batch, y))

    alone = jax.tree_util.tree_map(jax.device_put, params)
    one = Contender(make_step(sgd()), alone, jax.jit(sgd().init)(alone), jax.device_put(x), jax.device_put(y))
    return rvod, spmd, one


def summary(label, values):
    return f"{label} median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def log(text):
    if hvd.rank() == 0:
        print(text, flush=True)


def training(args, name, sizes, mesh):
    rvod, spmd, one = contenders(sizes, args.batch_size, mesh)
    params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(rvod.state[0]))
    log(f"\n{name}: {params / 1e6:.3f} M parameters ({params * 4 / 2**20:.2f} MiB of gradients), batch "
        f"{args.batch_size} per rank, {args.steps} timed steps per contender and round")
    ratios, rvod_eff, spmd_eff = [], [], []
    for round_index in range(args.rounds):
        t_rvod = slowest(rvod.run(args.warmup, args.steps)) / args.steps
        t_spmd = slowest(spmd.run(args.warmup, args.steps)) / args.steps
        seconds = one.run(args.warmup, args.steps) if hvd.rank() == 0 else 0.0
        if hvd.rank() != 0:
            hvd.barrier()  # rank 0's run() waits here before timing alone
        t_one = slowest(seconds) / args.steps
        ratios.append(t_rvod / t_spmd)
        rvod_eff.append(t_one / t_rvod)
        spmd_eff.append(t_one / t_spmd)
        log(f"  round {round_index}: step rvod {t_rvod * 1e3:7.2f} ms, jax.distributed {t_spmd * 1e3:7.2f} ms, "
            f"one process {t_one * 1e3:7.2f} ms; rvod/jax.distributed {ratios[-1]:.3f}; "
            f"E(2) rvod {rvod_eff[-1]:.3f}, jax.distributed {spmd_eff[-1]:.3f}")
    log("  " + summary("step time rvod/jax.distributed", ratios))
    log("  " + summary("E(2) rvod", rvod_eff) + "; " + summary("E(2) jax.distributed", spmd_eff))
    apart = max(float(jnp.max(jnp.abs(a - np.asarray(b.addressable_data(0)))))
                for a, b in zip(jax.tree_util.tree_leaves(rvod.state[0]), jax.tree_util.tree_leaves(spmd.state[0])))
    log(f"  parameters after {args.rounds * (args.warmup + args.steps)} steps: rvod and jax.distributed differ "
        f"by at most {apart:.2e}")


def init_jax_distributed():
    """jax.distributed beside rvod: a coordinator on a port rank 0 chose, shared through rvod; gloo collectives."""
    port = None
    if hvd.rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="bench.jax.port")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=hvd.size(), process_id=hvd.rank(),
                               initialization_timeout=60)
    return Mesh(np.array(jax.devices()), ("data",))


def main():
    args = parse_args()
    hvd.init()
    if hvd.size() != 2:
        raise SystemExit("run with 2 ranks: rvodrun -np 2 python benches/jax_training.py")
    mesh = init_jax_distributed()
    log(f"rvod.jax vs jax.distributed (gloo): 2 ranks, 1 XLA thread each, jax {jax.__version__}, "
        f"optax {optax.__version__}, {os.cpu_count()} CPUs, {args.rounds} alternating rounds")
    training(args, f"MLP {FEATURES}-{args.small_width}-{CLASSES} (digits-sized)",
             [FEATURES, args.small_width, CLASSES], mesh)
    training(args, f"MLP {FEATURES}-{args.width}x3-{CLASSES}", [FEATURES] + [args.width] * 3 + [CLASSES], mesh)
    jax.distributed.shutdown()
    hvd.shutdown()


if __name__ == "__main__":
    main()
