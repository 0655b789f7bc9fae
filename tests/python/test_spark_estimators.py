"""rvod.spark's estimators on Spark local-cluster (2 executors of 1 core, JVMs this module starts) with
scikit-learn's digits: a fit on 2 ranks reaches the accuracy of the same model trained plainly, transform's
prediction columns are the returned model's own predictions, checkpoints land in the store, a failing rank
is named; the stores' paths and the errors of the stores this machine cannot test."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark", reason="rvod.spark needs pyspark (pip install pyspark) to be tested")
torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("pyarrow")
cloudpickle = pytest.importorskip("cloudpickle")

from rvod.spark.common.backend import SparkBackend  # noqa: E402
from rvod.spark.common.store import DBFSLocalStore, HDFSStore, LocalStore, Store  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

EPOCHS = 4
BATCH = 32
# Each rank's torch computes on one thread: two ranks share this machine's cores.
RANK_ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
# Few Parquet files: small data, and each file is a Spark task.
FILES_PER_RANK = 2


@pytest.fixture(scope="module")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    master = os.environ.get("RVOD_TEST_SPARK_MASTER", "local-cluster[2,1,1024]")
    session = (SparkSession.builder.master(master).appName("rvod-estimator-tests")
               .config("spark.executorEnv.OMP_NUM_THREADS", "1")
               .config("spark.ui.enabled", "false").config("spark.executor.memory", "768m")
               .config("spark.driver.memory", "768m").config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    return train_test_split(x, data.target.astype(np.int64), test_size=0.25, random_state=0)


def frame(spark, x, y):
    import pandas as pd

    return spark.createDataFrame(pd.DataFrame({"features": list(x), "label": y}))


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def accuracy(model, x, y):
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def plain_accuracy(x_train, y_train, x_test, y_test, batch):
    """The same model, optimizer and epochs trained in this process with the 2 ranks' combined batch."""
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = np.random.default_rng(0)
    for _ in range(EPOCHS):
        order = generator.permutation(len(x_train))
        for first in range(0, len(order) - batch + 1, batch):
            chosen = order[first:first + batch]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.from_numpy(x_train[chosen])),
                                              torch.from_numpy(y_train[chosen])).backward()
            optimizer.step()
    return accuracy(model, x_test, y_test)


def torch_estimator(store, **overrides):
    from rvod.spark.torch import TorchEstimator

    model = mlp()
    settings = dict(backend=SparkBackend(num_proc=2, env=RANK_ENV), store=store, model=model,
                    optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                    loss=torch.nn.functional.cross_entropy, feature_cols=["features"], label_cols=["label"],
                    batch_size=BATCH, epochs=EPOCHS, random_seed=1, verbose=0,
                    partitions_per_process=FILES_PER_RANK)
    settings.update(overrides)
    return TorchEstimator(**settings)


@pytest.mark.timeout(420)
def test_torch_fit_on_two_ranks_matches_plain_training_and_transform_predicts(spark, digits, tmp_path):
    x_train, x_test, y_train, y_test = digits
    store = Store.create(str(tmp_path / "store"))
    estimator = torch_estimator(store, validation=0.1, metrics=[_correct_fraction], run_id="digits")
    started = time.monotonic()
    fitted = estimator.fit(frame(spark, x_train, y_train))
    took = time.monotonic() - started

    # Accuracy: that of the same model trained plainly on the 2 ranks' combined batch, within 3 points.
    trained = fitted.getModel()
    got, plain = accuracy(trained, x_test, y_test), plain_accuracy(x_train, y_train, x_test, y_test, 2 * BATCH)
    assert got >= 0.9 and got >= plain - 0.03, (got, plain, took)

    # History: one entry per epoch with the train and validation loss and metric, the loss going down.
    history = fitted.getHistory()
    assert [entry["epoch"] for entry in history] == list(range(EPOCHS))
    assert set(history[-1]["train"]) == {"loss", "_correct_fraction"} == set(history[-1]["validation"])
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"]
    assert history[-1]["validation"]["_correct_fraction"] >= 0.85

    # The store: the Parquet data and the last epoch's checkpoint, equal to the returned model.
    assert store.exists(store.get_train_data_path()) and store.exists(store.get_val_data_path())
    checkpoint_path = store.get_checkpoint_path("digits")
    assert checkpoint_path == str(tmp_path / "store" / "runs" / "digits" / "checkpoint")
    checkpoint = torch.load(io.BytesIO(store.read(checkpoint_path)), weights_only=False)
    assert checkpoint["epoch"] == EPOCHS - 1 and len(checkpoint["history"]) == EPOCHS
    for name, value in trained.state_dict().items():
        assert torch.equal(checkpoint["model"][name], value), name

    # Transform: a DenseVector of the 10 logits per row, the returned model's own outputs for that row.
    predicted = fitted.transform(frame(spark, x_test, y_test)).collect()
    assert fitted.getOutputCols() == ["label__output"]
    assert [row["label"] for row in predicted] == y_test.tolist()  # rows and their columns kept, in order
    logits = np.array([row["label__output"].toArray() for row in predicted])
    assert logits.shape == (len(y_test), 10) and logits.dtype == np.float64
    with torch.no_grad():
        expected = trained(torch.from_numpy(np.array([row["features"] for row in predicted], np.float32)))
    np.testing.assert_allclose(logits, expected.numpy(), rtol=1e-5, atol=1e-5)
    assert float((logits.argmax(1) == y_test).mean()) == got


def keras_mlp():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10, activation="softmax")])


def keras_plain_accuracy(x_train, y_train, x_test, y_test, batch):
    import keras

    model = keras_mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    model.fit(x_train, y_train, batch_size=batch, epochs=EPOCHS, verbose=0)
    return float((model.predict(x_test, verbose=0).argmax(1) == y_test).mean())


@pytest.mark.timeout(420)
def test_keras_fit_on_two_ranks_matches_plain_training_and_transform_predicts(spark, digits, tmp_path):
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    from rvod.spark.keras import KerasEstimator

    x_train, x_test, y_train, y_test = digits
    store = Store.create(str(tmp_path / "store"))
    estimator = KerasEstimator(backend=SparkBackend(num_proc=2, env=RANK_ENV), store=store, model=keras_mlp(),
                               optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                               metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                               batch_size=BATCH, epochs=EPOCHS, validation=0.1, random_seed=1, verbose=0,
                               run_id="keras-digits", partitions_per_process=FILES_PER_RANK)
    fitted = estimator.fit(frame(spark, x_train, y_train))
    trained = fitted.getModel()
    got = float((trained.predict(x_test, verbose=0).argmax(1) == y_test).mean())
    plain = keras_plain_accuracy(x_train, y_train, x_test, y_test, 2 * BATCH)
    assert got >= 0.9 and got >= plain - 0.03, (got, plain)

    history = fitted.getHistory()
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history), history
    assert len(history["loss"]) == EPOCHS and history["loss"][-1] < history["loss"][0]

    checkpoint = store.get_checkpoint_path("keras-digits")
    assert store.exists(checkpoint)
    from rvod.spark.keras.remote import model_from_bytes

    saved = model_from_bytes(store.read(checkpoint), compile=False)
    for mine, theirs in zip(saved.get_weights(), trained.get_weights()):
        np.testing.assert_array_equal(mine, theirs)

    predicted = fitted.transform(frame(spark, x_test, y_test)).collect()
    assert [row["label"] for row in predicted] == y_test.tolist()
    outputs = np.array([row["label__output"].toArray() for row in predicted])
    assert outputs.shape == (len(y_test), 10) and outputs.dtype == np.float64
    expected = trained.predict(np.array([row["features"] for row in predicted], np.float32), verbose=0)
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-6)


def _correct_fraction(output, label):
    return float((output.argmax(1) == label).float().mean())


def _fail_on_rank_one(batch):
    if os.environ["RVOD_RANK"] == "1":
        raise ValueError("rank one's batches fail on purpose")
    return batch


@pytest.mark.timeout(180)
def test_a_failing_rank_is_named(spark, digits, tmp_path):
    x_train, _, y_train, _ = digits
    estimator = torch_estimator(Store.create(str(tmp_path / "store")), epochs=1,
                                transformation_fn=_fail_on_rank_one)
    with pytest.raises(RuntimeError) as failure:
        estimator.fit(frame(spark, x_train[:400], y_train[:400]))
    message = str(failure.value)
    assert message.startswith("rvod.spark.run: rank 1 on "), message
    assert "ValueError: rank one's batches fail on purpose" in message


@pytest.mark.timeout(420)
@pytest.mark.parametrize("example", ["spark_torch_estimator_digits", "spark_keras_estimator_digits"])
def test_examples_fit_and_predict(spark, example, capsys):
    """The examples run in this module's Spark session (they use the active one and leave it running)."""
    if "keras" in example:
        pytest.importorskip("keras")
        pytest.importorskip("tensorflow")
    path = Path(__file__).resolve().parents[2] / "examples" / f"{example}.py"
    spec = importlib.util.spec_from_file_location(example, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["-np", "2", "--epochs", "4"])
    out = capsys.readouterr().out
    assert "checkpoint in the store: True" in out, out
    found = re.search(r"trained on 2 ranks in [\d.]+ s; validation accuracy ([\d.]+); test accuracy ([\d.]+)", out)
    assert found and float(found.group(1)) >= 0.85 and float(found.group(2)) >= 0.9, out


def test_stores_place_data_and_runs_and_name_what_they_lack(tmp_path):
    local = Store.create(f"file://{tmp_path}")
    assert type(local) is LocalStore and type(Store.create(str(tmp_path))) is LocalStore
    assert local.get_train_data_path() == f"{tmp_path}/intermediate_train_data"
    assert local.get_val_data_path(3) == f"{tmp_path}/intermediate_val_data.3"
    assert local.get_full_path(local.get_train_data_path()) == f"file://{tmp_path}/intermediate_train_data"
    assert local.get_logs_path("r1") == f"{tmp_path}/runs/r1/logs"
    local.write(local.get_checkpoint_path("r1"), b"state")
    assert local.read(f"{tmp_path}/runs/r1/checkpoint") == b"state"
    assert LocalStore(str(tmp_path), save_runs=False).get_checkpoint_path("r1") is None
    with pytest.raises(RuntimeError, match=r"HDFSStore\('hdfs://namenode:8020/data'\) cannot reach HDFS: "
                                           r"pyarrow's HadoopFileSystem needs libhdfs"):
        Store.create("hdfs://namenode:8020/data")
    assert HDFSStore.matches("hdfs://x") and DBFSLocalStore.matches("dbfs:/x")
    if not Path("/dbfs").is_dir():
        with pytest.raises(RuntimeError, match=r"DBFSLocalStore\('dbfs:/models'\) needs the /dbfs FUSE mount"):
            Store.create("dbfs:/models")


def test_params_are_checked_before_anything_runs(tmp_path):
    from rvod.spark.torch import TorchEstimator

    with pytest.raises(ValueError, match=r"TorchEstimator needs the params \['store', 'label_cols'\]"):
        TorchEstimator(model=mlp(), feature_cols=["features"])._check_params()
    with pytest.raises(ValueError, match="give num_proc or backend, not both"):
        torch_estimator(Store.create(str(tmp_path)), num_proc=2)._get_or_create_backend()
