//! Negotiation messages: what a rank asks for ([`Request`]) and what every rank agrees to run ([`Response`]).
//!
//! A request is a rank, a tensor name and the op's parameters for that tensor ([`OpParams`]), the one
//! description of an op's parameters in the crate: the response cache compares it, the fast lane owns one,
//! and a submission holds the settings its tensors share in one.
//!
//! A response names one or more tensors (several once fused) and carries everything a rank needs to run
//! the collective without its own request at hand (a joined rank contributes zeros of the right size).

use crate::error::ErrorKind;
use crate::types::{CollectiveKind, Compression, DataType, ReduceOp};

/// One rank's announcement that a named tensor is ready for a collective.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Communicator rank that submitted it.
    pub rank: u32,
    pub name: String,
    pub params: OpParams,
}

/// An op's parameters for one tensor: everything a rank says about it besides its name. The one description
/// that requests, the response cache (a hit requires equal parameters), the fast lane (`engine::fast_lane`,
/// borrowing it) and submissions (`engine::submission`) share.
#[derive(Clone, Debug)]
pub struct OpParams {
    pub kind: CollectiveKind,
    pub dtype: DataType,
    pub shape: Vec<i64>,
    pub reduce_op: ReduceOp,
    /// Broadcast root as a communicator rank; -1 when not a broadcast.
    pub root_rank: i32,
    pub prescale: f64,
    pub postscale: f64,
    /// Alltoall: rows of dim 0 sent to each rank (empty: split evenly).
    pub splits: Vec<i64>,
    /// A grouped allreduce packed into one tensor (see `fusion::packed_group`): the shapes of its tensors in
    /// order, encoded by [`encode_part_shapes`]; `shape` is then the total element count. Empty otherwise.
    pub parts: Vec<i64>,
    /// Where the tensor lives: [`CPU_DEVICE`], or the CUDA device ordinal. Ranks must agree on CPU vs GPU.
    pub device: i32,
    /// How an allreduce's tensor travels (every rank must agree).
    pub compression: Compression,
}

/// `OpParams::device` of a tensor in host memory (Horovod's `CPU_DEVICE_ID`).
pub const CPU_DEVICE: i32 = -1;

impl OpParams {
    /// A `kind` op with the default settings (a sum, no scaling, no root, an even split) and no tensor
    /// (uint8, no dimensions, in host memory).
    pub fn new(kind: CollectiveKind) -> OpParams {
        OpParams {
            kind,
            dtype: DataType::Uint8,
            shape: Vec::new(),
            reduce_op: ReduceOp::Sum,
            root_rank: -1,
            prescale: 1.0,
            postscale: 1.0,
            splits: Vec::new(),
            parts: Vec::new(),
            device: CPU_DEVICE,
            compression: Compression::None,
        }
    }

    /// These settings without their tensor's description (`dtype`, `shape`, `parts` as in [`OpParams::new`]):
    /// what an op of several tensors shares.
    pub fn without_tensor(&self) -> OpParams {
        OpParams {
            kind: self.kind,
            reduce_op: self.reduce_op,
            root_rank: self.root_rank,
            prescale: self.prescale,
            postscale: self.postscale,
            splits: self.splits.clone(),
            device: self.device,
            compression: self.compression,
            ..OpParams::new(self.kind)
        }
    }

    /// These settings for one tensor of `dtype` and `shape` (`parts`: a packed group's, else empty).
    pub fn for_tensor(&self, dtype: DataType, shape: Vec<i64>, parts: Vec<i64>) -> OpParams {
        OpParams { dtype, shape, parts, ..self.without_tensor() }
    }
}

/// Equal in every field (floats by `==`, so a NaN scale never matches): what a response cache hit requires.
impl PartialEq for OpParams {
    fn eq(&self, other: &OpParams) -> bool {
        // Destructured, so a new field cannot be left out of the comparison.
        let OpParams {
            kind,
            dtype,
            shape,
            reduce_op,
            root_rank,
            prescale,
            postscale,
            splits,
            parts,
            device,
            compression,
        } = self;
        *kind == other.kind
            && *dtype == other.dtype
            && same_dims(shape, &other.shape)
            && *reduce_op == other.reduce_op
            && *root_rank == other.root_rank
            && *prescale == other.prescale
            && *postscale == other.postscale
            && same_dims(splits, &other.splits)
            && same_dims(parts, &other.parts)
            && *device == other.device
            && *compression == other.compression
    }
}

/// `a == b`, without calling `memcmp` on empty lists: glibc's AVX-512 `memcmp` reads through a masked load
/// even for zero bytes, and at an empty `Vec`'s dangling address that costs a microcode assist (~150 ns,
/// measured; a barrier's whole cache lookup is a few nanoseconds without it).
fn same_dims(a: &[i64], b: &[i64]) -> bool {
    a.len() == b.len() && (a.is_empty() || a == b)
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
    /// The tensors are on GPUs (each rank's own: the ordinal is a rank's business, not the response's).
    /// Every rank, a joined one too, runs it on its process set's GPU route (`engine::execute_device`); GPU
    /// and host tensors are never fused together.
    pub on_gpu: bool,
    /// An allreduce's compression; tensors of different compressions are never fused together.
    pub compression: Compression,
}

impl Response {
    /// The response to the requests for tensor `name` made with `params` (the first rank's): one entry of
    /// their shape, with `per_rank`, packed when they carry a group's parts; no error.
    pub fn for_params(name: String, params: &OpParams, per_rank: Vec<i64>) -> Response {
        Response {
            kind: params.kind,
            entries: vec![ResponseEntry {
                name,
                shape: params.shape.clone(),
                per_rank,
                packed: !params.parts.is_empty(),
            }],
            dtype: params.dtype,
            reduce_op: params.reduce_op,
            root_rank: params.root_rank,
            prescale: params.prescale,
            postscale: params.postscale,
            error: None,
            last_joined_rank: -1,
            on_gpu: params.device != CPU_DEVICE,
            compression: params.compression,
        }
    }

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
            on_gpu: false,
            compression: Compression::None,
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
