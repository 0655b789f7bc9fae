"""rvodrun --mpi: the ranks start through Open MPI's mpirun instead of ssh, and meet at rvodrun's store.

mpirun places the ranks as rvodrun would (`-H host:slots,... -map-by slot` fills hosts in order) and tags
their output itself (`--tag-output`). Each rank runs `python -m rvod.runner.mpi_rank COMMAND`, which reads
its rank from Open MPI's environment and its place in the job from the layout rvodrun computed, then becomes
COMMAND. The job's settings and secret travel as `-x NAME` (the value comes from mpirun's environment, so
the secret is never on a command line). rvodrun keeps serving the store until mpirun ends, and passes
SIGINT, SIGTERM and SIGHUP on to it. `rvod.run(use_mpi=True)` starts its ranks the same way
(`run_mpirun` inside its own job).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys

from rvod.runner import store
from rvod.runner.cli import engine_env
from rvod.runner.ssh import forwarded_environment

LAYOUT_VARIABLE = "RVOD_MPI_LAYOUT"


def mpirun_command(options: argparse.Namespace, plan, env_names: list[str], command: list[str]) -> list[str]:
    """The mpirun command line (horovodrun's Open MPI flags) for `plan`."""
    hosts = ",".join(f"{name}:{count}" for name, count in _layout(plan))
    args = ["mpirun", "--allow-run-as-root", "--tag-output", "-np", str(len(plan.slots)), "-H", hosts]
    args += shlex.split(options.binding_args) if options.binding_args else ["-bind-to", "none", "-map-by", "slot"]
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
    if options.output_dir:
        args += ["--output-filename", options.output_dir]
    if options.prefix_timestamp:
        args += ["--timestamp-output"]
    if options.mpi_args:
        args += shlex.split(options.mpi_args)
    for name in env_names:
        args += ["-x", name]
    return args + [sys.executable, "-m", "rvod.runner.mpi_rank", *command]


def _layout(plan) -> list[tuple[str, int]]:
    """(host, ranks on it) in placement order."""
    counts: dict[str, int] = {}
    for slot in plan.slots:
        counts[slot.hostname] = counts.get(slot.hostname, 0) + 1
    return list(counts.items())


MISSING_MPIRUN = ("starts the ranks with mpirun, which is not installed here (install Open MPI, or leave it "
                  "out: rvod starts ranks on other hosts over ssh itself)")


def run_mpirun(job, command: list[str]) -> int:
    """Runs `command` as every rank of `job` (whose store is serving) through mpirun; returns the job's exit
    status and sets `job.failure` when mpirun fails."""
    options, plan = job.options, job.plan
    env = forwarded_environment(os.environ)
    env.update(engine_env(options))
    env.update({
        "RVOD_RENDEZVOUS_ADDR": plan.rendezvous_addr,
        "RVOD_RENDEZVOUS_PORT": str(job.port),
        "RVOD_SECRET": job.secret.hex(),
        LAYOUT_VARIABLE: ",".join(f"{name}:{count}" for name, count in _layout(plan)),
        "PYTHONUNBUFFERED": "1",
    })
    names = sorted(name for name in env if name.isidentifier())
    args = mpirun_command(options, plan, names, command)
    if options.verbose:
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


def run_with_mpirun(options: argparse.Namespace, plan, command: list[str]) -> int:
    from rvod.runner.launch import Job

    if shutil.which("mpirun") is None:
        print(f"rvodrun: --mpi {MISSING_MPIRUN}", file=sys.stderr)
        return 1
    job = Job(options, plan)
    try:
        with job:
            return run_mpirun(job, command)
    except store.StoreUnavailable as error:
        print(f"rvodrun: {error}", file=sys.stderr)
        return 1
