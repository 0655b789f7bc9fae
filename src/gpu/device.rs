//! The device interface the GPU paths are written against.
//!
//! It is the CUDA runtime's model, reduced to what host staging needs: memory on the device (addressed by
//! [`DevicePtr`], owned by the framework or by rvod), pinned host memory, streams that run work in order,
//! and events that mark a point in a stream. [`crate::gpu::cuda::CudaDevice`] implements it over libcudart;
//! the tests implement it with host memory and queues that run only when synchronized, so a missing wait
//! shows up as a wrong value.

use crate::gpu::GpuError;

/// An address in device memory (a CUDA device pointer). Plain data: who owns the memory is the caller's
/// business, as with DLPack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `bytes` further on.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0.wrapping_add(bytes as u64))
    }
}

/// Host memory the device can copy to and from asynchronously (page-locked).
pub trait PinnedBuffer: Send {
    fn as_slice(&self) -> &[u8];
    fn as_mut_slice(&mut self) -> &mut [u8];
}

/// One GPU, as host staging uses it.
///
/// Copies are enqueued on a stream and complete later; the caller keeps the host memory alive and
/// untouched until an event recorded after the copy has completed (see [`Device::synchronize`]).
pub trait Device {
    type Stream;
    type Event;
    type Pinned: PinnedBuffer;

    /// How messages name this device, e.g. `GPU 0`.
    fn name(&self) -> String;

    /// `len` bytes of pinned host memory.
    fn alloc_pinned(&self, len: usize) -> Result<Self::Pinned, GpuError>;

    /// Enqueue a copy of `dst.len()` bytes from device memory at `src` into `dst`.
    ///
    /// # Safety
    /// `src` must be valid device memory for `dst.len()` bytes, and `dst` must stay alive and unread until
    /// an event recorded on `stream` after this call has completed.
    unsafe fn copy_to_host(&self, stream: &Self::Stream, src: DevicePtr, dst: &mut [u8]) -> Result<(), GpuError>;

    /// Enqueue a copy of `src` into device memory at `dst`.
    ///
    /// # Safety
    /// `dst` must be valid device memory for `src.len()` bytes, and `src` must stay alive and unchanged
    /// until an event recorded on `stream` after this call has completed.
    unsafe fn copy_to_device(&self, stream: &Self::Stream, src: &[u8], dst: DevicePtr) -> Result<(), GpuError>;

    /// Mark the current end of `stream`.
    fn record(&self, stream: &Self::Stream) -> Result<Self::Event, GpuError>;

    /// Make `stream` wait (on the device, without blocking the host) until `event` has completed.
    fn wait_event(&self, stream: &Self::Stream, event: &Self::Event) -> Result<(), GpuError>;

    /// Block the host until `event` has completed: the work before it in its stream only.
    fn synchronize(&self, event: &Self::Event) -> Result<(), GpuError>;
}
