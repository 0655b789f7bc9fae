//! Requests for the coordinator's unit tests: one rank's float32 sum allreduce of a CPU tensor, which a
//! test changes with [`changed`] where it needs to.

use crate::protocol::message::{OpParams, Request};
use crate::types::{CollectiveKind, DataType};

/// Rank `rank`'s request to sum the float32 CPU tensor `name` of shape `shape`.
pub fn allreduce_request(rank: u32, name: &str, shape: &[i64]) -> Request {
    let params = OpParams::new(CollectiveKind::Allreduce).for_tensor(DataType::Float32, shape.to_vec(), Vec::new());
    Request { rank, name: name.into(), params }
}

/// `request` with its parameters changed by `change`.
pub fn changed(mut request: Request, change: impl FnOnce(&mut OpParams)) -> Request {
    change(&mut request.params);
    request
}
