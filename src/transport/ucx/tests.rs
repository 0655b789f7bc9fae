//! Two or three UCX transports in one process, as threads over loopback (whatever transports UCX picks
//! here: TCP or shared memory). Skipped, with the reason printed, where libucp cannot be loaded.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use super::*;
use crate::transport::rendezvous::{RendezvousServer, StoreClient};

const SECRET: &[u8] = b"ucx test secret";

fn loaded() -> Option<&'static Ucx> {
    match ucx(None) {
        Ok(ucx) => Some(ucx),
        Err(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}

/// `size` ranks, each running `body(transport)` on a thread of its own; their results in rank order.
fn ranks<T: Send + 'static>(
    size: usize,
    timeout: Duration,
    body: impl Fn(UcxTransport) -> T + Send + Sync + 'static,
) -> Option<Vec<T>> {
    let ucx = loaded()?;
    ranks_tuned(size, timeout, tuned(ucx.resources().unwrap(), &|_| false), body)
}

/// [`ranks`] with UCX set up as `tuning` says (the engine's choice for the transports here, in `ranks`).
fn ranks_tuned<T: Send + 'static>(
    size: usize,
    timeout: Duration,
    tuning: Tuning,
    body: impl Fn(UcxTransport) -> T + Send + Sync + 'static,
) -> Option<Vec<T>> {
    let ucx = loaded()?;
    let tuning = std::sync::Arc::new(tuning);
    let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let server = RendezvousServer::start(localhost, 0, SECRET.to_vec()).unwrap();
    let addr = server.addr();
    let body = std::sync::Arc::new(body);
    let threads: Vec<_> = (0..size)
        .map(|rank| {
            let (body, tuning) = (body.clone(), tuning.clone());
            thread::spawn(move || {
                let mut store = StoreClient::connect(addr, SECRET, timeout).unwrap();
                let control = TcpTransport::connect_mesh(
                    rank,
                    size,
                    &mut store,
                    "ucx-test",
                    SECRET,
                    localhost,
                    "127.0.0.1",
                    timeout,
                )
                .unwrap();
                body(UcxTransport::over(control, ucx, &tuning, timeout).unwrap())
            })
        })
        .collect();
    let results = threads.into_iter().map(|t| t.join().unwrap()).collect();
    server.stop();
    Some(results)
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(31).wrapping_add(seed) % 251) as u8).collect()
}

#[test]
fn bytes_arrive_in_order_whatever_the_sizes_of_sends_and_receives() {
    let sizes = [0usize, 1, 7, 4097, 3 * CHUNK + 3];
    let Some(results) = ranks(2, Duration::from_secs(20), move |mut t| {
        let other = 1 - t.rank();
        if t.rank() == 0 {
            for &len in &sizes {
                t.send(other, &pattern(len, len as u32)).unwrap();
            }
            // One message taken by two receives, two messages by one receive.
            t.send(other, &pattern(10, 1)).unwrap();
            t.send(other, &pattern(3, 2)).unwrap();
            t.send(other, &pattern(5, 3)).unwrap();
            Vec::new()
        } else {
            let mut seen = Vec::new();
            for &len in &sizes {
                let mut buf = vec![0u8; len];
                t.recv(other, &mut buf).unwrap();
                seen.push(buf == pattern(len, len as u32));
            }
            let (mut a, mut b, mut c) = ([0u8; 4], [0u8; 6], [0u8; 8]);
            t.recv(other, &mut a).unwrap();
            t.recv(other, &mut b).unwrap();
            t.recv(other, &mut c).unwrap();
            seen.push([&a[..], &b[..]].concat() == pattern(10, 1));
            seen.push(c[..] == [pattern(3, 2), pattern(5, 3)].concat()[..]);
            seen
        }
    }) else {
        return;
    };
    assert_eq!(results[1], vec![true; 7]);
}

#[test]
fn large_exchanges_both_ways_at_once_do_not_deadlock_and_sink_in_order() {
    let len = 3 * CHUNK + 5;
    let Some(results) = ranks(2, Duration::from_secs(30), move |mut t| {
        let other = 1 - t.rank();
        // Plain sends both ways first: each side must take the other's in while it waits.
        t.send(other, &pattern(len, t.rank() as u32)).unwrap();
        let mut got = vec![0u8; len];
        t.recv(other, &mut got).unwrap();
        let sent_ok = got == pattern(len, other as u32);
        let mut received = vec![0u8; len];
        let mut next = 0;
        let mut in_order = true;
        t.exchange(other, &pattern(len, 10 + t.rank() as u32), other, len, &mut |off, bytes| {
            in_order &= off == next;
            next += bytes.len();
            received[off..off + bytes.len()].copy_from_slice(bytes);
        })
        .unwrap();
        (sent_ok, in_order, received == pattern(len, 10 + other as u32))
    }) else {
        return;
    };
    assert_eq!(results, vec![(true, true, true); 2]);
}

#[test]
fn sendrecv_lands_every_byte_in_order_across_message_bounds_both_ways_at_once() {
    // Messages of 5 and 6 chunks' worth (cut at CHUNK), received as 2.5, 3.5 and 5 chunks' worth: some
    // messages land straight in place, some are split between two receives, and one receive first takes
    // what an earlier one left received ahead.
    let (a, b) = (5 * CHUNK + 7, 6 * CHUNK + 1);
    let cuts = [CHUNK * 5 / 2, CHUNK * 7 / 2, a + b - CHUNK * 6];
    let Some(results) = ranks(2, Duration::from_secs(30), move |mut t| {
        let (rank, other) = (t.rank(), 1 - t.rank());
        let outgoing = [pattern(a, 20 + rank as u32), pattern(b, 30 + rank as u32)].concat();
        let mut incoming = vec![0u8; a + b];
        let mut sent = 0;
        let mut got = 0;
        for (i, &cut) in cuts.iter().enumerate() {
            // Sends of whole messages (a, then b) while receiving the cuts.
            let send: &[u8] = match i {
                0 => &outgoing[..a],
                1 => &outgoing[a..],
                _ => &[],
            };
            t.sendrecv(other, send, other, &mut incoming[got..got + cut]).unwrap();
            sent += send.len();
            got += cut;
        }
        (sent, incoming == [pattern(a, 20 + other as u32), pattern(b, 30 + other as u32)].concat())
    }) else {
        return;
    };
    assert_eq!(results, vec![(a + b, true); 2]);
}

#[test]
fn a_ring_of_three_exchanges_with_different_peers() {
    let Some(results) = ranks(3, Duration::from_secs(20), |mut t| {
        let (rank, size) = (t.rank(), t.size());
        let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
        let mut got = vec![0u8; 2 * CHUNK + 1];
        t.sendrecv(right, &pattern(2 * CHUNK + 1, rank as u32), left, &mut got).unwrap();
        got == pattern(2 * CHUNK + 1, left as u32)
    }) else {
        return;
    };
    assert_eq!(results, vec![true; 3]);
}

#[test]
fn waits_report_idle_local_wake_ups_and_peers_that_sent() {
    let Some(results) = ranks(2, Duration::from_secs(20), |mut t| {
        let other = 1 - t.rank();
        let waker = Waker::new().unwrap();
        if t.rank() == 0 {
            let started = Instant::now();
            let idle = t.wait_for_activity(&waker, Duration::from_millis(200)).unwrap();
            let waited = started.elapsed();
            waker.wake();
            let local = t.wait_for_activity(&waker, Duration::from_secs(5)).unwrap();
            waker.drain();
            t.send(other, b"go").unwrap();
            let mut reply = [0u8; 2];
            t.recv(other, &mut reply).unwrap();
            vec![
                format!("{idle:?}"),
                (waited >= Duration::from_millis(190)).to_string(),
                format!("{local:?}"),
                String::from_utf8_lossy(&reply).into_owned(),
            ]
        } else {
            let peer = t.wait_for_activity(&waker, Duration::from_secs(10)).unwrap();
            let mut go = [0u8; 2];
            t.recv(other, &mut go).unwrap();
            t.send(other, b"ok").unwrap();
            vec![format!("{peer:?}"), String::from_utf8_lossy(&go).into_owned()]
        }
    }) else {
        return;
    };
    assert_eq!(results[0], ["Idle", "true", "Local", "ok"]);
    assert_eq!(results[1], ["Peer", "go"]);
}

/// Both ways UCX may be set up: with its own peer error handling (over RDMA) and without (its TCP here).
#[test]
fn a_peer_that_closes_is_named_and_a_silent_one_times_out_with_and_without_ucxs_error_handling() {
    a_peer_that_closes_is_named_and_a_silent_one_times_out(true);
    a_peer_that_closes_is_named_and_a_silent_one_times_out(false);
}

fn a_peer_that_closes_is_named_and_a_silent_one_times_out(peer_error_handling: bool) {
    let (tx, rx) = mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let tx = std::sync::Mutex::new(tx);
    let tuning = Tuning { settings: Vec::new(), peer_error_handling };
    let Some(results) = ranks_tuned(2, Duration::from_secs(2), tuning, move |mut t| {
        let other = 1 - t.rank();
        if t.rank() == 0 {
            // Silent while rank 1 waits for it, then gone.
            let _ = rx.lock().unwrap().recv_timeout(Duration::from_secs(20));
            t.close();
            String::new()
        } else {
            let started = Instant::now();
            let silent = t.recv(other, &mut [0u8; 4]).unwrap_err();
            let timed_out = format!("{silent} after {}s", started.elapsed().as_secs());
            let _ = tx.lock().unwrap().send(());
            let started = Instant::now();
            let closed = t.recv(other, &mut [0u8; 4]).unwrap_err();
            format!("{timed_out}; {closed} within 2 s: {}", started.elapsed() < Duration::from_secs(2))
        }
    }) else {
        return;
    };
    assert_eq!(
        results[1],
        "no progress from rank 0 for 2.0 s after 2s; rank 0 exited or closed its connection within 2 s: true"
    );
}

/// The send-buffer sizes of this process's TCP sockets (`SO_SNDBUF`, as the kernel reports it: twice what
/// was asked for).
fn tcp_send_buffers() -> Vec<i32> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    fds.flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|fd| {
            let (mut kind, mut size) = (0 as libc::c_int, 0 as libc::c_int);
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: valid out-pointers of the length given; a descriptor that is not a socket just fails.
            let typed = unsafe {
                libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, (&mut kind as *mut i32).cast(), &mut len)
            };
            len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: as above.
            let sized = unsafe {
                libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, (&mut size as *mut i32).cast(), &mut len)
            };
            (typed == 0 && sized == 0 && kind == libc::SOCK_STREAM).then_some(size)
        })
        .collect()
}

#[test]
fn the_tuned_send_buffer_reaches_ucxs_tcp_sockets() {
    // Over UCX's TCP transport alone (as without RDMA), the settings `tuned` gives reach UCX: its sockets'
    // send buffer is the one asked for (the kernel reports it doubled).
    let tcp_only = vec!["tcp/lo".to_string()];
    let mut tuning = tuned(&tcp_only, &|_| false);
    let asked = tuning.settings.iter().find(|(key, _)| key.contains("SNDBUF")).expect("a send buffer over TCP").1;
    let asked: i32 = asked.trim_end_matches('k').parse::<i32>().unwrap() * 1024;
    tuning.settings.push(("TLS", "tcp"));
    let Some(results) = ranks_tuned(2, Duration::from_secs(20), tuning, move |mut t| {
        let other = 1 - t.rank();
        let mut got = vec![0u8; 1 << 20];
        t.sendrecv(other, &pattern(1 << 20, 7), other, &mut got).unwrap();
        (got == pattern(1 << 20, 7), tcp_send_buffers())
    }) else {
        return;
    };
    for (rank, (arrived, buffers)) in results.iter().enumerate() {
        assert!(arrived, "rank {rank}: bytes differ");
        assert!(
            buffers.contains(&(2 * asked)),
            "rank {rank}: no TCP socket with a {asked}-byte send buffer: {buffers:?}"
        );
    }
}
