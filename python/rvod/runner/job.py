"""The job description every part of the runner works from: `JobSpec`, and the engine settings it asks for.

It is built once, from rvodrun's command line (and --config-file) by `rvod.runner.cli.job_from_args`, or from
`rvod.run`'s arguments by `rvod.runner.run_func`; the launcher, the elastic driver and the mpirun launch take
it as it is. Every field's default is horovodrun's: None for a setting the job leaves to the engine (or to a
value the user exported), so that `engine_env` sets only what was asked for.
"""

from __future__ import annotations

import os

from dataclasses import dataclass

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
# The fields (and flags) that make a job elastic: --min-np, --max-np, --host-discovery-script.
ELASTIC_FIELDS = ("min_num_proc", "max_num_proc", "host_discovery_script")
_BYTES_PER_MB = 1024 * 1024


def _format_number(value: float) -> str:
    """Numbers as an engine parses them: whole values without a fractional part."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass(frozen=True)
class JobSpec:
    """One rvod job: what runs, where, how it is launched and supervised, and the engine's settings."""

    # What runs, and where.
    num_proc: int | None = None
    command: tuple[str, ...] = ()
    hosts: str | None = None  # "host:slots,..." (-H)
    hostfile: str | None = None
    nics: tuple[str, ...] = ()  # --network-interface(s), in the order given
    use_mpi: bool = False
    mpi_args: str | None = None
    binding_args: str | None = None
    # Reaching the hosts.
    start_timeout: float | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_config_file: str | None = None
    # Output and supervision.
    verbose: bool = False
    output_dir: str | None = None
    prefix_timestamp: bool = False
    # Elastic training.
    min_num_proc: int | None = None
    max_num_proc: int | None = None
    host_discovery_script: str | None = None
    slots_per_host: int | None = None
    elastic_timeout: float | None = None
    elastic_hung_timeout: float | None = None  # --elastic-hung-timeout: RVOD_ELASTIC_HUNG_TIMEOUT
    reset_limit: int | None = None
    cooldown_range: tuple[int, int] | None = None
    # Engine settings (None: not set by the job).
    fusion_threshold_mb: int | None = None
    cycle_time_ms: float | None = None
    cache_capacity: int | None = None
    timeout: float | None = None  # --timeout, else --gloo-timeout-seconds
    thread_affinity: str | None = None  # comma-separated core ids
    hierarchical_allreduce: bool | None = None
    hierarchical_allgather: bool | None = None
    autotune: bool | None = None
    autotune_log_file: str | None = None
    autotune_warmup_samples: int | None = None
    autotune_steps_per_sample: int | None = None
    autotune_bayes_opt_max_samples: int | None = None
    autotune_gaussian_process_noise: float | None = None
    timeline_filename: str | None = None
    timeline_mark_cycles: bool | None = None
    metrics_port: int | None = None  # --metrics-port: each rank serves Prometheus metrics at this + local rank
    no_stall_check: bool | None = None
    stall_warning_seconds: int | None = None
    stall_shutdown_seconds: int | None = None
    log_level: str | None = None
    log_with_timestamp: bool | None = None
    tcp: bool = False
    transport: str | None = None  # --transport: auto, tcp or ucx (between hosts)

    @property
    def elastic(self) -> bool:
        """Whether workers come and go (any of --min-np, --max-np, --host-discovery-script given)."""
        return any(getattr(self, name) is not None for name in ELASTIC_FIELDS)

    def engine_env(self) -> dict[str, str]:
        """The RVOD_* settings (and NCCL_IB_DISABLE for --tcp, which also means RVOD_TRANSPORT=tcp unless
        --transport says otherwise) this job asks for."""
        env: dict[str, str] = {}
        if self.fusion_threshold_mb is not None:
            env["RVOD_FUSION_THRESHOLD"] = str(self.fusion_threshold_mb * _BYTES_PER_MB)
        if self.cycle_time_ms is not None:
            env["RVOD_CYCLE_TIME"] = _format_number(self.cycle_time_ms)
        if self.cache_capacity is not None:
            env["RVOD_CACHE_CAPACITY"] = str(self.cache_capacity)
        if self.timeout is not None:
            env["RVOD_TIMEOUT"] = _format_number(self.timeout)
        if self.start_timeout is not None:
            env["RVOD_START_TIMEOUT"] = _format_number(self.start_timeout)
        for value, name in ((self.hierarchical_allreduce, "RVOD_HIERARCHICAL_ALLREDUCE"),
                            (self.hierarchical_allgather, "RVOD_HIERARCHICAL_ALLGATHER")):
            if value is not None:
                env[name] = "1" if value else "0"
        if self.timeline_filename is not None:
            env["RVOD_TIMELINE"] = self.timeline_filename
            if self.timeline_mark_cycles is not None:
                env["RVOD_TIMELINE_MARK_CYCLES"] = "1" if self.timeline_mark_cycles else "0"
        if self.metrics_port is not None:
            env["RVOD_METRICS_PORT"] = str(self.metrics_port)
        if self.autotune:
            env["RVOD_AUTOTUNE"] = "1"
            for value, name in ((self.autotune_log_file, "RVOD_AUTOTUNE_LOG"),
                                (self.autotune_warmup_samples, "RVOD_AUTOTUNE_WARMUP_SAMPLES"),
                                (self.autotune_steps_per_sample, "RVOD_AUTOTUNE_STEPS_PER_SAMPLE"),
                                (self.autotune_bayes_opt_max_samples, "RVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES")):
                if value is not None:
                    env[name] = str(value)
            if self.autotune_gaussian_process_noise is not None:
                env["RVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"] = _format_number(self.autotune_gaussian_process_noise)
        if self.elastic_hung_timeout is not None:
            env["RVOD_ELASTIC_HUNG_TIMEOUT"] = _format_number(self.elastic_hung_timeout)
        if self.no_stall_check is not None:
            env["RVOD_STALL_CHECK_DISABLE"] = "1" if self.no_stall_check else "0"
        if self.stall_warning_seconds is not None:
            env["RVOD_STALL_CHECK_TIME_SECONDS"] = str(self.stall_warning_seconds)
        if self.stall_shutdown_seconds is not None:
            env["RVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(self.stall_shutdown_seconds)
        if self.log_level is not None:
            env["RVOD_LOG_LEVEL"] = self.log_level
        elif self.verbose and not any(os.environ.get(name) for name in ("RVOD_LOG_LEVEL", "HOROVOD_LOG_LEVEL")):
            # --verbose also shows the engine's choices (transport between hosts, GPU route per process set,
            # autotune's result), which it logs at INFO; a log level the user set stays.
            env["RVOD_LOG_LEVEL"] = "INFO"
        if self.log_with_timestamp is not None:
            env["RVOD_LOG_HIDE_TIME"] = "0" if self.log_with_timestamp else "1"
        if self.thread_affinity is not None:
            env["RVOD_THREAD_AFFINITY"] = self.thread_affinity
        if self.tcp:
            env["NCCL_IB_DISABLE"] = "1"
        if self.transport is not None or self.tcp:
            env["RVOD_TRANSPORT"] = self.transport or "tcp"
        if self.nics:
            env["RVOD_NETWORK_INTERFACE"] = ",".join(self.nics)
        return env
