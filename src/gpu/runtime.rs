//! The CUDA state rvod keeps per GPU of this process: rvod's own stream, the pinned buffer host staging
//! copies through, and the pool of device buffers results (and the NCCL route's fusion buffers) are made in.
//! A process set's NCCL work runs on a stream of its own (`engine::gpu_route`), which takes pooled buffers
//! through [`DeviceContext::buffer_for`].
//!
//! One [`DeviceContext`] per device ordinal, made on first use (after the libraries were loaded by the
//! Python side, see [`crate::gpu::library::loaded`]) and kept for the rest of the process: streams and
//! buffers are not worth freeing (cudaFree synchronizes the device). Device buffers go back to the pool
//! when their last user drops them ([`PooledBuffer`]); a buffer is reused only for a request of its size
//! class (the next power of two).
//!
//! A result buffer is read by the framework on its own stream (the consumer stream `wait` was given, or the
//! legacy default stream where the host waited), and the framework frees it as soon as its host code lets go,
//! while kernels queued on that stream may still read it. So the drop records an event on the consumer
//! stream, and the buffer's next user, rvod's stream, waits for that event before it writes. Where the event
//! cannot be recorded, the memory is freed instead (cudaFree waits for the work that uses it).
//!
//! The events recorded here (a tensor's ready event, a buffer's readers' end) come from the device's pool of
//! events ([`crate::gpu::cuda::CudaEvent`]) and go back to it when dropped; each op on a context costs no
//! `cudaEventCreate`, and no `cudaSetDevice` where the calling thread is on its GPU already.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::gpu::cuda::{CudaDevice, CudaEvent, CudaPinned, CudaStream, DeviceMemory};
use crate::gpu::device::{Device, DevicePtr, PinnedBuffer};
use crate::gpu::library::loaded;
use crate::gpu::GpuError;

/// One GPU as rvod uses it.
pub struct DeviceContext {
    device: CudaDevice,
    stream: CudaStream,
    /// Host staging's buffer: reused, grows; locked for a whole staged op.
    pinned: Mutex<Option<CudaPinned>>,
    /// Free device buffers by size class, each with the event after which its last reader is done.
    free: Mutex<HashMap<usize, Vec<(DeviceMemory, CudaEvent)>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

static CONTEXTS: OnceLock<Mutex<HashMap<i32, Arc<DeviceContext>>>> = OnceLock::new();

/// The GPU of the latest [`context`] asked for (a tensor submitted on it, or its stream asked for); -1: none.
static LAST_USED: AtomicI32 = AtomicI32::new(-1);

/// The GPU this process last submitted a tensor on (or asked rvod's stream of): the GPU a rank that has
/// no tensor in a GPU collective (it joined) takes part with.
pub fn last_used() -> Option<i32> {
    Some(LAST_USED.load(Ordering::Relaxed)).filter(|&ordinal| ordinal >= 0)
}

/// The context of GPU `ordinal`, made on first use; an error when the CUDA runtime was not loaded or the
/// device cannot be used.
pub fn context(ordinal: i32) -> Result<Arc<DeviceContext>, GpuError> {
    let mut contexts = lock(CONTEXTS.get_or_init(Default::default));
    if let Some(found) = contexts.get(&ordinal) {
        LAST_USED.store(ordinal, Ordering::Relaxed);
        return Ok(found.clone());
    }
    let unloaded =
        |message: String| GpuError { call: "loading libcudart".into(), device: format!("GPU {ordinal}"), message };
    let libraries = loaded().ok_or_else(|| unloaded("the GPU libraries were not loaded".into()))?;
    let runtime = libraries.cuda.as_ref().map_err(|why| unloaded(why.clone()))?;
    // Called on a framework's thread: its current device stays what it was.
    let (device, stream) = runtime.keeping_current_device(|| {
        let device = CudaDevice::new(runtime, ordinal)?;
        let stream = device.new_stream()?;
        Ok((device, stream))
    })?;
    let made = Arc::new(DeviceContext { device, stream, pinned: Mutex::new(None), free: Mutex::new(HashMap::new()) });
    contexts.insert(ordinal, made.clone());
    LAST_USED.store(ordinal, Ordering::Relaxed);
    Ok(made)
}

/// Device memory from a context's pool, returned to it when dropped.
pub struct PooledBuffer {
    memory: Option<DeviceMemory>,
    /// The bytes asked for (the allocation may be larger).
    len: usize,
    context: Arc<DeviceContext>,
    /// The stream its user reads it on (a `cudaStream_t` as a number; 0, the legacy default stream, where
    /// unknown). It must outlive the buffer, as a stream given to torch's `record_stream` must.
    consumer: usize,
}

impl PooledBuffer {
    pub fn ptr(&self) -> DevicePtr {
        self.memory.as_ref().map_or(DevicePtr(0), |m| m.ptr)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn ordinal(&self) -> i32 {
        self.context.ordinal()
    }

    /// The stream the buffer's user reads it on (see the module doc); None: unknown (the legacy default
    /// stream, which follows the work of every blocking stream).
    pub fn set_consumer(&mut self, stream: Option<usize>) {
        self.consumer = stream.unwrap_or(LEGACY_DEFAULT_STREAM);
    }
}

/// The legacy default stream's handle.
const LEGACY_DEFAULT_STREAM: usize = 0;

impl std::fmt::Debug for PooledBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PooledBuffer({} bytes on GPU {})", self.len, self.context.ordinal())
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        let Some(memory) = self.memory.take() else { return };
        // SAFETY: the consumer stream outlives the buffer (see `consumer`); 0 is always a stream.
        match unsafe { self.context.record_on(self.consumer) } {
            Ok(read) => lock(&self.context.free).entry(memory.len).or_default().push((memory, read)),
            Err(e) => {
                tracing::debug!("{self:?}: freed, not pooled: its readers' end could not be marked: {e}");
                drop(memory);
            }
        }
    }
}

impl DeviceContext {
    pub fn ordinal(&self) -> i32 {
        self.device.ordinal()
    }

    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// rvod's stream on this GPU.
    pub fn stream(&self) -> &CudaStream {
        &self.stream
    }

    /// The stream's handle as a number (what `__dlpack__(stream=...)` takes).
    pub fn stream_handle(&self) -> usize {
        self.stream.raw() as usize
    }

    /// The pinned staging buffer, for one staged op at a time.
    pub fn pinned(&self) -> MutexGuard<'_, Option<CudaPinned>> {
        lock(&self.pinned)
    }

    /// Make `slot` (the pinned buffer) at least `len` bytes long; contents are not kept when it grows.
    pub fn grow_pinned<'a>(
        &self,
        slot: &'a mut Option<CudaPinned>,
        len: usize,
    ) -> Result<&'a mut CudaPinned, GpuError> {
        if !slot.as_ref().is_some_and(|p| p.as_slice().len() >= len) {
            *slot = None; // free the old one first: pinned memory is scarce
            *slot = Some(self.device.alloc_pinned(len.max(1).next_power_of_two())?);
        }
        slot.as_mut().ok_or_else(|| GpuError {
            call: "cudaMallocHost".into(),
            device: self.device.name(),
            message: "no pinned buffer".into(),
        })
    }

    /// `len` bytes of device memory from the pool (a new allocation when none of its class is free), for
    /// rvod's stream to write: a reused buffer is written only after its last reader's work (the stream
    /// waits for it).
    pub fn buffer(self: &Arc<Self>, len: usize) -> Result<PooledBuffer, GpuError> {
        self.buffer_for(len, &self.stream)
    }

    /// [`DeviceContext::buffer`] for `writer`, a stream of this GPU other than rvod's (a process set's NCCL
    /// stream): a reused buffer is written only after its last reader's work (`writer` waits for it).
    pub fn buffer_for(self: &Arc<Self>, len: usize, writer: &CudaStream) -> Result<PooledBuffer, GpuError> {
        let class = len.max(1).next_power_of_two();
        let reused = lock(&self.free).get_mut(&class).and_then(Vec::pop);
        let memory = match reused {
            Some((memory, read)) => {
                let waited = self.device.runtime().keeping_current_device(|| self.device.wait_event(writer, &read));
                if let Err(e) = waited {
                    lock(&self.free).entry(class).or_default().push((memory, read));
                    return Err(e);
                }
                memory
            }
            None => self.device.alloc(class)?,
        };
        Ok(PooledBuffer { memory: Some(memory), len, context: self.clone(), consumer: LEGACY_DEFAULT_STREAM })
    }

    /// An event marking the current end of rvod's stream (from any thread: its current device is kept).
    pub fn record(&self) -> Result<CudaEvent, GpuError> {
        self.device.runtime().keeping_current_device(|| self.device.record(&self.stream))
    }

    /// An event marking the current end of a stream the framework owns (its handle as a number).
    ///
    /// # Safety
    /// `stream` must be a live stream of this device (or 0/1/2: the legacy and per-thread default streams).
    pub unsafe fn record_on(&self, stream: usize) -> Result<CudaEvent, GpuError> {
        // SAFETY: the caller guarantees the stream.
        let borrowed = unsafe { self.device.borrowed_stream(stream) };
        self.device.runtime().keeping_current_device(|| self.device.record(&borrowed))
    }
}
