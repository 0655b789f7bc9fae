//! Arrays read through the buffer protocol, without a DLPack capsule per array.
//!
//! `np.ndarray.__dlpack__` costs about as much as the rest of a small collective (a capsule, a managed
//! tensor, a shape copy, all freed again afterwards); a grouped allreduce of a thousand arrays spent most
//! of its submission there. `PyObject_GetBuffer` gives the same facts (pointer, shape, item type,
//! contiguity, writability) from C with no Python object made.
//!
//! Only for exact `numpy.ndarray`s (see `ndarray`): the view is released as soon as it is read, because the
//! caller keeps the array alive until the op completes and an ndarray's memory does not move while it is
//! referenced (NumPy refuses to resize an array others refer to). The buffer functions are declared here
//! because pyo3 only offers them to abi3 builds for Python 3.11+; they and `Py_buffer`'s layout are the
//! same in 3.10, and Python 3.11 made them part of the stable ABI as they are.

use std::ffi::{c_char, c_int, c_void, CStr};

use pyo3::exceptions::PyValueError;
use pyo3::ffi::{self, PyObject, Py_ssize_t};
use pyo3::prelude::*;

use crate::py::dlpack::ImportedTensor;
use crate::tensor::RawTensor;
use crate::types::DataType;

#[repr(C)]
struct PyBuffer {
    buf: *mut c_void,
    obj: *mut PyObject,
    len: Py_ssize_t,
    itemsize: Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut Py_ssize_t,
    strides: *mut Py_ssize_t,
    suboffsets: *mut Py_ssize_t,
    internal: *mut c_void,
}

const PYBUF_WRITABLE: c_int = 0x0001;
const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

extern "C" {
    fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut PyBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBuffer);
}

/// Read a C-contiguous array through the buffer protocol (`writable`: the op writes its result into it).
/// Errors are `ValueError`s naming `what`; the caller then exports the array the careful way, which
/// copies what it can and explains the rest.
pub fn import_buffer(array: &Bound<'_, PyAny>, writable: bool, what: impl Fn() -> String) -> PyResult<ImportedTensor> {
    let mut view = std::mem::MaybeUninit::<PyBuffer>::zeroed();
    let flags = PYBUF_C_CONTIGUOUS | PYBUF_FORMAT | if writable { PYBUF_WRITABLE } else { 0 };
    // SAFETY: `array` is a live object and `view` has room for a Py_buffer.
    if unsafe { PyObject_GetBuffer(array.as_ptr(), view.as_mut_ptr(), flags) } != 0 {
        // SAFETY: the failed call set a Python error, which the careful path makes its own.
        unsafe { ffi::PyErr_Clear() };
        return Err(PyValueError::new_err(format!(
            "{}: not a C-contiguous{} array",
            what(),
            if writable { " writable" } else { "" }
        )));
    }
    // SAFETY: PyObject_GetBuffer succeeded, so the view is filled in and must be released exactly once.
    let mut view = unsafe { view.assume_init() };
    let read = read_view(&view, &what);
    // SAFETY: obtained above, released once; the array itself stays alive with the caller.
    unsafe { PyBuffer_Release(&mut view) };
    read
}

fn read_view(view: &PyBuffer, what: &impl Fn() -> String) -> PyResult<ImportedTensor> {
    let format: &[u8] = if view.format.is_null() {
        b"B"
    } else {
        // SAFETY: with PYBUF_FORMAT the exporter gives a NUL-terminated struct-module format string.
        unsafe { CStr::from_ptr(view.format) }.to_bytes()
    };
    let itemsize = usize::try_from(view.itemsize).unwrap_or(0);
    let dtype = DataType::from_struct_format(format, itemsize).ok_or_else(|| {
        PyValueError::new_err(format!(
            "{}: item format {:?} is not one the engine exchanges",
            what(),
            String::from_utf8_lossy(format)
        ))
    })?;
    let ndim = usize::try_from(view.ndim).unwrap_or(0);
    let shape: Vec<i64> = if ndim == 0 || view.shape.is_null() {
        Vec::new()
    } else {
        // SAFETY: with PYBUF_ND the exporter gives `ndim` dimensions.
        unsafe { std::slice::from_raw_parts(view.shape, ndim) }.iter().map(|&d| d as i64).collect()
    };
    let len = usize::try_from(view.len).unwrap_or(0);
    let elements: usize = shape.iter().map(|&d| d as usize).product();
    if elements * dtype.size() != len {
        return Err(PyValueError::new_err(format!("{}: buffer of {len} bytes for shape {shape:?}", what())));
    }
    let data = if len == 0 { std::ptr::null_mut() } else { view.buf as *mut u8 };
    // SAFETY: the exporter's memory holds `len` bytes while the array lives, which the caller guarantees
    // until the op completes (and writes to it only through the op when `writable`).
    let tensor = unsafe { RawTensor::new(data, len) };
    Ok(ImportedTensor { tensor, dtype, shape, device: None })
}
