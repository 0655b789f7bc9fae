//! Where things live in a communicator's segment, and typed access to them.
//!
//! ```text
//! [header: magic, size, channel capacity]           one cache line
//! [rank slot 0] .. [rank slot n-1]                   one cache line each: doorbell, sleepers, pid, closed
//! (page aligned)
//! [channel 0->1] [channel 0->2] .. [channel n-1->n-2]   one per ordered pair of ranks
//! ```
//! A channel is a single-producer single-consumer byte ring: `head` (bytes ever written, advanced only by
//! the sender) and `tail` (bytes ever consumed, advanced only by the receiver) on separate cache lines,
//! then `capacity` bytes of data. Bytes in `[tail, head)` belong to the receiver, the rest to the sender.
//!
//! Every rank has a doorbell: a futex word bumped after anything another party may be waiting for
//! (bytes arrived, space freed, a peer closed, local work submitted). A rank about to sleep registers in
//! `sleepers`, so a ringer issues the wake-up syscall only when somebody actually sleeps.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

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
}

#[repr(C, align(64))]
pub struct RankSlot {
    pub doorbell: AtomicU32,
    pub sleepers: AtomicU32,
    pub pid: AtomicU32,
    pub closed: AtomicU32,
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

fn slots_offset() -> usize {
    LINE
}

fn channels_offset(size: usize) -> usize {
    (slots_offset() + size * LINE).next_multiple_of(PAGE)
}

fn channel_stride(capacity: usize) -> usize {
    (CHANNEL_HEADER + capacity).next_multiple_of(PAGE)
}

/// Bytes of a segment for `size` ranks with channels of `capacity` bytes.
pub fn segment_len(size: usize, capacity: usize) -> usize {
    channels_offset(size) + size * size.saturating_sub(1) * channel_stride(capacity)
}

/// One rank's typed view of a mapped segment.
#[derive(Clone)]
pub struct Layout {
    segment: Arc<Segment>,
    size: usize,
    capacity: usize,
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
    pub fn initialise(segment: Arc<Segment>, size: usize, capacity: usize) -> Layout {
        let layout = Layout { segment, size, capacity };
        let header = layout.header();
        header.size.store(size as u64, Ordering::Relaxed);
        header.capacity.store(capacity as u64, Ordering::Relaxed);
        header.magic.store(MAGIC, Ordering::Release);
        layout
    }

    /// View a segment another rank initialised; checks that it is laid out for `size` ranks.
    pub fn attach(segment: Arc<Segment>, size: usize, capacity: usize) -> Result<Layout, String> {
        if segment.len() != segment_len(size, capacity) {
            return Err(format!("segment is {} bytes, expected {}", segment.len(), segment_len(size, capacity)));
        }
        let layout = Layout { segment, size, capacity };
        let header = layout.header();
        let found = (
            header.magic.load(Ordering::Acquire),
            header.size.load(Ordering::Relaxed),
            header.capacity.load(Ordering::Relaxed),
        );
        if found != (MAGIC, size as u64, capacity as u64) {
            return Err(format!("segment header {found:x?} does not describe {size} ranks with {capacity}-byte channels"));
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
            let base = self.segment.base().add(channels_offset(self.size) + index * channel_stride(self.capacity));
            Channel {
                head: &(*(base as *const Cursor)).value,
                tail: &(*(base.add(LINE) as *const Cursor)).value,
                data: base.add(CHANNEL_HEADER),
                capacity: self.capacity,
            }
        }
    }

    /// Tell `rank` that something it may be waiting for happened.
    pub fn ring(&self, rank: usize) {
        let slot = self.slot(rank);
        slot.doorbell.fetch_add(1, Ordering::SeqCst);
        if slot.sleepers.load(Ordering::SeqCst) > 0 {
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
        head.checked_sub(tail)
            .filter(|&n| n <= self.capacity as u64)
            .map(|n| n as usize)
            .ok_or(Corrupt { head, tail })
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
    pub fn write(&self, data: &[u8], limit: usize) -> Result<usize, Corrupt> {
        let head = self.head.load(Ordering::Relaxed);
        let free = self.capacity - self.used(head, self.tail.load(Ordering::Acquire))?;
        let n = free.min(data.len()).min(limit);
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
            std::ptr::copy_nonoverlapping(data.as_ptr().add(first), self.data, n - first);
        }
        self.head.store(head + n as u64, Ordering::Release);
        Ok(n)
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
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(n, cap)).unwrap());
        segment.unlink();
        let layout = Layout::initialise(segment, n, cap);
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
    }

    #[test]
    fn ring_wraps_around() {
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(2, PAGE)).unwrap());
        segment.unlink();
        let layout = Layout::initialise(segment, 2, PAGE);
        let ch = layout.channel(0, 1);
        let mut received = Vec::new();
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        let mut sent = 0;
        while received.len() < data.len() {
            sent += ch.write(&data[sent..], 3000).unwrap();
            ch.read(1700, &mut |piece| received.extend_from_slice(piece)).unwrap();
            assert!(ch.writable() + ch.readable() == PAGE);
        }
        assert_eq!(received, data);
    }

    #[test]
    fn inconsistent_cursors_are_reported_not_followed() {
        let segment = Arc::new(Segment::create(&std::env::temp_dir(), segment_len(2, PAGE)).unwrap());
        segment.unlink();
        let layout = Layout::initialise(segment, 2, PAGE);
        let ch = layout.channel(0, 1);
        // A peer claiming more unread bytes than the ring holds, or a tail past the head.
        for (head, tail) in [(PAGE as u64 * 3, 0), (5, 9)] {
            ch.head.store(head, Ordering::Relaxed);
            ch.tail.store(tail, Ordering::Relaxed);
            assert!(ch.readable() > 0 && ch.writable() > 0, "a corrupt channel must wake its waiter");
            assert_eq!(ch.read(usize::MAX, &mut |_| panic!("read from a corrupt ring")), Err(Corrupt { head, tail }));
            assert_eq!(ch.write(&[1, 2, 3], 3), Err(Corrupt { head, tail }));
        }
    }
}
