//! The connection to one peer ([`Link`]: the socket, the bytes read ahead of their receive, how the
//! connection ended), one non-blocking read or write on it, and the [`Cause`] byte a closing rank leaves
//! its peers as TCP urgent data (see the parent module's doc for why).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::poll_once;
use crate::transport::TransportError;

/// How a peer's connection ended, seen while reading ahead; reported once its pending bytes are consumed.
pub(super) enum Ended {
    Closed,
    Failed(io::Error),
}

/// The connection to one peer.
pub(super) struct Link {
    pub(super) stream: TcpStream,
    /// Bytes read ahead; `pending[pending_start..]` are not consumed yet.
    pub(super) pending: Vec<u8>,
    pub(super) pending_start: usize,
    pub(super) ended: Option<Ended>,
    /// The urgent byte (a [`Cause`]) the peer sent, taken when `poll` reported it: a normal read that passes
    /// the byte's place in the stream discards it.
    pub(super) urgent: Option<u8>,
}

impl Link {
    pub(super) fn new(stream: TcpStream) -> Link {
        Link { stream, pending: Vec::new(), pending_start: 0, ended: None, urgent: None }
    }

    pub(super) fn pending(&self) -> &[u8] {
        &self.pending[self.pending_start..]
    }

    pub(super) fn consume_pending(&mut self, n: usize) {
        self.pending_start += n;
        if self.pending_start == self.pending.len() {
            self.pending.clear();
            self.pending_start = 0;
        }
    }

    pub(super) fn append_pending(&mut self, bytes: &[u8]) {
        if self.pending_start > 0 {
            self.pending.drain(..self.pending_start);
            self.pending_start = 0;
        }
        self.pending.extend_from_slice(bytes);
    }

    /// Takes the peer's urgent byte if `revents` says it is there.
    pub(super) fn take_urgent(&mut self, revents: libc::c_short) {
        if revents & libc::POLLPRI != 0 {
            if let Some(byte) = recv_urgent(&self.stream) {
                self.urgent = Some(byte);
            }
        }
    }

    /// The error to report to a receive that has consumed every pending byte, if the link has ended.
    pub(super) fn end_error(&mut self, peer: usize) -> Option<TransportError> {
        match self.ended.take()? {
            Ended::Closed => {
                self.ended = Some(Ended::Closed);
                Some(TransportError::PeerClosed { peer })
            }
            Ended::Failed(source) => {
                // Report the cause once; afterwards the link is simply closed.
                self.ended = Some(Ended::Closed);
                Some(TransportError::Io { peer, source })
            }
        }
    }
}

/// Why this rank gave up on the communicator, as passed on to its peers when it closes: the rank it blames
/// and whether for silence (a time-out) rather than a closed connection. One byte on the wire: the rank
/// shifted left by one, the low bit set for a time-out; ranks from 128 up cannot be told (the peers then
/// name this rank, as they would without the byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Cause {
    pub(super) peer: usize,
    pub(super) timed_out: bool,
}

impl Cause {
    pub(super) fn of(err: &TransportError, rank: usize, size: usize) -> Option<Cause> {
        let (peer, timed_out) = match err {
            TransportError::PeerClosed { peer } | TransportError::Io { peer, .. } => (*peer, false),
            TransportError::Timeout { peer, .. } => (*peer, true),
            TransportError::Setup(_)
            | TransportError::KeyTimeout { .. }
            | TransportError::Connect { .. }
            | TransportError::NotConnected { .. }
            | TransportError::Protocol { .. } => return None,
        };
        (peer != rank && peer < size).then_some(Cause { peer, timed_out })
    }

    pub(super) fn to_byte(self) -> Option<u8> {
        (self.peer < 128).then(|| ((self.peer as u8) << 1) | u8::from(self.timed_out))
    }

    pub(super) fn from_byte(byte: u8) -> Cause {
        Cause { peer: usize::from(byte >> 1), timed_out: byte & 1 == 1 }
    }

    pub(super) fn error(self, timeout: Duration) -> TransportError {
        if self.timed_out {
            TransportError::Timeout { peer: self.peer, seconds: timeout.as_secs_f64() }
        } else {
            TransportError::PeerClosed { peer: self.peer }
        }
    }
}

/// Longest time `close` spends passing its [`Cause`] to peers whose send buffers are full.
pub(super) const CAUSE_SEND_LIMIT: Duration = Duration::from_millis(100);

/// Sends `byte` as TCP urgent data, waiting until `deadline` for room in the send buffer; whether it went.
pub(super) fn send_urgent(stream: &TcpStream, byte: u8, deadline: Instant) -> bool {
    let fd = stream.as_raw_fd();
    loop {
        // SAFETY: `fd` is an open socket and the buffer is one valid byte for the duration of the call.
        let sent = unsafe {
            libc::send(fd, (&byte as *const u8).cast(), 1, libc::MSG_OOB | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        };
        if sent == 1 {
            return true;
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return false;
                }
                let mut fds = [libc::pollfd { fd, events: libc::POLLOUT, revents: 0 }];
                if poll_once(&mut fds, left).is_err() {
                    return false;
                }
            }
            _ => return false,
        }
    }
}

/// The urgent byte the peer sent on `stream`, if one has arrived and was not read yet.
pub(super) fn recv_urgent(stream: &TcpStream) -> Option<u8> {
    let mut byte = 0u8;
    loop {
        // SAFETY: `stream` is an open socket and the buffer is one valid, writable byte for the call.
        let got = unsafe {
            libc::recv(stream.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_OOB | libc::MSG_DONTWAIT)
        };
        if got == 1 {
            return Some(byte);
        }
        if got < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return None;
    }
}

/// Outcome of one non-blocking read or write.
pub(super) enum Step {
    Moved(usize),
    WouldBlock,
}

pub(super) fn is_disconnect(err: &io::Error) -> bool {
    matches!(err.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted | io::ErrorKind::BrokenPipe)
}

pub(super) fn read_step(mut stream: &TcpStream, buf: &mut [u8], peer: usize) -> Result<Step, TransportError> {
    loop {
        return match stream.read(buf) {
            Ok(0) => Err(TransportError::PeerClosed { peer }),
            Ok(n) => Ok(Step::Moved(n)),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(Step::WouldBlock),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) if is_disconnect(&err) => Err(TransportError::PeerClosed { peer }),
            Err(source) => Err(TransportError::Io { peer, source }),
        };
    }
}

pub(super) fn write_step(mut stream: &TcpStream, data: &[u8], peer: usize) -> Result<Step, TransportError> {
    loop {
        return match stream.write(data) {
            Ok(n) => Ok(Step::Moved(n)),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(Step::WouldBlock),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) if is_disconnect(&err) => Err(TransportError::PeerClosed { peer }),
            Err(source) => Err(TransportError::Io { peer, source }),
        };
    }
}
