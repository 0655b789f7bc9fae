"""`rvodrun`: reads the command line, places the ranks, starts the rendezvous store, and supervises the job.

Only this machine can host ranks for now; naming another host is a usage error (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
from pathlib import Path

from rvod.runner import store
from rvod.runner.check_build import build_report, package_version
from rvod.runner.cli import build_parser, engine_env, parse_args
from rvod.runner.hosts import Host, Slot, assign_slots, parse_hostfile, parse_hosts, remote_hosts
from rvod.runner.supervisor import Supervisor, WorkerSpec
from rvod.runner.worker_env import worker_env

_SECRET_BYTES = 32


def _hosts(options: argparse.Namespace) -> list[Host]:
    if options.hosts is not None:
        return parse_hosts(options.hosts)
    if options.hostfile is not None:
        return parse_hostfile(options.hostfile)
    return [Host("localhost", options.num_proc)]


def plan_slots(options: argparse.Namespace) -> list[Slot]:
    """Where each rank runs; raises ValueError for hosts or counts that cannot work."""
    hosts = _hosts(options)
    remote = remote_hosts(hosts)
    if remote:
        raise ValueError(
            f"{', '.join(repr(name) for name in remote)}: not this machine. rvodrun only runs jobs on this machine "
            f"for now (multi-host support comes later); use localhost, 127.0.0.1 or {socket.gethostname()}"
        )
    return assign_slots(hosts, options.num_proc)


def _rank_output_dir(root: str, rank: int, size: int) -> Path:
    """`root/rank.<rank>`, zero-padded to the width of the largest rank, as horovodrun names them."""
    return Path(root) / f"rank.{str(rank).zfill(len(str(size - 1)))}"


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
    try:
        slots = plan_slots(options)
    except ValueError as error:
        parser.error(str(error))

    secret = secrets.token_bytes(_SECRET_BYTES)
    try:
        rendezvous = store.start_store(store.LOOPBACK, secret)
    except store.StoreUnavailable as error:
        print(f"rvodrun: {error}", file=sys.stderr)
        return 1
    try:
        if options.verbose:
            print(f"rvodrun: rendezvous store listening on {store.LOOPBACK}:{rendezvous.port}", file=sys.stderr)
            for slot in slots:
                print(f"rvodrun: rank {slot.rank} on {slot.hostname}: local rank {slot.local_rank} of "
                      f"{slot.local_size}, cross rank {slot.cross_rank} of {slot.cross_size}", file=sys.stderr)
        settings = engine_env(options)
        specs = [
            WorkerSpec(
                rank=slot.rank,
                command=options.command,
                env=worker_env(os.environ, slot, rendezvous_addr=store.LOOPBACK, rendezvous_port=rendezvous.port,
                               secret=secret, settings=settings),
                output_dir=_rank_output_dir(options.output_dir, slot.rank, slot.size) if options.output_dir else None,
            )
            for slot in slots
        ]
        return Supervisor(verbose=options.verbose).run(specs)
    finally:
        rendezvous.close()


def run_commandline() -> None:
    """Entry point with horovodrun's name: runs rvodrun and exits with its status."""
    sys.exit(main())
