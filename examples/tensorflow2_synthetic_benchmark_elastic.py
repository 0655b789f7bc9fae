"""TensorFlow 2 synthetic benchmark as an elastic job, written the way Horovod's
tensorflow2_synthetic_benchmark_elastic.py is: a Keras application model trains on one random batch in a
tf.function with DistributedGradientTape; model, optimizer and results live in a TensorFlowKerasState
that commits every --num-batches-per-commit batches, and a reset (a worker died, or hosts came or went)
goes on from the last commit with the learning rate scaled to the new number of ranks. Run it with:

    rvodrun --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \
        python examples/tensorflow2_synthetic_benchmark_elastic.py

--image-size and --num-classes (Horovod's script fixes 224 and 1000) let a test run it small.
"""

import argparse
import os
import timeit

import numpy as np
import tensorflow as tf
from tensorflow.keras import applications

import rvod.tensorflow as hvd

parser = argparse.ArgumentParser(description="TensorFlow Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="ResNet50", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=224, help="height and width of the synthetic images")
parser.add_argument("--num-classes", type=int, default=1000, help="number of classes of the model")
parser.add_argument("--num-warmup-batches", type=int, default=10,
                    help="number of warm-up batches that don't count towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
parser.add_argument("--num-batches-per-commit", type=int, default=1,
                    help="number of batches per commit of the elastic state object")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
args = parser.parse_args()
args.cuda = not args.no_cuda

# Horovod: initialize Horovod (in an elastic job: join the world the driver formed).
hvd.init()

# Horovod: pin the GPU of this process's local rank (one GPU per process).
if args.cuda:
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

# A standard model, and a learning rate scaled by the number of ranks.
lr = 0.01
model = getattr(applications, args.model)(weights=None, input_shape=(args.image_size, args.image_size, 3),
                                          classes=args.num_classes)
opt = tf.optimizers.SGD(lr * hvd.size())

data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=args.num_classes, dtype=tf.int64)


@tf.function
def train_one_batch():
    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.keras.losses.sparse_categorical_crossentropy(target, probs)

    # Horovod: wrap the tape so that the gradients are averaged across ranks.
    tape = hvd.DistributedGradientTape(tape, compression=compression)

    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))


def benchmark_step(state):
    train_one_batch()
    if state is not None:
        state.batch += 1
        if state.batch == args.num_batches_per_commit:
            state.batch = 0
            state.commit()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "", flush=True)


log("Model: %s" % args.model)
log("Batch size: %d" % args.batch_size)
device = "GPU" if args.cuda and tf.config.list_physical_devices("GPU") else "CPU"
log("Number of %ss: %d" % (device, hvd.size()))

# Horovod's script runs one batch here so that the optimizer has its variables before they are
# synchronised. TensorFlowKerasState builds them itself; leaving the batch out also keeps a worker that
# joins a running job from starting with a collective the others do not run.


@hvd.elastic.run
def run_benchmark(state):
    log("Training on %d ranks" % hvd.size())
    with tf.device(device):
        # Warm-up
        if not state.warm:
            log("Running warmup...")
            timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches)
            state.warm = True
            state.commit()

        # Benchmark
        if state.iter == 0:
            log("Running benchmark...")
        for x in range(state.iter, args.num_iters):
            time = timeit.timeit(lambda: benchmark_step(state), number=args.num_batches_per_iter)
            img_sec = args.batch_size * args.num_batches_per_iter / time
            log("Iter #%d: %.1f img/sec per %s" % (x, img_sec, device))
            state.img_secs.append(img_sec)
            # The next iteration to run: a reset after this commit does not record this one twice.
            state.iter = x + 1
            state.commit()


def on_state_reset():
    opt.learning_rate.assign(lr * hvd.size())


state = hvd.elastic.TensorFlowKerasState(model, opt, img_secs=[], iter=0, batch=0, warm=False)
state.register_reset_callbacks([on_state_reset])
run_benchmark(state)

# Results
img_sec_mean = np.mean(state.img_secs)
img_sec_conf = 1.96 * np.std(state.img_secs)
log("Img/sec per %s: %.1f +-%.1f" % (device, img_sec_mean, img_sec_conf))
log("Total img/sec on %d %s(s): %.1f +-%.1f" %
    (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))
log("Iterations recorded: %d" % len(state.img_secs))
