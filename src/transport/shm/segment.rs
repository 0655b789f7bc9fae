//! A job-private shared-memory segment: a file in the shm directory (`/dev/shm` unless `RVOD_SHM_DIR`
//! says otherwise) with an unguessable name, created with mode 0600 and `O_EXCL`, its pages reserved with
//! `fallocate` (so a full or too small tmpfs is an error at set-up, never a bus error later), and mapped
//! shared by every rank. Once every rank has mapped it, the name is unlinked: the memory lives on only in
//! the mappings, and the kernel frees it when the last rank exits, however it exits. A rank that ends
//! before that unlinks the name on its way out where it can (`unlink_on_exit`); one that cannot (SIGKILL)
//! leaves it to the others, who learn the name before it is created (see `ShmTransport::connect_mesh`).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::unlink_on_exit::{self, PendingName};

pub struct Segment {
    base: *mut u8,
    len: usize,
    path: PathBuf,
    /// Unlinks the name if the process ends before [`Segment::unlink`] (see `unlink_on_exit`).
    pending: Mutex<Option<PendingName>>,
}

// SAFETY: the mapping is plain shared memory; all concurrent access to it goes through atomics or through
// byte ranges that the channel protocol hands to exactly one side at a time.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn random_name() -> io::Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::getrandom(&mut bytes).map_err(|e| io::Error::other(format!("no randomness for a segment name: {e}")))?;
    Ok(format!("rvod-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

fn map(file: &File, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of `len` bytes of a file at least that long; the pointer is owned by
    // the Segment and unmapped in Drop. MAP_POPULATE faults the pages in now rather than mid-collective.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(ptr.cast())
}

/// A fresh, unguessable segment path in `dir`.
pub fn fresh_path(dir: &Path) -> io::Result<PathBuf> {
    Ok(dir.join(random_name()?))
}

/// Whether `path` is named as [`fresh_path`] names segments: the only names a rank unlinks on a peer's word.
pub fn is_segment_name(path: &Path) -> bool {
    let name = path.file_name().map(|n| n.as_bytes()).unwrap_or_default();
    name.len() == 37 && name.starts_with(b"rvod-") && name[5..].iter().all(u8::is_ascii_hexdigit)
}

impl Segment {
    /// Create and map a new segment of `len` bytes in `dir`.
    pub fn create(dir: &Path, len: usize) -> io::Result<Segment> {
        Self::create_at(&fresh_path(dir)?, len)
    }

    /// Create and map a new segment of `len` bytes at `path` (which must not exist). On failure nothing is
    /// left at `path`, so the same path can be tried again.
    pub fn create_at(path: &Path, len: usize) -> io::Result<Segment> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let path = path.to_path_buf();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        let pending = unlink_on_exit::register(&path);
        let reserve = || -> io::Result<*mut u8> {
            // SAFETY: plain syscall on our own fd.
            let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
            if rc != 0 {
                let err = io::Error::last_os_error();
                return Err(io::Error::new(
                    err.kind(),
                    format!("cannot reserve {} MiB in {}: {err}", len.div_ceil(1 << 20), dir.display()),
                ));
            }
            map(&file, len)
        };
        match reserve() {
            Ok(base) => Ok(Segment { base, len, path, pending: Mutex::new(Some(pending)) }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Map an existing segment created by another rank of this job. Refuses a file that is not a regular
    /// file of ours, readable by others, or not exactly `len` bytes long.
    pub fn open(path: &Path, len: usize) -> io::Result<Segment> {
        let file =
            OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path)?;
        let meta = file.metadata()?;
        // SAFETY: plain syscall without arguments.
        let uid = unsafe { libc::geteuid() };
        if !meta.is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 || meta.len() != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not a private segment of {len} bytes owned by this user", path.display()),
            ));
        }
        let pending = unlink_on_exit::register(path);
        let base = map(&file, len)?;
        Ok(Segment { base, len, path: path.to_path_buf(), pending: Mutex::new(Some(pending)) })
    }

    /// Remove the segment's name (idempotent). The mappings stay valid.
    pub fn unlink(&self) {
        if let Ok(name) = CString::new(self.path.as_os_str().as_bytes()) {
            // SAFETY: a valid NUL-terminated path. ENOENT (another rank unlinked it first) is fine.
            unsafe {
                libc::unlink(name.as_ptr());
            }
        }
        self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.pending.get_mut().map_or(true, |pending| pending.is_some()) {
            // Dropped before every rank mapped it (set-up failed): nobody can use the name any more.
            self.unlink();
        }
        // SAFETY: unmaps exactly the mapping created in `map`; nothing refers to it any more (users hold an
        // Arc<Segment>).
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_private_mapped_twice_and_unlinked() {
        let dir = std::env::temp_dir();
        let a = Segment::create(&dir, 8192).unwrap();
        let meta = std::fs::metadata(a.path()).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert!(a.path().file_name().unwrap().to_string_lossy().len() > 30, "name must carry 128 random bits");
        let b = Segment::open(a.path(), 8192).unwrap();
        // SAFETY: both mappings are 8192 bytes of the same file.
        unsafe {
            *a.base().add(100) = 42;
            assert_eq!(*b.base().add(100), 42);
        }
        a.unlink();
        assert!(!a.path().exists());
        // SAFETY: as above; the memory outlives the name.
        unsafe {
            *b.base().add(8000) = 7;
            assert_eq!(*a.base().add(8000), 7);
        }
        b.unlink();
        assert!(Segment::open(a.path(), 8192).is_err());
    }

    #[test]
    fn only_names_made_by_fresh_path_count_as_segment_names() {
        let dir = std::env::temp_dir();
        assert!(is_segment_name(&fresh_path(&dir).unwrap()));
        for other in ["rvod-1234", "rvod-0123456789abcdef0123456789abcdeg", "data.bin", "", "/"] {
            assert!(!is_segment_name(&dir.join(other)), "{other}");
        }
    }

    #[test]
    fn wrong_length_or_foreign_mode_is_refused() {
        let dir = std::env::temp_dir();
        let a = Segment::create(&dir, 4096).unwrap();
        assert!(Segment::open(a.path(), 8192).is_err());
        std::fs::set_permissions(a.path(), std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        assert!(Segment::open(a.path(), 4096).is_err());
        a.unlink();
    }
}
