//! [`UcxTransport`]: ranks on other hosts through UCX's UCP tag API, which reaches InfiniBand and RoCE by
//! RDMA (and otherwise uses what UCX has: TCP, shared memory). libucp is loaded at run time ([`library`]).
//!
//! Set-up ([`UcxTransport::over`], in `setup`): the ranks first build rvod's authenticated TCP mesh (the
//! job secret's handshake, see [`crate::transport::tcp`]); over it each pair agrees a random 32-bit key and
//! exchanges UCP worker addresses, then connects UCP endpoints. A peer that cannot prove the secret never
//! learns a worker address and never gets a byte. UCX itself authenticates nothing: a stranger that finds a
//! worker's port can put messages in its unexpected queue, but no receive matches them, because every tag
//! carries the pair's key (tag = key << 32 | sender rank << 8 | channel).
//!
//! Data: a send is one tagged message per [`CHUNK`] bytes; a receive takes the peer's messages in order as
//! a byte stream (a message may serve several receives), so the trait's framing-free contract holds. A
//! receive (`recv`, `sendrecv`) probes the next messages and has UCX write those that fit straight into the
//! caller's buffer (zero-copy where UCX can); otherwise, and for `exchange`'s sink, into buffers of the
//! transport's own; either way up to [`AHEAD`] messages per peer at once, so the rendezvous of the next
//! overlaps the bytes of this one (one at a time, a receive of 64 MiB over UCX's TCP took 30% longer).
//! While an operation waits it also takes in what other peers sent, so two ranks sending each other large
//! messages cannot deadlock. Memory is registered by UCX's own
//! registration cache (the staging buffers are reused, so they register once); explicit `ucp_mem_map`
//! handles are not passed (that needs UCX 1.12's `memh` request field).
//!
//! Waiting: `ucp_worker_progress`, a short adaptive spin ([`crate::transport::spin`]), then
//! `ucp_worker_arm` and `poll(2)` on the worker's event fd together with the control connections (and the
//! engine's waker in [`Transport::wait_for_activity`]); no busy spin beyond the spin window.
//!
//! Liveness: the TCP mesh stays open as the control channel and carries nothing after set-up, so its end
//! (or a UCX endpoint error, where UCX handles peer failures: over RDMA, see [`library::tuned`]) says a
//! peer closed or died. An operation fails with [`TransportError::PeerClosed`] once that peer's arrived
//! messages are all taken and it stays ended for [`END_GRACE`] (messages sent just before a close may still
//! be in flight; one still arriving after that never will), and with
//! [`TransportError::Timeout`] after the timeout without progress. The error is then settled by the control
//! mesh ([`TcpTransport::blame`]), and `close` passes this rank's cause over it, so every survivor names
//! the rank that died or froze, as over TCP. Other UCX failures name the peer and UCX's own message.
//!
//! Files: [`ffi`] (the C declarations), [`library`] (loading, version, the transports UCX reports),
//! `setup` (context, worker, key and address exchange, endpoints), this module (the data path).

mod ffi;
pub mod library;
mod setup;

use std::collections::VecDeque;
use std::ffi::c_void;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicI8, Ordering};
use std::time::{Duration, Instant};

use crate::transport::handshake;
use crate::transport::spin;
use crate::transport::tcp::TcpTransport;
use crate::transport::{Activity, Transport, TransportError, Waker};
use ffi::{posted, Ep, Message, Posted, RequestParam, Status, TagRecvInfo};
pub use library::{rdma_transports, tuned, ucx, Tuning, Ucx};

/// Largest message a send is cut into: big enough for UCX's zero-copy protocols, small enough that a
/// receiver's sink works on one while the next arrives.
pub const CHUNK: usize = 4 << 20;
/// Messages per peer received ahead of the receive that will take them.
pub const AHEAD: usize = 4;
/// How long a peer whose connection ended may still deliver messages it sent before.
pub const END_GRACE: Duration = Duration::from_millis(200);
/// How long a wait checks for progress without sleeping before it arms the worker and blocks.
const SPIN: Duration = Duration::from_micros(50);
/// How long `close` lets endpoints flush (the peers take the last messages) before leaving them to UCX.
const CLOSE_LIMIT: Duration = Duration::from_millis(500);

/// Channels: data, and the message each pair exchanges once to prove its endpoints at set-up.
const DATA: u8 = 0;
const HELLO: u8 = 1;

/// The tag of a message from `sender` on `channel` between a pair whose key is `key`.
fn tag(key: u32, sender: usize, channel: u8) -> u64 {
    (u64::from(key) << 32) | (((sender as u64) & 0xff_ffff) << 8) | u64::from(channel)
}

/// A message from a peer, probed and received (or being received) into memory of the transport's own.
struct Incoming {
    data: Vec<u8>,
    /// The UCX request still writing `data`; `None` once it is complete.
    request: Option<*mut c_void>,
    /// Bytes of `data` already handed out.
    taken: usize,
}

/// One peer on another host.
struct Peer {
    ep: Ep,
    /// Key of this pair's tags.
    key: u32,
    /// The status UCX's error handler reported for the endpoint (0: none); boxed so its address, given
    /// to UCX, stays put.
    failure: Box<AtomicI8>,
    incoming: VecDeque<Incoming>,
    /// When its control connection ended or its endpoint failed.
    ended_at: Option<Instant>,
    control_ended: bool,
}

impl Peer {
    fn ep_status(&self) -> Status {
        self.failure.load(Ordering::SeqCst)
    }
}

/// Ordered byte channels to the ranks on other hosts over UCX (see the module doc).
pub struct UcxTransport {
    rank: usize,
    size: usize,
    ucx: &'static Ucx,
    context: ffi::Context,
    worker: ffi::Worker,
    /// The worker's event fd (`ucp_worker_get_efd`).
    efd: RawFd,
    /// Indexed by rank; `None` at this rank and at ranks reached otherwise.
    peers: Vec<Option<Peer>>,
    /// The authenticated TCP mesh among the same ranks: liveness, and the cause passed on at close.
    control: TcpTransport,
    timeout: Duration,
    /// Receive buffers kept for reuse.
    spare: Vec<Vec<u8>>,
    poll_fds: Vec<libc::pollfd>,
    /// Whether the endpoints ask UCX to handle peer failures (see [`library::tuned`]).
    peer_error_handling: bool,
    closed: bool,
}

// SAFETY: the worker is created in UCS_THREAD_MODE_SERIALIZED (any thread, one at a time), and every use
// goes through `&mut self`, so one thread at a time touches the worker, its endpoints and requests.
unsafe impl Send for UcxTransport {}

fn invalid_peer(peer: usize, rank: usize, size: usize) -> TransportError {
    TransportError::Io {
        peer,
        source: io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("rank {peer} is not a rank on another host of this {size}-rank communicator (this is rank {rank})"),
        ),
    }
}

impl UcxTransport {
    fn peer(&mut self, peer: usize) -> Result<&mut Peer, TransportError> {
        let (rank, size) = (self.rank, self.size);
        self.peers.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| invalid_peer(peer, rank, size))
    }

    /// Drives UCX; whether anything happened.
    fn progress(&mut self) -> bool {
        let mut any = false;
        // SAFETY: the worker lives as long as self; serialized access through &mut self.
        while unsafe { (self.ucx.api.worker_progress)(self.worker) } != 0 {
            any = true;
        }
        any
    }

    /// `Some(status)` once `request` is complete (and freed), `None` while it runs.
    fn finished(&self, request: *mut c_void) -> Option<Status> {
        // SAFETY: `request` is a live request of this worker that nobody freed yet.
        let status = unsafe { (self.ucx.api.request_check_status)(request) };
        if status == ffi::UCS_INPROGRESS {
            return None;
        }
        // SAFETY: complete, so freeing it releases it at once; it is not used again.
        unsafe { (self.ucx.api.request_free)(request) };
        Some(status)
    }

    /// The error for a UCX operation with `peer` that failed with `status`.
    fn failure(&self, peer: usize, status: Status, what: &str) -> TransportError {
        let ended = self.peers.get(peer).and_then(Option::as_ref).is_some_and(|p| p.ended_at.is_some());
        if ffi::is_peer_failure(status) || ended {
            TransportError::PeerClosed { peer }
        } else {
            let message = format!("UCX {what} failed: {}", self.ucx.status_text(status));
            TransportError::Io { peer, source: io::Error::other(message) }
        }
    }

    /// The next message `peer` sent on `channel` that nobody took yet: its handle and length.
    fn probe(&self, peer: usize, key: u32, channel: u8) -> Option<(Message, usize)> {
        let mut info = TagRecvInfo::default();
        // SAFETY: live worker, valid out-pointer; remove=1 hands us the message, which we then receive.
        let message =
            unsafe { (self.ucx.api.tag_probe_nb)(self.worker, tag(key, peer, channel), u64::MAX, 1, &mut info) };
        (!message.is_null()).then_some((message, info.length))
    }

    /// Whether `peer` sent a message on the data channel that is not taken yet (without taking it).
    fn has_message(&self, peer: usize, key: u32) -> bool {
        let mut info = TagRecvInfo::default();
        // SAFETY: live worker, valid out-pointer; remove=0 leaves the message where it is.
        let message = unsafe { (self.ucx.api.tag_probe_nb)(self.worker, tag(key, peer, DATA), u64::MAX, 0, &mut info) };
        !message.is_null()
    }

    /// Starts receiving a probed message into `buf` (exactly its length).
    fn receive_into(&self, message: Message, buf: *mut u8, len: usize) -> Posted {
        let param = RequestParam::plain();
        // SAFETY: `buf` has `len` writable bytes that stay valid until the request completes (callers keep
        // them: their own buffer, waited for, or an `Incoming`'s heap buffer); `message` came from a probe.
        posted(unsafe { (self.ucx.api.tag_msg_recv_nbx)(self.worker, buf.cast(), len, message, &param) })
    }

    /// Receives up to `limit` of `peer`'s messages ahead into buffers of the transport's own.
    fn pull(&mut self, peer: usize, limit: usize) -> Result<(), TransportError> {
        let key = self.peer(peer)?.key;
        while self.peer(peer)?.incoming.len() < limit {
            let Some((message, len)) = self.probe(peer, key, DATA) else { break };
            self.receive_queued(peer, message, len)?;
        }
        Ok(())
    }

    /// Takes in everything peers other than `except` sent, so none of them waits on this rank (a sender of
    /// large messages waits until its receiver takes them).
    fn read_ahead(&mut self, except: Option<usize>) -> Result<(), TransportError> {
        for peer in 0..self.peers.len() {
            if Some(peer) != except && self.peers[peer].is_some() {
                self.pull(peer, usize::MAX)?;
            }
        }
        Ok(())
    }

    /// Hands up to `want` received bytes of `peer` to `take(bytes)`, in order; how many.
    fn take_received(
        &mut self,
        peer: usize,
        want: usize,
        take: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        let mut given = 0;
        while given < want {
            let request = match self.peer(peer)?.incoming.front() {
                Some(front) => front.request,
                None => break,
            };
            if let Some(request) = request {
                match self.finished(request) {
                    None => break,
                    Some(ffi::UCS_OK) => {}
                    Some(status) => {
                        self.peer(peer)?.incoming.pop_front();
                        return Err(self.failure(peer, status, "receive"));
                    }
                }
            }
            let incoming = self.peer(peer)?;
            let Some(front) = incoming.incoming.front_mut() else { break };
            front.request = None;
            let n = (front.data.len() - front.taken).min(want - given);
            take(&front.data[front.taken..front.taken + n]);
            front.taken += n;
            given += n;
            if front.taken == front.data.len() {
                if let Some(done) = incoming.incoming.pop_front() {
                    if self.spare.len() < 2 * AHEAD {
                        self.spare.push(done.data);
                    }
                }
            }
        }
        Ok(given)
    }

    /// Marks peers whose control connection has news (it only ever carries their close).
    fn note_ended_controls(&mut self, fds: &[libc::pollfd], peers: &[usize]) {
        for (fd, &peer) in fds.iter().zip(peers) {
            if fd.revents != 0 {
                if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
                    p.control_ended = true;
                    p.ended_at.get_or_insert_with(Instant::now);
                }
            }
        }
    }

    /// Looks at the endpoints' errors and, without waiting, at the control connections.
    fn check_ends(&mut self) {
        for peer in self.peers.iter_mut().flatten() {
            if peer.ep_status() != 0 {
                peer.ended_at.get_or_insert_with(Instant::now);
            }
        }
        let (mut fds, peers) = self.control_fds();
        if !fds.is_empty() && poll_fds(&mut fds, Duration::ZERO).is_ok() {
            self.note_ended_controls(&fds, &peers);
        }
    }

    /// The control connections of peers not known to have ended, to poll.
    fn control_fds(&self) -> (Vec<libc::pollfd>, Vec<usize>) {
        let mut fds = Vec::new();
        let mut peers = Vec::new();
        for (peer, fd) in self.control.peer_fds() {
            if self.peers.get(peer).and_then(Option::as_ref).is_some_and(|p| !p.control_ended) {
                fds.push(libc::pollfd { fd, events: libc::POLLIN | libc::POLLPRI, revents: 0 });
                peers.push(peer);
            }
        }
        (fds, peers)
    }

    /// The error for `peer` when it has ended (for [`END_GRACE`], or its endpoint failed and its control
    /// connection ended) and, when `reading`, nothing it sent that arrived is left to take.
    fn end_of(&mut self, peer: usize, reading: bool) -> Option<TransportError> {
        let p = self.peers.get(peer)?.as_ref()?;
        let since = p.ended_at?;
        let settled = p.control_ended && p.ep_status() != 0;
        if !settled && since.elapsed() < END_GRACE.min(self.timeout / 4) {
            return None;
        }
        if reading && self.has_arrived(p) {
            return None;
        }
        Some(TransportError::PeerClosed { peer })
    }

    /// Whether the oldest message received ahead from `p` is all there. Readers take in (or start
    /// receiving) what a peer sent before they wait, so a message that ended in time is there; a receive
    /// still running once the peer has ended never completes where UCX does not handle peer failures (see
    /// [`library::tuned`]), nor does a message UCX only announced.
    fn has_arrived(&self, p: &Peer) -> bool {
        p.incoming.front().is_some_and(|front| match front.request {
            None => true,
            // SAFETY: a live request of this worker, not freed yet (only looked at here; whoever takes the
            // message frees it).
            Some(request) => (unsafe { (self.ucx.api.request_check_status)(request) }) != ffi::UCS_INPROGRESS,
        })
    }

    /// One wait for progress by an operation that has seen none since `stalled_since`: drives UCX, takes
    /// in other peers' messages, fails when a peer in `watched` (rank, whether reading from it) has ended
    /// or the timeout passed (blaming `blamed`), and otherwise sleeps until UCX or a control connection has
    /// news. Returns when it is worth looking again.
    fn wait_step(
        &mut self,
        watched: &[(usize, bool)],
        blamed: usize,
        stalled_since: Instant,
    ) -> Result<(), TransportError> {
        let progressed = self.progress();
        let reading = watched.iter().find(|(_, reading)| *reading).map(|&(peer, _)| peer);
        self.read_ahead(reading)?;
        if progressed {
            return Ok(());
        }
        self.check_ends();
        for &(peer, reading) in watched {
            if let Some(err) = self.end_of(peer, reading) {
                return Err(err);
            }
        }
        let left = self.timeout.saturating_sub(stalled_since.elapsed());
        if left.is_zero() {
            return Err(TransportError::Timeout { peer: blamed, seconds: self.timeout.as_secs_f64() });
        }
        let (api, worker) = (&self.ucx.api, self.worker);
        // SAFETY: live worker, serialized access.
        if spin::spin_until(SPIN.min(left), || unsafe { (api.worker_progress)(worker) } != 0) {
            return Ok(());
        }
        // A peer that ended is looked at again when its grace is over.
        let grace_left = watched
            .iter()
            .filter_map(|&(peer, _)| self.peers.get(peer)?.as_ref()?.ended_at)
            .map(|since| END_GRACE.saturating_sub(since.elapsed()) + Duration::from_millis(1))
            .min()
            .unwrap_or(left);
        self.sleep(None, left.min(grace_left))?;
        Ok(())
    }

    /// Arms the worker and sleeps until it, a control connection or `waker` has news, or `timeout` passes;
    /// whether `waker` fired.
    fn sleep(&mut self, waker: Option<&Waker>, timeout: Duration) -> Result<bool, TransportError> {
        // SAFETY: live worker, serialized access.
        let armed = unsafe { (self.ucx.api.worker_arm)(self.worker) };
        if armed == ffi::UCS_ERR_BUSY {
            return Ok(false);
        }
        if armed != ffi::UCS_OK {
            let message = format!("UCX ucp_worker_arm failed: {}", self.ucx.status_text(armed));
            return Err(TransportError::Io { peer: self.rank, source: io::Error::other(message) });
        }
        let (controls, peers) = self.control_fds();
        let mut fds = std::mem::take(&mut self.poll_fds);
        fds.clear();
        fds.push(libc::pollfd { fd: self.efd, events: libc::POLLIN, revents: 0 });
        if let Some(waker) = waker {
            fds.push(libc::pollfd { fd: waker.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        let first_control = fds.len();
        fds.extend(controls);
        let polled = poll_fds(&mut fds, timeout);
        self.note_ended_controls(&fds[first_control..], &peers);
        let woken = waker.is_some() && fds[1].revents & libc::POLLIN != 0;
        self.poll_fds = fds;
        polled.map_err(|source| TransportError::Io { peer: self.rank, source })?;
        Ok(woken)
    }

    /// Waits for `request`, a receive from `peer` into memory the caller owns; on failure the request is
    /// abandoned so that UCX no longer writes there.
    fn await_request(&mut self, peer: usize, request: *mut c_void, what: &str) -> Result<(), TransportError> {
        let stalled_since = Instant::now();
        loop {
            match self.finished(request) {
                Some(ffi::UCS_OK) => return Ok(()),
                Some(status) => return Err(self.failure(peer, status, what)),
                None => {}
            }
            if let Err(err) = self.wait_step(&[(peer, false)], peer, stalled_since) {
                self.abandon(peer, &[request]);
                return Err(err);
            }
        }
    }

    /// Gives up on `requests` with `peer` after a failure: closes the endpoint by force (UCX then ends its
    /// requests), cancels them and waits a moment for them to end, so that none touches caller memory.
    fn abandon(&mut self, peer: usize, requests: &[*mut c_void]) {
        self.close_endpoint(peer, true);
        for &request in requests {
            // SAFETY: a live request of this worker.
            unsafe { (self.ucx.api.request_cancel)(self.worker, request) };
        }
        let deadline = Instant::now() + CLOSE_LIMIT;
        let mut left: Vec<*mut c_void> = requests.to_vec();
        while !left.is_empty() && Instant::now() < deadline {
            self.progress();
            left.retain(|&request| self.finished(request).is_none());
        }
        if !left.is_empty() {
            tracing::warn!(rank = self.rank, peer, "UCX: {} requests did not end after a failure", left.len());
            self.release(&left);
        }
    }

    /// Closes `peer`'s endpoint at once (UCX ends its requests); waits up to [`CLOSE_LIMIT`].
    fn close_endpoint(&mut self, peer: usize, force: bool) {
        let closing: Vec<*mut c_void> = self.start_closing(peer, force).into_iter().collect();
        self.wait_closed(closing);
    }

    /// Starts closing `peer`'s endpoint: flushing what it holds, or at once (`force`); the request to wait for.
    fn start_closing(&mut self, peer: usize, force: bool) -> Option<*mut c_void> {
        let p = self.peers.get_mut(peer).and_then(Option::as_mut)?;
        let ep = std::mem::replace(&mut p.ep, std::ptr::null_mut());
        if ep.is_null() {
            return None;
        }
        let param = if force {
            RequestParam::with_flags(ffi::UCP_OP_ATTR_FIELD_FLAGS, ffi::UCP_EP_CLOSE_FLAG_FORCE)
        } else {
            RequestParam::plain()
        };
        // SAFETY: a live endpoint of this worker, closed once (its slot is now null).
        match posted(unsafe { (self.ucx.api.ep_close_nbx)(ep, &param) }) {
            Posted::Pending(request) => Some(request),
            Posted::Done | Posted::Failed(_) => None,
        }
    }

    /// Drives UCX until the endpoint closes in `requests` are done, for up to [`CLOSE_LIMIT`].
    fn wait_closed(&mut self, mut requests: Vec<*mut c_void>) {
        let deadline = Instant::now() + CLOSE_LIMIT;
        while !requests.is_empty() && Instant::now() < deadline {
            self.progress();
            requests.retain(|&request| self.finished(request).is_none());
        }
        if !requests.is_empty() {
            tracing::debug!(rank = self.rank, "UCX: {} endpoints did not close in time", requests.len());
            self.release(&requests);
        }
    }

    /// Hands running requests back to UCX, which frees them when they end (the worker's destruction
    /// requires every request to be released).
    fn release(&self, requests: &[*mut c_void]) {
        for &request in requests {
            // SAFETY: a live request of this worker, not used again.
            unsafe { (self.ucx.api.request_free)(request) };
        }
    }

    /// Posts `data` to `peer` as tagged messages of at most [`CHUNK`] bytes; the requests still running.
    fn post_sends(&mut self, peer: usize, data: &[u8]) -> Result<Vec<*mut c_void>, TransportError> {
        let (ep, key) = {
            let p = self.peer(peer)?;
            (p.ep, p.key)
        };
        if ep.is_null() {
            return Err(TransportError::PeerClosed { peer });
        }
        let param = RequestParam::plain();
        let mut running = Vec::new();
        for chunk in data.chunks(CHUNK) {
            // SAFETY: `chunk` stays valid until the request completes: callers wait for every request (or
            // abandon them) before returning to their caller, who owns `data`.
            let sent = unsafe {
                (self.ucx.api.tag_send_nbx)(ep, chunk.as_ptr().cast(), chunk.len(), tag(key, self.rank, DATA), &param)
            };
            match posted(sent) {
                Posted::Done => {}
                Posted::Pending(request) => running.push(request),
                Posted::Failed(status) => {
                    let err = self.failure(peer, status, "send");
                    self.abandon(peer, &running);
                    return Err(err);
                }
            }
        }
        Ok(running)
    }

    /// Drops finished send requests; whether any finished. Fails on the first that failed.
    fn reap_sends(&mut self, peer: usize, running: &mut Vec<*mut c_void>) -> Result<bool, TransportError> {
        let before = running.len();
        let mut failed = None;
        running.retain(|&request| match self.finished(request) {
            None => true,
            Some(ffi::UCS_OK) => false,
            Some(status) => {
                failed.get_or_insert(status);
                false
            }
        });
        if let Some(status) = failed {
            return Err(self.failure(peer, status, "send"));
        }
        Ok(running.len() < before)
    }

    fn send_bytes(&mut self, peer: usize, data: &[u8]) -> Result<(), TransportError> {
        self.peer(peer)?;
        let mut running = self.post_sends(peer, data)?;
        let mut stalled_since = Instant::now();
        loop {
            match self.reap_sends(peer, &mut running) {
                Ok(true) => stalled_since = Instant::now(),
                Ok(false) => {}
                Err(err) => {
                    self.abandon(peer, &running);
                    return Err(err);
                }
            }
            if running.is_empty() {
                return Ok(());
            }
            if let Err(err) = self.wait_step(&[(peer, false)], peer, stalled_since) {
                self.abandon(peer, &running);
                return Err(err);
            }
        }
    }

    /// A receive is [`Self::sendrecv_bytes`] with nothing to send: up to [`AHEAD`] of the peer's messages are
    /// received straight into `buf` at once, so the next one's rendezvous overlaps this one's bytes.
    fn recv_bytes(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), TransportError> {
        self.sendrecv_bytes(peer, &[], peer, buf)
    }

    /// Receives a probed message of `peer` into a buffer of the transport's own (a reused one: only its
    /// growth is zeroed), queued after the ones before it.
    fn receive_queued(&mut self, peer: usize, message: Message, len: usize) -> Result<(), TransportError> {
        let mut data = self.spare.pop().unwrap_or_default();
        if data.len() < len {
            data.resize(len, 0);
        }
        data.truncate(len);
        let request = match self.receive_into(message, data.as_mut_ptr(), len) {
            Posted::Done => None,
            Posted::Pending(request) => Some(request),
            Posted::Failed(status) => return Err(self.failure(peer, status, "receive")),
        };
        self.peer(peer)?.incoming.push_back(Incoming { data, request, taken: 0 });
        Ok(())
    }

    fn exchange_bytes(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError> {
        if recv_len > 0 {
            self.peer(from)?;
        }
        let mut running = if send.is_empty() { Vec::new() } else { self.post_sends(to, send)? };
        let outcome = self.finish_exchange(to, &mut running, from, recv_len, sink);
        if outcome.is_err() && !running.is_empty() {
            self.abandon(to, &running);
        }
        outcome
    }

    /// One [`Self::wait_step`] of an exchange still reading from `from` and/or sending to `to` (each with
    /// whether it still is).
    fn wait_both_ways(
        &mut self,
        (from, reading): (usize, bool),
        (to, sending): (usize, bool),
        stalled_since: Instant,
    ) -> Result<(), TransportError> {
        let mut watched = Vec::with_capacity(2);
        if reading {
            watched.push((from, true));
        }
        if sending {
            watched.push((to, false));
        }
        self.wait_step(&watched, if reading { from } else { to }, stalled_since)
    }

    fn finish_exchange(
        &mut self,
        to: usize,
        running: &mut Vec<*mut c_void>,
        from: usize,
        recv_len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError> {
        let mut got = 0;
        let mut stalled_since = Instant::now();
        loop {
            let mut moved = self.reap_sends(to, running)?;
            if got < recv_len {
                self.pull(from, AHEAD)?;
                let n = self.take_received(from, recv_len - got, &mut |bytes| {
                    sink(got, bytes);
                    got += bytes.len();
                })?;
                moved |= n > 0;
            }
            if running.is_empty() && got == recv_len {
                return Ok(());
            }
            if moved {
                stalled_since = Instant::now();
                continue;
            }
            self.wait_both_ways((from, got < recv_len), (to, !running.is_empty()), stalled_since)?;
        }
    }

    /// [`Transport::sendrecv`]: like [`Self::exchange_bytes`], but a message that fits in what is left of
    /// `recv` is received straight there (zero-copy where UCX can), up to [`AHEAD`] at once.
    fn sendrecv_bytes(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<(), TransportError> {
        if !recv.is_empty() {
            self.peer(from)?;
        }
        let mut running = if send.is_empty() { Vec::new() } else { self.post_sends(to, send)? };
        let mut direct = VecDeque::new();
        let outcome = self.finish_sendrecv(to, &mut running, from, recv, &mut direct);
        if outcome.is_err() {
            let receives: Vec<*mut c_void> = direct.iter().filter_map(|&(request, _)| request).collect();
            if !receives.is_empty() {
                self.abandon(from, &receives);
            }
            if !running.is_empty() {
                self.abandon(to, &running);
            }
        }
        outcome
    }

    /// The rest of [`Self::sendrecv_bytes`]; `direct` holds the receives straight into `recv`, in order,
    /// with their lengths (`None`: done at once, after one still running; the running ones are abandoned
    /// by the caller on failure, as `running` is).
    fn finish_sendrecv(
        &mut self,
        to: usize,
        running: &mut Vec<*mut c_void>,
        from: usize,
        recv: &mut [u8],
        direct: &mut VecDeque<(Option<*mut c_void>, usize)>,
    ) -> Result<(), TransportError> {
        // `got`: bytes of `recv` filled; `posted`: bytes given to receives so far (`got` plus `direct`'s).
        let (mut got, mut posted) = (0, 0);
        let mut stalled_since = Instant::now();
        loop {
            let mut moved = self.reap_sends(to, running)?;
            while let Some(&(request, len)) = direct.front() {
                match request.map(|request| self.finished(request)) {
                    Some(None) => break,
                    None | Some(Some(ffi::UCS_OK)) => {}
                    Some(Some(status)) => {
                        direct.pop_front();
                        return Err(self.failure(from, status, "receive"));
                    }
                }
                direct.pop_front();
                got += len;
                moved = true;
            }
            if got == posted && got < recv.len() {
                // What was received ahead comes first.
                let start = got;
                let n = self.take_received(from, recv.len() - got, &mut |bytes| {
                    recv[got..got + bytes.len()].copy_from_slice(bytes);
                    got += bytes.len();
                })?;
                posted += got - start;
                moved |= n > 0;
            }
            while posted < recv.len() && direct.len() < AHEAD && self.peer(from)?.incoming.is_empty() {
                let key = self.peer(from)?.key;
                let Some((message, len)) = self.probe(from, key, DATA) else { break };
                moved = true;
                if len > recv.len() - posted {
                    // Part of it belongs to a later receive: taken through the transport's own buffer.
                    self.receive_queued(from, message, len)?;
                    break;
                }
                match self.receive_into(message, recv[posted..].as_mut_ptr(), len) {
                    Posted::Done if direct.is_empty() => got += len,
                    Posted::Done => direct.push_back((None, len)),
                    Posted::Pending(request) => direct.push_back((Some(request), len)),
                    Posted::Failed(status) => return Err(self.failure(from, status, "receive")),
                }
                posted += len;
            }
            if running.is_empty() && got == recv.len() {
                return Ok(());
            }
            if moved {
                stalled_since = Instant::now();
                continue;
            }
            self.wait_both_ways((from, got < recv.len()), (to, !running.is_empty()), stalled_since)?;
        }
    }

    /// Whether some peer sent data nobody took yet, or ended.
    fn peer_activity(&mut self) -> bool {
        self.check_ends();
        (0..self.peers.len()).any(|peer| match self.peers[peer].as_ref() {
            Some(p) => !p.incoming.is_empty() || p.ended_at.is_some() || self.has_message(peer, p.key),
            None => false,
        })
    }

    fn settle<T>(&mut self, outcome: Result<T, TransportError>) -> Result<T, TransportError> {
        outcome.map_err(|err| self.control.blame(err))
    }
}

/// `poll(2)` on `fds` for up to `timeout` (a signal just ends the wait early).
fn poll_fds(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<()> {
    let millis = timeout.as_nanos().div_ceil(1_000_000).min(libc::c_int::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid, exclusively borrowed slice of pollfd for the duration of the call.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis) };
    if ready < 0 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    Ok(())
}

impl Transport for UcxTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn label(&self) -> &'static str {
        "ucx"
    }

    crate::transport::settled_data_path!();

    fn sendrecv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<(), TransportError> {
        let outcome = self.sendrecv_bytes(to, send, from, recv);
        self.settle(outcome)
    }

    fn wait_for_activity(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError> {
        let deadline = handshake::deadline_after(timeout);
        loop {
            self.progress();
            if self.peer_activity() {
                return Ok(Activity::Peer);
            }
            if waker.is_signalled() {
                return Ok(Activity::Local);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Activity::Idle);
            }
            let (api, worker) = (&self.ucx.api, self.worker);
            // SAFETY: live worker, serialized access.
            if spin::spin_until(
                SPIN.min(left),
                || unsafe { (api.worker_progress)(worker) } != 0 || waker.is_signalled(),
            ) {
                continue;
            }
            if self.sleep(Some(waker), left)? {
                return Ok(Activity::Local);
            }
        }
    }

    fn note_failure(&mut self, cause: &TransportError) {
        self.control.note_failure(cause);
    }

    /// Flushes and closes the endpoints (by force after a failure), then closes the control mesh, which
    /// tells the peers whom this rank blames.
    fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let mut closing = Vec::new();
        for peer in 0..self.peers.len() {
            let failed = self.peers[peer].as_ref().is_some_and(|p| p.ended_at.is_some());
            closing.extend(self.start_closing(peer, failed));
        }
        self.wait_closed(closing);
        self.control.close();
    }
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        self.close();
        for peer in self.peers.iter_mut().flatten() {
            for incoming in peer.incoming.drain(..) {
                if let Some(request) = incoming.request {
                    // SAFETY: a live receive request of this worker, into `incoming.data`, which is leaked
                    // below if UCX may still write it.
                    unsafe {
                        (self.ucx.api.request_cancel)(self.worker, request);
                        (self.ucx.api.request_free)(request);
                    }
                    std::mem::forget(incoming.data);
                }
            }
        }
        // SAFETY: every endpoint is closed; the worker and then the context are destroyed once.
        unsafe {
            (self.ucx.api.worker_destroy)(self.worker);
            (self.ucx.api.cleanup)(self.context);
        }
    }
}

#[cfg(test)]
mod tests;
