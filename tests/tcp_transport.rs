//! The TCP transport and the rendezvous store end to end: ranks are threads of this process that meet
//! through a real `RendezvousServer` and talk over loopback. Every test runs under a time limit.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use rvod::transport::handshake::{self, Purpose};
use rvod::transport::rendezvous::{RendezvousServer, StoreClient};
use rvod::transport::tcp::TcpTransport;
use rvod::transport::{Activity, Transport, TransportError, Waker};

const SECRET: &[u8] = b"job secret for tests";
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const SIZES: [usize; 5] = [0, 1, 7, 4097, 1_000_003];

/// Runs `body` on its own thread and fails the test if it takes longer than `limit`.
fn within<T: Send + 'static>(limit: Duration, body: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, result) = mpsc::channel();
    thread::spawn(move || {
        let _ = done.send(body());
    });
    match result.recv_timeout(limit) {
        Ok(value) => value,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("test did not finish within {limit:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("test body panicked"),
    }
}

fn store(server: &RendezvousServer) -> StoreClient {
    StoreClient::connect(server.addr(), SECRET, Duration::from_secs(5)).unwrap()
}

fn join_mesh(addr: SocketAddr, rank: usize, size: usize, timeout: Duration) -> TcpTransport {
    let mut store = StoreClient::connect(addr, SECRET, Duration::from_secs(5)).unwrap();
    TcpTransport::connect_mesh(rank, size, &mut store, "world", SECRET, LOOPBACK, "127.0.0.1", timeout).unwrap()
}

/// Runs `body` on every rank of a fresh `size`-rank mesh and returns the results in rank order.
fn on_mesh<T: Send + 'static>(
    size: usize,
    timeout: Duration,
    body: impl Fn(TcpTransport) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let server = RendezvousServer::start(LOOPBACK, 0, SECRET.to_vec()).unwrap();
    let addr = server.addr();
    let ranks: Vec<_> = (0..size)
        .map(|rank| {
            let body = body.clone();
            thread::spawn(move || body(join_mesh(addr, rank, size, timeout)))
        })
        .collect();
    ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
}

/// Deterministic bytes that differ by sender, receiver and length.
fn pattern(from: usize, to: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ (from * 7 + to * 13 + len)) as u8).collect()
}

#[test]
fn ring_send_recv_of_odd_sizes() {
    within(Duration::from_secs(60), || {
        for size in 2..=4 {
            on_mesh(size, Duration::from_secs(20), move |mut t| {
                let (rank, next, prev) = (t.rank(), (t.rank() + 1) % size, (t.rank() + size - 1) % size);
                for len in SIZES {
                    // Everyone sends before anyone receives: only reading ahead keeps this from deadlocking.
                    t.send(next, &pattern(rank, next, len)).unwrap();
                    let mut got = vec![0u8; len];
                    t.recv(prev, &mut got).unwrap();
                    assert!(got == pattern(prev, rank, len), "rank {rank} got wrong bytes from {prev} (len {len})");
                }
            });
        }
    });
}

#[test]
fn ring_exchange_of_odd_sizes_streams_in_order() {
    within(Duration::from_secs(60), || {
        for size in 2..=4 {
            on_mesh(size, Duration::from_secs(20), move |mut t| {
                let (rank, next, prev) = (t.rank(), (t.rank() + 1) % size, (t.rank() + size - 1) % size);
                for len in SIZES {
                    let mut got = Vec::with_capacity(len);
                    t.exchange(next, &pattern(rank, next, len), prev, len, &mut |offset, piece| {
                        assert_eq!(offset, got.len());
                        got.extend_from_slice(piece);
                    })
                    .unwrap();
                    assert!(got == pattern(prev, rank, len), "rank {rank} exchange from {prev} (len {len})");
                }
            });
        }
    });
}

#[test]
fn all_pairs_sendrecv_with_the_same_peer() {
    within(Duration::from_secs(60), || {
        on_mesh(4, Duration::from_secs(20), |mut t| {
            let rank = t.rank();
            for peer in (0..4).filter(|&peer| peer != rank) {
                let mut got = vec![0u8; 4097];
                t.sendrecv(peer, &pattern(rank, peer, 4097), peer, &mut got).unwrap();
                assert!(got == pattern(peer, rank, 4097));
            }
        });
    });
}

#[test]
fn simultaneous_large_sends_both_ways() {
    within(Duration::from_secs(60), || {
        const LEN: usize = 32 << 20;
        on_mesh(2, Duration::from_secs(20), |mut t| {
            let (rank, peer) = (t.rank(), 1 - t.rank());
            for _ in 0..2 {
                t.send(peer, &pattern(rank, peer, LEN)).unwrap();
                let mut got = vec![0u8; LEN];
                t.recv(peer, &mut got).unwrap();
                assert!(got == pattern(peer, rank, LEN));
            }
        });
    });
}

#[test]
fn get_waits_for_a_key_set_later() {
    within(Duration::from_secs(20), || {
        let server = RendezvousServer::start(LOOPBACK, 0, SECRET.to_vec()).unwrap();
        let mut reader = store(&server);
        let mut writer = store(&server);
        let setter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            writer.set("late", b"here").unwrap();
            writer
        });
        let started = Instant::now();
        assert_eq!(reader.get("late", Duration::from_secs(10)).unwrap(), b"here");
        assert!(started.elapsed() >= Duration::from_millis(150));
        setter.join().unwrap();
        let err = reader.get("never", Duration::from_millis(100)).unwrap_err();
        assert!(matches!(&err, TransportError::Setup(msg) if msg.contains("'never'")), "{err}");
    });
}

#[test]
fn store_drops_strangers_and_keeps_serving() {
    within(Duration::from_secs(30), || {
        let server = RendezvousServer::start(LOOPBACK, 0, SECRET.to_vec()).unwrap();
        let mut client = store(&server);
        client.set("before", b"1").unwrap();

        let wrong = StoreClient::connect(server.addr(), b"not the secret", Duration::from_secs(5));
        assert!(matches!(&wrong, Err(TransportError::Setup(msg)) if msg.contains("secret")));

        let mut silent = TcpStream::connect(server.addr()).unwrap();
        let mut garbage = TcpStream::connect(server.addr()).unwrap();
        garbage.write_all(&[0xAB; 4096]).unwrap();
        let mut huge = TcpStream::connect(server.addr()).unwrap();
        let mut hello = b"RVOD\x00\x01\x01".to_vec();
        hello.extend_from_slice(&[0; 32]);
        hello.extend_from_slice(&u16::MAX.to_be_bytes());
        huge.write_all(&hello).unwrap();
        for stranger in [&mut garbage, &mut huge] {
            stranger.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut byte = [0u8; 1];
            assert!(matches!(stranger.read(&mut byte), Ok(0) | Err(_)), "a stranger got an answer");
        }

        // The silent stranger is still connected; real clients are served meanwhile.
        let mut other = store(&server);
        assert_eq!(other.get("before", Duration::ZERO).unwrap(), b"1");
        assert_eq!(other.add("count", 4).unwrap(), 4);
        assert_eq!(client.add("count", 1).unwrap(), 5);
        silent.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut byte = [0u8; 1];
        assert!(matches!(silent.read(&mut byte), Ok(0) | Err(_)), "the silent stranger got an answer");
    });
}

/// Rank 0 builds a 2-rank mesh while strangers knock on its listener; rank 1 joins afterwards.
#[test]
fn mesh_listener_drops_strangers() {
    within(Duration::from_secs(30), || {
        let server = RendezvousServer::start(LOOPBACK, 0, SECRET.to_vec()).unwrap();
        let addr = server.addr();
        let rank0 = thread::spawn(move || join_mesh(addr, 0, 2, Duration::from_secs(20)));
        let mut client = store(&server);
        let listener: SocketAddr =
            String::from_utf8(client.get("world/addr/0", Duration::from_secs(5)).unwrap()).unwrap().parse().unwrap();

        let _silent = TcpStream::connect(listener).unwrap();
        let mut garbage = TcpStream::connect(listener).unwrap();
        garbage.write_all(&[0x55; 1000]).unwrap();
        let mut huge = TcpStream::connect(listener).unwrap();
        let mut hello = b"RVOD\x00\x01\x02".to_vec();
        hello.extend_from_slice(&[0; 32]);
        hello.extend_from_slice(&u16::MAX.to_be_bytes());
        huge.write_all(&hello).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut wrong_secret = TcpStream::connect(listener).unwrap();
        let claim = [&1u32.to_be_bytes()[..], b"world"].concat();
        assert!(handshake::connect(&mut wrong_secret, b"guess", Purpose::Mesh, &claim, deadline).is_err());
        let mut wrong_scope = TcpStream::connect(listener).unwrap();
        let other_claim = [&1u32.to_be_bytes()[..], b"elsewhere"].concat();
        let refused = handshake::connect(&mut wrong_scope, SECRET, Purpose::Mesh, &other_claim, deadline);
        assert!(matches!(refused, Err(handshake::HandshakeError::Unexpected)));

        let started = Instant::now();
        let mut rank1 = join_mesh(addr, 1, 2, Duration::from_secs(20));
        let mut rank0 = rank0.join().unwrap();
        assert!(started.elapsed() < Duration::from_secs(3), "a silent stranger delayed the mesh");
        let peer = thread::spawn(move || {
            let mut got = [0u8; 5];
            rank1.sendrecv(0, b"pong!", 0, &mut got).unwrap();
            got
        });
        let mut got = [0u8; 5];
        rank0.sendrecv(1, b"ping!", 1, &mut got).unwrap();
        assert_eq!(&got, b"pong!");
        assert_eq!(&peer.join().unwrap(), b"ping!");
    });
}

#[test]
fn closed_peer_is_reported_at_once() {
    within(Duration::from_secs(30), || {
        let results = on_mesh(3, Duration::from_secs(20), |mut t| {
            if t.rank() == 2 {
                t.close();
                return Vec::new();
            }
            let started = Instant::now();
            let mut buf = [0u8; 16];
            let recv = t.recv(2, &mut buf);
            let exchange = t.exchange(2, &[1u8; 64], 2, 64, &mut |_, _| {});
            assert!(started.elapsed() < Duration::from_secs(5));
            vec![recv, exchange]
        });
        for errors in &results[..2] {
            for err in errors {
                assert!(matches!(err, Err(TransportError::PeerClosed { peer: 2 })), "{err:?}");
            }
        }
    });
}

#[test]
fn silent_peer_times_out() {
    within(Duration::from_secs(30), || {
        let results = on_mesh(2, Duration::from_millis(500), |mut t| {
            if t.rank() == 1 {
                thread::sleep(Duration::from_secs(2));
                return None;
            }
            let started = Instant::now();
            let result = t.recv(1, &mut [0u8; 8]);
            Some((result, started.elapsed()))
        });
        let (result, elapsed) = results[0].as_ref().unwrap();
        assert!(matches!(result, Err(TransportError::Timeout { peer: 1, .. })), "{result:?}");
        assert!(*elapsed >= Duration::from_millis(450) && *elapsed < Duration::from_millis(1500), "{elapsed:?}");
    });
}

#[test]
fn wait_for_activity_tells_local_peer_and_idle_apart() {
    within(Duration::from_secs(30), || {
        on_mesh(2, Duration::from_secs(10), |mut t| {
            let waker = Waker::new().unwrap();
            if t.rank() == 1 {
                t.recv(0, &mut [0u8; 1]).unwrap();
                t.send(0, b"hi").unwrap();
                return;
            }
            let short = Duration::from_millis(50);
            assert_eq!(t.wait_for_activity(&waker, short).unwrap(), Activity::Idle);
            waker.wake();
            assert_eq!(t.wait_for_activity(&waker, Duration::from_secs(5)).unwrap(), Activity::Local);
            assert!(waker.drain());
            t.send(1, b"?").unwrap();
            assert_eq!(t.wait_for_activity(&waker, Duration::from_secs(5)).unwrap(), Activity::Peer);
            let mut got = [0u8; 2];
            t.recv(1, &mut got).unwrap();
            assert_eq!(&got, b"hi");
            // Rank 1 has returned and dropped its end: that is activity too, and recv says what happened.
            assert_eq!(t.wait_for_activity(&waker, Duration::from_secs(5)).unwrap(), Activity::Peer);
            assert!(matches!(t.recv(1, &mut got), Err(TransportError::PeerClosed { peer: 1 })));
        });
    });
}

/// Rank 2 stops making progress with its connections open (as under SIGSTOP); rank 0 times out on it and
/// closes. Rank 1, which only waits on rank 0, must name rank 2 as silent, as rank 0 does, not rank 0.
#[test]
fn a_frozen_rank_is_named_by_every_survivor() {
    within(Duration::from_secs(30), || {
        let results = on_mesh(3, Duration::from_secs(1), |mut t| match t.rank() {
            2 => {
                thread::sleep(Duration::from_secs(2));
                None
            }
            0 => {
                let result = t.recv(2, &mut [0u8; 8]);
                t.close();
                Some(result)
            }
            _ => {
                // Start waiting later than rank 0, so that rank 0 is the one that times out first.
                thread::sleep(Duration::from_millis(500));
                Some(t.recv(0, &mut [0u8; 8]))
            }
        });
        for (rank, result) in results[..2].iter().enumerate() {
            let result = result.as_ref().unwrap();
            assert!(matches!(result, Err(TransportError::Timeout { peer: 2, .. })), "rank {rank}: {result:?}");
        }
    });
}

/// Rank 2 dies (its connections end without a word); rank 0 sees that and closes. Rank 1, which only waits
/// on rank 0, must name rank 2, not rank 0 that closed because of it. (Rank 2 dies once rank 1 is waiting:
/// a rank that reads past the closing rank's urgent byte without having waited for it loses the byte.)
#[test]
fn a_dead_rank_is_named_by_every_survivor() {
    within(Duration::from_secs(30), || {
        let results = on_mesh(3, Duration::from_secs(10), |mut t| match t.rank() {
            2 => {
                thread::sleep(Duration::from_millis(300));
                drop(t);
                None
            }
            0 => {
                let result = t.recv(2, &mut [0u8; 8]);
                t.close();
                Some(result)
            }
            _ => {
                let started = Instant::now();
                let result = t.recv(0, &mut [0u8; 8]);
                assert!(started.elapsed() < Duration::from_secs(5));
                Some(result)
            }
        });
        for (rank, result) in results[..2].iter().enumerate() {
            let result = result.as_ref().unwrap();
            assert!(matches!(result, Err(TransportError::PeerClosed { peer: 2 })), "rank {rank}: {result:?}");
        }
    });
}

/// A rank that times out on the rank that waits on it tells it so; that rank, not at fault by its own
/// account, names the rank that closed on it.
#[test]
fn a_rank_blamed_by_its_peer_names_that_peer() {
    within(Duration::from_secs(30), || {
        let results = on_mesh(2, Duration::from_millis(500), |mut t| {
            if t.rank() == 1 {
                // Silent past rank 0's timeout, then waits on rank 0, which has given up on it.
                thread::sleep(Duration::from_millis(1000));
                return Some(t.recv(0, &mut [0u8; 8]));
            }
            let result = t.recv(1, &mut [0u8; 8]);
            t.close();
            assert!(matches!(result, Err(TransportError::Timeout { peer: 1, .. })), "{result:?}");
            None
        });
        let result = results[1].as_ref().unwrap();
        assert!(matches!(result, Err(TransportError::PeerClosed { peer: 0 })), "{result:?}");
    });
}
