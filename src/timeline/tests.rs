//! End-to-end tests of recording: engine-side calls in, a loadable trace file out.

use std::time::{Duration, Instant};

use super::file::tests::is_valid_json;
use super::*;
use crate::protocol::message::{Response, ResponseEntry};
use crate::types::ReduceOp;

fn response(kind: CollectiveKind, names: &[&str]) -> Response {
    Response {
        kind,
        dtype: DataType::Float32,
        entries: names
            .iter()
            .map(|n| ResponseEntry { name: n.to_string(), shape: vec![2, 3], per_rank: Vec::new(), packed: false })
            .collect(),
        reduce_op: ReduceOp::Sum,
        root_rank: 0,
        prescale: 1.0,
        postscale: 1.0,
        error: None,
        last_joined_rank: -1,
        on_gpu: false,
        compression: crate::types::Compression::None,
    }
}

fn temp_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("rvod-timeline-rec-{tag}-{}.json", std::process::id()))
}

#[test]
fn off_records_nothing_and_costs_no_subject() {
    let set = SetTimeline::new(Timeline::new(0, "job".into()), 0, &[0, 1], "shm");
    let mut record = set.op(&response(CollectiveKind::Allreduce, &["a"]), [None].into_iter(), Instant::now());
    assert!(record.recording.is_none(), "an op record while off");
    record.mark_collective();
    record.finish();
    set.tick("a", CollectiveKind::Allreduce, 1);
    set.cycle();
}

#[test]
fn two_ranks_record_into_one_valid_file() {
    let path = temp_path("two");
    let ranks: Vec<Timeline> = (0..2).map(|r| Timeline::new(r, "job-two".into())).collect();
    for t in &ranks {
        t.start(path.clone(), true).unwrap();
    }
    for (r, t) in ranks.iter().enumerate() {
        let set = SetTimeline::new(t.clone(), 0, &[0, 1], "shm");
        set.cycle();
        let fused = response(CollectiveKind::Allreduce, &["allreduce.a", "allreduce.b"]);
        let agreed = Instant::now();
        if r == 0 {
            set.tick("allreduce.a", CollectiveKind::Allreduce, 1);
        }
        // Only tensor b was submitted on this rank (a is a joined rank's zeros).
        let submitted = [None, Some(agreed - Duration::from_micros(50))];
        let mut phases = set.op(&fused, submitted.into_iter(), agreed);
        phases.mark(Stage::MemcpyInFusionBuffer);
        phases.mark_collective();
        phases.mark(Stage::MemcpyOutFusionBuffer);
        phases.finish();
    }
    for t in &ranks {
        t.stop();
    }
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(is_valid_json(&text), "{text}");
    for needle in [
        "\"NEGOTIATE_ALLREDUCE\"",
        "\"SHM_ALLREDUCE\"",
        "\"MEMCPY_IN_FUSION_BUFFER\"",
        "\"MEMCPY_OUT_FUSION_BUFFER\"",
        "\"CYCLE_START\"",
        "\"name\":\"allreduce.a\"",
        "\"name\":\"allreduce.b\"",
        "\"name\":\"rank 0\"",
        "\"name\":\"rank 1\"",
        "\"ready_rank\":1",
        "\"dtype\":\"float32\",\"shape\":[2, 3]",
        "\"QUEUE\"",
    ] {
        assert!(text.contains(needle), "missing {needle} in {text}");
    }
    // Every op span on both ranks: 2 tensors x 2 ranks.
    assert_eq!(text.matches("\"name\":\"ALLREDUCE\"").count(), 4);
    assert_eq!(text.matches("\"name\":\"NEGOTIATE_ALLREDUCE\"").count(), 2, "only tensor b negotiated");
    assert_eq!(text.matches("\"name\":\"SHM_ALLREDUCE\"").count(), 4);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn switching_files_closes_the_first_and_fills_the_second() {
    let (first, second) = (temp_path("first"), temp_path("second"));
    let t = Timeline::new(0, "job-switch".into());
    let set = SetTimeline::new(t.clone(), 0, &[0], "tcp");
    let r = response(CollectiveKind::Allgather, &["allgather.x"]);
    t.start(first.clone(), false).unwrap();
    let mut phases = set.op(&r, [Some(Instant::now())].into_iter(), Instant::now());
    phases.mark_collective();
    phases.finish();
    t.start(second.clone(), false).unwrap();
    for _ in 0..2 {
        let mut phases = set.op(&r, [Some(Instant::now())].into_iter(), Instant::now());
        phases.mark_collective();
        phases.finish();
    }
    set.cycle();
    t.stop();
    assert!(!t.is_on());
    let one = std::fs::read_to_string(&first).unwrap();
    let two = std::fs::read_to_string(&second).unwrap();
    assert!(is_valid_json(&one) && is_valid_json(&two));
    assert_eq!(one.matches("\"TCP_ALLGATHER\"").count(), 1);
    assert_eq!(two.matches("\"TCP_ALLGATHER\"").count(), 2);
    assert!(!two.contains("CYCLE_START"), "cycles were not asked for");
    let _ = std::fs::remove_file(&first);
    let _ = std::fs::remove_file(&second);
}

#[test]
fn recording_never_pauses_while_switching_files() {
    let paths: Vec<PathBuf> = (0..2).map(|i| temp_path(&format!("flip{i}"))).collect();
    let t = Timeline::new(0, "job-flip".into());
    t.start(paths[0].clone(), false).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (t, done) = (t.clone(), done.clone());
        std::thread::spawn(move || {
            let mut seen_off = 0usize;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                seen_off += usize::from(!t.is_on());
            }
            seen_off
        })
    };
    for i in 0..100 {
        t.start(paths[i % 2].clone(), false).unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(watcher.join().unwrap(), 0, "an op starting mid-switch would not be recorded anywhere");
    t.stop();
    for path in paths {
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn a_failed_switch_keeps_recording_into_the_current_file() {
    let path = temp_path("kept");
    let t = Timeline::new(0, "job-kept".into());
    let set = SetTimeline::new(t.clone(), 0, &[0], "shm");
    let r = response(CollectiveKind::Allreduce, &["allreduce.kept"]);
    t.start(path.clone(), false).unwrap();
    assert!(t.start(PathBuf::from("/nonexistent-dir-rvod/t.json"), false).is_err());
    assert!(t.is_on());
    let mut phases = set.op(&r, [Some(Instant::now())].into_iter(), Instant::now());
    phases.mark_collective();
    phases.finish();
    t.stop();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(is_valid_json(&text) && text.contains("SHM_ALLREDUCE"), "{text}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_collective_by_a_named_algorithm_keeps_its_name_and_says_the_algorithm() {
    let path = temp_path("algorithm");
    let t = Timeline::new(0, "job-algorithm".into());
    let set = SetTimeline::new(t.clone(), 0, &[0], "tcp");
    t.start(path.clone(), false).unwrap();
    for (kind, name, algorithm) in [
        (CollectiveKind::Allreduce, "allreduce.by", "rabenseifner"),
        (CollectiveKind::Allgather, "allgather.by", "bruck"),
        (CollectiveKind::Broadcast, "broadcast.by", "tree"),
    ] {
        let mut phases = set.op(&response(kind, &[name]), [Some(Instant::now())].into_iter(), Instant::now());
        phases.mark_algorithm(algorithm);
        phases.finish();
    }
    t.stop();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(is_valid_json(&text), "{text}");
    for (phase, algorithm) in [("TCP_ALLREDUCE", "rabenseifner"), ("TCP_ALLGATHER", "bruck"), ("TCP_BROADCAST", "tree")]
    {
        let span = text.lines().find(|l| l.contains(&format!("\"name\":\"{phase}\""))).unwrap_or_default();
        assert!(span.contains(&format!("\"args\":{{\"algorithm\":\"{algorithm}\"}}")), "{phase}: {text}");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn an_unwritable_path_is_a_clear_error() {
    let t = Timeline::new(0, "job".into());
    let err = t.start(PathBuf::from("/nonexistent-dir-rvod/t.json"), false).unwrap_err();
    assert!(err.to_string().contains("/nonexistent-dir-rvod/t.json"), "{err}");
    assert!(!t.is_on());
}

#[test]
fn events_are_flushed_while_recording_goes_on() {
    let path = temp_path("live");
    let t = Timeline::new(0, "job-live".into());
    t.start(path.clone(), true).unwrap();
    SetTimeline::new(t.clone(), 0, &[0], "shm").cycle();
    std::thread::sleep(FLUSH_WAIT);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(is_valid_json(&text) && text.contains("CYCLE_START"), "{text}");
    t.stop();
    let _ = std::fs::remove_file(&path);
}

/// Longer than the writer's flush interval.
const FLUSH_WAIT: Duration = Duration::from_millis(400);

#[test]
fn a_terminating_signal_has_every_queued_event_written_before_the_process_ends() {
    let path = temp_path("signal");
    let t = Timeline::new(0, "job-signal".into());
    t.start(path.clone(), false).unwrap();
    let set = SetTimeline::new(t.clone(), 0, &[0], "shm");
    let r = response(CollectiveKind::Allreduce, &["allreduce.before_signal"]);
    for _ in 0..3 {
        let mut phases = set.op(&r, [Some(Instant::now())].into_iter(), Instant::now());
        phases.mark_collective();
        phases.finish();
    }
    // What the SIGTERM handler runs; it returns once the writers wrote, well before the 100 ms flush.
    let asked = Instant::now();
    super::signal_flush::flush_every_timeline();
    assert!(asked.elapsed() < Duration::from_millis(90), "waited {:?}", asked.elapsed());
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(is_valid_json(&text), "{text}");
    assert_eq!(text.matches("\"SHM_ALLREDUCE\"").count(), 3, "{text}");
    t.stop();
    let _ = std::fs::remove_file(&path);
}
