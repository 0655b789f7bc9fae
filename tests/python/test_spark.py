"""rvod.spark.run on Spark in local-cluster mode (a master, a worker and two executors of 2 cores each, in
JVMs this module starts; RVOD_TEST_SPARK_MASTER=local[4] runs the same tests in one JVM): every op on 2
and 3 ranks, torch training equal to rvodrun's, failures named by rank with no rank left behind, and a run
after a failure."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pyspark = pytest.importorskip("pyspark", reason="rvod.spark needs pyspark (pip install pyspark) to be tested")
cloudpickle = pytest.importorskip("cloudpickle")

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import cluster_fns  # noqa: E402
from conftest import tagged_pids  # noqa: E402

import rvod.spark  # noqa: E402

# Spark's executors cannot import the tests' modules: functions from them travel by value.
cloudpickle.register_pickle_by_value(cluster_fns)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python: this one, where rvod is installed
    from pyspark.sql import SparkSession

    master = os.environ.get("RVOD_TEST_SPARK_MASTER", "local-cluster[2,2,512]")  # local[4]: one JVM, faster
    session = (SparkSession.builder.master(master).appName("rvod-tests")
               .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
               .config("spark.driver.memory", "512m").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_op_gives_the_right_values(spark, ranks):
    cluster_fns.assert_collectives(rvod.spark.run(cluster_fns.collectives, num_proc=ranks, start_timeout=60))


@pytest.mark.timeout(300)
def test_training_matches_rvodrun(spark, run_rvodrun, tmp_path):
    expected = cluster_fns.rvodrun_parameters(run_rvodrun, tmp_path)
    cluster_fns.assert_same_parameters(rvod.spark.run(cluster_fns.train, num_proc=2), expected)


def _greet(word, punctuation="."):
    import os

    print(f"{word} from rank {os.environ['RVOD_RANK']}{punctuation}")
    return int(os.environ["RVOD_LOCAL_RANK"]), os.environ["RVOD_TEST_MARK"]


@pytest.mark.timeout(120)
def test_arguments_environment_and_output_reach_the_driver(spark):
    out = io.StringIO()
    results = rvod.spark.run(_greet, args=("hello",), kwargs={"punctuation": "!"}, num_proc=2,
                             env={"RVOD_TEST_MARK": "from the driver"}, stdout=out)
    assert results == [(0, "from the driver"), (1, "from the driver")]
    assert out.getvalue().splitlines() == ["[0]<stdout>:hello from rank 0!", "[1]<stdout>:hello from rank 1!"]


@pytest.mark.timeout(240)
def test_a_failing_rank_is_named_no_rank_is_left_and_the_next_run_works(spark):
    tag = uuid.uuid4().hex
    started = time.monotonic()
    with pytest.raises(RuntimeError) as failure:
        rvod.spark.run(cluster_fns.fail_on_rank_one, num_proc=2, env={"RVOD_TEST_JOB_TAG": tag})
    took = time.monotonic() - started
    message = str(failure.value)
    assert re.search(r"^rvod\.spark\.run: rank 1 on \S+ failed: rank 1 raised:", message), message
    assert "Traceback (most recent call last)" in message and "ValueError: rank one fails on purpose" in message
    assert "the Spark job was cancelled" in message
    assert took < 60, f"rank 0 waited in a collective for ever: the failure took {took:.0f} s to report"
    deadline = time.monotonic() + 30
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert tagged_pids(tag) == [], "rank 0's process outlived the cancelled Spark job"
    cluster_fns.assert_collectives(rvod.spark.run(cluster_fns.collectives, num_proc=2))


def test_folders_of_killed_tasks_are_removed_by_the_next_task(tmp_path):
    """A task Spark kills runs no cleanup: its rank folder stays until a later task finds its process gone."""
    from rvod.spark import rank_process

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"rvod-spark-{gone.pid}-rank0-abc123"
    orphan.mkdir()
    (orphan / "rank0.payload").write_bytes(b"left behind")
    in_use = tmp_path / f"rvod-spark-{os.getpid()}-rank1-def456"
    in_use.mkdir()
    unrelated = tmp_path / f"rvod-spark-rank0-{gone.pid}"
    unrelated.mkdir()
    assert rank_process.remove_orphaned_workdirs(str(tmp_path)) == [str(orphan)]
    assert not orphan.exists() and in_use.is_dir() and unrelated.is_dir()
    with rank_process.workdir(2) as folder:
        assert Path(folder).name.startswith(f"rvod-spark-{os.getpid()}-rank2-")
        assert folder not in rank_process.remove_orphaned_workdirs() and Path(folder).is_dir()
    assert not Path(folder).exists()


@pytest.mark.timeout(240)
def test_a_rank_whose_process_dies_is_named(spark):
    with pytest.raises(RuntimeError, match=r"rank 1 on \S+ failed: rank 1's process exited with status 3 before "
                                           r"returning a result"):
        rvod.spark.run(cluster_fns.exit_on_rank_one, num_proc=2)
    assert rvod.spark.run(lambda: 5, num_proc=3) == [5, 5, 5]


def test_arguments_are_checked_before_anything_starts(spark):
    with pytest.raises(ValueError, match="num_proc must be a positive integer"):
        rvod.spark.run(lambda: None, num_proc=0)


_WITHOUT_RVOD = """
import os, sys
from pyspark.sql import SparkSession
import rvod.spark
session = (SparkSession.builder.master("local[2]").appName("rvod-preflight")
           .config("spark.ui.enabled", "false").config("spark.driver.memory", "512m").getOrCreate())
session.sparkContext.setLogLevel("OFF")
try:
    rvod.spark.run(lambda: 1, num_proc=2)
except RuntimeError as error:
    print("RAISED:", error)
else:
    print("NO ERROR")
session.stop()
"""


@pytest.mark.timeout(180)
def test_executors_without_rvod_are_named_before_the_job_starts(tmp_path):
    # The executors' Python: a fresh virtual environment of the same interpreter version, without rvod.
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    env = {**os.environ, "PYSPARK_PYTHON": str(bare / "bin" / "python"), "PYSPARK_DRIVER_PYTHON": sys.executable}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _WITHOUT_RVOD], env=env, capture_output=True, text=True,
                          timeout=150)
    out = done.stdout
    assert "RAISED:" in out, (out, done.stderr[-3000:])
    message = out.split("RAISED:", 1)[1]
    # What is wrong and what to do come first, naming the executors' interpreter.
    assert message.lstrip().startswith("rvod.spark.run: rvod is not importable in the Spark executors' Python ("), message
    assert str(bare / "bin" / "python") in message
    assert "ModuleNotFoundError: No module named 'rvod'" in message
    assert "install rvod in the executors' Python, or set PYSPARK_PYTHON" in message
    assert "without reporting a result" not in message
    assert time.monotonic() - started < 150
