"""Tests of rvodrun: host parsing and rank placement, worker environment, output forwarding, supervision.

Jobs run with a fake rendezvous store patched into the runner, so these tests do not need the native
extension; one test at the end uses the real store and is skipped until the extension is built.
"""

from __future__ import annotations

import io
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import JOB_TAG_VARIABLE, RVODRUN, tagged_pids
from rvod.runner.cli import build_parser, job_from_args, parse_args
from rvod.runner.hosts import Host, Slot, assign_slots, parse_hostfile, parse_hosts, remote_hosts
from rvod.runner.output import forward_lines
from rvod.runner.supervisor import describe_exit, exit_status
from rvod.runner.worker_env import worker_env

# `python -m rvod.runner`, with the rendezvous store replaced by a plain listening socket.
FAKE_STORE_ENTRY = ("-c", textwrap.dedent("""
    import runpy, socket, sys
    import rvod.runner.store as store

    class FakeStore:
        def __init__(self, host, secret):
            assert len(secret) == 32, secret
            self._socket = socket.create_server((host, 0))
            self.port = self._socket.getsockname()[1]

        def close(self):
            self._socket.close()
            print("fake store closed", file=sys.stderr)

    store.start_store = FakeStore
    runpy.run_module("rvod.runner", run_name="__main__", alter_sys=True)
"""))

PYTHON = sys.executable


def python_code(code: str) -> list[str]:
    return [PYTHON, "-c", textwrap.dedent(code)]


def rank_lines(text: str, stream: str) -> dict[int, list[str]]:
    """Lines of `text` in rvodrun's `[rank]<stream>:line` form, grouped by rank."""
    lines: dict[int, list[str]] = {}
    for match in re.finditer(rf"^\[(\d+)\]<{stream}>:(.*)$", text, re.MULTILINE):
        lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return lines


@pytest.fixture
def run_job(run_rvodrun):
    """Runs rvodrun with the fake store."""

    def run(args, timeout=20):
        return run_rvodrun(args, timeout=timeout, entry=FAKE_STORE_ENTRY)

    return run


# --- hosts and placement ---------------------------------------------------------------------------

def test_parse_hosts():
    assert parse_hosts("localhost:2,otherhost:4") == [Host("localhost", 2), Host("otherhost", 4)]
    assert parse_hosts(" a:1 , b ") == [Host("a", 1), Host("b", 1)]


@pytest.mark.parametrize("text, message", [
    ("a:0", "slots must be"),
    ("a:x", "slots must be"),
    ("a:", "slots must be"),
    (":2", "without a host name"),
    ("a:2,,b:1", "without a host name"),
    ("a:2,a:1", "listed more than once"),
])
def test_parse_hosts_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        parse_hosts(text)


def test_parse_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\n\n  node2   slots=2  # spare\nnode3\n")
    assert parse_hostfile(str(hostfile)) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]


def test_parse_hostfile_rejects(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=4\nnode2 cores=2\n")
    with pytest.raises(ValueError, match="line 2: expected 'slots=N', got 'cores=2'"):
        parse_hostfile(str(hostfile))
    with pytest.raises(ValueError, match="cannot read hostfile"):
        parse_hostfile(str(tmp_path / "missing"))
    hostfile.write_text("# nothing\n")
    with pytest.raises(ValueError, match="names no hosts"):
        parse_hostfile(str(hostfile))


def layout(slots: list[Slot]) -> list[tuple]:
    return [(s.hostname, s.rank, s.size, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]


def test_assign_one_host():
    assert layout(assign_slots([Host("localhost", 4)], 3)) == [
        ("localhost", 0, 3, 0, 3, 0, 1),
        ("localhost", 1, 3, 1, 3, 0, 1),
        ("localhost", 2, 3, 2, 3, 0, 1),
    ]


def test_assign_even_hosts():
    assert layout(assign_slots([Host("a", 2), Host("b", 2)], 4)) == [
        ("a", 0, 4, 0, 2, 0, 2),
        ("a", 1, 4, 1, 2, 0, 2),
        ("b", 2, 4, 0, 2, 1, 2),
        ("b", 3, 4, 1, 2, 1, 2),
    ]


def test_assign_uneven_hosts():
    # a has local ranks 0..2, b only local rank 0: local ranks 1 and 2 exist on one host alone.
    assert layout(assign_slots([Host("a", 3), Host("b", 1)], 4)) == [
        ("a", 0, 4, 0, 3, 0, 2),
        ("a", 1, 4, 1, 3, 0, 1),
        ("a", 2, 4, 2, 3, 0, 1),
        ("b", 3, 4, 0, 1, 1, 2),
    ]


def test_assign_fills_hosts_in_order_and_stops_early():
    assert layout(assign_slots([Host("a", 1), Host("b", 3), Host("c", 2), Host("d", 5)], 5)) == [
        ("a", 0, 5, 0, 1, 0, 3),
        ("b", 1, 5, 0, 3, 1, 3),
        ("b", 2, 5, 1, 3, 0, 1),
        ("b", 3, 5, 2, 3, 0, 1),
        ("c", 4, 5, 0, 1, 2, 3),
    ]


def test_assign_rejects_bad_counts():
    with pytest.raises(ValueError, match="-np 5 is more than the 4 slots"):
        assign_slots([Host("a", 2), Host("b", 2)], 5)
    with pytest.raises(ValueError, match="at least 1"):
        assign_slots([Host("a", 2)], 0)


def test_remote_hosts():
    hostname = socket.gethostname()
    local = [Host("localhost", 1), Host("127.0.0.1", 1), Host(hostname.upper(), 1)]
    assert remote_hosts(local) == []
    assert remote_hosts([Host("localhost", 1), Host("gpu-node-7.example", 2)]) == ["gpu-node-7.example"]


# --- settings and environment ----------------------------------------------------------------------

def test_engine_env_from_flags():
    job = job_from_args(parse_args(build_parser(), [
        "-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--cache-capacity", "0",
        "--timeline-filename", "/tmp/t.json", "--timeline-mark-cycles", "--log-level", "debug",
        "--stall-check-warning-time-seconds", "30", "--stall-check-shutdown-time-seconds", "90",
        "--no-stall-check", "--timeout", "45", "--start-timeout", "10", "--disable-cache",
        "--thread-affinity", "3, 01", "python", "x.py",
    ]))
    assert job.command == ("python", "x.py")
    assert job.engine_env() == {
        "RVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024),
        "RVOD_CYCLE_TIME": "2.5",
        "RVOD_CACHE_CAPACITY": "0",
        "RVOD_TIMELINE": "/tmp/t.json",
        "RVOD_TIMELINE_MARK_CYCLES": "1",
        "RVOD_LOG_LEVEL": "DEBUG",
        "RVOD_STALL_CHECK_TIME_SECONDS": "30",
        "RVOD_STALL_SHUTDOWN_TIME_SECONDS": "90",
        "RVOD_STALL_CHECK_DISABLE": "1",
        "RVOD_TIMEOUT": "45",
        "RVOD_START_TIMEOUT": "10",
        "RVOD_THREAD_AFFINITY": "3,1",
    }


def test_thread_affinity_flag_refuses_what_is_not_core_ids(capsys):
    for bad in ("1,x", "-1", "", "1,,2"):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(build_parser(), ["-np", "2", "--thread-affinity", bad, "python", "x.py"])
        assert exit_info.value.code == 2
        assert "not a comma-separated list of core ids" in capsys.readouterr().err


def test_engine_env_empty_without_flags():
    job = job_from_args(parse_args(build_parser(), ["-np", "1", "--", "python", "-v"]))
    assert job.command == ("python", "-v")
    assert job.engine_env() == {}


def test_worker_env():
    slot = Slot("localhost", rank=2, size=4, local_rank=0, local_size=2, cross_rank=1, cross_size=2)
    env = worker_env({"PATH": "/bin", "RVOD_RANK": "9"}, slot, rendezvous_addr="127.0.0.1", rendezvous_port=4242,
                     secret=b"\x01\xab", settings={"RVOD_CYCLE_TIME": "2"})
    assert env == {
        "PATH": "/bin", "RVOD_CYCLE_TIME": "2",
        "RVOD_RANK": "2", "RVOD_SIZE": "4", "RVOD_LOCAL_RANK": "0", "RVOD_LOCAL_SIZE": "2",
        "RVOD_CROSS_RANK": "1", "RVOD_CROSS_SIZE": "2", "RVOD_HOSTNAME": "localhost",
        "RVOD_RENDEZVOUS_ADDR": "127.0.0.1", "RVOD_RENDEZVOUS_PORT": "4242", "RVOD_SECRET": "01ab",
        "PYTHONUNBUFFERED": "1",
    }


# --- output forwarding and exit descriptions --------------------------------------------------------

def test_forward_lines_prefixes_and_copies():
    raw = b"first\n\nbad \xff\xfe bytes\nno newline at end"
    sink = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    copy = io.BytesIO()
    copy.close = lambda: None  # keep the contents readable after forward_lines closes it
    forward_lines(io.BytesIO(raw), "[3]<stdout>:", sink, copy)
    assert sink.buffer.getvalue().decode() == (
        "[3]<stdout>:first\n[3]<stdout>:\n[3]<stdout>:bad \ufffd\ufffd bytes\n[3]<stdout>:no newline at end\n"
    )
    assert copy.getvalue() == raw


def test_exit_descriptions():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by signal SIGKILL"
    assert exit_status(3) == 3
    assert exit_status(-signal.SIGKILL) == 137


# --- jobs ------------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_workers_see_their_environment(run_job):
    result = run_job(["-np", "3", *python_code("""
        import os
        names = ["RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME",
                 "RENDEZVOUS_ADDR", "RENDEZVOUS_PORT", "SECRET"]
        print(*[os.environ["RVOD_" + name] for name in names], os.environ["PYTHONUNBUFFERED"])
    """)])
    assert result.returncode == 0, result.stderr
    fields = {rank: lines[0].split() for rank, lines in rank_lines(result.stdout, "stdout").items()}
    assert sorted(fields) == [0, 1, 2]
    for rank, (r, size, local_rank, local_size, cross_rank, cross_size, host, addr, port, secret, unbuffered) \
            in fields.items():
        assert (int(r), size, int(local_rank), local_size, cross_rank, cross_size) == (rank, "3", rank, "3", "0", "1")
        assert (host, addr, unbuffered) == ("localhost", "127.0.0.1", "1")
        assert int(port) > 0 and re.fullmatch(r"[0-9a-f]{64}", secret)
    assert len({tuple(f[8:10]) for f in fields.values()}) == 1, "all ranks share one store and one secret"
    assert "fake store closed" in result.stderr


@pytest.mark.timeout(30)
def test_two_local_host_names_make_two_hosts(run_job):
    result = run_job(["-np", "3", "-H", "localhost:2,127.0.0.1:2", "--cycle-time-ms", "3", *python_code("""
        import os
        print(*[os.environ[name] for name in
                ["RVOD_HOSTNAME", "RVOD_LOCAL_RANK", "RVOD_LOCAL_SIZE", "RVOD_CROSS_RANK", "RVOD_CROSS_SIZE",
                 "RVOD_CYCLE_TIME"]])
    """)])
    assert result.returncode == 0, result.stderr
    assert {rank: lines[0] for rank, lines in rank_lines(result.stdout, "stdout").items()} == {
        0: "localhost 0 2 0 2 3",
        1: "localhost 1 2 0 1 3",
        2: "127.0.0.1 0 1 1 2 3",
    }


@pytest.mark.timeout(30)
def test_output_is_prefixed_by_rank_and_stream(run_job):
    result = run_job(["-np", "2", *python_code("""
        import os, sys
        rank = os.environ["RVOD_RANK"]
        print("out", rank)
        print("err", rank, file=sys.stderr)
        sys.stdout.buffer.write(b"bad \\xff bytes\\n")
        sys.stderr.write("partial " + rank)
    """)])
    assert result.returncode == 0, result.stderr
    stdout, stderr = rank_lines(result.stdout, "stdout"), rank_lines(result.stderr, "stderr")
    for rank in (0, 1):
        assert stdout[rank] == [f"out {rank}", "bad \ufffd bytes"]
        assert stderr[rank] == [f"err {rank}", f"partial {rank}"]
    assert "<stderr>" not in result.stdout and "<stdout>" not in result.stderr


@pytest.mark.timeout(30)
def test_output_filename_writes_each_ranks_streams(run_job, tmp_path):
    result = run_job(["-np", "11", "--output-filename", str(tmp_path / "logs"),
                      "sh", "-c", "echo out $RVOD_RANK; echo err $RVOD_RANK >&2"])
    assert result.returncode == 0, result.stderr
    for rank in range(11):
        directory = tmp_path / "logs" / f"rank.{rank:02d}"  # padded to the width of the largest rank
        assert (directory / "stdout").read_text() == f"out {rank}\n"
        assert (directory / "stderr").read_text() == f"err {rank}\n"
    assert rank_lines(result.stdout, "stdout")[10] == ["out 10"]


@pytest.mark.timeout(30)
def test_failing_rank_stops_the_job(run_job, job_env):
    started = time.monotonic()
    result = run_job(["-np", "3", *python_code("""
        import os, sys, time
        if os.environ["RVOD_RANK"] == "1":
            time.sleep(0.5)
            print("rank 1 fails", file=sys.stderr)
            sys.exit(3)
        time.sleep(60)
    """)])
    assert result.returncode == 3
    assert re.search(r"^rvodrun: rank 1 \(pid \d+\) exited with code 3$", result.stderr, re.MULTILINE)
    assert result.stderr.index("rank 1 fails") < result.stderr.index("exited with code 3")
    assert time.monotonic() - started < 8
    assert tagged_pids(job_env[JOB_TAG_VARIABLE]) == []


@pytest.mark.timeout(30)
def test_rank_killed_by_signal_is_named(run_job, job_env):
    result = run_job(["-np", "2", *python_code("""
        import os, signal, time
        if os.environ["RVOD_RANK"] == "0":
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)])
    assert result.returncode == 128 + signal.SIGKILL
    assert re.search(r"^rvodrun: rank 0 \(pid \d+\) was killed by signal SIGKILL$", result.stderr, re.MULTILINE)
    assert tagged_pids(job_env[JOB_TAG_VARIABLE]) == []


@pytest.mark.timeout(30)
def test_a_killed_rank_is_named_before_the_peer_that_failed_because_of_it(run_job, job_env, tmp_path):
    # Rank 1 is killed; rank 0 fails the moment rank 1 is dead (as a rank whose peer vanished does), so both
    # are found finished together and rank 0, the lower rank, would otherwise be named as the job's failure.
    pid_file = tmp_path / "rank1.pid"
    result = run_job(["-np", "2", *python_code(f"""
        import os, signal, sys, time
        from pathlib import Path
        pid_file = Path({str(pid_file)!r})
        if os.environ["RVOD_RANK"] == "1":
            pid_file.write_text(str(os.getpid()))
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        while not pid_file.exists():
            time.sleep(0.01)
        stat = Path("/proc") / pid_file.read_text() / "stat"
        while stat.exists() and stat.read_text().split(")")[1].split()[0] != "Z":
            time.sleep(0.001)
        sys.exit("rank 0: rank 1 exited or closed its connection")
    """)])
    failures = [line for line in result.stderr.splitlines() if re.match(r"rvodrun: rank \d", line)]
    assert failures and re.fullmatch(r"rvodrun: rank 1 \(pid \d+\) was killed by signal SIGKILL", failures[0]), \
        result.stderr
    assert result.returncode == 128 + signal.SIGKILL
    assert tagged_pids(job_env[JOB_TAG_VARIABLE]) == []


@pytest.mark.timeout(30)
def test_children_left_by_a_clean_run_are_stopped(run_job, job_env):
    started = time.monotonic()
    result = run_job(["-np", "2", "sh", "-c", "sleep 60 & echo started"])
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 8
    assert tagged_pids(job_env[JOB_TAG_VARIABLE]) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_rvodrun_is_forwarded_to_workers(job_env, signum):
    worker = python_code("""
        import os, signal, sys, time
        def stop(signum, frame):
            print("rank", os.environ["RVOD_RANK"], "got", signal.Signals(signum).name)
            sys.exit(0)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        print("ready")
        time.sleep(60)
    """)
    rvodrun = subprocess.Popen([PYTHON, *FAKE_STORE_ENTRY, "-np", "3", *worker], env=job_env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = 0
        while ready < 3:
            line = rvodrun.stdout.readline()
            assert line, "rvodrun ended before its workers were ready"
            ready += line.endswith("<stdout>:ready\n")
        rvodrun.send_signal(signum)
        stdout, stderr = rvodrun.communicate(timeout=10)
    finally:
        rvodrun.kill()
    name = signal.Signals(signum).name
    assert rvodrun.returncode == 128 + signum
    assert sorted(rank_lines(stdout, "stdout").values()) == [[f"rank {r} got {name}"] for r in range(3)]
    assert f"rvodrun: received {name}, stopping 3 ranks" in stderr
    assert tagged_pids(job_env[JOB_TAG_VARIABLE]) == []


@pytest.mark.timeout(30)
def test_worker_ignoring_sigterm_is_killed(run_job, job_env):
    result = run_job(["-np", "2", *python_code("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ["RVOD_RANK"] == "0":
            time.sleep(0.3)
            sys.exit(1)
        time.sleep(60)
    """)])
    assert result.returncode == 1
    assert "rvodrun: killing 1 rank that did not stop" in result.stderr
    assert tagged_pids(job_env[JOB_TAG_VARIABLE]) == []


@pytest.mark.timeout(30)
def test_command_that_cannot_start(run_job):
    result = run_job(["-np", "2", "/nonexistent/program"])
    assert result.returncode == 1
    assert "rvodrun: cannot start rank 0 (/nonexistent/program)" in result.stderr


@pytest.mark.timeout(30)
def test_verbose_names_placement_and_exits(run_job):
    result = run_job(["-np", "2", "--verbose", "true"])
    assert result.returncode == 0, result.stderr
    assert "rvodrun: rank 1 on localhost: local rank 1 of 2, cross rank 0 of 1" in result.stderr
    assert re.search(r"^rvodrun: rank 0 \(pid \d+\) exited with code 0$", result.stderr, re.MULTILINE)


# --- command line ----------------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, message", [
    (["-np", "0", "true"], "must be at least 1, got 0"),
    (["-np", "5", "-H", "localhost:4", "true"], "-np 5 is more than the 4 slots"),
    (["-np", "2", "-H", "localhost:2", "--hostfile", "hosts", "true"], "not allowed with argument"),
    (["true"], "-np/--num-proc is required"),
    (["-np", "2"], "no command given"),
    (["-np", "2", "--no-such-flag", "true"], "unrecognized arguments: --no-such-flag"),
    (["-np", "2", "--fusion-threshold-mb", "-1", "true"], "-1 must be >= 0"),
    (["-np", "2", "--log-level", "loud", "true"], "invalid choice: 'LOUD'"),
])
def test_usage_errors(run_job, args, message):
    result = run_job(args)
    assert result.returncode == 2
    assert "rvodrun: error:" in result.stderr and message in result.stderr
    assert "fake store" not in result.stderr, "no store is started for a job that cannot run"


@pytest.mark.timeout(30)
def test_help(run_job):
    result = run_job(["-h"])
    assert result.returncode == 0
    assert result.stdout.startswith("usage: rvodrun")
    assert "--output-filename" in result.stdout


@pytest.mark.timeout(30)
def test_check_build(run_job):
    result = run_job(["--check-build"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"rvod v\S+:", lines[0])
    for heading in ("Available Frameworks:", "Available Controllers:", "Available Tensor Operations:"):
        assert heading in lines
    for framework in ("PyTorch", "TensorFlow", "MXNet", "Keras"):
        assert any(re.fullmatch(rf"    \[[X ]\] {framework}", line) for line in lines), framework
    try:
        import rvod._rvod  # noqa: F401
    except ImportError:
        assert "the native extension rvod._rvod is not built" in result.stdout
    else:
        assert "    [X] TCP" in lines and "    [X] shared memory" in lines and "    [X] rvod" in lines


# --- the real store ---------------------------------------------------------------------------------

def _native_extension_missing() -> bool:
    try:
        import rvod._rvod  # noqa: F401
    except ImportError:
        return True
    return False


@pytest.mark.timeout(30)
def test_without_extension_a_job_fails_clearly(run_rvodrun):
    if not _native_extension_missing():
        pytest.skip("rvod._rvod is built, so the store starts")
    result = run_rvodrun(["-np", "1", "true"], timeout=20, entry=RVODRUN)
    assert result.returncode == 1
    assert "the native extension rvod._rvod is not available" in result.stderr


@pytest.mark.timeout(30)
@pytest.mark.skipif(_native_extension_missing(), reason="rvod._rvod (the native extension) is not built")
def test_ranks_reach_the_real_store(run_rvodrun):
    result = run_rvodrun(["-np", "2", *python_code("""
        import os, socket
        with socket.create_connection((os.environ["RVOD_RENDEZVOUS_ADDR"], int(os.environ["RVOD_RENDEZVOUS_PORT"]))):
            print("connected")
    """)], timeout=20, entry=RVODRUN)
    assert result.returncode == 0, result.stderr
    assert rank_lines(result.stdout, "stdout") == {0: ["connected"], 1: ["connected"]}


@pytest.mark.timeout(30)
def test_dash_v_prints_the_version_like_horovodrun(run_job):
    import rvod

    result = run_job(["-v"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"rvod {rvod.__version__}"
