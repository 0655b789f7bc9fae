//! Bruck's allgather: `ceil(log2 n)` steps for any `n`, blocks of any size (empty ones too).
//!
//! After the step at distance `d` (1, 2, 4, ...) rank `r` holds blocks `r, r+1, .., r+2d-1` (mod `n`): at that
//! step it sends the first `min(d, n - d)` blocks it holds to rank `r - d` and receives as many, the
//! blocks from `r + d` on, from rank `r + d`. Blocks stay in their final places in the buffer; a run of
//! blocks that wraps past the last rank is two byte ranges, sent from a copy and received in two parts.

use std::ops::Range;

use crate::ring::chunks::Blocks;
use crate::transport::{Transport, TransportError};

/// The Bruck allgather over `buf` split into `blocks`, where block `rank` is already in place.
pub(crate) fn allgather_bruck(t: &mut dyn Transport, buf: &mut [u8], blocks: &Blocks) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    let mut outgoing = Vec::new();
    let mut distance = 1;
    while distance < n {
        let count = distance.min(n - distance);
        let to = (rank + n - distance) % n;
        let from = (rank + distance) % n;
        outgoing.clear();
        for range in cyclic_ranges(blocks, rank, count) {
            outgoing.extend_from_slice(&buf[range]);
        }
        let [first, second] = cyclic_ranges(blocks, from, count);
        let (first_len, incoming_len) = (first.len(), first.len() + second.len());
        t.exchange(to, &outgoing, from, incoming_len, &mut |offset, mut piece| {
            if offset < first_len {
                let take = piece.len().min(first_len - offset);
                let at = first.start + offset;
                buf[at..at + take].copy_from_slice(&piece[..take]);
                piece = &piece[take..];
            }
            let at = second.start + offset.max(first_len) - first_len;
            buf[at..at + piece.len()].copy_from_slice(piece);
        })?;
        distance <<= 1;
    }
    Ok(())
}

/// The bytes of blocks `start, start+1, .., start+count-1` (mod the number of blocks): one range, and a
/// second (empty unless the run wraps) for the blocks from 0 on.
fn cyclic_ranges(blocks: &Blocks, start: usize, count: usize) -> [Range<usize>; 2] {
    let n = blocks.count();
    let span = |first: usize, end: usize| {
        if end > first {
            blocks.range(first).start..blocks.range(end - 1).end
        } else {
            0..0
        }
    };
    let end = start + count;
    if end <= n {
        [span(start, end), 0..0]
    } else {
        [span(start, n), span(0, end - n)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_that_wrap_are_two_ranges() {
        let blocks = Blocks::from_lengths(&[2, 0, 3, 1], 1).unwrap();
        assert_eq!(cyclic_ranges(&blocks, 1, 2), [2..5, 0..0]);
        assert_eq!(cyclic_ranges(&blocks, 3, 2), [5..6, 0..2]);
        assert_eq!(cyclic_ranges(&blocks, 2, 3), [2..6, 0..2]);
        assert_eq!(cyclic_ranges(&blocks, 0, 0), [0..0, 0..0]);
    }
}
