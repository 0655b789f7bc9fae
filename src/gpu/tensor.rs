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
    /// For an op handed back before its work ran (asynchronous completion through NCCL): set, with why,
    /// when that work failed (the event then completes once the communicator is aborted, over results that
    /// are not the collective's); a host that waited on the event reads it after.
    pub failure: Option<Arc<OnceLock<String>>>,
}

impl std::fmt::Debug for DeviceDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceDone(GPU {})", self.context.ordinal())
    }
}
