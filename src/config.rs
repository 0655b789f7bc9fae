//! Every knob of the engine, read once from the environment into one [`Config`] that is passed down.
//!
//! Each `RVOD_X` variable also accepts Horovod's name `HOROVOD_X` (the `RVOD_` name wins when both are
//! set). Values that do not parse are reported as errors naming the variable, rather than silently
//! becoming 0 as in Horovod.

use std::time::Duration;

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
    /// Address this rank's data listener binds to and advertises.
    pub bind_addr: String,
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
    /// `tracing` filter for the engine's log (`warning` by default).
    pub log_level: String,
    /// Ranks on one host talk through shared memory (`RVOD_SHM`, on unless 0).
    pub shm: bool,
    /// Where shared-memory segments are created (`RVOD_SHM_DIR`, default /dev/shm).
    pub shm_dir: std::path::PathBuf,
    /// The core this rank's engine threads are pinned to (`RVOD_THREAD_AFFINITY`: one core id per local
    /// rank, this rank's by its local rank); `None`: not pinned.
    pub thread_affinity: Option<usize>,
    /// `RVOD_TIMELINE`: the Chrome-trace file every rank records into, or [`crate::timeline::DYNAMIC`]
    /// (recording only between `start_timeline()` and `stop_timeline()`); `None`: those functions raise.
    pub timeline: Option<String>,
    /// `RVOD_TIMELINE_MARK_CYCLES`: mark each negotiation round with `CYCLE_START`.
    pub timeline_mark_cycles: bool,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("invalid environment variable {name}={value:?}: {reason}")]
pub struct ConfigError {
    pub name: String,
    pub value: String,
    pub reason: String,
}

pub const DEFAULT_FUSION_THRESHOLD: usize = 128 * 1024 * 1024;
pub const DEFAULT_CYCLE_TIME_MS: f64 = 1.0;
pub const DEFAULT_CACHE_CAPACITY: usize = 1024;
pub const DEFAULT_TIMEOUT_SECONDS: f64 = 60.0;
pub const DEFAULT_STALL_CHECK_SECONDS: f64 = 60.0;

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
            Some((name, value)) => value
                .parse::<usize>()
                .map_err(|_| Self::error(name, value, "expected a non-negative integer")),
        }
    }

    fn seconds(&self, key: &str, default: f64) -> Result<f64, ConfigError> {
        match self.raw(key) {
            None => Ok(default),
            Some((name, value)) => match value.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
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
    /// Read the configuration from the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Read the configuration through `lookup` (variable name -> value).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let env = EnvReader { lookup };
        let size = env.usize("SIZE", 1)?.max(1);
        let rank = env.usize("RANK", 0)?;
        if rank >= size {
            return Err(ConfigError {
                name: "RVOD_RANK".into(),
                value: rank.to_string(),
                reason: format!("rank must be smaller than RVOD_SIZE={size}"),
            });
        }
        let local_size = env.usize("LOCAL_SIZE", 1)?.max(1);
        let topology = Topology {
            rank,
            size,
            local_rank: env.usize("LOCAL_RANK", 0)?,
            local_size,
            cross_rank: env.usize("CROSS_RANK", 0)?,
            cross_size: env.usize("CROSS_SIZE", 1)?.max(1),
            hostname: env.string("HOSTNAME").unwrap_or_else(|| "localhost".to_string()),
        };
        let rendezvous = if size > 1 {
            let addr = env.string("RENDEZVOUS_ADDR").ok_or_else(|| ConfigError {
                name: "RVOD_RENDEZVOUS_ADDR".into(),
                value: String::new(),
                reason: format!("RVOD_SIZE={size} but no rendezvous address is set; start the job with rvodrun"),
            })?;
            let port_value = env.usize("RENDEZVOUS_PORT", 0)?;
            let port = u16::try_from(port_value).ok().filter(|p| *p != 0).ok_or_else(|| ConfigError {
                name: "RVOD_RENDEZVOUS_PORT".into(),
                value: port_value.to_string(),
                reason: "expected a port number in 1..65535".into(),
            })?;
            let secret = match env.raw("SECRET") {
                Some((name, value)) => decode_hex(&name, &value)?,
                None => Vec::new(),
            };
            if secret.is_empty() {
                return Err(ConfigError {
                    name: "RVOD_SECRET".into(),
                    value: String::new(),
                    reason: "a multi-rank job needs the job secret; start the job with rvodrun".into(),
                });
            }
            let bind_addr = env.string("IFACE_ADDR").unwrap_or_else(|| "127.0.0.1".to_string());
            Some(Rendezvous { addr, port, secret, bind_addr })
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
            log_level: log_level(&env),
            shm: env.flag_or("SHM", true)?,
            shm_dir: env.string("SHM_DIR").unwrap_or_else(|| "/dev/shm".to_string()).into(),
            thread_affinity,
            timeline: env.string("TIMELINE").filter(|path| !path.is_empty()),
            timeline_mark_cycles: env.flag("TIMELINE_MARK_CYCLES")?,
        })
    }
}

fn log_level<F: Fn(&str) -> Option<String>>(env: &EnvReader<F>) -> String {
    env.string("LOG_LEVEL").unwrap_or_else(|| "warning".to_string())
}

/// The log level alone (`RVOD_LOG_LEVEL` / `HOROVOD_LOG_LEVEL`), so logging can start before the rest of the
/// configuration is read and what reading it logs is seen.
pub fn log_level_from_env() -> String {
    log_level(&EnvReader { lookup: |name: &str| std::env::var(name).ok() })
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
        Config::from_lookup(move |name| map.get(name).cloned())
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
