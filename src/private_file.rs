//! Files only this user can read: the rendezvous file of a one-host job, and `RVOD_SECRET_FILE`.
//!
//! Rank 0 of a one-host job started without a secret writes its store's port and a fresh secret to
//! `$TMPDIR/rvod-<uid>/<run key>` (the directory 0700, the file 0600, both owned by this user; written under a
//! temporary name and renamed, so a reader never sees half a file). The other ranks read it. Anything that
//! is not a regular file owned by this user without group or other permissions is refused, so another user
//! on the host can neither plant a store address nor read the secret.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

const MAGIC: &str = "rvod-rendezvous 1";

/// What rank 0 published.
#[derive(Debug, PartialEq)]
pub struct RendezvousFile {
    pub port: u16,
    pub secret: Vec<u8>,
    pub pid: u32,
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Why `metadata` does not describe something private to this user, if it does not.
fn not_private(path: &Path, metadata: &fs::Metadata, want_dir: bool) -> Option<String> {
    let kind_ok = if want_dir { metadata.file_type().is_dir() } else { metadata.file_type().is_file() };
    if !kind_ok {
        let kind = if want_dir { "a directory" } else { "a regular file" };
        return Some(format!("{} is not {kind}", path.display()));
    }
    if metadata.uid() != effective_uid() {
        return Some(format!(
            "{} belongs to uid {}, not to this user (uid {})",
            path.display(),
            metadata.uid(),
            effective_uid()
        ));
    }
    if metadata.mode() & 0o077 != 0 {
        return Some(format!(
            "{} can be read or written by others (mode {:o}); it must be private to its owner (chmod {})",
            path.display(),
            metadata.mode() & 0o777,
            if want_dir { "700" } else { "600" }
        ));
    }
    None
}

/// `$TMPDIR/rvod-<uid>`, created private if missing, refused if someone else could use it.
pub fn private_dir() -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("rvod-{}", effective_uid()));
    match fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    let metadata = fs::symlink_metadata(&dir).map_err(|e| format!("cannot inspect {}: {e}", dir.display()))?;
    match not_private(&dir, &metadata, true) {
        Some(reason) => Err(reason),
        None => Ok(dir),
    }
}

/// The rendezvous file of the job named `run_key` (characters outside `[A-Za-z0-9._-]` become `_`).
pub fn rendezvous_path(run_key: &str) -> Result<PathBuf, String> {
    let name: String = run_key
        .chars()
        .take(120)
        .map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' })
        .collect();
    Ok(private_dir()?.join(format!("{name}.rendezvous")))
}

/// Writes the file for the other ranks (replacing a stale one).
pub fn publish(path: &Path, port: u16, secret: &[u8]) -> Result<(), String> {
    let temporary = path.with_extension(format!("tmp{}", std::process::id()));
    let text = format!("{MAGIC}\nport {port}\nsecret {}\npid {}\n", hex(secret), std::process::id());
    let written = (|| -> io::Result<()> {
        let _ = fs::remove_file(&temporary);
        let mut file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&temporary)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        fs::rename(&temporary, path)
    })();
    written.map_err(|e| {
        let _ = fs::remove_file(&temporary);
        format!("cannot write the rendezvous file {}: {e}", path.display())
    })
}

/// What rank 0 published, `None` while the file does not exist yet.
pub fn read_rendezvous(path: &Path) -> Result<Option<RendezvousFile>, String> {
    let Some(text) = read_private(path)? else { return Ok(None) };
    let bad = || format!("{} is not an rvod rendezvous file", path.display());
    let mut lines = text.lines();
    if lines.next() != Some(MAGIC) {
        return Err(bad());
    }
    let (mut port, mut secret, mut pid) = (None, None, None);
    for line in lines {
        match line.split_once(' ') {
            Some(("port", value)) => port = value.parse::<u16>().ok(),
            Some(("secret", value)) => secret = parse_hex(value).ok(),
            Some(("pid", value)) => pid = value.parse::<u32>().ok(),
            _ => {}
        }
    }
    match (port, secret, pid) {
        (Some(port), Some(secret), Some(pid)) if port != 0 && !secret.is_empty() => {
            Ok(Some(RendezvousFile { port, secret, pid }))
        }
        _ => Err(bad()),
    }
}

/// The secret in `RVOD_SECRET_FILE`: hex digits (e.g. from `openssl rand -hex 32`), in a 0600 file of this user.
pub fn read_secret(path: &Path) -> Result<Vec<u8>, String> {
    let text = read_private(path)?.ok_or_else(|| format!("{} does not exist", path.display()))?;
    parse_hex(text.trim()).map_err(|reason| format!("{}: {reason}", path.display()))
}

/// The text of a private file of this user, `None` if it does not exist.
fn read_private(path: &Path) -> Result<Option<String>, String> {
    let metadata = match fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot inspect {}: {e}", path.display())),
    };
    if let Some(reason) = not_private(path, &metadata, false) {
        return Err(format!("refusing to use {}: {reason}", path.display()));
    }
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hex digits to bytes.
pub fn parse_hex(text: &str) -> Result<Vec<u8>, String> {
    let bad = || "expected an even number of hex digits".to_string();
    if text.len() % 2 != 0 || !text.is_ascii() {
        return Err(bad());
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).map_err(|_| bad())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn scratch(name: &str) -> PathBuf {
        let dir = private_dir().unwrap().join(format!("test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        dir
    }

    #[test]
    fn published_file_reads_back_and_is_private() {
        let dir = scratch("publish");
        let path = dir.join("job.rendezvous");
        assert_eq!(read_rendezvous(&path).unwrap(), None);
        publish(&path, 4242, &[1, 2, 255]).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let read = read_rendezvous(&path).unwrap().unwrap();
        assert_eq!((read.port, read.secret, read.pid), (4242, vec![1, 2, 255], std::process::id()));
        publish(&path, 4343, &[7]).unwrap();
        assert_eq!(read_rendezvous(&path).unwrap().unwrap().port, 4343, "a stale file is replaced");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = read_rendezvous(&path).unwrap_err();
        assert!(err.contains("refusing") && err.contains("644"), "{err}");
        fs::write(dir.join("junk"), "hello").unwrap();
        fs::set_permissions(dir.join("junk"), fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_rendezvous(&dir.join("junk")).unwrap_err().contains("not an rvod rendezvous file"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn secret_files_must_be_private_hex() {
        let dir = scratch("secret");
        let path = dir.join("secret");
        fs::write(&path, "00ff10aa\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_secret(&path).unwrap(), vec![0, 255, 16, 170]);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        assert!(read_secret(&path).unwrap_err().contains("chmod 600"));
        fs::write(&path, "xyz").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_secret(&path).unwrap_err().contains("hex digits"));
        std::os::unix::fs::symlink(&path, dir.join("link")).unwrap();
        assert!(read_secret(&dir.join("link")).unwrap_err().contains("not a regular file"));
        assert!(read_secret(&dir.join("missing")).unwrap_err().contains("does not exist"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn run_keys_become_safe_file_names() {
        let path = rendezvous_path("torchrun-a/b c-1").unwrap();
        assert_eq!(path.file_name().unwrap().to_str().unwrap(), "torchrun-a_b_c-1.rendezvous");
    }
}
