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

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::transport::dropped_connections::DropLog;
use crate::transport::handshake::{self, Purpose, MAX_CLAIM_LEN};
use crate::transport::rendezvous::StoreClient;
use crate::transport::spin;
use crate::transport::{Activity, Transport, TransportError, Waker};

/// Size of the buffer `exchange` reads into before handing pieces to its sink: small enough to stay in
/// cache while the consumer reduces it.
const STAGING_LEN: usize = 256 * 1024;

/// Longest time an accepted connection may take to authenticate before it is dropped.
const ACCEPT_HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// How a peer's connection ended, seen while reading ahead; reported once its pending bytes are consumed.
enum Ended {
    Closed,
    Failed(io::Error),
}

/// The connection to one peer.
struct Link {
    stream: TcpStream,
    /// Bytes read ahead; `pending[pending_start..]` are not consumed yet.
    pending: Vec<u8>,
    pending_start: usize,
    ended: Option<Ended>,
    /// The urgent byte (a [`Cause`]) the peer sent, taken when `poll` reported it: a normal read that passes
    /// the byte's place in the stream discards it.
    urgent: Option<u8>,
}

impl Link {
    fn new(stream: TcpStream) -> Link {
        Link { stream, pending: Vec::new(), pending_start: 0, ended: None, urgent: None }
    }

    fn pending(&self) -> &[u8] {
        &self.pending[self.pending_start..]
    }

    fn consume_pending(&mut self, n: usize) {
        self.pending_start += n;
        if self.pending_start == self.pending.len() {
            self.pending.clear();
            self.pending_start = 0;
        }
    }

    fn append_pending(&mut self, bytes: &[u8]) {
        if self.pending_start > 0 {
            self.pending.drain(..self.pending_start);
            self.pending_start = 0;
        }
        self.pending.extend_from_slice(bytes);
    }

    /// The error to report to a receive that has consumed every pending byte, if the link has ended.
    /// Takes the peer's urgent byte if `revents` says it is there.
    fn take_urgent(&mut self, revents: libc::c_short) {
        if revents & libc::POLLPRI != 0 {
            if let Some(byte) = recv_urgent(&self.stream) {
                self.urgent = Some(byte);
            }
        }
    }

    fn end_error(&mut self, peer: usize) -> Option<TransportError> {
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
struct Cause {
    peer: usize,
    timed_out: bool,
}

impl Cause {
    fn of(err: &TransportError, rank: usize, size: usize) -> Option<Cause> {
        let (peer, timed_out) = match err {
            TransportError::PeerClosed { peer } | TransportError::Io { peer, .. } => (*peer, false),
            TransportError::Timeout { peer, .. } => (*peer, true),
            TransportError::Setup(_) | TransportError::Protocol { .. } => return None,
        };
        (peer != rank && peer < size).then_some(Cause { peer, timed_out })
    }

    fn to_byte(self) -> Option<u8> {
        (self.peer < 128).then(|| ((self.peer as u8) << 1) | u8::from(self.timed_out))
    }

    fn from_byte(byte: u8) -> Cause {
        Cause { peer: usize::from(byte >> 1), timed_out: byte & 1 == 1 }
    }

    fn error(self, timeout: Duration) -> TransportError {
        if self.timed_out {
            TransportError::Timeout { peer: self.peer, seconds: timeout.as_secs_f64() }
        } else {
            TransportError::PeerClosed { peer: self.peer }
        }
    }
}

/// Longest time `close` spends passing its [`Cause`] to peers whose send buffers are full.
const CAUSE_SEND_LIMIT: Duration = Duration::from_millis(100);

/// Sends `byte` as TCP urgent data, waiting until `deadline` for room in the send buffer; whether it went.
fn send_urgent(stream: &TcpStream, byte: u8, deadline: Instant) -> bool {
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
fn recv_urgent(stream: &TcpStream) -> Option<u8> {
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
enum Step {
    Moved(usize),
    WouldBlock,
}

fn is_disconnect(err: &io::Error) -> bool {
    matches!(err.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted | io::ErrorKind::BrokenPipe)
}

fn read_step(mut stream: &TcpStream, buf: &mut [u8], peer: usize) -> Result<Step, TransportError> {
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

fn write_step(mut stream: &TcpStream, data: &[u8], peer: usize) -> Result<Step, TransportError> {
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
}

impl TcpTransport {
    /// Builds the mesh for `rank` of `size`, rendezvousing through `store` under `scope`.
    ///
    /// Listens on `(bind, ephemeral port)` and advertises `advertise_host:port`. `timeout` bounds the whole
    /// set-up and is then the no-progress limit of every operation.
    #[allow(clippy::too_many_arguments)]
    pub fn connect_mesh(
        rank: usize,
        size: usize,
        store: &mut StoreClient,
        scope: &str,
        secret: &[u8],
        bind: IpAddr,
        advertise_host: &str,
        timeout: Duration,
    ) -> Result<TcpTransport, TransportError> {
        let linked = vec![true; size];
        Self::connect_mesh_linked(rank, size, store, scope, secret, bind, advertise_host, timeout, &linked)
    }

    /// [`connect_mesh`](Self::connect_mesh), connecting only the pairs of ranks that `linked` (by rank, the
    /// same relation on every rank) says talk to each other: the ranks on other hosts, in a communicator
    /// whose members on this host use shared memory. Operations with an unlinked rank are errors.
    #[allow(clippy::too_many_arguments)]
    pub fn connect_mesh_linked(
        rank: usize,
        size: usize,
        store: &mut StoreClient,
        scope: &str,
        secret: &[u8],
        bind: IpAddr,
        advertise_host: &str,
        timeout: Duration,
        linked: &[bool],
    ) -> Result<TcpTransport, TransportError> {
        if linked.len() != size {
            return Err(TransportError::Setup(format!("{} link flags for {size} ranks", linked.len())));
        }
        if rank >= size || size > u32::MAX as usize {
            return Err(TransportError::Setup(format!("rank {rank} is outside a communicator of {size} ranks")));
        }
        if scope.len() + 4 > MAX_CLAIM_LEN {
            return Err(TransportError::Setup(format!(
                "mesh scope '{scope}' is {} bytes long, the limit is {}",
                scope.len(),
                MAX_CLAIM_LEN - 4
            )));
        }
        let deadline = handshake::deadline_after(timeout);
        let setup_error = |what: &str, err: io::Error| TransportError::Setup(format!("rank {rank}: {what}: {err}"));
        let listener =
            TcpListener::bind((bind, 0)).map_err(|err| setup_error(&format!("cannot listen on {bind}"), err))?;
        let port = listener.local_addr().map_err(|err| setup_error("listener address", err))?.port();
        let host = if advertise_host.contains(':') && !advertise_host.starts_with('[') {
            format!("[{advertise_host}]")
        } else {
            advertise_host.to_string()
        };
        store.set(&address_key(scope, rank), format!("{host}:{port}").as_bytes())?;

        let events = Arc::new(Waker::new().map_err(|err| setup_error("eventfd", err))?);
        let abort = AtomicBool::new(false);
        let mut links: Vec<Option<Link>> = (0..size).map(|_| None).collect();
        let mesh = MeshIdentity { rank, size, scope, secret, linked };
        let (lower, higher) = std::thread::scope(|scope_threads| {
            let acceptor = scope_threads.spawn(|| accept_higher(&listener, &mesh, deadline, &events, &abort));
            let lower = connect_lower(&mesh, store, deadline);
            if lower.is_err() {
                abort.store(true, Ordering::SeqCst);
                events.wake();
            }
            let higher = acceptor
                .join()
                .unwrap_or_else(|_| Err(TransportError::Setup(format!("rank {rank}: the accepting thread panicked"))));
            (lower, higher)
        });
        drop(listener);
        for (peer, stream) in lower?.into_iter().chain(higher?) {
            tune(&stream).map_err(|err| setup_error(&format!("socket options for rank {peer}"), err))?;
            links[peer] = Some(Link::new(stream));
        }
        Ok(TcpTransport::from_links(rank, links, timeout))
    }

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
        }
    }

    /// The error an operation reports: where a peer's connection ended or broke and that peer said it
    /// closed because of a third rank, that rank's failure. The first failure is remembered for `close`.
    fn settle<T>(&mut self, outcome: Result<T, TransportError>) -> Result<T, TransportError> {
        let err = match outcome {
            Ok(value) => return Ok(value),
            Err(err) => err,
        };
        let err = match &err {
            TransportError::PeerClosed { peer } | TransportError::Io { peer, .. } => {
                self.cause_given_by(*peer).map_or(err, |cause| cause.error(self.timeout))
            }
            _ => err,
        };
        self.note_failure(&err);
        Err(err)
    }

    /// The cause `peer` gave for closing its connection to this rank, when it names a third rank.
    fn cause_given_by(&self, peer: usize) -> Option<Cause> {
        let link = self.links.get(peer)?.as_ref()?;
        let cause = Cause::from_byte(link.urgent.or_else(|| recv_urgent(&link.stream))?);
        (cause.peer != self.rank && cause.peer != peer && cause.peer < self.size).then_some(cause)
    }

    fn link(&mut self, peer: usize) -> Result<&mut Link, TransportError> {
        let (rank, size) = (self.rank, self.size);
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
            match poll_spin_then_block(&mut self.poll_fds, left) {
                Ok(Some(_)) | Ok(None) => {}
                Err(source) => return Err(TransportError::Io { peer: blamed, source }),
            }
            let (mut writable, mut readable) = (false, false);
            for i in 0..self.poll_fds.len() {
                let (peer, revents) = (self.poll_ranks[i], self.poll_fds[i].revents);
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
                let Some(link) = self.links.get(from).and_then(Option::as_ref) else {
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
    fn kind(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), TransportError> {
        let outcome = self.send_bytes(peer, data);
        self.settle(outcome)
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), TransportError> {
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
    ) -> Result<(), TransportError> {
        let outcome = self.exchange_bytes(to, send, from, recv_len, sink);
        self.settle(outcome)
    }

    fn note_failure(&mut self, cause: &TransportError) {
        if self.cause.is_none() {
            self.cause = Cause::of(cause, self.rank, self.size);
        }
    }
    fn wait_for_activity(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError> {
        if self.links.iter().flatten().any(|link| !link.pending().is_empty() || link.ended.is_some()) {
            return Ok(Activity::Peer);
        }
        self.poll_fds.clear();
        self.poll_fds.push(libc::pollfd { fd: waker.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        for link in self.links.iter().flatten() {
            let events = libc::POLLIN | libc::POLLPRI;
            self.poll_fds.push(libc::pollfd { fd: link.stream.as_raw_fd(), events, revents: 0 });
        }
        let deadline = handshake::deadline_after(timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match poll_spin_then_block(&mut self.poll_fds, left) {
                Ok(Some(_)) => break,
                Ok(None) if left.is_zero() => break,
                Ok(None) => {}
                Err(source) => return Err(TransportError::Io { peer: self.rank, source }),
            }
        }
        for (link, fd) in self.links.iter_mut().flatten().zip(&self.poll_fds[1..]) {
            link.take_urgent(fd.revents);
        }
        if self.poll_fds[0].revents & libc::POLLIN != 0 {
            Ok(Activity::Local)
        } else if self.poll_fds[1..].iter().any(|fd| fd.revents & (libc::POLLIN | libc::POLLPRI | ALERT) != 0) {
            Ok(Activity::Peer)
        } else {
            Ok(Activity::Idle)
        }
    }

    fn close(&mut self) {
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

/// Who this rank is in the mesh being built, and what proves it.
struct MeshIdentity<'a> {
    rank: usize,
    size: usize,
    scope: &'a str,
    secret: &'a [u8],
    /// Whether this rank connects with each rank.
    linked: &'a [bool],
}

fn address_key(scope: &str, rank: usize) -> String {
    format!("{scope}/addr/{rank}")
}

/// The identity a connecting rank claims: its rank and the scope of the mesh.
fn mesh_claim(rank: usize, scope: &str) -> Vec<u8> {
    let mut claim = (rank as u32).to_be_bytes().to_vec();
    claim.extend_from_slice(scope.as_bytes());
    claim
}

/// The rank claimed by `claim` if it belongs to `scope` and is one that connects to `acceptor_rank`.
fn claimed_rank(claim: &[u8], scope: &str, acceptor_rank: usize, size: usize) -> Option<usize> {
    let (rank, claimed_scope) = claim.split_first_chunk::<4>()?;
    let rank = u32::from_be_bytes(*rank) as usize;
    (claimed_scope == scope.as_bytes() && rank > acceptor_rank && rank < size).then_some(rank)
}

/// Socket settings for the data path. Buffer sizes are left to the kernel's autotuning: fixed 4 MiB
/// `SO_SNDBUF`/`SO_RCVBUF` measured no faster over loopback, turn autotuning off, and are silently capped
/// by `net.core.{w,r}mem_max` (often 208 KiB), which would make them slower.
fn tune(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    stream.set_nonblocking(true)
}

/// Connects to and authenticates with every lower rank, in order.
fn connect_lower(
    mesh: &MeshIdentity<'_>,
    store: &mut StoreClient,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>, TransportError> {
    let claim = mesh_claim(mesh.rank, mesh.scope);
    let mut streams = Vec::with_capacity(mesh.rank);
    for peer in (0..mesh.rank).filter(|&peer| mesh.linked[peer]) {
        let fail =
            |detail: String| TransportError::Setup(format!("rank {} connecting to rank {peer}: {detail}", mesh.rank));
        let left = deadline.saturating_duration_since(Instant::now());
        let address = store.get(&address_key(mesh.scope, peer), left)?;
        let address = String::from_utf8(address).map_err(|_| fail("its published address is not text".into()))?;
        let mut stream = connect_to(&address, deadline).map_err(|err| fail(format!("{address}: {err}")))?;
        handshake::connect(&mut stream, mesh.secret, Purpose::Mesh, &claim, deadline)
            .map_err(|err| fail(format!("{address}: {err}")))?;
        streams.push((peer, stream));
    }
    Ok(streams)
}

fn connect_to(address: &str, deadline: Instant) -> io::Result<TcpStream> {
    let mut last_error = io::Error::new(io::ErrorKind::NotFound, "the address resolves to nothing");
    for candidate in address.to_socket_addrs()? {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "out of time"));
        }
        match TcpStream::connect_timeout(&candidate, left) {
            Ok(stream) => return Ok(stream),
            Err(err) => last_error = err,
        }
    }
    Err(last_error)
}

/// Accepts connections until every higher rank has authenticated. Each handshake runs on its own short-lived
/// thread, so a silent stranger delays nobody; finished ones come back over a channel and ring `events`.
fn accept_higher(
    listener: &TcpListener,
    mesh: &MeshIdentity<'_>,
    deadline: Instant,
    events: &Arc<Waker>,
    abort: &AtomicBool,
) -> Result<Vec<(usize, TcpStream)>, TransportError> {
    let rank = mesh.rank;
    let fail = |detail: String| TransportError::Setup(format!("rank {rank} accepting peers: {detail}"));
    listener.set_nonblocking(true).map_err(|err| fail(err.to_string()))?;
    let secret: Arc<[u8]> = mesh.secret.into();
    let scope: Arc<str> = mesh.scope.into();
    let (done_tx, done_rx) = mpsc::channel::<(usize, TcpStream)>();
    let mut accepted: Vec<Option<TcpStream>> = (0..mesh.size).map(|_| None).collect();
    let mut missing = (rank + 1..mesh.size).filter(|&peer| mesh.linked[peer]).count();
    while missing > 0 {
        while let Ok((peer, stream)) = done_rx.try_recv() {
            if !mesh.linked[peer] {
                tracing::warn!(rank, peer, "mesh: dropped a connection from a rank this one does not link with");
            } else if accepted[peer].is_none() {
                accepted[peer] = Some(stream);
                missing -= 1;
            } else {
                tracing::warn!(rank, peer, "mesh: dropped a second connection claiming the same rank");
            }
        }
        if missing == 0 {
            break;
        }
        if abort.load(Ordering::SeqCst) {
            return Err(fail("set-up was abandoned".into()));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let absent: Vec<String> = (rank + 1..mesh.size)
                .filter(|&peer| mesh.linked[peer] && accepted[peer].is_none())
                .map(|peer| peer.to_string())
                .collect();
            return Err(fail(format!("rank(s) {} did not connect in time", absent.join(", "))));
        }
        let mut fds = [
            libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: events.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        poll_once(&mut fds, left).map_err(|err| fail(err.to_string()))?;
        events.drain();
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    let job = HandshakeJob {
                        rank,
                        size: mesh.size,
                        scope: scope.clone(),
                        secret: secret.clone(),
                        deadline: deadline.min(Instant::now() + ACCEPT_HANDSHAKE_LIMIT),
                        done: done_tx.clone(),
                        events: events.clone(),
                    };
                    let spawned = std::thread::Builder::new()
                        .name("rvod-mesh-handshake".into())
                        .spawn(move || job.run(stream, from));
                    if let Err(err) = spawned {
                        tracing::warn!(rank, %from, error = %err, "mesh: no thread to authenticate a connection");
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => {
                    tracing::warn!(rank, error = %err, "mesh: accept failed");
                    break;
                }
            }
        }
    }
    Ok(accepted.into_iter().enumerate().filter_map(|(peer, stream)| Some((peer, stream?))).collect())
}

/// Connections the mesh listeners of this process dropped (rate-limited warnings).
static MESH_DROPS: DropLog = DropLog::new("mesh");

/// Authenticates one accepted connection on its own thread.
struct HandshakeJob {
    rank: usize,
    size: usize,
    scope: Arc<str>,
    secret: Arc<[u8]>,
    deadline: Instant,
    done: mpsc::Sender<(usize, TcpStream)>,
    events: Arc<Waker>,
}

impl HandshakeJob {
    fn run(self, mut stream: TcpStream, from: SocketAddr) {
        let (rank, size, scope) = (self.rank, self.size, &*self.scope);
        if let Err(err) = stream.set_nonblocking(false) {
            MESH_DROPS.dropped(from, &format!("cannot make it blocking: {err}"));
            return;
        }
        let verified = handshake::accept(&mut stream, &self.secret, Purpose::Mesh, self.deadline, |claim| {
            claimed_rank(claim, scope, rank, size).is_some()
        });
        match verified.map(|claim| claimed_rank(&claim, scope, rank, size)) {
            Ok(Some(peer)) => {
                // The receiver is gone only if set-up already finished or failed; then the stream just closes.
                if self.done.send((peer, stream)).is_ok() {
                    self.events.wake();
                }
            }
            Ok(None) => {}
            Err(err) => {
                MESH_DROPS.dropped(from, &format!("rank {rank}: it failed authentication: {err}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two transports joined by one loopback connection, without a store or handshake.
    fn pair(timeout: Duration) -> (TcpTransport, TcpTransport) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        tune(&a).unwrap();
        tune(&b).unwrap();
        (
            TcpTransport::from_links(0, vec![None, Some(Link::new(a))], timeout),
            TcpTransport::from_links(1, vec![Some(Link::new(b)), None], timeout),
        )
    }

    #[test]
    fn claims_round_trip_and_reject_strangers() {
        let claim = mesh_claim(3, "world");
        assert_eq!(claimed_rank(&claim, "world", 1, 4), Some(3));
        assert_eq!(claimed_rank(&claim, "other", 1, 4), None);
        assert_eq!(claimed_rank(&claim, "world", 3, 4), None);
        assert_eq!(claimed_rank(&claim, "world", 0, 3), None);
        assert_eq!(claimed_rank(b"ab", "world", 0, 4), None);
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
