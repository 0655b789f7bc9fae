//! A grouped allreduce's tensors of one dtype seen as one packed tensor: what is reduced is its tensors'
//! bytes back to back.
//!
//! Packed, a group of many small tensors (a model's gradients) costs the work of one tensor all the way
//! through (a name, a table slot, a request, a cache bit, a completion; its request carries the tensors'
//! shapes, so ranks that disagree about any of them get a mismatch error naming it). The bytes are gathered
//! only when the reduction runs, straight into wherever it reduces them (the shared-memory staging area or
//! the fusion buffer), and the results are scattered straight back into the tensors (in-place ops) or into
//! one new tensor per member. The engine submits each packed group as one tensor (`engine::grouped`).
use crate::protocol::message::encode_part_shapes;
use crate::tensor::{AlignedBuffer, OutputTensor, RawTensor};
use crate::types::DataType;

/// One tensor of a group as the caller submitted it.
#[derive(Debug)]
pub struct GroupMember {
    pub input: RawTensor,
    pub dtype: DataType,
    pub shape: Vec<i64>,
}

#[derive(Debug)]
struct Part {
    /// The caller's tensor (read when the group is gathered, written for in-place ops).
    target: RawTensor,
    shape: Vec<i64>,
    /// Output slot of the tensor in the op's handle.
    index: usize,
    /// Where its bytes sit in the packed tensor.
    offset: usize,
    /// Its own result (out-of-place ops), allocated when the results are scattered.
    output: Option<AlignedBuffer>,
}

/// The tensors of one dtype of a grouped allreduce, seen as one packed tensor.
#[derive(Debug)]
pub struct PackedGroup {
    parts: Vec<Part>,
    len: usize,
    dtype: DataType,
    in_place: bool,
}

impl PackedGroup {
    /// Number of tensors in the group.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Bytes of the packed tensor.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// The dtype of every tensor of the group.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// The shapes of the group's tensors, encoded for the request (see `OpParams::parts`).
    pub fn encoded_shapes(&self) -> Vec<i64> {
        encode_part_shapes(self.parts.iter().map(|p| p.shape.as_slice()))
    }

    /// Copy the tensors back to back into `dst` (`len_bytes()` long).
    pub fn gather_into(&self, dst: &mut [u8]) {
        self.gather(0, dst);
    }

    /// Fill `dst` with the packed tensor's bytes at `offset`.
    pub fn gather(&self, offset: usize, dst: &mut [u8]) {
        let end = offset + dst.len();
        for part in self.parts_within(offset, end) {
            let bytes = part.target.as_slice();
            let (lo, hi) = (offset.max(part.offset), end.min(part.offset + bytes.len()));
            dst[lo - offset..hi - offset].copy_from_slice(&bytes[lo - part.offset..hi - part.offset]);
        }
    }

    /// Write `bytes`, the result at `offset` of the packed tensor, to the tensors it belongs to: into the
    /// callers' tensors for an in-place op, else into each tensor's new result.
    pub fn scatter(&mut self, offset: usize, bytes: &[u8]) {
        let end = offset + bytes.len();
        let (first, count) = self.parts_range(offset, end);
        let in_place = self.in_place;
        for part in self.parts[first..first + count].iter_mut() {
            let len = part.target.len();
            let (lo, hi) = (offset.max(part.offset), end.min(part.offset + len));
            let src = &bytes[lo - offset..hi - offset];
            let dst = if in_place {
                part.target.as_mut_slice()
            } else {
                part.output.get_or_insert_with(|| AlignedBuffer::for_overwrite(len)).as_mut_slice()
            };
            dst[lo - part.offset..hi - part.offset].copy_from_slice(src);
        }
    }

    /// Index of the first part overlapping `offset..end` and how many do (empty parts never count).
    fn parts_range(&self, offset: usize, end: usize) -> (usize, usize) {
        let first = self.parts.partition_point(|p| p.offset + p.target.len() <= offset);
        let count = self.parts[first..].iter().take_while(|p| p.offset < end).count();
        (first, count)
    }

    fn parts_within(&self, offset: usize, end: usize) -> impl Iterator<Item = &Part> {
        let (first, count) = self.parts_range(offset, end);
        self.parts[first..first + count].iter()
    }

    /// Each tensor's (output slot, result) once everything was scattered: `None` for in-place ops.
    pub fn take_results(&mut self) -> Vec<(usize, Option<OutputTensor>)> {
        let dtype = self.dtype;
        let in_place = self.in_place;
        self.parts
            .iter_mut()
            .map(|part| {
                let output = (!in_place).then(|| OutputTensor {
                    buffer: part.output.take().unwrap_or_else(|| AlignedBuffer::zeroed(part.target.len())),
                    shape: part.shape.clone(),
                    dtype,
                });
                (part.index, output)
            })
            .collect()
    }
}

/// Pack `members` (output slots in list order) into one group per dtype, in order of first appearance.
/// Nothing is copied here: a group is gathered when it runs.
pub fn pack_by_dtype(members: Vec<GroupMember>, in_place: bool) -> impl Iterator<Item = PackedGroup> {
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
    dtypes.into_iter().zip(by_dtype).map(move |(dtype, members)| {
        let mut parts = Vec::with_capacity(members.len());
        let mut offset = 0;
        for (index, member) in members {
            let len = member.input.len();
            parts.push(Part { target: member.input, shape: member.shape, index, offset, output: None });
            offset += len;
        }
        PackedGroup { parts, len: offset, dtype, in_place }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::message::decode_part_shapes;

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
        let mut groups: Vec<PackedGroup> = pack_by_dtype(members, true).collect();
        assert_eq!(groups.len(), 2);
        assert_eq!((groups[0].dtype(), groups[1].dtype()), (DataType::Float32, DataType::Float64));
        let mut group = groups.remove(0);
        assert_eq!(group.len_bytes(), 12);
        let mut packed = vec![0u8; 12];
        group.gather_into(&mut packed);
        assert_eq!(packed, [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13]);
        assert_eq!(decode_part_shapes(&group.encoded_shapes()).unwrap(), vec![&[1i64][..], &[2][..]]);

        // Results come in pieces that need not follow the tensors' boundaries.
        packed.iter_mut().for_each(|x| *x += 100);
        group.scatter(0, &packed[..3]);
        group.scatter(3, &packed[3..9]);
        group.scatter(9, &packed[9..]);
        let results = group.take_results();
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
        let mut group = pack_by_dtype(members, false).next().unwrap();
        let mut packed = vec![0u8; 6];
        group.gather_into(&mut packed);
        packed.reverse();
        group.scatter(0, &packed);
        let results = group.take_results();
        let (i0, o0) = &results[0];
        let (i1, o1) = &results[1];
        assert_eq!(
            (*i0, o0.as_ref().unwrap().buffer.as_slice(), o0.as_ref().unwrap().shape.clone()),
            (0, &[6u8, 5][..], vec![])
        );
        assert_eq!(
            (*i1, o1.as_ref().unwrap().buffer.as_slice(), o1.as_ref().unwrap().shape.clone()),
            (1, &[4u8, 3, 2, 1][..], vec![2, 1])
        );
        assert_eq!((a, b), (vec![1, 2], vec![3, 4, 5, 6]), "inputs are left alone");
    }
}
