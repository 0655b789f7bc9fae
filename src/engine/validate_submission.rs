//! Argument checks made when an op is submitted, before anything is sent: errors here are the caller's
//! mistake and leave the engine untouched.

use crate::engine::submission::OpSubmission;
use crate::error::EngineError;
use crate::protocol::message::shape_elements;
use crate::types::{CollectiveKind, ReduceOp};

pub fn check(op: &OpSubmission, size: usize) -> Result<(), EngineError> {
    let p = &op.params;
    let invalid = |m: String| Err(EngineError::InvalidArgument(m));
    let needs_tensors = !matches!(p.kind, CollectiveKind::Barrier | CollectiveKind::Join);
    if needs_tensors && op.tensors.is_empty() {
        return invalid(format!("{} needs at least one tensor", p.kind));
    }
    if !needs_tensors && !op.tensors.is_empty() {
        return invalid(format!("{} takes no tensors", p.kind));
    }
    for t in &op.tensors {
        if t.name.is_empty() {
            return invalid(format!("{}: tensor names must not be empty", p.kind));
        }
        let expected = shape_elements(&t.shape) * t.dtype.size();
        let have = t.data_len();
        if have != expected {
            return Err(EngineError::Internal(format!(
                "tensor '{}' has {have} bytes but shape {:?} of {} needs {expected}",
                t.name, t.shape, t.dtype
            )));
        }
    }
    if p.kind == CollectiveKind::Allreduce && p.reduce_op == ReduceOp::Adasum {
        if let Some(t) = op.tensors.iter().find(|t| !t.dtype.is_float()) {
            return invalid(format!(
                "Adasum reduces only floating-point tensors (float16, bfloat16, float32, float64); tensor '{}' is {}",
                t.name, t.dtype
            ));
        }
        if op.tensors.iter().any(|t| t.packed.is_some()) {
            // Adasum needs each tensor's bounds on every rank; a grouped Adasum is submitted tensor by tensor.
            return invalid("a grouped Adasum allreduce must be submitted as separate tensors, not packed".into());
        }
    }
    if !p.compression.is_none() {
        check_compression(op)?;
    }
    if !p.prescale.is_finite() || !p.postscale.is_finite() {
        return invalid(format!("{}: prescale and postscale factors must be finite numbers", p.kind));
    }
    match p.kind {
        CollectiveKind::Reducescatter => {
            if !matches!(p.reduce_op, ReduceOp::Sum | ReduceOp::Average) {
                return invalid(format!("Reducescatter currently only supports Average and Sum, not {}.", p.reduce_op));
            }
            if op.tensors.iter().any(|t| t.shape.is_empty()) {
                return invalid("reducescatter needs a tensor with at least one dimension, got a scalar".into());
            }
        }
        CollectiveKind::Allgather if op.tensors.iter().any(|t| t.shape.is_empty()) => {
            return invalid("allgather needs a tensor with at least one dimension, got a scalar".into());
        }
        CollectiveKind::Broadcast if p.root_rank < 0 || p.root_rank as usize >= size => {
            return invalid(format!("broadcast root_rank {} is not a rank of this job (size {size})", p.root_rank));
        }
        CollectiveKind::Alltoall => {
            for t in &op.tensors {
                let Some(&dim0) = t.shape.first() else {
                    return invalid("alltoall needs a tensor with at least one dimension, got a scalar".into());
                };
                if p.splits.is_empty() {
                    if dim0 % size as i64 != 0 {
                        return invalid(
                            "splits not provided, but first dimension of tensor is not an even multiple of the number of workers."
                                .into(),
                        );
                    }
                } else {
                    if p.splits.len() != size {
                        return invalid(format!(
                            "Number of entries in splits ({}) does not equal number of workers ({size}).",
                            p.splits.len()
                        ));
                    }
                    if p.splits.iter().any(|&s| s < 0) {
                        return invalid("alltoall splits must not be negative.".into());
                    }
                    // Checked: splits near i64::MAX would wrap to a small sum in a release build.
                    let total = p.splits.iter().try_fold(0i64, |sum, &s| sum.checked_add(s));
                    if total.map_or(true, |total| total > dim0) {
                        return invalid("Sum of splits entries is greater than the first dimension of tensor.".into());
                    }
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// A compressed op: an allreduce that sums or averages floating-point tensors submitted one by one (each
/// tensor's error feedback and PowerSGD factors are kept by its name).
fn check_compression(op: &OpSubmission) -> Result<(), EngineError> {
    let p = &op.params;
    let compression = p.compression;
    if p.kind != CollectiveKind::Allreduce || !matches!(p.reduce_op, ReduceOp::Sum | ReduceOp::Average) {
        let what =
            if p.kind == CollectiveKind::Allreduce { format!("{} allreduce", p.reduce_op) } else { p.kind.to_string() };
        return Err(EngineError::InvalidArgument(format!(
            "{compression} compression applies to Sum and Average allreduces, not to {what}"
        )));
    }
    if let Some(t) = op.tensors.iter().find(|t| !t.dtype.is_float()) {
        return Err(EngineError::InvalidArgument(format!(
            "{compression} compression applies to floating-point tensors (float16, bfloat16, float32, float64); \
             tensor '{}' is {}",
            t.name, t.dtype
        )));
    }
    if op.tensors.iter().any(|t| t.packed.is_some()) {
        return Err(EngineError::InvalidArgument(format!(
            "a grouped allreduce with {compression} compression must be submitted as separate tensors, not packed"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::submission::TensorSubmission;
    use crate::tensor::RawTensor;
    use crate::types::DataType;

    fn alltoall(data: &mut [u8], rows: i64, splits: Vec<i64>) -> OpSubmission {
        let mut op = OpSubmission::new(CollectiveKind::Alltoall);
        // SAFETY: `data` outlives the submission, which is only checked, never run.
        let input = unsafe { RawTensor::new(data.as_mut_ptr(), data.len()) };
        op.tensors.push(TensorSubmission {
            name: "a2a".into(),
            dtype: DataType::Uint8,
            shape: vec![rows],
            input,
            in_place: false,
            packed: None,
            device: None,
            into: None,
        });
        op.params.splits = splits;
        op
    }

    #[test]
    fn alltoall_splits_that_overflow_are_refused() {
        let mut data = vec![0u8; 4];
        assert!(check(&alltoall(&mut data, 4, vec![1, 3]), 2).is_ok());
        let err = check(&alltoall(&mut data, 4, vec![i64::MAX, i64::MAX]), 2).unwrap_err().to_string();
        assert!(err.contains("Sum of splits entries is greater than the first dimension"), "{err}");
        let err = check(&alltoall(&mut data, 4, vec![i64::MAX, 3]), 2).unwrap_err().to_string();
        assert!(err.contains("Sum of splits entries"), "{err}");
    }
}
