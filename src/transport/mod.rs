//! Transports move bytes between the ranks of one communicator; they know nothing of tensors or
//! reduce operations.
//!
//! Every rank of a communicator holds one [`Transport`] whose `rank()`/`size()` are positions inside
//! that communicator. Channels are ordered and reliable per pair of ranks, and all ranks perform the
//! same sequence of operations on each pair, so no framing is needed for data: a receive of `n` bytes
//! reads exactly the `n` bytes the peer sent for it. Blocking operations give up with
//! [`TransportError::Timeout`] when a peer makes no progress for the configured timeout, and with
//! [`TransportError::PeerClosed`] when a peer's connection ends.
//!
//! - [`tcp`]: sockets between processes, on poll; [`shm`]: ranks of one host through a shared-memory segment;
//!   [`ucx`]: ranks on other hosts through UCX (RDMA where the fabric has it; libucp loaded at run time);
//!   [`composite`]: a communicator spanning hosts (shared memory inside a host, TCP or UCX across); [`memory`]:
//!   ranks as threads of one process, for tests.
//! - [`handshake`]: authenticating a fresh connection with the job's secret; [`dropped_connections`]:
//!   rate-limited warnings about connections a listener drops; [`net`]: which address listeners bind to.
//! - [`rendezvous`]: the key-value store ranks find each other through.
//! - [`spin`]: spin-then-block waits; [`waker`]: a wake-up signal waited on together with sockets.

pub mod composite;
pub mod dropped_connections;
pub mod handshake;
pub mod memory;
pub mod net;
pub mod rendezvous;
pub mod shm;
pub mod spin;
pub mod tcp;
pub mod ucx;
pub mod waker;

use std::time::Duration;

use crate::error::{EngineError, TransportErrorInfo};

pub use composite::HostParts;
pub use waker::{Doorbell, Waker};

/// Why a transport operation failed. Each variant names the peer (communicator rank) involved.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("rank {peer} exited or closed its connection")]
    PeerClosed { peer: usize },
    #[error("no progress from rank {peer} for {seconds:.1} s")]
    Timeout { peer: usize, seconds: f64 },
    #[error("I/O error with rank {peer}: {source}")]
    Io {
        peer: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("connection set-up failed: {0}")]
    Setup(String),
    /// A key that one rank sets did not appear in the rendezvous store in time.
    #[error(
        "connection set-up failed: timed out after {seconds:.1} s waiting for rank {peer} to publish '{key}' in \
         the rendezvous store at {store}"
    )]
    KeyTimeout { peer: usize, key: String, seconds: f64, store: String },
    #[error("connection set-up with rank {peer} failed: {detail}")]
    Connect { peer: usize, detail: String },
    #[error("connection set-up failed: {} did not connect in time", ranks_text(peers))]
    NotConnected { peers: Vec<usize> },
    #[error("rank {peer} sent a malformed message: {detail}")]
    Protocol { peer: usize, detail: String },
}

/// The data-path methods of [`Transport`] for a transport whose inherent `send_bytes`, `recv_bytes` and
/// `exchange_bytes` do the work and whose `settle` turns a failure into the error every rank agrees on
/// (TCP and UCX: the control mesh names the rank that died). Used inside `impl Transport for ...`.
macro_rules! settled_data_path {
    () => {
        fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), $crate::transport::TransportError> {
            let outcome = self.send_bytes(peer, data);
            self.settle(outcome)
        }

        fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), $crate::transport::TransportError> {
            let outcome = self.recv_bytes(peer, buf);
            self.settle(outcome)
        }

        fn exchange(
            &mut self,
            to: usize,
            send: &[u8],
            from: usize,
            recv_len: usize,
            sink: &mut dyn FnMut(usize, &[u8]),
        ) -> Result<(), $crate::transport::TransportError> {
            let outcome = self.exchange_bytes(to, send, from, recv_len, sink);
            self.settle(outcome)
        }
    };
}
pub(crate) use settled_data_path;

impl TransportError {
    /// The same error with its peer renumbered: peer `p` becomes `numbers[p]` (kept where `numbers` has no
    /// entry). Turns a part's ranks into the whole communicator's, or a communicator's into global ranks.
    pub fn renumbered(self, numbers: &[usize]) -> TransportError {
        let number = |peer: usize| numbers.get(peer).copied().unwrap_or(peer);
        match self {
            TransportError::PeerClosed { peer } => TransportError::PeerClosed { peer: number(peer) },
            TransportError::Timeout { peer, seconds } => TransportError::Timeout { peer: number(peer), seconds },
            TransportError::Io { peer, source } => TransportError::Io { peer: number(peer), source },
            TransportError::Protocol { peer, detail } => TransportError::Protocol { peer: number(peer), detail },
            TransportError::Connect { peer, detail } => TransportError::Connect { peer: number(peer), detail },
            TransportError::KeyTimeout { peer, key, seconds, store } => {
                TransportError::KeyTimeout { peer: number(peer), key, seconds, store }
            }
            TransportError::NotConnected { peers } => {
                TransportError::NotConnected { peers: peers.into_iter().map(number).collect() }
            }
            other @ TransportError::Setup(_) => other,
        }
    }

    /// The peers this error names (none for a set-up failure that names no rank).
    pub fn peers(&self) -> Vec<usize> {
        match self {
            TransportError::PeerClosed { peer }
            | TransportError::Timeout { peer, .. }
            | TransportError::Io { peer, .. }
            | TransportError::Protocol { peer, .. }
            | TransportError::Connect { peer, .. }
            | TransportError::KeyTimeout { peer, .. } => vec![*peer],
            TransportError::NotConnected { peers } => peers.clone(),
            TransportError::Setup(_) => Vec::new(),
        }
    }
}

impl From<&TransportError> for TransportErrorInfo {
    fn from(e: &TransportError) -> Self {
        TransportErrorInfo { message: e.to_string(), timed_out: matches!(e, TransportError::Timeout { .. }) }
    }
}

impl EngineError {
    /// `op` failed because of `e` (the engine's record of a transport failure).
    pub fn transport(op: impl Into<String>, e: &TransportError) -> EngineError {
        EngineError::Transport { op: op.into(), cause: e.into() }
    }
}

/// "rank 2" or "ranks 1, 3".
fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    format!("rank{} {}", if ranks.len() == 1 { "" } else { "s" }, list.join(", "))
}

/// Why [`Transport::wait_for_activity`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activity {
    /// The local waker fired (new work was submitted on this rank).
    Local,
    /// Some peer has sent bytes that nobody has read yet (it started a negotiation round).
    Peer,
    /// The timeout passed with neither.
    Idle,
}

/// What a transport can do beyond moving bytes, for the algorithms to ask instead of its name. A new
/// transport reports what holds for it; the default, [`Capabilities::NONE`], is always correct (it only
/// keeps algorithms on their general path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// A hand-off (an `exchange` whose bytes the peer takes as soon as they are there) costs a few
    /// microseconds, as over shared memory, not the tens of a socket round trip (TCP: ~22 us). Algorithms
    /// may then cut a buffer into many small exchanges to pipeline them (the two-rank allreduce in
    /// `ring::allreduce`) where a costly hand-off keeps them to few large ones.
    pub cheap_handoffs: bool,
}

impl Capabilities {
    /// Nothing beyond the trait's required methods.
    pub const NONE: Capabilities = Capabilities { cheap_handoffs: false };

    /// What holds for every peer of a transport made of the parts `a` and `b`.
    pub fn common(a: Capabilities, b: Capabilities) -> Capabilities {
        Capabilities { cheap_handoffs: a.cheap_handoffs && b.cheap_handoffs }
    }
}

/// Ordered, reliable byte channels to every other rank of one communicator.
///
/// Every transport implements `rank`, `size`, `label`, `send`, `recv`, `exchange`, `wait_for_activity`
/// and `close`. The other methods have defaults that are correct for any transport and say "cannot":
/// a transport overrides those it can do better, and algorithms ask them (and [`Capabilities`]), never
/// the transport's name, so a new transport needs no change to the algorithms. `sendrecv` is a
/// convenience over `exchange`.
pub trait Transport: Send {
    /// This rank's position in the communicator.
    fn rank(&self) -> usize;
    /// Number of ranks in the communicator.
    fn size(&self) -> usize;
    /// What carries the bytes ("tcp", "shm", "ucx", "shm+tcp", "shm+ucx", "memory"), for logs, the timeline and Python's
    /// introspection only: what the transport can do is [`Transport::capabilities`], never this label.
    fn label(&self) -> &'static str;

    /// Optional: what this transport can do beyond the required methods (default: nothing).
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
    }

    /// Send all of `data` to `peer`. Returns once the bytes are handed off (the peer may not have read them).
    /// Safe to call for any size: implementations must not deadlock when `peer` is simultaneously sending to us
    /// a message of any size (they buffer or interleave reading as needed).
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), TransportError>;

    /// Receive exactly `buf.len()` bytes from `peer`.
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), TransportError>;

    /// Send `send` to `to` while receiving `recv_len` bytes from `from`, both progressing at once (full duplex).
    /// Received bytes are handed to `sink(offset, bytes)` in order, in pieces of any size, as they arrive;
    /// `offset` is the position of `bytes` within the whole incoming message. This lets a reduction consume
    /// data while it is still streaming in, without staging the whole message. `to` and `from` may be the same
    /// peer. Zero-length sides are allowed.
    fn exchange(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError>;

    /// Optional: copy the next `buf.len()` bytes from `peer` into `buf` without consuming them, if they have
    /// all arrived; false (and nothing copied) otherwise, or where the transport cannot look ahead.
    fn peek(&mut self, _peer: usize, _buf: &mut [u8]) -> bool {
        false
    }

    /// Full-duplex exchange straight into `recv`; a transport that can receive in place overrides it (UCX).
    fn sendrecv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<(), TransportError> {
        let len = recv.len();
        self.exchange(to, send, from, len, &mut |off, bytes| {
            recv[off..off + bytes.len()].copy_from_slice(bytes);
        })
    }

    /// Block until `waker` fires, any peer has unread incoming bytes or a peer's connection closed
    /// (reported as [`Activity::Peer`]; the following `recv` then returns the error), or `timeout` passes.
    fn wait_for_activity(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError>;

    /// Optional: what a [`Waker`] should ring so that this transport's `wait_for_activity` notices it, for
    /// transports that do not sleep in `poll(2)` on the waker's fd.
    fn doorbell(&self) -> Option<Doorbell> {
        None
    }

    /// Optional: remember that this rank is failing because of `cause` (the first call counts), so that
    /// `close` can tell the peers which rank to name; transports whose peers find out by themselves ignore it.
    fn note_failure(&mut self, _cause: &TransportError) {}

    /// Close every connection now, so peers blocked on this rank fail fast instead of waiting for a timeout.
    fn close(&mut self);

    /// Optional: the local and cross parts of a communicator whose members span hosts (see [`composite`]);
    /// `None` where all members are reached the same way.
    fn hosts(&mut self) -> Option<HostParts<'_>> {
        None
    }

    /// Optional: memory every rank of the communicator can read, where the ranks share it (see [`Staging`]).
    fn staging(&mut self) -> Option<&mut dyn Staging> {
        None
    }

    /// Optional: a way to sleep until this transport may have activity without borrowing it (see
    /// [`IdleWaiter`]); `None` where waiting needs the transport itself (then its engine thread keeps it while
    /// it sleeps).
    fn idle_waiter(&self) -> Option<Box<dyn IdleWaiter>> {
        None
    }
}

/// Sleeps like [`Transport::wait_for_activity`] but without the transport, so that an idle engine thread
/// can sleep while another thread (a caller running its own small op) uses the transport. It returns when
/// the waker fires, a peer may have sent something, or `timeout` passes, and may return early for no
/// reason: the engine thread then asks the transport itself (`wait_for_activity` with a zero timeout),
/// which also checks what the waiter cannot (peers that died, bytes already taken out of a ring).
pub trait IdleWaiter: Send + Sync {
    fn wait(&self, waker: &Waker, timeout: Duration);

    /// Whether every peer has sent this rank bytes it has not read yet (a glance: the answer may be stale
    /// by the time it is used). A caller whose peers all sent can expect its next exchange not to wait.
    fn every_peer_sent(&self) -> bool {
        false
    }
}

/// Staging areas: one region of memory per rank that every rank of the communicator can read (the
/// shared-memory transport's fusion buffers), and a step counter per rank that orders access to them.
///
/// A rank writes only its own area, and only while no other rank reads it; which is when is the business
/// of the protocol built on top (`ring::staged`), which tells the others how far it got with
/// [`Staging::arrive`] and waits for them with [`Staging::wait_for`]. All ranks run the same sequence of
/// steps, so step numbers agree.
pub trait Staging {
    /// Bytes of each rank's area.
    fn area_len(&self) -> usize;
    /// Start of `rank`'s area: `area_len()` bytes, page aligned, valid while the transport lives.
    fn area(&self, rank: usize) -> *mut u8;
    /// Steps this rank has completed.
    fn completed(&self) -> u64;
    /// Complete the next step: publish it to the other ranks and return its number.
    fn arrive(&mut self) -> u64;
    /// Wait until every other rank has completed `step`; fails like a receive if one dies, closes or
    /// makes no progress for the timeout.
    fn wait_for(&mut self, step: u64) -> Result<(), TransportError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_sets_peer_is_named_by_its_global_rank() {
        // Process set [1, 3]: communicator rank 1 is global rank 3.
        let set = [1, 3];
        let named = |e: TransportError| e.renumbered(&set).to_string();
        assert_eq!(named(TransportError::PeerClosed { peer: 1 }), "rank 3 exited or closed its connection");
        assert_eq!(named(TransportError::Timeout { peer: 0, seconds: 2.0 }), "no progress from rank 1 for 2.0 s");
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(named(TransportError::Io { peer: 1, source: io }), "I/O error with rank 3: reset");
        let protocol = TransportError::Protocol { peer: 1, detail: "bad".into() };
        assert_eq!(named(protocol), "rank 3 sent a malformed message: bad");
        let connect = TransportError::Connect { peer: 0, detail: "refused".into() };
        assert_eq!(named(connect), "connection set-up with rank 1 failed: refused");
        let absent = TransportError::NotConnected { peers: vec![0, 1] };
        assert_eq!(named(absent), "connection set-up failed: ranks 1, 3 did not connect in time");
        assert_eq!(named(TransportError::Setup("x".into())), "connection set-up failed: x");
        assert_eq!(named(TransportError::PeerClosed { peer: 5 }), "rank 5 exited or closed its connection");
    }
}
