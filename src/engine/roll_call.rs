//! The roll call of `init()`, its first step once the rendezvous store is reached: every rank announces
//! itself in the store and waits, up to the start timeout, for all the others. A rank that never comes fails
//! everyone's `init()` with an error naming it, instead of a timeout deep inside connection set-up that names
//! a store key. (Finding the store in a job a launcher started is `crate::launch::meet`'s job.)

use std::time::{Duration, Instant};

use crate::error::EngineError;
use crate::transport::rendezvous::StoreClient;
use crate::transport::TransportError;

/// How long the listing of the other missing ranks may take once the deadline has passed.
const LISTING_WAIT: Duration = Duration::ZERO;

/// Announce `rank` in `scope` and wait until all `size` ranks have. On timeout the error names every rank
/// that had not come by then.
pub fn call_the_roll(
    store: &mut StoreClient,
    scope: &str,
    rank: usize,
    size: usize,
    timeout: Duration,
) -> Result<(), EngineError> {
    let fail = |e: TransportError| EngineError::transport("announcing this rank to the others", &e);
    let key = |r: usize| format!("{scope}/arrived/{r}");
    store.set(&key(rank), b"1").map_err(fail)?;
    let deadline = Instant::now() + timeout;
    let mut missing = Vec::new();
    for r in 0..size {
        let wait = if missing.is_empty() { deadline.saturating_duration_since(Instant::now()) } else { LISTING_WAIT };
        if store.try_get(&key(r), wait).map_err(fail)?.is_none() {
            missing.push(r);
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(EngineError::StartTimeout(missing_ranks_message(&missing, size, timeout)))
}

fn missing_ranks_message(missing: &[usize], size: usize, timeout: Duration) -> String {
    let list = |ranks: &[usize]| ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
    let came: Vec<usize> = (0..size).filter(|r| !missing.contains(r)).collect();
    let (noun, verb) = if missing.len() == 1 { ("rank", "has") } else { ("ranks", "have") };
    format!(
        "init() timed out after {:.0} s (RVOD_START_TIMEOUT / --start-timeout) waiting for the other ranks: {noun} {} of \
         {size} {verb} not called init() (ranks that came: {}). Start every rank, or allow more time.",
        timeout.as_secs_f64(),
        list(missing),
        if came.is_empty() { "none".to_string() } else { list(&came) },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rendezvous::RendezvousServer;
    use std::net::Ipv4Addr;

    #[test]
    fn ranks_that_never_come_are_named() {
        let server = RendezvousServer::start(Ipv4Addr::LOCALHOST.into(), 0, b"k".to_vec()).unwrap();
        let mut rank0 = StoreClient::connect(server.addr(), b"k", Duration::from_secs(5)).unwrap();
        let mut rank2 = StoreClient::connect(server.addr(), b"k", Duration::from_secs(5)).unwrap();
        rank2.set("s/arrived/2", b"1").unwrap();
        let started = Instant::now();
        let err = call_the_roll(&mut rank0, "s", 0, 4, Duration::from_millis(300)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(matches!(err, EngineError::StartTimeout(_)));
        let message = err.to_string();
        assert!(message.contains("ranks 1, 3 of 4 have not called init() (ranks that came: 0, 2)"), "{message}");
        assert!(message.contains("RVOD_START_TIMEOUT"), "{message}");

        rank2.set("t/arrived/1", b"1").unwrap();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            call_the_roll(&mut rank2, "t", 1, 2, Duration::from_secs(5))
        });
        call_the_roll(&mut rank0, "t", 0, 2, Duration::from_secs(5)).unwrap();
        late.join().unwrap().unwrap();
    }
}
