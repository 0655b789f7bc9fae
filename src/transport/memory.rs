//! In-process transport for tests: the ranks of a communicator are threads of one process.
//!
//! Every rank owns an inbox holding one unbounded byte queue per sender, so `send` never blocks and
//! full-duplex exchanges cannot deadlock. Receives block on the inbox's condition variable until bytes
//! arrive, the sender closes (reported only once its queued bytes are drained, as with a TCP FIN), or no
//! byte has arrived for the timeout. `exchange` hands incoming bytes to its sink in pseudo-random,
//! often odd-sized pieces, so algorithms are exercised against arbitrary piece boundaries.
//! Dropping a `MemoryTransport` closes it, so a rank thread that stops early makes its peers fail fast.
//! `Recorded` (tests only) wraps one, records what it sends and claims given capabilities.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::transport::{Activity, IdleWaiter, Transport, TransportError, Waker};

/// How long a blocked receive waits for a peer that makes no progress, unless told otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How often `wait_for_activity` looks at the waker while no peer bytes arrive.
const WAKER_POLL_INTERVAL: Duration = Duration::from_millis(1);

/// Largest piece `exchange` hands to its sink at once.
const MAX_PIECE_BYTES: u64 = 256 * 1024;

/// Largest of the deliberately tiny pieces, small enough to split single elements.
const MAX_TINY_PIECE_BYTES: u64 = 13;

/// Bytes waiting for one rank.
struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
}

struct InboxState {
    /// Unread bytes, indexed by sender.
    pending: Vec<VecDeque<u8>>,
    /// Whether each sender has closed.
    sender_closed: Vec<bool>,
    /// Whether the inbox's own rank has closed (sends to it then fail).
    owner_closed: bool,
}

impl Inbox {
    fn new(size: usize) -> Inbox {
        Inbox {
            state: Mutex::new(InboxState {
                pending: vec![VecDeque::new(); size],
                sender_closed: vec![false; size],
                owner_closed: false,
            }),
            arrived: Condvar::new(),
        }
    }

    /// A rank thread never panics while holding the lock, and the queues stay consistent even if one
    /// did, so a poisoned lock is simply taken over.
    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, InboxState>, timeout: Duration) -> MutexGuard<'a, InboxState> {
        match self.arrived.wait_timeout(guard, timeout) {
            Ok((guard, _)) => guard,
            Err(poisoned) => poisoned.into_inner().0,
        }
    }
}

/// Deterministic xorshift sequence choosing how many bytes each sink call receives at most.
struct PieceSizes {
    state: u64,
}

impl PieceSizes {
    fn for_rank(rank: usize) -> PieceSizes {
        PieceSizes { state: 0x9E37_79B9_7F4A_7C15 ^ (rank as u64).wrapping_mul(0xD1B5_4A32_D192_ED03) | 1 }
    }

    fn next_limit(&mut self) -> usize {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        let draw = self.state >> 8;
        let limit = if self.state % 3 == 0 { 1 + draw % MAX_TINY_PIECE_BYTES } else { 1 + draw % MAX_PIECE_BYTES };
        limit as usize
    }
}

/// The idle waiter of a rank without peers: it waits for the waker alone.
struct AloneWaiter;

impl IdleWaiter for AloneWaiter {
    fn wait(&self, waker: &Waker, timeout: Duration) {
        waker.wait(timeout);
    }

    fn every_peer_sent(&self) -> bool {
        true // there are none
    }
}

/// One rank's end of an in-process mesh.
pub struct MemoryTransport {
    rank: usize,
    inboxes: Arc<Vec<Inbox>>,
    timeout: Duration,
    closed: bool,
    piece_sizes: PieceSizes,
    /// Holds a piece between taking it out of the inbox and handing it to a sink, so the sink runs unlocked.
    piece: Vec<u8>,
}

impl MemoryTransport {
    /// One connected transport per rank of an `n`-rank communicator, with the default timeout.
    pub fn mesh(n: usize) -> Vec<MemoryTransport> {
        MemoryTransport::mesh_with_timeout(n, DEFAULT_TIMEOUT)
    }

    /// One connected transport per rank; blocked receives fail after `timeout` without progress.
    pub fn mesh_with_timeout(n: usize, timeout: Duration) -> Vec<MemoryTransport> {
        let inboxes = Arc::new((0..n).map(|_| Inbox::new(n)).collect::<Vec<_>>());
        (0..n)
            .map(|rank| MemoryTransport {
                rank,
                inboxes: Arc::clone(&inboxes),
                timeout,
                closed: false,
                piece_sizes: PieceSizes::for_rank(rank),
                piece: Vec::new(),
            })
            .collect()
    }

    fn check_usable(&self, peer: usize) -> Result<(), TransportError> {
        if self.closed {
            return Err(TransportError::Io {
                peer,
                source: io::Error::new(io::ErrorKind::NotConnected, "this rank's transport is closed"),
            });
        }
        if peer >= self.inboxes.len() {
            return Err(TransportError::Io {
                peer,
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("no rank {peer} in a communicator of {}", self.inboxes.len()),
                ),
            });
        }
        Ok(())
    }

    fn timeout_error(&self, peer: usize) -> TransportError {
        TransportError::Timeout { peer, seconds: self.timeout.as_secs_f64() }
    }

    /// Receive `len` bytes from `peer`, passing each piece taken from the queue to `deliver(offset, piece)`.
    /// With `split` the pieces are additionally cut at pseudo-random sizes.
    fn receive(
        &mut self,
        peer: usize,
        len: usize,
        split: bool,
        deliver: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError> {
        self.check_usable(peer)?;
        let inbox = &self.inboxes[self.rank];
        let mut received = 0;
        while received < len {
            let mut state = inbox.lock();
            let deadline = Instant::now() + self.timeout;
            while state.pending[peer].is_empty() {
                if state.sender_closed[peer] {
                    return Err(TransportError::PeerClosed { peer });
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(self.timeout_error(peer));
                }
                state = inbox.wait(state, deadline - now);
            }
            let queue = &mut state.pending[peer];
            let mut take = queue.len().min(len - received);
            if split {
                take = take.min(self.piece_sizes.next_limit());
            }
            let (front, back) = queue.as_slices();
            let from_front = take.min(front.len());
            self.piece.clear();
            self.piece.extend_from_slice(&front[..from_front]);
            self.piece.extend_from_slice(&back[..take - from_front]);
            queue.drain(..take);
            drop(state);
            deliver(received, &self.piece);
            received += take;
        }
        Ok(())
    }
}

impl Transport for MemoryTransport {
    fn label(&self) -> &'static str {
        "memory"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.inboxes.len()
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), TransportError> {
        self.check_usable(peer)?;
        if data.is_empty() {
            return Ok(());
        }
        let inbox = &self.inboxes[peer];
        let mut state = inbox.lock();
        if state.owner_closed {
            return Err(TransportError::PeerClosed { peer });
        }
        state.pending[self.rank].extend(data);
        drop(state);
        inbox.arrived.notify_all();
        Ok(())
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), TransportError> {
        let len = buf.len();
        self.receive(peer, len, false, &mut |offset, bytes| {
            buf[offset..offset + bytes.len()].copy_from_slice(bytes);
        })
    }

    fn exchange(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError> {
        // Queues are unbounded, so sending everything first still lets the peer's send to us proceed.
        self.send(to, send)?;
        self.receive(from, recv_len, true, sink)
    }

    fn wait_for_activity(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError> {
        self.check_usable(self.rank)?;
        if self.inboxes.len() == 1 {
            // No peers: only the waker can wake us, so block on it alone.
            return Ok(if waker.wait(timeout) { Activity::Local } else { Activity::Idle });
        }
        let deadline = Instant::now() + timeout;
        let inbox = &self.inboxes[self.rank];
        loop {
            if waker.wait(Duration::ZERO) {
                return Ok(Activity::Local);
            }
            let state = inbox.lock();
            let peer_active =
                state.pending.iter().any(|queue| !queue.is_empty()) || state.sender_closed.iter().any(|&closed| closed);
            if peer_active {
                return Ok(Activity::Peer);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(Activity::Idle);
            }
            drop(inbox.wait(state, (deadline - now).min(WAKER_POLL_INTERVAL)));
        }
    }

    fn idle_waiter(&self) -> Option<Box<dyn IdleWaiter>> {
        // Without peers only the waker can wake an idle engine (a job of one rank); with peers the waits
        // need the inboxes' locks, so the engine thread keeps the transport.
        (self.inboxes.len() == 1).then(|| Box::new(AloneWaiter) as Box<dyn IdleWaiter>)
    }

    fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        for (rank, inbox) in self.inboxes.iter().enumerate() {
            let mut state = inbox.lock();
            if rank == self.rank {
                state.owner_closed = true;
            } else {
                state.sender_closed[self.rank] = true;
            }
            drop(state);
            inbox.arrived.notify_all();
        }
    }
}

impl Drop for MemoryTransport {
    fn drop(&mut self) {
        self.close();
    }
}

/// Run `body` on every rank of `mesh`, each on its own thread, and return the results in rank order.
/// Each transport is dropped (closed) when its rank's body returns. Panics if a body panics (test use).
pub fn run_ranks<T: Send, R: Send>(mesh: Vec<T>, body: impl Fn(&mut T) -> R + Sync) -> Vec<R> {
    let body = &body;
    std::thread::scope(|scope| {
        let handles: Vec<_> = mesh.into_iter().map(|mut transport| scope.spawn(move || body(&mut transport))).collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect()
    })
}

/// A memory transport that claims `capabilities` and records the size of every message it sends (an
/// exchange's sending side included; an empty send is no message), for tests that count what an algorithm
/// sends or take the path a transport's capabilities choose.
#[cfg(test)]
pub(crate) struct Recorded {
    pub(crate) inner: MemoryTransport,
    pub(crate) capabilities: crate::transport::Capabilities,
    pub(crate) sent: Vec<usize>,
}

#[cfg(test)]
impl Recorded {
    /// One recording transport per rank of an `n`-rank mesh.
    pub(crate) fn mesh(n: usize, capabilities: crate::transport::Capabilities) -> Vec<Recorded> {
        MemoryTransport::mesh(n).into_iter().map(|inner| Recorded { inner, capabilities, sent: Vec::new() }).collect()
    }

    fn note(&mut self, bytes: usize) {
        if bytes > 0 {
            self.sent.push(bytes);
        }
    }
}

#[cfg(test)]
impl Transport for Recorded {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn label(&self) -> &'static str {
        "recorded"
    }
    fn capabilities(&self) -> crate::transport::Capabilities {
        self.capabilities
    }
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), TransportError> {
        self.note(data.len());
        self.inner.send(peer, data)
    }
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), TransportError> {
        self.inner.recv(peer, buf)
    }
    fn exchange(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError> {
        self.note(send.len());
        self.inner.exchange(to, send, from, recv_len, sink)
    }
    fn peek(&mut self, peer: usize, buf: &mut [u8]) -> bool {
        self.inner.peek(peer, buf)
    }
    fn wait_for_activity(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError> {
        self.inner.wait_for_activity(waker, timeout)
    }
    fn close(&mut self) {
        self.inner.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(timeout: Duration) -> (MemoryTransport, MemoryTransport) {
        let mut mesh = MemoryTransport::mesh_with_timeout(2, timeout);
        let second = mesh.pop().unwrap();
        (mesh.pop().unwrap(), second)
    }

    #[test]
    fn send_then_recv_in_order() {
        let (mut a, mut b) = pair(DEFAULT_TIMEOUT);
        a.send(1, b"hello ").unwrap();
        a.send(1, b"world").unwrap();
        let mut buf = [0u8; 11];
        b.recv(0, &mut buf).unwrap();
        assert_eq!(&buf, b"hello world");
        assert_eq!((a.rank(), a.size(), b.rank()), (0, 2, 1));
    }

    #[test]
    fn exchange_delivers_ordered_pieces_of_odd_sizes() {
        let message: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let results = run_ranks(MemoryTransport::mesh(2), |t| {
            let peer = 1 - t.rank();
            let mut received = Vec::new();
            let mut piece_lengths = Vec::new();
            t.exchange(peer, &message, peer, message.len(), &mut |offset, piece| {
                assert_eq!(offset, received.len());
                received.extend_from_slice(piece);
                piece_lengths.push(piece.len());
            })
            .unwrap();
            (received, piece_lengths)
        });
        for (received, piece_lengths) in results {
            assert_eq!(received, message);
            assert!(piece_lengths.len() > 1);
        }
        let mut sizes = PieceSizes::for_rank(0);
        let limits: Vec<usize> = (0..100).map(|_| sizes.next_limit()).collect();
        assert!(limits.iter().any(|&l| l % 8 != 0 && l < 8));
        assert!(limits.iter().any(|&l| l > 4096));
    }

    #[test]
    fn silent_peer_times_out() {
        let (mut a, _b) = pair(Duration::from_millis(50));
        let started = Instant::now();
        let mut buf = [0u8; 4];
        match a.recv(1, &mut buf) {
            Err(TransportError::Timeout { peer: 1, .. }) => {}
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn closed_peer_is_reported_after_its_queued_bytes() {
        let (mut a, mut b) = pair(DEFAULT_TIMEOUT);
        b.send(0, &[7, 8]).unwrap();
        b.close();
        let mut buf = [0u8; 2];
        a.recv(1, &mut buf).unwrap();
        assert_eq!(buf, [7, 8]);
        assert!(matches!(a.recv(1, &mut buf), Err(TransportError::PeerClosed { peer: 1 })));
        assert!(matches!(a.send(1, &buf), Err(TransportError::PeerClosed { peer: 1 })));
        assert!(matches!(b.send(0, &buf), Err(TransportError::Io { .. })));
    }

    #[test]
    fn blocked_receiver_wakes_when_peer_drops() {
        let results = run_ranks(MemoryTransport::mesh(2), |t| {
            if t.rank() == 0 {
                let mut buf = [0u8; 1];
                Some(t.recv(1, &mut buf))
            } else {
                std::thread::sleep(Duration::from_millis(20));
                None
            }
        });
        assert!(matches!(results[0], Some(Err(TransportError::PeerClosed { peer: 1 }))));
    }

    #[test]
    fn out_of_range_peer_is_an_error() {
        let (mut a, _b) = pair(DEFAULT_TIMEOUT);
        assert!(matches!(a.send(5, &[1]), Err(TransportError::Io { peer: 5, .. })));
    }

    #[test]
    fn wait_for_activity_reports_each_cause() {
        let (mut a, mut b) = pair(DEFAULT_TIMEOUT);
        let waker = Waker::new().unwrap();
        let idle = a.wait_for_activity(&waker, Duration::from_millis(5)).unwrap();
        assert_eq!(idle, Activity::Idle);
        waker.wake();
        assert_eq!(a.wait_for_activity(&waker, Duration::from_secs(5)).unwrap(), Activity::Local);
        waker.drain();
        b.send(0, &[1]).unwrap();
        assert_eq!(a.wait_for_activity(&waker, Duration::from_secs(5)).unwrap(), Activity::Peer);
        let mut buf = [0u8; 1];
        a.recv(1, &mut buf).unwrap();
        assert_eq!(a.wait_for_activity(&waker, Duration::from_millis(5)).unwrap(), Activity::Idle);
        b.close();
        assert_eq!(a.wait_for_activity(&waker, Duration::from_secs(5)).unwrap(), Activity::Peer);
    }

    #[test]
    fn waiting_rank_sees_bytes_sent_later() {
        let results = run_ranks(MemoryTransport::mesh(2), |t| {
            if t.rank() == 0 {
                let waker = Waker::new().unwrap();
                t.wait_for_activity(&waker, Duration::from_secs(10)).unwrap()
            } else {
                std::thread::sleep(Duration::from_millis(20));
                t.send(0, &[1]).unwrap();
                Activity::Idle
            }
        });
        assert_eq!(results[0], Activity::Peer);
    }
}
