//! NCCL, loaded at run time: version, communicators and the collectives rvod runs through them, and the
//! words for NCCL's failures.
//!
//! **Not yet run on a GPU.** The wrappers are reviewed against nccl.h and run in CI against the GPU
//! stand-in's NCCL (`tests/gpu_standin.rs`: communicators of threads and processes, every collective and
//! type, groups, PreMulSum, duplicate GPU, injected errors, dead and aborting peers), which is not NCCL. The
//! pure parts (version text, dtype and op codes, error messages, the wait that turns a dead peer into an
//! error instead of a hang) are unit-tested.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::gpu::library::symbol;
use crate::gpu::plan::NcclOp;
use crate::types::{DataType, ReduceOp};

type NcclStatus = c_int;
type RawComm = *mut c_void;
type RawStream = *mut c_void;

const SUCCESS: NcclStatus = 0;
const IN_PROGRESS: NcclStatus = 7;

/// `ncclUniqueId`: 128 opaque bytes rank 0 makes and every rank passes to `ncclCommInitRank` (rvod sends
/// them through its authenticated rendezvous).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

struct Functions {
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclStatus,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclStatus,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclStatus,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclStatus,
    comm_abort: unsafe extern "C" fn(RawComm) -> NcclStatus,
    comm_get_async_error: unsafe extern "C" fn(RawComm, *mut NcclStatus) -> NcclStatus,
    get_error_string: unsafe extern "C" fn(NcclStatus) -> *const c_char,
    /// Since NCCL 2.13.
    get_last_error: Option<unsafe extern "C" fn(RawComm) -> *const c_char>,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclStatus,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclStatus,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> NcclStatus,
    reduce_scatter:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclStatus,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclStatus,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclStatus,
    group_start: unsafe extern "C" fn() -> NcclStatus,
    group_end: unsafe extern "C" fn() -> NcclStatus,
    /// Since NCCL 2.11: scaled sums (see `plan::NcclOp::PreMulSum`).
    red_op_create_pre_mul_sum:
        Option<unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, c_int, RawComm) -> NcclStatus>,
    red_op_destroy: Option<unsafe extern "C" fn(c_int, RawComm) -> NcclStatus>,
}

/// A loaded NCCL. Lives for the rest of the process (see `library::libraries`).
pub struct Nccl {
    pub path: PathBuf,
    /// `NCCL_VERSION_CODE` of the loaded library, e.g. 23007 for 2.30.7: what `nccl_built()` returns.
    pub version: i32,
    f: Functions,
    _lib: libloading::Library,
}

impl Nccl {
    pub fn new(lib: libloading::Library, path: PathBuf) -> Result<Nccl, String> {
        let f = Functions {
            get_version: symbol(&lib, &path, "ncclGetVersion")?,
            get_unique_id: symbol(&lib, &path, "ncclGetUniqueId")?,
            comm_init_rank: symbol(&lib, &path, "ncclCommInitRank")?,
            comm_destroy: symbol(&lib, &path, "ncclCommDestroy")?,
            comm_abort: symbol(&lib, &path, "ncclCommAbort")?,
            comm_get_async_error: symbol(&lib, &path, "ncclCommGetAsyncError")?,
            get_error_string: symbol(&lib, &path, "ncclGetErrorString")?,
            get_last_error: symbol(&lib, &path, "ncclGetLastError").ok(),
            all_reduce: symbol(&lib, &path, "ncclAllReduce")?,
            broadcast: symbol(&lib, &path, "ncclBroadcast")?,
            all_gather: symbol(&lib, &path, "ncclAllGather")?,
            reduce_scatter: symbol(&lib, &path, "ncclReduceScatter")?,
            send: symbol(&lib, &path, "ncclSend")?,
            recv: symbol(&lib, &path, "ncclRecv")?,
            group_start: symbol(&lib, &path, "ncclGroupStart")?,
            group_end: symbol(&lib, &path, "ncclGroupEnd")?,
            red_op_create_pre_mul_sum: symbol(&lib, &path, "ncclRedOpCreatePreMulSum").ok(),
            red_op_destroy: symbol(&lib, &path, "ncclRedOpDestroy").ok(),
        };
        let mut version: c_int = 0;
        // SAFETY: a valid out-pointer; needs no driver.
        let status = unsafe { (f.get_version)(&mut version) };
        if status != SUCCESS {
            return Err(format!("{}: ncclGetVersion returned {status}", path.display()));
        }
        Ok(Nccl { path, version, f, _lib: lib })
    }

    /// NCCL's own text for a status code.
    pub fn error_string(&self, status: NcclStatus) -> String {
        // SAFETY: returns a static string (or null).
        let text = unsafe { (self.f.get_error_string)(status) };
        if text.is_null() {
            return String::new();
        }
        // SAFETY: a NUL-terminated static string.
        unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
    }

    /// A fresh unique id (rank 0 of a communicator makes it).
    pub fn unique_id(&self, rank: usize, device: i32) -> Result<UniqueId, String> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: a valid out-pointer.
        let status = unsafe { (self.f.get_unique_id)(&mut id) };
        self.check(status, "ncclGetUniqueId", None, rank, device)?;
        Ok(id)
    }

    fn check(
        &self,
        status: NcclStatus,
        call: &str,
        comm: Option<RawComm>,
        rank: usize,
        device: i32,
    ) -> Result<(), String> {
        if status == SUCCESS {
            return Ok(());
        }
        // Without a communicator (ncclCommInitRank, ncclGetUniqueId) NCCL's last error is asked with a null one:
        // that is where "Duplicate GPU detected" and bootstrap failures are told.
        let last = self.f.get_last_error.and_then(|get| {
            // SAFETY: a live communicator or null, which NCCL accepts; returns a NUL-terminated string or null.
            let text = unsafe { get(comm.unwrap_or(std::ptr::null_mut())) };
            // SAFETY: non-null: a NUL-terminated string owned by NCCL.
            (!text.is_null()).then(|| unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned())
        });
        Err(error_message(call, status, &self.error_string(status), last.as_deref(), rank, device))
    }
}

/// "2.30.7" for the version code 23007 (codes before NCCL 2.9 used 1000 per major version).
pub fn version_text(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

/// NCCL's name for a status code.
fn status_name(status: NcclStatus) -> &'static str {
    match status {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "unknown NCCL status",
    }
}

/// The error a failed NCCL call becomes: the rank, the device, the call, NCCL's code and its own text,
/// its last-error detail when it has one, and what the code usually means.
pub fn error_message(
    call: &str,
    status: NcclStatus,
    nccl_text: &str,
    last_error: Option<&str>,
    rank: usize,
    device: i32,
) -> String {
    let mut message = format!("NCCL error on rank {rank} (GPU {device}) in {call}: {} ({status})", status_name(status));
    if !nccl_text.is_empty() {
        message.push_str(&format!(": {nccl_text}"));
    }
    if let Some(detail) = last_error.map(str::trim).filter(|d| !d.is_empty()) {
        message.push_str(&format!(" - {detail}"));
    }
    let hint = match status {
        1 => Some("a CUDA call inside NCCL failed; the GPU may be out of memory or in an error state"),
        2 => Some("a system call or the network failed; run with NCCL_DEBUG=WARN for NCCL's own log"),
        6 => Some("a peer failed or the connection to it broke"),
        4 | 5 => Some("this is a bug in rvod or a mismatch between ranks; please report it"),
        _ => None,
    };
    if let Some(hint) = hint {
        message.push_str(&format!(" ({hint})"));
    }
    message
}

/// NCCL's `ncclDataType_t` for an element type; `None` for those NCCL has no type for (int16, uint16).
pub fn data_type(dtype: DataType) -> Option<c_int> {
    Some(match dtype {
        DataType::Int8 => 0,
        DataType::Uint8 | DataType::Bool => 1,
        DataType::Int32 => 2,
        DataType::Int64 => 4,
        DataType::Float16 => 6,
        DataType::Float32 => 7,
        DataType::Float64 => 8,
        DataType::Bfloat16 => 9,
        DataType::Int16 | DataType::Uint16 => return None,
    })
}

/// NCCL's `ncclRedOp_t` for a reduction; Average maps to `ncclAvg` (NCCL 2.10+, `version` says); `None` for
/// Adasum (host staging runs it).
pub fn reduce_op(op: ReduceOp, version: i32) -> Option<c_int> {
    match op {
        ReduceOp::Sum => Some(0),
        ReduceOp::Product => Some(1),
        ReduceOp::Max => Some(2),
        ReduceOp::Min => Some(3),
        ReduceOp::Average if version >= 21000 => Some(4),
        ReduceOp::Average | ReduceOp::Adasum => None,
    }
}

/// One NCCL communicator: this rank's place in a process set, on one GPU.
pub struct Communicator {
    nccl: &'static Nccl,
    comm: RawComm,
    pub rank: usize,
    pub size: usize,
    pub device: i32,
    /// Set by [`Communicator::abort`], which takes `&self` so that a wait can poll the communicator and abort
    /// it (see [`wait_or_abort`]).
    aborted: AtomicBool,
}

// SAFETY: a communicator may be used from any one host thread at a time (rvod's engine thread).
unsafe impl Send for Communicator {}

impl Communicator {
    /// `ncclCommInitRank`; the caller made `device` current. Blocks until every rank has called it.
    pub fn init(
        nccl: &'static Nccl,
        id: UniqueId,
        size: usize,
        rank: usize,
        device: i32,
    ) -> Result<Communicator, String> {
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; id is passed by value as the header declares.
        let status = unsafe { (nccl.f.comm_init_rank)(&mut comm, size as c_int, id, rank as c_int) };
        nccl.check(status, "ncclCommInitRank", None, rank, device)?;
        Ok(Communicator { nccl, comm, rank, size, device, aborted: AtomicBool::new(false) })
    }

    fn check(&self, status: NcclStatus, call: &str) -> Result<(), String> {
        self.nccl.check(status, call, Some(self.comm), self.rank, self.device)
    }

    /// # Safety
    /// `send` and `recv` must be device buffers of `count` elements of `dtype` (they may be the same), valid
    /// until the work enqueued on `stream` completes.
    pub unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
        op: c_int,
        stream: RawStream,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract.
        let status = unsafe { (self.nccl.f.all_reduce)(send as _, recv as _, count, dtype, op, self.comm, stream) };
        self.check(status, "ncclAllReduce")
    }

    /// # Safety
    /// As [`Communicator::all_reduce`], with `count` elements on every rank.
    pub unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
        root: usize,
        stream: RawStream,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract.
        let status =
            unsafe { (self.nccl.f.broadcast)(send as _, recv as _, count, dtype, root as c_int, self.comm, stream) };
        self.check(status, "ncclBroadcast")
    }

    /// # Safety
    /// `send` holds `count` elements, `recv` `count * size`.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
        stream: RawStream,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract.
        let status = unsafe { (self.nccl.f.all_gather)(send as _, recv as _, count, dtype, self.comm, stream) };
        self.check(status, "ncclAllGather")
    }

    /// # Safety
    /// `send` holds `recv_count * size` elements, `recv` `recv_count`.
    pub unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        recv_count: usize,
        dtype: c_int,
        op: c_int,
        stream: RawStream,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract.
        let status =
            unsafe { (self.nccl.f.reduce_scatter)(send as _, recv as _, recv_count, dtype, op, self.comm, stream) };
        self.check(status, "ncclReduceScatter")
    }

    /// Point-to-point transfers (alltoall with splits, uneven allgather) as one NCCL group: `sends` and
    /// `recvs` are `(peer, device address, elements)`.
    ///
    /// # Safety
    /// Every address must be a device buffer of its element count, valid until the work on `stream` completes.
    pub unsafe fn exchange(
        &self,
        sends: &[(usize, u64, usize)],
        recvs: &[(usize, u64, usize)],
        dtype: c_int,
        stream: RawStream,
    ) -> Result<(), String> {
        self.group(|comm| {
            for &(peer, addr, count) in sends {
                // SAFETY: the caller's contract.
                let status = unsafe { (comm.nccl.f.send)(addr as _, count, dtype, peer as c_int, comm.comm, stream) };
                comm.check(status, "ncclSend")?;
            }
            for &(peer, addr, count) in recvs {
                // SAFETY: the caller's contract.
                let status = unsafe { (comm.nccl.f.recv)(addr as _, count, dtype, peer as c_int, comm.comm, stream) };
                comm.check(status, "ncclRecv")?;
            }
            Ok(())
        })
    }

    /// The NCCL calls `calls` makes, as one group (`ncclGroupStart` ... `ncclGroupEnd`): NCCL runs them
    /// together, e.g. the broadcasts of an allgather with uneven first dimensions. The group is closed even
    /// when a call fails (NCCL then fails the whole group).
    pub fn group(&self, calls: impl FnOnce(&Self) -> Result<(), String>) -> Result<(), String> {
        // SAFETY: plain call; every group start is matched by the group end below.
        self.check(unsafe { (self.nccl.f.group_start)() }, "ncclGroupStart")?;
        let result = calls(self);
        // SAFETY: closes the group opened above.
        let ended = self.check(unsafe { (self.nccl.f.group_end)() }, "ncclGroupEnd");
        result.and(ended)
    }

    /// The reduction `op` as an `ncclRedOp_t` for tensors of `dtype`; a pre-multiplied sum is created on
    /// this communicator and destroyed when the returned guard drops (after the call that uses it is enqueued).
    pub fn reduction(&self, op: NcclOp, dtype: DataType) -> Result<Reduction<'_>, String> {
        let factor = match op {
            NcclOp::Builtin(code) => return Ok(Reduction { comm: self, code, custom: false }),
            NcclOp::PreMulSum(factor) => factor,
        };
        let (Some(create), Some(_)) = (self.nccl.f.red_op_create_pre_mul_sum, self.nccl.f.red_op_destroy) else {
            return Err(format!("NCCL {} lacks ncclRedOpCreatePreMulSum", version_text(self.nccl.version)));
        };
        let mut scalar = scalar_bytes(factor, dtype).ok_or_else(|| format!("no {dtype} scale factor in NCCL"))?;
        let nccl_dtype = data_type(dtype).ok_or_else(|| format!("NCCL has no {dtype} type"))?;
        let mut code: c_int = 0;
        const HOST_IMMEDIATE: c_int = 1;
        // SAFETY: a valid out-pointer, and `scalar` holds one value of `dtype`, read during the call
        // (host-immediate residence).
        let status =
            unsafe { create(&mut code, scalar.as_mut_ptr() as *mut c_void, nccl_dtype, HOST_IMMEDIATE, self.comm) };
        self.check(status, "ncclRedOpCreatePreMulSum")?;
        Ok(Reduction { comm: self, code, custom: true })
    }

    /// `ncclCommGetAsyncError`: an error NCCL hit in the background (a peer died, a link broke), if any.
    pub fn async_error(&self) -> Result<(), String> {
        if self.is_aborted() {
            // Its handle is gone: NCCL freed it.
            return Err(format!("the NCCL communicator of rank {} was aborted", self.rank));
        }
        let mut status: NcclStatus = SUCCESS;
        // SAFETY: a live communicator and a valid out-pointer.
        let queried = unsafe { (self.nccl.f.comm_get_async_error)(self.comm, &mut status) };
        self.check(queried, "ncclCommGetAsyncError")?;
        if status == IN_PROGRESS {
            return Ok(());
        }
        self.check(status, "a collective (reported by ncclCommGetAsyncError)")
    }

    /// Whether [`Communicator::abort`] ran.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// `ncclCommAbort`: stop every operation of this communicator so no kernel waits forever for a dead peer.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: a live communicator, aborted once.
            unsafe { (self.nccl.f.comm_abort)(self.comm) };
        }
    }
}

/// An `ncclRedOp_t` for one call; a custom one is destroyed on drop.
pub struct Reduction<'a> {
    comm: &'a Communicator,
    pub code: c_int,
    custom: bool,
}

impl Drop for Reduction<'_> {
    fn drop(&mut self) {
        if let (true, Some(destroy)) = (self.custom, self.comm.nccl.f.red_op_destroy) {
            // SAFETY: created by ncclRedOpCreatePreMulSum on this live communicator, destroyed once.
            unsafe { destroy(self.code, self.comm.comm) };
        }
    }
}

/// `factor` as one value of `dtype` in native byte order (what ncclRedOpCreatePreMulSum reads), for the
/// floating-point types.
pub fn scalar_bytes(factor: f64, dtype: DataType) -> Option<Vec<u8>> {
    Some(match dtype {
        DataType::Float16 => half::f16::from_f64(factor).to_ne_bytes().to_vec(),
        DataType::Bfloat16 => half::bf16::from_f64(factor).to_ne_bytes().to_vec(),
        DataType::Float32 => (factor as f32).to_ne_bytes().to_vec(),
        DataType::Float64 => factor.to_ne_bytes().to_vec(),
        _ => return None,
    })
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) {
            // SAFETY: a live communicator, destroyed once.
            unsafe { (self.nccl.f.comm_destroy)(self.comm) };
        }
    }
}

/// Wait for enqueued NCCL work without hanging on a dead peer: poll `done` (e.g. `cudaEventQuery` of an
/// event after the work) and `async_error`, back to back (yielding the CPU) for the first `interval`, so a
/// short op is seen done at once, then every `interval`; on an async error or after `timeout`, call `abort`
/// with the error and return it. Horovod's behaviour with `NCCL_ASYNC_ERROR_HANDLING`, bounded by
/// RVOD_TIMEOUT.
pub fn wait_or_abort(
    mut done: impl FnMut() -> Result<bool, String>,
    mut async_error: impl FnMut() -> Result<(), String>,
    abort: impl FnOnce(&str),
    timeout: Duration,
    interval: Duration,
    what: &str,
) -> Result<(), String> {
    let started = Instant::now();
    let deadline = started + timeout;
    loop {
        let failed = match (done(), async_error()) {
            (Ok(true), _) => return Ok(()),
            (Err(e), _) | (Ok(false), Err(e)) => Some(e),
            (Ok(false), Ok(())) => None,
        };
        if let Some(error) = failed {
            abort(&error);
            return Err(error);
        }
        if Instant::now() >= deadline {
            let error = format!(
                "{what} did not complete within {:.0} s (RVOD_TIMEOUT); the NCCL communicator was aborted",
                timeout.as_secs_f64()
            );
            abort(&error);
            return Err(error);
        }
        if started.elapsed() < interval {
            std::thread::yield_now();
        } else {
            std::thread::sleep(interval);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn version_codes_read_as_nccl_writes_them() {
        assert_eq!(version_text(23007), "2.30.7");
        assert_eq!(version_text(22105), "2.21.5");
        assert_eq!(version_text(2804), "2.8.4");
    }

    #[test]
    fn errors_name_rank_device_call_and_nccls_text() {
        assert_eq!(
            error_message("ncclAllReduce", 2, "unhandled system error", Some("socket connect to 10.0.0.2 failed\n"), 3, 1),
            "NCCL error on rank 3 (GPU 1) in ncclAllReduce: ncclSystemError (2): unhandled system error - socket \
             connect to 10.0.0.2 failed (a system call or the network failed; run with NCCL_DEBUG=WARN for NCCL's own log)"
        );
        assert_eq!(
            error_message("ncclCommInitRank", 5, "invalid usage", None, 0, 0),
            "NCCL error on rank 0 (GPU 0) in ncclCommInitRank: ncclInvalidUsage (5): invalid usage (this is a bug \
             in rvod or a mismatch between ranks; please report it)"
        );
        let remote =
            error_message("a collective", 6, "remote process exited or there was a network error", Some(" "), 1, 0);
        assert!(remote.ends_with("network error (a peer failed or the connection to it broke)"), "{remote}");
        assert!(error_message("x", 42, "", None, 0, 0).contains("unknown NCCL status (42)"));
    }

    #[test]
    fn dtypes_and_ops_map_to_ncclss_codes() {
        assert_eq!(data_type(DataType::Float32), Some(7));
        assert_eq!(data_type(DataType::Bfloat16), Some(9));
        assert_eq!(data_type(DataType::Bool), Some(1));
        assert_eq!(data_type(DataType::Int16), None);
        assert_eq!(reduce_op(ReduceOp::Average, 23007), Some(4));
        assert_eq!(reduce_op(ReduceOp::Average, 2804), None, "before NCCL 2.10: Sum and a postscale");
        assert_eq!(reduce_op(ReduceOp::Min, 23007), Some(3));
        assert_eq!(reduce_op(ReduceOp::Adasum, 23007), None);
    }

    #[test]
    fn scale_factors_are_written_in_the_tensors_type() {
        assert_eq!(scalar_bytes(0.25, DataType::Float16), Some(half::f16::from_f32(0.25).to_ne_bytes().to_vec()));
        assert_eq!(scalar_bytes(0.25, DataType::Bfloat16), Some(half::bf16::from_f32(0.25).to_ne_bytes().to_vec()));
        assert_eq!(scalar_bytes(0.25, DataType::Float32), Some(0.25f32.to_ne_bytes().to_vec()));
        assert_eq!(scalar_bytes(0.25, DataType::Float64), Some(0.25f64.to_ne_bytes().to_vec()));
        assert_eq!(scalar_bytes(0.25, DataType::Int32), None);
    }

    #[test]
    fn a_dead_peer_aborts_the_communicator_instead_of_hanging() {
        let aborted = Cell::new(0);
        let ms = Duration::from_millis(1);
        let waited =
            wait_or_abort(|| Ok(false), || Ok(()), |_| aborted.set(aborted.get() + 1), 5 * ms, ms, "allreduce of 'w'");
        assert_eq!(aborted.get(), 1);
        assert_eq!(
            waited.unwrap_err(),
            "allreduce of 'w' did not complete within 0 s (RVOD_TIMEOUT); the NCCL communicator was aborted"
        );

        let polls = Cell::new(0);
        let failing = || {
            polls.set(polls.get() + 1);
            if polls.get() < 3 {
                Ok(())
            } else {
                Err("NCCL error on rank 1 (GPU 0) in a collective: ncclRemoteError (6)".to_string())
            }
        };
        let waited =
            wait_or_abort(|| Ok(false), failing, |_| aborted.set(aborted.get() + 1), Duration::from_secs(60), ms, "x");
        assert_eq!(aborted.get(), 2);
        assert!(waited.unwrap_err().contains("ncclRemoteError"));

        let finished = wait_or_abort(|| Ok(true), || Err("stale".into()), |_| aborted.set(9), ms, ms, "x");
        assert!(finished.is_ok(), "completed work wins over a later error");
        assert_eq!(aborted.get(), 2);
    }
}
