"""Multi-process tests of rvod.numpy's error behaviour: mismatches, duplicate names, ops before init,
re-init, bad arguments, stalls, a rank killed or frozen mid-allreduce (over shared memory and TCP; also inside a
process set, named by its global rank), dtypes the engine cannot take, strangers on the job's sockets, and
a job of size 1 without rvodrun. The worker side is workers/errors.py.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import (
    PURPOSE_MESH,
    PYTHON,
    WORKERS,
    HandshakeRefused,
    LocalJob,
    StoreConnection,
    assert_worker_job,
    failures,
    is_dropped,
    verdicts,
)

ERRORS = str(WORKERS / "errors.py")


def rank_lines(text: str, rank: int, stream: str) -> list[str]:
    return re.findall(rf"^\[{rank}\]<{stream}>:(.*)$", text, re.MULTILINE)


@pytest.mark.timeout(90)
def test_error_cases_in_one_job(run_rvodrun, job_env):
    """Mismatches, duplicate names, ops before init and after shutdown, refused arguments, a stalled
    allreduce, and init -> shutdown -> init, all in one 3-rank job; every case is checked on every rank."""
    job_env["RVOD_STALL_CHECK_TIME_SECONDS"] = "2"
    result = run_rvodrun(["-np", "3", PYTHON, ERRORS, "main"], timeout=60)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{failures(result.stderr)[-20000:]}"
    found = verdicts(result.stdout)
    assert set(found) == {0, 1, 2}, report
    assert all(failed == 0 for _, failed in found.values()), report
    assert result.returncode == 0, report

    # The stall warning: logged by rank 0 (the coordinator), naming the tensor and the missing rank 1 only.
    coordinator = "\n".join(rank_lines(result.stderr, 0, "stderr"))
    assert re.search(r"waiting for remainder of ranks for more than \d+ seconds", coordinator), result.stderr
    missing = re.findall(r"^(\d+)!?: \[(.*)\]$", coordinator, re.MULTILINE)
    assert missing and all(rank == "1" and "allreduce.stall" in names for rank, names in missing), coordinator


@pytest.mark.timeout(60)
def test_interrupt_and_peer_shutdown(run_rvodrun):
    """Ctrl-C during a wait raises KeyboardInterrupt and the engine keeps working; a peer's shutdown()
    fails a collective waiting for it with RvodInternalError instead of hanging."""
    result = run_rvodrun(["-np", "2", PYTHON, ERRORS, "lifecycle"], timeout=45)
    assert_worker_job(result, {0: 4, 1: 1})


def survivor_reports(job: LocalJob, results) -> dict[int, tuple[str, float, str]]:
    """rank -> (exception class, seconds to fail, message) printed by each surviving rank."""
    reports = {}
    for rank, res in results.items():
        match = re.search(r"^SURVIVOR (\w+) ([\d.]+) (.*)$", res.stdout, re.MULTILINE)
        assert match, f"rank {rank} reported no error:\n{job.report()}"
        reports[rank] = (match.group(1), float(match.group(2)), ast.literal_eval(match.group(3)))
        assert res.returncode == 0, f"rank {rank} did not get an RvodInternalError:\n{job.report()}"
        assert "shutdown done" in res.stdout, f"rank {rank}: shutdown after the failure:\n{job.report()}"
    return reports


def transport_settings(transport: str, shm_dir: Path) -> dict[str, str]:
    """Job settings that select `transport`; shared-memory segments go to `shm_dir` so the test can see them."""
    if transport == "tcp":
        return {"RVOD_SHM": "0"}
    return {"RVOD_SHM": "1", "RVOD_SHM_DIR": str(shm_dir)}


def assert_transport(job: LocalJob, results, transport: str) -> None:
    for rank, res in results.items():
        assert f"TRANSPORT {transport}" in res.stdout, f"rank {rank} did not run over {transport}:\n{job.report()}"


def kill_rank_two(job_env, tmp_path, shm_dir, transport: str, variant: list[str]) -> tuple[LocalJob, dict]:
    """Runs workers/errors.py's ``kill SIGKILL *variant`` as a 3-rank job over `transport` with RVOD_TIMEOUT=10;
    checks that rank 2 died of the SIGKILL; the job and the results of ranks 0 and 1."""
    command = [PYTHON, ERRORS, "kill", "SIGKILL", *variant]
    settings = {"RVOD_TIMEOUT": "10", **transport_settings(transport, shm_dir)}
    with LocalJob(job_env, 3, command, tmp_path, settings=settings) as job:
        job.start()
        victim = job.wait(40, ranks=[2])[2]
        assert victim.returncode == -9, job.report()
        return job, job.wait(30, ranks=[0, 1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport, op", [("shm", "single"), ("shm", "grouped"), ("tcp", "single")])
def test_killed_rank_fails_the_others_quickly(job_env, tmp_path, shm_dir, transport, op):
    """Rank 2 is SIGKILLed while a 128 MiB allreduce (or a 64 MiB grouped one, which shared memory runs
    through the staging areas) is in flight: ranks 0 and 1 raise RvodInternalError naming rank 2 well within
    RVOD_TIMEOUT, and can still shut down. Over shared memory, nothing of the job is left in the segment
    folder afterwards (nor while it ran: segments are unlinked once mapped)."""
    job, survivors = kill_rank_two(job_env, tmp_path, shm_dir, transport, ["grouped"] if op == "grouped" else [])
    assert_transport(job, survivors, transport)
    reports = survivor_reports(job, survivors)
    for rank, (kind, seconds, message) in reports.items():
        assert kind in ("RvodInternalError", "RvodTimeoutError"), (rank, kind, message)
        assert seconds < 5.0, f"rank {rank} took {seconds} s to notice (RVOD_TIMEOUT=10): {message}"
        assert re.search(r"\brank 2\b", message), message
        assert "allreduce.fatal" in message, message
    assert list(shm_dir.iterdir()) == [], "the job left shared memory behind"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_killed_rank_inside_a_process_set_is_named_by_its_global_rank(job_env, tmp_path, shm_dir, transport):
    """3 ranks, process set [1, 2]: rank 2 is SIGKILLed instead of joining an allreduce on the set. Rank 1 raises
    RvodInternalError naming rank 2 (its global rank; it is rank 1 of the set's communicator), never rank 1."""
    job, survivors = kill_rank_two(job_env, tmp_path, shm_dir, transport, ["in-set"])
    assert "SURVIVOR" not in survivors[0].stdout, f"rank 0 is no member of the set:\n{job.report()}"
    kind, _, message = survivor_reports(job, {1: survivors[1]})[1]
    assert kind == "RvodInternalError", (kind, message)
    assert re.search(r"\brank 2\b", message) and not re.search(r"\brank 1\b", message), message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_frozen_rank_times_out(job_env, tmp_path, shm_dir, transport):
    """Rank 2 stops (SIGSTOP) mid-allreduce with its connections open: the others raise RvodTimeoutError
    naming rank 2 after RVOD_TIMEOUT (3 s), not before and not much later."""
    command = [PYTHON, ERRORS, "kill", "SIGSTOP"]
    settings = {"RVOD_TIMEOUT": "3", **transport_settings(transport, shm_dir)}
    with LocalJob(job_env, 3, command, tmp_path, settings=settings) as job:
        job.start()
        survivors = job.wait(40, ranks=[0, 1])
        assert_transport(job, survivors, transport)
        reports = survivor_reports(job, survivors)
    for rank, (kind, seconds, message) in reports.items():
        assert kind == "RvodTimeoutError", (rank, kind, message)
        assert 2.5 <= seconds < 8.0, f"rank {rank} failed after {seconds} s with RVOD_TIMEOUT=3: {message}"
        assert re.search(r"\brank 2\b", message), message
    assert list(shm_dir.iterdir()) == [], "the job left shared memory behind"


@pytest.mark.timeout(60)
def test_rvodrun_names_the_killed_rank(run_rvodrun):
    result = run_rvodrun(["-np", "3", PYTHON, ERRORS, "kill", "SIGKILL"], timeout=45)
    assert result.returncode != 0, result
    assert re.search(r"^rvodrun: rank 2 \(pid \d+\) was killed by signal SIGKILL$", result.stderr, re.MULTILINE), \
        result.stderr


@pytest.mark.timeout(60)
def test_strangers_are_dropped_and_the_job_is_unaffected(job_env, tmp_path):
    """Connections to the store and to a rank's mesh listener that send garbage, stay silent, or prove
    the wrong secret are dropped; the job started alongside them completes with the right results."""
    # The ranks must talk through a TCP mesh listener, which this test probes.
    with LocalJob(job_env, 2, [PYTHON, ERRORS, "steps"], tmp_path, settings={"RVOD_SHM": "0"}) as job:
        opened = time.monotonic()
        silent = [socket.create_connection(("127.0.0.1", job.port))]
        garbage = socket.create_connection(("127.0.0.1", job.port))
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: rvod\r\n\r\n" + bytes(range(256)) * 4)
        assert is_dropped(garbage), "the store kept a connection that sent garbage"
        with pytest.raises(HandshakeRefused):
            StoreConnection(job.port, b"not the job secret")
        huge_claim = socket.create_connection(("127.0.0.1", job.port))
        huge_claim.sendall(b"RVOD\x00\x01\x01" + os.urandom(32) + b"\xff\xff")
        assert is_dropped(huge_claim), "the store kept a connection claiming a 64 KiB identity"

        # A legitimate client (positive control for the handshake above), which also lets the test reach
        # rank 0's mesh listener: it stands in for rank 1's host registration so that rank 0 publishes its
        # address before the real rank 1 exists (it announces rank 1's arrival too).
        store = StoreConnection(job.port, job.secret)
        assert store.get("no such key", wait_ms=10) is None
        store.set("init0/arrived/1", b"1")
        store.set("init0/host/1", b"2 localhost")
        job.start([0])
        # The global process set is the first registered communicator: scope init0/set1.
        address = store.get("init0/set1/addr/0", wait_ms=20_000)
        assert address, f"rank 0 did not publish its address:\n{job.report()}"
        mesh_port = int(address.decode().rsplit(":", 1)[1])
        silent.append(socket.create_connection(("127.0.0.1", mesh_port)))
        with pytest.raises(HandshakeRefused):
            StoreConnection(mesh_port, b"not the job secret", purpose=PURPOSE_MESH,
                            claim=(1).to_bytes(4, "big") + b"init0/set1")
        mesh_garbage = socket.create_connection(("127.0.0.1", mesh_port))
        mesh_garbage.sendall(os.urandom(512))
        assert is_dropped(mesh_garbage), "rank 0 kept a mesh connection that sent garbage"

        job.start([1])
        results = job.wait(45)
        for rank, res in results.items():
            assert res.returncode == 0, job.report()
            assert f"rank {rank} of 2: steps ok" in res.stdout, job.report()
        # A client that never says anything is dropped once the store's 5 s handshake limit passes.
        assert is_dropped(silent[0], timeout=max(0.1, opened + 8.0 - time.monotonic())), \
            "the store kept a silent connection open"
        for sock in silent:
            sock.close()
        store.close()


@pytest.mark.timeout(60)
def test_size_one_job_without_rvodrun(job_env, tmp_path):
    env = {k: v for k, v in job_env.items() if not k.startswith(("RVOD_", "HOROVOD_")) or k == "RVOD_TEST_JOB_TAG"}
    start = time.monotonic()
    result = subprocess.run([sys.executable, ERRORS, "single"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=45)
    report = f"exit {result.returncode} after {time.monotonic() - start:.1f} s\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, report
    assert re.search(r"^rank 0: \d+ checks passed, 0 failed$", result.stdout, re.MULTILINE), report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module, name", [("ml_dtypes", "bfloat16"), ("ml_dtypes", "float8_e4m3fn"), ("numpy", "uint32")])
def test_arrays_of_dtypes_the_engine_cannot_take_raise_type_error_naming_the_dtype(job_env, tmp_path, module, name):
    """An array whose dtype the engine cannot take (ml_dtypes' bfloat16, which NumPy cannot export by DLPack,
    among them) raises TypeError naming the dtype and the supported ones, from every op, before anything is
    sent (a job of size 1)."""
    pytest.importorskip(module, reason=f"{module} is not installed (it comes with TensorFlow)")
    env = {k: v for k, v in job_env.items() if not k.startswith(("RVOD_", "HOROVOD_")) or k == "RVOD_TEST_JOB_TAG"}
    result = subprocess.run([sys.executable, ERRORS, "dtype", module, name], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=45)
    report = f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    refused = re.findall(r"^REFUSED (\w+) (\w+) ?(.*)$", result.stdout, re.MULTILINE)
    assert len(refused) == 7 and result.returncode == 0, report
    for op, kind, message in refused:
        assert kind == "TypeError", (op, kind, message)
        message = ast.literal_eval(message)
        assert f"dtype {name};" in message and "supported: " in message and "float32" in message, (op, message)
