//! Requests for the coordinator's unit tests: one rank's float32 sum allreduce of a CPU tensor, which a
//! test changes with struct update syntax (`Request { kind, ..allreduce_request(..) }`) where it needs to.

use crate::protocol::message::{Request, CPU_DEVICE};
use crate::types::{CollectiveKind, DataType, ReduceOp};

/// Rank `rank`'s request to sum the float32 CPU tensor `name` of shape `shape`.
pub fn allreduce_request(rank: u32, name: &str, shape: &[i64]) -> Request {
    Request {
        rank,
        kind: CollectiveKind::Allreduce,
        name: name.into(),
        dtype: DataType::Float32,
        shape: shape.to_vec(),
        reduce_op: ReduceOp::Sum,
        root_rank: -1,
        prescale: 1.0,
        postscale: 1.0,
        splits: Vec::new(),
        parts: Vec::new(),
        device: CPU_DEVICE,
    }
}
