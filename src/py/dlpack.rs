//! DLPack at the Python boundary: reading a framework's capsule as a [`RawTensor`], and handing an
//! engine-owned [`AlignedBuffer`] back as a capsule any framework can import without a copy.
//!
//! Input capsules are read, not consumed: the Python side keeps the capsule (and so the tensor) alive
//! until the op's handle completes, and the capsule's own destructor releases it. That way the engine
//! thread never has to call a deleter that needs the GIL.

use std::ffi::{c_void, CStr};

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::gpu::device::DevicePtr;
use crate::gpu::runtime::PooledBuffer;
use crate::gpu::tensor::{DeviceInput, DeviceOutput};
use crate::py::error::invalid_argument;
use crate::tensor::{AlignedBuffer, RawTensor};
use crate::types::DataType;

const CAPSULE_NAME: &CStr = c"dltensor";
const DEVICE_CPU: i32 = 1;
const DEVICE_CUDA: i32 = 2;
const DEVICE_CUDA_HOST: i32 = 3;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// A tensor read out of a DLPack capsule.
pub struct ImportedTensor {
    /// Its host memory (empty for a tensor on a GPU).
    pub tensor: RawTensor,
    pub dtype: DataType,
    pub shape: Vec<i64>,
    /// A tensor on a GPU: its device memory and the event recorded when it was submitted.
    pub device: Option<DeviceInput>,
}

fn dtype_from_dlpack(dt: DLDataType) -> Option<DataType> {
    if dt.lanes != 1 {
        return None;
    }
    Some(match (dt.code, dt.bits) {
        (0, 8) => DataType::Int8,
        (0, 16) => DataType::Int16,
        (0, 32) => DataType::Int32,
        (0, 64) => DataType::Int64,
        (1, 8) => DataType::Uint8,
        (1, 16) => DataType::Uint16,
        (2, 16) => DataType::Float16,
        (2, 32) => DataType::Float32,
        (2, 64) => DataType::Float64,
        (4, 16) => DataType::Bfloat16,
        (6, 8) | (1, 1) => DataType::Bool,
        _ => return None,
    })
}

fn dtype_to_dlpack(dtype: DataType) -> DLDataType {
    let (code, bits) = match dtype {
        DataType::Int8 => (0, 8),
        DataType::Int16 => (0, 16),
        DataType::Int32 => (0, 32),
        DataType::Int64 => (0, 64),
        DataType::Uint8 => (1, 8),
        DataType::Uint16 => (1, 16),
        DataType::Float16 => (2, 16),
        DataType::Float32 => (2, 32),
        DataType::Float64 => (2, 64),
        DataType::Bfloat16 => (4, 16),
        DataType::Bool => (6, 8),
    };
    DLDataType { code, bits, lanes: 1 }
}

/// True for an unconsumed `dltensor` capsule.
pub fn is_capsule(object: &Bound<'_, PyAny>) -> bool {
    // SAFETY: PyCapsule_IsValid accepts any object pointer.
    unsafe { ffi::PyCapsule_IsValid(object.as_ptr(), CAPSULE_NAME.as_ptr()) != 0 }
}

/// Read the tensor a `dltensor` capsule describes. The capsule must stay alive while the view is used.
/// `what` names the tensor in error messages (built only when there is an error). A tensor on a GPU is
/// taken where the GPU libraries are usable (else refused with the reason): its ready event is recorded on
/// `stream` (the framework's current stream, a `cudaStream_t` as a number), or without one on rvod's stream
/// (which the producer made wait for the tensor in `__dlpack__(stream=...)`).
pub fn import_capsule(
    capsule: &Bound<'_, PyAny>,
    stream: Option<usize>,
    what: impl Fn() -> String,
) -> PyResult<ImportedTensor> {
    if !is_capsule(capsule) {
        return Err(PyTypeError::new_err(format!("{}: expected an unconsumed DLPack capsule", what())));
    }
    // SAFETY: validated above that this is a capsule named "dltensor", whose pointer is a DLManagedTensor.
    let managed =
        unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) } as *const DLManagedTensor;
    if managed.is_null() {
        return Err(PyTypeError::new_err(format!("{}: the DLPack capsule holds no tensor", what())));
    }
    // SAFETY: the producer guarantees the DLManagedTensor is valid while the capsule is alive.
    let t = unsafe { &(*managed).dl_tensor };
    let on_gpu = match t.device.device_type {
        DEVICE_CPU | DEVICE_CUDA_HOST => None,
        DEVICE_CUDA => Some(crate::py::gpu::usable_device(capsule.py(), &what, t.device.device_id)?),
        other => {
            return Err(invalid_argument(format!(
                "{}: unsupported DLPack device type {other} (rvod takes CPU tensors, and CUDA ones where a GPU is                  usable)",
                what()
            )))
        }
    };
    let dtype = dtype_from_dlpack(t.dtype).ok_or_else(|| {
        invalid_argument(format!(
            "{}: tensor type (code {}, {} bits, {} lanes) is not supported",
            what(),
            t.dtype.code,
            t.dtype.bits,
            t.dtype.lanes
        ))
    })?;
    if t.ndim < 0 || (t.ndim > 0 && t.shape.is_null()) {
        return Err(invalid_argument(format!("{}: malformed DLPack shape", what())));
    }
    let ndim = t.ndim as usize;
    // SAFETY: shape points at ndim i64 values (checked non-null above when ndim > 0).
    let shape: Vec<i64> =
        if ndim == 0 { Vec::new() } else { unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec() };
    if shape.iter().any(|&d| d < 0) {
        return Err(invalid_argument(format!("{}: negative dimension in shape {shape:?}", what())));
    }
    // Checked: a producer's shape is not trusted to describe an allocation that fits in the address space.
    let too_large = || invalid_argument(format!("{}: shape {shape:?} describes more bytes than fit in memory", what()));
    let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d as usize)).ok_or_else(too_large)?;
    if !t.strides.is_null() && elements > 1 {
        // SAFETY: strides points at ndim i64 values when non-null.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut expected = 1i64;
        for (dim, stride) in shape.iter().zip(strides).rev() {
            if *dim != 1 && *stride != expected {
                return Err(invalid_argument(format!("{}: Tensor is required to be contiguous.", what())));
            }
            expected = expected.saturating_mul(*dim);
        }
    }
    let len = elements.checked_mul(dtype.size()).ok_or_else(too_large)?;
    let data = if len == 0 {
        std::ptr::null_mut()
    } else {
        if t.data.is_null() {
            return Err(invalid_argument(format!("{}: the tensor has no data pointer", what())));
        }
        // SAFETY: byte_offset lies inside the producer's allocation by the DLPack contract.
        unsafe { (t.data as *mut u8).add(t.byte_offset as usize) }
    };
    if let Some(context) = on_gpu {
        // SAFETY: a stream handle the framework passed for this device (0: the legacy default stream).
        let ready = match stream {
            Some(stream) => unsafe { context.record_on(stream) },
            None => context.record(),
        };
        let ready = ready.map_err(|e| invalid_argument(format!("{}: {e}", what())))?;
        let device = DeviceInput { context, ptr: DevicePtr(data as u64), len, ready };
        // SAFETY: a zero-length view of no memory: the engine reads the device memory only when staging.
        let tensor = unsafe { RawTensor::new(std::ptr::null_mut(), 0) };
        return Ok(ImportedTensor { tensor, dtype, shape, device: Some(device) });
    }
    // SAFETY: the memory is valid for len bytes while the capsule lives; the caller keeps it alive until the
    // op completes and does not write to it meanwhile (the documented contract of every async op).
    let tensor = unsafe { RawTensor::new(data, len) };
    Ok(ImportedTensor { tensor, dtype, shape, device: None })
}

/// `(device_type, device_id)` of an unconsumed `dltensor` capsule (DLPack's codes: 1 CPU, 2 CUDA), or None
/// for anything else.
#[pyfunction]
pub fn capsule_device(capsule: &Bound<'_, PyAny>) -> Option<(i32, i32)> {
    if !is_capsule(capsule) {
        return None;
    }
    // SAFETY: an unconsumed `dltensor` capsule (checked above) holds a DLManagedTensor.
    let managed =
        unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) } as *const DLManagedTensor;
    // SAFETY: the capsule is alive, so its tensor is.
    unsafe { managed.as_ref() }.map(|m| (m.dl_tensor.device.device_type, m.dl_tensor.device.device_id))
}

/// If `capsule` is one of the engine's unconsumed bool capsules, label it uint8 and return true. The
/// caller imports it and views it as bool: NumPy before 1.25 imports no DLPack bool.
#[pyfunction]
pub fn relabel_bool_as_uint8(capsule: &Bound<'_, PyAny>) -> bool {
    if !is_capsule(capsule) {
        return false;
    }
    // SAFETY: an unconsumed `dltensor` capsule (checked above) holds a DLManagedTensor.
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) } as *mut DLManagedTensor;
    // SAFETY: the capsule is alive and unconsumed, so nobody else reads or writes its tensor now.
    let Some(tensor) = (unsafe { managed.as_mut() }).map(|m| &mut m.dl_tensor) else { return false };
    if (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) != (6, 8, 1) {
        return false;
    }
    tensor.dtype = DLDataType { code: 1, bits: 8, lanes: 1 };
    true
}

/// What an exported capsule owns: a host buffer, or a pooled device buffer (back to the pool on delete).
enum ExportedMemory {
    Host(AlignedBuffer),
    Device(PooledBuffer),
}

struct ExportContext {
    memory: ExportedMemory,
    shape: Vec<i64>,
}

unsafe extern "C" fn delete_exported(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` and its manager_ctx were created by Box::into_raw in `export_capsule`, and DLPack
    // guarantees the deleter runs once.
    unsafe {
        let managed = Box::from_raw(managed);
        drop(Box::from_raw(managed.manager_ctx as *mut ExportContext));
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // A consumer that imported the tensor renamed the capsule and owns the deleter call; otherwise we free it.
    // SAFETY: called by Python with the capsule being destroyed.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) != 0 {
            let managed = ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr()) as *mut DLManagedTensor;
            if let Some(deleter) = managed.as_ref().and_then(|m| m.deleter) {
                deleter(managed);
            }
        } else {
            ffi::PyErr_Clear();
        }
    }
}

/// Wrap an engine-owned buffer as a `dltensor` capsule (zero copy).
pub fn export_capsule(py: Python<'_>, buffer: AlignedBuffer, shape: Vec<i64>, dtype: DataType) -> PyResult<PyObject> {
    export(py, ExportedMemory::Host(buffer), shape, dtype)
}

/// Wrap an engine-owned device result as a CUDA `dltensor` capsule (zero copy); deleting it returns the
/// memory to the engine's pool once the work queued on `consumer` (the stream the result is used on; None:
/// unknown) before the deletion is done.
pub fn export_device_capsule(py: Python<'_>, output: DeviceOutput, consumer: Option<usize>) -> PyResult<PyObject> {
    let mut buffer = output.buffer;
    buffer.set_consumer(consumer);
    export(py, ExportedMemory::Device(buffer), output.shape, output.dtype)
}

fn export(py: Python<'_>, memory: ExportedMemory, shape: Vec<i64>, dtype: DataType) -> PyResult<PyObject> {
    let mut ctx = Box::new(ExportContext { memory, shape });
    let (data, device) = match &mut ctx.memory {
        ExportedMemory::Host(buffer) => {
            (buffer.as_mut_ptr() as *mut c_void, DLDevice { device_type: DEVICE_CPU, device_id: 0 })
        }
        ExportedMemory::Device(buffer) => {
            (buffer.ptr().0 as *mut c_void, DLDevice { device_type: DEVICE_CUDA, device_id: buffer.ordinal() })
        }
    };
    let shape_ptr = ctx.shape.as_mut_ptr();
    let ndim = ctx.shape.len() as i32;
    let managed = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data,
            device,
            ndim,
            dtype: dtype_to_dlpack(dtype),
            shape: shape_ptr,
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: Box::into_raw(ctx) as *mut c_void,
        deleter: Some(delete_exported),
    });
    let raw = Box::into_raw(managed);
    // SAFETY: raw is a valid DLManagedTensor; on failure we free it ourselves.
    let capsule = unsafe { ffi::PyCapsule_New(raw as *mut c_void, CAPSULE_NAME.as_ptr(), Some(capsule_destructor)) };
    if capsule.is_null() {
        // SAFETY: the capsule was not created, so nobody else owns raw.
        unsafe { delete_exported(raw) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: PyCapsule_New returned a new strong reference.
    Ok(unsafe { PyObject::from_owned_ptr(py, capsule) })
}
