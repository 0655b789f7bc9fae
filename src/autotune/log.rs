//! The autotune log (`RVOD_AUTOTUNE_LOG`), written by rank 0: a CSV file with one row per sample, then a
//! closing line that starts with `# best:` (CSV readers that skip `#` comments skip it).
//!
//! Columns: `sample` (0, 1, ...), `phase` (`warm-up`, `defaults`, `bayes`, `categorical`), the values
//! tried (`fusion_threshold_bytes`, `cycle_time_ms`, `cache_enabled`, `hierarchical_allreduce`,
//! `hierarchical_allgather`; the last two `auto` when the executor chooses), the measurement (`steps`,
//! `bytes`, `seconds`, `score_bytes_per_s`: the median of the sample's pieces, see
//! [`crate::autotune::manager`]), `chosen_because` (why these values were tried: warm-up, the defaults, an
//! initial probe, the expected improvement that picked them, a sweep step: the baseline at the best point,
//! the defaults again, a categorical knob flipped) and
//! `next` (why the next sample's values were chosen, the same words as the next row's `chosen_because`).
//! Rows are flushed as they are written, so the file is readable while the job runs.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::protocol::tuned::TunedValues;

pub const HEADER: &str = "sample,phase,fusion_threshold_bytes,cycle_time_ms,cache_enabled,hierarchical_allreduce,\
hierarchical_allgather,steps,bytes,seconds,score_bytes_per_s,chosen_because,next";

/// One measured sample.
pub struct SampleRow<'a> {
    pub index: usize,
    pub phase: &'a str,
    pub values: &'a TunedValues,
    pub steps: usize,
    pub bytes: u64,
    pub seconds: f64,
    pub score: f64,
    pub chosen_because: &'a str,
    pub next: &'a str,
}

pub struct TuneLog {
    out: BufWriter<File>,
}

fn choice(c: Option<bool>) -> &'static str {
    match c {
        None => "auto",
        Some(true) => "true",
        Some(false) => "false",
    }
}

/// The values as `name=value` words, for the closing line and the engine's log.
pub fn describe(v: &TunedValues) -> String {
    format!(
        "fusion_threshold_bytes={} cycle_time_ms={:.3} cache_enabled={} hierarchical_allreduce={} \
         hierarchical_allgather={}",
        v.fusion_threshold,
        v.cycle_time.as_secs_f64() * 1e3,
        v.cache_enabled,
        choice(v.hierarchical_allreduce),
        choice(v.hierarchical_allgather)
    )
}

/// Commas would split a free-text field: they become semicolons.
fn field(text: &str) -> String {
    text.replace([',', '\n'], ";")
}

impl TuneLog {
    pub fn create(path: &Path) -> std::io::Result<TuneLog> {
        let mut out = BufWriter::new(File::create(path)?);
        writeln!(out, "{HEADER}")?;
        out.flush()?;
        Ok(TuneLog { out })
    }

    pub fn sample(&mut self, row: &SampleRow<'_>) -> std::io::Result<()> {
        let v = row.values;
        writeln!(
            self.out,
            "{},{},{},{:.3},{},{},{},{},{},{:.6},{:.1},{},{}",
            row.index,
            row.phase,
            v.fusion_threshold,
            v.cycle_time.as_secs_f64() * 1e3,
            v.cache_enabled,
            choice(v.hierarchical_allreduce),
            choice(v.hierarchical_allgather),
            row.steps,
            row.bytes,
            row.seconds,
            row.score,
            field(row.chosen_because),
            field(row.next)
        )?;
        self.out.flush()
    }

    pub fn best(&mut self, line: &str) -> std::io::Result<()> {
        writeln!(self.out, "# best: {line}")?;
        self.out.flush()
    }
}
