//! Segment names never outlive a rank that dies while setting shared memory up.
//!
//! A segment's name exists from its creation until every rank has mapped it (then each unlinks it). A rank
//! that ends inside that window would leave the whole segment (up to hundreds of MiB) in the shm folder:
//! by `exit()` (an exception or Ctrl-C during `init()`), or by SIGTERM/SIGHUP with their default action
//! (`rvodrun` stopping a job during start-up sends SIGTERM). Names in that window are registered here;
//! an `atexit` hook and a hook on those signals ([`crate::exit_signals`]) unlink them. Both only touch
//! atomics, fixed buffers and `unlink`, which is async-signal-safe. SIGKILL cannot be
//! caught: the creator names the segment in the store before creating it, and every other rank holds that
//! name in an [`UnlinkOnDrop`] until set-up ends, however it ends (see `connect_mesh`).

use std::cell::UnsafeCell;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

/// Segments that may be in their window at once (one per communicator being set up).
const SLOTS: usize = 8;
/// Longest path registered (longer ones are not covered).
const PATH_CAPACITY: usize = 512;

struct Slot {
    taken: AtomicBool,
    armed: AtomicBool,
    path: UnsafeCell<[u8; PATH_CAPACITY]>,
}

// SAFETY: `path` is written only by the thread that took the slot, before `armed` is set (Release), and read
// only after `armed` is seen set (Acquire).
unsafe impl Sync for Slot {}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot =
    Slot { taken: AtomicBool::new(false), armed: AtomicBool::new(false), path: UnsafeCell::new([0; PATH_CAPACITY]) };
static PENDING: [Slot; SLOTS] = [EMPTY; SLOTS];
static INSTALL: Once = Once::new();

/// A registered name; dropping it (once the name is unlinked) unregisters it.
pub struct PendingName {
    slot: Option<usize>,
}

impl Drop for PendingName {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            PENDING[i].armed.store(false, Ordering::Release);
            PENDING[i].taken.store(false, Ordering::Release);
        }
    }
}

/// A name unlinked when the guard is dropped, and until then if the process ends (see [`register`]).
pub struct UnlinkOnDrop {
    path: PathBuf,
    _pending: PendingName,
}

impl Drop for UnlinkOnDrop {
    fn drop(&mut self) {
        // Not found (another rank unlinked it first, or it was never created) is fine.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Unlink `path` when the returned guard is dropped, or if this process ends first.
pub fn unlink_on_drop(path: &Path) -> UnlinkOnDrop {
    UnlinkOnDrop { path: path.to_path_buf(), _pending: register(path) }
}

/// Unlink `path` if this process ends (exit, SIGTERM, SIGHUP) before the returned guard is dropped.
pub fn register(path: &Path) -> PendingName {
    install();
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= PATH_CAPACITY || bytes.contains(&0) {
        return PendingName { slot: None };
    }
    for (i, slot) in PENDING.iter().enumerate() {
        if slot.taken.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            // SAFETY: this thread owns the slot (taken above) and it is not armed, so nothing reads it.
            let buffer = unsafe { &mut *slot.path.get() };
            buffer[..bytes.len()].copy_from_slice(bytes);
            buffer[bytes.len()] = 0;
            slot.armed.store(true, Ordering::Release);
            return PendingName { slot: Some(i) };
        }
    }
    PendingName { slot: None }
}

/// Unlink every registered name. Async-signal-safe.
fn unlink_pending() {
    unlink_pending_under(b"");
}

/// Unlink the registered names that start with `prefix` (tests leave other tests' names alone). Async-signal-safe.
fn unlink_pending_under(prefix: &[u8]) {
    for slot in &PENDING {
        if slot.armed.load(Ordering::Acquire) {
            // SAFETY: armed, so the buffer holds a NUL-terminated path that is not being written.
            unsafe {
                let path = &*slot.path.get();
                if path.starts_with(prefix) {
                    libc::unlink(path.as_ptr().cast());
                }
            }
        }
    }
}

extern "C" fn on_exit() {
    unlink_pending();
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: registers a plain function that stays valid for the life of the process.
        unsafe {
            libc::atexit(on_exit);
        }
        crate::exit_signals::on_terminating_signal(on_exit);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_names_are_unlinked_and_dropped_ones_forgotten() {
        let dir = std::env::temp_dir();
        let kept = dir.join(format!("rvod-unlink-test-kept-{}", std::process::id()));
        let doomed = dir.join(format!("rvod-unlink-test-doomed-{}", std::process::id()));
        std::fs::write(&kept, b"x").unwrap();
        std::fs::write(&doomed, b"x").unwrap();
        let forgotten = register(&kept);
        let pending = register(&doomed);
        drop(forgotten);
        unlink_pending_under(dir.join("rvod-unlink-test-").as_os_str().as_bytes());
        assert!(!doomed.exists(), "a registered name is unlinked");
        assert!(kept.exists(), "a name whose guard was dropped is left alone");
        drop(pending);
        std::fs::remove_file(&kept).unwrap();
    }
}
