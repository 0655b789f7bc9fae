//! Device tensors as the engine carries them: an input on a GPU with the event that says when it is
//! ready, a result in a pooled device buffer, and the event that says when results are written.

use std::sync::{Arc, OnceLock};

use crate::gpu::cuda::CudaEvent;
use crate::gpu::device::DevicePtr;
use crate::gpu::runtime::{DeviceContext, PooledBuffer};
use crate::types::DataType;

/// A tensor in device memory, submitted: `len` bytes at `ptr` on GPU `ordinal`, which the framework keeps
/// alive until the op's handle completes (as for host tensors). `ready` completes once the work that
/// produces it (on the framework's stream, or on rvod's after DLPack's stream handshake) has run.
pub struct DeviceInput {
    pub context: Arc<DeviceContext>,
    pub ptr: DevicePtr,
    pub len: usize,
    pub ready: CudaEvent,
}

impl DeviceInput {
    pub fn ordinal(&self) -> i32 {
        self.context.ordinal()
    }
}

impl std::fmt::Debug for DeviceInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceInput({} bytes at {:#x} on GPU {})", self.len, self.ptr.0, self.ordinal())
    }
}

/// A result the engine made on a GPU.
#[derive(Debug)]
pub struct DeviceOutput {
    pub buffer: PooledBuffer,
    pub shape: Vec<i64>,
    pub dtype: DataType,
}

/// The event after which an op's device results are written, on GPU `context`'s stream: a consumer's
/// stream waits for it, or the host synchronizes on it.
#[derive(Clone)]
pub struct DeviceDone {
    pub context: Arc<DeviceContext>,
    pub event: Arc<CudaEvent>,
    /// Set where the engine handed the op back with its work still queued (the NCCL route).
    pub queued: Option<Queued>,
}

/// What a waiter of an op handed back with its GPU work still queued needs (see `engine::execute_nccl`).
#[derive(Clone)]
pub struct Queued {
    /// Set, with why, when the process set's NCCL work failed (the event then completes once the
    /// communicator is aborted, over results that are not the collective's); read after the event.
    pub failure: Arc<OnceLock<String>>,
    /// Whether the op completes for its caller only once its work has run (the default; Horovod's): `wait`
    /// and `poll` then look at the event on the host. `false` with `RVOD_ENABLE_ASYNC_COMPLETION`.
    pub complete_on_host: bool,
}

impl DeviceDone {
    /// Whether the op's caller must still see the event complete before the op counts as done.
    pub fn host_waits(&self) -> bool {
        self.queued.as_ref().is_some_and(|q| q.complete_on_host)
    }

    /// Why the process set's NCCL work failed after this op was handed back, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.queued.as_ref().and_then(|q| q.failure.get()).map(String::as_str)
    }
}

impl std::fmt::Debug for DeviceDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceDone(GPU {})", self.context.ordinal())
    }
}
