//! Noticing that a peer process died: a pidfd per peer becomes readable when the process exits (even
//! before it is reaped), so a rank blocked on a killed peer fails at once instead of waiting for the timeout.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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
