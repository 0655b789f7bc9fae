//! GPU tensors: the CUDA runtime and NCCL, loaded at run time, and the two ways a collective on device
//! memory can travel.
//!
//! One wheel serves machines with and without CUDA: nothing here is linked against CUDA. [`library`] finds
//! and `dlopen`s libcudart and libnccl on first use (never at `import rvod`), and a machine without them, or
//! without a driver, keeps every CPU path exactly as it was. What each part is:
//!
//! - [`device`]: the [`device::Device`] trait the GPU paths are written against (device pointers, pinned
//!   host memory, streams, events), so the staging logic is tested with a CPU stand-in.
//! - [`staging`]: host staging: device -> pinned host buffer -> rvod's host collective -> device, in
//!   stream order, waiting only on events (never a device-wide synchronize); written against
//!   [`device::Device`] and unit-tested (the engine's staging, `engine::execute_device`, does the same
//!   around the CPU executor, on [`runtime`]'s state).
//! - [`runtime`]: per GPU of this process, rvod's stream, the pinned staging buffer and the pool of device
//!   buffers results are made in; [`tensor`]: device tensors as the engine carries them (an input and its
//!   ready event, a pooled result, the event after which results are written).
//! - [`choice`]: which of NCCL and host staging a process set uses, and the reason (what `--verbose` shows).
//! - [`bootstrap`]: a process set's members agree on the route over their own transport (and NCCL's unique id),
//!   and on whether each member's set-up step succeeded.
//! - [`plan`]: the NCCL calls one agreed response takes on this rank, or why it goes through host staging.
//! - `standin` (unit tests only): an in-Rust stand-in for a [`device::Device`], whose streams run only when
//!   waited for, for the staging logic's unit tests.
//! - [`cuda`], [`nccl`]: thin FFI wrappers over the loaded libraries. **Not yet run on a GPU.** They run in
//!   CI against the GPU stand-in (`tests/gpu_standin/`, a C library exporting the same CUDA runtime and NCCL
//!   symbols on host memory, loaded through `RVOD_CUDA_LIBRARY` / `RVOD_NCCL_LIBRARY` like the real ones):
//!   `tests/gpu_standin.rs` drives loading, device memory, copies, streams and events (a missing wait reads
//!   stale bytes), out-of-memory and injected errors, every NCCL collective and type on 3 ranks,
//!   send/receive groups, PreMulSum, the duplicate-GPU refusal, and a peer that aborts or dies (an error
//!   through [`nccl::wait_or_abort`], never a hang), and [`staging`] on those devices in stream order.
//!
//! Status (issue 30 item 1, in progress): the engine runs collectives on GPU tensors where the libraries, a
//! driver and a device are there (elsewhere a CUDA tensor is refused at submission with the reason: no
//! driver, no NCCL found and where it was looked for). Each process set's members agree on a route at its
//! first GPU response (`engine::gpu_route`, through [`bootstrap`] and [`choice`]): NCCL where every member
//! has a GPU of its own (`engine::execute_nccl` runs what [`plan`] plans; the rest stages), host staging where
//! ranks share one (`engine::execute_device`), as `RVOD_GPU_TRANSPORT` allows. Requests carry the device,
//! so a CPU/GPU mix is a mismatch error; responses say whether they are GPU ones, so a joined rank takes
//! part. Host staging has run on a real GPU (an H200, 1 and 2 ranks sharing it); **the NCCL route has run
//! only against the GPU stand-in** (`tests/python/test_gpu_device_path.py`).

pub mod bootstrap;
pub mod choice;
pub mod cuda;
pub mod device;
pub mod library;
pub mod nccl;
pub mod plan;
pub mod runtime;
pub mod staging;
pub mod tensor;

#[cfg(test)]
mod standin;

/// What a GPU call failed with, in words that name the call, the device and the library's own message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed on {device}: {message}")]
pub struct GpuError {
    /// The library function, e.g. `cudaMemcpyAsync`.
    pub call: String,
    /// The device, e.g. `GPU 0`.
    pub device: String,
    /// The library's own error text (with its code name where it has one).
    pub message: String,
}
