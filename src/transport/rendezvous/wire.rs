//! The store's request and response framing, shared by client and server.
//!
//! After the handshake the client sends requests and reads one response to each, in order
//! (integers big-endian):
//!
//! ```text
//! request   op u8 | key length u16 | key | body
//!   SET     body = value length u32 | value
//!   GET     body = longest wait in milliseconds u64
//!   ADD     body = delta i64
//!   DELETE  body = (empty)
//! response  status u8 | body
//!   OK      GET: value length u32 | value;  ADD: new value i64;  DELETE: existed u8;  SET: (empty)
//!   MISSING (GET only) the key did not appear within the wait
//!   FAILED  message length u16 | message (UTF-8)
//! ```
//!
//! Keys are at most [`MAX_KEY_LEN`] bytes and values at most [`MAX_VALUE_LEN`]; either side treats a larger
//! length, an unknown op or an unknown status as a broken connection. Values and messages are read as their
//! bytes arrive ([`read_arriving`], [`read_arriving_async`]): a declared length costs memory only once the
//! bytes have come.

use std::io::{self, Read};

use tokio::io::{AsyncRead, AsyncReadExt};

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 4 * 1024;
/// Largest value, in bytes.
pub const MAX_VALUE_LEN: usize = 64 * 1024 * 1024;

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    Set = 1,
    Get = 2,
    Add = 3,
    Delete = 4,
}

impl Op {
    pub fn from_code(code: u8) -> Option<Op> {
        match code {
            1 => Some(Op::Set),
            2 => Some(Op::Get),
            3 => Some(Op::Add),
            4 => Some(Op::Delete),
            _ => None,
        }
    }
}

pub const STATUS_OK: u8 = 0;
pub const STATUS_MISSING: u8 = 1;
pub const STATUS_FAILED: u8 = 2;

/// The op and key that open every request. `key` must be at most [`MAX_KEY_LEN`] bytes.
pub fn request_header(op: Op, key: &[u8], body_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(3 + key.len() + body_len);
    out.push(op as u8);
    out.extend_from_slice(&(key.len() as u16).to_be_bytes());
    out.extend_from_slice(key);
    out
}

/// Memory set aside for a value before its bytes arrive; a larger one grows as they come.
const RESERVED: usize = 16 * 1024;

/// The `len` bytes that come next on `stream`, or [`io::ErrorKind::UnexpectedEof`] if it ends first.
pub fn read_arriving(stream: &mut impl Read, len: usize) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(len.min(RESERVED));
    stream.take(len as u64).read_to_end(&mut bytes)?;
    whole(bytes, len)
}

/// [`read_arriving`] for a tokio stream.
pub async fn read_arriving_async<R: AsyncRead + Unpin>(stream: &mut R, len: usize) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(len.min(RESERVED));
    stream.take(len as u64).read_to_end(&mut bytes).await?;
    whole(bytes, len)
}

fn whole(bytes: Vec<u8>, len: usize) -> io::Result<Vec<u8>> {
    if bytes.len() < len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "early eof"));
    }
    Ok(bytes)
}
