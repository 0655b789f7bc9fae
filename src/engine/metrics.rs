//! This process's metrics, in Prometheus' text format (served by [`super::metrics_server`] where
//! `RVOD_METRICS_PORT` is set): counters the engine bumps as it runs (relaxed atomics: a few nanoseconds
//! each), kept for the life of the process, across re-inits (elastic resets) and process sets.
//!
//! Names follow Prometheus' conventions: prefix `rvod_`, counters end in `_total`, durations in seconds,
//! sizes in bytes.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::coordinator::lateness::Lateness;
use crate::coordinator::negotiation::CONTROL_MESSAGES_SENT;
use crate::types::CollectiveKind;

const KINDS: [CollectiveKind; 7] = [
    CollectiveKind::Allreduce,
    CollectiveKind::Allgather,
    CollectiveKind::Broadcast,
    CollectiveKind::Alltoall,
    CollectiveKind::Reducescatter,
    CollectiveKind::Barrier,
    CollectiveKind::Join,
];

/// Upper bounds (bytes) of the fused-buffer size histogram's buckets.
const FUSED_BUCKETS: [u64; 8] = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20];

pub struct Metrics {
    ops: [AtomicU64; KINDS.len()],
    bytes: [AtomicU64; KINDS.len()],
    fused: [AtomicU64; FUSED_BUCKETS.len()],
    fused_count: AtomicU64,
    fused_bytes: AtomicU64,
    fused_tensors: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    rounds: AtomicU64,
    negotiation_ns: AtomicU64,
    collective_ns: AtomicU64,
    stall_warnings: AtomicU64,
    inits: AtomicU64,
    elastic_resets: AtomicU64,
    /// The global process set's lateness record and its members' global ranks (the current engine's).
    lateness: Mutex<Option<Arc<Mutex<Lateness>>>>,
}

/// The process's metrics.
pub static METRICS: Metrics = Metrics::new();

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Metrics {
    /// Every counter at zero, no lateness record.
    pub const fn new() -> Metrics {
        Metrics {
            ops: [const { AtomicU64::new(0) }; KINDS.len()],
            bytes: [const { AtomicU64::new(0) }; KINDS.len()],
            fused: [const { AtomicU64::new(0) }; FUSED_BUCKETS.len()],
            fused_count: AtomicU64::new(0),
            fused_bytes: AtomicU64::new(0),
            fused_tensors: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
            negotiation_ns: AtomicU64::new(0),
            collective_ns: AtomicU64::new(0),
            stall_warnings: AtomicU64::new(0),
            inits: AtomicU64::new(0),
            elastic_resets: AtomicU64::new(0),
            lateness: Mutex::new(None),
        }
    }

    /// `tensors` tensors of `kind`, `bytes` in all on this rank, ran.
    pub fn ran(&self, kind: CollectiveKind, tensors: usize, bytes: usize) {
        add(&self.ops[kind as usize], tensors as u64);
        add(&self.bytes[kind as usize], bytes as u64);
    }

    /// `tensors` tensors ran through one fusion buffer of `bytes`.
    pub fn fused(&self, tensors: usize, bytes: usize) {
        let bytes = bytes as u64;
        add(&self.fused_count, 1);
        add(&self.fused_bytes, bytes);
        add(&self.fused_tensors, tensors as u64);
        if let Some(bucket) = FUSED_BUCKETS.iter().position(|&bound| bytes <= bound) {
            add(&self.fused[bucket], 1);
        }
    }

    /// A round ran `hits` response-cache hits and decided `misses` responses the slow way.
    pub fn round(&self, hits: usize, misses: usize, negotiation: Duration) {
        add(&self.cache_hits, hits as u64);
        add(&self.cache_misses, misses as u64);
        add(&self.rounds, 1);
        add(&self.negotiation_ns, nanos(negotiation));
    }

    pub fn collective(&self, took: Duration) {
        add(&self.collective_ns, nanos(took));
    }

    pub fn stall_warning(&self) {
        add(&self.stall_warnings, 1);
    }

    /// The engine started; `lateness` is its global process set's record.
    pub fn started(&self, lateness: Arc<Mutex<Lateness>>) {
        add(&self.inits, 1);
        *self.lateness.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(lateness);
    }

    pub fn elastic_reset(&self) {
        add(&self.elastic_resets, 1);
    }

    /// Everything, in Prometheus' text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let seconds = |c: &AtomicU64| get(c) as f64 / 1e9;
        let mut family = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
            let _ = writeln!(out, "# HELP rvod_{name} {help}\n# TYPE rvod_{name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "rvod_{name}{labels} {value}");
            }
        };
        let by_kind = |counters: &[AtomicU64]| -> Vec<(String, String)> {
            KINDS
                .iter()
                .map(|k| (format!("{{kind=\"{}\"}}", k.name()), get(&counters[*k as usize]).to_string()))
                .collect()
        };
        family("ops_total", "counter", "Tensors run, by collective.", &by_kind(&self.ops));
        family("bytes_total", "counter", "Bytes of tensors run on this rank, by collective.", &by_kind(&self.bytes));
        let mut buckets = Vec::new();
        let mut cumulative = 0;
        for (bound, count) in FUSED_BUCKETS.iter().zip(&self.fused) {
            cumulative += get(count);
            buckets.push((format!("_bucket{{le=\"{bound}\"}}"), cumulative.to_string()));
        }
        buckets.push(("_bucket{le=\"+Inf\"}".into(), get(&self.fused_count).to_string()));
        buckets.push(("_sum".into(), get(&self.fused_bytes).to_string()));
        buckets.push(("_count".into(), get(&self.fused_count).to_string()));
        family("fusion_buffer_bytes", "histogram", "Sizes of the fusion buffers collectives ran through.", &buckets);
        let counters: [(&str, &str, String); 10] = [
            ("fused_tensors_total", "Tensors that ran fused with others.", get(&self.fused_tensors).to_string()),
            (
                "response_cache_hits_total",
                "Collectives agreed through the response cache.",
                get(&self.cache_hits).to_string(),
            ),
            (
                "response_cache_misses_total",
                "Collectives agreed through the coordinator.",
                get(&self.cache_misses).to_string(),
            ),
            ("negotiation_rounds_total", "Negotiation rounds run.", get(&self.rounds).to_string()),
            (
                "negotiation_messages_total",
                "Control messages sent in negotiation rounds (n - 1 per round all-to-all, O(log n) on a tree).",
                CONTROL_MESSAGES_SENT.load(Ordering::Relaxed).to_string(),
            ),
            (
                "negotiation_seconds_total",
                "Time spent in negotiation rounds.",
                seconds(&self.negotiation_ns).to_string(),
            ),
            ("collective_seconds_total", "Time spent running collectives.", seconds(&self.collective_ns).to_string()),
            (
                "stall_warnings_total",
                "Stall warnings (ranks missing for a tensor).",
                get(&self.stall_warnings).to_string(),
            ),
            ("engine_starts_total", "Times this process's engine started (init).", get(&self.inits).to_string()),
            (
                "elastic_resets_total",
                "Elastic resets this process took part in.",
                get(&self.elastic_resets).to_string(),
            ),
        ];
        for (name, help, value) in counters {
            family(name, "counter", help, &[(String::new(), value)]);
        }
        let lateness = self.lateness.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        let report = lateness.map(|l| l.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).report().to_vec());
        let ranks = report.unwrap_or_default();
        let per_rank =
            |value: &dyn Fn(&crate::coordinator::lateness::RankLateness) -> String| -> Vec<(String, String)> {
                ranks.iter().enumerate().map(|(rank, r)| (format!("{{rank=\"{rank}\"}}"), value(r))).collect()
            };
        family(
            "rank_lateness_seconds",
            "gauge",
            "Mean lateness of each rank of the job (how far behind the first it announces what runs).",
            &per_rank(&|r| r.mean_lateness().as_secs_f64().to_string()),
        );
        family(
            "rank_last_total",
            "counter",
            "Decisions in which each rank was last.",
            &per_rank(&|r| r.times_last.to_string()),
        );
        family(
            "rank_straggler",
            "gauge",
            "1 while a rank is named the straggler.",
            &per_rank(&|r| u8::from(r.straggler).to_string()),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_is_prometheus_exposition_with_every_family() {
        let metrics = Metrics::new();
        metrics.ran(CollectiveKind::Allreduce, 3, 4096);
        metrics.fused(3, 4096);
        metrics.fused(1, 1 << 30);
        metrics.round(2, 1, Duration::from_millis(1500));
        metrics.started(Arc::new(Mutex::new(Lateness::new(2))));
        let text = metrics.render();
        assert!(text.contains("# TYPE rvod_ops_total counter\n"), "{text}");
        assert!(text.contains("rvod_ops_total{kind=\"allreduce\"} 3\n"), "{text}");
        assert!(text.contains("rvod_bytes_total{kind=\"allreduce\"} 4096\n"), "{text}");
        assert!(text.contains("rvod_fusion_buffer_bytes_bucket{le=\"1024\"} 0\n"), "{text}");
        assert!(text.contains("rvod_fusion_buffer_bytes_bucket{le=\"16384\"} 1\n"), "{text}");
        assert!(text.contains("rvod_fusion_buffer_bytes_bucket{le=\"+Inf\"} 2\n"), "{text}");
        assert!(text.contains("rvod_fusion_buffer_bytes_count 2\n"), "{text}");
        assert!(text.contains("rvod_response_cache_hits_total 2\n"), "{text}");
        assert!(text.contains("rvod_negotiation_seconds_total 1.5\n"), "{text}");
        assert!(text.contains("rvod_negotiation_rounds_total 1\n"), "{text}");
        assert!(text.contains("# TYPE rvod_negotiation_messages_total counter\n"), "{text}");
        assert!(text.contains("rvod_engine_starts_total 1\n"), "{text}");
        assert!(text.contains("rvod_rank_straggler{rank=\"1\"} 0\n"), "{text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(name.starts_with("rvod_"), "{line}");
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }
}
