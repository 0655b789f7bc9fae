"""horovodrun's --config-file: a YAML file of settings, in Horovod's schema, under the command line.

    controller: gloo | mpi
    params: {fusion_threshold_mb, cycle_time_ms, cache_capacity, hierarchical_allreduce, hierarchical_allgather}
    autotune: {enabled, log_file, warmup_samples, steps_per_sample, bayes_opt_max_samples, gaussian_process_noise}
    timeline: {filename, mark_cycles}
    stall_check: {enabled, warning_time_seconds, shutdown_time_seconds}
    library_options: {mpi_threads_disable, num_nccl_streams, thread_affinity, gloo_timeout_seconds}
    logging: {level, with_timestamp}

A value fills a setting the command line left unset; a flag given on the command line wins, as in
horovodrun. Values get the checks their flags get (`ValueError` naming the file, section and key); a key
or section Horovod does not know is refused rather than silently ignored.
"""

from __future__ import annotations

import argparse
from typing import Any

from rvod.runner.job import LOG_LEVELS

# section -> key -> (options attribute, kind)
_SCHEMA: dict[str, dict[str, tuple[str, str]]] = {
    "params": {
        "fusion_threshold_mb": ("fusion_threshold_mb", "count"),
        "cycle_time_ms": ("cycle_time_ms", "number"),
        "cache_capacity": ("cache_capacity", "count"),
        "hierarchical_allreduce": ("hierarchical_allreduce", "bool"),
        "hierarchical_allgather": ("hierarchical_allgather", "bool"),
        "torus_allreduce": ("torus_allreduce", "bool"),
    },
    "autotune": {
        "enabled": ("autotune", "bool"),
        "log_file": ("autotune_log_file", "text"),
        "warmup_samples": ("autotune_warmup_samples", "count"),
        "steps_per_sample": ("autotune_steps_per_sample", "count"),
        "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", "count"),
        "gaussian_process_noise": ("autotune_gaussian_process_noise", "fraction"),
    },
    "timeline": {
        "filename": ("timeline_filename", "text"),
        "mark_cycles": ("timeline_mark_cycles", "bool"),
    },
    "stall_check": {
        "enabled": ("no_stall_check", "negated bool"),
        "warning_time_seconds": ("stall_warning_seconds", "count"),
        "shutdown_time_seconds": ("stall_shutdown_seconds", "count"),
    },
    "library_options": {
        "mpi_threads_disable": ("mpi_threads_disable", "bool"),
        "num_nccl_streams": ("num_nccl_streams", "count"),
        "thread_affinity": ("thread_affinity", "cores"),
        "gloo_timeout_seconds": ("gloo_timeout_seconds", "number"),
    },
    "logging": {
        "level": ("log_level", "log level"),
        "with_timestamp": ("log_with_timestamp", "bool"),
    },
}


def _convert(value: Any, kind: str, where: str) -> Any:
    """`value` checked and converted for an option of `kind`; ValueError naming `where` otherwise."""
    if kind in ("bool", "negated bool"):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return not value if kind == "negated bool" else value
    if kind == "text":
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    if kind == "log level":
        if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
            raise ValueError(f"{where} must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
        return value.upper()
    if kind == "cores":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"{where} must be a core id or a comma-separated list of them, got {value!r}")
        entries = [entry.strip() for entry in str(value).split(",")]
        if not all(entry.isdigit() for entry in entries):
            raise ValueError(f"{where} must be a core id or a comma-separated list of them, got {value!r}")
        return ",".join(str(int(entry)) for entry in entries)
    whole = isinstance(value, int)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "count" and not whole):
        wanted = "a whole number" if kind == "count" else "a number"
        raise ValueError(f"{where} must be {wanted}, got {value!r}")
    if value < 0:
        raise ValueError(f"{where}={value} must be >= 0")
    if kind == "fraction" and value > 1:
        raise ValueError(f"{where}={value} must be in [0, 1]")
    return value


def _load(path: str) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        raise ValueError("--config-file needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path) as file:
            config = yaml.safe_load(file)
    except OSError as error:
        raise ValueError(f"cannot read config file {path!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"config file {path!r} is not valid YAML: {' '.join(str(error).split())}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"config file {path!r} must be a mapping of sections, got {type(config).__name__}")
    return config


def apply_config_file(options: argparse.Namespace, path: str) -> None:
    """Fills the settings of `options` that the command line left unset from the YAML file at `path`."""
    config = _load(path)
    for section, entries in config.items():
        where = f"config file {path!r}: {section}"
        if section == "controller":
            if not isinstance(entries, str) or entries.lower() not in ("gloo", "mpi"):
                raise ValueError(f"{where} must be gloo or mpi, got {entries!r}")
            if not options.use_gloo and not options.use_mpi:
                options.use_mpi = entries.lower() == "mpi"
                options.use_gloo = not options.use_mpi
            continue
        schema = _SCHEMA.get(section)
        if schema is None:
            raise ValueError(f"{where}: unknown section (Horovod's are controller, {', '.join(_SCHEMA)})")
        if entries is None:
            continue
        if not isinstance(entries, dict):
            raise ValueError(f"{where} must be a mapping, got {entries!r}")
        for key, value in entries.items():
            if key not in schema:
                raise ValueError(f"{where}.{key}: unknown key (known: {', '.join(schema)})")
            attribute, kind = schema[key]
            if value is None or getattr(options, attribute) is not None:
                continue  # unset in the file, or given on the command line
            setattr(options, attribute, _convert(value, kind, f"{where}.{key}"))
