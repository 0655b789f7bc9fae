//! One tensor of a fused buffer seen from the executor ([`TensorIo`]): where its contribution comes from and
//! where its result goes, both piece by piece at offsets within the tensor. The contribution is the caller's
//! input, a packed group's tensors, or zeros (a joined rank); the result goes into the caller's memory
//! (in-place ops), a new buffer, a packed group's tensors, or nowhere. Pieces may come in any order and need
//! not follow element or member bounds; an in-place tensor's piece is read before its result is written.

use crate::fusion::packed_group::PackedGroup;
use crate::tensor::{AlignedBuffer, OutputTensor, RawTensor};
use crate::types::DataType;

/// The memory behind one tensor of a fused op on this rank.
pub enum TensorMemory<'a> {
    /// A joined rank: contributes zeros and wants no result.
    Joined,
    /// A caller's tensor: read from `input`; the result is written into it (`in_place`) or into a new tensor
    /// of `shape`.
    Plain { input: &'a mut RawTensor, in_place: bool, shape: &'a [i64] },
    /// A packed group's tensors.
    Packed(&'a mut PackedGroup),
}

/// What a tensor produced once its result was written.
pub enum Produced {
    /// Its result is where the caller wants it (in place), or nobody wants one (a joined rank).
    InPlace,
    /// A new tensor.
    Tensor(OutputTensor),
    /// A packed group: each member's (output slot, result), `None` where written in place.
    Members(Vec<(usize, Option<OutputTensor>)>),
}

pub struct TensorIo<'a> {
    memory: TensorMemory<'a>,
    /// The new result of an out-of-place plain tensor, allocated at the first write.
    fresh: Option<AlignedBuffer>,
    len: usize,
    dtype: DataType,
}

impl<'a> TensorIo<'a> {
    /// The tensor of `len` bytes in `memory`.
    pub fn new(memory: TensorMemory<'a>, len: usize, dtype: DataType) -> TensorIo<'a> {
        TensorIo { memory, fresh: None, len, dtype }
    }

    /// Fill `dst` with this rank's contribution at `offset`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        match &self.memory {
            TensorMemory::Joined => dst.fill(0),
            TensorMemory::Packed(group) => group.gather(offset, dst),
            TensorMemory::Plain { input, .. } => dst.copy_from_slice(&input.as_slice()[offset..offset + dst.len()]),
        }
    }

    /// Write `bytes`, the result at `offset`.
    pub fn write(&mut self, offset: usize, bytes: &[u8]) {
        if let TensorMemory::Packed(group) = &mut self.memory {
            return group.scatter(offset, bytes);
        }
        if let Some(dst) = self.output_mut() {
            dst[offset..offset + bytes.len()].copy_from_slice(bytes);
        }
    }

    /// The caller's tensor and where its whole result goes, to read and write directly: `(None, memory)` in
    /// place (read the tensor, then overwrite it), `(Some(input), output)` for a result in a new tensor.
    /// `None` for a joined rank and a packed group.
    pub fn input_and_output(&mut self) -> Option<(Option<&[u8]>, &mut [u8])> {
        let len = self.len;
        match &mut self.memory {
            TensorMemory::Joined | TensorMemory::Packed(_) => None,
            TensorMemory::Plain { input, in_place: true, .. } => Some((None, input.as_mut_slice())),
            TensorMemory::Plain { input, .. } => {
                let output = self.fresh.get_or_insert_with(|| AlignedBuffer::for_overwrite(len)).as_mut_slice();
                Some((Some(input.as_slice()), output))
            }
        }
    }

    /// The memory the whole result goes to, to write into directly: a caller's tensor (in place) or its new
    /// one. `None` for a joined rank and a packed group (whose result is spread over several tensors).
    pub fn output_mut(&mut self) -> Option<&mut [u8]> {
        let len = self.len;
        match &mut self.memory {
            TensorMemory::Joined | TensorMemory::Packed(_) => None,
            TensorMemory::Plain { input, in_place: true, .. } => Some(input.as_mut_slice()),
            TensorMemory::Plain { .. } => {
                Some(self.fresh.get_or_insert_with(|| AlignedBuffer::for_overwrite(len)).as_mut_slice())
            }
        }
    }

    /// What the tensor produced, once every byte of the result was written.
    pub fn finish(self) -> Produced {
        match self.memory {
            TensorMemory::Joined | TensorMemory::Plain { in_place: true, .. } => Produced::InPlace,
            TensorMemory::Packed(group) => Produced::Members(group.take_results()),
            TensorMemory::Plain { shape, .. } => {
                let buffer = self.fresh.unwrap_or_else(|| AlignedBuffer::zeroed(self.len));
                Produced::Tensor(OutputTensor { buffer, shape: shape.to_vec(), dtype: self.dtype })
            }
        }
    }
}
