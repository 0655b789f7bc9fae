//! What a caller hands the engine (an [`OpSubmission`]) and what it gets back ([`OpOutput`]).

use crate::fusion::packed_group::PackedGroup;
use crate::gpu::tensor::{DeviceDone, DeviceInput, DeviceOutput};
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
    /// Set for a tensor in GPU memory: `input` is then empty, and the engine reads the device memory in
    /// stream order when the op runs.
    pub device: Option<DeviceInput>,
    /// Caller-owned host memory the result is written into instead of a new buffer (a reducescatter's
    /// block, `reducescatter_async(..., output=)`): exactly the result's bytes.
    pub into: Option<RawTensor>,
}

impl TensorSubmission {
    /// Bytes of its data: in host memory, on the device, or a packed group's.
    pub fn data_len(&self) -> usize {
        match (&self.device, &self.packed) {
            (Some(device), _) => device.len,
            (None, Some(group)) => group.len_bytes(),
            (None, None) => self.input.len(),
        }
    }

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
    /// One slot per submitted tensor: the out-of-place result of a tensor on a GPU (`tensors` holds `None`
    /// there).
    pub device_tensors: Vec<Option<DeviceOutput>>,
    /// The events after which the op's device results are written (one per GPU response it took part in).
    pub done: Vec<DeviceDone>,
}
