//! [`TcpTransport`]: a full mesh of TCP connections, one per pair of ranks, driven by `poll(2)`.
//!
//! Set-up ([`TcpTransport::connect_mesh`]): every rank listens on an ephemeral port, publishes
//! `"{scope}/addr/{rank}"` in the rendezvous store, connects to every lower rank and accepts every higher
//! one. Each connection is authenticated with the job secret; the connector's claim (its rank and the
//! scope) is covered by the proof, so a stranger, or a rank of another communicator, is dropped while
//! accepting goes on. The listener closes once the mesh is complete.
//!
//! Data path: sockets are non-blocking with `TCP_NODELAY`. Every operation first tries the `read`/`write`
//! itself and calls `poll` only when the kernel would block, so a small message costs one syscall per
//! side when its peer is ready. While blocked, an operation reads ahead whatever any *other* direction
//! brings (including the peer we are sending to) into that peer's pending buffer, which later receives
//! consume first; so two ranks sending each other large messages at once cannot deadlock.
//! Invariant: a peer's pending bytes always precede the bytes still in its socket.
//! An operation that sees no progress from its peer for the timeout fails with
//! [`TransportError::Timeout`]; end of stream or a reset is [`TransportError::PeerClosed`] at once.
//!
//! Naming the culprit: a rank that fails because of peer X (X closed, or went silent) and then closes its
//! connections first sends each other peer one byte of TCP urgent data saying so (see [`Cause`]). Urgent
//! data travels outside the byte stream (`SO_OOBINLINE` is off), so the unframed data channels are not
//! disturbed, and it arrives before the end of stream it precedes. A rank that sees a connection end asks it
//! for that byte and, when the closing rank blamed a third rank, reports that rank instead: every survivor
//! then names the rank that died or froze, not the one that happened to notice first. A rank that dies sends
//! nothing, so it is named itself. Only failures pay for this; the data path is untouched.
//! Limits: a normal read that passes the urgent byte's place in the stream discards it, so the byte is taken
//! whenever `poll` reports it (`POLLPRI`), which is when the survivor was waiting; one that reads the closing
//! rank's stream without having waited (it was busy when the connection ended) names the closing rank, as
//! it would without the byte. Blamed ranks from 128 up are not passed on.

//!
//! Connections on demand ([`TcpTransport::connect_on_demand`]): instead of the full mesh, set-up only listens,
//! and a peer's connection is made (dialed, or accepted on a thread of the transport's own) when an operation
//! first needs that peer; waits also watch for peers' connections arriving and take them in.
//!
//! Files: [`link`] (one peer's connection and the cause byte), [`mesh`] (set-up of the full mesh, and
//! authenticating accepted connections), [`on_demand`] (connections made when first needed), this module
//! (the data path: waiting, reading ahead, send, receive and exchange).

mod link;
mod mesh;
mod on_demand;

pub use mesh::MeshPlace;

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::transport::handshake;
use crate::transport::spin;
use crate::transport::{Activity, Transport, TransportError, Waker};
use link::{
    is_disconnect, read_step, recv_urgent, send_urgent, write_step, Cause, Ended, Link, Step, CAUSE_SEND_LIMIT,
};

/// Size of the buffer `exchange` reads into before handing pieces to its sink: small enough to stay in
/// cache while the consumer reduces it.
const STAGING_LEN: usize = 256 * 1024;

/// `poll(2)` timeout in milliseconds, rounded up so a wait never ends before its deadline.
fn poll_millis(timeout: Duration) -> libc::c_int {
    let millis = timeout.as_nanos().div_ceil(1_000_000);
    millis.min(libc::c_int::MAX as u128) as libc::c_int
}

/// Polls `fds` once; `Ok(None)` when interrupted by a signal.
fn poll_once(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<Option<usize>> {
    // SAFETY: `fds` is a valid, exclusively borrowed slice of pollfd for the duration of the call.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, poll_millis(timeout)) };
    if ready >= 0 {
        return Ok(Some(ready as usize));
    }
    let err = io::Error::last_os_error();
    if err.kind() == io::ErrorKind::Interrupted {
        Ok(None)
    } else {
        Err(err)
    }
}

const ALERT: libc::c_short = libc::POLLHUP | libc::POLLERR;

/// The longest a timed-out operation waits for the silent peer's cause before naming that peer (a quarter of
/// the timeout when that is shorter).
const CAUSE_GRACE: Duration = Duration::from_secs(1);

/// How long a wait checks for readiness without sleeping before it blocks in `poll` (see
/// [`spin`](crate::transport::spin)).
const SPIN: Duration = Duration::from_micros(50);

/// `poll` that first checks readiness without blocking for up to [`SPIN`] (when spinning has been paying
/// off for this thread), then blocks for the rest of `timeout`.
fn poll_spin_then_block(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<Option<usize>> {
    let start = Instant::now();
    let mut failure = None;
    let became_ready = spin::spin_until(SPIN.min(timeout), || match poll_once(fds, Duration::ZERO) {
        Ok(Some(ready)) => ready > 0,
        Ok(None) => false,
        Err(e) => {
            failure = Some(e);
            true
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    if became_ready {
        return Ok(Some(1));
    }
    poll_once(fds, timeout.saturating_sub(start.elapsed()))
}

/// Ordered byte channels to every other rank over one authenticated TCP connection each.
pub struct TcpTransport {
    rank: usize,
    size: usize,
    /// Indexed by rank; `None` at this rank.
    links: Vec<Option<Link>>,
    /// How long an operation may see no progress from its peer.
    timeout: Duration,
    staging: Vec<u8>,
    /// Scratch for `poll`, kept to avoid allocating per wait: the fds and the rank each belongs to.
    poll_fds: Vec<libc::pollfd>,
    poll_ranks: Vec<usize>,
    /// The first failure of this rank, passed on to the peers by `close`.
    cause: Option<Cause>,
    /// Where links are made when first needed: the dialing side and the accepting thread.
    on_demand: Option<on_demand::OnDemand>,
}

/// The `poll_ranks` entry of the descriptor that says peers' connections arrived (connections on demand).
const ARRIVED: usize = usize::MAX;

impl TcpTransport {
    fn from_links(rank: usize, links: Vec<Option<Link>>, timeout: Duration) -> TcpTransport {
        TcpTransport {
            rank,
            size: links.len(),
            links,
            timeout,
            staging: vec![0u8; STAGING_LEN],
            poll_fds: Vec::new(),
            poll_ranks: Vec::new(),
            cause: None,
            on_demand: None,
        }
    }

    /// How many peers this rank holds a connection with.
    pub fn connected_peers(&self) -> usize {
        self.links.iter().flatten().count()
    }

    /// Takes in the peers' connections that arrived (connections on demand).
    fn adopt_arrived(&mut self) {
        let Some(on_demand) = self.on_demand.as_ref() else { return };
        for (peer, stream) in on_demand.take_arrived() {
            match mesh::tune(&stream) {
                Ok(()) => self.links[peer] = Some(Link::new(stream)),
                Err(err) => tracing::warn!(rank = self.rank, peer, error = %err, "mesh: dropped a connection"),
            }
        }
    }

    /// The error an operation reports: where a peer's connection ended or broke and that peer said it
    /// closed because of a third rank, that rank's failure. The first failure is remembered for `close`.
    fn settle<T>(&mut self, outcome: Result<T, TransportError>) -> Result<T, TransportError> {
        outcome.map_err(|err| self.blame(err))
    }

    /// `err`, a failure with a peer of this mesh (seen here, or on another channel to the same peer by a
    /// transport that keeps this mesh as its authenticated control channel, see `transport::ucx`), as this
    /// mesh reports it: a third rank the peer blamed as it closed, if it did. Remembered for `close`.
    pub(crate) fn blame(&mut self, err: TransportError) -> TransportError {
        let err = match &err {
            TransportError::PeerClosed { peer } | TransportError::Io { peer, .. } => {
                self.cause_given_by(*peer).map_or(err, |cause| cause.error(self.timeout))
            }
            TransportError::Timeout { peer, .. } => {
                // The silent peer may itself be waiting on a third rank and time out at about the same moment
                // (ranks stall together when one freezes): give the word it sends as it closes a moment to
                // arrive, so that every survivor names the frozen rank, not the survivor it waited on.
                self.await_cause(*peer, (self.timeout / 4).min(CAUSE_GRACE));
                self.cause_given_by(*peer).map_or(err, |cause| cause.error(self.timeout))
            }
            _ => err,
        };
        self.note_failure(&err);
        err
    }

    /// The socket of each linked peer, for a transport that keeps this mesh as its control channel and
    /// watches it for peers that end (nothing else is sent on it once that transport is set up).
    pub(crate) fn peer_fds(&self) -> Vec<(usize, std::os::fd::RawFd)> {
        let linked = self.links.iter().enumerate();
        linked.filter_map(|(peer, link)| Some((peer, link.as_ref()?.stream.as_raw_fd()))).collect()
    }

    /// Wait up to `grace` for `peer`'s urgent byte (its cause, sent as it closes), or for its connection to
    /// end or break without one; whatever arrived is left in the link for [`Self::cause_given_by`].
    fn await_cause(&mut self, peer: usize, grace: Duration) {
        let Some(link) = self.links.get_mut(peer).and_then(Option::as_mut) else { return };
        let deadline = Instant::now() + grace;
        while link.urgent.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let mut fds = [libc::pollfd { fd: link.stream.as_raw_fd(), events: libc::POLLPRI, revents: 0 }];
            match poll_once(&mut fds, left) {
                Ok(Some(ready)) if ready > 0 => {
                    link.take_urgent(fds[0].revents);
                    if link.urgent.is_none() {
                        return; // the connection ended or broke, or its urgent mark was already read past
                    }
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }

    /// The cause `peer` gave for closing its connection to this rank, when it names a third rank.
    fn cause_given_by(&self, peer: usize) -> Option<Cause> {
        let link = self.links.get(peer)?.as_ref()?;
        let cause = Cause::from_byte(link.urgent.or_else(|| recv_urgent(&link.stream))?);
        (cause.peer != self.rank && cause.peer != peer && cause.peer < self.size).then_some(cause)
    }

    /// The link with `peer`, made now if it is made on demand and not there yet.
    fn link(&mut self, peer: usize) -> Result<&mut Link, TransportError> {
        let (rank, size) = (self.rank, self.size);
        if self.links.get(peer).is_some_and(Option::is_none) {
            if let Some(on_demand) = self.on_demand.as_mut().filter(|on_demand| on_demand.may_link(peer)) {
                let stream = on_demand.connect(peer, self.timeout)?;
                mesh::tune(&stream)
                    .map_err(|err| TransportError::Connect { peer, detail: format!("socket options: {err}") })?;
                self.links[peer] = Some(Link::new(stream));
            }
        }
        self.links.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| TransportError::Io {
            peer,
            source: io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("rank {peer} is not another rank of this {size}-rank communicator (this is rank {rank})"),
            ),
        })
    }

    /// Copies pending bytes from `peer` into `buf`; returns how many. Fails if the link ended and nothing
    /// is pending while `buf` still wants bytes.
    fn recv_pending(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize, TransportError> {
        let link = self.link(peer)?;
        let n = link.pending().len().min(buf.len());
        buf[..n].copy_from_slice(&link.pending()[..n]);
        link.consume_pending(n);
        if n < buf.len() {
            if let Some(err) = link.end_error(peer) {
                return Err(err);
            }
        }
        Ok(n)
    }

    /// Hands up to `want` pending bytes from `peer` to `sink`; returns how many. Fails like `recv_pending`.
    fn sink_pending(
        &mut self,
        peer: usize,
        want: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<usize, TransportError> {
        let link = self.link(peer)?;
        let n = link.pending().len().min(want);
        if n > 0 {
            sink(0, &link.pending()[..n]);
            link.consume_pending(n);
        }
        if n < want {
            if let Some(err) = link.end_error(peer) {
                return Err(err);
            }
        }
        Ok(n)
    }

    /// Reads what `peer` has sent into its pending buffer, without blocking.
    fn read_ahead(&mut self, peer: usize) {
        let Some(link) = self.links.get_mut(peer).and_then(Option::as_mut) else { return };
        loop {
            match (&link.stream).read(&mut self.staging) {
                Ok(0) => link.ended = Some(Ended::Closed),
                Ok(n) => {
                    link.append_pending(&self.staging[..n]);
                    if n == self.staging.len() {
                        continue;
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                Err(err) if is_disconnect(&err) => link.ended = Some(Ended::Closed),
                Err(err) => link.ended = Some(Ended::Failed(err)),
            }
            return;
        }
    }

    /// Blocks until `write_peer` can take bytes or `read_peer` has some (or reports an error), reading ahead
    /// from every other peer meanwhile. Returns (writable, readable). `stalled_since` is when the calling
    /// operation last made progress; it fails with a timeout once that is `self.timeout` ago.
    fn wait(
        &mut self,
        write_peer: Option<usize>,
        read_peer: Option<usize>,
        stalled_since: &mut Option<Instant>,
    ) -> Result<(bool, bool), TransportError> {
        let blamed = read_peer.or(write_peer).unwrap_or(self.rank);
        let stalled_since = *stalled_since.get_or_insert_with(Instant::now);
        loop {
            let left = self.timeout.saturating_sub(stalled_since.elapsed());
            if left.is_zero() {
                return Err(TransportError::Timeout { peer: blamed, seconds: self.timeout.as_secs_f64() });
            }
            self.poll_fds.clear();
            self.poll_ranks.clear();
            for (peer, link) in self.links.iter().enumerate() {
                let Some(link) = link else { continue };
                let mut events = 0;
                if Some(peer) == read_peer || link.ended.is_none() {
                    events |= libc::POLLIN | libc::POLLPRI;
                }
                if Some(peer) == write_peer {
                    events |= libc::POLLOUT;
                }
                if events != 0 {
                    self.poll_fds.push(libc::pollfd { fd: link.stream.as_raw_fd(), events, revents: 0 });
                    self.poll_ranks.push(peer);
                }
            }
            if let Some(on_demand) = &self.on_demand {
                self.poll_fds.push(libc::pollfd { fd: on_demand.arrived_fd(), events: libc::POLLIN, revents: 0 });
                self.poll_ranks.push(ARRIVED);
            }
            match poll_spin_then_block(&mut self.poll_fds, left) {
                Ok(Some(_)) | Ok(None) => {}
                Err(source) => return Err(TransportError::Io { peer: blamed, source }),
            }
            let (mut writable, mut readable) = (false, false);
            for i in 0..self.poll_fds.len() {
                let (peer, revents) = (self.poll_ranks[i], self.poll_fds[i].revents);
                if peer == ARRIVED {
                    if revents != 0 {
                        self.adopt_arrived();
                    }
                    continue;
                }
                if let Some(link) = self.links[peer].as_mut() {
                    link.take_urgent(revents);
                }
                let has_input = revents & (libc::POLLIN | ALERT) != 0;
                if Some(peer) == read_peer {
                    readable |= has_input;
                } else if has_input {
                    self.read_ahead(peer);
                }
                if Some(peer) == write_peer && revents & (libc::POLLOUT | ALERT) != 0 {
                    writable = true;
                }
            }
            if writable || readable {
                return Ok((writable, readable));
            }
        }
    }

    fn send_bytes(&mut self, peer: usize, data: &[u8]) -> Result<(), TransportError> {
        self.link(peer)?;
        let mut sent = 0;
        let mut stalled_since = None;
        while sent < data.len() {
            let stream = &self.link(peer)?.stream;
            if let Step::Moved(n) = write_step(stream, &data[sent..], peer)? {
                sent += n;
                stalled_since = None;
                if sent == data.len() {
                    break;
                }
            }
            // A short write means the socket buffer is full: wait rather than retry at once.
            self.wait(Some(peer), None, &mut stalled_since)?;
        }
        Ok(())
    }

    fn recv_bytes(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), TransportError> {
        let mut got = self.recv_pending(peer, buf)?;
        let mut stalled_since = None;
        while got < buf.len() {
            let stream = &self.link(peer)?.stream;
            let want = buf.len() - got;
            if let Step::Moved(n) = read_step(stream, &mut buf[got..], peer)? {
                got += n;
                stalled_since = None;
                if n == want {
                    break;
                }
            }
            // A short read means the socket is drained: wait rather than retry at once.
            self.wait(None, Some(peer), &mut stalled_since)?;
        }
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
        if !send.is_empty() {
            self.link(to)?;
        }
        let mut got = if recv_len > 0 { self.sink_pending(from, recv_len, sink)? } else { 0 };
        let mut sent = 0;
        // Whether the last attempt in each direction may not have exhausted the socket.
        let (mut try_write, mut try_read) = (true, true);
        let mut stalled_since = None;
        while sent < send.len() || got < recv_len {
            let mut progressed = false;
            if sent < send.len() && try_write {
                match write_step(&self.link(to)?.stream, &send[sent..], to)? {
                    Step::Moved(n) => {
                        sent += n;
                        progressed = true;
                        try_write = sent == send.len();
                    }
                    Step::WouldBlock => try_write = false,
                }
            }
            if got < recv_len && try_read {
                let want = (recv_len - got).min(STAGING_LEN);
                self.link(from)?;
                let Some(link) = self.links[from].as_ref() else {
                    return Err(TransportError::PeerClosed { peer: from });
                };
                match read_step(&link.stream, &mut self.staging[..want], from)? {
                    Step::Moved(n) => {
                        sink(got, &self.staging[..n]);
                        got += n;
                        progressed = true;
                        try_read = n == want;
                    }
                    Step::WouldBlock => try_read = false,
                }
            }
            if progressed {
                stalled_since = None;
            }
            let write_idle = sent == send.len() || !try_write;
            let read_idle = got == recv_len || !try_read;
            if !(write_idle && read_idle) || (sent == send.len() && got == recv_len) {
                continue;
            }
            let write_peer = (sent < send.len()).then_some(to);
            let read_peer = (got < recv_len).then_some(from);
            let (writable, readable) = self.wait(write_peer, read_peer, &mut stalled_since)?;
            try_write = writable;
            try_read = readable;
        }
        Ok(())
    }
}

impl Transport for TcpTransport {
    fn label(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    crate::transport::settled_data_path!();

    fn note_failure(&mut self, cause: &TransportError) {
        if self.cause.is_none() {
            self.cause = Cause::of(cause, self.rank, self.size);
        }
    }
    fn wait_for_activity(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError> {
        let deadline = handshake::deadline_after(timeout);
        loop {
            self.adopt_arrived();
            if self.links.iter().flatten().any(|link| !link.pending().is_empty() || link.ended.is_some()) {
                return Ok(Activity::Peer);
            }
            self.poll_fds.clear();
            self.poll_fds.push(libc::pollfd { fd: waker.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            for link in self.links.iter().flatten() {
                let events = libc::POLLIN | libc::POLLPRI;
                self.poll_fds.push(libc::pollfd { fd: link.stream.as_raw_fd(), events, revents: 0 });
            }
            let links = self.poll_fds.len();
            if let Some(on_demand) = &self.on_demand {
                self.poll_fds.push(libc::pollfd { fd: on_demand.arrived_fd(), events: libc::POLLIN, revents: 0 });
            }
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match poll_spin_then_block(&mut self.poll_fds, left) {
                    Ok(Some(_)) => break,
                    Ok(None) if left.is_zero() => break,
                    Ok(None) => {}
                    Err(source) => return Err(TransportError::Io { peer: self.rank, source }),
                }
            }
            for (link, fd) in self.links.iter_mut().flatten().zip(&self.poll_fds[1..links]) {
                link.take_urgent(fd.revents);
            }
            if self.poll_fds[0].revents & libc::POLLIN != 0 {
                return Ok(Activity::Local);
            }
            if self.poll_fds[1..links].iter().any(|fd| fd.revents & (libc::POLLIN | libc::POLLPRI | ALERT) != 0) {
                return Ok(Activity::Peer);
            }
            // A peer's connection arrived: take it in and watch it too (its first bytes are on their way).
            let arrived = self.poll_fds[links..].iter().any(|fd| fd.revents != 0);
            if !arrived || deadline <= Instant::now() {
                return Ok(Activity::Idle);
            }
        }
    }

    fn close(&mut self) {
        if let Some(on_demand) = self.on_demand.as_mut() {
            on_demand.stop();
        }
        let cause = self.cause.and_then(|cause| Some((cause.peer, cause.to_byte()?)));
        let deadline = Instant::now() + CAUSE_SEND_LIMIT;
        for (peer, link) in self.links.iter().enumerate() {
            let Some(link) = link else { continue };
            if let Some((blamed, byte)) = cause {
                // The blamed rank needs no explanation (and, if frozen, has no room to take one).
                if peer != blamed {
                    send_urgent(&link.stream, byte, deadline);
                }
            }
            // Already-broken connections report NotConnected; there is nothing left to shut then.
            let _ = link.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    /// Two transports joined by one loopback connection, without a store or handshake.
    fn pair(timeout: Duration) -> (TcpTransport, TcpTransport) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        mesh::tune(&a).unwrap();
        mesh::tune(&b).unwrap();
        (
            TcpTransport::from_links(0, vec![None, Some(Link::new(a))], timeout),
            TcpTransport::from_links(1, vec![Some(Link::new(b)), None], timeout),
        )
    }

    #[test]
    fn read_ahead_bytes_are_received_in_order() {
        let (mut a, mut b) = pair(Duration::from_secs(10));
        let big_a: Vec<u8> = (0..8_000_000u32).map(|i| (i % 251) as u8).collect();
        let big_b: Vec<u8> = (0..6_000_000u32).map(|i| (i % 241) as u8).collect();
        let (ea, eb) = (big_b.clone(), big_a.clone());
        let t = std::thread::spawn(move || {
            b.send(0, &big_b).unwrap();
            let mut got = vec![0u8; eb.len()];
            b.recv(0, &mut got).unwrap();
            assert!(got == eb);
        });
        a.send(1, &big_a).unwrap();
        let mut got = vec![0u8; ea.len()];
        a.recv(1, &mut got).unwrap();
        assert!(got == ea);
        t.join().unwrap();
    }

    #[test]
    fn invalid_peers_are_errors() {
        let (mut a, _b) = pair(Duration::from_secs(1));
        assert!(matches!(a.send(0, b"x"), Err(TransportError::Io { peer: 0, .. })));
        assert!(matches!(a.recv(7, &mut [0u8; 1]), Err(TransportError::Io { peer: 7, .. })));
        a.exchange(0, &[], 9, 0, &mut |_, _| {}).unwrap();
    }

    #[test]
    fn exchange_with_one_peer_both_ways() {
        let (mut a, mut b) = pair(Duration::from_secs(10));
        let data: Vec<u8> = (0..3_000_001u32).map(|i| (i * 7) as u8).collect();
        let expected = data.clone();
        let t = std::thread::spawn(move || {
            let mut got = vec![0u8; expected.len()];
            b.sendrecv(0, &expected, 0, &mut got).unwrap();
            assert!(got == expected);
        });
        let mut got = vec![0u8; data.len()];
        let mut offsets_in_order = true;
        let mut next = 0;
        a.exchange(1, &data, 1, data.len(), &mut |off, piece| {
            offsets_in_order &= off == next;
            next += piece.len();
            got[off..off + piece.len()].copy_from_slice(piece);
        })
        .unwrap();
        assert!(offsets_in_order);
        assert!(got == data);
        t.join().unwrap();
    }
}
