"""Training with every compressor (arguments: ``torch``, ``keras`` or ``tensorflow``, the epochs, and the seed
of the initial weights and the data order, 42 if not given): the digits CNN of the framework's example
(Keras's in TensorFlow's custom loop with DistributedGradientTape) trains for the same epochs with
``Compression.none``, ``.int8``, ``.onebit`` and ``.powersgd(rank=4)`` from the same initial weights, and rank 0 prints each test accuracy (``accuracy <name> <value>``) for the test
to compare with the uncompressed one. Run with ``RVOD_COMPRESSION_WITHIN_HOST=1`` so one host's ranks
compress as hosts would, or across hosts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

FRAMEWORK = sys.argv[1]
EPOCHS = int(sys.argv[2])
SEED = int(sys.argv[3]) if len(sys.argv) > 3 else 42


def train_torch():
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from torch_digits import DigitsNet, datasets, evaluate

    import rvod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    train_set, test_set = datasets(42)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=SEED)
    test_loader = DataLoader(test_set, batch_size=256,
                             sampler=DistributedSampler(test_set, hvd.size(), hvd.rank(), shuffle=False))
    for name, compression in [("none", hvd.Compression.none), ("int8", hvd.Compression.int8),
                              ("onebit", hvd.Compression.onebit), ("powersgd", hvd.Compression.powersgd(rank=4))]:
        torch.manual_seed(SEED)
        model = DigitsNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02 * hvd.size(), momentum=0.9)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)
        loader = DataLoader(train_set, batch_size=32, sampler=sampler)
        for epoch in range(EPOCHS):
            model.train()
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
        accuracy = evaluate(model, test_loader)
        for key, tensor in model.state_dict().items():
            if not torch.equal(hvd.broadcast(tensor, root_rank=0, name=f"check.{name}.{key}"), tensor):
                raise SystemExit(f"rank {hvd.rank()}: {key} differs from rank 0's after training with {name}")
        if hvd.rank() == 0:
            print(f"accuracy {name} {accuracy:.4f}", flush=True)


def keras_data(hvd):
    """The digits split as the Keras example makes it: this rank's training shard (whole batches on every
    rank) and every rank's test images."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(images, digits.target, test_size=0.25, random_state=42)
    steps = len(x_train) // (hvd.size() * 32)
    shard = slice(hvd.rank(), steps * hvd.size() * 32, hvd.size())
    return x_train[shard], y_train[shard].astype(np.int64), x_test, y_test


def keras_report(hvd, name, model, x_test, y_test):
    """Check every rank holds rank 0's weights and print the test accuracy over every rank's share."""
    import numpy as np

    for i, weight in enumerate(model.get_weights()):
        if not np.array_equal(hvd.broadcast(weight, root_rank=0, name=f"check.{name}.{i}"), weight):
            raise SystemExit(f"rank {hvd.rank()}: weight {i} differs from rank 0's after training with {name}")
    mine = slice(hvd.rank(), None, hvd.size())
    predictions = np.asarray(model(x_test[mine], training=False)).argmax(axis=1)
    correct, total = hvd.allreduce(np.array([(predictions == y_test[mine]).sum(), len(predictions)]),
                                   op=hvd.Sum, name=f"test.{name}")
    if hvd.rank() == 0:
        print(f"accuracy {name} {correct / total:.4f}", flush=True)


def train_keras():
    import keras
    from keras_digits import digits_model

    import rvod.keras as hvd

    hvd.init()
    x_train, y_train, x_test, y_test = keras_data(hvd)
    for name, compression in [("none", hvd.Compression.none), ("int8", hvd.Compression.int8),
                              ("onebit", hvd.Compression.onebit), ("powersgd", hvd.Compression.powersgd(rank=4))]:
        keras.utils.set_random_seed(SEED)  # the same initial weights on every rank and for every compressor
        model = digits_model()
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.02 * hvd.size(), momentum=0.9),
                                             compression=compression)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0)
        keras_report(hvd, name, model, x_test, y_test)


def train_tensorflow():
    """A TensorFlow custom loop: DistributedGradientTape in a tf.function, the Keras model and optimizer."""
    import keras
    import tensorflow as tf
    from keras_digits import digits_model

    import rvod.tensorflow as hvd

    hvd.init()
    x_train, y_train, x_test, y_test = keras_data(hvd)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for name, compression in [("none", hvd.Compression.none), ("int8", hvd.Compression.int8),
                              ("onebit", hvd.Compression.onebit), ("powersgd", hvd.Compression.powersgd(rank=4))]:
        keras.utils.set_random_seed(SEED)
        model = digits_model()
        optimizer = keras.optimizers.SGD(0.02 * hvd.size(), momentum=0.9)

        @tf.function
        def train_step(x, y, model=model, optimizer=optimizer, compression=compression):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = hvd.DistributedGradientTape(tape, compression=compression)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))

        for _ in range(EPOCHS):
            for start in range(0, len(x_train), 32):
                train_step(x_train[start:start + 32], y_train[start:start + 32])
        keras_report(hvd, name, model, x_test, y_test)


{"torch": train_torch, "keras": train_keras, "tensorflow": train_tensorflow}[FRAMEWORK]()
