"""The UCX transport between hosts on one machine: ranks given rvodrun's environment for a -H host list
whose names are only names (tests/python/jobs.py's FakeHostsJob), so each "host"'s ranks share memory and
the hosts talk over UCX (RVOD_TRANSPORT=ucx, UCX_TLS=tcp,self). Checks --check-build's UCX section,
which transport each communicator runs on, a remote rank that is killed or frozen (the others raise
naming it and its host, over TCP too), a failure inside UCX (an RvodInternalError naming the rank, its host
and UCX's message), a stranger
poking at UCX's own listening sockets (ignored), a libucp that cannot be loaded (a clear error when
forced, TCP under auto, said only at INFO), and a bad RVOD_TRANSPORT. The same ops over real network
namespaces are in test_multihost.py, every op x dtype with hierarchical algorithms on and off in
test_hierarchical.py, Adasum in test_adasum_hosts.py, elastic re-forming in test_elastic_hosts.py.
Skipped, with the reason, where libucp cannot be loaded.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jobs import WORKERS, FakeHostsJob

import ucx_env

_REASON = ucx_env.skip_reason()
PYTHON = sys.executable
ERRORS = str(WORKERS / "errors.py")

TRANSPORT_JOB = textwrap.dedent("""
    import numpy as np
    import rvod.numpy as hvd
    from rvod import _rvod
    hvd.init()
    total = hvd.allreduce(np.arange(1 << 20, dtype=np.float64) * (hvd.rank() + 1), op=hvd.Sum)
    assert total[7] == 7 * sum(range(1, hvd.size() + 1)), total[:8]
    print("TRANSPORT", _rvod.transport_kind(), flush=True)
    hvd.shutdown()
""")


def run_fake_hosts(job_env, tmp_path, hosts: str, size: int, command: list[str], settings: dict[str, str],
                   timeout: float = 60):
    tmp_path.mkdir(exist_ok=True)
    with FakeHostsJob(hosts, job_env, size, command, tmp_path, settings=settings) as job:
        job.start()
        return job, job.wait(timeout)


def test_check_build_reports_ucx():
    result = subprocess.run([PYTHON, "-m", "rvod.runner", "--check-build"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    section = lines[lines.index("UCX (loaded at run time; between hosts):") + 1:]
    if _REASON is None:
        from rvod._rvod import ucx_library

        found = ucx_library()
        assert "    [X] UCX" in lines
        assert section[0] == f"    libucp: UCX {found['version']} from {found['path']}"
        assert section[1].startswith("    Transports and devices: ") and "tcp/" in section[1], section
        assert section[2] == f"    RDMA: {', '.join(found['rdma']) or 'none'}"
        assert section[3] == "    Transport between hosts (RVOD_TRANSPORT): auto"
    else:
        assert "    [ ] UCX" in lines and section[0].startswith("    libucp: UCX (libucp) not found"), section


def test_a_missing_libucp_is_reported_where_it_is_read():
    env = {"RVOD_UCX_LIBRARY": "/nonexistent/libucp.so.0", "RVOD_TRANSPORT": "ucx", "PATH": "/usr/bin:/bin"}
    code = "from rvod._rvod import ucx_library; info = ucx_library(); print(info['transport'], info['error'])"
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**env, "PYTHONPATH": ":".join(sys.path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ucx UCX (libucp) not found; looked for /nonexistent/libucp.so.0 "
                                    "(from RVOD_UCX_LIBRARY): "), result.stdout


@pytest.mark.timeout(60)
def test_a_bad_transport_setting_is_an_error_naming_it(job_env, tmp_path):
    job, results = run_fake_hosts(job_env, tmp_path, "hosta:1,hostb:1", 2, [PYTHON, "-c", TRANSPORT_JOB],
                                  {"RVOD_TRANSPORT": "rdma"})
    for res in results.values():
        assert res.returncode != 0, job.report()
        assert "invalid environment variable RVOD_TRANSPORT=\"rdma\": expected auto, tcp or ucx" in res.stderr, \
            job.report()


@pytest.mark.timeout(60)
def test_forcing_ucx_without_libucp_fails_clearly_and_auto_falls_back_to_tcp(job_env, tmp_path):
    missing = {"RVOD_UCX_LIBRARY": "/nonexistent/libucp.so.0"}
    job, results = run_fake_hosts(job_env, tmp_path / "forced", "hosta:1,hostb:1", 2,
                                  [PYTHON, "-c", TRANSPORT_JOB], {**missing, "RVOD_TRANSPORT": "ucx"})
    for rank, res in results.items():
        assert res.returncode != 0, job.report()
        assert (f"rank {rank}: RVOD_TRANSPORT=ucx, but UCX (libucp) not found; looked for "
                "/nonexistent/libucp.so.0 (from RVOD_UCX_LIBRARY)") in res.stderr, job.report()
    job, results = run_fake_hosts(job_env, tmp_path / "auto", "hosta:2,hostb:1", 3,
                                  [PYTHON, "-c", TRANSPORT_JOB], {**missing, "RVOD_LOG_LEVEL": "info"})
    assert all(res.returncode == 0 for res in results.values()), job.report()
    assert [res.stdout.strip() for res in results.values()] == ["TRANSPORT shm+tcp"] * 3, job.report()
    # Said at INFO (which rvodrun --verbose shows), and nothing at WARN or ERROR.
    assert re.search(r" INFO rank 0: between hosts through TCP \(RVOD_TRANSPORT=auto\): ", results[0].stderr), \
        job.report()
    assert not any(re.search(r"\b(WARN|ERROR)\b", res.stderr) for res in results.values()), job.report()


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("hosts, size, expected", [
    ("hosta:2,hostb:2", 4, ["shm+ucx"] * 4),
    ("hosta:1,hostb:3", 4, ["shm+ucx"] * 4),
    ("hosta:1,hostb:1,hostc:1", 3, ["ucx"] * 3),
])
def test_links_between_hosts_run_over_ucx(job_env, tmp_path, hosts, size, expected):
    job, results = run_fake_hosts(job_env, tmp_path, hosts, size, [PYTHON, "-c", TRANSPORT_JOB],
                                  {**ucx_env.SETTINGS, "RVOD_LOG_LEVEL": "info"})
    assert all(res.returncode == 0 for res in results.values()), job.report()
    assert [res.stdout.strip() for res in results.values()] == [f"TRANSPORT {kind}" for kind in expected], \
        job.report()
    assert re.search(r"rank 0: between hosts through UCX \S+ from \S+ \(RVOD_TRANSPORT=ucx\)", results[0].stderr), \
        job.report()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    _REASON is not None, reason=_REASON or ""))])
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_a_remote_rank_killed_or_frozen_is_named_by_the_others(job_env, tmp_path, signal_name, transport):
    """Rank 2, alone on host b, is SIGKILLed (or SIGSTOPped) while a 128 MiB allreduce is in flight: ranks 0
    and 1 on host a raise naming rank 2 and its host, quickly for a kill, after RVOD_TIMEOUT (4 s) for a freeze;
    over UCX, and over TCP for comparison."""
    between_hosts = ucx_env.SETTINGS if transport == "ucx" else {"RVOD_TRANSPORT": "tcp"}
    settings = {**between_hosts, "RVOD_TIMEOUT": "4"}
    with FakeHostsJob("hosta:2,hostb:1", job_env, 3, [PYTHON, ERRORS, "kill", signal_name], tmp_path,
                      settings=settings) as job:
        job.start()
        survivors = job.wait(60, ranks=[0, 1])
        report = job.report()
    for rank, res in survivors.items():
        assert f"TRANSPORT shm+{transport}" in res.stdout, report
        found = re.search(r"^SURVIVOR (\w+) ([\d.]+) (.*)$", res.stdout, re.MULTILINE)
        assert found, report
        kind, seconds, message = found.group(1), float(found.group(2)), found.group(3)
        assert re.search(r"\brank 2 on host hostb\b", message), report
        if signal_name == "SIGKILL":
            assert kind in ("RvodInternalError", "RvodTimeoutError") and seconds < 3.0, report
        else:
            assert kind == "RvodTimeoutError" and 3.5 <= seconds < 10.0, report


ERROR_JOB = textwrap.dedent("""
    import numpy as np
    import rvod.numpy as hvd
    try:
        hvd.init()
        hvd.allreduce(np.ones(4), op=hvd.Sum)
    except Exception as error:
        print("ERROR", type(error).__name__, error, flush=True)
""")


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(60)
def test_a_failure_inside_ucx_is_an_internal_error_naming_the_rank_and_ucxs_message(job_env, tmp_path):
    """Host b's UCX may use shared memory only (UCX_TLS=sm,self), which cannot reach host a: UCX refuses to
    connect the endpoints, and each rank's init() raises RvodInternalError naming the other rank, its host and
    UCX's own words, within seconds."""
    with FakeHostsJob("hosta:1,hostb:1", job_env, 2, [PYTHON, "-c", ERROR_JOB], tmp_path,
                      settings={**ucx_env.SETTINGS, "RVOD_TIMEOUT": "5"}) as job:
        started = time.monotonic()
        job.start([0])
        job.start([1], env={"UCX_TLS": "sm,self"})
        results = job.wait(40)
        report = job.report()
    assert time.monotonic() - started < 20, report
    for rank, res in results.items():
        assert res.returncode == 0, report
        # UCX logs its own view of the failure on stderr (rvod sets UCX_LOG_FILE=stderr where unset): the
        # script's stdout has the error line only.
        assert len(res.stdout.splitlines()) == 1, report
        assert re.search(r"UCX +(ERROR|WARN)", res.stderr), report
        assert re.fullmatch(rf"ERROR RvodInternalError connecting to the other ranks over UCX failed: connection "
                            rf"set-up with rank {1 - rank} on host host{'ba'[rank]} failed: UCX (ucp_ep_create failed|could not reach it): "
                            r"[A-Z][\w ,.-]+", res.stdout.splitlines()[-1]), report


STRANGER_JOB = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import rvod.numpy as hvd
    hvd.init()
    hvd.allreduce(np.ones(4), op=hvd.Sum)
    print("READY", os.getpid(), flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    for step in range(5):
        total = hvd.allreduce(np.arange(1 << 18, dtype=np.float64) * (hvd.rank() + step), op=hvd.Sum)
        assert total[7] == 7 * (2 * step + 1), (step, total[:8])
    print("DONE", flush=True)
""")


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """The TCP addresses process `pid` listens on (from /proc: its socket inodes in the LISTEN state)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                address, port = fields[1].rsplit(":", 1)
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(60)
def test_a_stranger_at_ucxs_own_listening_sockets_changes_nothing(job_env, tmp_path):
    """UCX's TCP transport listens on sockets of its own, which rvod's handshake does not guard. A stranger
    who connects to every one of them, on both ranks, and sends nothing, zeros, random bytes or an HTTP
    request gets nothing, and the job's collectives after that are all correct."""
    go = tmp_path / "go"
    with FakeHostsJob("hosta:1,hostb:1", job_env, 2, [PYTHON, "-c", STRANGER_JOB, str(go)], tmp_path,
                      settings={**ucx_env.SETTINGS, "RVOD_TIMEOUT": "10"}) as job:
        job.start()
        deadline = time.monotonic() + 30
        while not all("READY" in job.output(rank)[0] for rank in (0, 1)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in job.processes.values()), \
                job.report()
            time.sleep(0.05)
        poked = []
        for rank in (0, 1):
            pid = int(job.output(rank)[0].split()[1])
            for address in listening_sockets(pid):
                for payload in (b"", bytes(64), os.urandom(4096), b"GET / HTTP/1.0\r\n\r\n"):
                    with socket.create_connection(address, timeout=5) as stranger:
                        stranger.sendall(payload)
                        stranger.settimeout(0.2)
                        try:
                            answer = stranger.recv(4096)
                        except (TimeoutError, ConnectionResetError):
                            answer = b""
                    assert answer == b"", (address, payload[:16], answer)
                    poked.append(address)
        assert poked, "found no listening socket to poke at"
        go.write_text("")
        results = job.wait(40)
        report = job.report()
    for res in results.values():
        assert res.returncode == 0 and res.stdout.split()[-1] == "DONE", report
