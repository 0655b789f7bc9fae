"""The UCX transport between hosts on one machine: ranks given rvodrun's environment for a -H host list
whose names are only names (tests/python/jobs.py's FakeHostsJob), so each "host"'s ranks share memory and
the hosts talk over UCX (RVOD_TRANSPORT=ucx, UCX_TLS=tcp,self,sm). Checks --check-build's UCX section,
which transport each communicator runs on, a remote rank that is killed or frozen (the others raise
naming it), a libucp that cannot be loaded (a clear error when forced, TCP under auto), and a bad
RVOD_TRANSPORT. The same ops over real network namespaces are in test_multihost.py, every op x dtype
with hierarchical algorithms on and off in test_hierarchical.py. Skipped, with the reason, where libucp
cannot be loaded.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

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
    assert "between hosts through TCP (RVOD_TRANSPORT=auto): " in results[0].stderr, job.report()


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


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_a_remote_rank_killed_or_frozen_is_named_by_the_others(job_env, tmp_path, signal_name):
    """Rank 2, alone on host b, is SIGKILLed (or SIGSTOPped) while a 128 MiB allreduce is in flight: ranks 0
    and 1 on host a raise naming rank 2, quickly for a kill, after RVOD_TIMEOUT (4 s) for a freeze."""
    settings = {**ucx_env.SETTINGS, "RVOD_TIMEOUT": "4"}
    with FakeHostsJob("hosta:2,hostb:1", job_env, 3, [PYTHON, ERRORS, "kill", signal_name], tmp_path,
                      settings=settings) as job:
        job.start()
        survivors = job.wait(60, ranks=[0, 1])
        report = job.report()
    for rank, res in survivors.items():
        assert "TRANSPORT shm+ucx" in res.stdout, report
        found = re.search(r"^SURVIVOR (\w+) ([\d.]+) (.*)$", res.stdout, re.MULTILINE)
        assert found, report
        kind, seconds, message = found.group(1), float(found.group(2)), found.group(3)
        assert re.search(r"\brank 2\b", message), report
        if signal_name == "SIGKILL":
            assert kind in ("RvodInternalError", "RvodTimeoutError") and seconds < 3.0, report
        else:
            assert kind == "RvodTimeoutError" and 3.5 <= seconds < 10.0, report
