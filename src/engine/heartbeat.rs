//! An elastic worker's heartbeat to its driver: a thread that sets one key of the job's store every interval
//! to a count that grows and the ranks this process's engine found hung
//! ([`crate::coordinator::stall::HungRank`]), as JSON: `{"beat": N, "round": R, "hung": [[rank, seconds,
//! [tensors]], ...]}` (`round` and `hung` while an engine of an elastic world runs; the protocol is
//! `rvod.common.elastic_worker`'s). A Rust thread, so it beats while the script holds the GIL; it stops
//! when the whole process is frozen (SIGSTOP), which is what the driver watches for, or when the store is
//! gone (the job is over).
//!
//! What the coordinators found is kept process-wide ([`note_hung`]), by process set, and forgotten when the
//! engine stops ([`forget_hung`]).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::coordinator::stall::HungRank;
use crate::error::EngineError;
use crate::transport::rendezvous::StoreClient;

/// The elastic round of the engine that found them, and the ranks found hung by process set.
type Found = Option<(u64, BTreeMap<u32, Vec<HungRank>>)>;

static HUNG: Mutex<Found> = Mutex::new(None);

fn hung() -> std::sync::MutexGuard<'static, Found> {
    HUNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Record what set `set_id`'s coordinator (in elastic round `round`) now finds hung; returns the ranks it did
/// not find at its last check (to be said once).
pub fn note_hung(round: u64, set_id: u32, found: Vec<HungRank>) -> Vec<HungRank> {
    note(&mut hung(), round, set_id, found)
}

fn note(kept: &mut Found, round: u64, set_id: u32, found: Vec<HungRank>) -> Vec<HungRank> {
    let sets = match kept.as_mut() {
        Some((at, sets)) if *at == round => sets,
        _ => &mut kept.insert((round, BTreeMap::new())).1,
    };
    let before = sets.get(&set_id).map(|ranks| ranks.iter().map(|h| h.rank).collect::<Vec<_>>()).unwrap_or_default();
    let new = found.iter().filter(|h| !before.contains(&h.rank)).cloned().collect();
    if found.is_empty() {
        sets.remove(&set_id);
    } else {
        sets.insert(set_id, found);
    }
    new
}

/// Forget what the coordinators found (the engine stopped).
pub fn forget_hung() {
    *hung() = None;
}

/// Set `key` now (an error if the store cannot be reached), then every `interval` from a thread of its own.
pub fn start(mut client: StoreClient, key: String, interval: Duration) -> Result<(), EngineError> {
    let mut count = 1u64;
    let value = beat(&hung(), count);
    client.set(&key, value.as_bytes()).map_err(|e| EngineError::Init(format!("elastic heartbeat: {e}")))?;
    std::thread::Builder::new()
        .name("rvod-heartbeat".into())
        .spawn(move || loop {
            std::thread::sleep(interval);
            count += 1;
            let value = beat(&hung(), count);
            if client.set(&key, value.as_bytes()).is_err() {
                return; // the store is gone: the job is over
            }
        })
        .map(|_| ())
        .map_err(|e| EngineError::Init(format!("cannot start the elastic heartbeat thread: {e}")))
}

/// The value of beat `count`, with what `kept` holds.
fn beat(kept: &Found, count: u64) -> String {
    let Some((round, sets)) = kept.as_ref() else { return format!("{{\"beat\": {count}}}") };
    let mut by_rank: BTreeMap<u32, &HungRank> = BTreeMap::new();
    for found in sets.values().flatten() {
        if !by_rank.get(&found.rank).is_some_and(|kept| kept.waited >= found.waited) {
            by_rank.insert(found.rank, found);
        }
    }
    let ranks: Vec<String> = by_rank
        .values()
        .map(|h| {
            let tensors: Vec<String> = h.tensors.iter().map(|t| json_string(t)).collect();
            format!("[{}, {:.3}, [{}]]", h.rank, h.waited.as_secs_f64(), tensors.join(", "))
        })
        .collect();
    format!("{{\"beat\": {count}, \"round\": {round}, \"hung\": [{}]}}", ranks.join(", "))
}

/// `text` as a JSON string.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beats_carry_the_ranks_found_hung_until_forgotten() {
        let mut kept: Found = None;
        assert_eq!(beat(&kept, 1), "{\"beat\": 1}");
        let found = |rank, secs, name: &str| HungRank {
            rank,
            waited: Duration::from_secs_f64(secs),
            tensors: vec![name.to_string()],
        };
        let new = note(&mut kept, 3, 0, vec![found(2, 5.25, "allreduce.\"w\"\n")]);
        assert_eq!(new.len(), 1, "said once");
        assert!(note(&mut kept, 3, 0, vec![found(2, 5.5, "allreduce.\"w\"\n")]).is_empty(), "not again");
        note(&mut kept, 3, 1, vec![found(2, 6.0, "allreduce.set1")]);
        assert_eq!(beat(&kept, 7), "{\"beat\": 7, \"round\": 3, \"hung\": [[2, 6.000, [\"allreduce.set1\"]]]}");
        note(&mut kept, 3, 1, Vec::new());
        assert_eq!(
            beat(&kept, 8),
            "{\"beat\": 8, \"round\": 3, \"hung\": [[2, 5.500, [\"allreduce.\\\"w\\\"\\u000a\"]]]}"
        );
        note(&mut kept, 4, 0, Vec::new());
        assert_eq!(beat(&kept, 9), "{\"beat\": 9, \"round\": 4, \"hung\": []}", "a new round starts afresh");
        kept = None;
        assert_eq!(beat(&kept, 10), "{\"beat\": 10}");
    }
}
