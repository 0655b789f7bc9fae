"""Engine behaviour a Horovod script relies on (issue 13): join, scale factors on every dtype, names reused by
different ops, uint16, the exception tree, what the others hear when a rank exits without shutdown(), init()
that cannot meet the other ranks, re-init after a failed init(), no shared memory left behind by a start-up
that is killed or stopped, and fork safety. The worker side is workers/conformance_engine.py (and
workers/fork_safety.py).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import JOB_TAG_VARIABLE, kill_tagged, tagged_pids
from jobs import PYTHON, WORKERS, HoldingRelay, LocalJob, StoreConnection, assert_worker_job

WORKER = str(WORKERS / "conformance_engine.py")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode, checks", [("join", {0: 19, 1: 7}), ("names", {0: 11, 1: 11}), ("uint16", None)])
def test_two_rank_modes(run_rvodrun, mode, checks):
    """join: other collectives fail at once while a rank has joined, with Horovod's messages, and the ranks
    stay in step; names: different ops under one name -> RvodMismatchError on both ranks, a duplicate
    reducescatter name -> ValueError; uint16 through NumPy, PyTorch and TensorFlow."""
    result = run_rvodrun(["-np", "2", PYTHON, WORKER, mode], timeout=75)
    if checks is None:
        import torch

        per_rank = 5 if hasattr(torch, "uint16") else 4
        checks = {0: per_rank, 1: per_rank}
    assert_worker_job(result, checks)


@pytest.mark.timeout(240)
def test_scale_factors_match_horovods_formula_for_every_dtype(run_rvodrun):
    """prescale/postscale for allreduce, grouped allreduce, reducescatter and grouped reducescatter, Sum and
    Average, every NumPy dtype and every PyTorch dtype, compared element by element with Horovod's formula."""
    result = run_rvodrun(["-np", "2", PYTHON, WORKER, "scale"], timeout=200)
    count = 9 * 4 * 2 * 4 + 8 * 4 * 2 * 4
    assert_worker_job(result, {0: count, 1: count})


@pytest.mark.timeout(60)
def test_a_rank_that_exits_without_shutdown_is_reported_as_exited(job_env, tmp_path):
    with LocalJob(job_env, 2, [PYTHON, WORKER, "exit"], tmp_path, settings={"RVOD_TIMEOUT": "20"}) as job:
        job.start()
        results = job.wait(45)
    assert results[1].returncode != 0 and "rank 1's script failed" in results[1].stderr, job.report()
    assert results[0].returncode == 0, job.report()
    line = re.search(r"^ERROR (\w+): (.*)$", results[0].stdout, re.MULTILINE)
    assert line, job.report()
    assert line.group(1) == "RvodInternalError", line.group(0)
    assert "rank 1 exited without calling shutdown()" in line.group(2), line.group(0)
    assert "called shutdown()" not in line.group(2).replace("without calling shutdown()", ""), line.group(0)


@pytest.mark.timeout(60)
def test_a_rank_that_dies_is_reported_as_exited(job_env, tmp_path):
    """os._exit (or a crash) runs no exit handler: the others still say the rank exited."""
    code = ("import os, time, numpy as np, rvod.numpy as hvd\n"
            "hvd.init()\n"
            "if hvd.rank() == 1:\n    time.sleep(0.5); os._exit(3)\n"
            "try:\n    hvd.allreduce(np.ones(2), name='never')\n"
            "except Exception as error:\n    print('ERROR', type(error).__name__, error, flush=True)\n")
    with LocalJob(job_env, 2, [PYTHON, "-c", code], tmp_path, settings={"RVOD_TIMEOUT": "20"}) as job:
        job.start()
        results = job.wait(45)
    assert results[1].returncode == 3, job.report()
    assert re.search(r"^ERROR RvodInternalError .*rank 1 exited", results[0].stdout, re.MULTILINE), job.report()


@pytest.mark.timeout(60)
def test_init_that_cannot_meet_the_others_times_out_naming_them_and_can_be_retried(job_env, tmp_path):
    settings = {"RVOD_START_TIMEOUT": "2"}
    with LocalJob(job_env, 2, [PYTHON, WORKER, "late"], tmp_path, settings=settings) as job:
        job.start(ranks=[0])
        deadline = time.monotonic() + 20
        while "READY" not in job.output(0)[0]:
            assert time.monotonic() < deadline and job.processes[0].poll() is None, job.report()
            time.sleep(0.1)
        first = re.search(r"^FIRST INIT (.*)$", job.output(0)[0], re.MULTILINE).group(1)
        seconds, message = first.split(" ", 1)
        assert 1.9 <= float(seconds) < 5, first
        assert "rank 1 of 2 has not called init()" in message and "ranks that came: 0" in message, first
        assert "RVOD_START_TIMEOUT" in message, first
        job.start(ranks=[1])
        results = job.wait(30)
    for rank, result in results.items():
        assert result.returncode == 0 and "RESULT [3.0, 3.0]" in result.stdout, job.report()


def run_python(code: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(60)
def test_exception_tree(job_env):
    """RvodMismatchError is a ValueError (and RuntimeError), not an RvodInternalError; an init() the machine
    fails (a host name that does not resolve) is not a ValueError; a bad setting is."""
    from rvod.exceptions import RvodError, RvodInternalError, RvodMismatchError, RvodTimeoutError

    assert issubclass(RvodMismatchError, (RvodError, ValueError)) and issubclass(RvodMismatchError, RuntimeError)
    assert not issubclass(RvodMismatchError, RvodInternalError)
    assert issubclass(RvodTimeoutError, RvodInternalError)

    base = {k: v for k, v in job_env.items() if not k.startswith(("RVOD_", "HOROVOD_"))}
    job = {"RVOD_RANK": "0", "RVOD_SIZE": "2", "RVOD_LOCAL_RANK": "0", "RVOD_LOCAL_SIZE": "2", "RVOD_CROSS_RANK": "0",
           "RVOD_CROSS_SIZE": "1", "RVOD_SECRET": "00" * 16, "RVOD_RENDEZVOUS_PORT": "4000",
           "RVOD_START_TIMEOUT": "3"}
    code = """
import rvod.numpy as hvd
try:
    hvd.init()
except Exception as error:
    print(type(error).__name__, isinstance(error, ValueError), isinstance(error, RuntimeError), error)
"""
    unresolvable = run_python(code, {**base, **job, "RVOD_RENDEZVOUS_ADDR": "no-such-host.invalid"})
    assert unresolvable.stdout.startswith("RvodInternalError False True "), unresolvable
    assert "cannot resolve" in unresolvable.stdout, unresolvable
    bad_setting = run_python(code, {**base, **job, "RVOD_RENDEZVOUS_ADDR": "127.0.0.1", "RVOD_TIMEOUT": "soon"})
    assert bad_setting.stdout.startswith("ValueError True False "), bad_setting
    assert "RVOD_TIMEOUT" in bad_setting.stdout, bad_setting


@pytest.mark.timeout(120)
def test_forked_dataloader_workers_leave_the_job_alone(run_rvodrun):
    """A 2-rank training loop whose DataLoader forks 2 workers every epoch: training results are identical
    on both ranks and as expected, the workers' own rvod calls raise a clear error, and the job shuts down
    cleanly."""
    result = run_rvodrun(["-np", "2", PYTHON, str(WORKERS / "fork_safety.py")], timeout=100)
    assert_worker_job(result, {0: 5, 1: 5})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ending", ["set-up times out", "SIGTERM"])
def test_shm_segment_is_unlinked_when_a_rank_never_maps_it(job_env, tmp_path, shm_dir, ending):
    """Rank 0 creates the job's shared-memory segment, but rank 1 (played by the test through the store)
    never maps it: whether rank 0's set-up then times out (its init() fails) or rank 0 is stopped with
    SIGTERM meanwhile (as rvodrun stops a job during start-up), nothing is left in the segment folder."""
    settings = {"RVOD_SHM": "1", "RVOD_SHM_DIR": str(shm_dir), "RVOD_TIMEOUT": "3" if ending != "SIGTERM" else "30"}
    with LocalJob(job_env, 2, [PYTHON, WORKER, "init_only"], tmp_path, settings=settings) as job:
        store = StoreConnection(job.port, job.secret)
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        store.set("init0/arrived/1", b"1")
        store.set("init0/host/1", b"2 localhost")
        store.set("init0/set1/host/1", f"localhost/{boot_id}".encode())
        job.start([0])
        deadline = time.monotonic() + 30
        while not any(shm_dir.iterdir()):
            assert time.monotonic() < deadline and job.processes[0].poll() is None, job.report()
            time.sleep(0.05)
        if ending == "SIGTERM":
            job.processes[0].send_signal(signal.SIGTERM)
            result = job.wait(20)[0]
            assert result.returncode == -signal.SIGTERM, job.report()
        else:
            result = job.wait(30)[0]
            assert "INIT FAILED RvodInternalError" in result.stdout, job.report()
        store.close()
        assert not list(shm_dir.iterdir()), f"left behind: {list(shm_dir.iterdir())}\n{job.report()}"


@pytest.mark.timeout(60)
def test_rank_0_killed_between_creating_and_announcing_the_segment_leaves_nothing(job_env, tmp_path, shm_dir):
    """3 real ranks; rank 0 reaches the store through a relay that holds back its announcement of the
    shared-memory segment, so it is SIGKILLed with the segment created and its name known to nobody but
    itself: ranks 1 and 2 fail their init() at once with RvodInternalError naming rank 0 (not after
    RVOD_TIMEOUT=20), and the segment folder is empty."""
    settings = {"RVOD_SHM": "1", "RVOD_SHM_DIR": str(shm_dir), "RVOD_TIMEOUT": "20"}
    with LocalJob(job_env, 3, [PYTHON, WORKER, "init_only"], tmp_path, settings=settings) as job, \
            HoldingRelay(job.port, b"init0/set1/shm/segment") as relay:
        job.start([0], env={"RVOD_RENDEZVOUS_PORT": str(relay.port)})
        job.start([1, 2])
        assert relay.held.wait(30), f"rank 0 never announced its segment\n{job.report()}"
        assert len(list(shm_dir.iterdir())) == 1, f"rank 0 announces a segment it created\n{job.report()}"
        job.processes[0].kill()
        killed = time.monotonic()
        results = job.wait(20, ranks=[1, 2])
        failed_after = time.monotonic() - killed
        assert job.processes[0].wait() == -signal.SIGKILL
    for rank, result in results.items():
        line = re.search(r"^INIT FAILED (\w+): (.*)$", result.stdout, re.MULTILINE)
        assert line and line.group(1) == "RvodInternalError", job.report()
        assert "setting up shared memory with the other ranks failed: rank 0 exited" in line.group(2), line.group(0)
        assert result.returncode == 0, job.report()
    assert failed_after < 5.0, f"the survivors took {failed_after:.1f} s to fail\n{job.report()}"
    assert not list(shm_dir.iterdir()), f"left behind: {list(shm_dir.iterdir())}\n{job.report()}"


@pytest.mark.timeout(60)
def test_sigterm_to_rvodrun_during_start_up_leaves_no_segment_and_no_rank(job_env, shm_dir):
    """rvodrun -np 3, where rank 2 comes to the meeting but never maps the segment: once ranks 0 and 1 both
    map it (they wait for rank 2 in init()), rvodrun gets SIGTERM. It stops the job and exits 143, the
    segment folder is empty and no process of the job is left."""
    job_env.update({"RVOD_SHM": "1", "RVOD_SHM_DIR": str(shm_dir), "RVOD_TIMEOUT": "30"})
    tag = job_env[JOB_TAG_VARIABLE]
    rvodrun = subprocess.Popen([sys.executable, "-m", "rvod.runner", "-np", "3", PYTHON, WORKER, "never_maps"],
                               env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(processes_mapping(shm_dir, tag)) < 2:
            assert time.monotonic() < deadline and rvodrun.poll() is None, "ranks 0 and 1 never mapped the segment"
            time.sleep(0.05)
        rvodrun.send_signal(signal.SIGTERM)
        stdout, stderr = rvodrun.communicate(timeout=20)
    finally:
        kill_tagged(tag)
    report = f"exit {rvodrun.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    assert rvodrun.returncode == 128 + signal.SIGTERM, report
    assert "rvodrun: received SIGTERM, stopping 3 ranks" in stderr, report
    assert not list(shm_dir.iterdir()), f"left behind: {list(shm_dir.iterdir())}\n{report}"
    assert tagged_pids(tag) == [], report


def processes_mapping(folder: Path, tag: str) -> list[int]:
    """The job's processes (by `tag`) that map a file of `folder`."""
    mapping = []
    for pid in tagged_pids(tag):
        try:
            if str(folder) + "/" in Path(f"/proc/{pid}/maps").read_text():
                mapping.append(pid)
        except OSError:
            pass
    return mapping


@pytest.mark.timeout(120)
def test_init_can_be_retried_after_a_failure_that_did_not_time_out(run_rvodrun):
    """3 ranks: a bad setting on every rank, a bad setting on rank 1 only (the others wait in init()),
    process sets that differ across ranks, a set naming a rank outside the job: init() raises ValueError
    at once each time, and the next init() succeeds with correct allreduce, allgather and broadcast_object
    values, on the global set and on the process set it registers."""
    result = run_rvodrun(["-np", "3", "--start-timeout", "20", PYTHON, WORKER, "reinit"], timeout=100)
    assert_worker_job(result, {0: 8, 1: 10, 2: 8})


@pytest.mark.timeout(90)
def test_warnings_about_dropped_strangers_are_rate_limited(job_env, tmp_path, capfd):
    """60 strangers sending garbage to the store and 60 to rank 0's mesh listener: each listener logs a few
    lines, then says further drops are only counted; the store (in the launcher's process, here the test's)
    logs its drops too; the job is unaffected."""
    from jobs import PURPOSE_MESH, is_dropped  # noqa: F401

    errors_worker = str(WORKERS / "errors.py")
    with LocalJob(job_env, 2, [PYTHON, errors_worker, "steps"], tmp_path, settings={"RVOD_SHM": "0"}) as job:
        for _ in range(60):
            garbage = socket.create_connection(("127.0.0.1", job.port))
            garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + os.urandom(64))
            assert is_dropped(garbage), "the store kept a connection that sent garbage"
            garbage.close()
        store = StoreConnection(job.port, job.secret)
        store.set("init0/arrived/1", b"1")
        store.set("init0/host/1", b"2 localhost")
        job.start([0])
        address = store.get("init0/set1/addr/0", wait_ms=20_000)
        assert address, job.report()
        mesh_port = int(address.decode().rsplit(":", 1)[1])
        for _ in range(60):
            garbage = socket.create_connection(("127.0.0.1", mesh_port))
            garbage.sendall(os.urandom(512))
            assert is_dropped(garbage), "rank 0 kept a mesh connection that sent garbage"
            garbage.close()
        job.start([1])
        results = job.wait(45)
        store.close()
    for rank, res in results.items():
        assert res.returncode == 0 and f"rank {rank} of 2: steps ok" in res.stdout, job.report()
    store_lines = [line for line in capfd.readouterr().err.splitlines() if "rendezvous server: dropped" in line]
    # The store's log window is per process (this one), which earlier tests' strangers may have started.
    assert 1 <= len(store_lines) <= 5 and "counted, not logged" in store_lines[-1], store_lines
    mesh_lines = [line for line in results[0].stderr.splitlines() if "mesh: dropped" in line]
    assert len(mesh_lines) == 5 and "counted, not logged" in mesh_lines[-1], mesh_lines


@pytest.mark.timeout(90)
def test_stall_warning_and_shutdown_times_are_honoured_within_a_second(run_rvodrun, job_env):
    """RVOD_STALL_CHECK_TIME_SECONDS=2, RVOD_STALL_SHUTDOWN_TIME_SECONDS=4: for a fresh tensor and for one
    in the response cache, the warning comes 2-3 s after the submission and the op fails 4-5 s after it."""
    from datetime import datetime

    job_env.update({"RVOD_STALL_CHECK_TIME_SECONDS": "2", "RVOD_STALL_SHUTDOWN_TIME_SECONDS": "4"})
    result = run_rvodrun(["-np", "2", PYTHON, WORKER, "stall"], timeout=75)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, report
    warnings = [datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() for stamp in
                re.findall(r"^\[0\]<stderr>:(\S+Z)\s+WARN .*waiting for remainder of ranks", result.stderr, re.MULTILINE)]
    for label in ("fresh", "cached"):
        line = re.search(rf"^\[0\]<stdout>:STALL {label} ([\d.]+) ([\d.]+) (.*)$", result.stdout, re.MULTILINE)
        assert line, report
        start, failed, message = float(line.group(1)), float(line.group(2)), line.group(3)
        assert "stall." + label in message and "ranks [1] did not submit it within 4 s" in message, message
        assert 3.9 <= failed - start < 5.0, f"{label}: failed after {failed - start:.1f} s\n{report}"
        first = min((w for w in warnings if w >= start - 0.1), default=None)
        assert first is not None and 1.9 <= first - start < 3.0, f"{label}: warned after {first and first - start}\n{report}"
