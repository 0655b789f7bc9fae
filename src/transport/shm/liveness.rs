//! Noticing that a peer process died: a pidfd per peer becomes readable when the process exits (even
//! before it is reaped), so a rank blocked on a killed peer fails at once instead of waiting for the timeout.
//!
//! Noticing that a peer froze (SIGSTOP, a debugger, a swapped-out machine): every rank that waits stamps its
//! slot's heartbeat with the system-wide monotonic clock while it sleeps. When a wait times out, the peers
//! whose heartbeat went stale are the frozen ones; the rank merely waited on (itself waiting for the frozen
//! one) keeps beating, so every survivor names the frozen rank rather than its neighbour in the ring.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A heartbeat older than this shows a rank that stopped running: waiting ranks beat every 20 ms, and
/// a busy one between two waits is far quicker than this too.
pub const STALE_HEARTBEAT_MS: u64 = 1000;

/// Milliseconds of `CLOCK_MONOTONIC`, which every process on the host shares.
pub fn monotonic_ms() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec we own; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    (now.tv_sec as u64).saturating_mul(1000).saturating_add(now.tv_nsec as u64 / 1_000_000)
}

/// Which rank to name when a wait on `blame` timed out, given every rank's last heartbeat: `blame` itself
/// when its heartbeat is stale (or nobody's is), else the rank with the stalest heartbeat. `me` is skipped.
pub fn frozen_rank(me: usize, blame: usize, heartbeats: &[u64], now_ms: u64) -> usize {
    let stale = |beat: u64| now_ms.saturating_sub(beat) > STALE_HEARTBEAT_MS;
    if heartbeats.get(blame).map_or(true, |&beat| stale(beat)) {
        return blame;
    }
    heartbeats
        .iter()
        .enumerate()
        .filter(|&(rank, &beat)| rank != me && stale(beat))
        .min_by_key(|&(_, &beat)| beat)
        .map_or(blame, |(rank, _)| rank)
}

pub struct Liveness {
    /// pidfd of each peer (None for ourselves, for peers in our own process, or where pidfds are missing).
    pidfds: Vec<Option<OwnedFd>>,
    pids: Vec<u32>,
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: plain syscall; a non-negative result is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

impl Liveness {
    /// Watch the processes `pids` (indexed by rank); ranks living in this very process are not watched.
    pub fn watch(pids: Vec<u32>) -> Liveness {
        let me = std::process::id();
        let pidfds = pids.iter().map(|&pid| if pid == me || pid == 0 { None } else { pidfd_open(pid) }).collect();
        Liveness { pidfds, pids }
    }

    /// Whether `rank`'s process has exited.
    pub fn is_dead(&self, rank: usize) -> bool {
        match self.pidfds.get(rank) {
            Some(Some(fd)) => {
                let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd, no wait.
                let n = unsafe { libc::poll(&mut pfd, 1, 0) };
                n > 0 && pfd.revents != 0
            }
            // Without a pidfd: signal 0 tells whether the pid exists (a zombie still does; the timeout covers it).
            Some(None) => {
                let pid = self.pids[rank];
                // SAFETY: signal 0 only checks for existence.
                pid != 0
                    && pid != std::process::id()
                    && unsafe { libc::kill(pid as libc::pid_t, 0) } != 0
                    && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frozen_rank_is_named_not_the_one_waited_on() {
        let now = 10_000;
        // Rank 1 waits on rank 0, which beats (it waits on rank 2); rank 2 stopped beating 3 s ago.
        assert_eq!(frozen_rank(1, 0, &[now - 20, now, now - 3000], now), 2);
        // The rank waited on is itself stale: it is named.
        assert_eq!(frozen_rank(1, 0, &[now - 3000, now, now - 5000], now), 0);
        // Nobody is stale (a slow peer, not a frozen one): the rank waited on is named.
        assert_eq!(frozen_rank(0, 2, &[now, now - 10, now - 500], now), 2);
        // Several stale ranks: the stalest; my own heartbeat never counts.
        assert_eq!(frozen_rank(3, 0, &[now, now - 2000, now - 4000, 0], now), 2);
        // Never beat at all counts as stale.
        assert_eq!(frozen_rank(0, 1, &[now, now, 0], now), 2);
    }

    #[test]
    fn a_child_that_exits_is_seen_dead() {
        let mut child = std::process::Command::new("sleep").arg("0.2").spawn().unwrap();
        let liveness = Liveness::watch(vec![std::process::id(), child.id()]);
        assert!(!liveness.is_dead(0));
        assert!(!liveness.is_dead(1));
        let start = std::time::Instant::now();
        while !liveness.is_dead(1) {
            assert!(start.elapsed().as_secs() < 5, "exit not noticed");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        child.wait().unwrap();
    }
}
