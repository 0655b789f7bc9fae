//! Pinning the engine's background threads to one core (`RVOD_THREAD_AFFINITY` / Horovod's
//! `HOROVOD_THREAD_AFFINITY`). Off by default, as in Horovod: pinning helps when each rank has a core of its
//! own (the scheduler cannot then put two ranks' engine threads on one core, which serialises their copies),
//! and hurts when jobs share cores.

use std::io;

/// Pin the calling thread to `core`.
pub fn pin_current_thread(core: usize) -> io::Result<()> {
    let bits = 8 * std::mem::size_of::<libc::cpu_set_t>();
    if core >= bits {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("core ids go up to {}", bits - 1)));
    }
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write inside it, `core` is in range (checked above).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe {
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(core, &mut set);
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the size passed.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Pin the calling engine thread as `config` asks, warning (not failing) where the system refuses.
pub fn apply(thread_affinity: Option<usize>, thread_name: &str) {
    if let Some(core) = thread_affinity {
        if let Err(err) = pin_current_thread(core) {
            tracing::warn!("cannot pin {thread_name} to core {core} (RVOD_THREAD_AFFINITY): {err}; it runs unpinned");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed_cores() -> Vec<usize> {
        // SAFETY: as in pin_current_thread; sched_getaffinity fills `set`.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }, 0);
        (0..8 * std::mem::size_of::<libc::cpu_set_t>()).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
    }

    #[test]
    fn a_thread_is_pinned_to_the_core_asked_for() {
        let core = *allowed_cores().last().unwrap();
        let seen = std::thread::spawn(move || {
            pin_current_thread(core).unwrap();
            allowed_cores()
        })
        .join()
        .unwrap();
        assert_eq!(seen, vec![core]);
    }

    #[test]
    fn impossible_cores_are_refused() {
        assert_eq!(pin_current_thread(1 << 20).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}
