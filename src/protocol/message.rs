//! Negotiation messages: what a rank asks for ([`Request`]) and what every rank agrees to run ([`Response`]).
//!
//! A response names one or more tensors (several once fused) and carries everything a rank needs to run
//! the collective without its own request at hand (a joined rank contributes zeros of the right size).

use crate::error::ErrorKind;
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
    /// A grouped allreduce packed into one tensor (see `engine::packed`): the shapes of its tensors in
    /// order, encoded by [`encode_part_shapes`]; `shape` is then the total element count. Empty otherwise.
    pub parts: Vec<i64>,
    /// Where the tensor lives: [`CPU_DEVICE`], or the CUDA device ordinal. Ranks must agree on CPU vs GPU.
    pub device: i32,
}

/// `Request::device` of a tensor in host memory (Horovod's `CPU_DEVICE_ID`).
pub const CPU_DEVICE: i32 = -1;

/// Per-tensor part of a response.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponseEntry {
    pub name: String,
    /// The tensor's shape as submitted (for allgather and alltoall: rank 0's shape; per-rank rows are in `per_rank`).
    pub shape: Vec<i64>,
    /// Allgather: dim 0 of every rank (len n). Alltoall: the n x n splits matrix, row = sender (len n*n).
    /// Empty otherwise.
    pub per_rank: Vec<i64>,
    /// A packed grouped allreduce (its requests carried the members' shapes). Every rank, a joined one
    /// too, runs the same algorithm for it, so this travels with the response.
    pub packed: bool,
}

impl ResponseEntry {
    /// Number of elements of the tensor described by `shape`.
    pub fn num_elements(&self) -> usize {
        shape_elements(&self.shape)
    }

    /// An allgather's contribution of each rank in bytes: its rows times the bytes of one row. The rows come
    /// from each rank's request (a peer's bytes): negative counts count as 0, and products saturate.
    pub fn allgather_bytes_per_rank(&self, dtype: DataType) -> Vec<usize> {
        let row = shape_elements(self.shape.get(1..).unwrap_or(&[])).saturating_mul(dtype.size());
        self.per_rank.iter().map(|&rows| (rows.max(0) as usize).saturating_mul(row)).collect()
    }

    /// An allgather's whole result in bytes, or `None` if it does not fit a `usize` (only rows no real tensor
    /// has, from a corrupt peer: the op then fails on every rank instead of wrapping around).
    pub fn allgather_total_bytes(&self, dtype: DataType) -> Option<usize> {
        self.allgather_bytes_per_rank(dtype).into_iter().try_fold(0usize, usize::checked_add)
    }

    /// An allgather's result shape: every rank's rows (negative counts as 0, as in the sizes; the sum
    /// saturates), then the rows' dimensions.
    pub fn allgather_shape(&self) -> Vec<i64> {
        let mut shape = self.shape.clone();
        if let Some(first) = shape.first_mut() {
            *first = self.per_rank.iter().fold(0i64, |total, &rows| total.saturating_add(rows.max(0)));
        }
        shape
    }
}

/// The shapes of a packed group's tensors as one list: each shape's dimension count, then its dimensions.
pub fn encode_part_shapes<'a>(shapes: impl IntoIterator<Item = &'a [i64]>) -> Vec<i64> {
    let mut encoded = Vec::new();
    for shape in shapes {
        encoded.push(shape.len() as i64);
        encoded.extend_from_slice(shape);
    }
    encoded
}

/// The shapes [`encode_part_shapes`] encoded, or `None` if `encoded` is not such a list (it can come
/// from a peer's bytes).
pub fn decode_part_shapes(encoded: &[i64]) -> Option<Vec<&[i64]>> {
    let mut shapes = Vec::new();
    let mut rest = encoded;
    while let Some((&ndim, tail)) = rest.split_first() {
        let ndim = usize::try_from(ndim).ok().filter(|&n| n <= tail.len())?;
        shapes.push(&tail[..ndim]);
        rest = &tail[ndim..];
    }
    Some(shapes)
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

#[cfg(test)]
impl Response {
    /// A successful response for one tensor named `name` of `elements` values (for tests).
    pub(crate) fn for_one_tensor(kind: CollectiveKind, name: &str, dtype: DataType, elements: i64) -> Response {
        Response {
            kind,
            entries: vec![ResponseEntry { name: name.into(), shape: vec![elements], per_rank: vec![], packed: false }],
            dtype,
            reduce_op: ReduceOp::Sum,
            root_rank: -1,
            prescale: 1.0,
            postscale: 1.0,
            error: None,
            last_joined_rank: -1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_shapes_round_trip_and_malformed_lists_are_refused() {
        let shapes: [&[i64]; 4] = [&[2, 3], &[], &[7], &[1, 1, 1]];
        let encoded = encode_part_shapes(shapes);
        assert_eq!(encoded, vec![2, 2, 3, 0, 1, 7, 3, 1, 1, 1]);
        assert_eq!(decode_part_shapes(&encoded).unwrap(), shapes.to_vec());
        assert_eq!(decode_part_shapes(&[]).unwrap(), Vec::<&[i64]>::new());
        assert!(decode_part_shapes(&[3, 1, 2]).is_none(), "too few dimensions");
        assert!(decode_part_shapes(&[-1]).is_none(), "negative count");
    }

    fn allgather_of(shape: &[i64], per_rank: &[i64]) -> ResponseEntry {
        ResponseEntry { name: "g".into(), shape: shape.to_vec(), per_rank: per_rank.to_vec(), packed: false }
    }

    #[test]
    fn an_allgathers_sizes_and_shape_come_from_every_ranks_rows() {
        let spec = allgather_of(&[2, 3], &[2, 0, 5]);
        assert_eq!(spec.allgather_bytes_per_rank(DataType::Float32), [24, 0, 60]);
        assert_eq!(spec.allgather_total_bytes(DataType::Float32), Some(84));
        assert_eq!(spec.allgather_shape(), [7, 3]);
    }

    #[test]
    fn a_peers_impossible_rows_neither_wrap_nor_panic() {
        // Negative rows count as none, in the sizes and in the shape alike.
        let negative = allgather_of(&[2, 3], &[2, -5]);
        assert_eq!(negative.allgather_bytes_per_rank(DataType::Float32), [24, 0]);
        assert_eq!(negative.allgather_shape(), [2, 3]);
        // Rows whose bytes overflow: sizes saturate, the total is refused, the shape saturates.
        let huge = allgather_of(&[1, 1 << 40], &[i64::MAX, i64::MAX]);
        assert_eq!(huge.allgather_bytes_per_rank(DataType::Float64), [usize::MAX, usize::MAX]);
        assert_eq!(huge.allgather_total_bytes(DataType::Float64), None);
        assert_eq!(huge.allgather_shape(), [i64::MAX, 1 << 40]);
    }
}
