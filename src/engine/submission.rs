//! What a caller hands the engine (an [`OpSubmission`]) and what it gets back ([`OpOutput`]).

use crate::fusion::packed_group::PackedGroup;
use crate::protocol::message::OpParams;
use crate::tensor::{OutputTensor, RawTensor};
use crate::types::{CollectiveKind, DataType};

/// One tensor of a collective.
#[derive(Debug)]
pub struct TensorSubmission {
    /// Name matched across ranks.
    pub name: String,
    pub dtype: DataType,
    pub shape: Vec<i64>,
    /// Caller-owned input (for in-place ops also the output).
    pub input: RawTensor,
    /// Write the result into `input` instead of a new buffer (`allreduce_`, `broadcast_`).
    pub in_place: bool,
    /// Set when this tensor is a packed grouped allreduce (`input` views its buffer): see [`PackedGroup`].
    pub packed: Option<PackedGroup>,
}

impl TensorSubmission {
    /// Output slots this tensor fills: one, or one per member of a packed group.
    pub fn output_slots(&self) -> usize {
        self.packed.as_ref().map_or(1, PackedGroup::len)
    }
}

/// A collective as submitted by one rank: one tensor, a group of tensors negotiated together, or none
/// (barrier, join).
#[derive(Debug)]
pub struct OpSubmission {
    /// The settings its tensors share (see [`OpParams::without_tensor`]; each tensor's dtype and shape are
    /// its own, in `tensors`). A broadcast's root is a global rank here, a communicator rank once submitted.
    pub params: OpParams,
    pub tensors: Vec<TensorSubmission>,
}

impl OpSubmission {
    /// A submission of `kind` with default reduction settings and no tensors.
    pub fn new(kind: CollectiveKind) -> OpSubmission {
        OpSubmission { params: OpParams::new(kind), tensors: Vec::new() }
    }
}

/// Everything a completed op returns.
#[derive(Debug, Default)]
pub struct OpOutput {
    /// One slot per submitted tensor; `None` where the result was written in place.
    pub tensors: Vec<Option<OutputTensor>>,
    /// Alltoall: rows received from each rank.
    pub received_splits: Option<Vec<i64>>,
    /// Join: the rank that joined last.
    pub last_joined_rank: Option<i32>,
}
