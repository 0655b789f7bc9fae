//! Grouped allreduces packed into one tensor when they are submitted.
//!
//! A grouped allreduce of many small tensors (a model's gradients) would otherwise cost per-tensor work
//! all the way through: a name, a table slot, a request, a cache bit, a completion. Packed, the group is
//! one tensor of its dtype: its tensors are copied, back to back, into one engine-owned buffer as the op is
//! submitted; the group is negotiated, cached and reduced as that one tensor (its request carries the
//! tensors' shapes, so ranks that disagree about any of them get a mismatch error naming it); and when the
//! reduction is done, the engine thread copies each tensor's slice back into it (in-place ops) or hands
//! it out as the tensor's own result.
//!
//! Packed buffers are kept for reuse when their group completes (a few, the way the executor keeps its
//! fusion buffer): a fresh multi-megabyte allocation per step would be zero-filled or page-faulted again.
//!
//! A group whose tensors have several dtypes becomes one packed tensor per dtype, in order of first
//! appearance: the first keeps the group's name, the others are named `<name>.<k>`.

use std::sync::Mutex;

use crate::coordinator::message::encode_part_shapes;
use crate::engine::submission::{OutputTensor, TensorSubmission};
use crate::tensor::{AlignedBuffer, RawTensor};
use crate::types::DataType;

/// Packed buffers of completed groups, for the next groups to fill.
static SPARE_BUFFERS: Mutex<Vec<AlignedBuffer>> = Mutex::new(Vec::new());

/// At most this many spare buffers are kept.
const MAX_SPARE_BUFFERS: usize = 4;

/// A buffer of at least `len` bytes: the smallest spare one that fits, or a new one.
fn take_buffer(len: usize) -> AlignedBuffer {
    let mut spares = SPARE_BUFFERS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let best = spares.iter().enumerate().filter(|(_, b)| b.len() >= len).min_by_key(|(_, b)| b.len()).map(|(i, _)| i);
    match best {
        Some(i) => spares.swap_remove(i),
        None => AlignedBuffer::zeroed(len),
    }
}

fn give_back(buffer: AlignedBuffer) {
    if buffer.is_empty() {
        return;
    }
    let mut spares = SPARE_BUFFERS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    spares.push(buffer);
    if spares.len() > MAX_SPARE_BUFFERS {
        // Keep the largest ones: they serve every smaller group too.
        let smallest = spares.iter().enumerate().min_by_key(|(_, b)| b.len()).map(|(i, _)| i).unwrap_or(0);
        spares.swap_remove(smallest);
    }
}

/// One tensor of a group as the caller submitted it.
#[derive(Debug)]
pub struct GroupMember {
    pub input: RawTensor,
    pub dtype: DataType,
    pub shape: Vec<i64>,
}

#[derive(Debug)]
struct Part {
    /// The caller's tensor (written back into for in-place ops).
    target: RawTensor,
    shape: Vec<i64>,
    /// Output slot of the tensor in the op's handle.
    index: usize,
    /// Where its bytes sit in the packed buffer.
    offset: usize,
}

/// The tensors of one dtype of a grouped allreduce, packed into one buffer.
#[derive(Debug)]
pub struct PackedGroup {
    /// At least `len` bytes; the group uses the first `len`.
    buffer: AlignedBuffer,
    len: usize,
    parts: Vec<Part>,
    dtype: DataType,
    in_place: bool,
}

impl PackedGroup {
    /// The packed bytes as the view the engine reduces in place. Valid while `self` lives: the buffer is
    /// heap memory that moves with it.
    fn view(&mut self) -> RawTensor {
        // SAFETY: the buffer lives as long as this group, which the table entry holding the view owns; only
        // the engine thread touches it once submitted.
        unsafe { RawTensor::new(self.buffer.as_mut_ptr(), self.len) }
    }

    /// Number of tensors in the group.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The shapes of the group's tensors, encoded for the request (see `Request::parts`).
    pub fn encoded_shapes(&self) -> Vec<i64> {
        encode_part_shapes(self.parts.iter().map(|p| p.shape.as_slice()))
    }

    /// Hand the reduced bytes out: copied back into the caller's tensors for an in-place op (every slot
    /// `None`), or as one new tensor per member. Returns (output slot, result) per member.
    pub fn unpack(mut self) -> Vec<(usize, Option<OutputTensor>)> {
        let dtype = self.dtype;
        let in_place = self.in_place;
        let buffer = &self.buffer;
        self.parts
            .iter_mut()
            .map(|part| {
                let bytes = &buffer.as_slice()[part.offset..part.offset + part.target.len()];
                let output = if in_place {
                    part.target.as_mut_slice().copy_from_slice(bytes);
                    None
                } else {
                    Some(OutputTensor { buffer: AlignedBuffer::from_slice(bytes), shape: part.shape.clone(), dtype })
                };
                (part.index, output)
            })
            .collect()
    }
}

impl Drop for PackedGroup {
    fn drop(&mut self) {
        give_back(std::mem::replace(&mut self.buffer, AlignedBuffer::zeroed(0)));
    }
}

/// Pack `members` (output slots in list order) into one submission per dtype, named as the module says.
/// Each submission reduces its packed buffer in place; the group keeps `in_place` for [`PackedGroup::unpack`].
pub fn pack_group(name: &str, members: Vec<GroupMember>, in_place: bool) -> Vec<TensorSubmission> {
    let mut dtypes: Vec<DataType> = Vec::new();
    for member in &members {
        if !dtypes.contains(&member.dtype) {
            dtypes.push(member.dtype);
        }
    }
    let mut by_dtype: Vec<Vec<(usize, GroupMember)>> = dtypes.iter().map(|_| Vec::new()).collect();
    for (index, member) in members.into_iter().enumerate() {
        let k = dtypes.iter().position(|&d| d == member.dtype).unwrap_or(0);
        by_dtype[k].push((index, member));
    }
    dtypes
        .into_iter()
        .zip(by_dtype)
        .enumerate()
        .map(|(k, (dtype, members))| {
            let total: usize = members.iter().map(|(_, m)| m.input.len()).sum();
            let mut buffer = take_buffer(total);
            let mut parts = Vec::with_capacity(members.len());
            let mut offset = 0;
            for (index, member) in members {
                let len = member.input.len();
                buffer.as_mut_slice()[offset..offset + len].copy_from_slice(member.input.as_slice());
                parts.push(Part { target: member.input, shape: member.shape, index, offset });
                offset += len;
            }
            let mut group = PackedGroup { buffer, len: total, parts, dtype, in_place };
            let elements = (total / dtype.size()) as i64;
            TensorSubmission {
                name: if k == 0 { name.to_string() } else { format!("{name}.{k}") },
                dtype,
                shape: vec![elements],
                input: group.view(),
                in_place: true,
                packed: Some(group),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::message::decode_part_shapes;

    fn member(data: &mut [u8], dtype: DataType, shape: Vec<i64>) -> GroupMember {
        // SAFETY: the test keeps `data` alive and untouched while the view is used.
        let input = unsafe { RawTensor::new(data.as_mut_ptr(), data.len()) };
        GroupMember { input, dtype, shape }
    }

    #[test]
    fn packs_by_dtype_and_unpacks_into_the_right_slots() {
        let mut a = vec![1u8, 2, 3, 4]; // f32 [1]
        let mut b = vec![5u8; 8]; // f64 [1]
        let mut c = vec![6u8, 7, 8, 9, 10, 11, 12, 13]; // f32 [2]
        let members = vec![
            member(&mut a, DataType::Float32, vec![1]),
            member(&mut b, DataType::Float64, vec![1]),
            member(&mut c, DataType::Float32, vec![2]),
        ];
        let mut subs = pack_group("grouped_allreduce.g", members, true);
        assert_eq!(subs.len(), 2);
        assert_eq!(subs[0].name, "grouped_allreduce.g");
        assert_eq!(subs[1].name, "grouped_allreduce.g.1");
        assert_eq!((subs[0].dtype, subs[0].shape.clone()), (DataType::Float32, vec![3]));
        assert_eq!(subs[0].input.as_slice(), &[1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13]);
        let group = subs[0].packed.as_ref().unwrap();
        assert_eq!(decode_part_shapes(&group.encoded_shapes()).unwrap(), vec![&[1i64][..], &[2][..]]);

        // The engine reduces the packed view in place; unpacking writes the slices back.
        subs[0].input.as_mut_slice().iter_mut().for_each(|x| *x += 100);
        let results = subs.remove(0).packed.unwrap().unpack();
        assert_eq!(results.iter().map(|(i, o)| (*i, o.is_none())).collect::<Vec<_>>(), vec![(0, true), (2, true)]);
        assert_eq!(a, vec![101, 102, 103, 104]);
        assert_eq!(c, vec![106, 107, 108, 109, 110, 111, 112, 113]);
        assert_eq!(b, vec![5u8; 8], "the other dtype's tensor is not written by this group");
    }

    #[test]
    fn out_of_place_groups_hand_out_one_tensor_per_member() {
        let mut a = vec![1u8, 2];
        let mut b = vec![3u8, 4, 5, 6];
        let members = vec![member(&mut a, DataType::Int16, vec![]), member(&mut b, DataType::Int16, vec![2, 1])];
        let mut subs = pack_group("g", members, false);
        subs[0].input.as_mut_slice().reverse();
        let results = subs.remove(0).packed.unwrap().unpack();
        let (i0, o0) = &results[0];
        let (i1, o1) = &results[1];
        assert_eq!((*i0, o0.as_ref().unwrap().buffer.as_slice(), o0.as_ref().unwrap().shape.clone()), (0, &[6u8, 5][..], vec![]));
        assert_eq!((*i1, o1.as_ref().unwrap().buffer.as_slice(), o1.as_ref().unwrap().shape.clone()), (1, &[4u8, 3, 2, 1][..], vec![2, 1]));
        assert_eq!((a, b), (vec![1, 2], vec![3, 4, 5, 6]), "inputs are left alone");
    }
}
