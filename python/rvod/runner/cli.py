"""The rvodrun command line: its flags, their checks, and the engine settings they become.

Every horovodrun flag is accepted by name, so existing launch scripts keep working: each is honoured, or
refused with a sentence saying why (`REFUSED`, `MPI_ONLY`). A tuning flag that is not given sets nothing
(its value stays None), so a --config-file value, the engine's default, or a value the user exported applies.
`parse_args` checks the command line (--config-file applied); `job_from_args` turns it into the `JobSpec`
the rest of the runner works from.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields
from typing import TypeVar

from rvod.runner.config_file import apply_config_file
from rvod.runner.job import ELASTIC_FIELDS, LOG_LEVELS, JobSpec

Number = TypeVar("Number", int, float)


def _core_list(text: str) -> str:
    """An argparse type for comma-separated core ids (Horovod's `--thread-affinity N` is the one-id case)."""
    entries = [entry.strip() for entry in text.split(",")]
    if not all(entry.isdigit() for entry in entries):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of core ids")
    return ",".join(str(int(entry)) for entry in entries)


def _non_negative(parse: Callable[[str], Number]) -> Callable[[str], Number]:
    """An argparse type that parses with `parse` (int or float) and refuses values below zero."""

    def convert(text: str) -> Number:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {parse.__name__}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text} must be >= 0")
        return value

    return convert


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _network_interfaces(text: str) -> list[str]:
    """--network-interface(s): NIC names, commas splitting a list (both flags accumulate, as horovodrun's)."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of network interface names")
    return names


class _ExtendAction(argparse.Action):
    """Appends the items of each value to one list shared by several flags."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        items += [value for value in values if value not in items]
        setattr(namespace, self.dest, items)


# horovodrun flags that rvodrun accepts but refuses, each with the sentence that says why.
REFUSED = {
    "torus_allreduce": "--torus-allreduce is NCCL's torus allreduce for GPU clusters, which rvod does not have; "
                       "rvod picks its own algorithm (see --hierarchical-allreduce)",
    "num_nccl_streams": "--num-nccl-streams: rvod does not run NCCL operations yet, so there are no NCCL "
                        "streams to set",
    "use_jsrun": "--jsrun launches through LSF's jsrun, which rvodrun does not support; use -H/--hostfile "
                 "(ssh) or --mpi (mpirun)",
}
# Flags that only mean something to mpirun.
MPI_ONLY = {"mpi_args": "--mpi-args", "binding_args": "--binding-args"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rvodrun",
        description="Launch a distributed rvod job: one process per rank, on this machine or on the hosts "
                    "given (reached with ssh), output prefixed by rank. Takes horovodrun's flags.",
        usage="rvodrun [-h] [-np N] [-H HOSTS | --hostfile FILE] [options] command [args ...]",
    )
    parser.add_argument("-v", "--version", action="store_true", help="print the rvod version and exit (as horovodrun -v)")
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=_positive_int, metavar="N",
                        help="number of processes (ranks) to start")
    parser.add_argument("-cb", "--check-build", dest="check_build", action="store_true",
                        help="show which frameworks and tensor transports this rvod can use, then exit")
    parser.add_argument("--verbose", action="store_true",
                        help="say what rvodrun does (placement, addresses, process ids, exits) and what each "
                             "rank's engine chose (transport between hosts, GPU route): its log at INFO unless "
                             "--log-level or RVOD_LOG_LEVEL says otherwise")
    parser.add_argument("--output-filename", dest="output_dir", metavar="DIR",
                        help="also write each rank's stdout and stderr to DIR/rank.<rank>/{stdout,stderr}")
    parser.add_argument("--start-timeout", dest="start_timeout", type=_non_negative(float), metavar="SECONDS",
                        help="how long the ssh checks of the hosts may take, and how long ranks may take to meet "
                             "at the rendezvous (default 30 s for the checks; RVOD_START_TIMEOUT)")
    parser.add_argument("--disable-cache", dest="disable_cache", action="store_true",
                        help="accepted for horovodrun compatibility: rvodrun caches nothing, it checks every host "
                             "on every start")
    parser.add_argument("--network-interfaces", "--network-interface", dest="nics", action=_ExtendAction,
                        type=_network_interfaces, metavar="NIC[,NIC...]",
                        help="network interfaces the job's connections use (repeatable, or comma-separated); "
                             "default: the interface that routes to the other hosts")
    parser.add_argument("--config-file", dest="config_file", metavar="FILE.yaml",
                        help="horovodrun's YAML configuration file; flags given on the command line win")

    ssh = parser.add_argument_group("ssh")
    ssh.add_argument("-p", "--ssh-port", dest="ssh_port", type=_positive_int, metavar="PORT",
                     help="ssh port on every host")
    ssh.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE",
                     help="private key ssh authenticates with")
    ssh.add_argument("--ssh-config-file", dest="ssh_config_file", metavar="FILE",
                     help="ssh client configuration file (ssh -F) for reaching the hosts "
                          "(default: $RVOD_SSH_CONFIG_FILE, else ssh's own)")

    hosts = parser.add_argument_group("hosts").add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help='hosts and their slots, e.g. "server1:4,server2:4" (default: localhost:<np>); '
                            "ranks fill the hosts in order")
    hosts.add_argument("-hostfile", "--hostfile", metavar="FILE",
                       help='file with one "<host> slots=<n>" per line; "#" starts a comment')
    hosts.add_argument("--host-discovery-script", dest="host_discovery_script", metavar="SCRIPT",
                       help="elastic training: a program printing the available hosts, one 'host[:slots]' a "
                            "line; rvodrun reruns it every second and grows or shrinks the job to match")

    controller = parser.add_argument_group("controller").add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="use_gloo", action="store_true",
                            help="accepted: rvod's own TCP and shared-memory transports play Gloo's part")
    controller.add_argument("--mpi", dest="use_mpi", action="store_true",
                            help="start the ranks with Open MPI's mpirun (must be installed) instead of ssh")
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true", help="(LSF's jsrun: not supported)")

    tuning = parser.add_argument_group("tuning")
    tuning.add_argument("--fusion-threshold-mb", dest="fusion_threshold_mb", type=_non_negative(int), metavar="MB",
                        help="tensor fusion buffer size in MB; 0 disables fusion")
    tuning.add_argument("--cycle-time-ms", dest="cycle_time_ms", type=_non_negative(float), metavar="MS",
                        help="engine cycle time in milliseconds")
    tuning.add_argument("--cache-capacity", dest="cache_capacity", type=_non_negative(int), metavar="N",
                        help="response cache entries; 0 disables the cache")
    tuning.add_argument("--timeout", dest="timeout", type=_non_negative(float), metavar="SECONDS",
                        help="seconds before a rank gives up on a dead or silent peer")
    tuning.add_argument("--thread-affinity", dest="thread_affinity", type=_core_list, metavar="CORES",
                        help="pin the engine thread of local rank i to the i-th of these comma-separated core ids "
                             "(RVOD_THREAD_AFFINITY; one id per local rank)")
    for name, what in (("allreduce", "allreduce"), ("allgather", "allgather")):
        choice = tuning.add_mutually_exclusive_group()
        choice.add_argument(f"--hierarchical-{name}", dest=f"hierarchical_{name}", action="store_const", const=True,
                            help=f"force hierarchical {what} (inside each host, then across hosts)")
        choice.add_argument(f"--no-hierarchical-{name}", dest=f"hierarchical_{name}", action="store_const",
                            const=False, help=f"force flat {what}")
    torus = tuning.add_mutually_exclusive_group()
    torus.add_argument("--torus-allreduce", dest="torus_allreduce", action="store_const", const=True,
                       help="(NCCL torus allreduce: not supported)")
    torus.add_argument("--no-torus-allreduce", dest="torus_allreduce", action="store_const", const=False,
                       help="accepted: rvod never uses a torus allreduce")

    autotune = parser.add_argument_group("autotune (tunes the fusion threshold, cycle time, response cache and, "
                                         "across hosts, hierarchical algorithms the job leaves unset; the other "
                                         "flags only apply with --autotune, as in horovodrun)")
    autotune_choice = autotune.add_mutually_exclusive_group()
    autotune_choice.add_argument("--autotune", dest="autotune", action="store_const", const=True,
                                 help="tune while the job runs (RVOD_AUTOTUNE=1)")
    autotune_choice.add_argument("--no-autotune", dest="autotune", action="store_const", const=False,
                                 help=argparse.SUPPRESS)
    autotune.add_argument("--autotune-log-file", dest="autotune_log_file", metavar="FILE",
                          help="CSV file rank 0 writes: one row per sample, then the best values")
    autotune.add_argument("--autotune-warmup-samples", dest="autotune_warmup_samples", type=_non_negative(int),
                          metavar="N", help="samples discarded before tuning (default 3)")
    autotune.add_argument("--autotune-steps-per-sample", dest="autotune_steps_per_sample", type=_non_negative(int),
                          metavar="N", help="steps (reductions of the same tensor) per sample (default 10)")
    autotune.add_argument("--autotune-bayes-opt-max-samples", dest="autotune_bayes_opt_max_samples",
                          type=_non_negative(int), metavar="N",
                          help="samples spent on fusion threshold and cycle time (default 20)")
    autotune.add_argument("--autotune-gaussian-process-noise", dest="autotune_gaussian_process_noise",
                          type=_unit_interval, metavar="F", help="the Gaussian process's noise in [0, 1] (default 0.8)")

    elastic = parser.add_argument_group("elastic training (any of --min-np, --max-np, --host-discovery-script "
                                        "selects it; the script uses rvod's hvd.elastic API)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", type=_positive_int, metavar="N",
                         help="fewest workers the job runs with (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", type=_positive_int, metavar="N",
                         help="most workers the job grows to (default: every slot discovered)")
    elastic.add_argument("--slots-per-host", dest="slots_per_host", type=_positive_int, metavar="N",
                         help="slots of a discovered host whose line gives no count (default 1)")
    elastic.add_argument("--elastic-timeout", dest="elastic_timeout", type=_non_negative(float), metavar="SECONDS",
                         help="how long the job waits for --min-np slots before it fails (default: RVOD_ELASTIC_TIMEOUT "
                              "or HOROVOD_ELASTIC_TIMEOUT, else 600)")
    elastic.add_argument("--elastic-hung-timeout", dest="elastic_hung_timeout", type=_non_negative(float),
                         metavar="SECONDS",
                         help="kill and replace a worker that makes no progress this long: frozen, or blocked in "
                              "the script while the others wait for it (RVOD_ELASTIC_HUNG_TIMEOUT; default 30, or "
                              "half of --timeout if shorter; 0 never)")
    elastic.add_argument("--reset-limit", dest="reset_limit", type=_non_negative(int), metavar="N",
                         help="fail the job instead of resetting it more than N times (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=_non_negative(int), nargs=2,
                         metavar=("MIN", "MAX"),
                         help="a host whose worker failed is left out for a random MIN..MAX seconds (doubling "
                              "with each failure) instead of for good")

    timeline = parser.add_argument_group("timeline")
    timeline.add_argument("--timeline-filename", dest="timeline_filename", metavar="FILE",
                          help="write a Chrome-trace timeline of the job to FILE")
    cycles = timeline.add_mutually_exclusive_group()
    cycles.add_argument("--timeline-mark-cycles", dest="timeline_mark_cycles", action="store_const", const=True,
                        help="mark every engine cycle in the timeline")
    cycles.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_const", const=False,
                        help=argparse.SUPPRESS)

    parser.add_argument_group("metrics").add_argument(
        "--metrics-port", dest="metrics_port", type=_positive_int, metavar="PORT",
        help="each rank serves Prometheus metrics at http://<its host>:PORT+<local rank>/metrics (loopback unless "
             "the job spans hosts; RVOD_METRICS_PORT)")

    stall = parser.add_argument_group("stall check")
    stall_choice = stall.add_mutually_exclusive_group()
    stall_choice.add_argument("--no-stall-check", dest="no_stall_check", action="store_const", const=True,
                              help="disable the stall inspector")
    stall_choice.add_argument("--stall-check", dest="no_stall_check", action="store_const", const=False,
                              help=argparse.SUPPRESS)
    stall.add_argument("--stall-check-warning-time-seconds", dest="stall_warning_seconds",
                       type=_non_negative(int), metavar="SECONDS",
                       help="warn about ranks missing from a collective after this long")
    stall.add_argument("--stall-check-shutdown-time-seconds", dest="stall_shutdown_seconds",
                       type=_non_negative(int), metavar="SECONDS",
                       help="fail the job when a collective stalls this long; 0 never")

    library = parser.add_argument_group("library")
    threads = library.add_mutually_exclusive_group()
    threads.add_argument("--mpi-threads-disable", dest="mpi_threads_disable", action="store_const", const=True,
                         help="accepted: rvod never starts MPI's threads, so there is nothing to disable")
    threads.add_argument("--no-mpi-threads-disable", dest="mpi_threads_disable", action="store_const", const=False,
                         help=argparse.SUPPRESS)
    library.add_argument("--mpi-args", dest="mpi_args", metavar='"ARGS"',
                         help='extra arguments for mpirun (with --mpi), e.g. --mpi-args="--map-by ppr:2:node"')
    library.add_argument("--binding-args", dest="binding_args", metavar='"ARGS"',
                         help="process binding arguments for mpirun (with --mpi)")
    library.add_argument("--tcp", dest="tcp", action="store_true",
                         help="TCP only: sets NCCL_IB_DISABLE=1 and, unless --transport is given, --transport tcp")
    library.add_argument("--transport", dest="transport", choices=("auto", "tcp", "ucx"),
                         help="what carries bytes between hosts (RVOD_TRANSPORT): auto (default: UCX where every "
                              "host's UCX reports RDMA, such as InfiniBand or RoCE, TCP otherwise), tcp, or ucx "
                              "(UCX with whatever transports it has; an error where libucp cannot be loaded)")
    library.add_argument("--num-nccl-streams", dest="num_nccl_streams", type=_non_negative(int), metavar="N",
                         help="(not supported: rvod runs no NCCL operations yet)")
    library.add_argument("--gloo-timeout-seconds", dest="gloo_timeout_seconds", type=_non_negative(float),
                         metavar="SECONDS", help="as --timeout (when --timeout is not given)")

    logging = parser.add_argument_group("logging")
    logging.add_argument("--log-level", dest="log_level", type=str.upper, choices=LOG_LEVELS,
                         help="engine log level")
    stamps = logging.add_mutually_exclusive_group()
    stamps.add_argument("--log-with-timestamp", "--no-log-hide-timestamp", dest="log_with_timestamp",
                        action="store_const", const=True, help=argparse.SUPPRESS)
    stamps.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_with_timestamp",
                        action="store_const", const=False, help="leave the time out of the engine's log lines")
    logging.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_timestamp",
                         action="store_true", help="put the local time in front of every line of the ranks' output")

    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs, and its arguments")
    return parser


def _unit_interval(text: str) -> float:
    value = _non_negative(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} must be in [0, 1]")
    return value


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses and checks the command line (and --config-file); usage errors and refused flags exit with
    status 2 through `parser.error`."""
    options = parser.parse_args(argv)
    if options.command[:1] == ["--"]:
        options.command = options.command[1:]
    if options.config_file is not None:
        try:
            apply_config_file(options, options.config_file)
        except ValueError as error:
            parser.error(str(error))
    if options.version or options.check_build:
        return options
    for dest, sentence in REFUSED.items():
        if getattr(options, dest, None) not in (None, False):
            parser.error(sentence)
    for dest, flag in MPI_ONLY.items():
        if getattr(options, dest) is not None and not options.use_mpi:
            parser.error(f"{flag} is for mpirun, which rvodrun only uses with --mpi; add --mpi to launch "
                         "through mpirun")
    elastic = any(getattr(options, dest) is not None for dest in ELASTIC_FIELDS)
    if options.num_proc is None and not elastic:
        parser.error("-np/--num-proc is required")
    if not options.command:
        parser.error("no command given: rvodrun -np N [options] command [args ...]")
    return options


# Flags that leave no field of their own in the job: those asking for what rvod does anyway (--gloo,
# --disable-cache, --mpi-threads-disable), refused ones (REFUSED), those `main` and `parse_args` act on
# themselves, and --gloo-timeout-seconds, which becomes the job's `timeout`.
NOT_IN_THE_JOB = ("use_gloo", "disable_cache", "mpi_threads_disable", *REFUSED, "version", "check_build",
                  "config_file", "gloo_timeout_seconds")


def job_from_args(options: argparse.Namespace) -> JobSpec:
    """The job a checked command line (`parse_args`, --config-file applied) describes."""
    values = {field.name: getattr(options, field.name) for field in fields(JobSpec)}
    values.update(
        command=tuple(options.command),
        nics=tuple(options.nics or ()),
        cooldown_range=tuple(options.cooldown_range) if options.cooldown_range else None,
        # --gloo-timeout-seconds is horovodrun's other name for --timeout, which wins when both are given.
        timeout=options.timeout if options.timeout is not None else options.gloo_timeout_seconds,
    )
    return JobSpec(**values)
