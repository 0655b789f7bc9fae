//! One allreduce tensor seen from the executor: where its contribution comes from and where its result
//! goes, both piece by piece at offsets within the tensor. The contribution is the caller's input, a packed
//! group's tensors, or zeros (a joined rank); the result goes into the caller's memory (in-place ops), a new
//! buffer, a packed group's tensors, or nowhere. Pieces may come in any order and need not follow element
//! or member bounds; an in-place tensor's piece is read before its result is written.

use crate::engine::execute::TensorResult;
use crate::engine::table::TensorEntry;
use crate::tensor::AlignedBuffer;
use crate::tensor::OutputTensor;
use crate::types::DataType;

pub(crate) struct TensorIo<'a> {
    /// `None`: a joined rank, which contributes zeros and wants no result.
    entry: Option<&'a mut TensorEntry>,
    /// The new result of an out-of-place plain tensor, allocated at the first write.
    fresh: Option<AlignedBuffer>,
    len: usize,
    dtype: DataType,
}

impl<'a> TensorIo<'a> {
    /// `entry`'s tensor of `len` bytes.
    pub(crate) fn new(entry: Option<&'a mut TensorEntry>, len: usize, dtype: DataType) -> TensorIo<'a> {
        TensorIo { entry, fresh: None, len, dtype }
    }

    /// Fill `dst` with this rank's contribution at `offset`.
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8]) {
        match self.entry.as_deref() {
            None => dst.fill(0),
            Some(TensorEntry { packed: Some(group), .. }) => group.gather(offset, dst),
            Some(e) => dst.copy_from_slice(&e.input.as_slice()[offset..offset + dst.len()]),
        }
    }

    /// Write `bytes`, the result at `offset`.
    pub(crate) fn write(&mut self, offset: usize, bytes: &[u8]) {
        let len = self.len;
        let Some(entry) = self.entry.as_deref_mut() else { return };
        let dst = match entry {
            TensorEntry { packed: Some(group), .. } => return group.scatter(offset, bytes),
            TensorEntry { in_place: true, input, .. } => input.as_mut_slice(),
            _ => self.fresh.get_or_insert_with(|| AlignedBuffer::for_overwrite(len)).as_mut_slice(),
        };
        dst[offset..offset + bytes.len()].copy_from_slice(bytes);
    }

    /// What the tensor produced, once every byte of the result was written.
    pub(crate) fn finish(self) -> TensorResult {
        let Some(entry) = self.entry else { return TensorResult::default() };
        if let Some(group) = entry.packed.as_mut() {
            return TensorResult { members: group.take_results(), ..TensorResult::default() };
        }
        if entry.in_place {
            return TensorResult::default();
        }
        let buffer = self.fresh.unwrap_or_else(|| AlignedBuffer::zeroed(self.len));
        let output = OutputTensor { buffer, shape: entry.request.shape.clone(), dtype: self.dtype };
        TensorResult { output: Some(output), ..TensorResult::default() }
    }
}
