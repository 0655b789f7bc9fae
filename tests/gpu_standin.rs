//! rvod's real GPU wrappers (src/gpu/cuda.rs, nccl.rs) and host staging on them, against the GPU stand-in
//! (tests/gpu_standin/: the CUDA runtime and NCCL on host memory, loaded through RVOD_CUDA_LIBRARY and
//! RVOD_NCCL_LIBRARY as the real ones are).
//!
//! The stand-in is built here with `cc` (cached by the hash of its sources, shared with
//! tests/python/gpu_standin.py); without a C compiler every test says so and passes without running.
//! Ranks are threads of this process (one GPU each, 8 GPUs), except the dead-peer test, whose peer is a
//! child process that exits. Streams run their work late on purpose (RVOD_STANDIN_STREAM_DELAY_US), so a
//! missing wait reads stale bytes.

use std::ffi::{c_char, c_int, c_void, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use rvod::config::GpuConfig;
use rvod::gpu::cuda::{CudaDevice, CudaRuntime, CudaStream, DeviceMemory};
use rvod::gpu::device::{Device, DevicePtr, PinnedBuffer};
use rvod::gpu::library::GpuLibraries;
use rvod::gpu::nccl::{self, Communicator, Nccl, UniqueId};
use rvod::gpu::plan::NcclOp;
use rvod::gpu::staging::{DeviceRegion, HostResult, HostStaging};
use rvod::ring::allreduce;
use rvod::transport::memory::{run_ranks, MemoryTransport};
use rvod::transport::Transport;
use rvod::types::{Combine, DataType, ReduceOp};
use sha2::{Digest, Sha256};

/// What tests/python/gpu_standin.py compiles with: both hash these with the sources into one cache path.
const FLAGS: [&str; 4] = ["-shared", "-fPIC", "-O2", "-pthread"];
/// Tests run in parallel in one process and share the stand-in: each injected failure is on a GPU of its own.
const DEVICES: i32 = 8;
const STREAM_DELAY_US: &str = "1000";

struct Standin {
    cuda: &'static CudaRuntime,
    nccl: &'static Nccl,
    path: PathBuf,
    kernel_write: unsafe extern "C" fn(*mut c_void, *mut c_void, *const c_void, usize) -> c_int,
    fail: unsafe extern "C" fn(*const c_char) -> c_int,
    _lib: libloading::Library,
}

/// Build the stand-in (or find it built), or why it cannot be.
fn build() -> Result<PathBuf, String> {
    let sources = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/gpu_standin");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&sources)
        .map_err(|e| format!("{}: {e}", sources.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("c" | "h")))
        .collect();
    files.sort_by_key(|p| p.file_name().map(|n| n.to_owned()));
    let mut hash = Sha256::new();
    hash.update(FLAGS.join(" ").as_bytes());
    hash.update([0]);
    for file in &files {
        let name = file.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        hash.update(name.as_bytes());
        hash.update([0]);
        hash.update(std::fs::read(file).map_err(|e| e.to_string())?);
        hash.update([0]);
    }
    let hex: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let dir = std::env::temp_dir().join(format!("rvod-gpu-standin-{uid}")).join(&hex[..16]);
    let target = dir.join("librvod_gpu_standin.so");
    if target.exists() {
        return Ok(target);
    }
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let partial = dir.join(format!("librvod_gpu_standin.so.{}.partial", std::process::id()));
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let c_files = files.iter().filter(|p| p.extension().is_some_and(|e| e == "c"));
    let output = Command::new(&compiler).args(FLAGS).arg("-o").arg(&partial).args(c_files).output();
    match output {
        Err(e) => Err(format!("no C compiler ({compiler}: {e}) to build the GPU stand-in")),
        Ok(out) if !out.status.success() => {
            panic!("building the GPU stand-in failed:\n{}", String::from_utf8_lossy(&out.stderr))
        }
        Ok(_) => {
            std::fs::rename(&partial, &target).map_err(|e| e.to_string())?;
            Ok(target)
        }
    }
}

/// The stand-in, loaded once for this process through rvod's own loader, or `None` (with the reason printed).
fn standin() -> Option<&'static Standin> {
    static LOADED: OnceLock<Result<Standin, String>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        let path = build()?;
        // Read by the stand-in on its first call, which comes after this.
        std::env::set_var("RVOD_STANDIN_DEVICES", DEVICES.to_string());
        std::env::set_var("RVOD_STANDIN_DEVICE_MEMORY", "256M");
        std::env::set_var("RVOD_STANDIN_STREAM_DELAY_US", STREAM_DELAY_US);
        std::env::set_var("RVOD_STANDIN_KERNEL_US", "20000");
        std::env::set_var("RVOD_STANDIN_NCCL_SLOT_BYTES", "65536");
        let config =
            GpuConfig { cuda_library: Some(path.clone()), nccl_library: Some(path.clone()), ..GpuConfig::default() };
        let libs: &'static GpuLibraries = Box::leak(Box::new(GpuLibraries::load(&config, &[])));
        assert_eq!(libs.unavailable(), None, "the stand-in offers a driver, devices and NCCL");
        let (Ok(cuda), Ok(nccl)) = (&libs.cuda, &libs.nccl) else { panic!("the stand-in did not load") };
        // SAFETY: the stand-in is built to be dlopened; the symbols have the C signatures declared here.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| e.to_string())?;
        // SAFETY: as above.
        let (kernel_write, fail) = unsafe {
            (
                *lib.get(b"standin_kernel_write\0").map_err(|e| e.to_string())?,
                *lib.get(b"standin_fail\0").map_err(|e| e.to_string())?,
            )
        };
        Ok(Standin { cuda, nccl, path, kernel_write, fail, _lib: lib })
    });
    match loaded {
        Ok(standin) => Some(standin),
        Err(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}

impl Standin {
    fn device(&self, ordinal: i32) -> CudaDevice {
        CudaDevice::new(self.cuda, ordinal).unwrap()
    }

    /// A framework kernel on `stream` (of the calling thread's current device) that writes `bytes` at `dst`.
    fn kernel(&self, stream: &CudaStream, dst: DevicePtr, bytes: &[u8]) {
        // SAFETY: a live stream, device memory of at least bytes.len(), and a host slice (captured now).
        let status =
            unsafe { (self.kernel_write)(stream.raw(), dst.0 as *mut c_void, bytes.as_ptr().cast(), bytes.len()) };
        assert_eq!(status, 0, "standin_kernel_write");
    }

    fn fail(&self, spec: &str) {
        let spec = CString::new(spec).unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { (self.fail)(spec.as_ptr()) }, 0, "standin_fail");
    }
}

/// Device memory holding `bytes`, written by a synchronous copy.
fn upload(device: &CudaDevice, stream: &CudaStream, bytes: &[u8]) -> DeviceMemory {
    let memory = device.alloc(bytes.len().max(1)).unwrap();
    // SAFETY: the allocation holds bytes.len() bytes; `bytes` lives until the synchronize below.
    unsafe { device.copy_to_device(stream, bytes, memory.ptr) }.unwrap();
    device.synchronize(&device.record(stream).unwrap()).unwrap();
    memory
}

/// `len` bytes of device memory at `src`, once `stream` has run what it holds.
fn download(device: &CudaDevice, stream: &CudaStream, src: DevicePtr, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: the caller's region; `out` lives until the synchronize below.
    unsafe { device.copy_to_host(stream, src, &mut out) }.unwrap();
    device.synchronize(&device.record(stream).unwrap()).unwrap();
    out
}

fn f32s(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn loads_through_the_settings_and_reports_the_gpus() {
    let Some(s) = standin() else { return };
    assert_eq!(s.cuda.path, s.path);
    assert_eq!(s.cuda.device_count(), Ok(DEVICES));
    assert_eq!(s.cuda.runtime_version, 12080);
    assert_eq!(s.cuda.driver_version(), 12080);
    assert_eq!(nccl::version_text(s.nccl.version), "2.21.5");
    let buses: Vec<String> = (0..DEVICES).map(|d| s.device(d).pci_bus_id().unwrap()).collect();
    assert_eq!(buses[..3], ["00000000:10:00.0", "00000000:11:00.0", "00000000:12:00.0"]);
    let error = CudaDevice::new(s.cuda, DEVICES).err().unwrap();
    assert_eq!(error.to_string(), "cudaSetDevice failed on GPU 8: invalid device ordinal (cudaErrorInvalidDevice)");
    // Only a device that is current already skips cudaSetDevice: another, unusable, gets its error.
    let error = s.cuda.set_current_device(DEVICES).err().unwrap();
    assert_eq!(error.to_string(), "cudaSetDevice failed on GPU 8: invalid device ordinal (cudaErrorInvalidDevice)");
}

#[test]
fn copies_round_trip_through_device_memory() {
    let Some(s) = standin() else { return };
    let device = s.device(1);
    let stream = device.new_stream().unwrap();
    for len in [1usize, 7, 4097, (1 << 20) + 3] {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let memory = upload(&device, &stream, &bytes);
        assert_eq!(download(&device, &stream, memory.ptr, len), bytes, "{len} bytes");
        let mut pinned = device.alloc_pinned(len).unwrap();
        // SAFETY: the allocation holds len bytes; the pinned buffer lives until the synchronize.
        unsafe {
            device.copy_to_host(&stream, memory.ptr.offset(len / 2), &mut pinned.as_mut_slice()[..len - len / 2])
        }
        .unwrap();
        device.synchronize(&device.record(&stream).unwrap()).unwrap();
        assert_eq!(&pinned.as_slice()[..len - len / 2], &bytes[len / 2..], "a copy from inside an allocation");
    }
}

#[test]
fn a_missing_wait_reads_stale_bytes_and_the_frameworks_event_gives_the_kernels() {
    let Some(s) = standin() else { return };
    let device = s.device(2);
    let (framework, rvod) = (device.new_stream().unwrap(), device.new_stream().unwrap());
    let tensor = upload(&device, &rvod, &f32s(&[1.0; 4]));

    let before_kernel = device.record(&framework).unwrap();
    s.kernel(&framework, tensor.ptr, &f32s(&[9.0; 4]));
    assert_eq!(floats(&download(&device, &rvod, tensor.ptr, 16)), vec![1.0; 4], "no wait: the kernel has not run");
    device.wait_event(&rvod, &before_kernel).unwrap();
    assert_eq!(
        floats(&download(&device, &rvod, tensor.ptr, 16)),
        vec![1.0; 4],
        "an event recorded before the kernel does not cover it"
    );
    device.synchronize(&device.record(&framework).unwrap()).unwrap();

    s.kernel(&framework, tensor.ptr, &f32s(&[5.0; 4]));
    let ready = device.record(&framework).unwrap();
    assert_eq!(device.query(&ready), Ok(false), "the kernel takes a few milliseconds");
    device.wait_event(&rvod, &ready).unwrap();
    assert_eq!(
        floats(&download(&device, &rvod, tensor.ptr, 16)),
        vec![5.0; 4],
        "waiting on the event: the kernel's values"
    );
    assert_eq!(device.query(&ready), Ok(true));
}

#[test]
fn a_dropped_event_is_recorded_again_and_a_wait_made_before_keeps_the_record_it_saw() {
    let Some(s) = standin() else { return };
    let device = s.device(3);
    let (framework, idle, rvod) =
        (device.new_stream().unwrap(), device.new_stream().unwrap(), device.new_stream().unwrap());
    let mut seen = std::collections::HashSet::new();
    for _ in 0..100 {
        let event = device.record(&rvod).unwrap();
        device.synchronize(&event).unwrap();
        seen.insert(event.raw() as usize);
    }
    assert_eq!(seen.len(), 1, "one event serves a hundred records, each dropped before the next");
    let (first, second) = (device.record(&rvod).unwrap(), device.record(&rvod).unwrap());
    assert_ne!(first.raw(), second.raw(), "two held at once are two events");
    drop((first, second));

    let tensor = upload(&device, &rvod, &f32s(&[1.0; 4]));
    s.kernel(&framework, tensor.ptr, &f32s(&[5.0; 4])); // the framework's slow kernel
    let ready = device.record(&framework).unwrap();
    let raw = ready.raw();
    device.wait_event(&rvod, &ready).unwrap();
    drop(ready); // as an op drops its input's ready event once its stream waits for it
    let reused = device.record(&idle).unwrap(); // a stream with nothing queued: complete at once
    assert_eq!(reused.raw(), raw, "the dropped event is the next one recorded");
    assert_eq!(
        floats(&download(&device, &rvod, tensor.ptr, 16)),
        vec![5.0; 4],
        "the wait enqueued before the event was recorded again still waits for the kernel"
    );
    device.synchronize(&reused).unwrap();
}

#[test]
fn out_of_memory_and_injected_cuda_errors_read_as_cuda_words() {
    let Some(s) = standin() else { return };
    let device = s.device(7);
    let error = device.alloc(1 << 30).err().unwrap();
    assert_eq!(
        error.to_string(),
        "cudaMalloc of 1073741824 bytes failed on GPU 7: out of memory (cudaErrorMemoryAllocation)"
    );
    let stream = device.new_stream().unwrap();
    let memory = device.alloc(64).unwrap();
    s.fail("cudaMemcpyAsync@7:1:700");
    // SAFETY: the allocation holds 64 bytes; nothing is copied (the call fails).
    let error = unsafe { device.copy_to_device(&stream, &[0u8; 64], memory.ptr) }.err().unwrap();
    assert_eq!(
        error.to_string(),
        "cudaMemcpyAsync (host to device) failed on GPU 7: an illegal memory access was encountered \
         (cudaErrorIllegalAddress)"
    );
    // SAFETY: a host pointer where device memory is expected: the stand-in refuses it as CUDA does.
    let error = unsafe { device.copy_to_device(&stream, &[0u8; 8], DevicePtr(0x1000)) }.err().unwrap();
    assert!(error.to_string().ends_with("invalid argument (cudaErrorInvalidValue)"), "{error}");
}

/// Values for rank `rank`, small enough that sums, products and averages of three ranks are exact in every type.
fn values(rank: usize, count: usize) -> Vec<f64> {
    (0..count).map(|i| (1 + (i + 2 * rank) % 4) as f64).collect()
}

fn encode(dtype: DataType, values: &[f64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            DataType::Int8 => (v as i8).to_ne_bytes().to_vec(),
            DataType::Uint8 => (v as u8).to_ne_bytes().to_vec(),
            DataType::Int32 => (v as i32).to_ne_bytes().to_vec(),
            DataType::Int64 => (v as i64).to_ne_bytes().to_vec(),
            DataType::Float16 => f16::from_f64(v).to_ne_bytes().to_vec(),
            DataType::Bfloat16 => bf16::from_f64(v).to_ne_bytes().to_vec(),
            DataType::Float32 => (v as f32).to_ne_bytes().to_vec(),
            _ => v.to_ne_bytes().to_vec(),
        })
        .collect()
}

/// The dtypes NCCL reduces: those rvod's mapping gives an NCCL type, but bool (it travels as uint8, and its
/// reductions take host staging, see plan.rs). Not int16 or uint16 (NCCL has no such type).
fn nccl_types() -> Vec<DataType> {
    let reducible = |&d: &DataType| d != DataType::Bool && nccl::data_type(d).is_some();
    let types: Vec<DataType> = DataType::ALL.into_iter().filter(reducible).collect();
    assert_eq!(types.len(), 8, "NCCL has 8 of rvod's dtypes: {types:?}");
    types
}

/// Run `body` on `ranks` threads, each with its own GPU (rank r on GPU `gpus[r]`), a stream and an
/// initialised communicator.
fn on_ranks<R: Send>(
    s: &'static Standin,
    gpus: &[i32],
    body: impl Fn(&CudaDevice, &CudaStream, &Communicator) -> R + Sync,
) -> Vec<R> {
    let id = s.nccl.unique_id(0, gpus[0]).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = gpus
            .iter()
            .enumerate()
            .map(|(rank, &gpu)| {
                let body = &body;
                scope.spawn(move || {
                    let device = s.device(gpu);
                    let stream = device.new_stream().unwrap();
                    let comm = Communicator::init(s.nccl, id, gpus.len(), rank, gpu).unwrap();
                    body(&device, &stream, &comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Wait for what `stream` has queued the way rvod's engine does (`nccl::wait_or_abort`: poll an event, check
/// the communicator's asynchronous error, abort it at the deadline).
fn wait_as_rvod_does(
    device: &CudaDevice,
    stream: &CudaStream,
    comm: &Communicator,
    timeout: Duration,
    interval: Duration,
    what: &str,
) -> Result<(), String> {
    let done = device.record(stream).unwrap();
    nccl::wait_or_abort(
        || device.query(&done).map_err(|e| e.to_string()),
        || comm.async_error(),
        |_| comm.abort(),
        timeout,
        interval,
        what,
    )
}

/// Enqueue an NCCL call, wait for it through rvod's own wait (`wait_or_abort`), and return the output's bytes.
fn finish(device: &CudaDevice, stream: &CudaStream, comm: &Communicator, out: &DeviceMemory) -> Vec<u8> {
    wait_as_rvod_does(device, stream, comm, Duration::from_secs(60), Duration::from_micros(200), "test collective")
        .unwrap();
    download(device, stream, out.ptr, out.len)
}

#[test]
fn allreduce_of_every_type_and_op_on_three_ranks_matches_the_cpu_result() {
    let Some(s) = standin() else { return };
    let count = 4097;
    let all: Vec<Vec<f64>> = (0..3).map(|rank| values(rank, count)).collect();
    let results = on_ranks(s, &[0, 1, 2], |device, stream, comm| {
        let mut checked = 0;
        for dtype in nccl_types() {
            let code = nccl::data_type(dtype).unwrap();
            for op in [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Max, ReduceOp::Min, ReduceOp::Average] {
                if op == ReduceOp::Average && !dtype.is_float() {
                    continue; // integer averages take host staging (plan.rs)
                }
                let input = upload(device, stream, &encode(dtype, &values(comm.rank, count)));
                let output = device.alloc(input.len).unwrap();
                let op_code = nccl::reduce_op(op, s.nccl.version).unwrap();
                // SAFETY: both buffers hold `count` elements of dtype; they live until `finish` returns.
                unsafe { comm.all_reduce(input.ptr.0, output.ptr.0, count, code, op_code, stream.raw()) }.unwrap();
                let got = finish(device, stream, comm, &output);
                let expected: Vec<f64> = (0..count)
                    .map(|i| {
                        let v: Vec<f64> = all.iter().map(|values| values[i]).collect();
                        match op {
                            ReduceOp::Sum => v.iter().sum(),
                            ReduceOp::Product => v.iter().product(),
                            ReduceOp::Max => v.iter().cloned().fold(f64::MIN, f64::max),
                            ReduceOp::Min => v.iter().cloned().fold(f64::MAX, f64::min),
                            _ => v.iter().sum::<f64>() / 3.0,
                        }
                    })
                    .collect();
                if op == ReduceOp::Average && dtype != DataType::Float64 {
                    let tolerance = if dtype == DataType::Float32 { 1e-6 } else { 1e-2 };
                    let decoded = decode(dtype, &got);
                    assert!(
                        decoded.iter().zip(&expected).all(|(a, b)| (a - b).abs() <= tolerance * b.abs()),
                        "{op} of {dtype} on rank {}",
                        comm.rank
                    );
                } else {
                    assert_eq!(got, encode(dtype, &expected), "{op} of {dtype} on rank {}", comm.rank);
                }
                checked += 1;
            }
        }
        // In place, a size of many chunks, and a pre-multiplied sum (the prescale/average route of plan.rs).
        let big = (1 << 18) + 3;
        let tensor = upload(device, stream, &f32s(&vec![comm.rank as f32 + 1.0; big]));
        let sum = nccl::reduce_op(ReduceOp::Sum, s.nccl.version).unwrap();
        // SAFETY: one buffer of `big` float32s, used as input and output.
        unsafe { comm.all_reduce(tensor.ptr.0, tensor.ptr.0, big, 7, sum, stream.raw()) }.unwrap();
        assert!(floats(&finish(device, stream, comm, &tensor)).iter().all(|&v| v == 6.0), "in place, {big} elements");
        for dtype in [DataType::Float16, DataType::Bfloat16, DataType::Float32, DataType::Float64] {
            let input = upload(device, stream, &encode(dtype, &values(comm.rank, count)));
            let reduction = comm.reduction(NcclOp::PreMulSum(0.5), dtype).unwrap();
            // SAFETY: one buffer of `count` elements, in place.
            let code = nccl::data_type(dtype).unwrap();
            unsafe { comm.all_reduce(input.ptr.0, input.ptr.0, count, code, reduction.code, stream.raw()) }.unwrap();
            drop(reduction); // NCCL allows destroying the op once the call that uses it is enqueued
            let expected: Vec<f64> = (0..count).map(|i| all.iter().map(|values| values[i] * 0.5).sum()).collect();
            assert_eq!(finish(device, stream, comm, &input), encode(dtype, &expected), "premulsum of {dtype}");
        }
        checked
    });
    assert_eq!(results, vec![36; 3], "every type and op ran on every rank");
}

fn decode(dtype: DataType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DataType::Float16 => bytes.chunks_exact(2).map(|c| f16::from_ne_bytes([c[0], c[1]]).to_f64()).collect(),
        DataType::Bfloat16 => bytes.chunks_exact(2).map(|c| bf16::from_ne_bytes([c[0], c[1]]).to_f64()).collect(),
        DataType::Float32 => floats(bytes).into_iter().map(f64::from).collect(),
        _ => bytes.chunks_exact(8).map(|c| f64::from_ne_bytes(c.try_into().unwrap())).collect(),
    }
}

#[test]
fn broadcast_allgather_reducescatter_and_alltoall_on_three_ranks() {
    let Some(s) = standin() else { return };
    let outputs = on_ranks(s, &[5, 3, 4], |device, stream, comm| {
        let rank = comm.rank;
        let mine = upload(device, stream, &f32s(&[rank as f32 * 10.0 + 1.0, rank as f32 * 10.0 + 2.0]));
        let out = device.alloc(8).unwrap();
        // SAFETY: 2 float32s each.
        unsafe { comm.broadcast(mine.ptr.0, out.ptr.0, 2, 7, 2, stream.raw()) }.unwrap();
        let broadcast = floats(&finish(device, stream, comm, &out));

        let gathered = device.alloc(24).unwrap();
        // SAFETY: 2 float32s in, 6 out.
        unsafe { comm.all_gather(mine.ptr.0, gathered.ptr.0, 2, 7, stream.raw()) }.unwrap();
        let allgather = floats(&finish(device, stream, comm, &gathered));

        // Uneven first dimensions (plan.rs's AllGatherV): rank r contributes r + 1 elements, one broadcast each.
        let parts = [(0usize, 0usize, 1usize), (1, 1, 2), (2, 3, 3)];
        let own = upload(device, stream, &f32s(&vec![rank as f32; rank + 1]));
        let uneven = device.alloc(24).unwrap();
        comm.group(|comm| {
            for &(root, offset, count) in &parts {
                let send = if root == rank { own.ptr.0 } else { 0 };
                // SAFETY: the root's input holds `count` float32s, the output 6.
                unsafe { comm.broadcast(send, uneven.ptr.offset(offset * 4).0, count, 7, root, stream.raw()) }?;
            }
            Ok(())
        })
        .unwrap();
        let allgatherv = floats(&finish(device, stream, comm, &uneven));

        let rows = upload(device, stream, &f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0].map(|v| v * (rank as f32 + 1.0))));
        let scattered = device.alloc(8).unwrap();
        // SAFETY: 6 float32s in, 2 out.
        unsafe { comm.reduce_scatter(rows.ptr.0, scattered.ptr.0, 2, 7, 0, stream.raw()) }.unwrap();
        let reducescatter = floats(&finish(device, stream, comm, &scattered));

        // Alltoall with splits: rank r sends r + p + 1 elements to peer p, of value 100 r + p.
        let send_counts: Vec<usize> = (0..3).map(|p| rank + p + 1).collect();
        let send_values: Vec<f32> = (0..3).flat_map(|p| vec![(100 * rank + p) as f32; send_counts[p]]).collect();
        let recv_counts: Vec<usize> = (0..3).map(|p| p + rank + 1).collect();
        let input = upload(device, stream, &f32s(&send_values));
        let received = device.alloc(recv_counts.iter().sum::<usize>() * 4).unwrap();
        let offsets =
            |counts: &[usize]| counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect::<Vec<_>>();
        let (so, ro) = (offsets(&send_counts), offsets(&recv_counts));
        let sends: Vec<_> = (0..3).map(|p| (p, input.ptr.offset(so[p] * 4).0, send_counts[p])).collect();
        let recvs: Vec<_> = (0..3).map(|p| (p, received.ptr.offset(ro[p] * 4).0, recv_counts[p])).collect();
        // SAFETY: every address lies in its buffer with its count of float32s.
        unsafe { comm.exchange(&sends, &recvs, 7, stream.raw()) }.unwrap();
        let alltoall = floats(&finish(device, stream, comm, &received));
        (broadcast, allgather, allgatherv, reducescatter, alltoall)
    });
    for (rank, (broadcast, allgather, allgatherv, reducescatter, alltoall)) in outputs.into_iter().enumerate() {
        assert_eq!(broadcast, vec![21.0, 22.0], "rank {rank}: root 2's values");
        assert_eq!(allgather, vec![1.0, 2.0, 11.0, 12.0, 21.0, 22.0], "rank {rank}");
        assert_eq!(allgatherv, vec![0.0, 1.0, 1.0, 2.0, 2.0, 2.0], "rank {rank}");
        let full = [6.0, 12.0, 18.0, 24.0, 30.0, 36.0];
        assert_eq!(reducescatter, full[2 * rank..2 * rank + 2].to_vec(), "rank {rank}");
        let expected: Vec<f32> = (0..3).flat_map(|p| vec![(100 * p + rank) as f32; p + rank + 1]).collect();
        assert_eq!(alltoall, expected, "rank {rank}");
    }
}

#[test]
fn two_ranks_on_one_gpu_are_refused_as_nccl_does() {
    let Some(s) = standin() else { return };
    let id = s.nccl.unique_id(0, 6).unwrap();
    let errors: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                scope.spawn(move || {
                    let _device = s.device(6);
                    Communicator::init(s.nccl, id, 2, rank, 6).err().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, error) in errors.iter().enumerate() {
        assert_eq!(
            error,
            &format!(
                "NCCL error on rank {rank} (GPU 6) in ncclCommInitRank: ncclInvalidUsage (5): invalid usage (run with \
                 NCCL_DEBUG=WARN for details) - Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 6 (bus id \
                 00000000:16:00.0) (this is a bug in rvod or a mismatch between ranks; please report it)"
            )
        );
    }
}

#[test]
fn an_injected_nccl_error_names_the_rank_and_the_others_fail_instead_of_hanging() {
    let Some(s) = standin() else { return };
    s.fail("ncclAllReduce@4:1:2:socket to rank 0 closed by peer");
    let barrier = Barrier::new(3);
    let outcomes = on_ranks(s, &[5, 6, 4], |device, stream, comm| {
        let tensor = upload(device, stream, &f32s(&[1.0; 8]));
        barrier.wait();
        // SAFETY: 8 float32s, in place.
        let called = unsafe { comm.all_reduce(tensor.ptr.0, tensor.ptr.0, 8, 7, 0, stream.raw()) };
        if let Err(error) = called {
            comm.abort(); // what rvod does with a communicator whose call failed
            return error;
        }
        let started = Instant::now();
        let waited = wait_as_rvod_does(
            device,
            stream,
            comm,
            Duration::from_secs(60),
            Duration::from_millis(1),
            "allreduce of 'w'",
        );
        assert!(started.elapsed() < Duration::from_secs(10), "rank {} waited {:?}", comm.rank, started.elapsed());
        device.synchronize(&device.record(stream).unwrap()).unwrap(); // the abort ended the stuck work
        waited.err().unwrap()
    });
    assert_eq!(
        outcomes[2],
        "NCCL error on rank 2 (GPU 4) in ncclAllReduce: ncclSystemError (2): unhandled system error (run with \
         NCCL_DEBUG=INFO for details) - socket to rank 0 closed by peer (a system call or the network failed; run \
         with NCCL_DEBUG=WARN for NCCL's own log)"
    );
    for rank in 0..2 {
        let pid = std::process::id();
        assert!(
            outcomes[rank].starts_with(&format!(
                "NCCL error on rank {rank} (GPU {}) in a collective (reported by ncclCommGetAsyncError): \
                 ncclRemoteError (6): remote process exited or there was a network error - rank 2 (pid {pid}, GPU 4) \
                 aborted its communicator",
                [5, 6][rank]
            )),
            "{}",
            outcomes[rank]
        );
    }
}

#[test]
fn a_timed_out_wait_aborts_and_the_stuck_stream_moves_on() {
    let Some(s) = standin() else { return };
    let barrier = Barrier::new(2);
    let outcomes = on_ranks(s, &[0, 1], |device, stream, comm| {
        let tensor = upload(device, stream, &f32s(&[1.0; 8]));
        if comm.rank == 1 {
            barrier.wait(); // never joins the allreduce; stays alive until rank 0 has given up
            return String::new();
        }
        // SAFETY: 8 float32s, in place.
        unsafe { comm.all_reduce(tensor.ptr.0, tensor.ptr.0, 8, 7, 0, stream.raw()) }.unwrap();
        let ms = Duration::from_millis(1);
        let waited = wait_as_rvod_does(device, stream, comm, 300 * ms, ms, "allreduce of 'w'");
        device.synchronize(&device.record(stream).unwrap()).unwrap(); // returns: the abort ended the stuck kernel
        barrier.wait();
        waited.err().unwrap()
    });
    assert_eq!(
        outcomes[0],
        "allreduce of 'w' did not complete within 0 s (RVOD_TIMEOUT); the NCCL communicator was aborted"
    );
}

/// The peer of `a_peer_process_that_dies_fails_the_collective_instead_of_hanging`: joins the communicator whose
/// id is in RVOD_STANDIN_TEST_ID, then exits without a word.
#[test]
#[ignore = "run by a_peer_process_that_dies_fails_the_collective_instead_of_hanging as its peer process"]
fn dying_peer() {
    let (Some(s), Ok(hex)) = (standin(), std::env::var("RVOD_STANDIN_TEST_ID")) else { return };
    let mut id = UniqueId { internal: [0; 128] };
    for (i, byte) in id.internal.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as c_char;
    }
    let _device = s.device(1);
    let _comm = Communicator::init(s.nccl, id, 2, 1, 1).unwrap();
    std::process::exit(0);
}

#[test]
fn a_peer_process_that_dies_fails_the_collective_instead_of_hanging() {
    let Some(s) = standin() else { return };
    let id = s.nccl.unique_id(0, 0).unwrap();
    let hex: String = id.internal.iter().map(|&b| format!("{:02x}", b as u8)).collect();
    let mut peer = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "dying_peer", "--ignored", "--nocapture", "--test-threads=1"])
        .env("RVOD_STANDIN_TEST_ID", hex)
        .spawn()
        .unwrap();
    let device = s.device(0);
    let stream = device.new_stream().unwrap();
    let comm = Communicator::init(s.nccl, id, 2, 0, 0).unwrap();
    let peer_pid = peer.id();
    let tensor = upload(&device, &stream, &f32s(&[1.0; 8]));
    // SAFETY: 8 float32s, in place.
    unsafe { comm.all_reduce(tensor.ptr.0, tensor.ptr.0, 8, 7, 0, stream.raw()) }.unwrap();
    let started = Instant::now();
    let waited = wait_as_rvod_does(
        &device,
        &stream,
        &comm,
        Duration::from_secs(60),
        Duration::from_millis(1),
        "allreduce of 'w'",
    );
    let status = peer.wait().unwrap(); // reaped only now: the check above saw a zombie at most
    assert!(status.success());
    assert!(started.elapsed() < Duration::from_secs(10), "waited {:?}", started.elapsed());
    assert_eq!(
        waited.err().unwrap(),
        format!(
            "NCCL error on rank 0 (GPU 0) in a collective (reported by ncclCommGetAsyncError): ncclRemoteError (6): \
             remote process exited or there was a network error - rank 1 (pid {peer_pid}, GPU 1) exited while rank 0 \
             (GPU 0) waited for it in ncclAllReduce (a peer failed or the connection to it broke)"
        )
    );
}

#[test]
fn host_staging_runs_on_cuda_devices_in_stream_order() {
    let Some(s) = standin() else { return };
    const ELEMENTS: usize = 20_011;
    let mesh = MemoryTransport::mesh_with_timeout(3, Duration::from_secs(30));
    let sums = run_ranks(mesh, |transport| {
        let device = s.device(transport.rank() as i32);
        let framework = device.new_stream().unwrap();
        let tensor = upload(&device, &framework, &f32s(&vec![-1.0; ELEMENTS]));
        let values: Vec<f32> = (0..ELEMENTS).map(|i| (transport.rank() * 1000 + i % 97) as f32).collect();
        s.kernel(&framework, tensor.ptr, &f32s(&values)); // the framework writes the gradient just before
        let ready = device.record(&framework).unwrap();
        let mut staging = HostStaging::new(s.device(transport.rank() as i32), device.new_stream().unwrap());
        let region = DeviceRegion { ptr: tensor.ptr, len: ELEMENTS * 4 };
        // SAFETY: the region is the tensor's allocation.
        let done = unsafe {
            staging.run(&ready, &[region], &[region], |host: &mut [u8]| {
                allreduce(transport, host, DataType::Float32, Combine::Sum).map(|_| HostResult::InPlace)
            })
        }
        .unwrap();
        device.wait_event(&framework, &done).unwrap(); // the framework's stream waits for rvod's result
        floats(&download(&device, &framework, tensor.ptr, ELEMENTS * 4))
    });
    let expected: Vec<f32> = (0..ELEMENTS).map(|i| (3000 + 3 * (i % 97)) as f32).collect();
    for (rank, sum) in sums.iter().enumerate() {
        assert!(*sum == expected, "rank {rank}: the sum of the kernels' values, not of the -1s before them");
    }
}
