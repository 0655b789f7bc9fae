"""Elastic training under faults: rvodrun --host-discovery-script with PyTorch workers (workers/elastic_torch.py).

The "hosts" are names that all mean this machine (localhost, 127.0.0.1, its host name): rvodrun starts
their workers directly, and the engine treats them as different hosts (TCP between them). A discovery
script prints the hosts file, which a test rewrites to add or remove hosts while the job runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import JOB_TAG_VARIABLE, RVODRUN, tagged_pids

WORKER = Path(__file__).resolve().parent / "workers" / "elastic_torch.py"
HOSTS = ["localhost", "127.0.0.1", socket.gethostname()]


def read(out: Path, name: str) -> list[dict]:
    """The records the workers appended to `name` so far. A line still being written (no newline yet: a read
    can land in the middle of a worker's write) is left for the next read."""
    path = out / name
    whole = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in whole if line]


class ElasticJob:
    """rvodrun running workers/elastic_torch.py with the hosts in `out/hosts`."""

    def __init__(self, job_env: dict[str, str], out: Path, hosts: str, flags: list[str], wrap=list,
                 to_files: bool = False, **settings: str):
        """`wrap(command)`: the command line that runs rvodrun's (test_elastic_hosts.py runs it in a namespace).
        `to_files`: rvodrun's output goes to out/rvodrun.stdout and out/rvodrun.stderr as it comes (a long job
        keeps what it printed even if the test is stopped), and is read from there at the end."""
        self.out = out
        self.hosts_file = out / "hosts"
        self.set_hosts(hosts)
        env = dict(job_env, ELASTIC_OUT=str(out), **settings)
        command = wrap([sys.executable, *RVODRUN, *flags, "--host-discovery-script", f"cat {self.hosts_file}",
                        sys.executable, str(WORKER)])
        self.files = (out / "rvodrun.stdout", out / "rvodrun.stderr") if to_files else None
        outputs = [path.open("w") for path in self.files] if self.files else [subprocess.PIPE, subprocess.PIPE]
        self.process = subprocess.Popen(command, env=env, stdout=outputs[0], stderr=outputs[1], text=True,
                                        errors="replace")
        for output in outputs:
            if output is not subprocess.PIPE:
                output.close()

    def set_hosts(self, text: str) -> None:
        self.hosts_file.with_suffix(".new").write_text(text)
        self.hosts_file.with_suffix(".new").replace(self.hosts_file)

    def wait_for(self, name: str, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(predicate(entry) for entry in read(self.out, name)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.finish(5)
                pytest.fail(f"no {name} entry as expected\n{self.report()}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        try:
            self.stdout, self.stderr = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.stdout, self.stderr = self.process.communicate()
            self._read_files()
            pytest.fail(f"rvodrun did not finish within {timeout} s\n{self.report()}")
        self._read_files()
        return self.process.returncode

    def _read_files(self) -> None:
        if self.files:
            self.stdout, self.stderr = (path.read_text(errors="replace") for path in self.files)

    def report(self) -> str:
        return f"stdout:\n{getattr(self, 'stdout', '')[-4000:]}\nstderr:\n{getattr(self, 'stderr', '')[-6000:]}"


def completed_epochs(out: Path) -> list[int]:
    """The epochs some rank finished (every rank of the world writes one record per finished epoch)."""
    return sorted({record["epoch"] for record in read(out, "epochs.jsonl")})


def assert_every_sample_once_per_epoch(out: Path, epochs: int, samples: int) -> None:
    """Epochs 0 .. epochs-1 were finished, and every record of each counts every sample exactly once."""
    records = read(out, "epochs.jsonl")
    finished = [r["epoch"] for r in records]
    assert completed_epochs(out) == list(range(epochs)), finished
    for record in records:
        assert record["counts"] == [1.0] * samples, f"epoch {record['epoch']} (rank {record['rank']}): {record['counts']}"


def assert_worlds_start_in_step(out: Path) -> dict[int, list[dict]]:
    """Within each world, every rank started training from the same state; returns round -> starts."""
    worlds: dict[int, list[dict]] = {}
    for start in read(out, "starts.jsonl"):
        worlds.setdefault(start["round"], []).append(start)
    for round_, starts in worlds.items():
        assert sorted(s["rank"] for s in starts) == list(range(starts[0]["size"])), (round_, starts)
        fields = [(s["params"], s["epoch"], s["batch"], s["processed"], s["counted"]) for s in starts]
        assert len(set(fields)) == 1, (round_, starts)
    return worlds


@pytest.mark.timeout(180)
def test_killed_worker_training_goes_on_from_the_commit_with_every_sample_once(job_env, tmp_path):
    """(a) kill -9 of rank 1 in the middle of epoch 1: the other two ranks restore the last commit, form a
    world of 2 and finish; every sample of every epoch is counted exactly once by the committed state."""
    job = ElasticJob(job_env, tmp_path, "".join(f"{host}:1\n" for host in HOSTS), ["--min-np", "2"],
                     ELASTIC_KILL="1:1:5")
    assert job.finish(150) == 0, job.report()
    assert_every_sample_once_per_epoch(tmp_path, 3, 24)
    kills = read(tmp_path, "kills.jsonl")
    assert [(k["round"], k["epoch"]) for k in kills] == [(1, 1)]
    worlds = assert_worlds_start_in_step(tmp_path)
    assert sorted(worlds) == [1, 2] and worlds[2][0]["size"] == 2
    assert {(s["epoch"], s["batch"]) for s in worlds[2]} == {(1, 0)}  # the last commit: epoch 1's start
    assert sorted(r["round"] for r in read(tmp_path, "restores.jsonl")) == [1, 1]
    done = read(tmp_path, "done.jsonl")
    assert len(done) == 2 and len({d["params"] for d in done}) == 1
    assert "worker 2 (rank 1 on 127.0.0.1) was killed by signal SIGKILL; host 127.0.0.1 is blacklisted" in job.stderr


@pytest.mark.timeout(180)
def test_compressed_training_goes_on_after_a_kill_and_the_new_world_starts_without_error_feedback(job_env, tmp_path):
    """Issue 34: a world that re-forms drops the compressed allreduces' error feedback and says so; the new
    world's first int8 allreduce of a name the old world used equals a first step's NumPy reference."""
    job = ElasticJob(job_env, tmp_path, "".join(f"{host}:1\n" for host in HOSTS), ["--min-np", "2"],
                     ELASTIC_KILL="1:1:5", ELASTIC_COMPRESSION="int8", RVOD_LOG_LEVEL="info")
    assert job.finish(150) == 0, job.report()
    assert_every_sample_once_per_epoch(tmp_path, 3, 24)
    probes = read(tmp_path, "probes.jsonl")
    assert sorted((p["round"], p["size"]) for p in probes) == [(1, 3)] * 3 + [(2, 2)] * 2, probes
    assert all(p["equal"] for p in probes), probes
    assert "compressed allreduces: dropping the error feedback of" in job.stderr, job.report()


@pytest.mark.timeout(180)
def test_killed_worker_sharded_optimizer_state_comes_back_from_buddy_copies(job_env, tmp_path):
    """(a) with DistributedOptimizer(sharded=True): the killed rank's slice of the momentum comes back from
    its buddy copy; the new world of 2 starts from exactly the state consolidated at the last commit."""
    job = ElasticJob(job_env, tmp_path, "".join(f"{host}:1\n" for host in HOSTS), ["--min-np", "2"],
                     ELASTIC_KILL="1:1:5", ELASTIC_SHARDED="1")
    assert job.finish(150) == 0, job.report()
    assert_every_sample_once_per_epoch(tmp_path, 3, 24)
    worlds = assert_worlds_start_in_step(tmp_path)
    assert sorted(worlds) == [1, 2] and worlds[2][0]["size"] == 2
    last = [c for c in read(tmp_path, "commits.jsonl") if c["round"] == 1][-1]
    assert (last["epoch"], last["batch"]) == (1, 0)
    assert {s["optimizer"] for s in worlds[2]} == {last["optimizer"]} and last["optimizer"] != 0.0


def open_ended(tmp_path: Path) -> dict[str, str]:
    """Worker settings for a job that trains until OUT/stop exists (then ends with the epoch it is in): a test
    that changes the hosts mid-training cannot lose the race against the training's end on a slow machine."""
    return {"ELASTIC_EPOCHS": "1000", "ELASTIC_STOP_FILE": str(tmp_path / "stop")}


def finish_once_world_2_started(job, tmp_path, timeout, samples):
    """An `open_ended` job: waits for world 2's start, tells the job to stop, and checks that it ended well with
    every sample seen once in each epoch it finished."""
    job.wait_for("starts.jsonl", lambda start: start["round"] == 2, timeout / 2)
    (tmp_path / "stop").touch()
    assert job.finish(timeout) == 0, job.report()
    assert_every_sample_once_per_epoch(tmp_path, len(completed_epochs(tmp_path)), samples)


def progressed(entry: dict) -> bool:
    return entry["batch"] >= 2


@pytest.mark.timeout(180)
def test_added_host_joins_from_the_committed_state(job_env, tmp_path):
    """(b) the discovery script adds a host: the job grows to 3 ranks; the new rank starts with the
    committed parameters, epoch and batch of the others (horovod#2844), nothing is restored, and every
    sample is still counted once."""
    job = ElasticJob(job_env, tmp_path, "localhost:2\n", ["--min-np", "2", "--max-np", "3"], ELASTIC_SAMPLES="48",
                     **open_ended(tmp_path))
    job.wait_for("progress.jsonl", progressed, 90)
    added_at, added_wall = time.monotonic(), time.time()
    job.set_hosts("localhost:2\n127.0.0.1:1\n")
    finish_once_world_2_started(job, tmp_path, 150, 48)
    worlds = assert_worlds_start_in_step(tmp_path)
    assert sorted(worlds) == [1, 2], job.report()
    assert worlds[2][0]["size"] == 3
    last_commit = [p for p in read(tmp_path, "progress.jsonl") if p["round"] == 1][-1]
    assert (worlds[2][0]["epoch"], worlds[2][0]["batch"]) == (last_commit["epoch"], last_commit["batch"])
    assert not read(tmp_path, "restores.jsonl")
    assert "world 2 (added): 3 ranks on 127.0.0.1, localhost; 1 started" in job.stderr
    done = read(tmp_path, "done.jsonl")
    assert len(done) == 3 and len({d["params"] for d in done}) == 1
    assert time.monotonic() - added_at < 120
    print(f"host added to training on it: {min(s['time'] for s in worlds[2]) - added_wall:.2f} s")


def assert_removal_went_on_without_restoring(job, tmp_path, timeout, samples, new_size):
    """After the discovery script dropped a host from an `open_ended` job: world 2 starts (then the job is told
    to stop), the job ends well, every sample was seen once per epoch, world 1 became world 2 of `new_size`
    ranks, and nothing was restored. Returns the worlds."""
    finish_once_world_2_started(job, tmp_path, timeout, samples)
    worlds = assert_worlds_start_in_step(tmp_path)
    assert sorted(worlds) == [1, 2] and worlds[2][0]["size"] == new_size, job.report()
    assert not read(tmp_path, "restores.jsonl")
    return worlds


@pytest.mark.timeout(180)
def test_removed_host_interrupts_without_restoring(job_env, tmp_path):
    """(c) the discovery script drops a host: HostsUpdatedInterrupt at the next commit, no restore, its
    worker leaves with status 0, the other two go on from where they were."""
    job = ElasticJob(job_env, tmp_path, "localhost:2\n127.0.0.1:1\n", ["--min-np", "2"], ELASTIC_SAMPLES="48",
                     **open_ended(tmp_path))
    job.wait_for("progress.jsonl", progressed, 90)
    job.set_hosts("localhost:2\n")
    assert_removal_went_on_without_restoring(job, tmp_path, 150, 48, 2)
    assert "world 2 (removed): 2 ranks on localhost" in job.stderr
    assert "has no place in the new world 2 (its host was removed or blacklisted); exiting" in job.stderr
    done = read(tmp_path, "done.jsonl")
    assert len(done) == 2 and len({d["params"] for d in done}) == 1


@pytest.mark.timeout(120)
def test_removed_host_hands_over_the_sharded_optimizer_slices(job_env, tmp_path):
    """(c) with DistributedOptimizer(sharded=True): the discovery script drops the host of ranks 1 and 2 of 3
    (a slice and its buddy copy on one host); before they leave they hand their slices to rank 0, and the
    world of 1 starts, without restoring, from exactly the optimizer state of the interrupted commit."""
    job = ElasticJob(job_env, tmp_path, "localhost:1\n127.0.0.1:2\n", ["--min-np", "1"], ELASTIC_SAMPLES="36",
                     ELASTIC_SHARDED="1", **open_ended(tmp_path))
    job.wait_for("progress.jsonl", progressed, 90)
    job.set_hosts("localhost:1\n")
    worlds = assert_removal_went_on_without_restoring(job, tmp_path, 100, 36, 1)
    assert sorted((s["rank"], s["host"]) for s in worlds[1]) == [(0, "localhost"), (1, "127.0.0.1"), (2, "127.0.0.1")]
    assert "world 2 (removed): 1 ranks on localhost" in job.stderr, job.report()
    interrupted = [c for c in read(tmp_path, "precommits.jsonl") if c["round"] == 1][-1]
    assert worlds[2][0]["optimizer"] == interrupted["optimizer"] != 0.0, job.report()


@pytest.mark.timeout(120)
def test_below_min_np_past_the_elastic_timeout_fails_clearly(job_env, tmp_path):
    """(e) one of two single-slot hosts dies with --min-np 2: after --elastic-timeout, a clear error and a
    non-zero exit, nothing left running."""
    job = ElasticJob(job_env, tmp_path, "localhost:1\n127.0.0.1:1\n", ["--min-np", "2", "--elastic-timeout", "3"],
                     ELASTIC_KILL="1:1:3")
    returncode = job.finish(100)
    assert returncode == 1, job.report()
    assert ("rvodrun: elastic job failed: only 1 usable slots (localhost:1) for 3 s (--elastic-timeout), fewer "
            "than --min-np 2") in job.stderr, job.report()
    assert not read(tmp_path, "done.jsonl")


@pytest.mark.timeout(240)
def test_blacklisted_hosts_come_back_after_their_cooldown(job_env, tmp_path):
    """(d) three kills, each blacklisting its host for the cooldown (1 s, doubling): after each the job goes
    on with 2 ranks, then grows back to 3 when the host's cooldown ends. Prints the time from each death
    to training resuming (the first training start after it)."""
    job = ElasticJob(job_env, tmp_path, "".join(f"{host}:1\n" for host in HOSTS),
                     ["--min-np", "2", "--blacklist-cooldown-range", "1", "1"],
                     ELASTIC_KILL="1:1:3,3:1:3,5:1:3", ELASTIC_SAMPLES="48", ELASTIC_EPOCHS="12")
    assert job.finish(220) == 0, job.report()
    assert_every_sample_once_per_epoch(tmp_path, 12, 48)
    worlds = assert_worlds_start_in_step(tmp_path)
    sizes = [worlds[r][0]["size"] for r in sorted(worlds)]
    assert sizes[:6] == [3, 2, 3, 2, 3, 2], (sizes, job.report())
    assert job.stderr.count("is blacklisted for") == 3
    starts = sorted(s["time"] for s in read(tmp_path, "starts.jsonl"))
    recoveries = [min(t for t in starts if t > kill["time"]) - kill["time"] for kill in read(tmp_path, "kills.jsonl")]
    assert len(recoveries) == 3
    print(f"death to training resumed: {', '.join(f'{r * 1000:.0f} ms' for r in recoveries)}; "
          f"p50 {sorted(recoveries)[1] * 1000:.0f} ms")


@pytest.mark.timeout(240)
def test_a_worker_dying_while_the_job_re_forms_still_ends_in_a_running_job(job_env, tmp_path):
    """(f) rank 3 dies mid-epoch; while the other three re-form, the one on 127.0.0.1 dies after every worker
    of the new world was ready but before its engine started. The two left time out of that world's start
    (--start-timeout 5), join the next one and finish with every sample counted once."""
    job = ElasticJob(job_env, tmp_path, f"localhost:2\n127.0.0.1:1\n{HOSTS[2]}:1\n",
                     ["--min-np", "2", "--start-timeout", "5"], ELASTIC_KILL="1:3:5", ELASTIC_KILL_AT_INIT="2:2",
                     ELASTIC_SAMPLES="48")
    assert job.finish(220) == 0, job.report()
    assert_every_sample_once_per_epoch(tmp_path, 3, 48)
    worlds = assert_worlds_start_in_step(tmp_path)
    assert sorted(worlds) == [1, 3] and worlds[3][0]["size"] == 2, job.report()
    assert [(k["round"], k["rank"]) for k in read(tmp_path, "kills.jsonl")] == [(1, 3), (2, 2)]
    assert "world 3 (failure): 2 ranks on localhost" in job.stderr
    assert "world 2 failed to start" in job.stderr


@pytest.mark.timeout(300)
def test_keras_fit_goes_on_after_a_worker_dies(job_env, tmp_path):
    """Keras 3 (TensorFlow backend) model.fit under hvd.elastic.run: rank 1 is killed in epoch 1; the two
    left restore the last commit and finish the remaining epochs with identical weights."""
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{host}:1\n" for host in HOSTS))
    env = dict(job_env, ELASTIC_OUT=str(tmp_path), ELASTIC_KILL="1:1:1:2", KERAS_BACKEND="tensorflow",
               TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, *RVODRUN, "--min-np", "2", "--host-discovery-script", f"cat {hosts}",
               sys.executable, str(WORKER.with_name("elastic_keras.py"))]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    report = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    assert result.returncode == 0, report
    starts = read(tmp_path, "starts.jsonl")
    assert sorted((s["round"], s["rank"], s["size"]) for s in starts) == [
        (1, 0, 3), (1, 1, 3), (1, 2, 3), (2, 0, 2), (2, 1, 2)], report
    second = [s for s in starts if s["round"] == 2]
    assert {s["epoch"] for s in second} == {1} and len({s["params"] for s in second}) == 1
    done = read(tmp_path, "done.jsonl")
    assert len(done) == 2 and {d["epoch"] for d in done} == {3} and len({d["params"] for d in done}) == 1


@pytest.mark.timeout(200)
def test_keras_sharded_optimizer_state_comes_back_from_buddy_copies(job_env, tmp_path):
    """Keras with DistributedOptimizer(sharded=True) (Adam): rank 1 of 3 is killed in epoch 1; its slice of the
    moments comes back from its buddy copy, and the world of 2 starts from exactly the state consolidated at
    the last commit, then finishes with identical weights on both ranks."""
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{host}:1\n" for host in HOSTS))
    env = dict(job_env, ELASTIC_OUT=str(tmp_path), ELASTIC_KILL="1:1:1:2", ELASTIC_SHARDED="1",
               KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, *RVODRUN, "--min-np", "2", "--host-discovery-script", f"cat {hosts}",
               sys.executable, str(WORKER.with_name("elastic_keras.py"))]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    report = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    assert result.returncode == 0, report
    second = [s for s in read(tmp_path, "starts.jsonl") if s["round"] == 2]
    assert sorted(s["rank"] for s in second) == [0, 1] and {s["size"] for s in second} == {2}, report
    last = [c for c in read(tmp_path, "commits.jsonl") if c["round"] == 1][-1]
    assert (last["epoch"], last["batch"]) == (1, 1), report
    assert {s["optimizer"] for s in second} == {last["optimizer"]} and last["optimizer"] != 0.0, report
    done = read(tmp_path, "done.jsonl")
    assert len(done) == 2 and {d["epoch"] for d in done} == {3} and len({d["params"] for d in done}) == 1


@pytest.mark.timeout(120)
def test_reset_limit_ends_the_job_with_the_reason(job_env, tmp_path):
    """--reset-limit 0: the first death needs a reset the limit does not allow; rvodrun says so and exits 1."""
    job = ElasticJob(job_env, tmp_path, "".join(f"{host}:1\n" for host in HOSTS), ["--min-np", "2", "--reset-limit", "0"],
                     ELASTIC_KILL="1:1:3")
    assert job.finish(100) == 1, job.report()
    assert ("rvodrun: elastic job failed: the job needed a new world (failure) after 0 resets, and --reset-limit "
            "is 0") in job.stderr, job.report()
    assert not read(tmp_path, "done.jsonl")


def _worker_pid(tag: str, worker_id: int) -> int | None:
    """The pid of elastic worker `worker_id` of the job tagged `tag`."""
    for pid in tagged_pids(tag):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RVOD_ELASTIC_WORKER_ID={worker_id}".encode() in environ:
            return pid
    return None


def run_example_killing_a_worker(job_env: dict[str, str], tmp_path: Path, script: str, args: list[str],
                                 wait: float) -> tuple[str, str]:
    """examples/SCRIPT ARGS under rvodrun --min-np 2 on the three hosts, one slot each: once rank 0 printed
    "Iter #2:", kill -9 of worker 2 (rank 1, on 127.0.0.1) from outside. Returns (stdout, stderr) of a job that
    ended with status 0 within `wait` seconds of starting plus 90 after the kill."""
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{host}:1\n" for host in HOSTS))
    example = Path(__file__).resolve().parents[2] / "examples" / script
    stdout, stderr = (tmp_path / "stdout").open("w"), (tmp_path / "stderr").open("w")
    job = subprocess.Popen([sys.executable, *RVODRUN, "--min-np", "2", "--host-discovery-script", f"cat {hosts}",
                            sys.executable, str(example), *args], env=job_env, stdout=stdout, stderr=stderr)
    deadline = time.monotonic() + wait
    while "Iter #2:" not in (tmp_path / "stdout").read_text():
        assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-4000:]
        time.sleep(0.05)
    pid = _worker_pid(job_env[JOB_TAG_VARIABLE], 2)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert job.wait(timeout=max(90.0, deadline + 90 - time.monotonic())) == 0, \
        (tmp_path / "stderr").read_text()[-4000:]
    err = (tmp_path / "stderr").read_text()
    assert "worker 2 (rank 1 on 127.0.0.1) was killed by signal SIGKILL" in err, err[-4000:]
    return (tmp_path / "stdout").read_text(), err


@pytest.mark.timeout(240)
def test_elastic_synthetic_benchmark_example_survives_kill_9(job_env, tmp_path):
    """examples/torch_synthetic_benchmark_elastic.py (written as Horovod's elastic benchmark is) on 3 ranks:
    kill -9 of a worker from outside during the benchmark; the job ends on 2 ranks, every iteration recorded
    once."""
    out, _ = run_example_killing_a_worker(
        job_env, tmp_path, "torch_synthetic_benchmark_elastic.py",
        ["--width", "8", "--image-size", "16", "--batch-size", "8", "--num-warmup-batches", "2",
         "--num-batches-per-iter", "4", "--num-iters", "12"], wait=150)
    assert "[0]<stdout>:Training on 2 ranks" in out, out
    assert "[0]<stdout>:Iterations recorded: 12" in out and "Total img/sec on 2 rank(s)" in out, out


@pytest.mark.timeout(420)
def test_tensorflow2_elastic_synthetic_benchmark_example_survives_kill_9(job_env, tmp_path):
    """examples/tensorflow2_synthetic_benchmark_elastic.py (Horovod's TF2 elastic benchmark, import line
    changed) on 3 ranks with a small Keras application model: kill -9 of a worker from outside during the
    benchmark, mostly while the others are inside the tf.function step; the job ends on 2 ranks, every
    iteration recorded once."""
    pytest.importorskip("tensorflow", reason="the TensorFlow example needs TensorFlow")
    env = dict(job_env, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", OMP_NUM_THREADS="1",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2")
    out, _ = run_example_killing_a_worker(
        env, tmp_path, "tensorflow2_synthetic_benchmark_elastic.py",
        ["--no-cuda", "--model", "MobileNetV3Small", "--image-size", "32", "--num-classes", "10", "--batch-size", "4",
         "--num-warmup-batches", "2", "--num-batches-per-iter", "2", "--num-iters", "6"], wait=300)
    assert "[0]<stdout>:Model: MobileNetV3Small" in out and "[0]<stdout>:Number of CPUs: 3" in out, out
    assert out.count("[0]<stdout>:Training on 3 ranks") == 1 and "[0]<stdout>:Training on 2 ranks" in out, out
    assert "[0]<stdout>:Iterations recorded: 6" in out and "Total img/sec on 2 CPU(s)" in out, out


RUN_FUNC_SCRIPT = """
import os, signal, sys
import rvod

def train(steps):
    import torch
    import rvod.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0, total=0.0)

    @hvd.elastic.run
    def loop(state):
        while state.step < steps:
            if os.environ["RVOD_ELASTIC_ROUND"] == "1" and hvd.rank() == 1 and state.step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            state.total += float(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ones")[0])
            state.step += 1
            state.commit()

    loop(state)
    return hvd.rank(), hvd.size(), int(os.environ["RVOD_ELASTIC_ROUND"]), state.step, state.total

print(rvod.run(train, args=(10,), min_np=2, max_np=3, host_discovery_script=sys.argv[1]))
"""


@pytest.mark.timeout(240)
def test_rvod_run_elastic_returns_the_last_worlds_results_after_a_worker_is_killed(job_env, tmp_path):
    """rvod.run(fn, min_np=2, max_np=3, host_discovery_script=...): horovod.run's elastic mode through the
    same driver. Rank 1 kills itself (SIGKILL) at step 5 of 10 in the first world of 3; the two left restore
    the commit of step 5 and finish as a world of 2. The results are those of world 2's ranks, and the
    allreduced total counts 3 ranks for steps 0-4 and 2 for steps 5-9."""
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{host}:1\n" for host in HOSTS))
    result = subprocess.run([sys.executable, "-c", RUN_FUNC_SCRIPT, f"cat {hosts}"], env=job_env,
                            capture_output=True, text=True, errors="replace", timeout=220)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    assert result.returncode == 0, report
    assert result.stdout.splitlines()[-1] == "[(0, 2, 2, 10, 25.0), (1, 2, 2, 10, 25.0)]", report
    assert "worker 2 (rank 1 on 127.0.0.1) was killed by signal SIGKILL" in result.stderr, report


@pytest.mark.timeout(60)
def test_rvod_run_elastic_failing_below_min_np_raises_the_reason(job_env, tmp_path):
    """An elastic rvod.run whose hosts never reach min_np raises RuntimeError with the driver's reason."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    code = ("import sys, rvod\n"
            "try:\n"
            "    rvod.run(lambda: 0, min_np=2, host_discovery_script=sys.argv[1], reset_limit=1,"
            " cooldown_range=(1, 2))\n"
            "except RuntimeError as error:\n"
            "    print('raised:', error)\n")
    result = subprocess.run([sys.executable, "-c", code, f"cat {hosts}"], env=dict(job_env, RVOD_ELASTIC_TIMEOUT="2"),
                            capture_output=True, text=True, errors="replace", timeout=50)
    assert result.returncode == 0, result.stderr
    assert "raised: rvod.run: the job failed (only 1 usable slots (localhost:1) for" in result.stdout, result.stdout


HUNG_SECONDS = 3.0


def assert_hung_worker_replaced(job: ElasticJob, out: Path, worker: int, rank: int, host: str) -> float:
    """The job re-formed without the hung worker and finished with every sample counted once; rvodrun named
    it by rank and host within the hung time (+ slack), long before RVOD_TIMEOUT. Returns the time from the
    hang to training resumed in world 2."""
    assert job.finish(100) == 0, job.report()
    assert_every_sample_once_per_epoch(out, 3, 24)
    worlds = assert_worlds_start_in_step(out)
    assert sorted(worlds) == [1, 2] and worlds[2][0]["size"] == 2, job.report()
    assert host not in {s["host"] for s in worlds[2]}, job.report()
    found = [line for line in job.stderr.splitlines()
             if line.startswith(f"rvodrun: worker {worker} (rank {rank} on {host}) ")]
    assert found and found[0].endswith("; killing it"), job.report()
    assert f"worker {worker} (rank {rank} on {host}) was killed by signal SIGKILL; host {host} is blacklisted" \
        in job.stderr, job.report()
    (hang,) = read(out, "hangs.jsonl")
    resumed = min(s["time"] for s in worlds[2]) - hang["time"]
    # Found within the hung time plus a beat, a check and the coordinator's stall check (about 1.5 s), and
    # training resumed a few seconds later: far from RVOD_TIMEOUT (60 s), the only bound before this.
    assert resumed < HUNG_SECONDS + 12, (resumed, job.report())
    return resumed


@pytest.mark.timeout(120)
def test_rank_blocked_in_the_script_is_found_by_the_coordinator_and_replaced(job_env, tmp_path):
    """Rank 1 of 3 sleeps in its training step (alive, its sockets open) while the others wait in the next
    allreduce: after --elastic-hung-timeout the coordinator names it, rvodrun kills it and blacklists its host
    as for a crash, and the two left go on from the last commit with every sample counted once."""
    job = ElasticJob(job_env, tmp_path, "".join(f"{host}:1\n" for host in HOSTS),
                     ["--min-np", "2", "--elastic-hung-timeout", str(HUNG_SECONDS)], ELASTIC_HANG="1:1:5:sleep")
    resumed = assert_hung_worker_replaced(job, tmp_path, 2, 1, "127.0.0.1")
    found = next(line for line in job.stderr.splitlines() if line.startswith("rvodrun: worker 2 (rank 1 on"))
    seconds = float(found.split("made no progress for ")[1].split(" s")[0])
    assert HUNG_SECONDS <= seconds < HUNG_SECONDS + 3, found
    assert "which the other ranks wait on (found by rank 0)" in found, found
    assert "rank 1 on host 127.0.0.1 made no progress for" in job.stderr  # the coordinator's own log
    print(f"blocked rank: found after {seconds:.1f} s, training resumed {resumed:.1f} s after the hang")


@pytest.mark.timeout(120)
def test_stopped_rank_0_is_found_by_its_missing_heartbeat_and_replaced(job_env, tmp_path):
    """Rank 0 (the coordinator, which cannot report itself) is SIGSTOPped: its heartbeat stops, rvodrun kills it
    after RVOD_ELASTIC_HUNG_TIMEOUT and the two left re-form as a world of 2 from the last commit."""
    job = ElasticJob(job_env, tmp_path, "".join(f"{host}:1\n" for host in HOSTS), ["--min-np", "2"],
                     ELASTIC_HANG="1:0:5:stop", RVOD_ELASTIC_HUNG_TIMEOUT=str(HUNG_SECONDS))
    resumed = assert_hung_worker_replaced(job, tmp_path, 1, 0, "localhost")
    found = next(line for line in job.stderr.splitlines() if line.startswith("rvodrun: worker 1 (rank 0 on"))
    seconds = float(found.split("sent no heartbeat for ")[1].split(" s")[0])
    assert HUNG_SECONDS <= seconds < HUNG_SECONDS + 2, found
    print(f"stopped rank 0: found after {seconds:.1f} s without a heartbeat, training resumed {resumed:.1f} s "
          "after the stop")


NOT_ELASTIC_SCRIPT = """
import time
import torch
import rvod.torch as hvd

hvd.init()
if hvd.rank() == 1:
    time.sleep(4)  # far past RVOD_ELASTIC_HUNG_TIMEOUT: only an elastic job acts on it
total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="late")
print("total", float(total[0]))
"""


@pytest.mark.timeout(60)
def test_hung_timeout_does_not_act_outside_elastic_jobs(job_env, tmp_path):
    """A fixed-size job keeps today's behaviour: a rank late by more than RVOD_ELASTIC_HUNG_TIMEOUT is waited for
    (as before, until the stall warning or RVOD_TIMEOUT), nobody is named hung, and the result is right."""
    script = tmp_path / "late.py"
    script.write_text(NOT_ELASTIC_SCRIPT)
    env = dict(job_env, RVOD_ELASTIC_HUNG_TIMEOUT="1")
    result = subprocess.run([sys.executable, *RVODRUN, "-np", "2", sys.executable, str(script)], env=env,
                            capture_output=True, text=True, errors="replace", timeout=50)
    report = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, report
    assert result.stdout.count("total 2.0") == 2, report
    assert "made no progress" not in result.stderr and "heartbeat" not in result.stderr, report
