"""rvodrun's horovodrun compatibility, on this machine: every horovodrun flag is honoured or refused with a
sentence (never "unrecognized arguments"), --config-file in Horovod's YAML schema, a script named without
its interpreter, --prefix-output-with-timestamp, --mpi through mpirun, the ssh command line of a remote
rank (no secret on it), and rvod.run on one host, directly and through mpirun.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from rvod.runner.cli import build_parser, job_from_args, parse_args
from rvod.runner.ssh import SshSettings, forwarded_environment

PYTHON = sys.executable

# Every option string of horovodrun (horovod/runner/launch.py::parse_args), with a value where it takes one.
HOROVODRUN_FLAGS = [
    ["-v"], ["--version"], ["-cb"], ["--check-build"], ["--disable-cache"], ["--start-timeout", "30"],
    ["--network-interfaces", "lo"], ["--network-interface", "lo"], ["--output-filename", "/tmp/x"],
    ["--verbose"], ["--config-file", "CONFIG"], ["-p", "22"], ["--ssh-port", "22"], ["-i", "/tmp/id"],
    ["--ssh-identity-file", "/tmp/id"], ["--fusion-threshold-mb", "32"], ["--cycle-time-ms", "2"],
    ["--cache-capacity", "10"], ["--hierarchical-allreduce"], ["--no-hierarchical-allreduce"],
    ["--hierarchical-allgather"], ["--no-hierarchical-allgather"], ["--torus-allreduce"], ["--no-torus-allreduce"],
    ["--autotune"], ["--no-autotune"], ["--autotune-log-file", "/tmp/a"], ["--autotune-warmup-samples", "3"],
    ["--autotune-steps-per-sample", "10"], ["--autotune-bayes-opt-max-samples", "20"],
    ["--autotune-gaussian-process-noise", "0.8"], ["--min-np", "2"], ["--min-num-proc", "2"], ["--max-np", "4"],
    ["--max-num-proc", "4"], ["--slots-per-host", "2"], ["--elastic-timeout", "600"], ["--reset-limit", "3"],
    ["--blacklist-cooldown-range", "10", "100"], ["--timeline-filename", "/tmp/t.json"],
    ["--timeline-mark-cycles"], ["--no-timeline-mark-cycles"], ["--no-stall-check"], ["--stall-check"],
    ["--stall-check-warning-time-seconds", "60"], ["--stall-check-shutdown-time-seconds", "0"],
    ["--mpi-threads-disable"], ["--no-mpi-threads-disable"], ["--mpi-args=--bind-to none"], ["--tcp"],
    ["--binding-args=--bind-to none"], ["--num-nccl-streams", "2"], ["--thread-affinity", "0"],
    ["--gloo-timeout-seconds", "30"], ["--log-level", "INFO"], ["--log-with-timestamp"],
    ["--log-without-timestamp"], ["-prefix-timestamp"], ["--prefix-output-with-timestamp"],
    ["--log-hide-timestamp"], ["--no-log-hide-timestamp"], ["-H", "localhost:2"], ["--hosts", "localhost:2"],
    ["-hostfile", "HOSTFILE"], ["--hostfile", "HOSTFILE"], ["--host-discovery-script", "/bin/true"],
    ["--gloo"], ["--mpi"], ["--jsrun"],
]


@pytest.mark.parametrize("flag", HOROVODRUN_FLAGS, ids=lambda flag: flag[0].split("=")[0])
def test_every_horovodrun_flag_is_honoured_or_refused_with_a_reason(flag, tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("params:\n  cycle_time_ms: 3\n")
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    args = [{"CONFIG": str(tmp_path / "config.yaml"), "HOSTFILE": str(tmp_path / "hosts")}.get(a, a) for a in flag]
    try:
        options = parse_args(build_parser(), ["-np", "2", *args, "true"])
    except SystemExit as exit_info:
        error = capsys.readouterr().err
        assert exit_info.code == 2, error
        assert "unrecognized arguments" not in error and "expected" not in error, error
        message = error.strip().splitlines()[-1]
        # A refusal names the flag and says why, in a sentence.
        assert re.search(r"rvodrun: error: --[\w-]+.*(not support|which rvod|does not have|only uses|"
                         r"no NCCL|does not run)", message), message
    else:
        assert options.command == ["true"]
        job_from_args(options).engine_env()


def test_refusals_and_flags_become_settings():
    options = parse_args(build_parser(), [
        "-np", "2", "--hierarchical-allreduce", "--no-hierarchical-allgather", "--tcp", "--gloo-timeout-seconds",
        "15", "--log-without-timestamp", "--network-interface", "eth9", "--network-interfaces", "eth8,eth9",
        "--no-stall-check", "--timeline-filename", "t.json", "--no-timeline-mark-cycles", "--gloo", "true"])
    job = job_from_args(options)
    assert job.nics == ("eth9", "eth8")
    assert job.engine_env() == {
        "RVOD_HIERARCHICAL_ALLREDUCE": "1", "RVOD_HIERARCHICAL_ALLGATHER": "0", "NCCL_IB_DISABLE": "1",
        "RVOD_TIMEOUT": "15", "RVOD_LOG_HIDE_TIME": "1", "RVOD_NETWORK_INTERFACE": "eth9,eth8",
        "RVOD_STALL_CHECK_DISABLE": "1", "RVOD_TIMELINE": "t.json", "RVOD_TIMELINE_MARK_CYCLES": "0",
        "RVOD_TRANSPORT": "tcp",
    }


@pytest.mark.parametrize("args, transport", [
    ([], None), (["--transport", "ucx"], "ucx"), (["--transport", "auto"], "auto"), (["--tcp"], "tcp"),
    (["--tcp", "--transport", "ucx"], "ucx"),
])
def test_transport_between_hosts_is_forwarded_to_the_workers(args, transport):
    job = job_from_args(parse_args(build_parser(), ["-np", "2", *args, "true"]))
    assert job.engine_env().get("RVOD_TRANSPORT") == transport


@pytest.mark.parametrize("args, environ, level", [
    (["--verbose"], {}, "INFO"), ([], {}, None), (["--verbose", "--log-level", "debug"], {}, "DEBUG"),
    (["--verbose"], {"RVOD_LOG_LEVEL": "WARNING"}, None), (["--verbose"], {"HOROVOD_LOG_LEVEL": "error"}, None),
])
def test_verbose_shows_the_engines_choices_unless_a_log_level_is_set(args, environ, level, monkeypatch):
    """--verbose puts each rank's log at INFO, where the engine says which transport and GPU route it chose;
    a level from --log-level wins, and one already in the environment is left for the ranks to inherit."""
    for name in ("RVOD_LOG_LEVEL", "HOROVOD_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    job = job_from_args(parse_args(build_parser(), ["-np", "2", *args, "true"]))
    assert job.engine_env().get("RVOD_LOG_LEVEL") == level


def test_an_unknown_transport_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(build_parser(), ["-np", "2", "--transport", "rdma", "true"])
    assert exit_info.value.code == 2
    assert "argument --transport: invalid choice: 'rdma'" in capsys.readouterr().err


def test_autotune_flags_become_settings_only_with_autotune(tmp_path):
    tuning = ["--autotune-log-file", "tune.csv", "--autotune-warmup-samples", "1", "--autotune-steps-per-sample",
              "4", "--autotune-bayes-opt-max-samples", "6", "--autotune-gaussian-process-noise", "0.5"]
    options = parse_args(build_parser(), ["-np", "2", "--autotune", *tuning, "true"])
    assert job_from_args(options).engine_env() == {
        "RVOD_AUTOTUNE": "1", "RVOD_AUTOTUNE_LOG": "tune.csv", "RVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "RVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4", "RVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6",
        "RVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5",
    }
    for without in (["--no-autotune"], []):
        options = parse_args(build_parser(), ["-np", "2", *without, *tuning, "true"])
        assert job_from_args(options).engine_env() == {}, without
    config = tmp_path / "config.yaml"
    config.write_text("autotune:\n  enabled: true\n  steps_per_sample: 7\n")
    options = parse_args(build_parser(), ["-np", "2", "--config-file", str(config), "true"])
    assert job_from_args(options).engine_env() == {"RVOD_AUTOTUNE": "1", "RVOD_AUTOTUNE_STEPS_PER_SAMPLE": "7"}


def test_config_file_fills_what_the_command_line_left_unset(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent("""
        # Horovod's sample schema
        controller: gloo
        params:
          fusion_threshold_mb: 32
          cycle_time_ms: 10
          cache_capacity: 2048
          hierarchical_allreduce: false
          hierarchical_allgather: true
        autotune:
          enabled: false
          warmup_samples: 5
        timeline:
          filename: time.json
          mark_cycles: true
        stall_check:
          enabled: false
          warning_time_seconds: 120
          shutdown_time_seconds: 240
        library_options:
          mpi_threads_disable: true
          thread_affinity: 0
          gloo_timeout_seconds: 45
        logging:
          level: debug
          with_timestamp: false
    """))
    options = parse_args(build_parser(), ["-np", "2", "--cycle-time-ms", "2", "--config-file", str(config), "true"])
    assert options.use_gloo and not options.use_mpi
    assert job_from_args(options).engine_env() == {
        "RVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "RVOD_CYCLE_TIME": "2", "RVOD_CACHE_CAPACITY": "2048",
        "RVOD_HIERARCHICAL_ALLREDUCE": "0", "RVOD_HIERARCHICAL_ALLGATHER": "1", "RVOD_TIMELINE": "time.json",
        "RVOD_TIMELINE_MARK_CYCLES": "1", "RVOD_STALL_CHECK_DISABLE": "1", "RVOD_STALL_CHECK_TIME_SECONDS": "120",
        "RVOD_STALL_SHUTDOWN_TIME_SECONDS": "240", "RVOD_THREAD_AFFINITY": "0", "RVOD_TIMEOUT": "45",
        "RVOD_LOG_LEVEL": "DEBUG", "RVOD_LOG_HIDE_TIME": "1",
    }


@pytest.mark.parametrize("text, message", [
    ("params:\n  fusion_threshold_mb: -1\n", r"params.fusion_threshold_mb=-1 must be >= 0"),
    ("params:\n  fusion_thresh: 1\n", r"params.fusion_thresh: unknown key"),
    ("tuning:\n  x: 1\n", r"tuning: unknown section"),
    ("controller: nccl\n", r"controller must be gloo or mpi, got 'nccl'"),
    ("params: [1, 2\n", r"is not valid YAML"),
])
def test_config_file_errors_name_the_key(tmp_path, capsys, text, message):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(build_parser(), ["-np", "2", "--config-file", str(config), "true"])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def rvodrun(args, cwd=None, timeout=60, env=None):
    return subprocess.run([PYTHON, "-m", "rvod.runner", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


@pytest.mark.timeout(60)
def test_a_script_named_without_its_interpreter(job_env, tmp_path):
    (tmp_path / "hello.py").write_text("import os, sys\nprint('hello from', os.environ['RVOD_RANK'], sys.executable)\n")
    (tmp_path / "notes.txt").write_text("not a program\n")
    result = rvodrun(["-np", "2", "hello.py"], cwd=tmp_path, env=job_env)
    assert result.returncode == 0, result.stderr
    ran_with = sorted((rank, os.path.normpath(python))
                      for rank, python in re.findall(r"<stdout>:hello from (\d) (\S+)", result.stdout))
    assert ran_with == [("0", os.path.normpath(PYTHON)), ("1", os.path.normpath(PYTHON))]
    refused = rvodrun(["-np", "2", "notes.txt"], cwd=tmp_path, env=job_env)
    assert refused.returncode == 2
    assert "'notes.txt' is not executable: make it executable (chmod +x) or name its interpreter" in refused.stderr


@pytest.mark.timeout(60)
def test_prefix_output_with_timestamp(job_env):
    result = rvodrun(["-np", "2", "--prefix-output-with-timestamp", "sh", "-c", "echo hi $RVOD_RANK"], env=job_env)
    assert result.returncode == 0, result.stderr
    stamp = r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun) \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    assert len(re.findall(rf"^{stamp}\[\d\]<stdout>:hi \d$", result.stdout, re.M)) == 2, result.stdout


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="--mpi needs Open MPI's mpirun (scripts/setup-system.sh)")
def test_mpi_launches_through_mpirun(job_env):
    result = rvodrun(["--mpi", "-np", "2", PYTHON, "-c", textwrap.dedent("""
        import sys
        import numpy as np
        import rvod.numpy as hvd
        hvd.init()
        total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)[0]
        # One write per line: mpirun tags what each write brings, so a separate newline could join two ranks' lines.
        sys.stdout.write(f"rank {hvd.rank()} local {hvd.local_rank()} of {hvd.local_size()} total {total}\\n")
        sys.stdout.flush()
    """)], env=job_env)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert re.search(rf"^\[1,{rank}\]<stdout>:rank {rank} local {rank} of 2 total 3.0$", result.stdout, re.M), \
            result.stdout


def test_mpi_without_mpirun_is_a_clear_error(job_env, tmp_path):
    env = dict(job_env, PATH=str(tmp_path))
    result = rvodrun(["--mpi", "-np", "2", "true"], env=env)
    assert result.returncode == 1
    assert "rvodrun: --mpi starts the ranks with mpirun, which is not installed here" in result.stderr


def test_ssh_command_of_a_remote_rank():
    settings = SshSettings(port=2222, identity_file="/keys/id", config_file="/etc/cfg", connect_timeout=7)
    assert settings.command("node1", "exec python -m rvod.runner.remote") == [
        "ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new", "-o", "ConnectTimeout=7",
        "-F", "/etc/cfg", "-p", "2222", "-i", "/keys/id", "--", "node1", "exec python -m rvod.runner.remote"]
    forwarded = forwarded_environment({"PATH": "/bin", "HOSTNAME": "here", "SSH_AUTH_SOCK": "/s", "OLDPWD": "/",
                                       "BASH_FUNC_x%%": "() {}", "RVOD_CYCLE_TIME": "2"})
    assert forwarded == {"PATH": "/bin", "RVOD_CYCLE_TIME": "2"}


@pytest.mark.timeout(60)
def test_rvod_run_on_this_machine(job_env):
    result = subprocess.run([PYTHON, "-c", textwrap.dedent("""
        import rvod

        def square_of_rank(base):
            import rvod.numpy as hvd
            hvd.init()
            return (hvd.rank() + base) ** 2, hvd.size()

        print(rvod.run(square_of_rank, args=(1,), num_proc=3))
        # Elastic (min_num_proc) on a fixed set of hosts: the driver's world of 2.
        print(rvod.run(square_of_rank, args=(1,), num_proc=2, min_num_proc=2, hosts="localhost:2"))
        try:
            rvod.run(square_of_rank, num_proc=2, min_num_proc=1)
        except ValueError as error:
            print("refused:", error)
    """)], env=job_env, capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "[(1, 3), (4, 3), (9, 3)]",
        "[(1, 2), (4, 2)]",
        "refused: elastic training needs --host-discovery-script (or -H/--hostfile for a fixed set of hosts)",
    ]


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="use_mpi needs Open MPI's mpirun (scripts/setup-system.sh)")
def test_rvod_run_through_mpirun_on_this_machine(job_env):
    result = subprocess.run([PYTHON, "-c", textwrap.dedent("""
        import rvod

        def rank_and_local_rank():
            import os
            import rvod.numpy as hvd
            hvd.init()
            return hvd.rank(), hvd.local_rank(), int(os.environ["OMPI_COMM_WORLD_RANK"])

        print(rvod.run(rank_and_local_rank, num_proc=2, use_mpi=True, mpi_args="--oversubscribe"))
    """)], env=job_env, capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[(0, 0, 0), (1, 1, 1)]", result.stdout + result.stderr


def test_rvod_run_use_mpi_without_mpirun_and_mpi_args_without_use_mpi_are_clear_errors(job_env, tmp_path):
    result = subprocess.run([PYTHON, "-c", textwrap.dedent("""
        import rvod

        for kwargs in ({"use_mpi": True}, {"mpi_args": "--oversubscribe"}):
            try:
                rvod.run(print, num_proc=2, **kwargs)
            except ValueError as error:
                print(f"ValueError: {error}")
    """)], env=dict(job_env, PATH=str(tmp_path)), capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "ValueError: rvod.run: use_mpi=True starts the ranks with mpirun, which is not installed here (install "
        "Open MPI, or leave it out: rvod starts ranks on other hosts over ssh itself)",
        "ValueError: mpi_args is for mpirun, which rvod.run only uses with use_mpi=True",
    ]


def test_probe_names_a_host_with_another_python(tmp_path, monkeypatch):
    """The probe's verdicts, with an `ssh` on PATH that answers as a host with Python 3.9 would (b), one
    that cannot be reached (c), and one that lacks the NIC asked for (d)."""
    from rvod import __version__
    from rvod.runner.ssh import HostProblem, probe_hosts

    fake_ssh = tmp_path / "ssh"
    fake_ssh.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for host; do :; done  # the remote command is the last argument, the host the one before
        case "$*" in
          *" -- b "*) echo 'rvod-probe:{{"python": "3.9.18", "rvod": "{__version__}", "nics": ["eth0"]}}' ;;
          *" -- c "*) echo "ssh: connect to host c port 22: Connection refused" >&2; exit 255 ;;
          *) echo 'rvod-probe:{{"python": "{sys.version.split()[0]}", "rvod": "{__version__}", "nics": ["lo"]}}' ;;
        esac
    """))
    fake_ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    probe_hosts(SshSettings(), ["a", "d"], {}, timeout=10)
    with pytest.raises(HostProblem) as problem:
        probe_hosts(SshSettings(), ["a", "b", "c", "d"], {}, timeout=10, nics=["lo"])
    message = str(problem.value)
    assert f"host 'b' runs Python 3.9.18 with rvod {__version__}, this machine Python {sys.version.split()[0]}" \
        in message
    assert "host 'c' is not reachable over ssh: ssh: connect to host c port 22: Connection refused" in message
    assert "host 'a'" not in message and "host 'd'" not in message
    with pytest.raises(HostProblem, match=r"host 'a' has no network interface 'eth0' \(it has lo\)"):
        probe_hosts(SshSettings(), ["a"], {}, timeout=10, nics=["eth0"])


@pytest.mark.timeout(60)
def test_log_without_timestamp(job_env):
    """The engine's log lines (here: the error about too few --thread-affinity ids) with and without time."""
    code = "import rvod.numpy as hvd; hvd.init(); hvd.shutdown()"
    lines = {}
    for flag in ("--log-with-timestamp", "--log-without-timestamp"):
        result = rvodrun(["-np", "2", flag, "--thread-affinity", "0", PYTHON, "-c", code], env=job_env)
        assert result.returncode == 0, result.stderr
        lines[flag] = re.findall(r"^\[0\]<stderr>:(.*RVOD_THREAD_AFFINITY.*)$", result.stderr, re.M)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\S+ ERROR RVOD_THREAD_AFFINITY=.*", lines["--log-with-timestamp"][0])
    assert re.fullmatch(r"ERROR RVOD_THREAD_AFFINITY=.*", lines["--log-without-timestamp"][0])
