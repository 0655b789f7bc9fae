//! Packing the fusion buffer from its tensors ([`gather`]) and unpacking the results into them ([`scatter`]),
//! range by range: a range need not follow the tensors' bounds, so the shared-memory staging area can be
//! packed and unpacked piece by piece, in cache.

use crate::fusion::layout::FusionSlot;
use crate::fusion::tensor_io::TensorIo;

/// Fill `dst` with the fused buffer's bytes at `offset`: each entry's contribution in its slot (zeros for a
/// joined rank) and zeros in the gaps between slots, which are reduced along with the data.
pub fn gather(tensors: &[TensorIo<'_>], slots: &[FusionSlot], offset: usize, dst: &mut [u8]) {
    let end = offset + dst.len();
    let mut filled = offset;
    let first = slots.partition_point(|s| s.offset + s.bytes <= offset);
    for (slot, io) in slots[first..].iter().zip(&tensors[first..]) {
        if slot.offset >= end {
            break;
        }
        let (lo, hi) = (offset.max(slot.offset), end.min(slot.offset + slot.bytes));
        if lo < hi {
            dst[filled - offset..lo - offset].fill(0);
            io.read(lo - slot.offset, &mut dst[lo - offset..hi - offset]);
            filled = hi;
        }
    }
    dst[filled - offset..].fill(0);
}

/// Hand `bytes`, the result at `offset` of the fused buffer, to the entries whose slots it covers.
pub fn scatter(tensors: &mut [TensorIo<'_>], slots: &[FusionSlot], offset: usize, bytes: &[u8]) {
    let end = offset + bytes.len();
    let first = slots.partition_point(|s| s.offset + s.bytes <= offset);
    for (slot, io) in slots[first..].iter().zip(&mut tensors[first..]) {
        if slot.offset >= end {
            break;
        }
        let (lo, hi) = (offset.max(slot.offset), end.min(slot.offset + slot.bytes));
        if lo < hi {
            io.write(lo - slot.offset, &bytes[lo - offset..hi - offset]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fusion::tensor_io::{Produced, TensorMemory};
    use crate::tensor::RawTensor;
    use crate::types::DataType;

    #[test]
    fn pieces_across_tensor_bounds_pack_with_zero_gaps_and_unpack_into_place() {
        let mut a = vec![1u8, 2, 3];
        let mut b = vec![4u8, 5];
        // SAFETY: the test keeps the vectors alive and untouched while the views are used.
        let (mut ra, mut rb) = unsafe { (RawTensor::new(a.as_mut_ptr(), 3), RawTensor::new(b.as_mut_ptr(), 2)) };
        let slots = [FusionSlot { offset: 0, bytes: 3 }, FusionSlot { offset: 4, bytes: 2 }];
        let shape = [3i64];
        let mut tensors = vec![
            TensorIo::new(TensorMemory::Plain { input: &mut ra, in_place: true, shape: &shape }, 3, DataType::Uint8),
            TensorIo::new(TensorMemory::Joined, 0, DataType::Uint8),
        ];
        let mut packed = [9u8; 6];
        gather(&tensors, &slots, 0, &mut packed[..2]);
        gather(&tensors, &slots, 2, &mut packed[2..]);
        assert_eq!(packed, [1, 2, 3, 0, 0, 0], "a gap and a joined rank's tensor are zeros");

        tensors[1] = TensorIo::new(
            TensorMemory::Plain { input: &mut rb, in_place: false, shape: &shape[..0] },
            2,
            DataType::Uint8,
        );
        scatter(&mut tensors, &slots, 0, &[11, 12, 13, 99, 14]);
        scatter(&mut tensors, &slots, 5, &[15]);
        let produced: Vec<Produced> = tensors.into_iter().map(TensorIo::finish).collect();
        assert!(matches!(produced[0], Produced::InPlace));
        assert!(matches!(&produced[1], Produced::Tensor(t) if t.buffer.as_slice() == [14, 15] && t.shape.is_empty()));
        assert_eq!((a, b), (vec![11, 12, 13], vec![4, 5]));
    }
}
