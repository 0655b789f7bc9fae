//! [`ShmTransport`]: ranks on one host exchange bytes through a shared-memory segment instead of TCP.
//!
//! The segment ([`segment`]) holds one single-producer single-consumer byte ring per ordered pair of
//! ranks ([`layout`]). A send copies into the ring in pieces and publishes each piece at once, so the
//! receiver consumes (reduces, for a reduce-scatter) the bytes straight out of shared memory while the
//! rest is still being written: one copy in, none out.
//!
//! Waiting: an operation that cannot progress first spins briefly (the adaptive spin of [`spin`]), then
//! sleeps on its rank's doorbell futex, which peers ring after publishing bytes or freeing space; a
//! sleeping rank costs no CPU, so more ranks than cores still run at full speed. Sleeps are sliced so that
//! a peer that died (its pidfd turns readable) or closed is reported as [`TransportError::PeerClosed`] at
//! once, and a peer that makes no progress for the timeout as [`TransportError::Timeout`].
//!
//! Like the TCP transport, an operation blocked on a full ring moves whatever other peers sent into a
//! private stash (read later, before the ring), so ranks sending each other large messages never deadlock.
//!
//! A dead peer is noticed through its pidfd ([`liveness`]); the segment's name never outlives a rank that dies
//! while shared memory is being set up (`unlink_on_exit`); waits sleep on [`futex`]es.

pub mod futex;
pub mod layout;
pub mod liveness;
pub mod segment;
mod unlink_on_exit;

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::transport::rendezvous::StoreClient;
use crate::transport::spin;
use crate::transport::{Activity, Capabilities, Doorbell, IdleWaiter, Staging, Transport, TransportError, Waker};
use layout::{Corrupt, Geometry, Layout};
use liveness::Liveness;
use segment::Segment;

/// Most bytes written before they are published: small enough that the receiver starts early and the
/// piece is still in cache when it reads it.
const PIECE_BYTES: usize = 64 * 1024;
/// How far the send of a full-duplex exchange may run ahead of its receive. In a ring step every rank sends
/// a block to one neighbour while the other's arrives; unthrottled, senders kept the channels full and every
/// byte waited a whole channel's length (1 MiB) before its reader came to it, out of cache by then (a 64 MiB
/// reducescatter of two ranks took 1.8x as long, an allgather of 2 x 32 MiB 3x). Bytes still to come always have the window's
/// room: every rank of a collective exchanges at once, so no rank waits for another to send first.
const EXCHANGE_WINDOW: usize = 64 * 1024;
/// An exchange longer than this each way runs as consecutive exchanges of this many bytes, each finished
/// (sent and received) before the next starts. Measured, not derived: one exchange of a whole ring block
/// (tens of MiB) kept the ranks waiting on each other much longer than the same bytes in pieces (64 MiB
/// reducescatter, 2 ranks: 20.3 -> 12.6-13.4 ms; 3 ranks on 2 cores: 52 -> 45 ms, allreduce 79 -> 68 ms),
/// and exchanges up to this size (the two-rank pipeline's) are as before.
const EXCHANGE_PIECE: usize = 256 * 1024;
/// How long a blocked operation checks for readiness before it sleeps. Waits inside a collective always
/// spin this long (their peer is mid-collective too, so the wait is short); waits for the next round use the
/// adaptive spin, which stops spinning on a rank that keeps computing between collectives.
const SPIN: Duration = Duration::from_micros(50);
/// How long a rank that finds a peer closed looks for a dead rank to name instead (see `closed_error`).
const DEATH_GRACE: Duration = Duration::from_millis(200);
/// How long a rank whose wait timed out waits for the peer it waited on to name a third rank (at most a
/// quarter of the timeout; see `await_cause`).
const CAUSE_GRACE: Duration = Duration::from_secs(1);
/// Smallest staging area worth having when the full ones do not fit.
const MIN_STAGING: usize = 4 << 20;
const PAGE: usize = 4096;
/// Longest single sleep: how often a sleeping rank checks whether its peer died.
const SLEEP_SLICE: Duration = Duration::from_millis(20);
/// How often a rank waiting for rank 0 during set-up checks that rank 0 is still alive.
const CREATOR_CHECK: Duration = Duration::from_millis(50);

pub struct ShmTransport {
    rank: usize,
    layout: Layout,
    liveness: Liveness,
    /// Peers seen dead (their process exited).
    dead: Vec<bool>,
    /// Bytes taken out of a peer's ring while a send waited for space; they precede the ring's bytes.
    stash: Vec<VecDeque<u8>>,
    /// Each peer's read cursor on the channel to it, as this rank last read it (see `Channel::write`).
    tails_seen: Vec<u64>,
    timeout: Duration,
    closed: bool,
    /// Steps of the staging protocol completed (mirrors this rank's `step` in the segment).
    step: u64,
    /// When `wait_for_activity` last looked for dead peers.
    last_liveness_check: Instant,
}

/// Waits for a peer's bytes or a closed peer on a rank's doorbell, needing only the mapping (see
/// [`IdleWaiter`]): an idle engine sleeps in it while a caller may be using the transport.
struct RingWaiter {
    layout: Layout,
    rank: usize,
}

impl RingWaiter {
    /// Whether some peer sent bytes this rank has not read, or closed.
    fn peer_activity(&self) -> bool {
        let me = self.rank;
        (0..self.layout.size()).any(|p| {
            p != me
                && (self.layout.channel(p, me).readable() > 0
                    || self.layout.slot(p).closed.load(Ordering::Acquire) != 0)
        })
    }

    /// Sleep until the waker fires, a peer shows activity, or `timeout` passes (at most [`SLEEP_SLICE`] per
    /// futex wait, stamping this rank's heartbeat each time so peers see it is alive). With `spin`, first
    /// check for a while without sleeping (the adaptive spin).
    fn sleep(&self, waker: &Waker, timeout: Duration, spin: bool) {
        let ready = || waker.is_signalled() || self.peer_activity();
        if ready() || (spin && spin::spin_until(SPIN.min(timeout), ready)) {
            return;
        }
        let deadline = Instant::now() + timeout;
        let slot = self.layout.slot(self.rank);
        loop {
            slot.heartbeat.store(liveness::monotonic_ms(), Ordering::Relaxed);
            if ready() {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            slot.sleep_unless(left.min(SLEEP_SLICE), ready);
        }
    }
}

impl IdleWaiter for RingWaiter {
    fn wait(&self, waker: &Waker, timeout: Duration) {
        // Slices of at most SLEEP_SLICE, so the engine thread checks for dead peers that often.
        self.sleep(waker, timeout.min(SLEEP_SLICE), true);
    }

    fn every_peer_sent(&self) -> bool {
        let me = self.rank;
        (0..self.layout.size()).all(|p| p == me || self.layout.channel(p, me).readable() > 0)
    }
}

impl ShmTransport {
    fn new(rank: usize, layout: Layout, pids: Vec<u32>, timeout: Duration) -> ShmTransport {
        let size = layout.size();
        ShmTransport {
            rank,
            layout,
            liveness: Liveness::watch(pids),
            dead: vec![false; size],
            stash: vec![VecDeque::new(); size],
            tails_seen: vec![0; size],
            timeout,
            closed: false,
            step: 0,
            last_liveness_check: Instant::now(),
        }
    }

    /// All `size` ranks of a communicator as transports in this process, with staging areas of
    /// `staging` bytes (for tests and benchmarks).
    pub fn local_mesh(
        size: usize,
        staging: usize,
        dir: &Path,
        timeout: Duration,
    ) -> std::io::Result<Vec<ShmTransport>> {
        let geometry = Geometry { size, capacity: layout::channel_capacity(size), staging };
        let segment = Arc::new(Segment::create(dir, layout::segment_len(&geometry))?);
        segment.unlink();
        let layout = Layout::initialise(segment, geometry);
        let pids = vec![std::process::id(); size];
        Ok((0..size).map(|rank| ShmTransport::new(rank, layout.clone(), pids.clone(), timeout)).collect())
    }

    /// Build the shared-memory mesh of a communicator whose members all run on this host, this rank at
    /// position `rank` of `numbers` (the members' ranks as users know them, for messages), meeting
    /// in `scope` of the rendezvous store, with staging areas sized for `fusion_threshold`. When `dir` has
    /// no room for the staging areas, the segment is made without them (channels only; fusion then packs
    /// into private buffers), with a warning. Returns `Ok(None)`, on every rank alike, when some rank cannot
    /// create or map even that (for example a far too small `dir`): the caller then falls back to TCP.
    pub fn connect_mesh(
        rank: usize,
        numbers: &[usize],
        store: &mut StoreClient,
        scope: &str,
        dir: &Path,
        fusion_threshold: usize,
        timeout: Duration,
    ) -> Result<Option<ShmTransport>, TransportError> {
        let size = numbers.len();
        let number = |position: usize| numbers.get(position).copied().unwrap_or(position);
        let full = Geometry::for_ranks(size, fusion_threshold);
        let creating_key = format!("{scope}/shm/creating");
        let segment_key = format!("{scope}/shm/segment");
        let attached_key = |r: usize| format!("{scope}/shm/attached/{r}");
        // Rank 0 says where it will create the segment (and its pid) before creating it, and every rank
        // unlinks that name when set-up ends, however it ends: a rank killed at any point of set-up (even
        // rank 0, by SIGKILL, between creating and announcing the segment) leaves nothing behind once the
        // others have given up. The others also watch rank 0, so its death fails their set-up at once.
        let (name, creator, own_path) = if rank == 0 {
            let path = segment::fresh_path(dir).map_err(|e| e.to_string());
            let name = path.as_deref().ok().map(unlink_on_exit::unlink_on_drop);
            let shown = path.as_deref().map(|p| p.display().to_string()).unwrap_or_default();
            store.set(&creating_key, format!("{}:{shown}", std::process::id()).as_bytes())?;
            (name, None, Some(path))
        } else {
            let creating = String::from_utf8_lossy(&store.get_from(0, &creating_key, timeout)?).into_owned();
            let (pid, path) = creating.split_once(':').unwrap_or_default();
            let path = Path::new(path);
            let name = segment::is_segment_name(path).then(|| unlink_on_exit::unlink_on_drop(path));
            (name, Some(Liveness::watch(vec![pid.parse().unwrap_or(0)])), None)
        };
        let wait = |store: &mut StoreClient, peer: usize, key: &str| {
            store.get_from_checking(peer, key, timeout, CREATOR_CHECK, || match &creator {
                Some(creator) if creator.is_dead(0) => Err(TransportError::PeerClosed { peer: 0 }),
                _ => Ok(()),
            })
        };
        let mapped = if let Some(path) = own_path {
            let created = path.and_then(|path| Self::create_segment(&path, full));
            let announcement = match &created {
                Ok(l) => format!("ok:{}:{}", l.staging_len(), l.segment().path().display()),
                Err(e) => format!("no:{e}"),
            };
            store.set(&segment_key, announcement.as_bytes())?;
            created
        } else {
            let announcement = String::from_utf8_lossy(&wait(store, 0, &segment_key)?).into_owned();
            let parts: Vec<&str> = announcement.splitn(3, ':').collect();
            match parts.as_slice() {
                ["ok", staging, path] => match staging.parse() {
                    Ok(staging) => {
                        let geometry = Geometry { staging, ..full };
                        Segment::open(Path::new(path), layout::segment_len(&geometry))
                            .map_err(|e| e.to_string())
                            .and_then(|s| Layout::attach(Arc::new(s), geometry))
                    }
                    Err(_) => Err(format!("malformed announcement {announcement:?}")),
                },
                ["no", ..] => Err(format!("rank {} could not create it: {}", number(0), &announcement[3..])),
                _ => Err(format!("malformed announcement {announcement:?}")),
            }
        };
        if let Ok(layout) = &mapped {
            layout.slot(rank).pid.store(std::process::id(), Ordering::Release);
        }
        let verdict = match &mapped {
            Ok(_) => "ok".to_string(),
            Err(e) => format!("no:{e}"),
        };
        let verdicts = (|| -> Result<Vec<String>, TransportError> {
            store.set(&attached_key(rank), verdict.as_bytes())?;
            let mut failures = Vec::new();
            for r in 0..size {
                let v = String::from_utf8_lossy(&wait(store, r, &attached_key(r))?).into_owned();
                if let Some(reason) = v.strip_prefix("no:") {
                    failures.push(format!("rank {}: {reason}", number(r)));
                }
            }
            Ok(failures)
        })();
        // Everyone has mapped it (or given up, or this rank's wait failed, e.g. a rank died before mapping
        // it): the name can go. Every rank unlinks, so a rank killed right now cannot leave it behind.
        if let Ok(layout) = &mapped {
            layout.segment().unlink();
        }
        drop(name);
        let failures = verdicts?;
        if !failures.is_empty() {
            if rank == 0 {
                tracing::warn!(
                    "shared memory in {} is not usable ({}); ranks on this host use TCP instead",
                    dir.display(),
                    failures.join("; ")
                );
            }
            return Ok(None);
        }
        let layout = mapped.map_err(TransportError::Setup)?;
        let pids = (0..size).map(|r| layout.slot(r).pid.load(Ordering::Acquire)).collect();
        Ok(Some(ShmTransport::new(rank, layout, pids, timeout)))
    }

    /// Rank 0: create and lay out the segment at `path`, with smaller staging areas (halving down to 4 MiB)
    /// or none if there is no room for the full ones.
    fn create_segment(path: &Path, full: Geometry) -> Result<Layout, String> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let create =
            |g: Geometry| Segment::create_at(path, layout::segment_len(&g)).map(|s| Layout::initialise(Arc::new(s), g));
        let first_error = match create(full) {
            Ok(layout) => return Ok(layout),
            Err(e) if full.staging > 0 => e,
            Err(e) => return Err(e.to_string()),
        };
        let smaller = std::iter::successors(Some(full.staging / 2), |s| Some(s / 2)).take_while(|&s| s >= MIN_STAGING);
        for staging in smaller.chain([0]) {
            let Ok(layout) = create(Geometry { staging: staging / PAGE * PAGE, ..full }) else { continue };
            let instead = if staging == 0 {
                "without them (fused tensors are packed in private buffers)".to_string()
            } else {
                format!("with {} MiB ones", staging >> 20)
            };
            tracing::warn!(
                "shared memory in {} has no room for {} staging areas of {} MiB ({first_error}); ranks on this \
                 host share memory {instead}. Make it larger (docker: --shm-size) or lower RVOD_FUSION_THRESHOLD.",
                dir.display(),
                full.size,
                full.staging >> 20
            );
            return Ok(layout);
        }
        Err(first_error.to_string())
    }

    fn peer_closed(&self, peer: usize) -> bool {
        self.dead[peer] || self.layout.slot(peer).closed.load(Ordering::Acquire) != 0
    }

    /// Look at every peer's process; returns whether any is (now known to be) dead.
    fn refresh_dead(&mut self) -> bool {
        for peer in (0..self.layout.size()).filter(|&p| p != self.rank) {
            if !self.dead[peer] && self.liveness.is_dead(peer) {
                self.dead[peer] = true;
            }
        }
        self.dead.iter().any(|&d| d)
    }

    /// The error for `peer` having closed. A peer usually closes because it saw another rank die; the
    /// dead rank is the one worth naming, so it is named when known. Another rank's death can reach this
    /// process a moment after the closing peer saw it, so a closed (not dead) peer is given a short grace
    /// to let that show.
    fn closed_error(&mut self, peer: usize) -> TransportError {
        let err = self.closed_cause(peer);
        self.failing(err)
    }

    /// This rank fails with `err`: say so to the peers (see `note_failure`).
    fn failing(&mut self, err: TransportError) -> TransportError {
        self.note_failure(&err);
        err
    }

    /// What `closed_error` reports: the dead rank, or the rank `peer` blamed, or `peer`.
    fn closed_cause(&mut self, peer: usize) -> TransportError {
        if self.dead[peer] {
            return TransportError::PeerClosed { peer };
        }
        if let Some(passed_on) = self.cause_given_by(peer) {
            return passed_on;
        }
        let deadline = Instant::now() + DEATH_GRACE;
        loop {
            if self.refresh_dead() {
                if let Some(dead) = self.dead.iter().position(|&d| d) {
                    return TransportError::PeerClosed { peer: dead };
                }
            }
            if Instant::now() >= deadline {
                return TransportError::PeerClosed { peer };
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The failure `peer` said it closed because of, when it blamed a third rank (see `note_failure`).
    /// A blamed rank at or past this transport's size is one its owner numbers beyond it (a composite's rank
    /// on another host, see `transport::composite`).
    fn cause_given_by(&self, peer: usize) -> Option<TransportError> {
        let cause = self.layout.slot(peer).cause.load(Ordering::Acquire);
        let blamed = usize::try_from(cause >> 1).ok()?.checked_sub(1)?;
        if blamed == peer || blamed == self.rank {
            return None;
        }
        Some(if cause & 1 == 1 {
            TransportError::Timeout { peer: blamed, seconds: self.timeout.as_secs_f64() }
        } else {
            TransportError::PeerClosed { peer: blamed }
        })
    }

    /// Copy what fits of `data` into `to`'s ring (one piece at most).
    fn push(&mut self, to: usize, data: &[u8]) -> Result<usize, TransportError> {
        if self.peer_closed(to) {
            return Err(self.closed_error(to));
        }
        let tail_seen = &mut self.tails_seen[to];
        let n = self.layout.channel(self.rank, to).write(data, PIECE_BYTES, tail_seen).map_err(|c| corrupt(to, &c))?;
        if n > 0 {
            self.layout.ring(to);
        }
        Ok(n)
    }

    /// Hand up to `limit` bytes from `from` (stash first, then its ring) to `consume`.
    fn pop(&mut self, from: usize, limit: usize, consume: &mut dyn FnMut(&[u8])) -> Result<usize, TransportError> {
        let stash = &mut self.stash[from];
        if !stash.is_empty() {
            let n = limit.min(stash.len());
            let (a, b) = stash.as_slices();
            let first = n.min(a.len());
            consume(&a[..first]);
            if n > first {
                consume(&b[..n - first]);
            }
            stash.drain(..n);
            return Ok(n);
        }
        let channel = self.layout.channel(from, self.rank);
        let n = channel.read(limit, consume).map_err(|c| corrupt(from, &c))?;
        if n > 0 {
            self.layout.ring(from);
        }
        if n == 0 && self.peer_closed(from) && channel.readable() == 0 {
            return Err(self.closed_error(from));
        }
        Ok(n)
    }

    /// While our own send is stuck: move everything other peers (but `except`) sent into their stashes, so a
    /// peer stuck sending to us can go on. Returns whether anything moved.
    fn relieve(&mut self, except: Option<usize>) -> Result<bool, TransportError> {
        let mut moved = false;
        for peer in (0..self.layout.size()).filter(|&p| p != self.rank && Some(p) != except) {
            let stash = &mut self.stash[peer];
            let n = self
                .layout
                .channel(peer, self.rank)
                .read(usize::MAX, &mut |piece| stash.extend(piece))
                .map_err(|c| corrupt(peer, &c))?;
            if n > 0 {
                self.layout.ring(peer);
                moved = true;
            }
        }
        Ok(moved)
    }

    fn any_incoming(layout: &Layout, me: usize) -> bool {
        (0..layout.size()).any(|p| p != me && layout.channel(p, me).readable() > 0)
    }

    /// Wait until `ready`, `blame` closes or dies, or `blame` makes no progress for the timeout (an error).
    fn block(&mut self, blame: usize, ready: impl Fn(&Layout) -> bool) -> Result<(), TransportError> {
        let me = self.rank;
        let stop = |l: &Layout| ready(l) || l.slot(blame).closed.load(Ordering::Acquire) != 0;
        if spin::spin_for(SPIN, || stop(&self.layout)) {
            return Ok(());
        }
        let start = Instant::now();
        let mut last_check = start;
        loop {
            let slot = self.layout.slot(me);
            slot.heartbeat.store(liveness::monotonic_ms(), Ordering::Relaxed);
            if stop(&self.layout) {
                return Ok(());
            }
            slot.sleep_unless(SLEEP_SLICE, || stop(&self.layout));
            if last_check.elapsed() >= SLEEP_SLICE {
                last_check = Instant::now();
                // Any dead peer dooms the collective (and the one we wait on may be waiting for it).
                if self.refresh_dead() {
                    let dead = self.dead.iter().position(|&d| d).unwrap_or(blame);
                    return Err(self.failing(TransportError::PeerClosed { peer: dead }));
                }
                if start.elapsed() >= self.timeout {
                    if let Some(passed_on) = self.await_cause(blame) {
                        return Err(self.failing(passed_on));
                    }
                    let peer = self.frozen_rank(blame);
                    return Err(self.failing(TransportError::Timeout { peer, seconds: self.timeout.as_secs_f64() }));
                }
            }
        }
    }

    /// After a wait on `blame` timed out: the third rank `blame` blames, if it says so within a grace. A
    /// peer waiting on a frozen rank elsewhere (on another host, where no heartbeat shows) times out at
    /// about the same moment; its word lets every survivor name the frozen rank, not the peer it waited on.
    fn await_cause(&mut self, blame: usize) -> Option<TransportError> {
        let deadline = Instant::now() + (self.timeout / 4).min(CAUSE_GRACE);
        loop {
            let slot = self.layout.slot(self.rank);
            slot.heartbeat.store(liveness::monotonic_ms(), Ordering::Relaxed);
            if let Some(passed_on) = self.cause_given_by(blame) {
                return Some(passed_on);
            }
            if self.layout.slot(blame).closed.load(Ordering::Acquire) != 0 || Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The rank to name for a wait on `blame` that timed out (see `liveness::frozen_rank`).
    fn frozen_rank(&self, blame: usize) -> usize {
        let heartbeats: Vec<u64> =
            (0..self.layout.size()).map(|r| self.layout.slot(r).heartbeat.load(Ordering::Relaxed)).collect();
        liveness::frozen_rank(self.rank, blame, &heartbeats, liveness::monotonic_ms())
    }
}

/// The error for a channel whose cursors `peer`'s side left inconsistent.
fn corrupt(peer: usize, c: &Corrupt) -> TransportError {
    TransportError::Protocol {
        peer,
        detail: format!("shared-memory channel cursors are inconsistent (head {}, tail {})", c.head, c.tail),
    }
}

impl Transport for ShmTransport {
    fn label(&self) -> &'static str {
        "shm"
    }

    /// A hand-off is a few stores and loads in shared memory (and a wake-up where the peer sleeps).
    fn capabilities(&self) -> Capabilities {
        Capabilities { cheap_handoffs: true }
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.layout.size()
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), TransportError> {
        let me = self.rank;
        let mut sent = 0;
        while sent < data.len() {
            let n = self.push(peer, &data[sent..])?;
            sent += n;
            if n == 0 && !self.relieve(None)? {
                self.block(peer, |l| l.channel(me, peer).writable() > 0 || Self::any_incoming(l, me))?;
            }
        }
        Ok(())
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), TransportError> {
        self.sendrecv(peer, &[], peer, buf)
    }

    fn peek(&mut self, peer: usize, buf: &mut [u8]) -> bool {
        let stash = &self.stash[peer];
        if !stash.is_empty() {
            // Bytes taken out of the ring earlier come first; a look ahead stays within them.
            if stash.len() < buf.len() {
                return false;
            }
            for (dst, src) in buf.iter_mut().zip(stash) {
                *dst = *src;
            }
            return true;
        }
        peer != self.rank && peer < self.layout.size() && self.layout.channel(peer, self.rank).peek(buf)
    }

    fn exchange(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError> {
        let me = self.rank;
        let (mut sent, mut got) = (0, 0);
        // Long exchanges go as consecutive exchanges of EXCHANGE_PIECE bytes each way (see there): piece
        // `piece` is sent and received whole before the next one starts.
        let mut piece = 0;
        loop {
            let (send_start, recv_start) =
                (send.len().min(piece * EXCHANGE_PIECE), recv_len.min(piece * EXCHANGE_PIECE));
            let (send_end, recv_end) =
                (send.len().min((piece + 1) * EXCHANGE_PIECE), recv_len.min((piece + 1) * EXCHANGE_PIECE));
            if sent == send_end && got == recv_end {
                if sent == send.len() && got == recv_len {
                    return Ok(());
                }
                piece += 1;
                continue;
            }
            let mut progressed = false;
            // While bytes of the piece are still to come, its send runs at most EXCHANGE_WINDOW ahead of them.
            let send_limit =
                if got < recv_end { send_end.min(send_start + (got - recv_start) + EXCHANGE_WINDOW) } else { send_end };
            if sent < send_limit {
                let n = self.push(to, &send[sent..send_limit])?;
                sent += n;
                progressed |= n > 0;
            }
            while got < recv_end {
                let mut offset = got;
                let n = self.pop(from, recv_end - got, &mut |bytes| {
                    sink(offset, bytes);
                    offset += bytes.len();
                })?;
                if n == 0 {
                    break;
                }
                got += n;
                progressed = true;
            }
            if sent == send_end && got == recv_end {
                continue;
            }
            if !(progressed || sent < send_limit && self.relieve(Some(from))?) {
                let (sending, receiving) = (sent < send_limit, got < recv_end);
                let blame = if receiving { from } else { to };
                self.block(blame, |l| {
                    (sending && l.channel(me, to).writable() > 0) || (receiving && l.channel(from, me).readable() > 0)
                })?;
                if sending && blame != to && self.peer_closed(to) {
                    return Err(self.closed_error(to));
                }
            }
        }
    }

    fn wait_for_activity(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError> {
        let deadline = Instant::now() + timeout;
        let mut spin = true;
        loop {
            if self.last_liveness_check.elapsed() >= SLEEP_SLICE {
                self.last_liveness_check = Instant::now();
                self.refresh_dead();
            }
            if waker.is_signalled() {
                return Ok(Activity::Local);
            }
            if self.stash.iter().any(|s| !s.is_empty()) || self.dead.iter().any(|&d| d) {
                return Ok(Activity::Peer);
            }
            let waiter = RingWaiter { layout: self.layout.clone(), rank: self.rank };
            if waiter.peer_activity() {
                return Ok(Activity::Peer);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Activity::Idle);
            }
            waiter.sleep(waker, left.min(SLEEP_SLICE), spin);
            spin = false;
        }
    }

    fn idle_waiter(&self) -> Option<Box<dyn IdleWaiter>> {
        Some(Box::new(RingWaiter { layout: self.layout.clone(), rank: self.rank }))
    }

    /// Tell the peers, through this rank's slot, which rank to name: a peer that finds this rank closed
    /// names the rank it blamed (every survivor then names the rank that died or froze, as over TCP).
    fn note_failure(&mut self, cause: &TransportError) {
        let (blamed, timed_out) = match cause {
            TransportError::PeerClosed { peer } | TransportError::Io { peer, .. } => (*peer, false),
            TransportError::Timeout { peer, .. } => (*peer, true),
            TransportError::Setup(_)
            | TransportError::KeyTimeout { .. }
            | TransportError::Connect { .. }
            | TransportError::NotConnected { .. }
            | TransportError::Protocol { .. } => return,
        };
        if blamed == self.rank {
            return;
        }
        let code = ((blamed as u64 + 1) << 1) | u64::from(timed_out);
        let _ = self.layout.slot(self.rank).cause.compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
    }

    fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.layout.slot(self.rank).closed.store(1, Ordering::Release);
        for peer in (0..self.layout.size()).filter(|&p| p != self.rank) {
            self.layout.ring(peer);
        }
    }

    fn doorbell(&self) -> Option<Doorbell> {
        let layout = self.layout.clone();
        let me = self.rank;
        Some(Arc::new(move || layout.ring(me)))
    }

    fn staging(&mut self) -> Option<&mut dyn Staging> {
        if self.layout.staging_len() == 0 {
            return None;
        }
        Some(self)
    }
}

impl Staging for ShmTransport {
    fn area_len(&self) -> usize {
        self.layout.staging_len()
    }

    fn area(&self, rank: usize) -> *mut u8 {
        self.layout.staging(rank)
    }

    fn completed(&self) -> u64 {
        self.step
    }

    fn arrive(&mut self) -> u64 {
        self.step += 1;
        self.layout.slot(self.rank).step.store(self.step, Ordering::Release);
        for peer in (0..self.layout.size()).filter(|&p| p != self.rank) {
            self.layout.ring(peer);
        }
        self.step
    }

    fn wait_for(&mut self, step: u64) -> Result<(), TransportError> {
        let me = self.rank;
        for peer in (0..self.layout.size()).filter(|&p| p != me) {
            let reached = move |l: &Layout| l.slot(peer).step.load(Ordering::Acquire) >= step;
            if reached(&self.layout) {
                continue;
            }
            self.block(peer, reached)?;
            if !reached(&self.layout) {
                return Err(self.closed_error(peer));
            }
        }
        Ok(())
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rendezvous::RendezvousServer;
    use std::net::Ipv4Addr;

    /// Log lines written while `body` runs on this thread.
    fn logged(body: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(move || writer.clone()).finish();
        tracing::subscriber::with_default(subscriber, body);
        let text = String::from_utf8_lossy(&lines.0.lock().unwrap()).into_owned();
        text
    }

    #[test]
    fn the_warning_that_shared_memory_is_unusable_names_global_ranks() {
        let server = RendezvousServer::start(Ipv4Addr::LOCALHOST.into(), 0, b"k".to_vec()).unwrap();
        let addr = server.addr();
        let missing = std::env::temp_dir().join(format!("rvod-no-such-dir-{}", std::process::id()));
        // A process set of global ranks 3 and 6 on this host, whose segment cannot be created.
        let other = {
            let missing = missing.clone();
            std::thread::spawn(move || {
                let mut store = StoreClient::connect(addr, b"k", Duration::from_secs(5)).unwrap();
                ShmTransport::connect_mesh(1, &[3, 6], &mut store, "set2", &missing, 1 << 20, Duration::from_secs(10))
                    .map(|t| t.is_none())
            })
        };
        let mut store = StoreClient::connect(addr, b"k", Duration::from_secs(5)).unwrap();
        let mut fell_back = false;
        let log = logged(|| {
            fell_back =
                ShmTransport::connect_mesh(0, &[3, 6], &mut store, "set2", &missing, 1 << 20, Duration::from_secs(10))
                    .unwrap()
                    .is_none();
        });
        assert!(fell_back && other.join().unwrap().unwrap(), "both fall back to TCP");
        assert!(log.contains("is not usable (rank 3: "), "{log}");
        assert!(log.contains("; rank 6: rank 3 could not create it: "), "{log}");
        assert!(!log.contains("rank 0") && !log.contains("rank 1"), "{log}");
    }

    #[test]
    fn a_timeout_waiting_for_the_creator_names_its_global_rank() {
        let server = RendezvousServer::start(Ipv4Addr::LOCALHOST.into(), 0, b"k".to_vec()).unwrap();
        let mut store = StoreClient::connect(server.addr(), b"k", Duration::from_secs(5)).unwrap();
        let dir = std::env::temp_dir();
        let err = ShmTransport::connect_mesh(1, &[4, 7], &mut store, "set3", &dir, 1 << 20, Duration::from_millis(100))
            .map(|_| ())
            .unwrap_err()
            .renumbered(&[4, 7])
            .to_string();
        assert!(err.contains("waiting for rank 4 to publish 'set3/shm/creating'"), "{err}");
    }

    #[test]
    fn rank_0_dying_before_announcing_its_segment_fails_the_others_at_once_and_leaves_no_segment() {
        let dir = std::env::temp_dir().join(format!("rvod-creator-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let server = RendezvousServer::start(Ipv4Addr::LOCALHOST.into(), 0, b"k".to_vec()).unwrap();
        let addr = server.addr();
        // Rank 0 is played by a child process: it names its segment, creates it, and dies before announcing it.
        let mut rank0 = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let path = segment::fresh_path(&dir).unwrap();
        let mut store = StoreClient::connect(addr, b"k", Duration::from_secs(5)).unwrap();
        store.set("s/shm/creating", format!("{}:{}", rank0.id(), path.display()).as_bytes()).unwrap();
        std::fs::write(&path, b"segment").unwrap();
        let survivor_dir = dir.clone();
        let survivor = std::thread::spawn(move || {
            let mut store = StoreClient::connect(addr, b"k", Duration::from_secs(5)).unwrap();
            let result = ShmTransport::connect_mesh(
                1,
                &[0, 1],
                &mut store,
                "s",
                &survivor_dir,
                1 << 20,
                Duration::from_secs(30),
            );
            (result.map(|_| ()), Instant::now())
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(path.exists(), "the segment stays while rank 0 may still announce it");
        rank0.kill().unwrap();
        rank0.wait().unwrap();
        let killed = Instant::now();
        let (result, failed) = survivor.join().unwrap();
        assert!(matches!(result, Err(TransportError::PeerClosed { peer: 0 })), "{result:?}");
        assert!(failed - killed < Duration::from_secs(2), "failed {:?} after rank 0 died", failed - killed);
        assert!(!path.exists(), "the survivor unlinks the segment rank 0 named");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
