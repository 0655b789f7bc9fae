//! The timeline file on disk: a JSON array of Chrome trace events that is valid JSON after every write.
//!
//! Layout: `[\n<header>` then `,\n<event>` per event, then `\n]`. An append overwrites the closing `\n]`
//! with `,\n<events>\n]` in ONE positioned write, so a rank killed at any moment (kill -9, Ctrl-C, a crash)
//! leaves the file before that write or after it. (A complete rewrite and atomic rename per flush would
//! cost O(file size) per flush; this costs O(new events).) One window remains: Linux checks for a fatal
//! signal between the pages of a write, so a SIGKILL landing during a write that spans pages can leave it
//! cut at a page boundary (a write lasts microseconds; flushes come every 100 ms). The next append (of any
//! rank) then cuts the file back to the last whole event and closes it again: only that write's events
//! are lost, never the ones before it.
//!
//! Every rank of a job appends to the same file, each under an exclusive `flock`, so the activity of all
//! ranks lands in one file. The header is a metadata event carrying a session key (the job and the
//! number of the `start_timeline`): the first writer of a session replaces whatever the file held before
//! (an older run, a damaged file); later writers of the same session append; a writer whose session was
//! replaced by a newer one stops writing instead of damaging it.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

const OPEN: &[u8] = b"[\n";
const CLOSE: &[u8] = b"\n]";

/// One writer's handle on the shared timeline file.
pub struct TraceFile {
    file: File,
    /// `[\n` and the session's header event: the bytes every file of this session starts with.
    prefix: Vec<u8>,
}

/// Holds the file's exclusive lock until dropped.
struct Locked<'a>(&'a File);

impl<'a> Locked<'a> {
    fn new(file: &'a File) -> io::Result<Locked<'a>> {
        // SAFETY: flock on a descriptor this `File` owns for the guard's lifetime.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Locked(file))
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // SAFETY: as in `new`; unlocking a lock this guard took.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl TraceFile {
    /// Open (creating it if needed) the timeline at `path` for the session whose header event is
    /// `header` (one JSON object).
    pub fn open(path: &Path, header: &str) -> io::Result<TraceFile> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        let mut prefix = OPEN.to_vec();
        prefix.extend_from_slice(header.as_bytes());
        let trace = TraceFile { file, prefix };
        {
            let _lock = Locked::new(&trace.file)?;
            if !trace.is_our_session()? {
                trace.restart()?;
            } else if !trace.ends_closed()? {
                trace.repair()?;
            }
        }
        Ok(trace)
    }

    fn is_our_session(&self) -> io::Result<bool> {
        let mut start = vec![0u8; self.prefix.len()];
        let read = read_fully_at(&self.file, &mut start, 0)?;
        Ok(read == start.len() && start == self.prefix)
    }

    fn ends_closed(&self) -> io::Result<bool> {
        let len = self.file.metadata()?.len();
        if len < (self.prefix.len() + CLOSE.len()) as u64 {
            return Ok(false);
        }
        let mut tail = [0u8; 2];
        let read = read_fully_at(&self.file, &mut tail, len - CLOSE.len() as u64)?;
        Ok(read == tail.len() && tail == CLOSE)
    }

    /// Replace the file's contents with this session's empty timeline.
    fn restart(&self) -> io::Result<()> {
        self.file.set_len(0)?;
        let mut fresh = self.prefix.clone();
        fresh.extend_from_slice(CLOSE);
        self.file.write_all_at(&fresh, 0)
    }

    /// A file of this session that does not end closed: a write was cut short (a rank SIGKILLed between
    /// its pages, a full disk) or something outside rvod wrote to it. Keep every whole event before the
    /// damage: cut back to the last `},\n{` (event boundaries are the only place a raw newline appears,
    /// since names are escaped) and close the array there; start afresh when no boundary is left.
    fn repair(&self) -> io::Result<()> {
        let len = self.file.metadata()?.len();
        // The header's closing brace is the earliest boundary worth keeping.
        let floor = self.prefix.len().saturating_sub(1) as u64;
        match last_boundary(&self.file, floor, len)? {
            Some(brace) => {
                self.file.set_len(brace + 1)?;
                self.file.write_all_at(CLOSE, brace + 1)
            }
            None => self.restart(),
        }
    }

    /// Append `events` (JSON objects joined by `,\n`). Returns false, writing nothing, if a newer session
    /// took the file over.
    pub fn append(&self, events: &str) -> io::Result<bool> {
        if events.is_empty() {
            return Ok(true);
        }
        let _lock = Locked::new(&self.file)?;
        if !self.is_our_session()? {
            return Ok(false);
        }
        if !self.ends_closed()? {
            self.repair()?;
        }
        let at = self.file.metadata()?.len() - CLOSE.len() as u64;
        let mut bytes = Vec::with_capacity(events.len() + 4);
        bytes.extend_from_slice(b",\n");
        bytes.extend_from_slice(events.as_bytes());
        bytes.extend_from_slice(CLOSE);
        self.file.write_all_at(&bytes, at)?;
        Ok(true)
    }
}

/// Between two events: `},\n{`.
const BOUNDARY: &[u8] = b"},\n{";
/// Bytes read at a time while looking back for a boundary.
const SCAN_CHUNK: u64 = 64 << 10;

/// The offset of the closing brace of the last event boundary at or after `floor` in the first `len`
/// bytes of `file`.
fn last_boundary(file: &File, floor: u64, len: u64) -> io::Result<Option<u64>> {
    let overlap = BOUNDARY.len() as u64 - 1;
    let mut end = len;
    while end >= floor + BOUNDARY.len() as u64 {
        let start = end.saturating_sub(SCAN_CHUNK).max(floor);
        let mut chunk = vec![0u8; (end - start) as usize];
        let read = read_fully_at(file, &mut chunk, start)?;
        chunk.truncate(read);
        if let Some(at) = chunk.windows(BOUNDARY.len()).rposition(|w| w == BOUNDARY) {
            return Ok(Some(start + at as u64));
        }
        if start == floor {
            break;
        }
        end = start + overlap;
    }
    Ok(None)
}

fn read_fully_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A strict JSON validator (RFC 8259 grammar), enough to prove a file would load.
    pub(crate) fn is_valid_json(text: &str) -> bool {
        let b = text.as_bytes();
        let mut i = 0;
        skip_ws(b, &mut i);
        if !value(b, &mut i) {
            return false;
        }
        skip_ws(b, &mut i);
        i == b.len()
    }

    fn skip_ws(b: &[u8], i: &mut usize) {
        while *i < b.len() && matches!(b[*i], b' ' | b'\n' | b'\r' | b'\t') {
            *i += 1;
        }
    }

    fn value(b: &[u8], i: &mut usize) -> bool {
        skip_ws(b, i);
        match b.get(*i) {
            Some(b'{') => sequence(b, i, b'}', true),
            Some(b'[') => sequence(b, i, b']', false),
            Some(b'"') => string(b, i),
            Some(b't') => literal(b, i, b"true"),
            Some(b'f') => literal(b, i, b"false"),
            Some(b'n') => literal(b, i, b"null"),
            Some(c) if *c == b'-' || c.is_ascii_digit() => number(b, i),
            _ => false,
        }
    }

    fn sequence(b: &[u8], i: &mut usize, close: u8, object: bool) -> bool {
        *i += 1;
        skip_ws(b, i);
        if b.get(*i) == Some(&close) {
            *i += 1;
            return true;
        }
        loop {
            if object {
                skip_ws(b, i);
                if !string(b, i) {
                    return false;
                }
                skip_ws(b, i);
                if b.get(*i) != Some(&b':') {
                    return false;
                }
                *i += 1;
            }
            if !value(b, i) {
                return false;
            }
            skip_ws(b, i);
            match b.get(*i) {
                Some(b',') => *i += 1,
                Some(c) if *c == close => {
                    *i += 1;
                    return true;
                }
                _ => return false,
            }
        }
    }

    fn string(b: &[u8], i: &mut usize) -> bool {
        if b.get(*i) != Some(&b'"') {
            return false;
        }
        *i += 1;
        while let Some(&c) = b.get(*i) {
            *i += 1;
            match c {
                b'"' => return true,
                b'\\' => *i += 1,
                c if c < 0x20 => return false,
                _ => {}
            }
        }
        false
    }

    fn literal(b: &[u8], i: &mut usize, word: &[u8]) -> bool {
        let ok = b.get(*i..*i + word.len()) == Some(word);
        *i += word.len();
        ok
    }

    fn number(b: &[u8], i: &mut usize) -> bool {
        let start = *i;
        while *i < b.len() && matches!(b[*i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
            *i += 1;
        }
        std::str::from_utf8(&b[start..*i]).is_ok_and(|s| s.parse::<f64>().is_ok())
    }

    fn temp_path(tag: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("rvod-timeline-{tag}-{}.json", std::process::id()))
    }

    const HEADER_A: &str = r#"{"name":"process_name","ph":"M","pid":0,"args":{"session":"a"}}"#;
    const HEADER_B: &str = r#"{"name":"process_name","ph":"M","pid":0,"args":{"session":"b"}}"#;

    #[test]
    fn validator_rejects_what_json_rejects() {
        assert!(is_valid_json(r#"[{"a":[1,-2.5e3,"x\"y"],"b":null,"c":true}]"#));
        assert!(!is_valid_json(r#"[{"a":1},]"#));
        assert!(!is_valid_json(r#"[{"a":1}"#));
        assert!(!is_valid_json(r#"[{"a":1}],"#));
    }

    #[test]
    fn valid_json_after_open_and_after_every_append() {
        let path = temp_path("append");
        let file = TraceFile::open(&path, HEADER_A).unwrap();
        assert!(is_valid_json(&std::fs::read_to_string(&path).unwrap()));
        for i in 0..5 {
            let events = format!(
                r#"{{"name":"e{i}","ph":"i","ts":{i},"pid":1,"tid":0}},
{{"name":"f{i}","ph":"i","ts":{i},"pid":1,"tid":0}}"#
            );
            assert!(file.append(&events).unwrap());
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(is_valid_json(&text), "not JSON after append {i}: {text}");
            assert!(text.contains(&format!("\"e{i}\"")) && text.ends_with("\n]"));
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn writers_of_one_session_share_the_file_and_an_old_run_is_replaced() {
        let path = temp_path("share");
        std::fs::write(&path, "[\n{\"stale\":1},\n{\"cut off").unwrap();
        let rank0 = TraceFile::open(&path, HEADER_A).unwrap();
        let rank1 = TraceFile::open(&path, HEADER_A).unwrap();
        assert!(rank1.append(r#"{"name":"from1","ph":"i","ts":1,"pid":1,"tid":1}"#).unwrap());
        assert!(rank0.append(r#"{"name":"from0","ph":"i","ts":2,"pid":1,"tid":0}"#).unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(is_valid_json(&text), "{text}");
        assert!(text.contains("from0") && text.contains("from1") && !text.contains("stale"));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_newer_session_wins_and_the_old_writer_leaves_it_alone() {
        let path = temp_path("session");
        let old = TraceFile::open(&path, HEADER_A).unwrap();
        assert!(old.append(r#"{"name":"old","ph":"i","ts":1,"pid":1,"tid":0}"#).unwrap());
        let new = TraceFile::open(&path, HEADER_B).unwrap();
        assert!(!old.append(r#"{"name":"late","ph":"i","ts":2,"pid":1,"tid":0}"#).unwrap());
        assert!(new.append(r#"{"name":"new","ph":"i","ts":3,"pid":1,"tid":0}"#).unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(is_valid_json(&text) && text.contains("\"new\"") && !text.contains("old\"") && !text.contains("late"));
        let _ = std::fs::remove_file(&path);
    }

    /// Cut the file at `path` to `len` bytes, as a write cut short by SIGKILL leaves it.
    fn cut(path: &Path, len: u64) {
        std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
    }

    #[test]
    fn a_write_cut_short_costs_only_its_own_events() {
        let path = temp_path("cut");
        let file = TraceFile::open(&path, HEADER_A).unwrap();
        assert!(file.append(r#"{"name":"a","ph":"i","ts":1,"pid":1,"tid":0}"#).unwrap());
        let kept = std::fs::metadata(&path).unwrap().len();
        // A batch of two events (the second big enough to span chunks of the scan), cut inside its second.
        let big = format!(r#"{{"name":"b","ph":"i","ts":2,"pid":1,"tid":0,"args":{{"x":"{}"}}}}"#, "y".repeat(200_000));
        assert!(file.append(&format!("{},\n{big}", r#"{"name":"c","ph":"i","ts":2,"pid":1,"tid":0}"#)).unwrap());
        cut(&path, kept + 150_000);
        // The next writer (another rank, or this one) keeps a and c, and adds d.
        let other = TraceFile::open(&path, HEADER_A).unwrap();
        assert!(other.append(r#"{"name":"d","ph":"i","ts":3,"pid":1,"tid":1}"#).unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(is_valid_json(&text), "{}", &text[text.len().saturating_sub(300)..]);
        for name in ["\"a\"", "\"c\"", "\"d\""] {
            assert!(text.contains(name), "{name} lost: {text:.300}");
        }
        assert!(!text.contains("\"b\""));
        // Cut inside the first event: only the header is left to keep.
        cut(&path, HEADER_A.len() as u64 + 10);
        assert!(file.append(r#"{"name":"e","ph":"i","ts":4,"pid":1,"tid":0}"#).unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            is_valid_json(&text) && text.starts_with(&format!("[\n{HEADER_A},\n")) && text.contains("\"e\""),
            "{text}"
        );
        // Cut inside the header: not this session's file any more, so it starts afresh.
        cut(&path, 5);
        assert!(!file.append(r#"{"name":"f","ph":"i","ts":5,"pid":1,"tid":0}"#).unwrap());
        let _ = std::fs::remove_file(&path);
    }
}
