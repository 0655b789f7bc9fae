"""The rvodrun command line: its flags, their checks, and the engine settings they become.

Flag names follow horovodrun so existing launch scripts keep working. A tuning flag that is not given
sets nothing, so the engine's default (or a value the user exported) applies.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_BYTES_PER_MB = 1024 * 1024

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


def _format_number(value: float) -> str:
    """Numbers as an engine parses them: whole values without a fractional part."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rvodrun",
        description="Launch a distributed rvod job: one process per rank, output prefixed by rank.",
        usage="rvodrun [-h] [-np N] [-H HOSTS | --hostfile FILE] [options] command [args ...]",
    )
    parser.add_argument("-v", "--version", action="store_true", help="print the rvod version and exit (as horovodrun -v)")
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=_positive_int, metavar="N",
                        help="number of processes (ranks) to start")
    parser.add_argument("-cb", "--check-build", dest="check_build", action="store_true",
                        help="show which frameworks and tensor transports this rvod can use, then exit")
    parser.add_argument("--verbose", action="store_true",
                        help="say what rvodrun does: placement, process ids, exits")
    parser.add_argument("--output-filename", dest="output_dir", metavar="DIR",
                        help="also write each rank's stdout and stderr to DIR/rank.<rank>/{stdout,stderr}")
    parser.add_argument("--start-timeout", dest="start_timeout", type=_non_negative(float), metavar="SECONDS",
                        help="how long ranks may take to start and meet at the rendezvous (RVOD_START_TIMEOUT)")
    parser.add_argument("--disable-cache", dest="disable_cache", action="store_true",
                        help="accepted for horovodrun compatibility; local jobs cache nothing")

    hosts = parser.add_argument_group("hosts").add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help='hosts and their slots, e.g. "localhost:4" (default: localhost:<np>)')
    hosts.add_argument("-hostfile", "--hostfile", metavar="FILE",
                       help='file with one "<host> slots=<n>" per line')

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

    timeline = parser.add_argument_group("timeline")
    timeline.add_argument("--timeline-filename", dest="timeline_filename", metavar="FILE",
                          help="write a Chrome-trace timeline of the job to FILE")
    timeline.add_argument("--timeline-mark-cycles", dest="timeline_mark_cycles", action="store_true",
                          help="mark every engine cycle in the timeline")

    stall = parser.add_argument_group("stall check")
    stall.add_argument("--no-stall-check", dest="no_stall_check", action="store_true",
                       help="disable the stall inspector")
    stall.add_argument("--stall-check-warning-time-seconds", dest="stall_warning_seconds",
                       type=_non_negative(int), metavar="SECONDS",
                       help="warn about ranks missing from a collective after this long")
    stall.add_argument("--stall-check-shutdown-time-seconds", dest="stall_shutdown_seconds",
                       type=_non_negative(int), metavar="SECONDS",
                       help="fail the job when a collective stalls this long; 0 never")

    logging = parser.add_argument_group("logging")
    logging.add_argument("--log-level", dest="log_level", type=str.upper, choices=LOG_LEVELS,
                         help="engine log level")

    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs, and its arguments")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses and checks the command line; usage errors exit with status 2 through `parser.error`."""
    options = parser.parse_args(argv)
    if options.command[:1] == ["--"]:
        options.command = options.command[1:]
    if options.version or options.check_build:
        return options
    if options.num_proc is None:
        parser.error("-np/--num-proc is required")
    if not options.command:
        parser.error("no command given: rvodrun -np N [options] command [args ...]")
    return options


def engine_env(options: argparse.Namespace) -> dict[str, str]:
    """The RVOD_* settings the given tuning flags ask for."""
    env: dict[str, str] = {}
    if options.fusion_threshold_mb is not None:
        env["RVOD_FUSION_THRESHOLD"] = str(options.fusion_threshold_mb * _BYTES_PER_MB)
    if options.cycle_time_ms is not None:
        env["RVOD_CYCLE_TIME"] = _format_number(options.cycle_time_ms)
    if options.cache_capacity is not None:
        env["RVOD_CACHE_CAPACITY"] = str(options.cache_capacity)
    if options.timeout is not None:
        env["RVOD_TIMEOUT"] = _format_number(options.timeout)
    if options.start_timeout is not None:
        env["RVOD_START_TIMEOUT"] = _format_number(options.start_timeout)
    if options.timeline_filename is not None:
        env["RVOD_TIMELINE"] = options.timeline_filename
    if options.timeline_mark_cycles:
        env["RVOD_TIMELINE_MARK_CYCLES"] = "1"
    if options.no_stall_check:
        env["RVOD_STALL_CHECK_DISABLE"] = "1"
    if options.stall_warning_seconds is not None:
        env["RVOD_STALL_CHECK_TIME_SECONDS"] = str(options.stall_warning_seconds)
    if options.stall_shutdown_seconds is not None:
        env["RVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(options.stall_shutdown_seconds)
    if options.log_level is not None:
        env["RVOD_LOG_LEVEL"] = options.log_level
    if options.thread_affinity is not None:
        env["RVOD_THREAD_AFFINITY"] = options.thread_affinity
    return env
