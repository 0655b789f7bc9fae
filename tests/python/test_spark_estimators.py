"""rvod.spark's estimators on Spark local-cluster (2 executors of 1 core, JVMs this module starts) with
scikit-learn's digits, through the examples (examples/spark_torch_estimator_digits.py,
examples/spark_keras_estimator_digits.py, run in this module's Spark session): a fit on 2 ranks reaches
the accuracy of the same model trained plainly, transform's prediction columns are the returned model's own
predictions, checkpoints land in the store, a failing rank is named; the stores' paths and the errors of
the stores this machine cannot test."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark", reason="rvod.spark needs pyspark (pip install pyspark) to be tested")
torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("pyarrow")
cloudpickle = pytest.importorskip("cloudpickle")

# The examples train with torch in this process (the plain reference model), where the rest of the suite has
# already loaded TensorFlow and JAX. torch.optim imports torch._dynamo, which imports triton if it is
# installed (the CUDA wheel ships it), and loading triton's LLVM next to theirs aborts the whole process
# (SIGABRT in triton/knobs.py, reproduced with test_jax + test_tensorflow_ops + this module). On CPU torch needs
# no triton: unless something loaded it already, this process treats it as absent.
sys.modules.setdefault("triton", None)

from rvod.spark.common.backend import SparkBackend  # noqa: E402
from rvod.spark.common.store import DBFSLocalStore, HDFSStore, LocalStore, Store  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EPOCHS = 4
BATCH = 32  # the examples' default
# Each rank computes on one thread: two ranks share this machine's cores.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


@pytest.fixture(scope="module")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    master = os.environ.get("RVOD_TEST_SPARK_MASTER", "local-cluster[2,1,1024]")
    builder = (SparkSession.builder.master(master).appName("rvod-estimator-tests")
               .config("spark.ui.enabled", "false").config("spark.executor.memory", "768m")
               .config("spark.driver.memory", "768m").config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true"))
    for name, value in ONE_THREAD.items():
        builder = builder.config(f"spark.executorEnv.{name}", value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def digits():
    """The examples' split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    return train_test_split((data.data / 16.0).astype(np.float32), data.target, test_size=0.25, random_state=0)


def frame(spark, x, y):
    import pandas as pd

    return spark.createDataFrame(pd.DataFrame({"features": list(x), "label": y}))


def run_example(name, store_path, capsys):
    """Runs the example in this process (and so in the module's Spark session); returns it, its fitted model
    and store, and the accuracies it printed."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # the examples import estimator_digits from their folder
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fitted, store = module.main(["-np", "2", "--epochs", str(EPOCHS), "--store", str(store_path)])
    out = capsys.readouterr().out
    assert "checkpoint in the store: True" in out, out
    found = re.search(r"trained on 2 ranks in [\d.]+ s; validation accuracy ([\d.]+); test accuracy ([\d.]+)", out)
    assert found, out
    return module, fitted, store, float(found.group(1)), float(found.group(2))


def assert_transform_gives_the_models_outputs(spark, fitted, x, y, predict):
    """transform keeps the rows and their columns, and adds label__output: a DenseVector of the 10 class
    scores per row, the returned model's own outputs for that row."""
    predicted = fitted.transform(frame(spark, x, y)).collect()
    assert fitted.getOutputCols() == ["label__output"]
    assert [row["label"] for row in predicted] == y.tolist()
    outputs = np.array([row["label__output"].toArray() for row in predicted])
    assert outputs.shape == (len(y), 10) and outputs.dtype == np.float64
    features = np.array([row["features"] for row in predicted], np.float32)
    np.testing.assert_allclose(outputs, predict(features), rtol=1e-5, atol=1e-6)


def torch_predict(model):
    def predict(x):
        with torch.no_grad():
            return model(torch.from_numpy(x).reshape(-1, 1, 8, 8)).numpy()

    return predict


def torch_plain_accuracy(example, x_train, y_train, x_test, y_test):
    """The example's model and optimizer trained in this process for as many epochs on the 2 ranks'
    combined batch."""
    model = example.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=example.LEARNING_RATE)
    x, y = torch.from_numpy(x_train).reshape(-1, 1, 8, 8), torch.from_numpy(y_train.astype(np.int64))
    generator = np.random.default_rng(0)
    for _ in range(EPOCHS):
        order = generator.permutation(len(x))
        for first in range(0, len(order) - 2 * BATCH + 1, 2 * BATCH):
            chosen = order[first:first + 2 * BATCH]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[chosen]), y[chosen]).backward()
            optimizer.step()
    return float((torch_predict(model)(x_test).argmax(1) == y_test).mean())


@pytest.mark.timeout(420)
def test_torch_estimator_matches_plain_training_checkpoints_and_transform_predicts(spark, digits, tmp_path, capsys):
    x_train, x_test, y_train, y_test = digits
    example, fitted, store, validation, printed = run_example("spark_torch_estimator_digits", tmp_path, capsys)
    trained = fitted.getModel()
    got = float((torch_predict(trained)(x_test).argmax(1) == y_test).mean())
    plain = torch_plain_accuracy(example, x_train, y_train, x_test, y_test)
    assert printed == pytest.approx(got, abs=1e-3)  # the example's accuracy, from transform's predictions
    assert got >= 0.9 and got >= plain - 0.03 and validation >= 0.85, (got, plain, validation)

    history = fitted.getHistory()
    assert [entry["epoch"] for entry in history] == list(range(EPOCHS))
    assert set(history[-1]["train"]) == {"loss", "accuracy"} == set(history[-1]["validation"])
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"]

    # The store: the Parquet data and the last epoch's checkpoint, equal to the returned model.
    assert store.exists(store.get_train_data_path()) and store.exists(store.get_val_data_path())
    path = store.get_checkpoint_path("digits")
    assert path == str(tmp_path / "runs" / "digits" / "checkpoint")
    checkpoint = torch.load(io.BytesIO(store.read(path)), weights_only=False)
    assert checkpoint["epoch"] == EPOCHS - 1 and len(checkpoint["history"]) == EPOCHS
    for name, value in trained.state_dict().items():
        assert torch.equal(checkpoint["model"][name], value), name

    assert_transform_gives_the_models_outputs(spark, fitted, x_test[:60], y_test[:60], torch_predict(trained))


@pytest.mark.timeout(420)
def test_keras_estimator_matches_plain_training_checkpoints_and_transform_predicts(spark, digits, tmp_path, capsys):
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    from rvod.spark.keras.remote import model_from_bytes

    x_train, x_test, y_train, y_test = digits
    example, fitted, store, validation, printed = run_example("spark_keras_estimator_digits", tmp_path, capsys)
    trained = fitted.getModel()

    def predict(x):
        return trained.predict(x.reshape(-1, 8, 8, 1), verbose=0)

    got = float((predict(x_test).argmax(1) == y_test).mean())
    plain_model = example.build_model()
    plain_model.compile(optimizer=keras.optimizers.Adam(example.LEARNING_RATE), loss="sparse_categorical_crossentropy")
    plain_model.fit(x_train.reshape(-1, 8, 8, 1), y_train, batch_size=2 * BATCH, epochs=EPOCHS, verbose=0)
    plain = float((plain_model.predict(x_test.reshape(-1, 8, 8, 1), verbose=0).argmax(1) == y_test).mean())
    assert printed == pytest.approx(got, abs=1e-3)
    assert got >= 0.9 and got >= plain - 0.03 and validation >= 0.85, (got, plain, validation)

    history = fitted.getHistory()
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history), history
    assert len(history["loss"]) == EPOCHS and history["loss"][-1] < history["loss"][0]

    saved = model_from_bytes(store.read(store.get_checkpoint_path("digits")), compile=False)
    for mine, theirs in zip(saved.get_weights(), trained.get_weights()):
        np.testing.assert_array_equal(mine, theirs)

    assert_transform_gives_the_models_outputs(spark, fitted, x_test[:60], y_test[:60], predict)


def _fail_on_rank_one(batch):
    if os.environ["RVOD_RANK"] == "1":
        raise ValueError("rank one's batches fail on purpose")
    return batch


@pytest.mark.timeout(300)
def test_a_failing_rank_is_named(spark, digits, tmp_path):
    from rvod.spark.torch import TorchEstimator

    x_train, _, y_train, _ = digits
    model = torch.nn.Linear(64, 10)
    estimator = TorchEstimator(backend=SparkBackend(num_proc=2), store=Store.create(str(tmp_path)), model=model,
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               loss=torch.nn.functional.cross_entropy, feature_cols=["features"],
                               label_cols=["label"], epochs=1, partitions_per_process=1,
                               transformation_fn=_fail_on_rank_one)
    with pytest.raises(RuntimeError) as failure:
        estimator.fit(frame(spark, x_train[:200], y_train[:200]))
    message = str(failure.value)
    assert message.startswith("rvod.spark.run: rank 1 on "), message
    assert "ValueError: rank one's batches fail on purpose" in message


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

    model = torch.nn.Linear(64, 10)
    with pytest.raises(ValueError, match=r"TorchEstimator needs the params \['store', 'label_cols'\]"):
        TorchEstimator(model=model, feature_cols=["features"])._check_params()
    with pytest.raises(ValueError, match="give num_proc or backend, not both"):
        TorchEstimator(model=model, num_proc=2, backend=SparkBackend(num_proc=2))._get_or_create_backend()
