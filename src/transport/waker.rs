//! A cross-thread wake-up signal that can be waited on together with sockets.
//!
//! Backed by a Linux `eventfd`: `wake()` is one `write(2)`, and the fd becomes readable, so a transport
//! can `poll(2)` it alongside its sockets. Many wakes before a wait collapse into one. A transport that
//! sleeps on something else (the shared-memory transport sleeps on a futex) attaches a doorbell, which
//! `wake()` rings too, and reads the signal with [`Waker::is_signalled`] without a syscall.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Something a transport wants done on every wake (ring its own wake-up word).
pub type Doorbell = Arc<dyn Fn() + Send + Sync>;

pub struct Waker {
    fd: RawFd,
    signalled: AtomicBool,
    doorbell: Mutex<Option<Doorbell>>,
}

impl Waker {
    pub fn new() -> io::Result<Waker> {
        // SAFETY: plain syscall; the returned fd is owned by the Waker and closed in Drop.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Waker { fd, signalled: AtomicBool::new(false), doorbell: Mutex::new(None) })
    }

    /// Make the next (or the current) wait return.
    pub fn wake(&self) {
        self.signalled.store(true, Ordering::SeqCst);
        if let Some(doorbell) = self.doorbell.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            doorbell();
        }
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our own eventfd. A full counter (EAGAIN) means it is
        // already signalled, which is all we need.
        unsafe {
            libc::write(self.fd, &one as *const u64 as *const libc::c_void, 8);
        }
    }

    /// Clear the signal. Returns whether it was set.
    pub fn drain(&self) -> bool {
        self.signalled.store(false, Ordering::SeqCst);
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our own non-blocking eventfd.
        let n = unsafe { libc::read(self.fd, &mut value as *mut u64 as *mut libc::c_void, 8) };
        n == 8 && value > 0
    }

    /// Whether a wake is pending (set by `wake`, cleared by `drain`), without a syscall.
    pub fn is_signalled(&self) -> bool {
        self.signalled.load(Ordering::SeqCst)
    }

    /// Also ring `doorbell` on every future wake (replaces an earlier one).
    pub fn set_doorbell(&self, doorbell: Option<Doorbell>) {
        *self.doorbell.lock().unwrap_or_else(|p| p.into_inner()) = doorbell;
    }

    /// Block until woken or `timeout` passes, without consuming the signal. Returns whether it is set.
    /// Used by transports that have no file descriptors of their own to poll.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut pfd = libc::pollfd { fd: self.fd, events: libc::POLLIN, revents: 0 };
        // ppoll rather than poll: waits shorter than a millisecond matter here.
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: one valid pollfd, a valid timespec and no signal mask.
        let n = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        n > 0 && (pfd.revents & libc::POLLIN) != 0
    }
}

impl AsRawFd for Waker {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

impl Drop for Waker {
    fn drop(&mut self) {
        // SAFETY: we own the fd.
        unsafe {
            libc::close(self.fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wake_then_drain() {
        let w = Waker::new().unwrap();
        assert!(!w.wait(Duration::from_millis(1)));
        w.wake();
        w.wake();
        assert!(w.wait(Duration::from_millis(1)));
        assert!(w.drain());
        assert!(!w.drain());
    }
}
