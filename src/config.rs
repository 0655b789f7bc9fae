//! Every knob of the engine, read once from the environment into one [`Config`] that is passed down.
//!
//! Each `RVOD_X` variable also accepts Horovod's name `HOROVOD_X` (the `RVOD_` name wins when both are
//! set). Values that do not parse are reported as errors naming the variable, rather than silently
//! becoming 0 as in Horovod.

use std::time::Duration;

use crate::launched::{BindAddress, LaunchEnv, LaunchPlan};
use crate::types::{AlgorithmOverrides, Named};

/// Where this rank sits in the job and how to reach the others.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    pub rank: usize,
    pub size: usize,
    pub local_rank: usize,
    pub local_size: usize,
    pub cross_rank: usize,
    pub cross_size: usize,
    pub hostname: String,
}

/// How this rank joins the job: the rendezvous store and the job's secret. `None` for a job of size 1.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendezvous {
    pub addr: String,
    pub port: u16,
    pub secret: Vec<u8>,
    /// How this rank picks the address its data listeners bind to and advertise.
    pub bind: BindAddress,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub topology: Topology,
    pub rendezvous: Option<Rendezvous>,
    /// Largest fused buffer in bytes; 0 disables fusion.
    pub fusion_threshold: usize,
    /// How long a busy engine waits to batch more work before starting a negotiation round.
    pub cycle_time: Duration,
    /// Response cache entries per process set; 0 disables the cache.
    pub cache_capacity: usize,
    /// A peer that makes no progress for this long is declared dead.
    pub timeout: Duration,
    /// How long `init()` waits for the rendezvous store and the other ranks to show up.
    pub start_timeout: Duration,
    /// Warn about collectives some ranks never submitted after this long; `None` disables the check.
    pub stall_check: Option<Duration>,
    /// Fail collectives stalled longer than this (only if longer than `stall_check`).
    pub stall_shutdown: Option<Duration>,
    /// `RVOD_ELASTIC_HUNG_TIMEOUT`, in an elastic job only (`None` elsewhere, or when set to 0): a rank that
    /// has not submitted a collective the others have waited on for this long is reported hung (see
    /// [`elastic_hung_timeout`]).
    pub elastic_hung_timeout: Option<Duration>,
    /// `tracing` filter for the engine's log (`warning` by default).
    pub log_level: String,
    /// Ranks on one host talk through shared memory (`RVOD_SHM`, on unless 0).
    pub shm: bool,
    /// Where shared-memory segments are created (`RVOD_SHM_DIR`, default /dev/shm).
    pub shm_dir: std::path::PathBuf,
    /// `RVOD_BUFFER_POOL_MB`: how much freed result memory is kept for reuse (see `crate::memory`); 0: none.
    pub buffer_pool_bytes: usize,
    /// The core this rank's engine threads are pinned to (`RVOD_THREAD_AFFINITY`: one core id per local
    /// rank, this rank's by its local rank); `None`: not pinned.
    pub thread_affinity: Option<usize>,
    /// `RVOD_HIERARCHICAL_ALLREDUCE` / `RVOD_HIERARCHICAL_ALLGATHER`: `Some` forces the hierarchical
    /// algorithm on or off where a communicator spans hosts; `None` lets the executor choose.
    pub hierarchical_allreduce: Option<bool>,
    pub hierarchical_allgather: Option<bool>,
    /// `RVOD_ALLREDUCE_ALGORITHM`, `RVOD_ALLGATHER_ALGORITHM`, `RVOD_BROADCAST_ALGORITHM`: the flat algorithm
    /// each collective runs; `auto` (the default, `None`) chooses by size and number of ranks (see
    /// [`crate::ring::choice`]).
    pub collective_algorithms: AlgorithmOverrides,
    /// `RVOD_COMPRESSION_WITHIN_HOST`: compressed allreduces (`hvd.Compression.int8`, `.onebit`,
    /// `.powersgd`) compress inside one host's shared memory too; by default they are exact there, since
    /// memory is faster than the compression, and compress only between hosts.
    pub compression_within_host: bool,
    /// `RVOD_COMPRESSION_WARMUP_STEPS`: each compressed tensor is reduced exactly for its first this many
    /// allreduces (default 0).
    pub compression_warmup_steps: u64,
    /// `RVOD_NEGOTIATION`: how a communicator's ranks combine their round headers: `auto` (default: every
    /// rank sends its header to every other rank on small communicators, a tree on larger ones, see
    /// `coordinator::tree`), `all_to_all` or `tree` (forced, for tests and benchmarks).
    pub negotiation: Negotiation,
    /// `RVOD_CONNECTIONS`: when a communicator's TCP connections are made: `auto` (default: all at set-up on
    /// small communicators, each when first needed on larger ones, see `engine::connect`), `full_mesh` or
    /// `on_demand` (forced).
    pub connections: Connections,
    /// Process sets may be added and removed after init (`RVOD_DYNAMIC_PROCESS_SETS`, Horovod's flag rule:
    /// on when > 0; also turned on by `init(process_sets="dynamic")`).
    pub dynamic_process_sets: bool,
    /// Set when a launcher other than rvodrun started this multi-rank job (see `crate::launch`): rank 0
    /// serves the store and `rendezvous` is filled in when the ranks meet.
    pub launch: Option<LaunchPlan>,
    /// `RVOD_TIMELINE`: the Chrome-trace file every rank records into, or [`crate::timeline::DYNAMIC`]
    /// (recording only between `start_timeline()` and `stop_timeline()`); `None`: those functions raise.
    pub timeline: Option<String>,
    /// `RVOD_TIMELINE_MARK_CYCLES`: mark each negotiation round with `CYCLE_START`.
    pub timeline_mark_cycles: bool,
    /// `RVOD_METRICS_PORT`: each rank serves Prometheus metrics at this port plus its local rank.
    pub metrics_port: Option<u16>,
    /// `RVOD_ELASTIC_ROUND`: the world an elastic job's driver assigned this rank to. Ranks meet in the
    /// store under this round instead of their own count of inits, so a rank started for a re-formed world
    /// meets ranks that have been through several; `None` outside elastic jobs.
    pub elastic_round: Option<u64>,
    /// `RVOD_AUTOTUNE`: tune the knobs the user left unset while the job runs (see [`crate::autotune`]).
    pub autotune: Option<AutotuneConfig>,
    /// Where the CUDA runtime and NCCL come from and how GPU tensors travel (see [`crate::gpu`]).
    pub gpu: GpuConfig,
    /// What carries bytes between hosts (`RVOD_TRANSPORT`) and where libucp comes from.
    pub hosts: HostsConfig,
}

/// `RVOD_NEGOTIATION`: how the ranks of a communicator combine their round headers. rvod's own setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Negotiation {
    /// All-to-all on small communicators, a tree on larger ones.
    #[default]
    Auto,
    /// Every rank sends its header to every other rank (small data rides along).
    AllToAll,
    /// Headers combined by recursive doubling; requests gathered and responses broadcast along trees.
    Tree,
}

/// `RVOD_CONNECTIONS`: when the TCP connections between a communicator's ranks are made. rvod's own setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Connections {
    /// A full mesh at set-up on small communicators, connections on demand on larger ones.
    #[default]
    Auto,
    /// Every pair of ranks connected at set-up.
    FullMesh,
    /// A pair connected when an operation first needs it.
    OnDemand,
}

/// `RVOD_TRANSPORT`: what carries bytes between hosts (inside a host, shared memory stays rvod's own).
/// Horovod has no such setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostsTransport {
    /// UCX where every member's UCX reports an RDMA-capable transport (InfiniBand, RoCE), TCP otherwise.
    #[default]
    Auto,
    /// rvod's own TCP.
    Tcp,
    /// UCX, with whatever transports it has (also TCP and shared memory); an error where it cannot be loaded.
    Ucx,
}

impl HostsTransport {
    pub fn name(self) -> &'static str {
        match self {
            HostsTransport::Auto => "auto",
            HostsTransport::Tcp => "tcp",
            HostsTransport::Ucx => "ucx",
        }
    }
}

/// The knobs of the links between hosts, read by `init()` with the rest and on their own
/// ([`HostsConfig::from_env`]) for `rvodrun --check-build`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostsConfig {
    /// `RVOD_TRANSPORT`: `auto` (default), `tcp` or `ucx`.
    pub transport: HostsTransport,
    /// `RVOD_UCX_LIBRARY`: the libucp to load (a path); when set, nothing else is tried.
    pub ucx_library: Option<std::path::PathBuf>,
    /// Which of the settings rvod gives UCX over TCP ([`UCX_TUNED_SETTINGS`]) the user
    /// set in UCX's own environment (`UCX_<name>`): UCX reads them, and rvod changes no setting the user gave
    /// (see `transport::ucx::library::Ucx::new_context`).
    pub ucx_settings_set: Vec<&'static str>,
}

impl HostsConfig {
    /// These knobs alone, from the process environment.
    pub fn from_env() -> Result<HostsConfig, ConfigError> {
        hosts_config(&EnvReader { lookup: |name: &str| std::env::var(name).ok() })
    }
}

/// `RVOD_GPU_TRANSPORT`: how collectives on GPU tensors travel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuTransport {
    /// NCCL where every member of the process set has a GPU of its own, host staging otherwise.
    #[default]
    Auto,
    /// NCCL only: an error where NCCL cannot serve the process set.
    Nccl,
    /// Always through pinned host memory and rvod's shared-memory or TCP collectives.
    Host,
}

impl GpuTransport {
    pub fn name(self) -> &'static str {
        match self {
            GpuTransport::Auto => "auto",
            GpuTransport::Nccl => "nccl",
            GpuTransport::Host => "host",
        }
    }
}

/// The GPU knobs. They are read by `init()` with the rest, and also on their own
/// ([`GpuConfig::from_env`]) when `nccl_built()` or `rvodrun --check-build` asks before any `init()`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuConfig {
    /// `RVOD_GPU_TRANSPORT`: `auto` (default), `nccl` or `host`.
    pub transport: GpuTransport,
    /// `RVOD_NCCL_LIBRARY`: the NCCL library to load (a path); when set, nothing else is tried.
    pub nccl_library: Option<std::path::PathBuf>,
    /// `RVOD_CUDA_LIBRARY`: the CUDA runtime library (libcudart) to load; when set, nothing else is tried.
    pub cuda_library: Option<std::path::PathBuf>,
    /// `RVOD_ENABLE_ASYNC_COMPLETION` (Horovod's flag rule; off by default, as Horovod's): an op through
    /// NCCL completes as soon as its work is queued on the GPU, not once it has run (see
    /// `engine::execute_nccl`).
    pub async_completion: bool,
}

impl GpuConfig {
    /// The GPU knobs alone, from the process environment.
    pub fn from_env() -> Result<GpuConfig, ConfigError> {
        gpu_config(&EnvReader { lookup: |name: &str| std::env::var(name).ok() })
    }
}

/// How the autotuner samples (`RVOD_AUTOTUNE_*`, Horovod's defaults) and which knobs the user pinned.
#[derive(Clone, Debug, PartialEq)]
pub struct AutotuneConfig {
    /// `RVOD_AUTOTUNE_LOG`: the CSV file rank 0 writes, one row per sample.
    pub log: Option<std::path::PathBuf>,
    /// `RVOD_AUTOTUNE_WARMUP_SAMPLES`: samples measured and discarded before tuning starts.
    pub warmup_samples: usize,
    /// `RVOD_AUTOTUNE_STEPS_PER_SAMPLE`: steps (see [`crate::autotune`]) each sample spans.
    pub steps_per_sample: usize,
    /// `RVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`: samples spent on fusion threshold and cycle time.
    pub bayes_opt_max_samples: usize,
    /// `RVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE`: the Gaussian process's noise, in [0, 1].
    pub gaussian_process_noise: f64,
    /// Knobs whose variable is set: they keep the user's value.
    pub fixed: FixedKnobs,
}

/// Which tunable knobs the user set explicitly (their variable is present).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FixedKnobs {
    pub fusion_threshold: bool,
    pub cycle_time: bool,
    pub cache: bool,
    pub hierarchical_allreduce: bool,
    pub hierarchical_allgather: bool,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("invalid environment variable {name}={value:?}: {reason}")]
pub struct ConfigError {
    pub name: String,
    pub value: String,
    pub reason: String,
}

/// Longest duration a setting in seconds can ask for (about 31 years): far beyond any job, far below where
/// `Instant + Duration` overflows.
const MAX_SECONDS: f64 = 1e9;
pub const DEFAULT_FUSION_THRESHOLD: usize = 128 * 1024 * 1024;
pub const DEFAULT_CYCLE_TIME_MS: f64 = 1.0;
pub const DEFAULT_CACHE_CAPACITY: usize = 1024;
pub const DEFAULT_TIMEOUT_SECONDS: f64 = 60.0;
pub const DEFAULT_STALL_CHECK_SECONDS: f64 = 60.0;
/// `RVOD_ELASTIC_HUNG_TIMEOUT` when unset: this, or half of `RVOD_TIMEOUT` when that is shorter, so a hung
/// rank is found before the transports' own time-out ends the round.
pub const DEFAULT_ELASTIC_HUNG_SECONDS: f64 = 30.0;
pub const DEFAULT_AUTOTUNE_WARMUP_SAMPLES: usize = 3;
pub const DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE: usize = 10;
pub const DEFAULT_AUTOTUNE_BAYES_OPT_MAX_SAMPLES: usize = 20;
pub const DEFAULT_AUTOTUNE_GAUSSIAN_PROCESS_NOISE: f64 = 0.8;

/// A cycle time given in milliseconds at run time (the private `_rvod._set_tuned_values` hook), checked as
/// `RVOD_CYCLE_TIME` is: `None` unless finite and non-negative; capped as that variable is.
pub fn cycle_time_from_ms(ms: f64) -> Option<Duration> {
    (ms.is_finite() && ms >= 0.0).then(|| Duration::from_secs_f64(ms.min(MAX_SECONDS) / 1000.0))
}

/// Reads variables through a lookup function so tests need not touch the process environment.
struct EnvReader<F: Fn(&str) -> Option<String>> {
    lookup: F,
}

impl<F: Fn(&str) -> Option<String>> EnvReader<F> {
    /// The value of `RVOD_<key>`, else `HOROVOD_<key>`, with the name it was found under.
    fn raw(&self, key: &str) -> Option<(String, String)> {
        for prefix in ["RVOD_", "HOROVOD_"] {
            let name = format!("{prefix}{key}");
            if let Some(value) = (self.lookup)(&name) {
                if !value.trim().is_empty() {
                    return Some((name, value.trim().to_string()));
                }
            }
        }
        None
    }

    fn error(name: String, value: String, reason: &str) -> ConfigError {
        ConfigError { name, value, reason: reason.to_string() }
    }

    fn usize(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        match self.raw(key) {
            None => Ok(default),
            Some((name, value)) => {
                value.parse::<usize>().map_err(|_| Self::error(name, value, "expected a non-negative integer"))
            }
        }
    }

    /// A duration in seconds. Values above [`MAX_SECONDS`] (users write `1e12` for "never") are taken as
    /// that, so that turning them into a `Duration` or adding them to an `Instant` cannot overflow.
    fn seconds(&self, key: &str, default: f64) -> Result<f64, ConfigError> {
        match self.raw(key) {
            None => Ok(default),
            Some((name, value)) => match value.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => Ok(v.min(MAX_SECONDS)),
                _ => Err(Self::error(name, value, "expected a non-negative number")),
            },
        }
    }

    /// Horovod's convention: a flag is on when its integer value is > 0.
    fn flag(&self, key: &str) -> Result<bool, ConfigError> {
        self.flag_or(key, false)
    }

    fn flag_or(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.raw(key) {
            None => Ok(default),
            Some((name, value)) => match value.to_ascii_lowercase().as_str() {
                "true" | "yes" | "on" => Ok(true),
                "false" | "no" | "off" => Ok(false),
                other => other
                    .parse::<i64>()
                    .map(|v| v > 0)
                    .map_err(|_| Self::error(name, value, "expected 0/1 or true/false")),
            },
        }
    }

    /// A flag that is either set (on or off) or left to the engine.
    fn optional_flag(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.raw(key) {
            None => Ok(None),
            Some(_) => self.flag(key).map(Some),
        }
    }

    /// A collective's algorithm by name, or `auto` (`None`, also when unset).
    fn algorithm<A: Named>(&self, key: &str) -> Result<Option<A>, ConfigError> {
        match self.raw(key) {
            None => Ok(None),
            Some((name, value)) => A::parse_choice(&value).map_err(|reason| Self::error(name, value, &reason)),
        }
    }

    fn string(&self, key: &str) -> Option<String> {
        self.raw(key).map(|(_, v)| v)
    }
}

fn decode_hex(name: &str, value: &str) -> Result<Vec<u8>, ConfigError> {
    let bad = || ConfigError {
        name: name.to_string(),
        value: "<hidden>".to_string(),
        reason: "expected an even number of hex digits".to_string(),
    };
    if value.len() % 2 != 0 {
        return Err(bad());
    }
    (0..value.len())
        .step_by(2)
        .map(|i| value.get(i..i + 2).and_then(|pair| u8::from_str_radix(pair, 16).ok()).ok_or_else(bad))
        .collect()
}

impl Config {
    /// How long a collective some ranks wait on may go unseen by the coordinator: the stall check time, or
    /// half the elastic hung time when that is shorter (a waiting rank's cache hit reaches the coordinator's
    /// table well before a missing rank is judged hung, so a rank that waits is never mistaken for one that
    /// hangs). `None`: neither check is on.
    pub fn inspect_after(&self) -> Option<Duration> {
        let hung = self.elastic_hung_timeout.map(|d| d / 2);
        match (self.stall_check, hung) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Read the configuration through `lookup` (variable name -> value), given what the launcher's variables
    /// said (`launch::env::detect`; `None`: no launcher other than rvodrun, or none at all). `launch` has the
    /// function that does both from the process environment.
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
        launched: Option<LaunchEnv>,
    ) -> Result<Config, ConfigError> {
        let env = EnvReader { lookup };
        // RVOD_SIZE marks a job rvodrun started (its store is served outside the ranks); what a launcher
        // says only fills in what the RVOD_* variables leave unset.
        let rvodrun_job = env.raw("SIZE").is_some();
        let size = env.usize("SIZE", launched.as_ref().map_or(1, |l| l.size))?.max(1);
        let rank = env.usize("RANK", launched.as_ref().map_or(0, |l| l.rank))?;
        if rank >= size {
            return Err(ConfigError {
                name: "RVOD_RANK".into(),
                value: rank.to_string(),
                reason: format!("rank must be smaller than RVOD_SIZE={size}"),
            });
        }
        let local = launched.as_ref().and_then(|l| l.local);
        let cross = launched.as_ref().and_then(|l| l.cross);
        let topology = Topology {
            rank,
            size,
            local_rank: env.usize("LOCAL_RANK", local.map_or(0, |l| l.0))?,
            local_size: env.usize("LOCAL_SIZE", local.map_or(1, |l| l.1))?.max(1),
            cross_rank: env.usize("CROSS_RANK", cross.map_or(0, |c| c.0))?,
            cross_size: env.usize("CROSS_SIZE", cross.map_or(1, |c| c.1))?.max(1),
            hostname: env.string("HOSTNAME").unwrap_or_else(|| match &launched {
                Some(l) => l.hostname.clone().unwrap_or_else(crate::launched::system_hostname),
                None => "localhost".to_string(),
            }),
        };
        let secret = secret(&env)?;
        let launch = match launched {
            Some(launched) if size > 1 && !rvodrun_job => Some(launch_plan(&env, launched, secret.clone())?),
            _ => None,
        };
        let rendezvous = if size > 1 && launch.is_none() {
            let addr = env.string("RENDEZVOUS_ADDR").ok_or_else(|| ConfigError {
                name: "RVOD_RENDEZVOUS_ADDR".into(),
                value: String::new(),
                reason: format!("RVOD_SIZE={size} but no rendezvous address is set; start the job with rvodrun"),
            })?;
            let port = rendezvous_port(&env)?.map(|(port, _)| port).ok_or_else(|| ConfigError {
                name: "RVOD_RENDEZVOUS_PORT".into(),
                value: "0".into(),
                reason: "expected a port number in 1..65535".into(),
            })?;
            let Some((secret, _)) = secret else {
                return Err(ConfigError {
                    name: "RVOD_SECRET".into(),
                    value: String::new(),
                    reason: "a multi-rank job needs the job secret; start the job with rvodrun".into(),
                });
            };
            Some(Rendezvous { addr, port, secret, bind: bind_address(&env)? })
        } else {
            None
        };
        let stall_disabled = env.flag("STALL_CHECK_DISABLE")?;
        let stall_seconds = env.seconds("STALL_CHECK_TIME_SECONDS", DEFAULT_STALL_CHECK_SECONDS)?;
        let stall_shutdown_seconds = env.seconds("STALL_SHUTDOWN_TIME_SECONDS", 0.0)?;
        let stall_check = (!stall_disabled && stall_seconds > 0.0).then(|| Duration::from_secs_f64(stall_seconds));
        let stall_shutdown = match stall_check {
            Some(check) if stall_shutdown_seconds > check.as_secs_f64() => {
                Some(Duration::from_secs_f64(stall_shutdown_seconds))
            }
            Some(_) if stall_shutdown_seconds > 0.0 => {
                tracing::warn!(
                    "RVOD_STALL_SHUTDOWN_TIME_SECONDS is less than RVOD_STALL_CHECK_TIME_SECONDS, will not shut down."
                );
                None
            }
            _ => None,
        };
        let thread_affinity = thread_affinity(&env, topology.local_rank, topology.local_size)?;
        let timeout_seconds = env.seconds("TIMEOUT", DEFAULT_TIMEOUT_SECONDS)?;
        let timeout_seconds = if timeout_seconds > 0.0 { timeout_seconds } else { DEFAULT_TIMEOUT_SECONDS };
        let start_seconds = env.seconds("START_TIMEOUT", timeout_seconds)?;
        let elastic_round = match env.raw("ELASTIC_ROUND") {
            None => None,
            Some(_) => Some(env.usize("ELASTIC_ROUND", 0)? as u64),
        };
        let hung = hung_timeout(&env, timeout_seconds)?;
        Ok(Config {
            topology,
            rendezvous,
            fusion_threshold: env.usize("FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD)?,
            cycle_time: Duration::from_secs_f64(env.seconds("CYCLE_TIME", DEFAULT_CYCLE_TIME_MS)? / 1000.0),
            cache_capacity: env.usize("CACHE_CAPACITY", DEFAULT_CACHE_CAPACITY)?,
            timeout: Duration::from_secs_f64(timeout_seconds),
            start_timeout: Duration::from_secs_f64(if start_seconds > 0.0 { start_seconds } else { timeout_seconds }),
            stall_check,
            stall_shutdown,
            elastic_hung_timeout: elastic_round.and(hung),
            log_level: log_level(&env),
            shm: env.flag_or("SHM", true)?,
            shm_dir: env.string("SHM_DIR").unwrap_or_else(|| "/dev/shm".to_string()).into(),
            buffer_pool_bytes: env
                .usize("BUFFER_POOL_MB", crate::memory::DEFAULT_POOL_BYTES >> 20)?
                .saturating_mul(1 << 20),
            thread_affinity,
            hierarchical_allreduce: env.optional_flag("HIERARCHICAL_ALLREDUCE")?,
            hierarchical_allgather: env.optional_flag("HIERARCHICAL_ALLGATHER")?,
            collective_algorithms: AlgorithmOverrides {
                allreduce: env.algorithm("ALLREDUCE_ALGORITHM")?,
                allgather: env.algorithm("ALLGATHER_ALGORITHM")?,
                broadcast: env.algorithm("BROADCAST_ALGORITHM")?,
            },
            compression_within_host: env.flag("COMPRESSION_WITHIN_HOST")?,
            compression_warmup_steps: env.usize("COMPRESSION_WARMUP_STEPS", 0)? as u64,
            negotiation: negotiation(&env)?,
            connections: connections(&env)?,
            dynamic_process_sets: env.flag("DYNAMIC_PROCESS_SETS")?,
            launch,
            timeline: env.string("TIMELINE").filter(|path| !path.is_empty()),
            timeline_mark_cycles: env.flag("TIMELINE_MARK_CYCLES")?,
            metrics_port: metrics_port(&env)?,
            elastic_round,
            autotune: autotune(&env)?,
            gpu: gpu_config(&env)?,
            hosts: hosts_config(&env)?,
        })
    }
}

/// `RVOD_ELASTIC_HUNG_TIMEOUT` (seconds; 0 turns the check off) through `lookup`, with its default
/// ([`DEFAULT_ELASTIC_HUNG_SECONDS`], or half of `RVOD_TIMEOUT` when shorter). Read by `init()` in elastic
/// jobs and, on its own, by the elastic driver (which watches the workers' heartbeats with it) and by its
/// workers (which beat with it).
pub fn elastic_hung_timeout(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<Duration>, ConfigError> {
    let env = EnvReader { lookup };
    let timeout_seconds = env.seconds("TIMEOUT", DEFAULT_TIMEOUT_SECONDS)?;
    let timeout_seconds = if timeout_seconds > 0.0 { timeout_seconds } else { DEFAULT_TIMEOUT_SECONDS };
    hung_timeout(&env, timeout_seconds)
}

/// `ELASTIC_HUNG_TIMEOUT`, given the job's `TIMEOUT` in seconds.
fn hung_timeout<F: Fn(&str) -> Option<String>>(
    env: &EnvReader<F>,
    timeout_seconds: f64,
) -> Result<Option<Duration>, ConfigError> {
    let seconds = env.seconds("ELASTIC_HUNG_TIMEOUT", DEFAULT_ELASTIC_HUNG_SECONDS.min(timeout_seconds / 2.0))?;
    Ok((seconds > 0.0).then(|| Duration::from_secs_f64(seconds)))
}

/// `NEGOTIATION`.
fn negotiation<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> Result<Negotiation, ConfigError> {
    Ok(match env.raw("NEGOTIATION") {
        None => Negotiation::Auto,
        Some((name, value)) => match value.to_ascii_lowercase().replace('-', "_").as_str() {
            "auto" => Negotiation::Auto,
            "all_to_all" => Negotiation::AllToAll,
            "tree" => Negotiation::Tree,
            _ => return Err(EnvReader::<F>::error(name, value, "expected auto, all_to_all or tree")),
        },
    })
}

/// `CONNECTIONS`.
fn connections<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> Result<Connections, ConfigError> {
    Ok(match env.raw("CONNECTIONS") {
        None => Connections::Auto,
        Some((name, value)) => match value.to_ascii_lowercase().replace('-', "_").as_str() {
            "auto" => Connections::Auto,
            "full_mesh" => Connections::FullMesh,
            "on_demand" => Connections::OnDemand,
            _ => return Err(EnvReader::<F>::error(name, value, "expected auto, full_mesh or on_demand")),
        },
    })
}

/// UCX's own settings (names in its environment, without `UCX_`) that rvod gives UCX where it has no RDMA
/// transport (`transport::ucx::library::TCP_SETTINGS`, which a test there keeps in step with this list).
pub const UCX_TUNED_SETTINGS: [&str; 2] = ["RNDV_SCHEME", "TCP_SNDBUF"];

/// `TRANSPORT`, `UCX_LIBRARY`, and which of UCX's own settings rvod would tune the user set.
fn hosts_config<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> Result<HostsConfig, ConfigError> {
    let transport = match env.raw("TRANSPORT") {
        None => HostsTransport::Auto,
        Some((name, value)) => match value.to_ascii_lowercase().as_str() {
            "auto" => HostsTransport::Auto,
            "tcp" => HostsTransport::Tcp,
            "ucx" => HostsTransport::Ucx,
            _ => return Err(EnvReader::<F>::error(name, value, "expected auto, tcp or ucx")),
        },
    };
    Ok(HostsConfig {
        transport,
        ucx_library: env.string("UCX_LIBRARY").map(Into::into),
        ucx_settings_set: UCX_TUNED_SETTINGS
            .into_iter()
            .filter(|name| (env.lookup)(&format!("UCX_{name}")).is_some_and(|v| !v.trim().is_empty()))
            .collect(),
    })
}

/// `GPU_TRANSPORT`, `NCCL_LIBRARY`, `CUDA_LIBRARY`, `ENABLE_ASYNC_COMPLETION`.
fn gpu_config<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> Result<GpuConfig, ConfigError> {
    let transport = match env.raw("GPU_TRANSPORT") {
        None => GpuTransport::Auto,
        Some((name, value)) => match value.to_ascii_lowercase().as_str() {
            "auto" => GpuTransport::Auto,
            "nccl" => GpuTransport::Nccl,
            "host" => GpuTransport::Host,
            _ => return Err(EnvReader::<F>::error(name, value, "expected auto, nccl or host")),
        },
    };
    Ok(GpuConfig {
        transport,
        nccl_library: env.string("NCCL_LIBRARY").map(Into::into),
        cuda_library: env.string("CUDA_LIBRARY").map(Into::into),
        async_completion: env.flag("ENABLE_ASYNC_COMPLETION")?,
    })
}

/// `AUTOTUNE` (Horovod's flag rule) and its sampling knobs; the knobs are checked only when it is on.
fn autotune<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> Result<Option<AutotuneConfig>, ConfigError> {
    if !env.flag("AUTOTUNE")? {
        return Ok(None);
    }
    let noise = match env.raw("AUTOTUNE_GAUSSIAN_PROCESS_NOISE") {
        None => DEFAULT_AUTOTUNE_GAUSSIAN_PROCESS_NOISE,
        Some((name, value)) => match value.parse::<f64>() {
            Ok(v) if (0.0..=1.0).contains(&v) => v,
            _ => return Err(EnvReader::<F>::error(name, value, "expected a number in [0, 1]")),
        },
    };
    let set = |key: &str| env.raw(key).is_some();
    Ok(Some(AutotuneConfig {
        log: env.string("AUTOTUNE_LOG").map(Into::into),
        warmup_samples: env.usize("AUTOTUNE_WARMUP_SAMPLES", DEFAULT_AUTOTUNE_WARMUP_SAMPLES)?,
        steps_per_sample: env.usize("AUTOTUNE_STEPS_PER_SAMPLE", DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE)?.max(1),
        bayes_opt_max_samples: env.usize("AUTOTUNE_BAYES_OPT_MAX_SAMPLES", DEFAULT_AUTOTUNE_BAYES_OPT_MAX_SAMPLES)?,
        gaussian_process_noise: noise,
        fixed: FixedKnobs {
            fusion_threshold: set("FUSION_THRESHOLD"),
            cycle_time: set("CYCLE_TIME"),
            cache: set("CACHE_CAPACITY"),
            hierarchical_allreduce: set("HIERARCHICAL_ALLREDUCE"),
            hierarchical_allgather: set("HIERARCHICAL_ALLGATHER"),
        },
    }))
}

/// `IFACE_ADDR` (an IP address), else `NETWORK_INTERFACE` or Horovod's `HOROVOD_GLOO_IFACE` (comma-separated
/// NIC names), else automatic.
fn bind_address<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> Result<BindAddress, ConfigError> {
    if let Some((name, value)) = env.raw("IFACE_ADDR") {
        return value
            .parse()
            .map(BindAddress::Explicit)
            .map_err(|_| EnvReader::<F>::error(name, value, "expected an IP address"));
    }
    let nics = env.raw("NETWORK_INTERFACE").or_else(|| {
        (env.lookup)("HOROVOD_GLOO_IFACE").filter(|v| !v.trim().is_empty()).map(|v| ("HOROVOD_GLOO_IFACE".into(), v))
    });
    match nics {
        Some((name, value)) => {
            let names: Vec<String> = value.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect();
            if names.is_empty() {
                return Err(EnvReader::<F>::error(name, value, "expected comma-separated network interface names"));
            }
            Ok(BindAddress::Interfaces(names))
        }
        None => Ok(BindAddress::Auto),
    }
}

/// `RENDEZVOUS_PORT` with the name it was found under; 0 or out of range is an error naming the variable.
fn rendezvous_port<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> Result<Option<(u16, String)>, ConfigError> {
    let Some((name, value)) = env.raw("RENDEZVOUS_PORT") else { return Ok(None) };
    match value.parse::<u16>() {
        Ok(port) if port != 0 => Ok(Some((port, name))),
        _ => Err(EnvReader::<F>::error(name, value, "expected a port number in 1..65535")),
    }
}

/// `METRICS_PORT`: the first of the ports the ranks of a host serve metrics at (each adds its local rank).
fn metrics_port<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> Result<Option<u16>, ConfigError> {
    let Some((name, value)) = env.raw("METRICS_PORT") else { return Ok(None) };
    match value.parse::<u16>() {
        Ok(port) if port != 0 => Ok(Some(port)),
        _ => Err(EnvReader::<F>::error(name, value, "expected a port number in 1..65535")),
    }
}

/// The job's secret: `SECRET` (hex digits), else the hex digits in the 0600 file `SECRET_FILE`.
fn secret<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> Result<Option<(Vec<u8>, String)>, ConfigError> {
    if let Some((name, value)) = env.raw("SECRET") {
        return Ok(Some((decode_hex(&name, &value)?, name)).filter(|(secret, _)| !secret.is_empty()));
    }
    let Some((name, path)) = env.raw("SECRET_FILE") else { return Ok(None) };
    let secret = crate::private_file::read_secret(std::path::Path::new(&path))
        .map_err(|reason| EnvReader::<F>::error(name.clone(), path, &reason))?;
    Ok(Some((secret, name)))
}

/// Shortest secret accepted for a job a launcher started (rvodrun makes 32-byte ones).
const MIN_LAUNCH_SECRET_BYTES: usize = 16;

/// How a job a launcher started meets: the launcher's hints, overridden by the user's RVOD_* settings.
fn launch_plan<F: Fn(&str) -> Option<String>>(
    env: &EnvReader<F>,
    launched: LaunchEnv,
    secret: Option<(Vec<u8>, String)>,
) -> Result<LaunchPlan, ConfigError> {
    if let Some((bytes, name)) = &secret {
        if bytes.len() < MIN_LAUNCH_SECRET_BYTES {
            return Err(ConfigError {
                name: name.clone(),
                value: "<hidden>".into(),
                reason: format!(
                    "the secret is {} bytes; use at least {MIN_LAUNCH_SECRET_BYTES} (e.g. `openssl rand -hex 32`)",
                    bytes.len()
                ),
            });
        }
    }
    let both_set = |a: &str, b: &str| env.raw(a).is_some() && env.raw(b).is_some();
    Ok(LaunchPlan {
        launcher: launched.launcher,
        run_key: launched.run_key,
        one_host: launched.one_host,
        store_host: env.raw("RENDEZVOUS_ADDR").map(|(name, host)| (host, name)).or(launched.store_host),
        store_port: rendezvous_port(env)?.or(launched.store_port),
        secret,
        insecure: env.flag("INSECURE_RENDEZVOUS")?,
        iface_addr: env.string("IFACE_ADDR"),
        data_bind: bind_address(env)?,
        local_known: launched.local.is_some() || both_set("LOCAL_RANK", "LOCAL_SIZE"),
        cross_known: launched.cross.is_some() || both_set("CROSS_RANK", "CROSS_SIZE"),
    })
}

fn log_level<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> String {
    env.string("LOG_LEVEL").unwrap_or_else(|| "warning".to_string())
}

/// The log level alone (`RVOD_LOG_LEVEL` / `HOROVOD_LOG_LEVEL`), so logging can start before the rest of the
/// configuration is read and what reading it logs is seen.
pub fn log_level_from_env() -> String {
    log_level(&EnvReader { lookup: |name: &str| std::env::var(name).ok() })
}

/// Whether log lines leave out the time (`RVOD_LOG_HIDE_TIME` / `HOROVOD_LOG_HIDE_TIME`, rvodrun's
/// --log-without-timestamp); read with the log level, before the rest of the configuration. A value that is
/// not a flag shows the time.
pub fn log_hide_time_from_env() -> bool {
    EnvReader { lookup: |name: &str| std::env::var(name).ok() }.flag("LOG_HIDE_TIME").unwrap_or(false)
}

/// `THREAD_AFFINITY`: comma-separated core ids, entry `local_rank` for this rank. As in Horovod, fewer
/// entries than local ranks is logged as an error and pins nothing; an entry that is not a core id is an
/// error naming the variable.
fn thread_affinity<F: Fn(&str) -> Option<String>>(
    env: &EnvReader<F>,
    local_rank: usize,
    local_size: usize,
) -> Result<Option<usize>, ConfigError> {
    let Some((name, value)) = env.raw("THREAD_AFFINITY") else { return Ok(None) };
    let cores = value
        .split(',')
        .map(|entry| entry.trim().parse::<usize>())
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| EnvReader::<F>::error(name.clone(), value.clone(), "expected comma-separated core ids"))?;
    if cores.len() < local_size {
        tracing::error!(
            "{name}={value:?} names {} core(s) for {local_size} local ranks (one per local rank is needed); \
             engine threads are not pinned",
            cores.len()
        );
        return Ok(None);
    }
    Ok(cores.get(local_rank).copied())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(move |name| map.get(name).cloned(), None)
    }

    #[test]
    fn elastic_hung_timeout_acts_in_elastic_jobs_only() {
        let secs = |s: f64| Some(Duration::from_secs_f64(s));
        assert_eq!(config(&[("RVOD_ELASTIC_HUNG_TIMEOUT", "5")]).unwrap().elastic_hung_timeout, None);
        let elastic = |vars: &[(&str, &str)]| {
            let mut all = vec![("RVOD_ELASTIC_ROUND", "1")];
            all.extend_from_slice(vars);
            config(&all)
        };
        assert_eq!(elastic(&[]).unwrap().elastic_hung_timeout, secs(30.0));
        assert_eq!(elastic(&[("RVOD_TIMEOUT", "20")]).unwrap().elastic_hung_timeout, secs(10.0));
        assert_eq!(elastic(&[("RVOD_ELASTIC_HUNG_TIMEOUT", "2.5")]).unwrap().elastic_hung_timeout, secs(2.5));
        assert_eq!(elastic(&[("RVOD_ELASTIC_HUNG_TIMEOUT", "0")]).unwrap().elastic_hung_timeout, None);
        let err = elastic(&[("RVOD_ELASTIC_HUNG_TIMEOUT", "soon")]).unwrap_err();
        assert_eq!((err.name.as_str(), err.value.as_str()), ("RVOD_ELASTIC_HUNG_TIMEOUT", "soon"));
        assert!(err.to_string().contains("invalid environment variable RVOD_ELASTIC_HUNG_TIMEOUT=\"soon\""));
        // Outside a job's init (the driver, the workers' heartbeat) the same value, elastic or not.
        let lookup = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
        };
        assert_eq!(elastic_hung_timeout(lookup(&[])).unwrap(), secs(30.0));
        assert_eq!(elastic_hung_timeout(lookup(&[("RVOD_TIMEOUT", "8")])).unwrap(), secs(4.0));
        assert_eq!(
            elastic_hung_timeout(lookup(&[("RVOD_ELASTIC_HUNG_TIMEOUT", "-1")])).unwrap_err().name,
            "RVOD_ELASTIC_HUNG_TIMEOUT"
        );
    }

    #[test]
    fn inspection_comes_by_the_stall_time_or_half_the_hung_time() {
        let c = config(&[("RVOD_ELASTIC_ROUND", "1"), ("RVOD_ELASTIC_HUNG_TIMEOUT", "4")]).unwrap();
        assert_eq!(c.inspect_after(), Some(Duration::from_secs(2)));
        let c = config(&[("RVOD_ELASTIC_ROUND", "1"), ("RVOD_STALL_CHECK_DISABLE", "1")]).unwrap();
        assert_eq!(c.inspect_after(), Some(Duration::from_secs(15)));
        assert_eq!(config(&[]).unwrap().inspect_after(), Some(Duration::from_secs(60)));
        assert_eq!(config(&[("RVOD_STALL_CHECK_DISABLE", "1")]).unwrap().inspect_after(), None);
    }

    #[test]
    fn elastic_round_is_read_when_set() {
        assert_eq!(config(&[]).unwrap().elastic_round, None);
        assert_eq!(config(&[("RVOD_ELASTIC_ROUND", "7")]).unwrap().elastic_round, Some(7));
        assert_eq!(config(&[("RVOD_ELASTIC_ROUND", "x")]).unwrap_err().name, "RVOD_ELASTIC_ROUND");
    }

    #[test]
    fn thread_affinity_takes_this_local_ranks_entry() {
        assert_eq!(config(&[]).unwrap().thread_affinity, None);
        let two = [("RVOD_LOCAL_SIZE", "2"), ("RVOD_LOCAL_RANK", "1"), ("HOROVOD_THREAD_AFFINITY", "3, 5")];
        assert_eq!(config(&two).unwrap().thread_affinity, Some(5));
        let three = [("RVOD_LOCAL_SIZE", "3"), ("RVOD_LOCAL_RANK", "0"), ("RVOD_THREAD_AFFINITY", "3,5")];
        assert_eq!(config(&three).unwrap().thread_affinity, None, "too few entries pin nothing");
        let bad = config(&[("RVOD_THREAD_AFFINITY", "0,x")]).unwrap_err();
        assert_eq!((bad.name.as_str(), bad.value.as_str()), ("RVOD_THREAD_AFFINITY", "0,x"));
        assert!(bad.reason.contains("core ids"), "{bad}");
    }

    #[test]
    fn dynamic_process_sets_follow_the_flag_rule() {
        assert!(!config(&[]).unwrap().dynamic_process_sets);
        for (name, value, on) in [
            ("RVOD_DYNAMIC_PROCESS_SETS", "1", true),
            ("HOROVOD_DYNAMIC_PROCESS_SETS", "2", true),
            ("RVOD_DYNAMIC_PROCESS_SETS", "true", true),
            ("RVOD_DYNAMIC_PROCESS_SETS", "0", false),
            ("HOROVOD_DYNAMIC_PROCESS_SETS", "-1", false),
        ] {
            assert_eq!(config(&[(name, value)]).unwrap().dynamic_process_sets, on, "{name}={value}");
        }
        let bad = config(&[("HOROVOD_DYNAMIC_PROCESS_SETS", "maybe")]).unwrap_err();
        assert_eq!((bad.name.as_str(), bad.value.as_str()), ("HOROVOD_DYNAMIC_PROCESS_SETS", "maybe"));
    }

    #[test]
    fn timeline_settings() {
        let c = config(&[]).unwrap();
        assert_eq!((c.timeline, c.timeline_mark_cycles), (None, false));
        let c = config(&[("HOROVOD_TIMELINE", "/tmp/t.json"), ("HOROVOD_TIMELINE_MARK_CYCLES", "1")]).unwrap();
        assert_eq!((c.timeline.as_deref(), c.timeline_mark_cycles), (Some("/tmp/t.json"), true));
        assert_eq!(config(&[("RVOD_TIMELINE", "DYNAMIC")]).unwrap().timeline.as_deref(), Some("DYNAMIC"));
        assert_eq!(config(&[("RVOD_TIMELINE", "")]).unwrap().timeline, None);
        assert_eq!(config(&[("RVOD_TIMELINE_MARK_CYCLES", "x")]).unwrap_err().name, "RVOD_TIMELINE_MARK_CYCLES");
    }

    #[test]
    fn defaults_are_a_single_rank_job() {
        let c = config(&[]).unwrap();
        assert_eq!(c.topology.size, 1);
        assert_eq!(c.topology.rank, 0);
        assert!(c.rendezvous.is_none());
        assert_eq!(c.fusion_threshold, DEFAULT_FUSION_THRESHOLD);
        assert_eq!(c.cycle_time, Duration::from_millis(1));
        assert_eq!(c.cache_capacity, 1024);
        assert_eq!(c.timeout, Duration::from_secs(60));
        assert_eq!(c.start_timeout, Duration::from_secs(60));
        let c = config(&[("RVOD_TIMEOUT", "5"), ("HOROVOD_START_TIMEOUT", "30")]).unwrap();
        assert_eq!((c.timeout, c.start_timeout), (Duration::from_secs(5), Duration::from_secs(30)));
        assert_eq!(c.stall_check, Some(Duration::from_secs(60)));
        assert_eq!(c.stall_shutdown, None);
    }

    #[test]
    fn huge_durations_are_capped_instead_of_overflowing() {
        // Finite and non-negative, so accepted; before the cap, 1e300 made Duration::from_secs_f64 panic and
        // 1e18 made every `Instant::now() + timeout` panic.
        for huge in ["1e300", "1e18", "18446744073709551616"] {
            let c = config(&[
                ("RVOD_TIMEOUT", huge),
                ("RVOD_START_TIMEOUT", huge),
                ("RVOD_STALL_CHECK_TIME_SECONDS", huge),
                ("RVOD_CYCLE_TIME", huge),
            ])
            .unwrap();
            let cap = Duration::from_secs_f64(MAX_SECONDS);
            assert_eq!((c.timeout, c.start_timeout, c.stall_check), (cap, cap, Some(cap)), "{huge}");
            assert_eq!(c.cycle_time, cap / 1000, "{huge}");
            assert!(std::time::Instant::now().checked_add(c.timeout).is_some(), "{huge}");
        }
    }

    #[test]
    fn a_cycle_time_set_at_run_time_is_checked_and_capped_as_the_variable_is() {
        assert_eq!(cycle_time_from_ms(0.2), Some(Duration::from_micros(200)));
        assert_eq!(cycle_time_from_ms(0.0), Some(Duration::ZERO));
        assert_eq!(cycle_time_from_ms(1e300), Some(Duration::from_secs_f64(MAX_SECONDS) / 1000));
        for bad in [-1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(cycle_time_from_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn horovod_names_are_aliases_and_rvod_names_win() {
        let c = config(&[("HOROVOD_FUSION_THRESHOLD", "1024"), ("HOROVOD_CACHE_CAPACITY", "7")]).unwrap();
        assert_eq!(c.fusion_threshold, 1024);
        assert_eq!(c.cache_capacity, 7);
        let c = config(&[("HOROVOD_FUSION_THRESHOLD", "1024"), ("RVOD_FUSION_THRESHOLD", "0")]).unwrap();
        assert_eq!(c.fusion_threshold, 0);
    }

    #[test]
    fn multi_rank_job_needs_rendezvous_and_secret() {
        let err = config(&[("RVOD_SIZE", "2"), ("RVOD_RANK", "1")]).unwrap_err();
        assert_eq!(err.name, "RVOD_RENDEZVOUS_ADDR");
        let err = config(&[
            ("RVOD_SIZE", "2"),
            ("RVOD_RANK", "1"),
            ("RVOD_RENDEZVOUS_ADDR", "127.0.0.1"),
            ("RVOD_RENDEZVOUS_PORT", "4000"),
        ])
        .unwrap_err();
        assert_eq!(err.name, "RVOD_SECRET");
        let c = config(&[
            ("RVOD_SIZE", "2"),
            ("RVOD_RANK", "1"),
            ("RVOD_RENDEZVOUS_ADDR", "127.0.0.1"),
            ("RVOD_RENDEZVOUS_PORT", "4000"),
            ("RVOD_SECRET", "00ff10"),
        ])
        .unwrap();
        let r = c.rendezvous.unwrap();
        assert_eq!(r.port, 4000);
        assert_eq!(r.secret, vec![0, 255, 16]);
        assert_eq!(r.bind, BindAddress::Auto);
    }

    #[test]
    fn bind_address_is_explicit_then_interfaces_then_automatic() {
        let job = [
            ("RVOD_SIZE", "2"),
            ("RVOD_RENDEZVOUS_ADDR", "192.0.2.1"),
            ("RVOD_RENDEZVOUS_PORT", "4000"),
            ("RVOD_SECRET", "00ff10"),
        ];
        let with = |extra: &[(&'static str, &'static str)]| {
            let vars: Vec<(&str, &str)> = job.iter().chain(extra).copied().collect();
            config(&vars)
        };
        let bind = |extra: &[(&'static str, &'static str)]| with(extra).unwrap().rendezvous.unwrap().bind;
        assert_eq!(bind(&[("HOROVOD_GLOO_IFACE", "eth1")]), BindAddress::Interfaces(vec!["eth1".into()]));
        assert_eq!(
            bind(&[("RVOD_NETWORK_INTERFACE", "eth0, ib0"), ("HOROVOD_GLOO_IFACE", "eth1")]),
            BindAddress::Interfaces(vec!["eth0".into(), "ib0".into()])
        );
        assert_eq!(
            bind(&[("RVOD_IFACE_ADDR", "192.0.2.7"), ("RVOD_NETWORK_INTERFACE", "eth0")]),
            BindAddress::Explicit("192.0.2.7".parse().unwrap())
        );
        assert_eq!(with(&[("RVOD_IFACE_ADDR", "eth0")]).unwrap_err().name, "RVOD_IFACE_ADDR");
        assert_eq!(with(&[("RVOD_NETWORK_INTERFACE", " , ")]).unwrap_err().name, "RVOD_NETWORK_INTERFACE");
    }

    #[test]
    fn connections_are_auto_unless_forced() {
        assert_eq!(config(&[]).unwrap().connections, Connections::Auto);
        assert_eq!(config(&[("RVOD_CONNECTIONS", "on-demand")]).unwrap().connections, Connections::OnDemand);
        assert_eq!(config(&[("RVOD_CONNECTIONS", "FULL_MESH")]).unwrap().connections, Connections::FullMesh);
        let err = config(&[("RVOD_CONNECTIONS", "lazy")]).unwrap_err();
        assert_eq!(
            (err.name.as_str(), err.reason.as_str()),
            ("RVOD_CONNECTIONS", "expected auto, full_mesh or on_demand")
        );
    }

    #[test]
    fn negotiation_is_auto_unless_forced() {
        assert_eq!(config(&[]).unwrap().negotiation, Negotiation::Auto);
        assert_eq!(config(&[("RVOD_NEGOTIATION", "tree")]).unwrap().negotiation, Negotiation::Tree);
        assert_eq!(config(&[("RVOD_NEGOTIATION", "All-To-All")]).unwrap().negotiation, Negotiation::AllToAll);
        let err = config(&[("RVOD_NEGOTIATION", "star")]).unwrap_err();
        assert_eq!((err.name.as_str(), err.reason.as_str()), ("RVOD_NEGOTIATION", "expected auto, all_to_all or tree"));
    }

    #[test]
    fn hierarchical_knobs_force_or_leave_the_choice() {
        let c = config(&[]).unwrap();
        assert_eq!((c.hierarchical_allreduce, c.hierarchical_allgather), (None, None));
        let c = config(&[("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"), ("RVOD_HIERARCHICAL_ALLGATHER", "0")]).unwrap();
        assert_eq!((c.hierarchical_allreduce, c.hierarchical_allgather), (Some(true), Some(false)));
        let err = config(&[("RVOD_HIERARCHICAL_ALLGATHER", "sometimes")]).unwrap_err();
        assert_eq!(err.name, "RVOD_HIERARCHICAL_ALLGATHER");
    }

    #[test]
    fn algorithm_knobs_force_an_algorithm_or_leave_the_choice() {
        use crate::types::{AllgatherAlgorithm, AllreduceAlgorithm, BroadcastAlgorithm};
        assert_eq!(config(&[]).unwrap().collective_algorithms, AlgorithmOverrides::default());
        let c = config(&[
            ("RVOD_ALLREDUCE_ALGORITHM", "rabenseifner"),
            ("RVOD_ALLGATHER_ALGORITHM", "Bruck"),
            ("RVOD_BROADCAST_ALGORITHM", "auto"),
        ])
        .unwrap();
        let want = AlgorithmOverrides {
            allreduce: Some(AllreduceAlgorithm::Rabenseifner),
            allgather: Some(AllgatherAlgorithm::Bruck),
            broadcast: None,
        };
        assert_eq!(c.collective_algorithms, want);
        let c = config(&[("RVOD_ALLREDUCE_ALGORITHM", "recursive_doubling"), ("RVOD_BROADCAST_ALGORITHM", "chain")]);
        let c = c.unwrap().collective_algorithms;
        assert_eq!(c.allreduce, Some(AllreduceAlgorithm::RecursiveDoubling));
        assert_eq!(c.broadcast, Some(BroadcastAlgorithm::Chain));
        let err = config(&[("RVOD_ALLREDUCE_ALGORITHM", "tree")]).unwrap_err();
        assert_eq!(err.name, "RVOD_ALLREDUCE_ALGORITHM");
        assert_eq!(err.reason, "expected one of auto, recursive_doubling, rabenseifner, ring");
        let err = config(&[("RVOD_ALLGATHER_ALGORITHM", "ring2")]).unwrap_err();
        assert_eq!(
            (err.name.as_str(), err.reason.as_str()),
            ("RVOD_ALLGATHER_ALGORITHM", "expected one of auto, bruck, ring")
        );
        let err = config(&[("RVOD_BROADCAST_ALGORITHM", "ring")]).unwrap_err();
        assert_eq!(
            (err.name.as_str(), err.reason.as_str()),
            ("RVOD_BROADCAST_ALGORITHM", "expected one of auto, tree, chain")
        );
    }

    #[test]
    fn shared_memory_is_on_unless_disabled() {
        assert!(config(&[]).unwrap().shm);
        assert!(!config(&[("RVOD_SHM", "0")]).unwrap().shm);
        assert_eq!(config(&[("RVOD_SHM", "maybe")]).unwrap_err().name, "RVOD_SHM");
        assert_eq!(config(&[]).unwrap().shm_dir, std::path::PathBuf::from("/dev/shm"));
        assert_eq!(config(&[("RVOD_SHM_DIR", "/tmp/x")]).unwrap().shm_dir, std::path::PathBuf::from("/tmp/x"));
    }

    #[test]
    fn bad_values_name_the_variable() {
        let err = config(&[("RVOD_CYCLE_TIME", "fast")]).unwrap_err();
        assert_eq!(err.name, "RVOD_CYCLE_TIME");
        assert!(err.to_string().contains("fast"));
        let err = config(&[("HOROVOD_FUSION_THRESHOLD", "-1")]).unwrap_err();
        assert_eq!(err.name, "HOROVOD_FUSION_THRESHOLD");
        let err = config(&[("RVOD_RANK", "3"), ("RVOD_SIZE", "2")]).unwrap_err();
        assert!(err.reason.contains("smaller"));
    }

    #[test]
    fn autotune_settings() {
        assert_eq!(config(&[]).unwrap().autotune, None);
        assert_eq!(config(&[("RVOD_AUTOTUNE", "0"), ("RVOD_AUTOTUNE_WARMUP_SAMPLES", "x")]).unwrap().autotune, None);
        let a = config(&[("HOROVOD_AUTOTUNE", "1")]).unwrap().autotune.unwrap();
        assert_eq!(
            (a.log, a.warmup_samples, a.steps_per_sample, a.bayes_opt_max_samples, a.gaussian_process_noise),
            (None, 3, 10, 20, 0.8)
        );
        assert_eq!(a.fixed, FixedKnobs::default());
        let a = config(&[
            ("RVOD_AUTOTUNE", "true"),
            ("HOROVOD_AUTOTUNE_LOG", "/tmp/a.csv"),
            ("RVOD_AUTOTUNE_WARMUP_SAMPLES", "0"),
            ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "4"),
            ("RVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "9"),
            ("RVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0.25"),
            ("HOROVOD_FUSION_THRESHOLD", "1048576"),
            ("RVOD_CACHE_CAPACITY", "16"),
        ])
        .unwrap()
        .autotune
        .unwrap();
        assert_eq!(a.log, Some(std::path::PathBuf::from("/tmp/a.csv")));
        assert_eq!((a.warmup_samples, a.steps_per_sample, a.bayes_opt_max_samples), (0, 4, 9));
        assert_eq!(a.gaussian_process_noise, 0.25);
        assert_eq!(
            a.fixed,
            FixedKnobs { fusion_threshold: true, cache: true, ..FixedKnobs::default() },
            "only the knobs whose variable is present are fixed"
        );
        let bad = config(&[("RVOD_AUTOTUNE", "1"), ("RVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "1.5")]).unwrap_err();
        assert_eq!((bad.name.as_str(), bad.value.as_str()), ("RVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "1.5"));
        let bad = config(&[("RVOD_AUTOTUNE", "1"), ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "-2")]).unwrap_err();
        assert_eq!(bad.name, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE");
        assert_eq!(config(&[("RVOD_AUTOTUNE", "often")]).unwrap_err().name, "RVOD_AUTOTUNE");
    }

    #[test]
    fn gpu_settings() {
        assert_eq!(config(&[]).unwrap().gpu, GpuConfig::default());
        assert_eq!(config(&[]).unwrap().hosts, HostsConfig::default());
        let ucx = config(&[("RVOD_TRANSPORT", "UCX"), ("RVOD_UCX_LIBRARY", "/opt/ucx/libucp.so.0")]).unwrap().hosts;
        assert_eq!((ucx.transport, ucx.ucx_library), (HostsTransport::Ucx, Some("/opt/ucx/libucp.so.0".into())));
        assert!(ucx.ucx_settings_set.is_empty());
        let users = config(&[("UCX_RNDV_SCHEME", "get_zcopy"), ("UCX_TCP_SNDBUF", "1m"), ("UCX_TLS", "tcp")]).unwrap();
        assert_eq!(users.hosts.ucx_settings_set, ["RNDV_SCHEME", "TCP_SNDBUF"]);
        assert_eq!(config(&[("UCX_TCP_SNDBUF", " ")]).unwrap().hosts.ucx_settings_set, Vec::<&str>::new());
        assert_eq!(config(&[("RVOD_TRANSPORT", "tcp")]).unwrap().hosts.transport, HostsTransport::Tcp);
        let bad = config(&[("RVOD_TRANSPORT", "rdma")]).unwrap_err().to_string();
        assert_eq!(bad, "invalid environment variable RVOD_TRANSPORT=\"rdma\": expected auto, tcp or ucx");
        assert_eq!(GpuConfig::default().transport, GpuTransport::Auto);
        let c = config(&[
            ("RVOD_GPU_TRANSPORT", "Host"),
            ("RVOD_NCCL_LIBRARY", "/opt/nccl/lib/libnccl.so.2"),
            ("HOROVOD_CUDA_LIBRARY", "/usr/lib/libcudart.so.12"),
        ])
        .unwrap();
        assert_eq!(c.gpu.transport, GpuTransport::Host);
        assert_eq!(c.gpu.nccl_library, Some("/opt/nccl/lib/libnccl.so.2".into()));
        assert_eq!(c.gpu.cuda_library, Some("/usr/lib/libcudart.so.12".into()));
        assert_eq!(config(&[("RVOD_GPU_TRANSPORT", "nccl")]).unwrap().gpu.transport, GpuTransport::Nccl);
        assert_eq!(config(&[("RVOD_GPU_TRANSPORT", "auto")]).unwrap().gpu.transport, GpuTransport::Auto);
        assert!(!c.gpu.async_completion);
        assert!(config(&[("HOROVOD_ENABLE_ASYNC_COMPLETION", "1")]).unwrap().gpu.async_completion);
        assert!(
            !config(&[("RVOD_ENABLE_ASYNC_COMPLETION", "0"), ("HOROVOD_ENABLE_ASYNC_COMPLETION", "1")])
                .unwrap()
                .gpu
                .async_completion
        );
        let bad = config(&[("RVOD_ENABLE_ASYNC_COMPLETION", "sometimes")]).unwrap_err();
        assert_eq!(
            bad.to_string(),
            "invalid environment variable RVOD_ENABLE_ASYNC_COMPLETION=\"sometimes\": expected 0/1 or true/false"
        );
        let bad = config(&[("RVOD_GPU_TRANSPORT", "mpi")]).unwrap_err();
        assert_eq!((bad.name.as_str(), bad.value.as_str()), ("RVOD_GPU_TRANSPORT", "mpi"));
        assert!(bad.reason.contains("auto, nccl or host"), "{bad}");
    }

    #[test]
    fn stall_settings() {
        let c = config(&[("RVOD_STALL_CHECK_DISABLE", "1")]).unwrap();
        assert_eq!(c.stall_check, None);
        let c = config(&[("RVOD_STALL_CHECK_TIME_SECONDS", "2"), ("RVOD_STALL_SHUTDOWN_TIME_SECONDS", "5")]).unwrap();
        assert_eq!(c.stall_check, Some(Duration::from_secs(2)));
        assert_eq!(c.stall_shutdown, Some(Duration::from_secs(5)));
        let c = config(&[("RVOD_STALL_CHECK_TIME_SECONDS", "5"), ("RVOD_STALL_SHUTDOWN_TIME_SECONDS", "2")]).unwrap();
        assert_eq!(c.stall_shutdown, None);
    }
}
