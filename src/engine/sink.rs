//! Where the reduced bytes of one allreduce tensor go, written piece by piece at offsets within the
//! tensor: into the caller's memory (in-place ops), into a new buffer, into a packed group's tensors, or
//! nowhere (a joined rank). Pieces may come in any order and need not follow element or member bounds.

use crate::engine::execute::TensorResult;
use crate::engine::submission::OutputTensor;
use crate::engine::table::TensorEntry;
use crate::tensor::AlignedBuffer;
use crate::types::DataType;

pub(crate) enum ResultSink<'a> {
    /// A joined rank: its zeros were reduced, nobody wants the result.
    Discard,
    /// An in-place op: the caller's tensor.
    Caller(&'a mut [u8]),
    /// A new tensor of this shape.
    Fresh(AlignedBuffer, Vec<i64>, DataType),
    /// A packed group: its tensors, or their new results.
    Group(&'a mut TensorEntry),
}

impl<'a> ResultSink<'a> {
    /// The sink for `entry`'s result of `len` bytes (`None`: a joined rank).
    pub(crate) fn for_entry(entry: Option<&'a mut TensorEntry>, len: usize, dtype: DataType) -> ResultSink<'a> {
        match entry {
            None => ResultSink::Discard,
            Some(e) if e.packed.is_some() => ResultSink::Group(e),
            Some(e) if e.in_place => ResultSink::Caller(e.input.as_mut_slice()),
            Some(e) => ResultSink::Fresh(AlignedBuffer::zeroed(len), e.request.shape.clone(), dtype),
        }
    }

    /// Write `bytes`, the result at `offset` of the tensor.
    pub(crate) fn write(&mut self, offset: usize, bytes: &[u8]) {
        match self {
            ResultSink::Discard => {}
            ResultSink::Caller(dst) => dst[offset..offset + bytes.len()].copy_from_slice(bytes),
            ResultSink::Fresh(buffer, ..) => buffer.as_mut_slice()[offset..offset + bytes.len()].copy_from_slice(bytes),
            ResultSink::Group(entry) => {
                if let Some(group) = entry.packed.as_mut() {
                    group.scatter(offset, bytes);
                }
            }
        }
    }

    /// What the tensor produced, once every byte was written.
    pub(crate) fn finish(self) -> TensorResult {
        match self {
            ResultSink::Discard | ResultSink::Caller(_) => TensorResult::default(),
            ResultSink::Fresh(buffer, shape, dtype) => {
                TensorResult { output: Some(OutputTensor { buffer, shape, dtype }), ..TensorResult::default() }
            }
            ResultSink::Group(entry) => TensorResult {
                members: entry.packed.as_mut().map(|group| group.take_results()).unwrap_or_default(),
                ..TensorResult::default()
            },
        }
    }
}
