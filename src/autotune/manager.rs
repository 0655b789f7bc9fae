//! The parameter manager: rank 0's state machine that measures samples, feeds the optimiser, logs, and
//! decides which values every rank applies next (see the module docs of [`crate::autotune`]).
//!
//! Order of samples: warm-up (discarded) at the defaults; the defaults, measured; then, if the fusion
//! threshold or the cycle time is free, Bayesian optimisation over the free ones (four initial probes, then
//! the points of largest expected improvement) until `RVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES` samples,
//! the defaults included; then a sweep starting from the point the model predicts best: a baseline measured
//! there again (the best of many noisy samples is optimistic), the defaults measured again next to it, then
//! each free categorical knob flipped in turn, kept when it beats the best so far twice (a flip that wins
//! once is measured again right after the best values again, see [`Confirm`]). The best values stay
//! applied, and the closing line compares them with the defaults' latest measurement.
//!
//! A sample's score is the median of the throughputs of its pieces (up to 5, of equal steps), so a burst
//! of load during one piece does not decide it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::autotune::bayesian::BayesianOptimizer;
use crate::autotune::log::{describe, SampleRow, TuneLog};
use crate::config::AutotuneConfig;
use crate::protocol::message::Response;
use crate::protocol::tuned::TunedValues;
use crate::types::CollectiveKind;

/// The tuned fusion threshold's ceiling when no staging area is smaller (Horovod's 64 MB).
pub const MAX_FUSION_THRESHOLD: usize = 64 << 20;
/// Tuned fusion thresholds are multiples of this.
const FUSION_GRANULE: usize = 64 << 10;
/// The cycle times tried, in milliseconds, searched on a log scale.
const CYCLE_MS: (f64, f64) = (0.1, 50.0);
/// Initial probes, in the unit square (fusion threshold, cycle time), as Horovod's four starting points.
const PROBES: [[f64; 2]; 4] = [[0.0625, 0.5], [0.5, 0.85], [0.25, 0.7], [0.125, 0.3]];

/// A continuous knob the optimiser may move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dim {
    Fusion,
    Cycle,
}

/// A categorical knob the sweep may flip, and the value it tries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flip {
    CacheToggle,
    HierarchicalAllreduce(bool),
    HierarchicalAllgather(bool),
}

impl Flip {
    fn apply(self, v: &TunedValues) -> TunedValues {
        let mut v = v.clone();
        match self {
            Flip::CacheToggle => v.cache_enabled = !v.cache_enabled,
            Flip::HierarchicalAllreduce(on) => v.hierarchical_allreduce = Some(on),
            Flip::HierarchicalAllgather(on) => v.hierarchical_allgather = Some(on),
        }
        v
    }

    fn describe(self) -> String {
        match self {
            Flip::CacheToggle => "categorical sweep: response cache toggled".into(),
            Flip::HierarchicalAllreduce(on) => format!("categorical sweep: hierarchical allreduce {on}"),
            Flip::HierarchicalAllgather(on) => format!("categorical sweep: hierarchical allgather {on}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Warmup,
    Defaults,
    Bayes,
    Sweep,
    Done,
}

impl Phase {
    fn label(self) -> &'static str {
        match self {
            Phase::Warmup => "warm-up",
            Phase::Defaults => "defaults",
            Phase::Bayes => "bayes",
            Phase::Sweep => "categorical",
            Phase::Done => "done",
        }
    }
}

/// A flip that scored better than the best values once is measured again, after the best values again: it is
/// kept only if it wins that second, adjacent comparison too. One sample each decided it before, and on a
/// loaded machine a single lucky sample kept a flip that is slower (the response cache turned off for a burst
/// of 1,024 tensors: +12% in its one sample, 28% slower in another run's).
#[derive(Clone, Debug)]
enum Confirm {
    /// Measuring the best values again; `flip` scored `flip_score` against `best`'s score.
    Best { flip: TunedValues, flip_score: f64, best: (TunedValues, f64) },
    /// Measuring the flip again; the best values scored `best_again` just before.
    Flip { flip: TunedValues, flip_score: f64, best: (TunedValues, f64), best_again: f64 },
}

/// A sample is cut into up to this many pieces of equal steps (Horovod takes the median of 5 too).
const PIECES: usize = 5;

/// What the current sample has seen since the values it measures were applied.
struct Sample {
    started: Instant,
    bytes: u64,
    reductions: HashMap<String, usize>,
    steps: usize,
    /// The piece in progress: when it started and the bytes it reduced; the throughput of each one done.
    piece_started: Instant,
    piece_bytes: u64,
    pieces: Vec<f64>,
}

impl Sample {
    fn new(started: Instant) -> Self {
        Sample {
            started,
            bytes: 0,
            reductions: HashMap::new(),
            steps: 0,
            piece_started: started,
            piece_bytes: 0,
            pieces: Vec::new(),
        }
    }

    /// The sample's score: the median of its pieces' throughputs, so a burst of load on the machine
    /// during one piece does not decide the sample.
    fn score(&self) -> f64 {
        let mut pieces = self.pieces.clone();
        pieces.sort_by(f64::total_cmp);
        match pieces.len() {
            0 => 0.0,
            n if n % 2 == 1 => pieces[n / 2],
            n => (pieces[n / 2 - 1] + pieces[n / 2]) / 2.0,
        }
    }
}

/// Where the tuning stands, for tests and the final report.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub best: TunedValues,
    pub best_score: f64,
    pub defaults_score: f64,
}

pub struct ParameterManager {
    settings: AutotuneConfig,
    fusion_cap: usize,
    dims: Vec<Dim>,
    flips: Vec<Flip>,
    defaults: TunedValues,
    current: TunedValues,
    chosen_because: String,
    phase: Phase,
    warmup_left: usize,
    optimizer: BayesianOptimizer,
    probes_used: usize,
    /// `None` while the values to measure are announced but not yet applied.
    sample: Option<Sample>,
    samples_taken: usize,
    announce: Option<TunedValues>,
    /// The defaults' score: first their own sample, then their re-measurement in the sweep, if any.
    defaults_score: f64,
    /// The sweep still has to measure the defaults again.
    defaults_again: bool,
    sweep_best: Option<(TunedValues, f64)>,
    /// The sweep's current sample measures a flip (not the baseline or the defaults).
    measuring_flip: bool,
    /// A flip that beat the best values once, being measured again against them (see [`Confirm`]).
    confirming: Option<Confirm>,
    outcome: Option<Outcome>,
    log: Option<TuneLog>,
}

impl ParameterManager {
    /// `initial`: the configured values; `staging`: the shared-memory staging area's bytes, if any;
    /// `spans_hosts`: whether the communicator spans hosts (hierarchical knobs are tuned only then).
    pub fn new(settings: AutotuneConfig, initial: TunedValues, staging: Option<usize>, spans_hosts: bool) -> Self {
        let fusion_cap = staging.map_or(MAX_FUSION_THRESHOLD, |s| s.min(MAX_FUSION_THRESHOLD));
        let fixed = settings.fixed;
        let mut defaults = initial;
        if !fixed.fusion_threshold {
            defaults.fusion_threshold = defaults.fusion_threshold.min(fusion_cap);
        }
        let dims: Vec<Dim> = [(Dim::Fusion, fixed.fusion_threshold), (Dim::Cycle, fixed.cycle_time)]
            .into_iter()
            .filter_map(|(dim, fixed)| (!fixed).then_some(dim))
            .collect();
        let mut flips = Vec::new();
        if !fixed.cache {
            flips.push(Flip::CacheToggle);
        }
        if spans_hosts && !fixed.hierarchical_allreduce {
            flips.extend([Flip::HierarchicalAllreduce(true), Flip::HierarchicalAllreduce(false)]);
        }
        if spans_hosts && !fixed.hierarchical_allgather {
            flips.extend([Flip::HierarchicalAllgather(true), Flip::HierarchicalAllgather(false)]);
        }
        let log = settings.log.as_ref().and_then(|path| match TuneLog::create(path) {
            Ok(log) => Some(log),
            Err(e) => {
                tracing::warn!("autotune: cannot write the log {}: {e}; tuning goes on without it", path.display());
                None
            }
        });
        let warmup_left = settings.warmup_samples;
        let noise = settings.gaussian_process_noise;
        ParameterManager {
            phase: if warmup_left > 0 { Phase::Warmup } else { Phase::Defaults },
            chosen_because: if warmup_left > 0 { "warm-up at the defaults".into() } else { "defaults".into() },
            optimizer: BayesianOptimizer::new(dims.len(), noise),
            settings,
            fusion_cap,
            dims,
            flips,
            current: defaults.clone(),
            announce: Some(defaults.clone()),
            defaults,
            warmup_left,
            probes_used: 0,
            sample: None,
            samples_taken: 0,
            defaults_score: 0.0,
            defaults_again: false,
            sweep_best: None,
            measuring_flip: false,
            confirming: None,
            outcome: None,
            log,
        }
    }

    /// Values rank 0 must announce in its next round header (taken once).
    pub fn take_announcement(&mut self) -> Option<TunedValues> {
        self.announce.take()
    }

    /// The round that carried an announcement ended: every rank applied `values`, the sample starts now.
    pub fn applied(&mut self, values: &TunedValues) {
        self.applied_at(values, Instant::now());
    }

    /// [`applied`](Self::applied) at `now` (tests drive a synthetic clock).
    pub fn applied_at(&mut self, values: &TunedValues, now: Instant) {
        if *values == self.current && self.phase != Phase::Done {
            self.sample = Some(Sample::new(now));
        }
    }

    /// Whether tuning is over (the best values are applied, or announced to be).
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// Count the allreduces a round ran (responses, fused or not, and eager ones).
    pub fn record<'a>(&mut self, responses: impl IntoIterator<Item = &'a Response>) {
        self.record_at(responses, Instant::now());
    }

    /// [`record`](Self::record) at `now` (tests drive a synthetic clock).
    pub fn record_at<'a>(&mut self, responses: impl IntoIterator<Item = &'a Response>, now: Instant) {
        let Some(sample) = self.sample.as_mut() else { return };
        for response in responses {
            if response.kind != CollectiveKind::Allreduce || response.error.is_some() {
                continue;
            }
            let bytes = response.tensor_bytes() as u64;
            sample.bytes = sample.bytes.saturating_add(bytes);
            sample.piece_bytes = sample.piece_bytes.saturating_add(bytes);
            for entry in &response.entries {
                // Looked up before inserting: a name is copied once per sample, not once per reduction.
                let seen = match sample.reductions.get_mut(entry.name.as_str()) {
                    Some(seen) => {
                        *seen += 1;
                        *seen
                    }
                    None => {
                        sample.reductions.insert(entry.name.clone(), 1);
                        1
                    }
                };
                sample.steps = sample.steps.max(seen);
            }
        }
        // Piece k of P ends once k/P of the sample's steps are done.
        let steps = self.settings.steps_per_sample;
        let pieces = PIECES.min(steps).max(1);
        let piece_end = (sample.pieces.len() + 1) * steps;
        if sample.steps * pieces >= piece_end {
            let seconds = now.saturating_duration_since(sample.piece_started).as_secs_f64().max(1e-9);
            sample.pieces.push(sample.piece_bytes as f64 / seconds);
            sample.piece_started = now;
            sample.piece_bytes = 0;
        }
        if sample.steps >= steps {
            self.finish_sample(now);
        }
    }

    fn finish_sample(&mut self, now: Instant) {
        let Some(sample) = self.sample.take() else { return };
        let seconds = now.saturating_duration_since(sample.started).as_secs_f64().max(1e-9);
        let score = sample.score();
        let measured = self.current.clone();
        let phase = self.phase;
        let (next, next_because) = self.decide(score);
        if let Some(log) = self.log.as_mut() {
            let row = SampleRow {
                index: self.samples_taken,
                phase: phase.label(),
                values: &measured,
                steps: sample.steps,
                bytes: sample.bytes,
                seconds,
                score,
                chosen_because: &self.chosen_because,
                next: &next_because,
            };
            if let Err(e) = log.sample(&row) {
                tracing::warn!("autotune: writing the log failed: {e}");
            }
        }
        tracing::info!(
            "autotune: sample {} ({}) {} scored {score:.0} bytes/s; next: {next_because}",
            self.samples_taken,
            phase.label(),
            describe(&measured)
        );
        self.samples_taken += 1;
        self.chosen_because = next_because;
        if self.phase == Phase::Done {
            self.finish(next);
        } else if next == self.current {
            self.sample = Some(Sample::new(now));
        } else {
            self.current = next.clone();
            self.announce = Some(next);
        }
    }

    /// Feed `score` (of the current values) to the phase and pick the next values, with the reason.
    fn decide(&mut self, score: f64) -> (TunedValues, String) {
        match self.phase {
            Phase::Warmup => {
                self.warmup_left = self.warmup_left.saturating_sub(1);
                if self.warmup_left > 0 {
                    return (self.current.clone(), format!("warm-up ({} left)", self.warmup_left));
                }
                self.phase = Phase::Defaults;
                (self.defaults.clone(), "defaults".into())
            }
            Phase::Defaults => {
                self.defaults_score = score;
                if self.dims.is_empty() || self.settings.bayes_opt_max_samples == 0 {
                    return self.start_sweep(self.defaults.clone());
                }
                self.phase = Phase::Bayes;
                let x = self.point_of(&self.defaults);
                self.optimizer.add_sample(x, score);
                self.next_bayes()
            }
            Phase::Bayes => {
                let x = self.point_of(&self.current);
                self.optimizer.add_sample(x, score);
                self.next_bayes()
            }
            Phase::Sweep => self.next_sweep(score),
            Phase::Done => (self.current.clone(), "done".into()),
        }
    }

    fn next_bayes(&mut self) -> (TunedValues, String) {
        if self.optimizer.samples() >= self.settings.bayes_opt_max_samples {
            // The point the model predicts best, not the luckiest sample (see `best_predicted`).
            let best = self
                .optimizer
                .best_predicted()
                .map(|(x, _)| self.values_at(&x))
                .unwrap_or_else(|| self.defaults.clone());
            return self.start_sweep(best);
        }
        if self.probes_used < PROBES.len() {
            let probe = PROBES[self.probes_used];
            self.probes_used += 1;
            let x: Vec<f64> = self.dims.iter().map(|d| probe[*d as usize]).collect();
            return (self.values_at(&x), format!("initial probe {} of {}", self.probes_used, PROBES.len()));
        }
        match self.optimizer.propose() {
            Some(p) => {
                (self.values_at(&p.x), format!("largest expected improvement: {:.0} bytes/s", p.expected_improvement))
            }
            None => (self.current.clone(), "no model yet: same values again".into()),
        }
    }

    /// The final sweep from `base`, the best Bayesian point: a baseline measured there, the defaults measured
    /// again next to it (when they differ), then each categorical flip. Measurements taken minutes apart on a
    /// shared machine differ by more than the knobs do, so the best values are chosen, and compared with the
    /// defaults, among measurements taken close together.
    fn start_sweep(&mut self, base: TunedValues) -> (TunedValues, String) {
        self.phase = Phase::Sweep;
        self.sweep_best = None;
        self.defaults_again = base != self.defaults;
        if self.flips.is_empty() && !self.defaults_again {
            // The defaults stand, on their own measurement.
            self.sweep_best = Some((base.clone(), self.defaults_score));
            self.phase = Phase::Done;
            return (base, "best values found".into());
        }
        (base, "categorical sweep: baseline at the best fusion threshold and cycle time".into())
    }

    fn next_sweep(&mut self, score: f64) -> (TunedValues, String) {
        if self.current == self.defaults {
            self.defaults_score = score;
        }
        match self.confirming.take() {
            Some(Confirm::Best { flip, flip_score, best }) => {
                self.confirming = Some(Confirm::Flip { flip: flip.clone(), flip_score, best, best_again: score });
                return (flip, "categorical sweep: the flip again to confirm it".into());
            }
            Some(Confirm::Flip { flip, flip_score, best, best_again }) => {
                // Kept only if it won both comparisons; each side scores the mean of its two samples.
                self.sweep_best = Some(if score > best_again {
                    (flip, (flip_score + score) / 2.0)
                } else {
                    (best.0, (best.1 + best_again) / 2.0)
                });
            }
            None => match self.sweep_best.clone() {
                Some(best) if std::mem::take(&mut self.measuring_flip) && score > best.1 => {
                    self.confirming =
                        Some(Confirm::Best { flip: self.current.clone(), flip_score: score, best: best.clone() });
                    return (best.0, "categorical sweep: the best values again before the flip is kept".into());
                }
                Some((_, best)) if score <= best => {}
                _ => self.sweep_best = Some((self.current.clone(), score)),
            },
        }
        if std::mem::take(&mut self.defaults_again) {
            return (self.defaults.clone(), "categorical sweep: the defaults again for comparison".into());
        }
        let best = self.sweep_best.as_ref().map_or_else(|| self.current.clone(), |(v, _)| v.clone());
        while !self.flips.is_empty() {
            let flip = self.flips.remove(0);
            let candidate = flip.apply(&best);
            if candidate != best {
                self.measuring_flip = true;
                return (candidate, flip.describe());
            }
        }
        self.phase = Phase::Done;
        (best, "best values found".into())
    }

    /// Tuning is over: apply the best values and write the closing line.
    fn finish(&mut self, best: TunedValues) {
        let best_score = self.sweep_best.as_ref().map_or(self.defaults_score, |(_, s)| *s);
        let gain = if self.defaults_score > 0.0 { (best_score / self.defaults_score - 1.0) * 100.0 } else { 0.0 };
        let line = format!(
            "{} score_bytes_per_s={best_score:.1} defaults_bytes_per_s={:.1} improvement_over_defaults={gain:+.1}%",
            describe(&best),
            self.defaults_score
        );
        tracing::info!("autotune: best {line}");
        if let Some(log) = self.log.as_mut() {
            if let Err(e) = log.best(&line) {
                tracing::warn!("autotune: writing the log failed: {e}");
            }
        }
        self.outcome = Some(Outcome { best: best.clone(), best_score, defaults_score: self.defaults_score });
        if best != self.current {
            self.current = best.clone();
            self.announce = Some(best);
        }
    }

    /// The free knobs of `v` in the unit cube (fusion linear up to the cap, cycle time on a log scale).
    fn point_of(&self, v: &TunedValues) -> Vec<f64> {
        let (lo, hi) = CYCLE_MS;
        self.dims
            .iter()
            .map(|d| match d {
                Dim::Fusion => v.fusion_threshold as f64 / self.fusion_cap.max(1) as f64,
                Dim::Cycle => {
                    let ms = (v.cycle_time.as_secs_f64() * 1e3).clamp(lo, hi);
                    (ms / lo).ln() / (hi / lo).ln()
                }
            })
            .map(|x| x.clamp(0.0, 1.0))
            .collect()
    }

    /// The values at point `x` of the unit cube (knobs not in `dims` keep the defaults').
    fn values_at(&self, x: &[f64]) -> TunedValues {
        let (lo, hi) = CYCLE_MS;
        let mut v = self.defaults.clone();
        for (d, x) in self.dims.iter().zip(x) {
            let x = x.clamp(0.0, 1.0);
            match d {
                Dim::Fusion => {
                    let bytes = (x * self.fusion_cap as f64) as usize;
                    v.fusion_threshold = (bytes / FUSION_GRANULE * FUSION_GRANULE).min(self.fusion_cap);
                }
                Dim::Cycle => {
                    let ms = lo * ((hi / lo).ln() * x).exp();
                    v.cycle_time = Duration::from_micros((ms * 1e3).round() as u64);
                }
            }
        }
        v
    }
}

#[cfg(test)]
mod tests;
