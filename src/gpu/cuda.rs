//! The CUDA runtime (libcudart), loaded at run time: the calls rvod makes, and [`CudaDevice`], the
//! [`Device`] that host staging runs on a real GPU.
//!
//! **Not yet run on a GPU.** These wrappers are compiled and reviewed against the CUDA runtime API; every
//! call here runs in CI against the GPU stand-in (`tests/gpu_standin.rs`: memory, copies, streams, events,
//! errors in CUDA's words), which follows the runtime's documented behaviour but is not a device.
//!
//! Every call returns a `cudaError_t`; a non-zero one becomes a [`GpuError`] with the call, the device and
//! CUDA's own name and text for the code.
//!
//! Per op, rvod records a few events (a tensor's ready event, an op's done event, a staged copy's); a
//! [`CudaDevice`] keeps the events no one holds any more and records the next one on one of them instead of
//! creating and destroying one each time (see [`CudaEvent`]). It also calls `cudaSetDevice` only where the
//! thread is on another device (a framework's thread mostly is on its tensors' one already).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::gpu::device::{Device, DevicePtr, PinnedBuffer};
use crate::gpu::library::symbol;
use crate::gpu::GpuError;

type CudaStatus = c_int;
type RawStream = *mut c_void;
type RawEvent = *mut c_void;

const SUCCESS: CudaStatus = 0;
const ERROR_INSUFFICIENT_DRIVER: CudaStatus = 35;
const ERROR_NO_DEVICE: CudaStatus = 100;
const MEMCPY_HOST_TO_DEVICE: c_int = 1;
const MEMCPY_DEVICE_TO_HOST: c_int = 2;
const MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
const STREAM_NON_BLOCKING: c_uint = 0x01;
const EVENT_DISABLE_TIMING: c_uint = 0x02;

/// The libcudart entry points rvod uses (signatures from cuda_runtime_api.h).
struct Functions {
    get_device_count: unsafe extern "C" fn(*mut c_int) -> CudaStatus,
    runtime_get_version: unsafe extern "C" fn(*mut c_int) -> CudaStatus,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CudaStatus,
    get_error_string: unsafe extern "C" fn(CudaStatus) -> *const c_char,
    get_error_name: unsafe extern "C" fn(CudaStatus) -> *const c_char,
    set_device: unsafe extern "C" fn(c_int) -> CudaStatus,
    get_device: unsafe extern "C" fn(*mut c_int) -> CudaStatus,
    device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CudaStatus,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> CudaStatus,
    free: unsafe extern "C" fn(*mut c_void) -> CudaStatus,
    malloc_host: unsafe extern "C" fn(*mut *mut c_void, usize) -> CudaStatus,
    free_host: unsafe extern "C" fn(*mut c_void) -> CudaStatus,
    memcpy_async: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, RawStream) -> CudaStatus,
    memset_async: unsafe extern "C" fn(*mut c_void, c_int, usize, RawStream) -> CudaStatus,
    stream_create_with_flags: unsafe extern "C" fn(*mut RawStream, c_uint) -> CudaStatus,
    stream_destroy: unsafe extern "C" fn(RawStream) -> CudaStatus,
    event_create_with_flags: unsafe extern "C" fn(*mut RawEvent, c_uint) -> CudaStatus,
    event_destroy: unsafe extern "C" fn(RawEvent) -> CudaStatus,
    event_record: unsafe extern "C" fn(RawEvent, RawStream) -> CudaStatus,
    stream_wait_event: unsafe extern "C" fn(RawStream, RawEvent, c_uint) -> CudaStatus,
    event_synchronize: unsafe extern "C" fn(RawEvent) -> CudaStatus,
    event_query: unsafe extern "C" fn(RawEvent) -> CudaStatus,
}

/// A loaded CUDA runtime. Lives for the rest of the process (see `library::libraries`).
pub struct CudaRuntime {
    pub path: PathBuf,
    /// `cudaRuntimeGetVersion`, e.g. 13020 for 13.2.
    pub runtime_version: i32,
    f: Functions,
    _lib: libloading::Library,
}

impl CudaRuntime {
    pub fn new(lib: libloading::Library, path: PathBuf) -> Result<CudaRuntime, String> {
        let f = Functions {
            get_device_count: symbol(&lib, &path, "cudaGetDeviceCount")?,
            runtime_get_version: symbol(&lib, &path, "cudaRuntimeGetVersion")?,
            driver_get_version: symbol(&lib, &path, "cudaDriverGetVersion")?,
            get_error_string: symbol(&lib, &path, "cudaGetErrorString")?,
            get_error_name: symbol(&lib, &path, "cudaGetErrorName")?,
            set_device: symbol(&lib, &path, "cudaSetDevice")?,
            get_device: symbol(&lib, &path, "cudaGetDevice")?,
            device_get_pci_bus_id: symbol(&lib, &path, "cudaDeviceGetPCIBusId")?,
            malloc: symbol(&lib, &path, "cudaMalloc")?,
            free: symbol(&lib, &path, "cudaFree")?,
            malloc_host: symbol(&lib, &path, "cudaMallocHost")?,
            free_host: symbol(&lib, &path, "cudaFreeHost")?,
            memcpy_async: symbol(&lib, &path, "cudaMemcpyAsync")?,
            memset_async: symbol(&lib, &path, "cudaMemsetAsync")?,
            stream_create_with_flags: symbol(&lib, &path, "cudaStreamCreateWithFlags")?,
            stream_destroy: symbol(&lib, &path, "cudaStreamDestroy")?,
            event_create_with_flags: symbol(&lib, &path, "cudaEventCreateWithFlags")?,
            event_destroy: symbol(&lib, &path, "cudaEventDestroy")?,
            event_record: symbol(&lib, &path, "cudaEventRecord")?,
            stream_wait_event: symbol(&lib, &path, "cudaStreamWaitEvent")?,
            event_synchronize: symbol(&lib, &path, "cudaEventSynchronize")?,
            event_query: symbol(&lib, &path, "cudaEventQuery")?,
        };
        let mut version: c_int = 0;
        // SAFETY: a valid out-pointer; answers without a driver.
        let status = unsafe { (f.runtime_get_version)(&mut version) };
        if status != SUCCESS {
            return Err(format!("{}: cudaRuntimeGetVersion returned {status}", path.display()));
        }
        Ok(CudaRuntime { path, runtime_version: version, f, _lib: lib })
    }

    /// CUDA's name and text for a status, e.g. "CUDA driver version is insufficient for CUDA runtime
    /// version (cudaErrorInsufficientDriver)".
    pub fn error_text(&self, status: c_int) -> String {
        // SAFETY: both return pointers to static strings (or null for codes they do not know).
        let (text, name) = unsafe { ((self.f.get_error_string)(status), (self.f.get_error_name)(status)) };
        let read = |p: *const c_char| {
            // SAFETY: non-null pointers from these calls are NUL-terminated static strings.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        match (read(text), read(name)) {
            (Some(text), Some(name)) => format!("{text} ({name})"),
            (Some(text), None) | (None, Some(text)) => text,
            (None, None) => format!("CUDA error {status}"),
        }
    }

    /// The driver's CUDA version (e.g. 13000), or 0 when no driver is installed.
    pub fn driver_version(&self) -> i32 {
        let mut version: c_int = 0;
        // SAFETY: a valid out-pointer.
        let status = unsafe { (self.f.driver_get_version)(&mut version) };
        if status == SUCCESS {
            version
        } else {
            0
        }
    }

    /// The number of GPUs, or why there are none to use (no driver, no device) in words.
    pub fn device_count(&self) -> Result<i32, String> {
        let mut count: c_int = 0;
        // SAFETY: a valid out-pointer.
        let status = unsafe { (self.f.get_device_count)(&mut count) };
        match status {
            SUCCESS if count > 0 => Ok(count),
            SUCCESS => Err(device_count_error(ERROR_NO_DEVICE, "no CUDA-capable device is detected")),
            _ => Err(device_count_error(status, &self.error_text(status))),
        }
    }

    /// The calling thread's current device (`cudaGetDevice`).
    pub fn current_device(&self) -> Result<i32, GpuError> {
        let mut device: c_int = 0;
        // SAFETY: a valid out-pointer.
        let status = unsafe { (self.f.get_device)(&mut device) };
        self.check(status, "cudaGetDevice", -1)?;
        Ok(device)
    }

    /// Make `device` the calling thread's current device: `cudaSetDevice`, skipped where it is current
    /// already (`cudaGetDevice` reads the thread's state; it says nothing of a device that is not current, so
    /// an unusable one still gets `cudaSetDevice`'s own error).
    pub fn set_current_device(&self, device: i32) -> Result<(), GpuError> {
        if self.current_device().ok() == Some(device) {
            return Ok(());
        }
        self.set_device(device)
    }

    /// `cudaSetDevice`, even where `device` is current already: that also makes its primary context current
    /// on the thread at once (CUDA 12), which set-up relies on (see [`CudaDevice::bind`]).
    fn set_device(&self, device: i32) -> Result<(), GpuError> {
        // SAFETY: plain call.
        self.check(unsafe { (self.f.set_device)(device) }, "cudaSetDevice", device)
    }

    /// Run `f` (which may make another device current) and make the calling thread's current device the one
    /// it was again: a framework's thread keeps its own.
    pub fn keeping_current_device<R>(&self, f: impl FnOnce() -> Result<R, GpuError>) -> Result<R, GpuError> {
        let previous = self.current_device()?;
        let result = f();
        let restored = self.set_current_device(previous);
        let value = result?;
        restored?;
        Ok(value)
    }

    fn check(&self, status: CudaStatus, call: &str, device: i32) -> Result<(), GpuError> {
        if status == SUCCESS {
            return Ok(());
        }
        Err(GpuError { call: call.into(), device: format!("GPU {device}"), message: self.error_text(status) })
    }
}

/// The words for `cudaGetDeviceCount`'s failure: what it means for the user first, then CUDA's text.
pub fn device_count_error(status: i32, text: &str) -> String {
    match status {
        ERROR_INSUFFICIENT_DRIVER => format!("no CUDA driver: {text}"),
        ERROR_NO_DEVICE => format!("no CUDA device: {text}"),
        _ => format!("cudaGetDeviceCount failed: {text}"),
    }
}

/// One GPU through the CUDA runtime. Streams and events are made on this device; the calls that create
/// them make it the calling thread's current device first. Its events are pooled (see [`CudaEvent`]).
pub struct CudaDevice {
    rt: &'static CudaRuntime,
    ordinal: i32,
    events: Arc<EventPool>,
}

pub struct CudaStream {
    rt: &'static CudaRuntime,
    raw: RawStream,
}

/// An event recorded on a stream of a [`CudaDevice`], made by [`Device::record`].
///
/// Dropped, it goes back to its device's pool, and a later record reuses it. That is safe once its last
/// holder lets go: every `cudaStreamWaitEvent` on it was enqueued by then, and CUDA resolves such a wait
/// against the record as it was at the call (a later `cudaEventRecord` of the event changes nothing for it);
/// a host wait on it (`cudaEventSynchronize`, `cudaEventQuery`) has returned. Whoever needs an event's record
/// to last keeps the event (`gpu::tensor` holds each input's ready event until its op is done, an op's done
/// event until every result's consumer waits for it).
pub struct CudaEvent {
    raw: RawEvent,
    /// Its device's pool, which takes it back.
    pool: Arc<EventPool>,
}

/// A device's events that no one holds: the next records reuse them.
struct EventPool {
    rt: &'static CudaRuntime,
    free: Mutex<Vec<FreeEvent>>,
}

/// An event in a pool (a CUDA event handle may be used from any host thread).
struct FreeEvent(RawEvent);

// SAFETY: CUDA events may be used from any host thread; a pooled one is used by no one until taken.
unsafe impl Send for FreeEvent {}

/// How many unused events a device keeps (a burst of asynchronous ops leaves as many as it had in flight);
/// more are destroyed.
const MAX_FREE_EVENTS: usize = 1024;

impl EventPool {
    fn list(&self) -> std::sync::MutexGuard<'_, Vec<FreeEvent>> {
        self.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// An unused event of this device, if one is there.
    fn take(&self) -> Option<RawEvent> {
        self.list().pop().map(|event| event.0)
    }

    /// Keep `raw` (an event of this device no one holds) for the next record, or destroy it when enough are
    /// kept.
    fn give_back(&self, raw: RawEvent) {
        let mut free = self.list();
        if free.len() < MAX_FREE_EVENTS {
            free.push(FreeEvent(raw));
            return;
        }
        drop(free);
        // SAFETY: created by cudaEventCreateWithFlags; no one holds it.
        unsafe { (self.rt.f.event_destroy)(raw) };
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        let free = self.free.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
        for event in free.drain(..) {
            // SAFETY: created by cudaEventCreateWithFlags; no one holds it.
            unsafe { (self.rt.f.event_destroy)(event.0) };
        }
    }
}

/// Page-locked host memory from `cudaMallocHost`.
pub struct CudaPinned {
    rt: &'static CudaRuntime,
    ptr: *mut u8,
    len: usize,
}

/// Device memory from `cudaMalloc` (fusion buffers).
pub struct DeviceMemory {
    rt: &'static CudaRuntime,
    pub ptr: DevicePtr,
    pub len: usize,
}

// SAFETY: CUDA streams, events and allocations may be used from any host thread.
unsafe impl Send for CudaStream {}
unsafe impl Send for CudaEvent {}
unsafe impl Send for CudaPinned {}
unsafe impl Send for DeviceMemory {}
// SAFETY: the CUDA runtime is thread-safe: stream and event handles may be used from several host threads.
unsafe impl Sync for CudaStream {}
unsafe impl Sync for CudaEvent {}

impl CudaDevice {
    /// The device `ordinal`, made the calling thread's current one (an error where it cannot be used).
    pub fn new(rt: &'static CudaRuntime, ordinal: i32) -> Result<CudaDevice, GpuError> {
        let events = Arc::new(EventPool { rt, free: Mutex::new(Vec::new()) });
        let device = CudaDevice { rt, ordinal, events };
        device.bind()?;
        Ok(device)
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    pub fn runtime(&self) -> &'static CudaRuntime {
        self.rt
    }

    /// Make this device the calling thread's current one (`cudaSetDevice` where another is current, see
    /// [`CudaRuntime::set_current_device`]).
    pub fn make_current(&self) -> Result<(), GpuError> {
        self.rt.set_current_device(self.ordinal)
    }

    /// `cudaSetDevice` for the calling thread, even where this device is current already: for set-up (the
    /// device's first use, an NCCL communicator's start), which then finds its primary context current.
    pub fn bind(&self) -> Result<(), GpuError> {
        self.rt.set_device(self.ordinal)
    }

    /// The PCI bus id (e.g. `0000:3b:00.0`) that identifies this GPU on its host, for the transport choice.
    pub fn pci_bus_id(&self) -> Result<String, GpuError> {
        let mut buffer: [c_char; 64] = [0; 64];
        // SAFETY: the buffer holds 64 bytes, as passed.
        let status = unsafe { (self.rt.f.device_get_pci_bus_id)(buffer.as_mut_ptr(), 64, self.ordinal) };
        self.rt.check(status, "cudaDeviceGetPCIBusId", self.ordinal)?;
        // SAFETY: on success the buffer holds a NUL-terminated string (it was zeroed, so it ends in NUL).
        Ok(unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// A stream that does not synchronize with the legacy default stream.
    pub fn new_stream(&self) -> Result<CudaStream, GpuError> {
        self.make_current()?;
        let mut raw: RawStream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let status = unsafe { (self.rt.f.stream_create_with_flags)(&mut raw, STREAM_NON_BLOCKING) };
        self.rt.check(status, "cudaStreamCreateWithFlags", self.ordinal)?;
        Ok(CudaStream { rt: self.rt, raw })
    }

    /// `len` bytes of device memory (an out-of-memory error names the size).
    pub fn alloc(&self, len: usize) -> Result<DeviceMemory, GpuError> {
        self.make_current()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let status = unsafe { (self.rt.f.malloc)(&mut ptr, len) };
        self.rt.check(status, &format!("cudaMalloc of {len} bytes"), self.ordinal)?;
        Ok(DeviceMemory { rt: self.rt, ptr: DevicePtr(ptr as u64), len })
    }

    /// Whether the work before `event` has completed, without blocking (`cudaEventQuery`).
    pub fn query(&self, event: &CudaEvent) -> Result<bool, GpuError> {
        const NOT_READY: CudaStatus = 600;
        // SAFETY: a live event.
        match unsafe { (self.rt.f.event_query)(event.raw) } {
            SUCCESS => Ok(true),
            NOT_READY => Ok(false),
            status => self.rt.check(status, "cudaEventQuery", self.ordinal).map(|_| false),
        }
    }

    /// Enqueue a copy of `len` bytes from device memory at `src` to device memory at `dst` on `stream` (fusion
    /// buffers of the NCCL route). Nothing is enqueued for `len == 0`.
    ///
    /// # Safety
    /// Both ranges must be valid memory of this device, not overlapping, until the work on `stream` completes.
    pub unsafe fn copy_on_device(
        &self,
        stream: &CudaStream,
        src: DevicePtr,
        dst: DevicePtr,
        len: usize,
    ) -> Result<(), GpuError> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        let status = unsafe {
            (self.rt.f.memcpy_async)(
                dst.0 as *mut c_void,
                src.0 as *const c_void,
                len,
                MEMCPY_DEVICE_TO_DEVICE,
                stream.raw,
            )
        };
        self.rt.check(status, "cudaMemcpyAsync (device to device)", self.ordinal)
    }

    /// Enqueue zeroing `len` bytes of device memory at `dst` on `stream` (a joined rank's contribution).
    ///
    /// # Safety
    /// The range must be valid memory of this device until the work on `stream` completes.
    pub unsafe fn zero(&self, stream: &CudaStream, dst: DevicePtr, len: usize) -> Result<(), GpuError> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        let status = unsafe { (self.rt.f.memset_async)(dst.0 as *mut c_void, 0, len, stream.raw) };
        self.rt.check(status, "cudaMemsetAsync", self.ordinal)
    }

    /// A stream the framework owns (e.g. `torch.cuda.current_stream().cuda_stream`), borrowed: never
    /// destroyed by rvod.
    ///
    /// # Safety
    /// `raw` must be a live stream of this device for as long as the returned value is used.
    pub unsafe fn borrowed_stream(&self, raw: usize) -> std::mem::ManuallyDrop<CudaStream> {
        std::mem::ManuallyDrop::new(CudaStream { rt: self.rt, raw: raw as RawStream })
    }
}

impl CudaStream {
    pub fn raw(&self) -> *mut c_void {
        self.raw
    }
}

impl CudaEvent {
    /// The `cudaEvent_t` (which events are reused shows here).
    pub fn raw(&self) -> *mut c_void {
        self.raw
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // SAFETY: created by cudaStreamCreateWithFlags; work already queued still completes.
        unsafe { (self.rt.f.stream_destroy)(self.raw) };
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // Its last holder lets go: no wait on it can still be enqueued (see the type's doc).
        self.pool.give_back(self.raw);
    }
}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cudaMallocHost; the staging code waits for every copy using it first.
        unsafe { (self.rt.f.free_host)(self.ptr as *mut c_void) };
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by cudaMalloc; cudaFree waits for work using it.
        unsafe { (self.rt.f.free)(self.ptr.0 as *mut c_void) };
    }
}

impl PinnedBuffer for CudaPinned {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: cudaMallocHost returned `len` bytes (a dangling non-null pointer is not used for len 0).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above; &mut self gives unique access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Device for CudaDevice {
    type Stream = CudaStream;
    type Event = CudaEvent;
    type Pinned = CudaPinned;

    fn name(&self) -> String {
        format!("GPU {}", self.ordinal)
    }

    fn alloc_pinned(&self, len: usize) -> Result<CudaPinned, GpuError> {
        self.make_current()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; len > 0 (staging asks for at least one byte).
        let status = unsafe { (self.rt.f.malloc_host)(&mut ptr, len.max(1)) };
        self.rt.check(status, &format!("cudaMallocHost of {len} bytes"), self.ordinal)?;
        // cudaMallocHost does not promise zeroed memory; make it initialised for the slices above.
        // SAFETY: ptr points at len writable bytes.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, len) };
        Ok(CudaPinned { rt: self.rt, ptr: ptr as *mut u8, len })
    }

    unsafe fn copy_to_host(&self, stream: &CudaStream, src: DevicePtr, dst: &mut [u8]) -> Result<(), GpuError> {
        let (dst_ptr, len) = (dst.as_mut_ptr() as *mut c_void, dst.len());
        // SAFETY: the caller guarantees src and keeps dst alive until the copy has completed.
        let status = unsafe {
            (self.rt.f.memcpy_async)(dst_ptr, src.0 as *const c_void, len, MEMCPY_DEVICE_TO_HOST, stream.raw)
        };
        self.rt.check(status, "cudaMemcpyAsync (device to host)", self.ordinal)
    }

    unsafe fn copy_to_device(&self, stream: &CudaStream, src: &[u8], dst: DevicePtr) -> Result<(), GpuError> {
        let (src_ptr, len) = (src.as_ptr() as *const c_void, src.len());
        // SAFETY: the caller guarantees dst and keeps src alive until the copy has completed.
        let status =
            unsafe { (self.rt.f.memcpy_async)(dst.0 as *mut c_void, src_ptr, len, MEMCPY_HOST_TO_DEVICE, stream.raw) };
        self.rt.check(status, "cudaMemcpyAsync (host to device)", self.ordinal)
    }

    fn record(&self, stream: &CudaStream) -> Result<CudaEvent, GpuError> {
        self.make_current()?;
        let raw = match self.events.take() {
            Some(raw) => raw,
            None => {
                let mut raw: RawEvent = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                let status = unsafe { (self.rt.f.event_create_with_flags)(&mut raw, EVENT_DISABLE_TIMING) };
                self.rt.check(status, "cudaEventCreateWithFlags", self.ordinal)?;
                raw
            }
        };
        // Back to the pool even if the record fails: it is still an event of this device.
        let event = CudaEvent { raw, pool: self.events.clone() };
        // SAFETY: a live event (of this device, as its pool is) and stream.
        let status = unsafe { (self.rt.f.event_record)(event.raw, stream.raw) };
        self.rt.check(status, "cudaEventRecord", self.ordinal)?;
        Ok(event)
    }

    fn wait_event(&self, stream: &CudaStream, event: &CudaEvent) -> Result<(), GpuError> {
        // SAFETY: a live stream and event.
        let status = unsafe { (self.rt.f.stream_wait_event)(stream.raw, event.raw, 0) };
        self.rt.check(status, "cudaStreamWaitEvent", self.ordinal)
    }

    fn synchronize(&self, event: &CudaEvent) -> Result<(), GpuError> {
        // SAFETY: a live event.
        let status = unsafe { (self.rt.f.event_synchronize)(event.raw) };
        self.rt.check(status, "cudaEventSynchronize", self.ordinal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_count_errors_say_what_is_missing_first() {
        let text = "CUDA driver version is insufficient for CUDA runtime version (cudaErrorInsufficientDriver)";
        assert_eq!(device_count_error(35, text), format!("no CUDA driver: {text}"));
        assert_eq!(
            device_count_error(100, "no CUDA-capable device is detected"),
            "no CUDA device: no CUDA-capable device is detected"
        );
        assert_eq!(device_count_error(3, "initialization error"), "cudaGetDeviceCount failed: initialization error");
    }
}
