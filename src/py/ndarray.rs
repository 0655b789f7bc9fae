//! Exact `numpy.ndarray`s read straight from NumPy's array struct: the fastest way in.
//!
//! Even the buffer protocol costs NumPy a format string and a cache lookup per array (~0.15 us); a grouped
//! allreduce of a thousand gradients paid more for that than for anything else it did before the engine.
//! NumPy's C API exposes an array's data pointer, dimensions, flags and dtype as fields of its object
//! struct (`PyArray_DATA`, `PyArray_NDIM`, ... are field reads), a layout NumPy keeps stable for compiled
//! extensions (1.x and 2.x agree on every field read here). rvod compiles against no NumPy headers, so it
//! trusts its reading of that layout only after checking it once per process against the buffer
//! protocol's answer for a real array; if they ever disagree, every array goes through the buffer
//! protocol instead. Only objects whose type is exactly `numpy.ndarray` are read at all (an array's
//! memory cannot move while it is referenced, so no view of it needs to be held).
//!
//! Results come out the same way: [`empty_like`] makes a new array through NumPy's C API (its function
//! table, `_ARRAY_API`, whose slots NumPy keeps stable across versions), checked once per process against
//! what `numpy.empty_like` makes, with `numpy.empty_like` itself as the fallback.

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicU8, Ordering};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyType;

use crate::py::buffer::import_buffer;
use crate::py::dlpack::ImportedTensor;
use crate::tensor::RawTensor;
use crate::types::DataType;

/// The head of NumPy's `PyArrayObject_fields`.
#[repr(C)]
struct ArrayFields {
    head: ffi::PyObject,
    data: *mut u8,
    nd: c_int,
    dimensions: *const ffi::Py_ssize_t,
    strides: *const ffi::Py_ssize_t,
    base: *mut ffi::PyObject,
    descr: *const DescrFields,
    flags: c_int,
}

/// The head of NumPy's `PyArray_Descr` (type_num's place is fixed: NumPy 2 kept a spare byte for it).
#[repr(C)]
struct DescrFields {
    head: ffi::PyObject,
    typeobj: *mut c_void,
    kind: c_char,
    type_char: c_char,
    byteorder: c_char,
    former_flags: c_char,
    type_num: c_int,
}

const NPY_ARRAY_C_CONTIGUOUS: c_int = 0x0001;
const NPY_ARRAY_WRITEABLE: c_int = 0x0400;

const LAYOUT_UNCHECKED: u8 = 0;
const LAYOUT_TRUSTED: u8 = 1;
const LAYOUT_REFUSED: u8 = 2;
static LAYOUT: AtomicU8 = AtomicU8::new(LAYOUT_UNCHECKED);

static NDARRAY_TYPE: GILOnceCell<Option<Py<PyType>>> = GILOnceCell::new();

fn is_exact_ndarray(object: &Bound<'_, PyAny>) -> bool {
    let py = object.py();
    let ndarray = NDARRAY_TYPE.get_or_init(py, || {
        let found = py.import("numpy").and_then(|numpy| numpy.getattr("ndarray"));
        found.ok().and_then(|t| t.downcast_into::<PyType>().ok()).map(Bound::unbind)
    });
    matches!(ndarray, Some(t) if object.get_type().is(t.bind(py)))
}

/// The engine's type for NumPy's type number (native byte order), if it is one.
fn dtype_from_type_num(type_num: c_int) -> Option<DataType> {
    let long = if std::mem::size_of::<std::ffi::c_long>() == 8 { DataType::Int64 } else { DataType::Int32 };
    Some(match type_num {
        0 => DataType::Bool,
        1 => DataType::Int8,
        2 => DataType::Uint8,
        3 => DataType::Int16,
        4 => DataType::Uint16,
        5 => DataType::Int32,
        7 => long,
        9 => DataType::Int64,
        11 => DataType::Float32,
        12 => DataType::Float64,
        23 => DataType::Float16,
        _ => return None,
    })
}

/// Read an exact ndarray from its struct. Errors are `ValueError`s, as `import_buffer`'s.
fn read_fields(array: &Bound<'_, PyAny>, writable: bool, what: &impl Fn() -> String) -> PyResult<ImportedTensor> {
    // SAFETY: the caller checked that `array`'s type is exactly numpy.ndarray, whose instances start with
    // these fields; the GIL is held, so nothing changes them while they are read.
    let fields = unsafe { &*(array.as_ptr() as *const ArrayFields) };
    // SAFETY: every ndarray has a dtype.
    let descr = unsafe { &*fields.descr };
    let native = matches!(descr.byteorder as u8, b'=' | b'|')
        || (cfg!(target_endian = "little") && descr.byteorder as u8 == b'<');
    let dtype = match dtype_from_type_num(descr.type_num) {
        Some(dtype) if native => dtype,
        _ => return Err(PyValueError::new_err(format!("{}: not an array type the engine reads as it is", what()))),
    };
    if fields.flags & NPY_ARRAY_C_CONTIGUOUS == 0 || (writable && fields.flags & NPY_ARRAY_WRITEABLE == 0) {
        return Err(PyValueError::new_err(format!(
            "{}: not a C-contiguous{} array",
            what(),
            if writable { " writable" } else { "" }
        )));
    }
    let ndim = usize::try_from(fields.nd).unwrap_or(0);
    let shape: Vec<i64> = if ndim == 0 {
        Vec::new()
    } else {
        // SAFETY: an ndarray's `dimensions` holds `nd` sizes.
        unsafe { std::slice::from_raw_parts(fields.dimensions, ndim) }.iter().map(|&d| d as i64).collect()
    };
    let len = shape.iter().map(|&d| d as usize).product::<usize>() * dtype.size();
    let data = if len == 0 { std::ptr::null_mut() } else { fields.data };
    // SAFETY: a C-contiguous ndarray's data holds `len` bytes while the array lives, which the caller
    // guarantees until the op completes.
    let tensor = unsafe { RawTensor::new(data, len) };
    Ok(ImportedTensor { tensor, dtype, shape, device: None })
}

fn same(a: &ImportedTensor, b: &ImportedTensor) -> bool {
    a.dtype == b.dtype
        && a.shape == b.shape
        && a.tensor.len() == b.tensor.len()
        && a.tensor.as_slice().as_ptr() == b.tensor.as_slice().as_ptr()
}

/// Read an exact `numpy.ndarray` (anything else is a `TypeError`): from its struct once that reading has
/// been checked, through the buffer protocol until then (or for good if the check failed). `writable`: the
/// op writes its result into it.
pub fn import_array(array: &Bound<'_, PyAny>, writable: bool, what: impl Fn() -> String) -> PyResult<ImportedTensor> {
    if !is_exact_ndarray(array) {
        return Err(PyTypeError::new_err(format!("{}: expected a DLPack capsule or a numpy.ndarray", what())));
    }
    let layout = LAYOUT.load(Ordering::Relaxed);
    if layout == LAYOUT_REFUSED {
        return import_buffer(array, writable, what);
    }
    if layout == LAYOUT_TRUSTED {
        return read_fields(array, writable, &what);
    }
    let by_buffer = import_buffer(array, writable, &what)?;
    match read_fields(array, writable, &what) {
        Ok(by_fields) if same(&by_fields, &by_buffer) => LAYOUT.store(LAYOUT_TRUSTED, Ordering::Relaxed),
        _ => {
            tracing::warn!(
                "NumPy's array struct is not laid out as expected; arrays are read through the buffer protocol"
            );
            LAYOUT.store(LAYOUT_REFUSED, Ordering::Relaxed);
        }
    }
    Ok(by_buffer)
}

/// `PyArray_NewLikeArray(prototype, order, descr, subok)`: slot 277 of NumPy's C API table since NumPy 1.6.
type NewLikeArray = unsafe extern "C" fn(*mut ffi::PyObject, c_int, *mut c_void, c_int) -> *mut ffi::PyObject;
const NEW_LIKE_ARRAY_SLOT: usize = 277;
const NPY_CORDER: c_int = 0;

/// NumPy's C API table, found once (None where it cannot be found or its arrays were refused once).
static ARRAY_API: GILOnceCell<Option<usize>> = GILOnceCell::new();
static CREATION: AtomicU8 = AtomicU8::new(LAYOUT_UNCHECKED);

fn array_api(py: Python<'_>) -> Option<*const *const c_void> {
    let table = ARRAY_API.get_or_init(py, || {
        let module = py.import("numpy._core._multiarray_umath").or_else(|_| py.import("numpy.core._multiarray_umath"));
        let capsule = module.and_then(|m| m.getattr("_ARRAY_API")).ok()?;
        let capsule = capsule.downcast::<pyo3::types::PyCapsule>().ok()?;
        let table = capsule.pointer();
        (!table.is_null()).then_some(table as usize)
    });
    table.map(|t| t as *const *const c_void)
}

/// A new, uninitialised, C-contiguous array with the dtype and shape of `prototype` (an exact ndarray):
/// `numpy.empty_like(prototype)` without the call through Python. Returns it with its memory.
pub fn empty_like<'py>(prototype: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, RawTensor)> {
    let py = prototype.py();
    let what = || "result array".to_string();
    let api = array_api(py).filter(|_| CREATION.load(Ordering::Relaxed) != LAYOUT_REFUSED);
    if let Some(api) = api {
        // SAFETY: `api` is NumPy's function table (a capsule NumPy exports for compiled extensions); the slot
        // holds PyArray_NewLikeArray, whose signature has not changed since NumPy 1.6. `prototype` is an
        // ndarray; a null descr keeps its dtype; the result is a new reference or null with an exception set.
        let made = unsafe {
            let new_like: NewLikeArray = std::mem::transmute(*api.add(NEW_LIKE_ARRAY_SLOT));
            let raw = new_like(prototype.as_ptr(), NPY_CORDER, std::ptr::null_mut(), 0);
            Bound::from_owned_ptr_or_err(py, raw)
        };
        if let Ok(array) = made {
            if CREATION.load(Ordering::Relaxed) == LAYOUT_TRUSTED {
                let memory = import_array(&array, true, what)?;
                return Ok((array, memory.tensor));
            }
            let expected = import_array(prototype, false, what)?;
            match import_array(&array, true, what) {
                Ok(got) if got.dtype == expected.dtype && got.shape == expected.shape => {
                    CREATION.store(LAYOUT_TRUSTED, Ordering::Relaxed);
                    return Ok((array, got.tensor));
                }
                _ => {}
            }
        }
        tracing::warn!("NumPy's C API did not make the expected array; results are made by numpy.empty_like");
        CREATION.store(LAYOUT_REFUSED, Ordering::Relaxed);
    }
    let array = py.import("numpy")?.getattr("empty_like")?.call1((prototype,))?;
    let memory = import_array(&array, true, what)?;
    Ok((array, memory.tensor))
}

static NUMPY_EMPTY: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

/// A new, uninitialised, C-contiguous array of `shape` with the dtype of `prototype` (an exact ndarray), for a
/// result whose shape is not the input's (an allgather's): `numpy.empty(shape, prototype.dtype)`. Returns it
/// with its memory.
pub fn empty_shaped<'py>(prototype: &Bound<'py, PyAny>, shape: &[i64]) -> PyResult<(Bound<'py, PyAny>, RawTensor)> {
    let py = prototype.py();
    let empty = NUMPY_EMPTY.get_or_try_init(py, || py.import("numpy")?.getattr("empty").map(Bound::unbind))?;
    let array = empty.bind(py).call1((shape.to_vec(), prototype.getattr(pyo3::intern!(py, "dtype"))?))?;
    let memory = import_array(&array, true, || "result array".to_string())?;
    Ok((array, memory.tensor))
}
