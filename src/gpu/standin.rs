//! A CPU stand-in for a GPU, for tests of the code written against [`Device`].
//!
//! Device memory is one host vector addressed from [`BASE`]; each stream is a queue of operations that run
//! only when something waits for them ([`Device::synchronize`], or a stream that waits on an event of
//! another), so a path that reads host memory before waiting for its copy reads stale bytes, and a path
//! that forgets the framework's event copies a tensor before the "kernel" that wrote it has run. Every
//! operation that runs is written to a log, in the order it ran.

use std::cell::RefCell;
use std::rc::Rc;

use crate::gpu::device::{Device, DevicePtr, PinnedBuffer};
use crate::gpu::GpuError;

/// The address of the stand-in's first device byte (0 stays an invalid pointer).
pub const BASE: u64 = 0x1000;

enum Work {
    ToHost {
        src: DevicePtr,
        dst: *mut u8,
        len: usize,
    },
    ToDevice {
        src: *const u8,
        len: usize,
        dst: DevicePtr,
    },
    /// A kernel of the framework: writes these bytes at this address.
    Kernel {
        dst: DevicePtr,
        bytes: Vec<u8>,
    },
    WaitFor(StandInEvent),
}

#[derive(Default)]
struct StreamQueue {
    work: Vec<Work>,
    /// How many of `work` have run.
    done: usize,
}

#[derive(Clone)]
pub struct StandInStream(usize);

#[derive(Clone, Debug)]
pub struct StandInEvent {
    stream: usize,
    position: usize,
}

pub struct StandInPinned(Vec<u8>);

impl PinnedBuffer for StandInPinned {
    fn as_slice(&self) -> &[u8] {
        &self.0
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

#[derive(Default)]
struct State {
    memory: Vec<u8>,
    streams: Vec<StreamQueue>,
    log: Vec<String>,
    /// The call that fails (with its name) when made, for error tests.
    failing: Option<&'static str>,
}

/// The stand-in device. Clones share one device.
#[derive(Clone, Default)]
pub struct StandIn(Rc<RefCell<State>>);

impl StandIn {
    pub fn with_memory(len: usize) -> StandIn {
        let device = StandIn::default();
        device.0.borrow_mut().memory = vec![0; len];
        device
    }

    pub fn new_stream(&self) -> StandInStream {
        let mut state = self.0.borrow_mut();
        state.streams.push(StreamQueue::default());
        StandInStream(state.streams.len() - 1)
    }

    /// Enqueue a framework kernel that writes `bytes` at `dst`.
    pub fn kernel(&self, stream: &StandInStream, dst: DevicePtr, bytes: &[u8]) {
        self.0.borrow_mut().streams[stream.0].work.push(Work::Kernel { dst, bytes: bytes.to_vec() });
    }

    /// Device memory as it is now (only what has run).
    pub fn read(&self, src: DevicePtr, len: usize) -> Vec<u8> {
        let start = (src.0 - BASE) as usize;
        self.0.borrow().memory[start..start + len].to_vec()
    }

    pub fn write(&self, dst: DevicePtr, bytes: &[u8]) {
        let start = (dst.0 - BASE) as usize;
        self.0.borrow_mut().memory[start..start + bytes.len()].copy_from_slice(bytes);
    }

    pub fn log(&self) -> Vec<String> {
        self.0.borrow().log.clone()
    }

    pub fn fail(&self, call: &'static str) {
        self.0.borrow_mut().failing = Some(call);
    }

    fn check(&self, call: &'static str) -> Result<(), GpuError> {
        if self.0.borrow().failing == Some(call) {
            return Err(GpuError { call: call.into(), device: self.name(), message: "injected failure".into() });
        }
        Ok(())
    }

    fn run_until(&self, stream: usize, position: usize) {
        loop {
            let work = {
                let mut state = self.0.borrow_mut();
                let queue = &mut state.streams[stream];
                if queue.done >= position || queue.done >= queue.work.len() {
                    return;
                }
                queue.done += 1;
                std::mem::replace(&mut queue.work[queue.done - 1], Work::Kernel { dst: DevicePtr(BASE), bytes: vec![] })
            };
            match work {
                Work::WaitFor(event) => self.run_until(event.stream, event.position),
                Work::Kernel { dst, bytes } => {
                    if !bytes.is_empty() {
                        self.write(dst, &bytes);
                        self.0.borrow_mut().log.push(format!("stream {stream}: kernel writes {:#x}", dst.0));
                    }
                }
                Work::ToHost { src, dst, len } => {
                    let bytes = self.read(src, len);
                    // SAFETY: the Device contract keeps `dst` alive and unaliased until this has run.
                    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, len) };
                    self.0
                        .borrow_mut()
                        .log
                        .push(format!("stream {stream}: copy {len} bytes to host from {:#x}", src.0));
                }
                Work::ToDevice { src, len, dst } => {
                    // SAFETY: the Device contract keeps `src` alive and unchanged until this has run.
                    let bytes = unsafe { std::slice::from_raw_parts(src, len) }.to_vec();
                    self.write(dst, &bytes);
                    self.0
                        .borrow_mut()
                        .log
                        .push(format!("stream {stream}: copy {len} bytes to device at {:#x}", dst.0));
                }
            }
        }
    }
}

impl Device for StandIn {
    type Stream = StandInStream;
    type Event = StandInEvent;
    type Pinned = StandInPinned;

    fn name(&self) -> String {
        "GPU 0 (stand-in)".into()
    }

    fn alloc_pinned(&self, len: usize) -> Result<StandInPinned, GpuError> {
        self.check("alloc_pinned")?;
        self.0.borrow_mut().log.push(format!("alloc pinned {len}"));
        Ok(StandInPinned(vec![0; len]))
    }

    unsafe fn copy_to_host(&self, stream: &StandInStream, src: DevicePtr, dst: &mut [u8]) -> Result<(), GpuError> {
        self.check("copy_to_host")?;
        let work = Work::ToHost { src, dst: dst.as_mut_ptr(), len: dst.len() };
        self.0.borrow_mut().streams[stream.0].work.push(work);
        Ok(())
    }

    unsafe fn copy_to_device(&self, stream: &StandInStream, src: &[u8], dst: DevicePtr) -> Result<(), GpuError> {
        self.check("copy_to_device")?;
        let work = Work::ToDevice { src: src.as_ptr(), len: src.len(), dst };
        self.0.borrow_mut().streams[stream.0].work.push(work);
        Ok(())
    }

    fn record(&self, stream: &StandInStream) -> Result<StandInEvent, GpuError> {
        self.check("record")?;
        Ok(StandInEvent { stream: stream.0, position: self.0.borrow().streams[stream.0].work.len() })
    }

    fn wait_event(&self, stream: &StandInStream, event: &StandInEvent) -> Result<(), GpuError> {
        self.check("wait_event")?;
        self.0.borrow_mut().streams[stream.0].work.push(Work::WaitFor(event.clone()));
        Ok(())
    }

    fn synchronize(&self, event: &StandInEvent) -> Result<(), GpuError> {
        self.check("synchronize")?;
        self.0.borrow_mut().log.push(format!("host waits for stream {}", event.stream));
        self.run_until(event.stream, event.position);
        Ok(())
    }
}
