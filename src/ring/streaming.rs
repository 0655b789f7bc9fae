//! Reducing a message into a buffer while it streams in, in pieces of any size.
//!
//! Pieces need not end on element boundaries: the bytes of an element split across pieces wait in a
//! small carry buffer until the element is whole. Nothing larger than one element is ever staged. A
//! reducer may also scale what it combines ([`scaled`](StreamingReducer::scaled)) while it is still in
//! cache, instead of a later pass over the whole result.

use crate::ring::reduce::{reduce_into, scale_in_place};
use crate::tensor::copy_streaming;
use crate::types::{Combine, DataType};

/// Largest element size of any [`DataType`].
const MAX_ELEMENT_BYTES: usize = 8;

/// Bytes of `base` copied into `dst` at a time just before they are combined, so they are still in L1.
const BASE_BLOCK_BYTES: usize = 4096;

/// Consumes the pieces of one incoming message, in order, combining them into `dst` element-wise
/// (`dst ⊕ piece`, or with a `base`, `base ⊕ piece` written to `dst`).
pub(crate) struct StreamingReducer<'a> {
    dst: &'a mut [u8],
    base: Option<&'a [u8]>,
    /// With a base: write results with streaming stores (see [`from_base_streaming`](Self::from_base_streaming)).
    streaming: bool,
    dtype: DataType,
    combine: Combine,
    /// Each combined element is multiplied by this (`scale_in_place`'s arithmetic); 1 leaves it.
    scale: f64,
    /// Bytes of `dst` already combined.
    done: usize,
    carry: [u8; MAX_ELEMENT_BYTES],
    carry_len: usize,
}

impl<'a> StreamingReducer<'a> {
    pub(crate) fn new(dst: &'a mut [u8], dtype: DataType, combine: Combine) -> StreamingReducer<'a> {
        StreamingReducer::with(dst, None, dtype, combine)
    }

    fn with(dst: &'a mut [u8], base: Option<&'a [u8]>, dtype: DataType, combine: Combine) -> StreamingReducer<'a> {
        let (streaming, scale, done, carry, carry_len) = (false, 1.0, 0, [0; MAX_ELEMENT_BYTES], 0);
        StreamingReducer { dst, base, streaming, dtype, combine, scale, done, carry, carry_len }
    }

    /// Write `base ⊕ message` to `dst` (of `base`'s length), leaving `base` as it is.
    pub(crate) fn from_base(
        base: &'a [u8],
        dst: &'a mut [u8],
        dtype: DataType,
        combine: Combine,
    ) -> StreamingReducer<'a> {
        let dst_len = dst.len().min(base.len());
        StreamingReducer::with(&mut dst[..dst_len], Some(base), dtype, combine)
    }

    /// [`from_base`](Self::from_base) for a `dst` nobody reads soon (a large result): each block is combined
    /// in cache and written with streaming stores, so `dst`'s old contents are never read.
    pub(crate) fn from_base_streaming(
        base: &'a [u8],
        dst: &'a mut [u8],
        dtype: DataType,
        combine: Combine,
    ) -> StreamingReducer<'a> {
        StreamingReducer { streaming: true, ..Self::from_base(base, dst, dtype, combine) }
    }

    /// Multiply each combined element by `factor` as it is written (the same bits as `scale_in_place` over
    /// the finished result: both are element-wise, and each element is scaled once, after combining).
    pub(crate) fn scaled(self, factor: f64) -> StreamingReducer<'a> {
        StreamingReducer { scale: factor, ..self }
    }

    /// Combine the next piece of the message into `dst`. Bytes beyond `dst`'s length are ignored.
    pub(crate) fn accept(&mut self, mut piece: &[u8]) {
        let size = self.dtype.size();
        if self.carry_len > 0 {
            let take = (size - self.carry_len).min(piece.len());
            self.carry[self.carry_len..self.carry_len + take].copy_from_slice(&piece[..take]);
            self.carry_len += take;
            piece = &piece[take..];
            if self.carry_len < size {
                return;
            }
            self.carry_len = 0;
            let carried = self.carry;
            self.combine_whole(&carried[..size]);
        }
        let whole = piece.len() - piece.len() % size;
        self.combine_whole(&piece[..whole]);
        let rest = &piece[whole..];
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carry_len = rest.len();
    }

    fn combine_whole(&mut self, elements: &[u8]) {
        // `done <= dst.len()` always holds: it only ever advances by at most the room left.
        let len = elements.len().min(self.dst.len() - self.done);
        let dst = &mut self.dst[self.done..self.done + len];
        match self.base {
            None => {
                reduce_into(dst, &elements[..len], self.dtype, self.combine);
                scale_in_place(dst, self.dtype, self.scale);
            }
            Some(base) => {
                let base = &base[self.done..self.done + len];
                let mut block = [0u8; BASE_BLOCK_BYTES];
                // Whole elements per block: 4096 is a multiple of every element size.
                for ((d, b), e) in dst
                    .chunks_mut(BASE_BLOCK_BYTES)
                    .zip(base.chunks(BASE_BLOCK_BYTES))
                    .zip(elements[..len].chunks(BASE_BLOCK_BYTES))
                {
                    if self.streaming {
                        let block = &mut block[..d.len()];
                        block.copy_from_slice(b);
                        reduce_into(block, e, self.dtype, self.combine);
                        scale_in_place(block, self.dtype, self.scale);
                        copy_streaming(d, block);
                    } else {
                        d.copy_from_slice(b);
                        reduce_into(d, e, self.dtype, self.combine);
                        scale_in_place(d, self.dtype, self.scale);
                    }
                }
            }
        }
        self.done += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn as_bytes(values: &[i32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_ne_bytes()).collect()
    }

    #[test]
    fn pieces_split_inside_elements_reduce_like_one_piece() {
        let local: Vec<i32> = (0..37).collect();
        let incoming: Vec<i32> = (0..37).map(|v| v * 100).collect();
        let expected: Vec<i32> = (0..37).map(|v| v * 101).collect();
        let message = as_bytes(&incoming);
        for piece_len in [1, 2, 3, 5, 7, 64, 148, 1000] {
            let mut dst = as_bytes(&local);
            let mut reducer = StreamingReducer::new(&mut dst, DataType::Int32, Combine::Sum);
            for piece in message.chunks(piece_len) {
                reducer.accept(piece);
            }
            assert_eq!(dst, as_bytes(&expected), "piece length {piece_len}");
        }
    }

    #[test]
    fn excess_bytes_are_ignored() {
        let mut dst = as_bytes(&[1, 2]);
        let mut reducer = StreamingReducer::new(&mut dst, DataType::Int32, Combine::Max);
        reducer.accept(&as_bytes(&[5, 0, 9]));
        assert_eq!(dst, as_bytes(&[5, 2]));
    }
}
