//! Futex waits and wakes on 32-bit words in memory shared between processes (no `FUTEX_PRIVATE_FLAG`).

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleep while `*word == expected`, at most `timeout`. Returns early on a wake, a signal or when the word
/// no longer holds `expected`; callers re-check their condition either way.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit atomic for the duration of the call; the kernel only reads
    // it. Errors (EAGAIN: value changed, EINTR, ETIMEDOUT) all mean "re-check", so the result is ignored.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec);
    }
}

/// Wake every thread (of any process) sleeping in [`wait`] on `word`.
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: as in `wait`; FUTEX_WAKE does not touch memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn wait_returns_on_timeout_changed_value_and_wake() {
        let word = Arc::new(AtomicU32::new(0));
        let start = Instant::now();
        wait(&word, 0, Duration::from_millis(20));
        assert!(start.elapsed() >= Duration::from_millis(15));
        let start = Instant::now();
        wait(&word, 1, Duration::from_secs(5));
        assert!(start.elapsed() < Duration::from_secs(1), "a stale expected value must not sleep");
        let waker = Arc::clone(&word);
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            waker.store(1, Ordering::SeqCst);
            wake_all(&waker);
        });
        let start = Instant::now();
        while word.load(Ordering::SeqCst) == 0 {
            wait(&word, 0, Duration::from_secs(5));
        }
        assert!(start.elapsed() < Duration::from_secs(2));
        thread.join().unwrap();
    }
}
