"""rvod.tensorflow.data (Horovod's tf.data compute service): the compute service's registrations, waits and
errors, and the watchdog that ends a process whose service died, without TensorFlow; then a compute job of 1
worker (``rvodrun -np 1 python -m rvod.tensorflow.data.compute_worker``) serving a training job of 2 ranks
until it is killed, and the data-service example with the dispatcher in the training job, which ends the
compute job with a shutdown request.

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


class Job:
    """``rvodrun ARGS`` in the background, its output in files named after the job."""

    def __init__(self, job_env, folder: Path, name: str, *args: str):
        self.name, self.out, self.err = name, folder / f"{name}.out", folder / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen([sys.executable, *RVODRUN, *args], env=job_env, stdout=out, stderr=err,
                                            cwd=folder)
        self.tag = job_env[JOB_TAG_VARIABLE]

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tagged(self.tag)
            pytest.fail(f"the {self.name} job did not end within {timeout} s\n{self.report()}")

    def wait_for_lines(self, lines: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(line in self.out.read_text().splitlines() for line in lines):
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the {self.name} job did not print {lines} within {timeout} s\n{self.report()}")
            time.sleep(0.2)

    def report(self) -> str:
        return f"{self.name} job stdout:\n{self.out.read_text()[-4000:]}\nstderr:\n{self.err.read_text()[-4000:]}"


def compute_job(job_env, folder: Path, *args: str) -> Job:
    """``rvodrun -np 1 python -m rvod.tensorflow.data.compute_worker CONFIG ARGS``; its config is folder/compute.json."""
    return Job(job_env, folder, "compute", "-np", "1", sys.executable, "-m", "rvod.tensorflow.data.compute_worker",
               str(folder / "compute.json"), *args)


def results(stdout: str) -> dict[int, dict]:
    found = [json.loads(line) for line in re.findall(r"^\[\d\]<stdout>:result (.*)$", stdout, re.MULTILINE)]
    return {result["rank"]: result for result in found}


@pytest.mark.timeout(180)
def test_two_training_ranks_take_their_batches_from_one_compute_worker_and_end_when_it_dies(job_env, tmp_path):
    pytest.importorskip("tensorflow", reason="the tf.data service needs TensorFlow (pip install .[tensorflow])")
    compute = compute_job(job_env, tmp_path, "--timeout", "30")
    training = Job(job_env, tmp_path, "training", "-np", "2", sys.executable, str(WORKER),
                   str(tmp_path / "compute.json"), "64", "8")
    training.wait_for_lines(["[0]<stdout>:streaming", "[1]<stdout>:streaming"], timeout=150)
    report = f"{training.report()}\n{compute.report()}"
    assert re.search(r"^\[0\]<stdout>:compute service of 1 dispatcher\(s\) \(compute side\) and 1 worker\(s\) at "
                     r"\{'lo': \[\('127.0.0.1', (\d+)\)\]\}; config in ", compute.out.read_text(), re.M), report

    found = results(training.out.read_text())
    assert sorted(found) == [0, 1], report
    for result in found.values():
        assert result["size"] == 2 and result["round_trip"], report
        config = result["config"]
        assert (config["dispatchers"], config["workers_per_dispatcher"], config["dispatcher_side"],
                config["timeout"]) == (1, 1, "compute", 30), report
        assert [host for host, _ in config["addresses"]["lo"]] == ["127.0.0.1"], report
        # A job of its own: every rank gets all 8 batches of 8, in order (one worker).
        assert result["own"] == [list(range(start, start + 8)) for start in range(0, 64, 8)], report
        # No config file yet, or a config whose service is not there: clear errors, in time.
        kind, message, seconds = result["no_config"]
        assert kind == "ComputeServiceTimeout" and "start the compute job first" in message and seconds < 2, report
        kind, message, seconds = result["dead"]
        assert kind == "ComputeServiceError" and seconds < 3, report
        assert message.startswith("cannot reach the compute service within 1 s (127.0.0.1:"), report
    # One job shared first come first served: the ranks' batches are disjoint and together the whole dataset.
    shared = found[0]["shared"] + found[1]["shared"]
    assert len(shared) == 8 and all(len(batch) == 8 for batch in shared), report
    assert sorted(value for batch in shared for value in batch) == list(range(0, 640, 10)), report

    # The compute job dies (stopped without a shutdown request) while both ranks read from it.
    port = config["addresses"]["lo"][0][1]
    compute.process.terminate()
    start = time.monotonic()
    assert training.wait(40) != 0, training.report()
    seconds = time.monotonic() - start
    report = f"{training.report()}\n{compute.report()}"
    assert seconds < 30, report
    assert (f"rvod: the compute service at 127.0.0.1:{port} went away before anyone asked it to shut down "
            "(did the compute job die?)") in training.err.read_text(), report
    assert re.search(r"^rvodrun: rank [01] \(pid \d+\) exited with code 1$", training.err.read_text(), re.M), report
    compute.wait(30)


@pytest.mark.timeout(150)
def test_data_service_example_trains_with_training_side_dispatchers(job_env, run_rvodrun, tmp_path):
    pytest.importorskip("tensorflow", reason="the tf.data service needs TensorFlow (pip install .[tensorflow])")
    pytest.importorskip("sklearn", reason="the digits examples need scikit-learn")
    compute = compute_job(job_env, tmp_path, "--dispatcher-side", "training", "--timeout", "30")
    training = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLE), str(tmp_path / "compute.json"),
                            "--epochs", "6"], timeout=120)
    report = f"exit {training.returncode}\n{training.stdout[-5000:]}\n{training.stderr[-5000:]}\n{compute.report()}"
    assert training.returncode == 0, report
    assert compute.wait(30) == 0, report  # rank 0's shutdown request ended it
    final = re.search(r"^\[0\]<stdout>:trained on 2 ranks in [\d.]+ s with data from 1 tf.data worker\(s\) of 1 dispatcher\(s\) "
                      r"\(training side\): (\d+) batches of 32 per rank, test accuracy (\d\.\d+)$", training.stdout,
                      re.MULTILINE)
    assert final and float(final.group(2)) > 0.9, report
    assert final.group(1) == str(6 * (1347 // (2 * 32))), report  # 6 epochs of the 1347 training images
    assert "[1]<stdout>:" not in training.stdout, "only rank 0 prints"
