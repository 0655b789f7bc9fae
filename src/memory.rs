//! Where the memory of large engine-owned buffers comes from (results handed to the frameworks by
//! out-of-place allreduce, allgather, alltoall, reducescatter and broadcast, and their scratch).
//!
//! Fresh memory costs a page fault per 4 KiB page the first time it is written: a 64 MiB result takes
//! 16,384 faults, 10-34 ms on the development machine, several times the collective itself. Two remedies:
//!
//! - Blocks of [`LARGE`] bytes or more are mapped directly, aligned to 2 MiB and sized in whole 2 MiB
//!   steps, and advised as transparent huge pages (`MADV_HUGEPAGE`; kernels in `madvise` mode then
//!   fault them in 2 MiB at a time, 512x fewer faults).
//! - A freed block goes back to a bounded pool (`RVOD_BUFFER_POOL_MB`, default 256; 0 turns pooling off;
//!   the blocks freed longest ago make room for it) and the next request of the same size reuses it,
//!   already faulted in. The contents of a reused block
//!   are stale, which is why only buffers the engine overwrites whole ask for one
//!   ([`crate::tensor::AlignedBuffer::for_overwrite`]); zeroed buffers are always fresh mappings. Blocks
//!   not reused for [`IDLE`] are unmapped by [`trim_idle`], which the engine's loop calls as it runs, so a
//!   job that stops communicating gives the memory back.
//!
//! A framework frees a result through its DLPack deleter, which drops the buffer and so returns it here.

use std::ptr::NonNull;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Buffers of at least this many bytes are mapped here; smaller ones come from the global allocator.
pub const LARGE: usize = 1 << 20;
/// The huge-page size the mappings are aligned to and sized in.
const HUGE_PAGE: usize = 2 << 20;
/// A pooled block not reused for this long is unmapped.
pub const IDLE: Duration = Duration::from_secs(3);
/// `RVOD_BUFFER_POOL_MB`'s default.
pub const DEFAULT_POOL_BYTES: usize = 256 << 20;

/// A mapped block: `capacity` bytes at `ptr`, a multiple of [`HUGE_PAGE`].
#[derive(Debug)]
pub struct Block {
    pub ptr: NonNull<u8>,
    pub capacity: usize,
}

// SAFETY: a Block uniquely owns its mapping.
unsafe impl Send for Block {}

struct Pooled {
    block: Block,
    freed: Instant,
}

/// Freed blocks kept for reuse, at most `limit` bytes of them. Its methods hand back what must be
/// unmapped, so no mapping call runs under the lock.
pub struct Pool {
    free: Vec<Pooled>,
    bytes: usize,
    limit: usize,
}

impl Pool {
    pub const fn new(limit: usize) -> Pool {
        Pool { free: Vec::new(), bytes: 0, limit }
    }

    /// A pooled block of exactly `capacity` bytes, the most recently freed one.
    fn take(&mut self, capacity: usize) -> Option<Block> {
        let found = self.free.iter().rposition(|p| p.block.capacity == capacity)?;
        self.bytes -= capacity;
        Some(self.free.swap_remove(found).block)
    }

    /// Keep `block`, making room by giving up the blocks freed longest ago (the newest is the likeliest to
    /// be asked for next: the same op again); what is given up, or `block` itself when it is larger than the
    /// limit, comes back to be unmapped.
    fn put(&mut self, block: Block, now: Instant) -> Vec<Block> {
        if block.capacity > self.limit {
            return vec![block];
        }
        let (capacity, limit) = (block.capacity, self.limit);
        let evicted = self.evict_oldest_until(|bytes| bytes + capacity <= limit);
        self.bytes += block.capacity;
        self.free.push(Pooled { block, freed: now });
        evicted
    }

    /// The blocks freed at least `age` before `now`, removed from the pool.
    fn older_than(&mut self, age: Duration, now: Instant) -> Vec<Block> {
        if !self.free.iter().any(|p| now.saturating_duration_since(p.freed) >= age) {
            return Vec::new();
        }
        let (stale, kept): (Vec<Pooled>, Vec<Pooled>) =
            self.free.drain(..).partition(|p| now.saturating_duration_since(p.freed) >= age);
        self.free = kept;
        self.bytes -= stale.iter().map(|p| p.block.capacity).sum::<usize>();
        stale.into_iter().map(|p| p.block).collect()
    }

    /// Lower or raise the bound; the oldest blocks over the new bound come back to be unmapped.
    fn set_limit(&mut self, limit: usize) -> Vec<Block> {
        self.limit = limit;
        self.evict_oldest_until(|bytes| bytes <= limit)
    }

    /// Remove the blocks freed longest ago until `fits(bytes held)`, oldest first.
    fn evict_oldest_until(&mut self, fits: impl Fn(usize) -> bool) -> Vec<Block> {
        let mut evicted = Vec::new();
        while !fits(self.bytes) && !self.free.is_empty() {
            let oldest = self.free.remove(0);
            self.bytes -= oldest.block.capacity;
            evicted.push(oldest.block);
        }
        evicted
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

static POOL: Mutex<Pool> = Mutex::new(Pool::new(DEFAULT_POOL_BYTES));

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The mapping size that serves a request of `len` bytes.
pub fn capacity_for(len: usize) -> usize {
    len.div_ceil(HUGE_PAGE).max(1) * HUGE_PAGE
}

/// Bound the pool to `bytes` (from `RVOD_BUFFER_POOL_MB`); blocks over the new bound are unmapped now.
pub fn set_pool_limit(bytes: usize) {
    let evicted = pool().set_limit(bytes);
    evicted.into_iter().for_each(unmap);
}

/// A block for `len` bytes whose contents the caller overwrites: a pooled one when there is one of the
/// right size, else a fresh mapping. `None` only when the system is out of memory.
pub fn reuse_or_map(len: usize) -> Option<Block> {
    let capacity = capacity_for(len);
    let reused = pool().take(capacity);
    reused.or_else(|| map(capacity))
}

/// A fresh, zero-filled mapping for `len` bytes (the kernel zeroes pages as they are first touched).
pub fn map_zeroed(len: usize) -> Option<Block> {
    map(capacity_for(len))
}

/// Return a block: kept for reuse (the blocks freed longest ago are unmapped to make room for it), or
/// unmapped when it is larger than the pool's bound.
pub fn give_back(block: Block) {
    let unneeded = pool().put(block, Instant::now());
    unneeded.into_iter().for_each(unmap);
}

/// Unmap pooled blocks that have not been reused for [`IDLE`]. Cheap when there are none.
pub fn trim_idle() {
    let stale = {
        let mut pool = pool();
        if pool.free.is_empty() {
            return;
        }
        let now = Instant::now();
        pool.older_than(IDLE, now)
    };
    stale.into_iter().for_each(unmap);
}

/// Bytes held by the pool now (for the debug log).
pub fn pooled_bytes() -> usize {
    pool().bytes()
}

fn map(capacity: usize) -> Option<Block> {
    // Over-map by one huge page so an aligned start exists, then unmap the ends.
    let span = capacity + HUGE_PAGE;
    // SAFETY: an anonymous private mapping; no memory of ours is touched.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE);
    let (head, tail) = (aligned - start, start + span - (aligned + capacity));
    // SAFETY: both ranges lie inside the mapping just made and outside the part that is kept.
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((aligned + capacity) as *mut libc::c_void, tail);
        }
        // Advice only: a kernel without transparent huge pages refuses it and small pages are used.
        libc::madvise(aligned as *mut libc::c_void, capacity, libc::MADV_HUGEPAGE);
    }
    NonNull::new(aligned as *mut u8).map(|ptr| Block { ptr, capacity })
}

fn unmap(block: Block) {
    // SAFETY: the block is a mapping made by `map` with this capacity, owned by us and no longer used.
    unsafe { libc::munmap(block.ptr.as_ptr().cast(), block.capacity) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_are_whole_huge_pages() {
        assert_eq!(capacity_for(1), HUGE_PAGE);
        assert_eq!(capacity_for(HUGE_PAGE), HUGE_PAGE);
        assert_eq!(capacity_for(HUGE_PAGE + 1), 2 * HUGE_PAGE);
        assert_eq!(capacity_for(64 << 20), 64 << 20);
    }

    #[test]
    fn mappings_are_aligned_zeroed_and_writable() {
        let block = map_zeroed(3 << 20).unwrap();
        assert_eq!(block.ptr.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(block.capacity, 4 << 20);
        // SAFETY: the block is ours, mapped readable and writable for its capacity.
        let bytes = unsafe { std::slice::from_raw_parts_mut(block.ptr.as_ptr(), block.capacity) };
        assert!(bytes.iter().all(|&b| b == 0));
        bytes[block.capacity - 1] = 7;
        unmap(block);
    }

    #[test]
    fn a_freed_block_is_reused_for_its_size_only_and_dropped_when_idle() {
        let mut pool = Pool::new(64 << 20);
        let t0 = Instant::now();
        let block = map(4 << 20).unwrap();
        let address = block.ptr;
        assert!(pool.put(block, t0).is_empty());
        assert!(pool.put(map(8 << 20).unwrap(), t0 + Duration::from_secs(5)).is_empty());
        assert_eq!(pool.bytes(), 12 << 20);
        assert!(pool.take(2 << 20).is_none(), "no block of another size is handed out");
        let again = pool.take(4 << 20).unwrap();
        assert_eq!(again.ptr, address, "the same size reuses the freed block");
        assert_eq!(pool.bytes(), 8 << 20);
        assert!(pool.put(again, t0 + Duration::from_secs(6)).is_empty());
        let stale = pool.older_than(Duration::from_secs(3), t0 + Duration::from_secs(8));
        assert_eq!(stale.iter().map(|b| b.capacity).collect::<Vec<_>>(), vec![8 << 20]);
        assert_eq!(pool.bytes(), 4 << 20);
        stale.into_iter().for_each(unmap);
        pool.older_than(Duration::ZERO, t0 + Duration::from_secs(9)).into_iter().for_each(unmap);
        assert_eq!(pool.bytes(), 0);
    }

    #[test]
    fn the_pool_never_holds_more_than_its_limit_and_keeps_the_newest() {
        let mut pool = Pool::new(6 << 20);
        let now = Instant::now();
        let blocks: Vec<Block> = (0..4).map(|_| map(2 << 20).unwrap()).collect();
        let (first, last) = (blocks[0].ptr, blocks[3].ptr);
        let evicted: Vec<Block> = blocks.into_iter().flat_map(|b| pool.put(b, now)).collect();
        assert_eq!((evicted.len(), pool.bytes()), (1, 6 << 20));
        assert_eq!(evicted[0].ptr, first, "the block freed longest ago makes room");
        evicted.into_iter().for_each(unmap);
        // A block as large as the whole bound replaces everything pooled (a 256 MiB result under the default
        // 256 MiB bound used to be refused, and so faulted in afresh, whenever anything else was pooled).
        let evicted = pool.put(map(6 << 20).unwrap(), now);
        assert_eq!((evicted.len(), pool.bytes()), (3, 6 << 20));
        assert!(evicted.iter().any(|b| b.ptr == last));
        evicted.into_iter().for_each(unmap);
        let too_large = pool.put(map(8 << 20).unwrap(), now);
        assert_eq!((too_large.len(), pool.bytes()), (1, 6 << 20), "a block over the bound is not pooled");
        too_large.into_iter().for_each(unmap);
        let evicted = pool.set_limit(2 << 20);
        assert_eq!((evicted.len(), pool.bytes()), (1, 0));
        evicted.into_iter().for_each(unmap);
        pool.put(map(2 << 20).unwrap(), now).into_iter().for_each(unmap);
        assert_eq!(pool.bytes(), 2 << 20);
        pool.set_limit(0).into_iter().for_each(unmap);
        assert_eq!(pool.bytes(), 0);
        let refused = pool.put(map(2 << 20).unwrap(), now);
        assert_eq!(refused.len(), 1, "a zero limit turns pooling off");
        refused.into_iter().for_each(unmap);
    }
}
