//! A mutation fuzzer for every decoder of a peer's bytes (unit tests only; docs/fuzzing.md).
//!
//! Each decoder's module defines a [`Target`]: valid encodings to start from and a function that decodes one
//! input (and may check what it decoded, e.g. that it encodes back to what decodes the same). [`run`] feeds
//! it inputs made from those seeds and from its kept corpus (`tests/fuzz_corpus/<target>/`) and fails on the
//! first input that panics, holds more memory than its length warrants ([`allowance`]) or runs longer than
//! [`HANG_LIMIT`] (the process aborts then, printing the input). Every module's `fuzz_short` test runs
//! [`SHORT_RUN`] inputs in `cargo test`; its ignored `fuzz_long` test runs [`LONG_RUN`] and rewrites the
//! kept corpus: `cargo test --release --lib fuzz_long -- --ignored --test-threads=1 --nocapture`.
//!
//! - `mutate`: the deterministic PRNG and the mutations that make input `i` of a run.
//! - `guard`: the counting global allocator and the hang watchdog.

mod guard;
mod mutate;

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub(crate) use guard::measure;
use guard::{set_current_input, Watchdog};

/// Inputs per decoder in `cargo test`.
pub(crate) const SHORT_RUN: u64 = 20_000;
/// Inputs per decoder in the long run.
pub(crate) const LONG_RUN: u64 = 10_000_000;
/// One input taking longer than this is a hang (inputs are at most 4 KiB; decoders take microseconds).
pub(crate) const HANG_LIMIT: Duration = Duration::from_secs(5);
/// Inputs that decoded, kept in the corpus by the long run for later runs to mutate.
const KEPT: usize = 12;
/// Every run makes the same inputs; a failure names the index of its input.
const SEED: u64 = 0x5256_4f44_4655_5a5a;

/// A decoder under test.
pub(crate) struct Target {
    /// Its corpus folder's name.
    pub(crate) name: &'static str,
    /// Valid encodings, each of which must decode.
    pub(crate) seeds: Vec<Vec<u8>>,
    /// Decodes one input; true when it decoded. Panics only if the decoder breaks (that is the bug).
    pub(crate) decode: fn(&[u8]) -> bool,
}

/// What a run saw.
#[derive(Debug)]
pub(crate) struct Report {
    pub(crate) inputs: u64,
    pub(crate) decoded: u64,
    pub(crate) elapsed: Duration,
    pub(crate) slowest: Duration,
    /// The most memory one input held at once, and that input's length.
    pub(crate) peak: (usize, usize),
}

/// Memory a decoder may hold at once for an input of `len` bytes: a constant for fixed-size state, and a
/// multiple of the input for what it decodes (each item takes at least a byte on the wire and a few dozen in
/// memory; vectors grow by doubling). A decoder that sizes a buffer by a length prefix before the bytes have
/// come exceeds it.
pub(crate) fn allowance(len: usize) -> usize {
    64 * 1024 + 32 * len
}

fn corpus_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("fuzz_corpus").join(name)
}

/// The corpus files of `name`, sorted by file name; a missing folder is an empty corpus.
fn corpus(name: &str) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(corpus_dir(name)) else { return Vec::new() };
    let mut files: Vec<(String, Vec<u8>)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| Some((entry.file_name().into_string().ok()?, std::fs::read(entry.path()).ok()?)))
        .collect();
    files.sort();
    files
}

fn digest(bytes: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

/// Writes the corpus of `name`: its seeds and the kept inputs, in place of the old ones (crash files stay).
fn save_corpus(name: &str, seeds: &[Vec<u8>], kept: &[Vec<u8>]) {
    let dir = corpus_dir(name);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, _) in corpus(name) {
        if file.starts_with("seed-") || file.starts_with("kept-") {
            std::fs::remove_file(dir.join(file)).unwrap();
        }
    }
    for (i, seed) in seeds.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}.bin")), seed).unwrap();
    }
    for input in kept {
        std::fs::write(dir.join(format!("kept-{:016x}.bin", digest(input))), input).unwrap();
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Keeps the crashing input in the corpus and fails the test with it.
fn crash(target: &Target, index: u64, input: &[u8], what: &str) -> ! {
    let file = corpus_dir(target.name).join(format!("crash-{:016x}.bin", digest(input)));
    let _ = std::fs::create_dir_all(corpus_dir(target.name)).and_then(|()| std::fs::write(&file, input));
    panic!(
        "fuzz {}: input {index} ({} bytes, kept in {}) {what}:\n{}",
        target.name,
        input.len(),
        file.display(),
        hex(input)
    );
}

/// Feeds `target` `inputs` inputs; panics on the first that breaks it. A target with no corpus yet gets its
/// seeds written as one. Crash files stay in the corpus (inputs that once broke a decoder are good bases).
pub(crate) fn run(target: &Target, inputs: u64) -> Report {
    for (i, seed) in target.seeds.iter().enumerate() {
        assert!((target.decode)(seed), "fuzz {}: seed {i} does not decode: {}", target.name, hex(seed));
    }
    let stored = corpus(target.name);
    if stored.is_empty() {
        save_corpus(target.name, &target.seeds, &[]);
    }
    let mut bases = target.seeds.clone();
    bases.extend(stored.into_iter().map(|(_, bytes)| bytes));
    let known: HashSet<u64> = bases.iter().map(|b| digest(b)).collect();

    let watchdog = Watchdog::start(HANG_LIMIT);
    let mut report = Report { inputs, decoded: 0, elapsed: Duration::ZERO, slowest: Duration::ZERO, peak: (0, 0) };
    let mut kept: Vec<Vec<u8>> = Vec::new();
    let mut input = Vec::new();
    let started = Instant::now();
    for index in 0..inputs {
        mutate::make_input(&bases, SEED, index, &mut input);
        set_current_input(target.name, index, &input);
        watchdog.busy();
        let began = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| measure(|| (target.decode)(&input))));
        let took = began.elapsed();
        watchdog.idle();
        let (decoded, peak) = match outcome {
            Ok(done) => done,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                crash(target, index, &input, &format!("panicked: {message}"));
            }
        };
        if peak > allowance(input.len()) {
            crash(target, index, &input, &format!("held {peak} bytes at once"));
        }
        if took > HANG_LIMIT {
            crash(target, index, &input, &format!("took {took:?}"));
        }
        report.slowest = report.slowest.max(took);
        if peak > report.peak.0 {
            report.peak = (peak, input.len());
        }
        if decoded {
            report.decoded += 1;
            if kept.len() < KEPT && !known.contains(&digest(&input)) && !kept.contains(&input) {
                kept.push(input.clone());
            }
        }
    }
    report.elapsed = started.elapsed();
    drop(watchdog);
    println!(
        "fuzz {}: {} inputs ({} decoded) in {:.1} s, slowest {:?}, peak {} bytes held (a {}-byte input), no crash",
        target.name,
        report.inputs,
        report.decoded,
        report.elapsed.as_secs_f64(),
        report.slowest,
        report.peak.0,
        report.peak.1
    );
    if inputs >= LONG_RUN {
        save_corpus(target.name, &target.seeds, &kept);
    }
    report
}

/// Polls `future` once: for decoders written as async reads, fed from a byte slice that is all there is.
/// Still pending then means it waits for bytes that will never come, which the fuzzer counts as a hang.
pub(crate) fn ready<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut context) {
        std::task::Poll::Ready(out) => out,
        std::task::Poll::Pending => panic!("the decoder waits for more than the whole input"),
    }
}

/// A stream for async decoders that read the input and write answers nowhere.
pub(crate) struct Scripted<'a>(pub(crate) &'a [u8]);

impl tokio::io::AsyncRead for Scripted<'_> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Scripted<'_> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// `count` values of `strategy`, the same every run (seeds for a target).
pub(crate) fn samples<T: std::fmt::Debug>(
    strategy: impl proptest::strategy::Strategy<Value = T>,
    count: usize,
) -> Vec<T> {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    (0..count).map(|_| strategy.new_tree(&mut runner).unwrap().current()).collect()
}

/// Decodes a framed message; what decodes must encode to bytes that decode to the same encoding.
pub(crate) fn decodes_stably<M: crate::protocol::codec::WireMessage>(bytes: &[u8]) -> bool {
    match M::from_bytes(bytes) {
        Ok(message) => {
            let encoded = message.to_bytes();
            let again = M::from_bytes(&encoded).expect("a decoded message, encoded again, decodes");
            assert_eq!(again.to_bytes(), encoded, "a decoded message encodes differently after a round trip");
            true
        }
        Err(err) => {
            assert!(!err.to_string().is_empty());
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strict(bytes: &[u8]) -> bool {
        assert!(bytes.first() != Some(&0x42), "a planted bug");
        true
    }

    #[test]
    fn a_panicking_decoder_fails_the_run_naming_its_input() {
        let target = Target { name: "self_test", seeds: vec![b"abc".to_vec()], decode: strict };
        let err = catch_unwind(AssertUnwindSafe(|| run(&target, 100_000))).unwrap_err();
        let message = err.downcast_ref::<String>().unwrap();
        assert!(message.contains("fuzz self_test: input") && message.contains("a planted bug"), "{message}");
        std::fs::remove_dir_all(corpus_dir("self_test")).unwrap();
    }

    fn hoarder(bytes: &[u8]) -> bool {
        let declared = bytes.first().map_or(0, |&b| usize::from(b) << 12);
        std::hint::black_box(vec![0u8; declared]);
        true
    }

    #[test]
    fn a_decoder_allocating_what_a_length_declares_fails_the_run() {
        let target = Target { name: "self_test_alloc", seeds: vec![vec![1, 2, 3]], decode: hoarder };
        let err = catch_unwind(AssertUnwindSafe(|| run(&target, 100_000))).unwrap_err();
        let message = err.downcast_ref::<String>().unwrap();
        assert!(message.contains("bytes at once"), "{message}");
        std::fs::remove_dir_all(corpus_dir("self_test_alloc")).unwrap();
    }
}
