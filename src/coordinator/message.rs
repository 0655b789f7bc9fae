//! Negotiation messages: what a rank asks for ([`Request`]) and what every rank agrees to run ([`Response`]).
//!
//! A response names one or more tensors (several once fused) and carries everything a rank needs to run
//! the collective without its own request at hand (a joined rank contributes zeros of the right size).

use crate::types::{CollectiveKind, DataType, ReduceOp};

/// One rank's announcement that a named tensor is ready for a collective.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Communicator rank that submitted it.
    pub rank: u32,
    pub kind: CollectiveKind,
    pub name: String,
    pub dtype: DataType,
    pub shape: Vec<i64>,
    pub reduce_op: ReduceOp,
    /// Broadcast root as a communicator rank; -1 when not a broadcast.
    pub root_rank: i32,
    pub prescale: f64,
    pub postscale: f64,
    /// Alltoall: rows of dim 0 sent to each rank (empty: split evenly).
    pub splits: Vec<i64>,
}

/// What kind of error a failed negotiation reports; decides the Python exception.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorKind {
    /// Ranks disagree about a tensor (RvodMismatchError).
    Mismatch = 0,
    /// The request itself is not allowed (ValueError-like, e.g. an op not supported with join).
    Invalid = 1,
}

impl ErrorKind {
    pub fn from_code(code: u8) -> Option<ErrorKind> {
        match code {
            0 => Some(ErrorKind::Mismatch),
            1 => Some(ErrorKind::Invalid),
            _ => None,
        }
    }
}

/// Per-tensor part of a response.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponseEntry {
    pub name: String,
    /// The tensor's shape as submitted (for allgather and alltoall: rank 0's shape; per-rank rows are in `per_rank`).
    pub shape: Vec<i64>,
    /// Allgather: dim 0 of every rank (len n). Alltoall: the n x n splits matrix, row = sender (len n*n).
    /// Empty otherwise.
    pub per_rank: Vec<i64>,
}

impl ResponseEntry {
    /// Number of elements of the tensor described by `shape`.
    pub fn num_elements(&self) -> usize {
        shape_elements(&self.shape)
    }
}

/// Elements in a tensor of this shape (1 for a scalar); negative dims count as 0. Saturates instead of
/// overflowing, since shapes can come from a peer's bytes.
pub fn shape_elements(shape: &[i64]) -> usize {
    shape.iter().fold(1usize, |acc, &d| acc.saturating_mul(d.max(0) as usize))
}

/// A collective every rank agreed to run, or an error every rank reports.
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    pub kind: CollectiveKind,
    pub entries: Vec<ResponseEntry>,
    pub dtype: DataType,
    pub reduce_op: ReduceOp,
    pub root_rank: i32,
    pub prescale: f64,
    pub postscale: f64,
    /// Set when negotiation failed: every rank fails these tensors with this message.
    pub error: Option<(ErrorKind, String)>,
    /// Join: the communicator rank that joined last. -1 otherwise.
    pub last_joined_rank: i32,
}

impl Response {
    /// Bytes of this response's tensors on one rank (allreduce-style: the full tensor).
    pub fn tensor_bytes(&self) -> usize {
        self.entries
            .iter()
            .fold(0usize, |acc, e| acc.saturating_add(e.num_elements().saturating_mul(self.dtype.size())))
    }
}
