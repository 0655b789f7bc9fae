"""The runner's job description (rvod.runner.job.JobSpec): rvodrun's command line and rvod.run's arguments
describe the same job with equal JobSpecs, a --config-file's values land in it, and every rvodrun flag
either has a place in it or is listed as leaving none. Nothing is launched: rvod.run is stopped where it
hands its job to the launcher."""

from __future__ import annotations

import dataclasses
import shutil
import textwrap

import pytest
from rvod.runner import launch
from rvod.runner.cli import NOT_IN_THE_JOB, build_parser, job_from_args, parse_args
from rvod.runner.job import JobSpec

pytest.importorskip("cloudpickle")


class Handed(Exception):
    """Raised in place of the launcher, carrying the job rvod.run handed it."""

    def __init__(self, spec: JobSpec):
        super().__init__()
        self.spec = spec


def cli_job(*argv: str) -> JobSpec:
    return job_from_args(parse_args(build_parser(), list(argv)))


def run_job(monkeypatch, **arguments) -> JobSpec:
    """The JobSpec `rvod.run(fn, **arguments)` hands to the launcher (plain or elastic)."""
    import rvod

    def stop(spec, *_):
        raise Handed(spec)

    monkeypatch.setattr(launch, "plan_job", stop)
    monkeypatch.setattr(launch, "elastic_driver", stop)
    with pytest.raises(Handed) as handed:
        rvod.run(lambda: 0, **arguments)
    return handed.value.spec


@pytest.mark.timeout(60)
def test_the_command_line_and_rvod_run_describe_a_job_alike(monkeypatch):
    cli = cli_job("-np", "3", "-H", "localhost:2,127.0.0.1:1", "--start-timeout", "12.5", "-p", "2222",
                  "-i", "/keys/id", "--output-filename", "/tmp/out", "--network-interface", "lo,eth0",
                  "--verbose", "--disable-cache", "--gloo", "python", "train.py")
    run = run_job(monkeypatch, num_proc=3, hosts="localhost:2,127.0.0.1:1", start_timeout=12.5, ssh_port=2222,
                  ssh_identity_file="/keys/id", output_filename="/tmp/out", network_interfaces="lo,eth0",
                  verbose=2, disable_cache=True, use_gloo=True)
    assert cli.command == ("python", "train.py") and run.command == ()
    assert dataclasses.replace(cli, command=()) == run
    assert (run.num_proc, run.hosts, run.nics, run.ssh_port, run.verbose) == (
        3, "localhost:2,127.0.0.1:1", ("lo", "eth0"), 2222, True)
    for name in ("RVOD_LOG_LEVEL", "HOROVOD_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    assert run.engine_env() == cli.engine_env() == {"RVOD_START_TIMEOUT": "12.5",
                                                    "RVOD_NETWORK_INTERFACE": "lo,eth0",
                                                    "RVOD_LOG_LEVEL": "INFO"}  # --verbose shows the engine's choices


@pytest.mark.timeout(60)
def test_an_elastic_job_and_an_mpirun_job_alike(monkeypatch, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    cli = cli_job("-np", "2", "--min-np", "1", "--max-np", "4", "--host-discovery-script", "./discover.sh",
                  "--slots-per-host", "2", "--reset-limit", "3", "--blacklist-cooldown-range", "5", "10", "true")
    with pytest.warns(DeprecationWarning, match="min_np is deprecated, use min_num_proc"):
        run = run_job(monkeypatch, num_proc=2, min_np=1, max_num_proc=4, host_discovery_script="./discover.sh",
                      slots=2, reset_limit=3, cooldown_range=[5, 10])
    assert run.elastic and cli.elastic
    assert dataclasses.replace(cli, command=()) == run
    assert run.cooldown_range == (5, 10)

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")  # rvod.run checks mpirun is there
    cli = cli_job("--mpi", "-np", "2", "--hostfile", str(hostfile), "--mpi-args=--oversubscribe", "true")
    with pytest.warns(DeprecationWarning, match="np is deprecated, use num_proc"):
        run = run_job(monkeypatch, np=2, hostfile=str(hostfile), use_mpi=True, mpi_args="--oversubscribe")
    assert run.use_mpi and not run.elastic
    assert dataclasses.replace(cli, command=()) == run


def test_config_file_values_land_in_the_job(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent("""
        controller: mpi
        params:
          fusion_threshold_mb: 32
          cycle_time_ms: 10
          hierarchical_allgather: true
        autotune:
          enabled: true
          gaussian_process_noise: 0.25
        timeline:
          filename: time.json
        stall_check:
          enabled: false
        library_options:
          thread_affinity: "2, 03"
          gloo_timeout_seconds: 45
        logging:
          level: debug
    """))
    job = cli_job("-np", "2", "--cycle-time-ms", "2", "--config-file", str(config), "python", "x.py")
    assert job == JobSpec(num_proc=2, command=("python", "x.py"), use_mpi=True, fusion_threshold_mb=32,
                          cycle_time_ms=2.0, hierarchical_allgather=True, autotune=True,
                          autotune_gaussian_process_noise=0.25, timeline_filename="time.json",
                          no_stall_check=True, thread_affinity="2,3", timeout=45, log_level="DEBUG")
    assert cli_job("-np", "2", "--timeout", "9", "--config-file", str(config), "true").timeout == 9.0


def test_every_flag_has_a_place_in_the_job_or_is_listed_as_leaving_none():
    destinations = {action.dest for action in build_parser()._actions if action.dest != "help"}
    fields = {field.name for field in dataclasses.fields(JobSpec)}
    assert destinations - fields == set(NOT_IN_THE_JOB)
    assert fields <= destinations, "a JobSpec field no flag sets"
