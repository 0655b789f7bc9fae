//! [`FusionLayout`]: where each tensor of a fused response lives inside the fusion buffer.
//!
//! Tensors are packed in response-entry order, each starting at a multiple of [`FUSION_ALIGNMENT`]
//! bytes (a multiple of every element size, and a cache line, so no two tensors share one). The gaps
//! between tensors are reduced along with the data, so the buffer they live in must be initialised
//! (zeroed) memory. The total size ends at the last tensor's last byte: there is no tail padding.

use crate::protocol::message::Response;

/// Alignment of every tensor's offset inside the fusion buffer, in bytes.
pub const FUSION_ALIGNMENT: usize = 64;

/// One tensor's place in the fusion buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusionSlot {
    pub offset: usize,
    pub bytes: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusionLayout {
    slots: Vec<FusionSlot>,
    total_bytes: usize,
}

impl FusionLayout {
    /// Lays out tensors of these byte sizes in order; `None` if the buffer size would overflow `usize`.
    pub fn from_sizes(sizes: impl IntoIterator<Item = usize>) -> Option<Self> {
        let mut slots = Vec::new();
        let mut total_bytes = 0usize;
        for bytes in sizes {
            let offset = aligned(total_bytes)?;
            total_bytes = offset.checked_add(bytes)?;
            slots.push(FusionSlot { offset, bytes });
        }
        Some(FusionLayout { slots, total_bytes })
    }

    /// The layout of an allreduce response's tensors (each entry's full tensor, in entry order).
    pub fn for_response(response: &Response) -> Option<Self> {
        let element_bytes = response.dtype.size();
        let sizes: Option<Vec<usize>> =
            response.entries.iter().map(|entry| entry.num_elements().checked_mul(element_bytes)).collect();
        Self::from_sizes(sizes?)
    }

    /// One slot per tensor, in entry order.
    pub fn slots(&self) -> &[FusionSlot] {
        &self.slots
    }

    /// Bytes of fusion buffer the tensors need.
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }
}

/// `bytes` rounded up to a multiple of [`FUSION_ALIGNMENT`] (where the next tensor starts after a
/// buffer prefix of `bytes`); `None` on overflow.
pub(crate) fn aligned(bytes: usize) -> Option<usize> {
    bytes.checked_next_multiple_of(FUSION_ALIGNMENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::message::ResponseEntry;
    use crate::types::{CollectiveKind, DataType};
    use proptest::prelude::*;

    #[test]
    fn offsets_are_aligned_and_total_has_no_tail_padding() {
        let layout = FusionLayout::from_sizes([4, 64, 0, 65, 3]).unwrap();
        let offsets: Vec<usize> = layout.slots().iter().map(|s| s.offset).collect();
        assert_eq!(offsets, vec![0, 64, 128, 128, 256]);
        assert_eq!(layout.total_bytes(), 259);
    }

    #[test]
    fn empty_layout_is_empty() {
        let layout = FusionLayout::from_sizes([]).unwrap();
        assert!(layout.slots().is_empty());
        assert_eq!(layout.total_bytes(), 0);
    }

    #[test]
    fn overflow_is_none() {
        assert_eq!(FusionLayout::from_sizes([usize::MAX]).unwrap().total_bytes(), usize::MAX);
        assert!(FusionLayout::from_sizes([usize::MAX, 0]).is_none());
        assert!(FusionLayout::from_sizes([1 << (usize::BITS - 1), 1 << (usize::BITS - 1)]).is_none());
    }

    #[test]
    fn response_layout_uses_element_size() {
        let entry =
            |name: &str, shape: Vec<i64>| ResponseEntry { name: name.into(), shape, per_rank: vec![], packed: false };
        let response = Response {
            entries: vec![entry("a", vec![3]), entry("b", vec![2, 5]), entry("scalar", vec![])],
            ..Response::for_one_tensor(CollectiveKind::Allreduce, "", DataType::Float64, 0)
        };
        let layout = FusionLayout::for_response(&response).unwrap();
        assert_eq!(
            layout.slots(),
            &[
                FusionSlot { offset: 0, bytes: 24 },
                FusionSlot { offset: 64, bytes: 80 },
                FusionSlot { offset: 192, bytes: 8 }
            ]
        );
        assert_eq!(layout.total_bytes(), 200);
    }

    proptest! {
        #[test]
        fn slots_are_aligned_ordered_and_disjoint(sizes in prop::collection::vec(0usize..5000, 0..20)) {
            let layout = FusionLayout::from_sizes(sizes.iter().copied()).unwrap();
            prop_assert_eq!(layout.slots().len(), sizes.len());
            let mut end = 0;
            for (slot, &bytes) in layout.slots().iter().zip(&sizes) {
                prop_assert_eq!(slot.bytes, bytes);
                prop_assert_eq!(slot.offset % FUSION_ALIGNMENT, 0);
                prop_assert!(slot.offset >= end);
                prop_assert!(slot.offset < end + FUSION_ALIGNMENT);
                end = slot.offset + slot.bytes;
            }
            prop_assert_eq!(layout.total_bytes(), end);
            let padded: usize = sizes.iter().map(|&b| aligned(b).unwrap()).sum();
            prop_assert!(layout.total_bytes() <= padded);
        }
    }
}
