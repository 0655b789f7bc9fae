//! The manager driven by a synthetic clock: each step reduces a fixed number of bytes and takes as long as a
//! known throughput function of the applied values says.

use super::*;
use crate::config::FixedKnobs;
use crate::types::DataType;

const MIB: usize = 1 << 20;
/// Bytes one step reduces: one float32 tensor of this many elements.
const STEP_ELEMENTS: i64 = 1 << 20;

fn settings(fixed: FixedKnobs, log: Option<std::path::PathBuf>) -> AutotuneConfig {
    AutotuneConfig {
        log,
        warmup_samples: 2,
        steps_per_sample: 3,
        bayes_opt_max_samples: 20,
        gaussian_process_noise: 0.05,
        fixed,
    }
}

fn defaults() -> TunedValues {
    TunedValues {
        fusion_threshold: 128 * MIB,
        cycle_time: Duration::from_millis(1),
        cache_enabled: true,
        hierarchical_allreduce: None,
        hierarchical_allgather: None,
    }
}

fn step_response() -> Response {
    Response::for_one_tensor(CollectiveKind::Allreduce, "grad", DataType::Float32, STEP_ELEMENTS)
}

/// Drives `manager` like the engine would, with time passing as `throughput` (bytes/s) says, until tuning is
/// over; returns every value set that was announced, in order.
fn run(manager: &mut ParameterManager, throughput: impl Fn(&TunedValues) -> f64) -> Vec<TunedValues> {
    let response = step_response();
    let bytes = response.tensor_bytes() as f64;
    let mut now = Instant::now();
    let mut applied = defaults();
    let mut announced = Vec::new();
    for _ in 0..2_000 {
        if let Some(values) = manager.take_announcement() {
            // The round carrying the announcement ends: every rank applies it.
            applied = values.clone();
            announced.push(values.clone());
            manager.applied_at(&values, now);
        }
        if manager.is_done() && manager.take_announcement().is_none() {
            return announced;
        }
        now += Duration::from_secs_f64(bytes / throughput(&applied));
        manager.record_at([&response], now);
    }
    panic!("tuning did not finish within 2000 steps");
}

/// A smooth throughput surface with its maximum (1 GB/s) at 24 MiB and 3 ms; the response cache adds 5 %.
fn surface(v: &TunedValues) -> f64 {
    let fusion = v.fusion_threshold as f64 / MIB as f64;
    let cycle = v.cycle_time.as_secs_f64() * 1e3;
    let d2 = ((fusion - 24.0) / 30.0).powi(2) + ((cycle / 3.0).ln() / 3.0).powi(2);
    let cache = if v.cache_enabled { 1.0 } else { 0.95 };
    1e9 * cache * (0.4 + 0.6 * (-d2 / 0.2).exp())
}

#[test]
fn tunes_fusion_threshold_and_cycle_time_jointly_to_the_known_maximum() {
    let dir = std::env::temp_dir().join(format!("rvod-autotune-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("converge.csv");
    let mut manager =
        ParameterManager::new(settings(FixedKnobs::default(), Some(log.clone())), defaults(), None, false);
    let announced = run(&mut manager, surface);
    let outcome = manager.outcome().unwrap().clone();
    let best = surface(&outcome.best);
    assert!(best >= 0.97e9, "best {:?} reaches {best} of 1e9", outcome.best);
    assert!(outcome.best.cache_enabled, "the cache pays on this surface");
    assert!(outcome.best_score > outcome.defaults_score);
    // Warm-up and the defaults run at the defaults with the fusion threshold capped at 64 MiB.
    assert_eq!(announced[0].fusion_threshold, MAX_FUSION_THRESHOLD);
    assert!(announced.iter().all(|v| v.fusion_threshold <= MAX_FUSION_THRESHOLD));
    assert!(announced.iter().all(|v| v.hierarchical_allreduce.is_none() && v.hierarchical_allgather.is_none()));

    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], crate::autotune::log::HEADER);
    let rows: Vec<Vec<&str>> = lines[1..lines.len() - 1].iter().map(|l| l.split(',').collect()).collect();
    let phases: Vec<&str> = rows.iter().map(|r| r[1]).collect();
    // 2 warm-up, the defaults, 19 more Bayesian samples (20 with the defaults), then the sweep: baseline,
    // the defaults again, cache toggled.
    assert_eq!(phases.iter().filter(|p| **p == "warm-up").count(), 2);
    assert_eq!(phases.iter().filter(|p| **p == "defaults").count(), 1);
    assert_eq!(phases.iter().filter(|p| **p == "bayes").count(), 19);
    assert_eq!(phases.iter().filter(|p| **p == "categorical").count(), 3);
    let sweep: Vec<&str> = rows[rows.len() - 3..].iter().map(|r| r[11]).collect();
    assert_eq!(
        sweep,
        [
            "categorical sweep: baseline at the best fusion threshold and cycle time",
            "categorical sweep: the defaults again for comparison",
            "categorical sweep: response cache toggled"
        ]
    );
    assert_eq!(rows[rows.len() - 2][2], (64 * MIB).to_string(), "the defaults, capped, measured again");
    assert!(rows.iter().all(|r| r.len() == 13), "13 columns in every row");
    assert!(rows.iter().any(|r| r[11].starts_with("largest expected improvement")), "EI choices are logged");
    assert!(rows.iter().any(|r| r[11].starts_with("categorical sweep")));
    assert!(rows.iter().all(|r| r[7] == "3"), "each sample spans steps_per_sample steps");
    let last = lines[lines.len() - 1];
    assert!(last.starts_with("# best: fusion_threshold_bytes="), "{last}");
    assert!(last.contains("improvement_over_defaults=+"), "{last}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn knobs_the_user_set_stay_fixed() {
    let fixed = FixedKnobs { fusion_threshold: true, cache: true, ..FixedKnobs::default() };
    let initial = TunedValues { fusion_threshold: 100 * MIB, ..defaults() };
    let mut manager = ParameterManager::new(settings(fixed, None), initial, Some(8 * MIB), false);
    let announced = run(&mut manager, surface);
    assert!(announced.len() > 5, "the cycle time was tuned: {}", announced.len());
    assert!(announced.iter().all(|v| v.fusion_threshold == 100 * MIB), "the user's threshold, uncapped");
    assert!(announced.iter().all(|v| v.cache_enabled));
    let cycles: std::collections::BTreeSet<Duration> = announced.iter().map(|v| v.cycle_time).collect();
    assert!(cycles.len() > 3, "cycle times tried: {cycles:?}");

    let all_fixed = FixedKnobs { cycle_time: true, ..fixed };
    let mut manager = ParameterManager::new(settings(all_fixed, None), initial_with_cycle(), None, true);
    let announced = run(&mut manager, surface);
    assert!(announced.iter().all(|v| v.fusion_threshold == 100 * MIB && v.cycle_time == Duration::from_millis(7)));
    assert!(
        announced.iter().any(|v| v.hierarchical_allreduce == Some(true)),
        "hierarchical knobs are swept when the job spans hosts"
    );
}

fn initial_with_cycle() -> TunedValues {
    TunedValues { fusion_threshold: 100 * MIB, cycle_time: Duration::from_millis(7), ..defaults() }
}

#[test]
fn tuned_fusion_threshold_never_exceeds_the_staging_area() {
    let mut manager = ParameterManager::new(settings(FixedKnobs::default(), None), defaults(), Some(8 * MIB), false);
    let announced = run(&mut manager, surface);
    assert!(announced.iter().all(|v| v.fusion_threshold <= 8 * MIB), "{announced:?}");
    assert_eq!(manager.outcome().unwrap().best.fusion_threshold, 8 * MIB, "the surface rises up to the cap");
}

#[test]
fn the_cache_is_turned_off_when_that_scores_better() {
    let mut manager = ParameterManager::new(settings(FixedKnobs::default(), None), defaults(), None, false);
    run(
        &mut manager,
        |v| if v.cache_enabled { 0.8 } else { 1.0 } * surface(&TunedValues { cache_enabled: true, ..v.clone() }),
    );
    assert!(!manager.outcome().unwrap().best.cache_enabled);
}

#[test]
fn a_flip_that_wins_one_lucky_sample_is_measured_again_and_dropped() {
    // With the cache off, the first sample's steps run 30% faster than the cache-on surface, every later one
    // 20% slower: one sample alone would keep the cache off.
    let cache_off_steps = std::cell::Cell::new(0usize);
    let mut manager = ParameterManager::new(settings(FixedKnobs::default(), None), defaults(), None, false);
    let announced = run(&mut manager, |v| {
        let on = surface(&TunedValues { cache_enabled: true, ..v.clone() });
        if v.cache_enabled {
            return on;
        }
        cache_off_steps.set(cache_off_steps.get() + 1);
        on * if cache_off_steps.get() <= 3 { 1.3 } else { 0.8 }
    });
    let outcome = manager.outcome().unwrap();
    assert!(outcome.best.cache_enabled, "{outcome:?}");
    // The sweep's tail: the flip, the best values again, the flip again, then the best values stay applied.
    let cache = |v: &TunedValues| v.cache_enabled;
    let tail: Vec<bool> = announced.iter().rev().take(4).rev().map(cache).collect();
    assert_eq!(tail, [false, true, false, true], "{announced:?}");
    assert_eq!(outcome.best, *announced.last().unwrap());
}

#[test]
fn a_flip_that_wins_twice_is_kept() {
    let mut manager = ParameterManager::new(settings(FixedKnobs::default(), None), defaults(), None, false);
    let announced = run(&mut manager, |v| {
        let on = surface(&TunedValues { cache_enabled: true, ..v.clone() });
        on * if v.cache_enabled { 1.0 } else { 1.2 }
    });
    let outcome = manager.outcome().unwrap();
    assert!(!outcome.best.cache_enabled, "{outcome:?}");
    let tail: Vec<bool> = announced.iter().rev().take(3).rev().map(|v| v.cache_enabled).collect();
    assert_eq!(tail, [false, true, false], "the flip, the best values again, the flip again: {announced:?}");
}

#[test]
fn other_collectives_and_failed_responses_do_not_count() {
    let mut manager = ParameterManager::new(settings(FixedKnobs::default(), None), defaults(), None, false);
    let values = manager.take_announcement().unwrap();
    let start = Instant::now();
    manager.applied_at(&values, start);
    let gather = Response { kind: CollectiveKind::Allgather, ..step_response() };
    let failed = Response { error: Some((crate::error::ErrorKind::Mismatch, "x".into())), ..step_response() };
    for i in 1..10 {
        manager.record_at([&gather, &failed], start + Duration::from_millis(i));
    }
    assert!(manager.take_announcement().is_none());
    assert_eq!(manager.samples_taken, 0);
}

#[test]
fn a_slow_moment_inside_a_sample_does_not_decide_its_score() {
    let dir = std::env::temp_dir().join(format!("rvod-autotune-pieces-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("pieces.csv");
    let settings =
        AutotuneConfig { warmup_samples: 1, steps_per_sample: 5, ..settings(FixedKnobs::default(), Some(log.clone())) };
    let mut manager = ParameterManager::new(settings, defaults(), None, false);
    let values = manager.take_announcement().unwrap();
    let mut now = Instant::now();
    manager.applied_at(&values, now);
    let response = step_response();
    for step in 0..5 {
        // One step in five is 100 times slower: the mean throughput halves, the median does not move.
        now += Duration::from_millis(if step == 2 { 100 } else { 1 });
        manager.record_at([&response], now);
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let row: Vec<&str> = text.lines().nth(1).unwrap().split(',').collect();
    let per_step = response.tensor_bytes() as f64 / 1e-3;
    let score: f64 = row[10].parse().unwrap();
    assert!((score / per_step - 1.0).abs() < 1e-6, "score {score} vs {per_step} bytes/s per fast step");
    assert_eq!((row[7], row[8]), ("5", (5 * response.tensor_bytes()).to_string().as_str()));
    std::fs::remove_dir_all(&dir).unwrap();
}
