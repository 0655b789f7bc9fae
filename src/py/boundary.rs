//! The numbers that cross the Python boundary, exported from their one source ([`crate::types`]).
//!
//! `rvod.common` takes collective kinds, reduce-op codes and dtype codes from these name -> code
//! dictionaries instead of copying them by hand; `rvod.common.reduce_ops` keeps Horovod's public constants
//! and checks them against `REDUCE_OPS` at import.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::types::{CollectiveKind, DataType, ReduceOp};

/// Adds `COLLECTIVE_KINDS`, `REDUCE_OPS` and `DTYPES` (each a dict name -> code) to the module.
pub fn add_codes(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let kinds = PyDict::new(py);
    for kind in (0..=u8::MAX).filter_map(CollectiveKind::from_code) {
        kinds.set_item(kind.name(), kind.code())?;
    }
    let reduce_ops = PyDict::new(py);
    for op in (0..=u8::MAX).filter_map(ReduceOp::from_code) {
        reduce_ops.set_item(op.name(), op.code())?;
    }
    let dtypes = PyDict::new(py);
    for dtype in DataType::ALL {
        dtypes.set_item(dtype.name(), dtype.code())?;
    }
    m.add("COLLECTIVE_KINDS", kinds)?;
    m.add("REDUCE_OPS", reduce_ops)?;
    m.add("DTYPES", dtypes)?;
    Ok(())
}
