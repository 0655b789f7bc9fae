//! Connections on demand: a [`TcpTransport`] that opens the connection to a peer the first time one of its
//! operations needs that peer, instead of a full mesh at set-up ([`TcpTransport::connect_on_demand`]).
//!
//! Set-up only listens and publishes this rank's address; a thread then accepts connections for the life of
//! the transport. An operation that needs a peer it has no link to dials it: the peer's address comes from
//! the rendezvous store, and the connection is authenticated with the job secret exactly as in the full mesh
//! (the claim names the dialing rank and the mesh's scope). The peer's accepting thread answers without its
//! engine's help, so dialing never waits for what the peer is busy with.
//!
//! Two ranks may dial each other at once. Each pair keeps one connection: a rank that is itself dialing a
//! lower rank lets that rank's connection in, and a rank dialing a higher rank refuses that rank's (the
//! verdict of the handshake says so). The refused side then waits for the connection it let in, which is
//! already on its way. Per peer, the state moves `Idle -> Dialing -> Taken` (this rank's dial won) or
//! `Idle | Dialing -> Accepting -> Ready -> Taken` (the peer's won); admission and dialing decide under one
//! lock, so the two sides can neither both refuse nor both let a connection in.
//!
//! A peer that is gone refuses the connection (its listener closed with it): that is
//! [`TransportError::PeerClosed`], as a closed link is; a frozen peer's handshake times out.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::mesh::{self, Admission, Handshakes, MeshPlace};
use super::{poll_once, TcpTransport};
use crate::transport::handshake::{self, HandshakeError, Purpose};
use crate::transport::rendezvous::StoreClient;
use crate::transport::{TransportError, Waker};

/// Where the connection with one peer stands.
enum PeerState {
    /// No connection and nobody on this side dialing.
    Idle,
    /// This rank is dialing the peer.
    Dialing,
    /// The peer's connection was let in; its handshake is finishing.
    Accepting,
    /// The peer's connection, authenticated, waiting for the transport to take it.
    Ready(TcpStream),
    /// The transport holds the connection.
    Taken,
}

/// The per-peer states, shared by the transport and the threads that authenticate incoming connections.
struct Table {
    rank: usize,
    peers: Mutex<Vec<PeerState>>,
    /// Notified whenever a state changes, for a dial that was refused and waits for the peer's connection.
    changed: Condvar,
    /// Rung when a connection becomes `Ready`, so that the transport's waits take it in.
    arrived: Waker,
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, Vec<PeerState>> {
        self.peers.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Admission for Table {
    fn admit(&self, peer: usize) -> bool {
        let mut peers = self.lock();
        let Some(state) = peers.get_mut(peer) else { return false };
        let admitted = match state {
            PeerState::Idle => true,
            // Both dial: the lower rank's connection is kept.
            PeerState::Dialing => peer < self.rank,
            PeerState::Accepting | PeerState::Ready(_) | PeerState::Taken => false,
        };
        if admitted {
            *state = PeerState::Accepting;
        }
        admitted
    }

    fn deliver(&self, peer: usize, stream: TcpStream) {
        self.lock()[peer] = PeerState::Ready(stream);
        self.changed.notify_all();
        self.arrived.wake();
    }

    fn failed(&self, peer: usize) {
        let mut peers = self.lock();
        if matches!(peers[peer], PeerState::Accepting) {
            peers[peer] = PeerState::Idle;
        }
        self.changed.notify_all();
    }
}

/// The dialing side of a transport whose connections are made on demand, and the thread that accepts.
pub(super) struct OnDemand {
    rank: usize,
    scope: String,
    secret: Arc<[u8]>,
    /// Which ranks this one may connect with.
    linked: Vec<bool>,
    /// Where peers' addresses are looked up (a connection of this transport's own).
    store: StoreClient,
    table: Arc<Table>,
    stop: Arc<Waker>,
    acceptor: Option<JoinHandle<()>>,
}

/// How one dial ended.
enum Dialed {
    Connected(TcpStream),
    /// The peer was dialing this rank too and keeps its own connection.
    Crossed,
}

impl TcpTransport {
    /// A transport for `place.rank` that connects to a peer only when an operation first needs it,
    /// authenticated as in [`connect_mesh`](Self::connect_mesh), and only to the ranks `place.linked` names.
    /// Set-up listens, advertises this rank's address in `store` and opens a second connection to the store
    /// for looking up peers later; it waits for no other rank.
    pub fn connect_on_demand(store: &mut StoreClient, place: &MeshPlace<'_>) -> Result<TcpTransport, TransportError> {
        let MeshPlace { rank, size, scope, secret, bind, advertise_host, timeout, linked } = *place;
        mesh::check_mesh(rank, size, scope, linked)?;
        let listener = mesh::listen_and_publish(store, scope, rank, bind, advertise_host)?;
        listener.set_nonblocking(true).map_err(|err| mesh::setup_error("listener", err))?;
        let lookups = store.another(secret)?;
        let table = Arc::new(Table {
            rank,
            peers: Mutex::new((0..size).map(|_| PeerState::Idle).collect()),
            changed: Condvar::new(),
            arrived: Waker::new().map_err(|err| mesh::setup_error("eventfd", err))?,
        });
        let stop = Arc::new(Waker::new().map_err(|err| mesh::setup_error("eventfd", err))?);
        let handshakes = Handshakes {
            rank,
            size,
            scope: scope.into(),
            secret: secret.into(),
            admission: table.clone() as Arc<dyn Admission>,
        };
        let stop_accepting = stop.clone();
        let acceptor = std::thread::Builder::new()
            .name("rvod-accept".into())
            .spawn(move || accept_until_stopped(&listener, &handshakes, &stop_accepting))
            .map_err(|err| mesh::setup_error("no thread to accept connections", err))?;
        let on_demand = OnDemand {
            rank,
            scope: scope.to_string(),
            secret: secret.into(),
            linked: linked.to_vec(),
            store: lookups,
            table,
            stop,
            acceptor: Some(acceptor),
        };
        let mut transport = TcpTransport::from_links(rank, (0..size).map(|_| None).collect(), timeout);
        transport.on_demand = Some(on_demand);
        Ok(transport)
    }
}

/// Accepts connections on `listener` until `stop` rings (the listener closes when this returns).
fn accept_until_stopped(listener: &TcpListener, handshakes: &Handshakes, stop: &Waker) {
    loop {
        let mut fds = [
            libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        if let Err(err) = poll_once(&mut fds, Duration::from_secs(3600)) {
            tracing::warn!(rank = handshakes.rank, error = %err, "mesh: waiting for connections failed");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        handshakes.accept_waiting(listener, Instant::now() + Duration::from_secs(3600));
    }
}

impl OnDemand {
    /// The descriptor that becomes readable when a peer's connection is ready to be taken.
    pub(super) fn arrived_fd(&self) -> RawFd {
        self.table.arrived.as_raw_fd()
    }

    /// The peers' connections that arrived since the last call.
    pub(super) fn take_arrived(&self) -> Vec<(usize, TcpStream)> {
        self.table.arrived.drain();
        let mut peers = self.table.lock();
        let mut arrived = Vec::new();
        for (peer, state) in peers.iter_mut().enumerate() {
            if matches!(state, PeerState::Ready(_)) {
                if let PeerState::Ready(stream) = std::mem::replace(state, PeerState::Taken) {
                    arrived.push((peer, stream));
                }
            }
        }
        arrived
    }

    /// Whether `peer` is a rank this one may connect with.
    pub(super) fn may_link(&self, peer: usize) -> bool {
        peer != self.rank && self.linked.get(peer).copied().unwrap_or(false)
    }

    /// The connection with `peer`: the peer's, if it already arrived or is arriving, else one this rank dials
    /// (or, where the peer dials at the same moment and wins, the peer's). Gives up after `timeout`.
    pub(super) fn connect(&mut self, peer: usize, timeout: Duration) -> Result<TcpStream, TransportError> {
        let deadline = handshake::deadline_after(timeout);
        {
            let mut peers = self.table.lock();
            match std::mem::replace(&mut peers[peer], PeerState::Taken) {
                PeerState::Ready(stream) => return Ok(stream),
                PeerState::Idle => peers[peer] = PeerState::Dialing,
                PeerState::Accepting => {
                    peers[peer] = PeerState::Accepting;
                    drop(peers);
                    return self.await_arrival(peer, deadline, timeout);
                }
                state @ (PeerState::Dialing | PeerState::Taken) => {
                    peers[peer] = state;
                    return Err(TransportError::Setup(format!("the connection with rank {peer} is already made")));
                }
            }
        }
        match self.dial(peer, deadline, timeout) {
            Ok(Dialed::Connected(stream)) => {
                self.table.lock()[peer] = PeerState::Taken;
                Ok(stream)
            }
            Ok(Dialed::Crossed) => {
                #[cfg(test)]
                tests::CROSSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.await_arrival(peer, deadline, timeout)
            }
            Err(err) => {
                let mut peers = self.table.lock();
                if matches!(peers[peer], PeerState::Dialing) {
                    peers[peer] = PeerState::Idle;
                }
                Err(err)
            }
        }
    }

    /// Looks `peer` up, connects and authenticates.
    fn dial(&mut self, peer: usize, deadline: Instant, timeout: Duration) -> Result<Dialed, TransportError> {
        let fail = |detail: String| TransportError::Connect { peer, detail };
        let left = deadline.saturating_duration_since(Instant::now());
        let address = self.store.get_from(peer, &mesh::address_key(&self.scope, peer), left)?;
        let address = String::from_utf8(address).map_err(|_| fail("its published address is not text".into()))?;
        let mut stream = match mesh::connect_to(&address, deadline) {
            Ok(stream) => stream,
            // Its listener closed: the peer's transport is gone.
            Err(err) if err.kind() == io::ErrorKind::ConnectionRefused => {
                return Err(TransportError::PeerClosed { peer });
            }
            Err(err) => return Err(fail(format!("{address}: {err}"))),
        };
        let claim = mesh::mesh_claim(self.rank, &self.scope);
        match handshake::connect(&mut stream, &self.secret, Purpose::Mesh, &claim, deadline) {
            Ok(()) => Ok(Dialed::Connected(stream)),
            Err(HandshakeError::Unexpected) => Ok(Dialed::Crossed),
            Err(HandshakeError::TimedOut) => Err(TransportError::Timeout { peer, seconds: timeout.as_secs_f64() }),
            Err(HandshakeError::Closed) => Err(TransportError::PeerClosed { peer }),
            Err(err) => Err(fail(format!("{address}: {err}"))),
        }
    }

    /// Waits until the connection `peer` dialed is ready and takes it.
    fn await_arrival(&self, peer: usize, deadline: Instant, timeout: Duration) -> Result<TcpStream, TransportError> {
        let mut peers = self.table.lock();
        loop {
            match std::mem::replace(&mut peers[peer], PeerState::Taken) {
                PeerState::Ready(stream) => return Ok(stream),
                PeerState::Idle => {
                    peers[peer] = PeerState::Idle;
                    return Err(TransportError::Connect {
                        peer,
                        detail: "its connection to this rank broke while it was being authenticated".into(),
                    });
                }
                state => peers[peer] = state,
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout { peer, seconds: timeout.as_secs_f64() });
            }
            peers = self.table.changed.wait_timeout(peers, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
    }

    /// Stops accepting: peers that dial this rank from now on are refused.
    pub(super) fn stop(&mut self) {
        self.stop.wake();
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

impl Drop for OnDemand {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::Barrier;

    use super::*;
    use crate::transport::rendezvous::RendezvousServer;
    use crate::transport::{Activity, Transport};

    const SECRET: &[u8] = b"on-demand test secret";

    /// Dials that found the peer dialing this rank at the same moment (and took the peer's connection).
    pub(super) static CROSSED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    const TIMEOUT: Duration = Duration::from_secs(20);

    /// `size` ranks connecting on demand, each running `body(transport, barrier)` on a thread of its own; their
    /// results in rank order.
    fn ranks<T: Send + 'static>(
        size: usize,
        scope: &'static str,
        body: impl Fn(TcpTransport, &Barrier) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let server = RendezvousServer::start(localhost, 0, SECRET.to_vec()).unwrap();
        let addr = server.addr();
        let shared = Arc::new((body, Barrier::new(size)));
        let threads: Vec<_> = (0..size)
            .map(|rank| {
                let shared = shared.clone();
                std::thread::spawn(move || {
                    let mut store = StoreClient::connect(addr, SECRET, TIMEOUT).unwrap();
                    let everyone = vec![true; size];
                    let place = MeshPlace {
                        rank,
                        size,
                        scope,
                        secret: SECRET,
                        bind: localhost,
                        advertise_host: "127.0.0.1",
                        timeout: TIMEOUT,
                        linked: &everyone,
                    };
                    let transport = TcpTransport::connect_on_demand(&mut store, &place).unwrap();
                    (shared.0)(transport, &shared.1)
                })
            })
            .collect();
        let results = threads.into_iter().map(|t| t.join().unwrap()).collect();
        server.stop();
        results
    }

    fn message(from: usize, to: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * 7 + from * 31 + to * 13) % 251) as u8).collect()
    }

    #[test]
    fn a_ring_opens_two_links_per_rank() {
        let size = 12;
        let links = ranks(size, "ring", move |mut t, _| {
            let (rank, len) = (t.rank(), 300_000);
            let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
            assert_eq!(t.connected_peers(), 0);
            for _ in 0..3 {
                let mut got = vec![0u8; len];
                t.sendrecv(next, &message(rank, next, len), prev, &mut got).unwrap();
                assert!(got == message(prev, rank, len), "rank {rank}: wrong bytes from rank {prev}");
            }
            t.connected_peers()
        });
        assert_eq!(links, vec![2; size]);
    }

    #[test]
    fn ranks_dialing_each_other_at_once_keep_one_connection_per_pair() {
        let size = 9;
        let links = ranks(size, "crossing", move |mut t, barrier| {
            let rank = t.rank();
            // Every shift at once, so both ranks of a pair dial each other at about the same moment.
            for shift in 1..size {
                let (to, from) = ((rank + shift) % size, (rank + size - shift) % size);
                barrier.wait();
                let mut got = vec![0u8; 70_000];
                t.sendrecv(to, &message(rank, to, 70_000), from, &mut got).unwrap();
                assert!(got == message(from, rank, 70_000), "rank {rank}: wrong bytes from rank {from}");
            }
            // Plain sends in one direction after receives in the other, on the links just made.
            for peer in (0..size).filter(|&peer| peer != rank) {
                t.send(peer, &[rank as u8; 5]).unwrap();
            }
            for peer in (0..size).filter(|&peer| peer != rank) {
                let mut got = [0u8; 5];
                t.recv(peer, &mut got).unwrap();
                assert_eq!(got, [peer as u8; 5]);
            }
            t.connected_peers()
        });
        assert_eq!(links, vec![size - 1; size]);
    }

    #[test]
    fn a_pair_that_dials_at_the_same_instant_agrees_many_times_over() {
        for round in 0..40 {
            let scope: &'static str = Box::leak(format!("pair{round}").into_boxed_str());
            ranks(2, scope, |mut t, barrier| {
                let (rank, other) = (t.rank(), 1 - t.rank());
                barrier.wait();
                let mut got = [0u8; 3];
                t.sendrecv(other, &[rank as u8; 3], other, &mut got).unwrap();
                assert_eq!(got, [other as u8; 3]);
                assert_eq!(t.connected_peers(), 1);
            });
        }
        // The case this test is for happened (a dial refused because the lower rank's crossed it).
        assert!(CROSSED.load(std::sync::atomic::Ordering::Relaxed) > 0);
    }

    #[test]
    fn an_idle_rank_wakes_when_a_peer_connects_and_sends() {
        let seen = ranks(2, "idle", |mut t, barrier| {
            let waker = Waker::new().unwrap();
            if t.rank() == 0 {
                barrier.wait();
                std::thread::sleep(Duration::from_millis(200));
                t.send(1, b"round").unwrap();
                None
            } else {
                barrier.wait();
                let started = Instant::now();
                let activity = t.wait_for_activity(&waker, Duration::from_secs(10)).unwrap();
                let waited = started.elapsed();
                let mut got = [0u8; 5];
                t.recv(0, &mut got).unwrap();
                assert_eq!(&got, b"round");
                Some((activity, waited < Duration::from_secs(5)))
            }
        });
        assert_eq!(seen[1], Some((Activity::Peer, true)));
    }

    #[test]
    fn dialing_a_rank_that_is_gone_names_it() {
        let errors = ranks(3, "gone", |mut t, barrier| {
            let rank = t.rank();
            if rank == 2 {
                t.close();
                drop(t);
                barrier.wait();
                return None;
            }
            barrier.wait();
            let err = t.send(2, b"x").unwrap_err();
            assert!(t.send(rank, b"x").is_err(), "rank {rank} sent to itself");
            Some(err.to_string())
        });
        for error in &errors[..2] {
            assert_eq!(error.as_deref(), Some("rank 2 exited or closed its connection"));
        }
    }

    #[test]
    fn a_rank_outside_the_links_is_an_error_not_a_connection() {
        let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let server = RendezvousServer::start(localhost, 0, SECRET.to_vec()).unwrap();
        let mut store = StoreClient::connect(server.addr(), SECRET, TIMEOUT).unwrap();
        let linked = [false, true, false];
        let place = MeshPlace {
            rank: 0,
            size: 3,
            scope: "unlinked",
            secret: SECRET,
            bind: localhost,
            advertise_host: "127.0.0.1",
            timeout: TIMEOUT,
            linked: &linked,
        };
        let mut t = TcpTransport::connect_on_demand(&mut store, &place).unwrap();
        let err = t.send(2, b"x").unwrap_err();
        assert!(matches!(err, TransportError::Io { peer: 2, .. }), "{err}");
        assert_eq!(t.connected_peers(), 0);
        server.stop();
    }
}
