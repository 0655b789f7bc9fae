//! Tensor memory: views of caller-owned buffers, engine-owned aligned buffers, and result tensors made of them.
//!
//! This is the one place (besides DLPack parsing in `py/dlpack.rs`) that holds raw pointers. A
//! [`RawTensor`] points at memory owned by a framework tensor; the Python side keeps that tensor alive
//! until the handle that uses it completes, and the engine touches it only from its background thread
//! while the op is in flight.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use crate::memory;
use crate::types::DataType;

/// Alignment of engine-allocated buffers (enough for every dtype and for SIMD loads).
const BUFFER_ALIGN: usize = 64;

/// A view of `len` bytes of caller-owned memory.
#[derive(Debug)]
pub struct RawTensor {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is owned by an object the submitting thread keeps alive until the op completes, and
// only the engine thread accesses it while the op is in flight (the caller must not touch it meanwhile,
// which is Horovod's contract too).
unsafe impl Send for RawTensor {}

impl RawTensor {
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until this view is dropped, and nothing else
    /// may write to that memory meanwhile. A null `ptr` is allowed only with `len == 0`.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawTensor {
        RawTensor { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the two views share a byte of memory.
    pub fn overlaps(&self, other: &RawTensor) -> bool {
        let (a, b) = (self.ptr as usize, other.ptr as usize);
        self.len > 0 && other.len > 0 && a < b.saturating_add(other.len) && b < a.saturating_add(self.len)
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: guaranteed by the contract of `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: guaranteed by the contract of `new`; `&mut self` prevents aliasing through this view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Results at least this large are written with [`copy_streaming`]: larger than a core's L2, they go out to
/// memory before anyone reads them anyway. Smaller ones stay in cache for their reader.
pub const STREAMING_MIN_BYTES: usize = 4 << 20;

/// Copy `src` into `dst` (of the same length) with stores that go around the caches where the CPU has
/// them (x86-64's non-temporal stores): for results written whole and not read again soon, such as a
/// large out-of-place result, which then costs no read of the destination's old contents first. Short
/// copies and the unaligned ends are ordinary copies.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming needs equal lengths");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        const LANE: usize = 16;
        if dst.len() >= 4 * LANE {
            let head = dst.as_ptr().align_offset(LANE).min(dst.len());
            let body = (dst.len() - head) / LANE * LANE;
            dst[..head].copy_from_slice(&src[..head]);
            // SAFETY: `dst[head..head + body]` is 16-byte aligned and `body` a multiple of 16, inside `dst`;
            // every load reads 16 bytes inside `src` (unaligned loads allowed); SSE2 is part of x86-64. The
            // fence orders the streaming stores before anything this thread does next (publishing the result).
            unsafe {
                let d = dst.as_mut_ptr().add(head) as *mut __m128i;
                let s = src.as_ptr().add(head) as *const __m128i;
                for i in 0..body / LANE {
                    _mm_stream_si128(d.add(i), _mm_loadu_si128(s.add(i)));
                }
                _mm_sfence();
            }
            dst[head + body..].copy_from_slice(&src[head + body..]);
            return;
        }
    }
    dst.copy_from_slice(src);
}

/// A 64-byte aligned buffer owned by the engine (outputs, fusion buffers, scratch). Large ones are mappings
/// from [`crate::memory`] (huge-page advised, recycled through its pool); small ones come from the global
/// allocator.
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// The size of the mapping behind a large buffer; 0 for one from the global allocator.
    mapped: usize,
}

// SAFETY: AlignedBuffer uniquely owns its allocation.
unsafe impl Send for AlignedBuffer {}
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> AlignedBuffer {
        if len >= memory::LARGE {
            return Self::mapped(memory::map_zeroed(len), len);
        }
        Self::allocated(len)
    }

    /// `len` bytes of unspecified (initialised) contents, for a result the caller overwrites whole: a
    /// recycled mapping when one of the right size is free, so writing it faults in no new pages.
    pub fn for_overwrite(len: usize) -> AlignedBuffer {
        if len >= memory::LARGE {
            return Self::mapped(memory::reuse_or_map(len), len);
        }
        Self::allocated(len)
    }

    /// A buffer holding a copy of `bytes` (a small one is not zeroed first: the copy fills it whole).
    pub fn from_slice(bytes: &[u8]) -> AlignedBuffer {
        let len = bytes.len();
        if len >= memory::LARGE || len == 0 {
            let mut buf = AlignedBuffer::for_overwrite(len);
            buf.as_mut_slice().copy_from_slice(bytes);
            return buf;
        }
        let layout = Self::layout(len);
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        // SAFETY: `ptr` is a fresh allocation of `len` bytes, disjoint from `bytes`; after the copy every byte
        // is initialised, before anything reads it.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr.as_ptr(), len) };
        AlignedBuffer { ptr, len, mapped: 0 }
    }

    fn allocated(len: usize) -> AlignedBuffer {
        if len == 0 {
            return AlignedBuffer { ptr: NonNull::dangling(), len: 0, mapped: 0 };
        }
        let layout = Self::layout(len);
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        match NonNull::new(raw) {
            Some(ptr) => AlignedBuffer { ptr, len, mapped: 0 },
            None => alloc::handle_alloc_error(layout),
        }
    }

    fn mapped(block: Option<memory::Block>, len: usize) -> AlignedBuffer {
        match block {
            Some(block) => AlignedBuffer { ptr: block.ptr, len, mapped: block.capacity },
            None => alloc::handle_alloc_error(Self::layout(len)),
        }
    }

    fn layout(len: usize) -> Layout {
        // Only fails for sizes near isize::MAX, which no allocation can satisfy anyway.
        Layout::from_size_align(len, BUFFER_ALIGN).unwrap_or_else(|_| Layout::new::<u8>())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes (or dangling with len 0); mappings are
        // zero-filled when made, so even a recycled one holds initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives unique access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Make the buffer at least `len` bytes long; contents are not preserved when it grows.
    pub fn ensure_len(&mut self, len: usize) {
        if len > self.len {
            *self = AlignedBuffer::zeroed(len.next_power_of_two());
        }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        if self.mapped > 0 {
            memory::give_back(memory::Block { ptr: self.ptr, capacity: self.mapped });
        } else if self.len > 0 {
            // SAFETY: allocated in `allocated` with this exact layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
        }
    }
}

impl std::fmt::Debug for AlignedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuffer({} bytes)", self.len)
    }
}

/// A result tensor allocated by the engine: its bytes, shape and dtype.
#[derive(Debug)]
pub struct OutputTensor {
    pub buffer: AlignedBuffer,
    pub shape: Vec<i64>,
    pub dtype: DataType,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_overlap_when_they_share_a_byte() {
        let mut memory = [0u8; 16];
        let base = memory.as_mut_ptr();
        // SAFETY: views of `memory`, only compared.
        let view = |start: usize, len: usize| unsafe { RawTensor::new(base.add(start), len) };
        assert!(view(0, 8).overlaps(&view(4, 8)) && view(4, 8).overlaps(&view(0, 8)));
        assert!(view(0, 16).overlaps(&view(15, 1)), "one shared byte at the end");
        assert!(!view(0, 8).overlaps(&view(8, 8)) && !view(8, 8).overlaps(&view(0, 8)), "neighbours do not");
        assert!(!view(4, 0).overlaps(&view(0, 16)), "an empty view shares nothing");
    }

    #[test]
    fn aligned_buffer_is_aligned_and_zeroed() {
        for len in [0usize, 1, 7, 4097, memory::LARGE, 3 * memory::LARGE + 1] {
            let b = AlignedBuffer::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            if len > 0 {
                assert_eq!(b.as_ptr() as usize % BUFFER_ALIGN, 0);
            }
        }
        let b = AlignedBuffer::from_slice(&[1, 2, 3]);
        assert_eq!(b.as_slice(), &[1, 2, 3]);
        let large: Vec<u8> = (0..memory::LARGE + 5).map(|i| i as u8).collect();
        let copy = AlignedBuffer::from_slice(&large);
        assert_eq!(copy.as_slice(), &large[..]);
        assert_eq!(copy.as_ptr() as usize % BUFFER_ALIGN, 0);
        drop(copy);
        let zeros = AlignedBuffer::zeroed(memory::LARGE + 5);
        assert!(zeros.as_slice().iter().all(|&x| x == 0), "zeroed never hands out a recycled mapping");
    }

    #[test]
    fn raw_tensor_views_memory() {
        let mut v = vec![1u8, 2, 3, 4];
        // SAFETY: v outlives the view and is not otherwise touched meanwhile.
        let mut t = unsafe { RawTensor::new(v.as_mut_ptr(), v.len()) };
        t.as_mut_slice()[0] = 9;
        assert_eq!(t.as_slice(), &[9, 2, 3, 4]);
        assert_eq!(v[0], 9);
    }
}
