"""rvod.tensorflow.data (Horovod's tf.data compute service): the compute service's registrations, waits and
errors without TensorFlow; then a compute job of 1 worker (``rvodrun -np 1 python -m
rvod.tensorflow.data.compute_worker``) serving a training job of 2 ranks, and the data-service example.

Each job's output goes to files (no pipe can fill up); every wait has a timeout, and the job tag kills what
a failing test leaves behind."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import JOB_TAG_VARIABLE, RVODRUN, kill_tagged

from rvod.runner.cluster_job import new_secret
from rvod.runner.compute_service import ComputeClient, ComputeService, ComputeServiceError, ComputeServiceTimeout

WORKER = Path(__file__).resolve().parent / "workers" / "tf_data_service.py"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tensorflow2_digits_data_service.py"


@pytest.mark.timeout(30)
def test_compute_service_registers_dispatchers_and_workers_and_times_out_clearly():
    key = new_secret()
    service = ComputeService(1, 2, key)
    try:
        (name, [(host, port)]), = service.addresses().items()
        assert (name, host) == ("lo", "127.0.0.1")
        client = ComputeClient(service.addresses(), key, timeout=5)
        assert client.shape() == (1, 2)
        with pytest.raises(IndexError, match=r"Dispatcher id must be within \[0..0\]: 1"):
            client.register_dispatcher(1, "grpc://127.0.0.1:1")
        start = time.monotonic()
        with pytest.raises(ComputeServiceTimeout, match=r"Timed out after 0.3 s waiting for dispatcher 0 to register"):
            client.wait_for_dispatcher_registration(0, 0.3)
        assert time.monotonic() - start < 2
        client.register_dispatcher(0, "grpc://127.0.0.1:5050")
        client.register_dispatcher(0, "grpc://127.0.0.1:5050")  # the same address again is fine
        with pytest.raises(ValueError, match="already been registered under different address grpc://127.0.0.1:5050"):
            client.register_dispatcher(0, "grpc://127.0.0.1:6060")
        assert client.wait_for_dispatcher_registration(0, 1) == "grpc://127.0.0.1:5050"
        client.register_worker_for_dispatcher(0, 0)
        with pytest.raises(ComputeServiceTimeout, match=r"workers for dispatcher 0 to register \(1 of 2 did\)"):
            client.wait_for_dispatcher_worker_registration(0, 0.3)
        client.register_worker_for_dispatcher(0, 1)
        client.wait_for_dispatcher_worker_registration(0, 1)
        assert client.is_running()
        with pytest.raises(ComputeServiceError, match="rejected our proof: is the job secret the same everywhere"):
            ComputeClient(service.addresses(), new_secret(), timeout=5)
        ComputeClient(service.addresses(), key, timeout=5).shutdown()
        assert not client.is_running()
        client.wait_for_shutdown()
    finally:
        service.shutdown()
    with pytest.raises(ComputeServiceError, match=f"the compute service at 127.0.0.1:{port} went away"):
        client.is_running()
    start = time.monotonic()
    with pytest.raises(ComputeServiceError, match=f"cannot reach the compute service within 1 s .*127.0.0.1:{port}"):
        ComputeClient(service.addresses(), key, timeout=1)
    assert time.monotonic() - start < 3
    with pytest.raises(ValueError, match="number of dispatchers must be larger than 0: 0"):
        ComputeService(0, 1, key)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ending", ["dies", "is asked to shut down", "outlives the process"])
def test_a_process_whose_compute_service_dies_exits_with_a_message_instead_of_hanging(ending):
    """tf.data's client retries a dead dispatcher forever, in code Ctrl-C cannot interrupt: the watchdog ends
    such a process (here one blocked in a wait) once the service is gone, and leaves it alone when the
    service was asked to shut down first; a process that ends while the service runs exits cleanly."""
    key = new_secret()
    service = ComputeService(1, 1, key)
    program = ("import sys, threading; from rvod.runner.compute_service import exit_if_lost; "
               f"exit_if_lost({service.addresses()!r}, bytes.fromhex('{key.hex()}'), 5); "
               "print('watching', flush=True); threading.Event().wait(float(sys.argv[1]))")
    wait = "0" if ending == "outlives the process" else "20"
    process = subprocess.Popen([sys.executable, "-c", program, wait], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline() == "watching\n"
        start = time.monotonic()
        if ending == "dies":
            service._server.close()  # as when the compute job is killed: nobody asked for a shutdown
            _, stderr = process.communicate(timeout=15)
            assert process.returncode == 1 and time.monotonic() - start < 5, stderr
            (_, [(_, port)]), = service.addresses().items()
            assert (f"rvod: the compute service at 127.0.0.1:{port} went away before anyone asked it to shut down "
                    "(did the compute job die?)") in stderr, stderr
        elif ending == "outlives the process":
            _, stderr = process.communicate(timeout=15)
            assert (process.returncode, stderr) == (0, ""), stderr
        else:
            ComputeClient(service.addresses(), key).shutdown()  # as the training job's rank 0 does at its end
            time.sleep(0.3)
            service.shutdown()
            time.sleep(1.0)
            assert process.poll() is None, process.communicate()
    finally:
        process.kill()
        process.communicate(timeout=10)
        service.shutdown()


class ComputeJob:
    """``rvodrun -np N python -m rvod.tensorflow.data.compute_worker CONFIG ARGS`` in the background."""

    def __init__(self, job_env, folder: Path, np: int, *args: str):
        self.config = folder / "compute.json"
        self.out, self.err = folder / "compute.out", folder / "compute.err"
        command = [sys.executable, *RVODRUN, "-np", str(np), sys.executable, "-m",
                   "rvod.tensorflow.data.compute_worker", str(self.config), *args]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(command, env=job_env, stdout=out, stderr=err, cwd=folder)
        self.tag = job_env[JOB_TAG_VARIABLE]

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tagged(self.tag)
            pytest.fail(f"the compute job did not end within {timeout} s after the shutdown request\n{self.report()}")

    def report(self) -> str:
        return f"compute job stdout:\n{self.out.read_text()[-3000:]}\nstderr:\n{self.err.read_text()[-3000:]}"


def results(stdout: str) -> dict[int, dict]:
    found = [json.loads(line) for line in re.findall(r"^\[\d\]<stdout>:result (.*)$", stdout, re.MULTILINE)]
    return {result["rank"]: result for result in found}


@pytest.mark.timeout(150)
def test_two_training_ranks_take_their_batches_from_one_compute_worker(job_env, run_rvodrun, tmp_path):
    pytest.importorskip("tensorflow", reason="the tf.data service needs TensorFlow (pip install .[tensorflow])")
    compute = ComputeJob(job_env, tmp_path, 1, "--timeout", "30")
    training = run_rvodrun(["-np", "2", sys.executable, str(WORKER), str(compute.config), "64", "8"], timeout=120)
    report = f"exit {training.returncode}\n{training.stdout[-5000:]}\n{training.stderr[-5000:]}\n{compute.report()}"
    assert training.returncode == 0, report
    assert compute.wait(30) == 0, report  # rank 0's shutdown request ended it
    assert re.search(r"^\[0\]<stdout>:compute service of 1 dispatcher\(s\) \(compute side\) and 1 worker\(s\) at "
                     r"\{'lo': \[\('127.0.0.1', \d+\)\]\}; config in ", compute.out.read_text(), re.M), report

    found = results(training.stdout)
    assert sorted(found) == [0, 1], report
    for rank, result in found.items():
        assert result["size"] == 2 and result["round_trip"], report
        config = result["config"]
        assert (config["dispatchers"], config["workers_per_dispatcher"], config["dispatcher_side"],
                config["timeout"]) == (1, 1, "compute", 30), report
        assert [host for host, _ in config["addresses"]["lo"]] == ["127.0.0.1"], report
        # A job of its own: every rank gets all 8 batches of 8, in order (one worker).
        assert result["own"] == [list(range(start, start + 8)) for start in range(0, 64, 8)], report
        # Missing config file, then a service that is gone: clear errors, in time.
        kind, message, seconds = result["no_config"]
        assert kind == "ComputeServiceTimeout" and "start the compute job first" in message and seconds < 2, report
        kind, message, seconds = result["dead"]
        assert kind == "ComputeServiceError" and seconds < 5, report
        assert message.startswith("cannot reach the compute service within 2 s (127.0.0.1:"), report
    # One job shared first come first served: the ranks' batches are disjoint and together the whole dataset.
    shared = found[0]["shared"] + found[1]["shared"]
    assert len(shared) == 8 and all(len(batch) == 8 for batch in shared), report
    assert sorted(value for batch in shared for value in batch) == list(range(0, 640, 10)), report


@pytest.mark.timeout(150)
def test_data_service_example_trains_with_training_side_dispatchers(job_env, run_rvodrun, tmp_path):
    pytest.importorskip("sklearn", reason="the digits examples need scikit-learn")
    compute = ComputeJob(job_env, tmp_path, 1, "--dispatcher-side", "training", "--timeout", "30")
    training = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLE), str(compute.config), "--epochs", "6"],
                           timeout=120)
    report = f"exit {training.returncode}\n{training.stdout[-5000:]}\n{training.stderr[-5000:]}\n{compute.report()}"
    assert training.returncode == 0, report
    assert compute.wait(30) == 0, report
    final = re.search(r"^\[0\]<stdout>:trained on 2 ranks in [\d.]+ s with data from 1 tf.data worker\(s\) of 1 dispatcher\(s\) "
                      r"\(training side\): (\d+) batches of 32 per rank, test accuracy (\d\.\d+)$", training.stdout,
                      re.MULTILINE)
    assert final and float(final.group(2)) > 0.9, report
    assert final.group(1) == str(6 * (1347 // (2 * 32))), report  # 6 epochs of the 1347 training images
    assert "[1]<stdout>:" not in training.stdout, "only rank 0 prints"
