//! Host staging: a collective on device memory run by rvod's host collectives (shared memory or TCP).
//!
//! For one op (one tensor, or several fused): rvod's stream waits for the event the framework's stream
//! recorded when the op was submitted (so a kernel that wrote the tensor just before finishes first), the
//! inputs are copied into one pinned host buffer back to back, the host waits for that copy's event only,
//! the host collective runs on the buffer (in place, or into a new buffer for collectives whose result has
//! another size), the result is copied to the outputs in order, and the event after those copies is
//! returned for the framework's stream to wait on. The host never synchronizes the whole device.
//!
//! Invariants: the pinned buffer is reused across ops and only grows; no host memory a copy reads or writes
//! is touched or freed before an event recorded after that copy has completed (`run` waits for the last
//! one before returning, so it also holds when an error cuts an op short).

use crate::gpu::device::{Device, DevicePtr, PinnedBuffer};
use crate::gpu::GpuError;
use crate::tensor::AlignedBuffer;

/// A span of device memory: one tensor's input or output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRegion {
    pub ptr: DevicePtr,
    pub len: usize,
}

/// Where the host collective left its result.
#[derive(Debug)]
pub enum HostResult {
    /// In the staged buffer itself (allreduce, broadcast): the outputs take its first bytes.
    InPlace,
    /// In a buffer of its own (allgather, alltoall).
    New(AlignedBuffer),
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StagingError<E> {
    #[error(transparent)]
    Device(#[from] GpuError),
    #[error("{0}")]
    Collective(E),
    #[error("the host collective's result holds {result} bytes but the device outputs take {outputs}")]
    ResultSize { result: usize, outputs: usize },
}

/// The staging state of one device: rvod's stream and the pinned buffer reused across ops.
pub struct HostStaging<D: Device> {
    device: D,
    stream: D::Stream,
    pinned: Option<D::Pinned>,
}

impl<D: Device> HostStaging<D> {
    pub fn new(device: D, stream: D::Stream) -> HostStaging<D> {
        HostStaging { device, stream, pinned: None }
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    /// Run one staged collective; see the module doc. `ready` was recorded on the framework's stream at
    /// submission; the returned event completes when the outputs hold the result.
    ///
    /// # Safety
    /// Every input region must be valid device memory for its length until the returned event completes
    /// (or until this returns an error), likewise every output region, and no output may overlap an input
    /// that is read after it is written.
    pub unsafe fn run<E>(
        &mut self,
        ready: &D::Event,
        inputs: &[DeviceRegion],
        outputs: &[DeviceRegion],
        collective: impl FnOnce(&mut [u8]) -> Result<HostResult, E>,
    ) -> Result<D::Event, StagingError<E>> {
        let staged_len: usize = inputs.iter().map(|r| r.len).sum();
        self.device.wait_event(&self.stream, ready)?;
        self.grow_pinned(staged_len)?;
        let pinned = match self.pinned.as_mut() {
            Some(pinned) => pinned,
            None => {
                let message = "no pinned buffer".into();
                return Err(GpuError { call: "alloc_pinned".into(), device: self.device.name(), message }.into());
            }
        };
        let mut offset = 0;
        let mut copied = Ok(());
        for region in inputs {
            let dst = &mut pinned.as_mut_slice()[offset..offset + region.len];
            // SAFETY: the caller guarantees the input region; `dst` is the pinned buffer this struct owns,
            // untouched until the event below completes.
            copied = unsafe { self.device.copy_to_host(&self.stream, region.ptr, dst) };
            if copied.is_err() {
                break;
            }
            offset += region.len;
        }
        // Wait even after a failed copy: earlier copies may still be writing into the pinned buffer.
        let staged = self.device.record(&self.stream).and_then(|event| self.device.synchronize(&event));
        copied?;
        staged?;
        let pinned = self.pinned.as_mut().map(|p| &mut p.as_mut_slice()[..staged_len]).unwrap_or_default();
        let result = collective(pinned).map_err(StagingError::Collective)?;
        let bytes: &[u8] = match &result {
            HostResult::InPlace => self.pinned.as_ref().map(|p| &p.as_slice()[..staged_len]).unwrap_or_default(),
            HostResult::New(buffer) => buffer.as_slice(),
        };
        let wanted: usize = outputs.iter().map(|r| r.len).sum();
        if wanted > bytes.len() || (matches!(result, HostResult::New(_)) && wanted != bytes.len()) {
            return Err(StagingError::ResultSize { result: bytes.len(), outputs: wanted });
        }
        let mut offset = 0;
        let mut copied = Ok(());
        for region in outputs {
            // SAFETY: the caller guarantees the output region; `bytes` (the pinned buffer or `result`) lives
            // until the event below has completed.
            copied =
                unsafe { self.device.copy_to_device(&self.stream, &bytes[offset..offset + region.len], region.ptr) };
            if copied.is_err() {
                break;
            }
            offset += region.len;
        }
        let done = self.device.record(&self.stream);
        // The host memory the copies read is freed or reused after this returns, so wait for them here.
        let waited = match &done {
            Ok(event) => self.device.synchronize(event),
            Err(e) => Err(e.clone()),
        };
        copied?;
        waited?;
        Ok(done?)
    }

    /// Make the pinned buffer at least `len` bytes long (contents not kept when it grows).
    fn grow_pinned(&mut self, len: usize) -> Result<(), GpuError> {
        if !self.pinned.as_ref().is_some_and(|p| p.as_slice().len() >= len) {
            self.pinned = None; // free the old one first: pinned memory is scarce
            self.pinned = Some(self.device.alloc_pinned(len.max(1).next_power_of_two())?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::standin::{StandIn, BASE};
    use crate::ring::{allgatherv, allreduce};
    use crate::transport::memory::{run_ranks, MemoryTransport};
    use crate::transport::Transport;
    use crate::types::{Combine, DataType};

    fn f32s(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn floats(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// A stand-in with two tensors written by a framework kernel that has not run yet, and the event the
    /// framework recorded after it.
    fn submitted() -> (StandIn, HostStaging<StandIn>, crate::gpu::standin::StandInEvent, [DeviceRegion; 2]) {
        let device = StandIn::with_memory(256);
        let framework = device.new_stream();
        let a = DeviceRegion { ptr: DevicePtr(BASE), len: 12 };
        let b = DeviceRegion { ptr: DevicePtr(BASE + 64), len: 4 };
        device.kernel(&framework, a.ptr, &f32s(&[1.0, 2.0, 3.0]));
        device.kernel(&framework, b.ptr, &f32s(&[4.0]));
        let ready = device.record(&framework).unwrap();
        let stream = device.new_stream();
        (device.clone(), HostStaging::new(device, stream), ready, [a, b])
    }

    #[test]
    fn fused_allreduce_in_place_sees_the_kernels_values_and_lands_in_the_outputs() {
        let (device, mut staging, ready, regions) = submitted();
        let seen = std::cell::RefCell::new(Vec::new());
        // SAFETY: the regions lie inside the stand-in's memory.
        let done = unsafe {
            staging.run(&ready, &regions, &regions, |host: &mut [u8]| {
                seen.borrow_mut().extend(floats(host));
                let doubled: Vec<f32> = floats(host).iter().map(|v| v * 2.0).collect(); // two ranks' sum
                host.copy_from_slice(&f32s(&doubled));
                Ok::<_, String>(HostResult::InPlace)
            })
        }
        .unwrap();
        assert_eq!(*seen.borrow(), vec![1.0, 2.0, 3.0, 4.0], "the host collective saw the kernels' values");
        assert_eq!(floats(&device.read(regions[0].ptr, 12)), vec![2.0, 4.0, 6.0]);
        assert_eq!(floats(&device.read(regions[1].ptr, 4)), vec![8.0]);
        let framework_waits = device.new_stream();
        device.wait_event(&framework_waits, &done).unwrap();
        assert_eq!(
            device.log(),
            vec![
                "alloc pinned 16".to_string(),
                "host waits for stream 1".into(),
                "stream 0: kernel writes 0x1000".into(),
                "stream 0: kernel writes 0x1040".into(),
                "stream 1: copy 12 bytes to host from 0x1000".into(),
                "stream 1: copy 4 bytes to host from 0x1040".into(),
                "host waits for stream 1".into(),
                "stream 1: copy 12 bytes to device at 0x1000".into(),
                "stream 1: copy 4 bytes to device at 0x1040".into(),
            ],
            "kernels, then the copies to the host, then (after the collective) the copies back, in tensor order"
        );
    }

    #[test]
    fn a_result_of_another_size_is_copied_from_its_own_buffer() {
        let (device, mut staging, ready, [a, b]) = submitted();
        let out = DeviceRegion { ptr: DevicePtr(BASE + 128), len: 32 };
        // SAFETY: the regions lie inside the stand-in's memory.
        unsafe {
            staging.run(&ready, &[a, b], &[out], |host: &mut [u8]| {
                let mut gathered = host.to_vec(); // an allgather of two ranks with the same values
                gathered.extend_from_slice(host);
                Ok::<_, String>(HostResult::New(AlignedBuffer::from_slice(&gathered)))
            })
        }
        .unwrap();
        assert_eq!(floats(&device.read(out.ptr, 32)), vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(floats(&device.read(a.ptr, 12)), vec![1.0, 2.0, 3.0], "the input is left as it was");
    }

    #[test]
    fn the_pinned_buffer_is_reused_and_grows_only_when_needed() {
        let (device, mut staging, ready, [a, b]) = submitted();
        let identity = |_: &mut [u8]| Ok::<_, String>(HostResult::InPlace);
        // SAFETY: the regions lie inside the stand-in's memory.
        unsafe {
            staging.run(&ready, &[a, b], &[a, b], identity).unwrap();
            staging.run(&ready, &[a], &[a], identity).unwrap();
            staging.run(&ready, &[DeviceRegion { ptr: a.ptr, len: 40 }], &[], identity).unwrap();
        }
        let allocations: Vec<String> = device.log().into_iter().filter(|l| l.starts_with("alloc")).collect();
        assert_eq!(allocations, vec!["alloc pinned 16", "alloc pinned 64"]);
    }

    /// Each rank: a stand-in GPU whose framework kernel writes `values` into device memory at BASE, rvod's
    /// staging, and this rank's transport as the host collective.
    fn staged_on_every_rank<R: Send>(
        ranks: usize,
        body: impl Fn(&mut HostStaging<StandIn>, &crate::gpu::standin::StandInEvent, &mut MemoryTransport) -> R + Sync,
    ) -> Vec<R> {
        let mesh = MemoryTransport::mesh_with_timeout(ranks, std::time::Duration::from_secs(5));
        run_ranks(mesh, |transport| {
            let device = StandIn::with_memory(1 << 20);
            let framework = device.new_stream();
            let values: Vec<f32> = (0..ELEMENTS).map(|i| (transport.rank() * 1000 + i % 97) as f32).collect();
            device.kernel(&framework, DevicePtr(BASE), &f32s(&values));
            let ready = device.record(&framework).unwrap();
            let stream = device.new_stream();
            body(&mut HostStaging::new(device, stream), &ready, transport)
        })
    }

    /// Not a multiple of anything, and above the ring threshold (the ring algorithm runs, not only recursive
    /// doubling).
    const ELEMENTS: usize = 20_011;

    #[test]
    fn staged_allreduce_and_allgather_over_rvods_own_collectives() {
        let region = DeviceRegion { ptr: DevicePtr(BASE), len: ELEMENTS * 4 };
        let sums = staged_on_every_rank(3, |staging, ready, transport| {
            // SAFETY: the region lies inside the stand-in's memory.
            unsafe {
                staging.run(ready, &[region], &[region], |host: &mut [u8]| {
                    allreduce(transport, host, DataType::Float32, Combine::Sum).map(|_| HostResult::InPlace)
                })
            }
            .unwrap();
            floats(&staging.device().read(region.ptr, region.len))
        });
        let expected: Vec<f32> = (0..ELEMENTS).map(|i| (3000 + 3 * (i % 97)) as f32).collect();
        assert!(sums.iter().all(|s| *s == expected), "every rank's device holds the sum over 0+1000+2000");

        let gathered = staged_on_every_rank(3, |staging, ready, transport| {
            let rank = transport.rank();
            let mine = DeviceRegion { ptr: DevicePtr(BASE), len: (rank + 1) * 4 }; // uneven first dimensions
            let out = DeviceRegion { ptr: DevicePtr(BASE + 512 * 1024), len: 6 * 4 };
            // SAFETY: the regions lie inside the stand-in's memory and do not overlap.
            unsafe {
                staging.run(ready, &[mine], &[out], |host: &mut [u8]| {
                    let mut all = AlignedBuffer::zeroed(6 * 4);
                    allgatherv(transport, host, all.as_mut_slice(), &[4, 8, 12]).map(|_| HostResult::New(all))
                })
            }
            .unwrap();
            floats(&staging.device().read(out.ptr, out.len))
        });
        assert!(gathered.iter().all(|g| *g == vec![0.0, 1000.0, 1001.0, 2000.0, 2001.0, 2002.0]), "{gathered:?}");
    }

    #[test]
    fn a_peer_that_never_comes_fails_the_staged_op_and_nothing_is_copied_back() {
        let region = DeviceRegion { ptr: DevicePtr(BASE), len: ELEMENTS * 4 };
        let outcomes = staged_on_every_rank(3, |staging, ready, transport| {
            if transport.rank() == 2 {
                return None; // rank 2 leaves: its transport closes
            }
            // SAFETY: the region lies inside the stand-in's memory.
            let result = unsafe {
                staging.run(ready, &[region], &[region], |host: &mut [u8]| {
                    allreduce(transport, host, DataType::Float32, Combine::Sum).map(|_| HostResult::InPlace)
                })
            };
            let copied_back = staging.device().log().iter().any(|l| l.contains("to device"));
            Some((result.map(|_| ()).map_err(|e| e.to_string()), copied_back))
        });
        for (rank, outcome) in outcomes.into_iter().take(2).enumerate() {
            let (result, copied_back) = outcome.unwrap();
            assert!(result.is_err(), "rank {rank} must fail, not hang or succeed");
            assert!(!copied_back, "rank {rank} copied a partial result to the device");
        }
    }

    #[test]
    fn errors_propagate_and_nothing_is_copied_back_after_one() {
        let (device, mut staging, ready, regions) = submitted();
        // SAFETY: the regions lie inside the stand-in's memory.
        let failed = unsafe {
            staging.run(&ready, &regions, &regions, |_: &mut [u8]| Err::<HostResult, _>("rank 1 died".to_string()))
        };
        assert_eq!(failed.unwrap_err(), StagingError::Collective("rank 1 died".to_string()));
        assert!(!device.log().iter().any(|l| l.contains("to device")), "{:?}", device.log());

        // SAFETY: as above.
        let short = unsafe {
            staging.run(&ready, &regions, &[DeviceRegion { ptr: DevicePtr(BASE), len: 24 }], |_: &mut [u8]| {
                Ok::<_, String>(HostResult::InPlace)
            })
        };
        assert_eq!(short.unwrap_err(), StagingError::ResultSize { result: 16, outputs: 24 });

        device.fail("copy_to_host");
        // SAFETY: as above.
        let failed =
            unsafe { staging.run(&ready, &regions, &regions, |_: &mut [u8]| Ok::<_, String>(HostResult::InPlace)) };
        let StagingError::Device(error) = failed.unwrap_err() else { panic!("expected a device error") };
        assert_eq!(error.to_string(), "copy_to_host failed on GPU 0 (stand-in): injected failure");
    }
}
