"""`rvodrun`: reads the command line, places the ranks, checks the hosts, starts the rendezvous store, and
supervises the job.

Ranks on this machine (localhost, 127.0.0.1, or its own name) start directly; ranks on other hosts start
through ssh (see `rvod.runner.ssh` and `rvod.runner.remote`). A one-host job keeps the store on loopback; a
job with other hosts serves it on the address of the first --network-interface, or else on the local address
that routes to the first remote host. Before any rank starts, every remote host is probed in parallel; the
first problem found (unreachable, no rvod, another Python or rvod version, a missing NIC) ends rvodrun with
a line naming the host, and nothing is left running.

The command line becomes a `JobSpec` (rvod.runner.job) once; the placement (`plan_job`), the job (`Job`),
the mpirun launch (rvod.runner.mpi) and the elastic driver (rvod.runner.elastic) all work from it.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rvod.runner import elastic, mpi, network, store
from rvod.runner.check_build import build_report, package_version
from rvod.runner.cli import build_parser, job_from_args, parse_args
from rvod.runner.hosts import Host, Slot, assign_slots, parse_hostfile, parse_hosts, remote_hosts
from rvod.runner.job import JobSpec
from rvod.runner.ssh import HostProblem, SshSettings, forwarded_environment, probe_hosts, remote_python_command
from rvod.runner.supervisor import Supervisor, WorkerSpec
from rvod.runner.worker_env import worker_env

_SECRET_BYTES = 32
DEFAULT_START_TIMEOUT = 30.0


def _hosts(spec: JobSpec) -> list[Host]:
    if spec.hosts is not None:
        return parse_hosts(spec.hosts)
    if spec.hostfile is not None:
        return parse_hostfile(spec.hostfile)
    return [Host("localhost", spec.num_proc)]


def start_timeout(spec: JobSpec) -> float:
    """--start-timeout, else RVOD_START_TIMEOUT / HOROVOD_START_TIMEOUT, else 30 s (horovodrun's default)."""
    if spec.start_timeout is not None:
        return float(spec.start_timeout)
    for name in ("RVOD_START_TIMEOUT", "HOROVOD_START_TIMEOUT"):
        value = os.environ.get(name)
        if value:
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    return DEFAULT_START_TIMEOUT


def resolve_command(command: list[str]) -> list[str]:
    """The command as the ranks run it: a Python script named without an interpreter runs with this Python;
    another file that exists but cannot be executed is refused with a sentence saying so."""
    program = command[0]
    if shutil.which(program) is not None:
        return command
    path = Path(program)
    if not path.is_file():
        return command  # not found: the rank's start reports it
    if path.suffix == ".py":
        return [sys.executable, *command]
    if os.access(path, os.X_OK):
        return [str(path if "/" in program else Path(".") / path), *command[1:]]
    raise ValueError(f"{program!r} is not executable: make it executable (chmod +x) or name its interpreter, "
                     f"e.g. rvodrun -np N python {program}")


@dataclass
class JobPlan:
    """Where every rank runs and how the hosts are reached; made before anything starts."""

    slots: list[Slot]
    remote_hosts: list[str]
    ssh: SshSettings
    rendezvous_addr: str
    rendezvous_reason: str
    start_timeout: float
    nics: list[str] = field(default_factory=list)

    @property
    def multi_host(self) -> bool:
        return len({slot.hostname for slot in self.slots}) > 1 or bool(self.remote_hosts)


def _ssh_settings(spec: JobSpec) -> SshSettings:
    return SshSettings(port=spec.ssh_port, identity_file=spec.ssh_identity_file,
                       config_file=spec.ssh_config_file or os.environ.get("RVOD_SSH_CONFIG_FILE") or None,
                       connect_timeout=start_timeout(spec))


def plan_job(spec: JobSpec) -> JobPlan:
    """Places the ranks and picks the rendezvous address; ValueError (naming the host, line or NIC) for what
    cannot work."""
    hosts = _hosts(spec)
    slots = assign_slots(hosts, spec.num_proc)
    used = {slot.hostname for slot in slots}
    remote = [name for name in remote_hosts(hosts) if name in used]
    ssh = _ssh_settings(spec)
    nics = list(spec.nics)
    nic_addresses = [network.interface_address(nic) for nic in nics]  # a NIC this machine lacks: ValueError
    # An unknown host is named here, before anything starts.
    peers = [network.resolve(ssh.resolved_hostname(name)) for name in remote]
    if not remote:
        rendezvous_addr, why = network.LOOPBACK, "every rank is on this machine"
    elif nic_addresses:
        rendezvous_addr, why = nic_addresses[0], f"the address of --network-interface {nics[0]}"
    else:
        rendezvous_addr = network.route_source(peers[0])
        why = f"this machine's address on the route to {remote[0]} ({peers[0]})"
    return JobPlan(slots=slots, remote_hosts=remote, ssh=ssh, rendezvous_addr=rendezvous_addr,
                   rendezvous_reason=why, start_timeout=ssh.connect_timeout, nics=nics)


def _rank_output_dir(root: str, rank: int, size: int) -> Path:
    """`root/rank.<rank>`, zero-padded to the width of the largest rank, as horovodrun names them."""
    return Path(root) / f"rank.{str(rank).zfill(len(str(size - 1)))}"


class Job:
    """One job: check the hosts, then (as a context manager) serve the rendezvous store while `run` runs
    the ranks. `rvod.run` uses it too, to reach the store before and after the ranks run."""

    def __init__(self, spec: JobSpec, plan: JobPlan):
        self.spec = spec
        self.plan = plan
        self.secret = secrets.token_bytes(_SECRET_BYTES)
        self.failure: str | None = None
        self._store: store.RendezvousStore | None = None

    def check_hosts(self) -> None:
        """Probes every remote host (HostProblem naming the first bad one)."""
        if self.plan.remote_hosts:
            if self.spec.verbose:
                print(f"rvodrun: checking {', '.join(self.plan.remote_hosts)} over ssh", file=sys.stderr)
            probe_hosts(self.plan.ssh, self.plan.remote_hosts, os.environ, self.plan.start_timeout, self.plan.nics)

    @property
    def port(self) -> int:
        assert self._store is not None
        return self._store.port

    def __enter__(self) -> Job:
        self._store = store.start_store(self.plan.rendezvous_addr, self.secret)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def _worker(self, slot: Slot, command: list[str], settings: dict[str, str]) -> WorkerSpec:
        remote = slot.hostname in self.plan.remote_hosts
        base = forwarded_environment(os.environ) if remote else os.environ
        env = worker_env(base, slot, rendezvous_addr=self.plan.rendezvous_addr, rendezvous_port=self.port,
                         secret=self.secret, settings=settings)
        output_dir = self.spec.output_dir
        ssh_command = None
        if remote:
            ssh_command = self.plan.ssh.command(slot.hostname,
                                                remote_python_command(env, ["-m", "rvod.runner.remote"]))
        return WorkerSpec(rank=slot.rank, command=command, env=env, hostname=slot.hostname, ssh_command=ssh_command,
                          output_dir=_rank_output_dir(output_dir, slot.rank, slot.size) if output_dir else None)

    def run(self, command: list[str]) -> int:
        """Runs `command` as every rank and returns the job's exit status (`failure` says what failed)."""
        spec = self.spec
        if spec.verbose:
            print(f"rvodrun: rendezvous store listening on {self.plan.rendezvous_addr}:{self.port} "
                  f"({self.plan.rendezvous_reason})", file=sys.stderr)
            for slot in self.plan.slots:
                print(f"rvodrun: rank {slot.rank} on {slot.hostname}: local rank {slot.local_rank} of "
                      f"{slot.local_size}, cross rank {slot.cross_rank} of {slot.cross_size}", file=sys.stderr)
        settings = spec.engine_env()
        workers = [self._worker(slot, command, settings) for slot in self.plan.slots]
        supervisor = Supervisor(verbose=spec.verbose, name_hosts=self.plan.multi_host,
                                timestamp=spec.prefix_timestamp)
        status = supervisor.run(workers)
        self.failure = supervisor.failure
        return status


def main(argv: list[str] | None = None) -> int:
    """Runs rvodrun with `argv` (default: the process's arguments) and returns its exit status."""
    parser = build_parser()
    options = parse_args(parser, argv)
    if options.version:
        print(f"rvod {package_version()}")
        return 0
    if options.check_build:
        print(build_report())
        return 0
    spec = job_from_args(options)
    if spec.elastic:
        return _run_elastic(parser, spec)
    try:
        plan = plan_job(spec)
        command = resolve_command(list(spec.command))
    except ValueError as error:
        parser.error(str(error))
    job = Job(spec, plan)
    if spec.use_mpi:
        return _run_with_mpirun(job, command)
    try:
        job.check_hosts()
    except HostProblem as error:
        print(f"rvodrun: {error}", file=sys.stderr)
        return 1
    try:
        with job:
            return job.run(command)
    except store.StoreUnavailable as error:
        print(f"rvodrun: {error}", file=sys.stderr)
        return 1


def _run_with_mpirun(job: Job, command: list[str]) -> int:
    """rvodrun --mpi: see rvod.runner.mpi."""
    if shutil.which("mpirun") is None:
        print(f"rvodrun: --mpi {mpi.MISSING_MPIRUN}", file=sys.stderr)
        return 1
    try:
        with job:
            return mpi.run_mpirun(job, command)
    except store.StoreUnavailable as error:
        print(f"rvodrun: {error}", file=sys.stderr)
        return 1


def _run_elastic(parser: argparse.ArgumentParser, spec: JobSpec) -> int:
    """An elastic job (--min-np, --max-np or --host-discovery-script): see rvod.runner.elastic."""
    if spec.use_mpi:
        parser.error("elastic training starts and restarts workers itself; it cannot run under --mpi")
    try:
        driver = elastic_driver(spec, resolve_command(list(spec.command)))
    except ValueError as error:
        parser.error(str(error))
    try:
        return driver.run()
    except store.StoreUnavailable as error:
        print(f"rvodrun: {error}", file=sys.stderr)
        return 1


def elastic_driver(spec: JobSpec, command: list[str]) -> elastic.ElasticDriver:
    """The elastic driver of `spec` running `command` on every worker (ValueError with a sentence for the
    user when the job's settings are wrong)."""
    fixed = None
    if spec.host_discovery_script is None and (spec.hosts is not None or spec.hostfile is not None):
        fixed = _hosts(spec)
    settings = elastic.elastic_settings(spec, fixed)
    for nic in spec.nics:
        network.interface_address(nic)  # a NIC this machine lacks: ValueError
    return elastic.ElasticDriver(settings, elastic.ProcessLauncher(spec, command, _ssh_settings(spec)),
                                 functools.partial(elastic.discover, settings), engine_settings=spec.engine_env(),
                                 verbose=spec.verbose)


def run_commandline() -> None:
    """Entry point with horovodrun's name: runs rvodrun and exits with its status."""
    sys.exit(main())
