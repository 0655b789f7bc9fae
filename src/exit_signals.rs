//! Last work before SIGTERM or SIGHUP ends the process with their default action (`rvodrun` stops a job's
//! ranks with SIGTERM; a closed terminal sends SIGHUP).
//!
//! Parts of the engine register hooks here; the first registration installs one handler for both signals,
//! only where the disposition is still the default (a handler the program set is never replaced, and then
//! the program decides how it ends). The handler runs every hook, in registration order, then restores the
//! default action and raises the signal again, so the process ends as it would have (same signal, same exit
//! status for whoever waits on it). Hooks run inside the handler: each must be async-signal-safe (atomics,
//! fixed buffers, `unlink`, `clock_gettime`, `nanosleep`) and bounded in time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

/// Hooks that may be registered (each part of the engine registers at most one).
const SLOTS: usize = 8;
const SIGNALS: [libc::c_int; 2] = [libc::SIGTERM, libc::SIGHUP];

/// A hook: a plain function, run inside the signal handler.
pub type Hook = extern "C" fn();

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: AtomicUsize = AtomicUsize::new(0);
/// Registered hooks as addresses (0: free slot), filled front to back.
static HOOKS: [AtomicUsize; SLOTS] = [EMPTY; SLOTS];
static INSTALL: Once = Once::new();

/// Run `hook` if SIGTERM or SIGHUP ends this process. Registering the same hook again does nothing.
/// Returns false when every slot is taken (the hook will not run).
pub fn on_terminating_signal(hook: Hook) -> bool {
    install();
    let address = hook as usize;
    for slot in &HOOKS {
        match slot.compare_exchange(0, address, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(current) if current == address => return true,
            Err(_) => {}
        }
    }
    false
}

/// The signals that end the process through [`on_terminating_signal`]'s hooks, for a thread that must
/// never run them itself (one that a hook waits for): block them in that thread.
pub fn block_in_this_thread() {
    // SAFETY: builds a signal set on the stack and changes only the calling thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in SIGNALS {
            libc::sigaddset(&mut set, signal);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

fn run_hooks() {
    for slot in &HOOKS {
        let address = slot.load(Ordering::Acquire);
        if address == 0 {
            break;
        }
        // SAFETY: only `on_terminating_signal` stores non-zero values, each the address of a `Hook`.
        let hook: Hook = unsafe { std::mem::transmute::<usize, Hook>(address) };
        hook();
    }
}

extern "C" fn on_signal(signal: libc::c_int) {
    run_hooks();
    // SAFETY: restore the default action and deliver the signal again (it is blocked until this handler
    // returns), so the process ends as it would have.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: installs a plain function that stays valid for the life of the process, only where the
        // disposition is the default.
        unsafe {
            for signal in SIGNALS {
                let mut current: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(signal, std::ptr::null(), &mut current) == 0 && current.sa_sigaction == libc::SIG_DFL
                {
                    let mut action: libc::sigaction = std::mem::zeroed();
                    action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                    libc::sigemptyset(&mut action.sa_mask);
                    libc::sigaction(signal, &action, std::ptr::null_mut());
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    static RAN: AtomicU32 = AtomicU32::new(0);

    extern "C" fn count() {
        RAN.fetch_add(1, Ordering::SeqCst);
    }

    #[test]
    fn a_hook_registered_twice_runs_once() {
        assert!(on_terminating_signal(count));
        assert!(on_terminating_signal(count));
        let before = RAN.load(Ordering::SeqCst);
        run_hooks();
        assert_eq!(RAN.load(Ordering::SeqCst), before + 1);
    }
}
