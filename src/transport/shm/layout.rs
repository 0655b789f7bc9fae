//! Where things live in a communicator's segment, and typed access to them.
//!
//! ```text
//! [header: magic, size, channel capacity]           one cache line
//! [rank slot 0] .. [rank slot n-1]                   one cache line each: doorbell, sleepers, pid, closed,
//!                                                    step, heartbeat
//! (page aligned)
//! [channel 0->1] [channel 0->2] .. [channel n-1->n-2]   one per ordered pair of ranks
//! [staging 0] .. [staging n-1]                        one per rank, page aligned (see below)
//! ```
//! A channel is a single-producer single-consumer byte ring: `head` (bytes ever written, advanced only by
//! the sender) and `tail` (bytes ever consumed, advanced only by the receiver) on separate cache lines,
//! then `capacity` bytes of data. Bytes in `[tail, head)` belong to the receiver, the rest to the sender.
//!
//! Every rank has a doorbell: a futex word rung after anything another party may be waiting for (bytes
//! arrived, space freed, a peer closed, local work submitted). A rank about to sleep registers in
//! `sleepers` before it looks at its condition a last time ([`RankSlot::sleep_unless`]), and a ringer
//! bumps the word and makes the wake-up syscall only when somebody sleeps ([`Layout::ring`]): while every
//! rank is awake (a lockstep loop of small ops), ringing writes nothing another core has to give up.
//!
//! Staging areas are the fusion buffers: each rank writes its contribution to a collective into its own
//! area, and every rank reads the others' areas directly (see `ring::staged`). A rank's `step` counter says
//! how far it has got through that protocol; it only ever grows.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::futex;
use super::segment::Segment;

const MAGIC: u64 = 0x7276_6f64_5f73_686d; // "rvod_shm"
const LINE: usize = 64;
const PAGE: usize = 4096;
/// Channel header: head and tail, each on its own cache line.
const CHANNEL_HEADER: usize = 2 * LINE;

#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    size: AtomicU64,
    capacity: AtomicU64,
    staging: AtomicU64,
}

#[repr(C, align(64))]
pub struct RankSlot {
    pub doorbell: AtomicU32,
    pub sleepers: AtomicU32,
    pub pid: AtomicU32,
    pub closed: AtomicU32,
    /// Steps of the staging protocol this rank has completed.
    pub step: AtomicU64,
    /// When this rank last showed it was alive while waiting (milliseconds of the system-wide monotonic
    /// clock, see `liveness::monotonic_ms`); 0 before its first wait. A frozen rank's heartbeat stops.
    pub heartbeat: AtomicU64,
    /// Why this rank gave up, set before `closed` (see `ShmTransport::note_failure`): 0 for nothing said,
    /// else the blamed rank plus one, shifted left once, the low bit set for a time-out.
    pub cause: AtomicU64,
}

impl RankSlot {
    /// Sleep on this slot's doorbell for at most `timeout` unless `ready()`. Registered as a sleeper before
    /// `ready` is checked, so whatever a ringer published before ringing is either seen by that check or
    /// rings this sleep awake (see [`Layout::ring`]).
    pub fn sleep_unless(&self, timeout: Duration, ready: impl FnOnce() -> bool) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let seq = self.doorbell.load(Ordering::SeqCst);
        if !ready() {
            futex::wait(&self.doorbell, seq, timeout);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

#[repr(C, align(64))]
struct Cursor {
    value: AtomicU64,
}

/// Data bytes of each channel for `size` ranks: 1 MiB for small jobs, less for many ranks on one host so
/// that all channels together stay within 256 MiB.
pub fn channel_capacity(size: usize) -> usize {
    let pairs = (size * size.saturating_sub(1)).max(1);
    let budget = (256usize << 20) / pairs;
    (budget.clamp(64 << 10, 1 << 20) / PAGE) * PAGE
}

/// Bytes of each rank's staging area for `size` ranks and a fusion threshold of `fusion_threshold` bytes:
/// the threshold within 4..64 MiB, and at most 512 MiB for all ranks together. The segment is allocated up
/// front (tmpfs pages are memory), so it is bounded even where the threshold is not.
pub fn staging_capacity(size: usize, fusion_threshold: usize) -> usize {
    const MIB: usize = 1 << 20;
    let share = (512 * MIB / size.max(1)).max(4 * MIB);
    (fusion_threshold.clamp(4 * MIB, 64 * MIB).min(share) / PAGE) * PAGE
}

/// The shape of a segment: ranks, bytes per channel, bytes per staging area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub size: usize,
    pub capacity: usize,
    pub staging: usize,
}

impl Geometry {
    /// The segment for `size` ranks with the default channel capacity and staging areas for
    /// `fusion_threshold` (see [`channel_capacity`], [`staging_capacity`]).
    pub fn for_ranks(size: usize, fusion_threshold: usize) -> Geometry {
        Geometry { size, capacity: channel_capacity(size), staging: staging_capacity(size, fusion_threshold) }
    }
}

fn slots_offset() -> usize {
    LINE
}

fn channels_offset(size: usize) -> usize {
    (slots_offset() + size * LINE).next_multiple_of(PAGE)
}

fn channel_stride(capacity: usize) -> usize {
    (CHANNEL_HEADER + capacity).next_multiple_of(PAGE)
}

fn staging_offset(g: &Geometry) -> usize {
    channels_offset(g.size) + g.size * g.size.saturating_sub(1) * channel_stride(g.capacity)
}

fn staging_stride(staging: usize) -> usize {
    staging.next_multiple_of(PAGE)
}

/// Bytes of a segment of this geometry.
pub fn segment_len(g: &Geometry) -> usize {
    staging_offset(g) + g.size * staging_stride(g.staging)
}

/// One rank's typed view of a mapped segment.
#[derive(Clone)]
pub struct Layout {
    segment: Arc<Segment>,
    geometry: Geometry,
    size: usize,
}

/// A channel's cursors and data, borrowed from the segment.
pub struct Channel<'a> {
    pub head: &'a AtomicU64,
    pub tail: &'a AtomicU64,
    data: *mut u8,
    pub capacity: usize,
}

impl Layout {
    /// Write the header of a freshly created (zero-filled) segment.
    pub fn initialise(segment: Arc<Segment>, geometry: Geometry) -> Layout {
        let layout = Layout { segment, geometry, size: geometry.size };
        let header = layout.header();
        header.size.store(geometry.size as u64, Ordering::Relaxed);
        header.capacity.store(geometry.capacity as u64, Ordering::Relaxed);
        header.staging.store(geometry.staging as u64, Ordering::Relaxed);
        header.magic.store(MAGIC, Ordering::Release);
        layout
    }

    /// View a segment another rank initialised; checks that it has the expected geometry.
    pub fn attach(segment: Arc<Segment>, geometry: Geometry) -> Result<Layout, String> {
        let expected = segment_len(&geometry);
        if segment.len() != expected {
            return Err(format!("segment is {} bytes, expected {expected}", segment.len()));
        }
        let layout = Layout { segment, geometry, size: geometry.size };
        let header = layout.header();
        let found = (
            header.magic.load(Ordering::Acquire),
            header.size.load(Ordering::Relaxed),
            header.capacity.load(Ordering::Relaxed),
            header.staging.load(Ordering::Relaxed),
        );
        let Geometry { size, capacity, staging } = geometry;
        if found != (MAGIC, size as u64, capacity as u64, staging as u64) {
            return Err(format!(
                "segment header {found:x?} does not describe {size} ranks with {capacity}-byte channels and \
                 {staging}-byte staging areas"
            ));
        }
        Ok(layout)
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    fn header(&self) -> &Header {
        // SAFETY: offset 0 of a page-aligned mapping at least one line long; Header is all atomics.
        unsafe { &*(self.segment.base() as *const Header) }
    }

    pub fn slot(&self, rank: usize) -> &RankSlot {
        assert!(rank < self.size);
        // SAFETY: inside the slot area (checked rank), 64-byte aligned; RankSlot is all atomics.
        unsafe { &*(self.segment.base().add(slots_offset() + rank * LINE) as *const RankSlot) }
    }

    /// The channel carrying bytes from `from` to `to` (`from != to`).
    pub fn channel(&self, from: usize, to: usize) -> Channel<'_> {
        assert!(from < self.size && to < self.size && from != to);
        let index = from * (self.size - 1) + if to > from { to - 1 } else { to };
        // SAFETY: the channel area holds size*(size-1) strides (checked indices); the cursors are page/line
        // aligned atomics and the data area follows them inside the same stride.
        unsafe {
            let capacity = self.geometry.capacity;
            let base = self.segment.base().add(channels_offset(self.size) + index * channel_stride(capacity));
            Channel {
                head: &(*(base as *const Cursor)).value,
                tail: &(*(base.add(LINE) as *const Cursor)).value,
                data: base.add(CHANNEL_HEADER),
                capacity,
            }
        }
    }

    /// Bytes of each rank's staging area.
    pub fn staging_len(&self) -> usize {
        self.geometry.staging
    }

    /// Start of `rank`'s staging area (`staging_len()` bytes, page aligned), valid while `self` lives.
    pub fn staging(&self, rank: usize) -> *mut u8 {
        assert!(rank < self.size);
        // SAFETY: the staging areas follow the channels, one stride per rank (checked rank), inside the
        // segment (`segment_len` counts them).
        unsafe {
            self.segment.base().add(staging_offset(&self.geometry) + rank * staging_stride(self.geometry.staging))
        }
    }

    /// Tell `rank` that something it may be waiting for happened (published before this call). The fence
    /// pairs with the one in [`RankSlot::sleep_unless`]: either this sees the sleeper registered, or the
    /// sleeper's last check sees what was published. With nobody asleep, nothing is written.
    pub fn ring(&self, rank: usize) {
        let slot = self.slot(rank);
        fence(Ordering::SeqCst);
        if slot.sleepers.load(Ordering::SeqCst) > 0 {
            slot.doorbell.fetch_add(1, Ordering::SeqCst);
            futex::wake_all(&slot.doorbell);
        }
    }
}

/// A channel whose cursors another process left inconsistent (tail past head, or more than `capacity`
/// bytes between them). The memory is shared with peers, so their cursor values are checked before any
/// byte range is derived from them.
#[derive(Debug, PartialEq, Eq)]
pub struct Corrupt {
    pub head: u64,
    pub tail: u64,
}

impl Channel<'_> {
    /// Bytes between `tail` and `head`, if the cursors are consistent.
    fn used(&self, head: u64, tail: u64) -> Result<usize, Corrupt> {
        head.checked_sub(tail).filter(|&n| n <= self.capacity as u64).map(|n| n as usize).ok_or(Corrupt { head, tail })
    }

    /// Unread bytes (receiver's view). Inconsistent cursors count as readable, so that the caller goes on
    /// to `read`, which reports them.
    pub fn readable(&self) -> usize {
        self.used(self.head.load(Ordering::Acquire), self.tail.load(Ordering::Relaxed)).unwrap_or(1)
    }

    /// Free bytes (sender's view); inconsistent cursors count as writable, for `write` to report.
    pub fn writable(&self) -> usize {
        self.used(self.head.load(Ordering::Relaxed), self.tail.load(Ordering::Acquire))
            .map_or(1, |used| self.capacity - used)
    }

    /// Sender: copy as much of `data` as fits (at most `limit` bytes) and publish it. Returns the count.
    /// `tail_seen` is the receiver's cursor as this sender last read it: room is judged by it first, and the
    /// cursor (a line the receiver writes) is read again only when that leaves too little, so a small message
    /// into a ring with room costs no read of the receiver's line.
    pub fn write(&self, data: &[u8], limit: usize, tail_seen: &mut u64) -> Result<usize, Corrupt> {
        let head = self.head.load(Ordering::Relaxed);
        let wanted = data.len().min(limit);
        let mut free = self.capacity - self.used(head, *tail_seen)?;
        if free < wanted {
            *tail_seen = self.tail.load(Ordering::Acquire);
            free = self.capacity - self.used(head, *tail_seen)?;
        }
        let n = free.min(wanted);
        if n == 0 {
            return Ok(0);
        }
        let start = (head % self.capacity as u64) as usize;
        let first = n.min(self.capacity - start);
        // SAFETY: `[head, head + n)` is free space owned by the sender (the receiver only reads below
        // `head`; `n <= free` was derived from checked cursors), and both pieces lie inside the data area
        // (`first <= capacity - start`, `n - first <= capacity`).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.data.add(start), first);
            if n > first {
                std::ptr::copy_nonoverlapping(data.as_ptr().add(first), self.data, n - first);
            }
        }
        self.head.store(head + n as u64, Ordering::Release);
        Ok(n)
    }

    /// Receiver: copy the next `buf.len()` unread bytes into `buf` without consuming them, if that many are
    /// there; false otherwise (also for inconsistent cursors, which `read` then reports).
    pub fn peek(&self, buf: &mut [u8]) -> bool {
        let tail = self.tail.load(Ordering::Relaxed);
        match self.used(self.head.load(Ordering::Acquire), tail) {
            Ok(used) if used >= buf.len() => {}
            _ => return false,
        }
        let start = (tail % self.capacity as u64) as usize;
        let first = buf.len().min(self.capacity - start);
        // SAFETY: `[tail, tail + buf.len())` was published by the sender (Acquire above, checked against the
        // cursors) and stays until this receiver advances `tail`; both pieces lie inside the data area.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(start), buf.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data, buf.as_mut_ptr().add(first), buf.len() - first);
        }
        true
    }

    /// Receiver: hand up to `limit` unread bytes to `consume` (in one or two pieces, straight out of shared
    /// memory), then release them to the sender. Returns the count.
    pub fn read(&self, limit: usize, consume: &mut dyn FnMut(&[u8])) -> Result<usize, Corrupt> {
        let tail = self.tail.load(Ordering::Relaxed);
        let n = self.used(self.head.load(Ordering::Acquire), tail)?.min(limit);
        if n == 0 {
            return Ok(0);
        }
        let start = (tail % self.capacity as u64) as usize;
        let first = n.min(self.capacity - start);
        // SAFETY: `[tail, tail + n)` was published by the sender (Acquire above; `n <= capacity` checked) and
        // is not written again until we advance `tail`; both pieces lie inside the data area.
        unsafe {
            consume(std::slice::from_raw_parts(self.data.add(start), first));
            if n > first {
                consume(std::slice::from_raw_parts(self.data, n - first));
            }
        }
        self.tail.store(tail + n as u64, Ordering::Release);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_shrinks_with_many_ranks_and_channels_do_not_overlap() {
        assert_eq!(channel_capacity(2), 1 << 20);
        assert!(channel_capacity(64) * 64 * 63 <= 256 << 20);
        assert_eq!(channel_capacity(64) % PAGE, 0);
        let n = 3;
        let cap = 8192;
        let geometry = Geometry { size: n, capacity: cap, staging: 5000 };
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(&geometry)).unwrap());
        segment.unlink();
        let layout = Layout::initialise(segment, geometry);
        let mut starts = Vec::new();
        for from in 0..n {
            for to in (0..n).filter(|&t| t != from) {
                starts.push(layout.channel(from, to).head as *const AtomicU64 as usize);
            }
        }
        starts.sort();
        starts.dedup();
        assert_eq!(starts.len(), n * (n - 1));
        assert!(starts.windows(2).all(|w| w[1] - w[0] >= CHANNEL_HEADER + cap));
        // The staging areas come after the last channel, page aligned, one per rank, inside the segment.
        let last_channel_end = starts[starts.len() - 1] + CHANNEL_HEADER + cap;
        let areas: Vec<usize> = (0..n).map(|r| layout.staging(r) as usize).collect();
        assert!(areas[0] >= last_channel_end && areas.iter().all(|a| a % PAGE == 0));
        assert!(areas.windows(2).all(|w| w[1] - w[0] >= 5000));
        assert!(areas[n - 1] + 5000 <= layout.segment().base() as usize + layout.segment().len());
    }

    #[test]
    fn staging_areas_follow_the_fusion_threshold_within_bounds() {
        const MIB: usize = 1 << 20;
        assert_eq!(staging_capacity(2, 128 * MIB), 64 * MIB);
        assert_eq!(staging_capacity(2, 8 * MIB), 8 * MIB);
        assert_eq!(staging_capacity(2, 0), 4 * MIB, "fusion off still stages single tensors");
        assert_eq!(staging_capacity(16, 128 * MIB), 32 * MIB);
        assert_eq!(staging_capacity(1000, 128 * MIB), 4 * MIB);
        assert_eq!(staging_capacity(2, 5 * MIB + 1) % PAGE, 0);
    }

    #[test]
    fn attach_rejects_another_geometry() {
        let geometry = Geometry { size: 2, capacity: PAGE, staging: PAGE };
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(&geometry)).unwrap());
        segment.unlink();
        Layout::initialise(segment.clone(), geometry);
        assert!(Layout::attach(segment.clone(), geometry).is_ok());
        // Same length, other staging size: only the header tells them apart.
        let err = Layout::attach(segment, Geometry { staging: PAGE - 64, ..geometry }).err().unwrap();
        assert!(err.contains("does not describe 2 ranks"), "{err}");
    }

    #[test]
    fn ring_wraps_around() {
        let geometry = Geometry { size: 2, capacity: PAGE, staging: 0 };
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(&geometry)).unwrap());
        segment.unlink();
        let layout = Layout::initialise(segment, geometry);
        let ch = layout.channel(0, 1);
        let mut received = Vec::new();
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        let (mut sent, mut tail_seen) = (0, 0);
        while received.len() < data.len() {
            sent += ch.write(&data[sent..], 3000, &mut tail_seen).unwrap();
            ch.read(1700, &mut |piece| received.extend_from_slice(piece)).unwrap();
            assert!(ch.writable() + ch.readable() == PAGE);
        }
        assert_eq!(received, data);
    }

    /// A sender blocked on a full ring and a receiver waiting for bytes, each asleep on its doorbell with a
    /// timeout far longer than the test, are always rung awake: no wake-up is lost between a sleeper's last
    /// look and its sleep (see `RankSlot::sleep_unless` and `Layout::ring`).
    #[test]
    fn sleepers_on_a_full_or_empty_ring_are_always_rung_awake() {
        let geometry = Geometry { size: 2, capacity: PAGE, staging: 0 };
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(&geometry)).unwrap());
        segment.unlink();
        let layout = Layout::initialise(segment, geometry);
        let data: Vec<u8> = (0..4_000_000u32).map(|i| (i % 253) as u8).collect();
        let forever = Duration::from_secs(60);
        let start = std::time::Instant::now();
        let received = std::thread::scope(|s| {
            let sender = s.spawn(|| {
                let ch = layout.channel(0, 1);
                let (mut sent, mut tail_seen) = (0, 0);
                while sent < data.len() {
                    let n = ch.write(&data[sent..], 3000, &mut tail_seen).unwrap();
                    if n > 0 {
                        sent += n;
                        layout.ring(1);
                    } else {
                        layout.slot(0).sleep_unless(forever, || ch.writable() > 0);
                    }
                }
            });
            let ch = layout.channel(0, 1);
            let mut received = Vec::with_capacity(data.len());
            while received.len() < data.len() {
                let n = ch.read(1700, &mut |piece| received.extend_from_slice(piece)).unwrap();
                if n > 0 {
                    layout.ring(0);
                } else {
                    layout.slot(1).sleep_unless(forever, || ch.readable() > 0);
                }
            }
            sender.join().unwrap();
            received
        });
        assert!(received == data);
        assert!(start.elapsed() < Duration::from_secs(30), "a wake-up was lost: {:?}", start.elapsed());
    }

    /// The one interleaving that loses a wake-up, made to happen: the ringer publishes and rings right after
    /// the sleeper's last look (inside its `ready`, which has already seen nothing). The sleeper registered
    /// first, so the ring bumps the doorbell and the sleep returns at once instead of after its timeout.
    #[test]
    fn a_ring_between_the_last_look_and_the_sleep_is_not_lost() {
        let geometry = Geometry { size: 2, capacity: PAGE, staging: 0 };
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(&geometry)).unwrap());
        segment.unlink();
        let layout = Layout::initialise(segment, geometry);
        let start = std::time::Instant::now();
        layout.slot(1).sleep_unless(Duration::from_secs(10), || {
            layout.ring(1);
            false
        });
        assert!(start.elapsed() < Duration::from_secs(5), "the ring was lost: slept {:?}", start.elapsed());
        assert_eq!(layout.slot(1).sleepers.load(Ordering::SeqCst), 0, "the sleeper unregistered");
    }

    #[test]
    fn peeking_copies_what_has_arrived_and_consumes_nothing() {
        let geometry = Geometry { size: 2, capacity: PAGE, staging: 0 };
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(&geometry)).unwrap());
        segment.unlink();
        let layout = Layout::initialise(segment, geometry);
        let ch = layout.channel(1, 0);
        let mut tail_seen = 0;
        // Wrap the cursors near the end of the ring, so a peek spans the wrap.
        let filler = vec![7u8; PAGE - 3];
        ch.write(&filler, PAGE, &mut tail_seen).unwrap();
        ch.read(PAGE, &mut |_| {}).unwrap();
        ch.write(&[1, 2, 3, 4, 5, 6], 6, &mut tail_seen).unwrap();
        let mut four = [0u8; 4];
        assert!(ch.peek(&mut four));
        assert_eq!(four, [1, 2, 3, 4]);
        assert!(!ch.peek(&mut [0u8; 7]), "only 6 bytes have arrived");
        let mut all = Vec::new();
        assert_eq!(ch.read(PAGE, &mut |piece| all.extend_from_slice(piece)).unwrap(), 6);
        assert_eq!(all, [1, 2, 3, 4, 5, 6], "peeking consumed nothing");
    }

    #[test]
    fn inconsistent_cursors_are_reported_not_followed() {
        let geometry = Geometry { size: 2, capacity: PAGE, staging: 0 };
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(&geometry)).unwrap());
        segment.unlink();
        let layout = Layout::initialise(segment, geometry);
        let ch = layout.channel(0, 1);
        // A peer claiming more unread bytes than the ring holds, or a tail past the head.
        for (head, tail) in [(PAGE as u64 * 3, 0), (5, 9)] {
            ch.head.store(head, Ordering::Relaxed);
            ch.tail.store(tail, Ordering::Relaxed);
            assert!(ch.readable() > 0 && ch.writable() > 0, "a corrupt channel must wake its waiter");
            assert_eq!(ch.read(usize::MAX, &mut |_| panic!("read from a corrupt ring")), Err(Corrupt { head, tail }));
            let mut tail_seen = tail;
            assert_eq!(ch.write(&[1, 2, 3], 3, &mut tail_seen), Err(Corrupt { head, tail }));
        }
    }
}
