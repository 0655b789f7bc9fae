"""rvodrun --mpi: the ranks start through Open MPI's mpirun instead of ssh, and meet at rvodrun's store.

mpirun places the ranks as rvodrun would (`-H host:slots,... -map-by slot` fills hosts in order) and tags
their output itself (`--tag-output`). Each rank runs `python -m rvod.runner.mpi_rank COMMAND`, which reads
its rank from Open MPI's environment and its place in the job from the layout rvodrun computed, then becomes
COMMAND. The job's settings and secret travel as `-x NAME` (the value comes from mpirun's environment, so
the secret is never on a command line). rvodrun keeps serving the store until mpirun ends, and passes
SIGINT, SIGTERM and SIGHUP on to it. `rvod.run(use_mpi=True)` starts its ranks the same way: both run
`run_mpirun` inside a job (rvod.runner.launch.Job) whose store serves.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

from rvod.runner.hosts import Host
from rvod.runner.job import JobSpec
from rvod.runner.ssh import forwarded_environment
from rvod.runner.worker_env import rendezvous_env

LAYOUT_VARIABLE = "RVOD_MPI_LAYOUT"
MISSING_MPIRUN = ("starts the ranks with mpirun, which is not installed here (install Open MPI, or leave it "
                  "out: rvod starts ranks on other hosts over ssh itself)")


def mpirun_command(spec: JobSpec, plan, env_names: list[str], command: list[str]) -> list[str]:
    """The mpirun command line (horovodrun's Open MPI flags) for `plan`."""
    args = ["mpirun", "--allow-run-as-root", "--tag-output", "-np", str(len(plan.slots)), "-H", _layout(plan)]
    args += shlex.split(spec.binding_args) if spec.binding_args else ["-bind-to", "none", "-map-by", "slot"]
    args += ["-mca", "pml", "ob1", "-mca", "btl", "^openib"]
    if plan.nics:
        args += ["-mca", "btl_tcp_if_include", ",".join(plan.nics)]
    ssh_args = []
    if plan.ssh.port is not None:
        ssh_args += ["-p", str(plan.ssh.port)]
    if plan.ssh.identity_file is not None:
        ssh_args += ["-i", plan.ssh.identity_file]
    if plan.ssh.config_file is not None:
        ssh_args += ["-F", plan.ssh.config_file]
    if ssh_args:
        args += ["-mca", "plm_rsh_args", shlex.join(ssh_args)]
    if spec.output_dir:
        args += ["--output-filename", spec.output_dir]
    if spec.prefix_timestamp:
        args += ["--timestamp-output"]
    if spec.mpi_args:
        args += shlex.split(spec.mpi_args)
    for name in env_names:
        args += ["-x", name]
    return args + [sys.executable, "-m", "rvod.runner.mpi_rank", *command]


def _layout(plan) -> str:
    """`host:ranks on it,...` in placement order: mpirun's -H and the ranks' RVOD_MPI_LAYOUT."""
    counts: dict[str, int] = {}
    for slot in plan.slots:
        counts[slot.hostname] = counts.get(slot.hostname, 0) + 1
    return ",".join(f"{name}:{count}" for name, count in counts.items())


def layout_hosts(layout: str) -> list[Host]:
    """The hosts of a job, in placement order, from its RVOD_MPI_LAYOUT (`host:count,...`)."""
    hosts = []
    for entry in layout.split(","):
        name, _, count = entry.rpartition(":")
        hosts.append(Host(name, int(count)))
    return hosts


def run_mpirun(job, command: list[str]) -> int:
    """Runs `command` as every rank of `job` (whose store is serving) through mpirun; returns the job's exit
    status and sets `job.failure` when mpirun fails."""
    spec, plan = job.spec, job.plan
    env = forwarded_environment(os.environ)
    env.update(spec.engine_env())
    env.update(rendezvous_env(plan.rendezvous_addr, job.port, job.secret))
    env[LAYOUT_VARIABLE] = _layout(plan)
    names = sorted(name for name in env if name.isidentifier())
    args = mpirun_command(spec, plan, names, command)
    if spec.verbose:
        print(f"rvodrun: {shlex.join(args)}", file=sys.stderr)
    process = subprocess.Popen(args, env=env, start_new_session=True)
    forward = lambda number, _frame: process.send_signal(number)  # noqa: E731
    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        returncode = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if returncode != 0:
        job.failure = f"mpirun exited with status {returncode}"
        print(f"rvodrun: {job.failure}", file=sys.stderr)
    return returncode if returncode >= 0 else 128 - returncode

