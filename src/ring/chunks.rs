//! How a buffer is cut into one block per rank, and which block a rank moves at each ring step.
//!
//! Pure arithmetic. Even splits give the first `count % n` ranks one extra element. [`Blocks`] describes
//! any per-rank split (uneven, with empty blocks) as byte ranges laid end to end; it is built with
//! checked arithmetic because per-rank sizes may come from peers.
//!
//! Ring schedule: rank `r` sends to `r + 1` and receives from `r - 1`. During reduce-scatter, at step
//! `s` it sends block `r - s - 1` and receives (and reduces into) block `r - s - 2`, so after `n - 1`
//! steps rank `r` holds the fully reduced block `r`. During allgather it sends block `r - s` and
//! receives block `r - s - 1`, so after `n - 1` steps every rank has every block. All indices mod `n`.

use std::ops::Range;

/// Segment `i` of `count` elements split as evenly as possible into `n`: `(first element, length)`.
/// Lengths differ by at most one, the first ranks taking the extra elements. Out-of-range `i` (or
/// `n == 0`) gets an empty segment at the end.
pub fn segment_bounds(count: usize, n: usize, i: usize) -> (usize, usize) {
    if i >= n {
        return (count, 0);
    }
    let base = count / n;
    let extra = count % n;
    let start = i * base + i.min(extra);
    let len = base + usize::from(i < extra);
    (start, len)
}

/// Consecutive byte ranges, one per rank, covering `0..total()` in rank order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocks {
    /// `offsets[i]..offsets[i + 1]` is block `i`; one more entry than blocks.
    offsets: Vec<usize>,
}

impl Blocks {
    /// Blocks of `lengths[i] * unit` bytes each (`unit` is the element size, or 1 for byte lengths).
    /// `None` if the sizes overflow `usize`.
    pub fn from_lengths(lengths: &[usize], unit: usize) -> Option<Blocks> {
        let mut offsets = Vec::with_capacity(lengths.len() + 1);
        let mut end = 0usize;
        offsets.push(end);
        for &length in lengths {
            end = end.checked_add(length.checked_mul(unit)?)?;
            offsets.push(end);
        }
        Some(Blocks { offsets })
    }

    /// `count` elements of `elem_size` bytes split evenly into `n` blocks, as [`segment_bounds`] does.
    pub fn even(count: usize, n: usize, elem_size: usize) -> Blocks {
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        for i in 0..n {
            let (start, len) = segment_bounds(count, n, i);
            offsets.push((start + len) * elem_size);
        }
        Blocks { offsets }
    }

    /// Number of blocks.
    pub fn count(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// Total bytes of all blocks.
    pub fn total(&self) -> usize {
        self.offsets.last().copied().unwrap_or(0)
    }

    /// Byte range of block `i`; an empty range at the end for `i >= count()`.
    pub fn range(&self, i: usize) -> Range<usize> {
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&start), Some(&end)) => start..end,
            _ => self.total()..self.total(),
        }
    }

    /// Byte length of block `i` (0 for `i >= count()`).
    pub fn len(&self, i: usize) -> usize {
        self.range(i).len()
    }
}

/// `(block sent, block received and reduced)` by `rank` at reduce-scatter step `step` of a ring of `n`.
pub fn reduce_scatter_step(rank: usize, n: usize, step: usize) -> (usize, usize) {
    (ring_back(rank, n, step + 1), ring_back(rank, n, step + 2))
}

/// `(block sent, block received)` by `rank` at allgather step `step` of a ring of `n`.
pub fn allgather_step(rank: usize, n: usize, step: usize) -> (usize, usize) {
    (ring_back(rank, n, step), ring_back(rank, n, step + 1))
}

/// `(rank - back) mod n`, for any `back`.
fn ring_back(rank: usize, n: usize, back: usize) -> usize {
    if n == 0 {
        return 0;
    }
    (rank % n + n - back % n) % n
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn even_split_gives_extra_to_first_ranks() {
        let segments: Vec<_> = (0..4).map(|i| segment_bounds(10, 4, i)).collect();
        assert_eq!(segments, vec![(0, 3), (3, 3), (6, 2), (8, 2)]);
        assert_eq!(segment_bounds(2, 4, 3), (2, 0));
        assert_eq!(segment_bounds(5, 0, 0), (5, 0));
        assert_eq!(segment_bounds(5, 2, 7), (5, 0));
    }

    #[test]
    fn blocks_from_uneven_lengths() {
        let blocks = Blocks::from_lengths(&[2, 0, 3], 4).unwrap();
        assert_eq!(blocks.count(), 3);
        assert_eq!(blocks.range(0), 0..8);
        assert_eq!(blocks.range(1), 8..8);
        assert_eq!(blocks.range(2), 8..20);
        assert_eq!(blocks.range(3), 20..20);
        assert_eq!(blocks.total(), 20);
        assert_eq!(blocks.len(2), 12);
    }

    #[test]
    fn blocks_reject_overflow() {
        assert_eq!(Blocks::from_lengths(&[usize::MAX, 1], 1), None);
        assert_eq!(Blocks::from_lengths(&[usize::MAX / 2 + 1], 2), None);
    }

    #[test]
    fn reduce_scatter_schedule_leaves_block_r_on_rank_r() {
        for n in 1usize..=7 {
            for rank in 0..n {
                // What a rank sends at step s is what it reduced at step s - 1.
                for step in 1..n.saturating_sub(1) {
                    assert_eq!(reduce_scatter_step(rank, n, step).0, reduce_scatter_step(rank, n, step - 1).1);
                }
                // What the left neighbour sends is what this rank receives.
                let left = (rank + n - 1) % n;
                for step in 0..n.saturating_sub(1) {
                    assert_eq!(reduce_scatter_step(left, n, step).0, reduce_scatter_step(rank, n, step).1);
                }
                if n > 1 {
                    assert_eq!(reduce_scatter_step(rank, n, n - 2).1, rank);
                }
            }
        }
    }

    #[test]
    fn allgather_schedule_delivers_every_block_once() {
        for n in 1..=7 {
            for rank in 0..n {
                let left = (rank + n - 1) % n;
                let mut seen = vec![false; n];
                seen[rank] = true;
                assert_eq!(allgather_step(rank, n, 0).0, rank);
                for step in 0..n - 1 {
                    let (_, received) = allgather_step(rank, n, step);
                    assert_eq!(allgather_step(left, n, step).0, received);
                    assert!(!seen[received]);
                    seen[received] = true;
                    if step + 1 < n - 1 {
                        assert_eq!(allgather_step(rank, n, step + 1).0, received);
                    }
                }
                assert!(seen.iter().all(|&s| s));
            }
        }
    }

    proptest! {
        #[test]
        fn segments_tile_the_buffer(count in 0usize..100_000, n in 1usize..64) {
            let mut next = 0;
            let mut lengths = Vec::new();
            for i in 0..n {
                let (start, len) = segment_bounds(count, n, i);
                prop_assert_eq!(start, next);
                next = start + len;
                lengths.push(len);
            }
            prop_assert_eq!(next, count);
            let longest = lengths.iter().copied().max().unwrap();
            let shortest = lengths.iter().copied().min().unwrap();
            prop_assert!(longest - shortest <= 1);
            prop_assert!(lengths.windows(2).all(|w| w[0] >= w[1]));
        }

        #[test]
        fn even_blocks_match_segments(count in 0usize..10_000, n in 1usize..16, elem_size in 1usize..9) {
            let blocks = Blocks::even(count, n, elem_size);
            prop_assert_eq!(blocks.count(), n);
            prop_assert_eq!(blocks.total(), count * elem_size);
            for i in 0..n {
                let (start, len) = segment_bounds(count, n, i);
                prop_assert_eq!(blocks.range(i), start * elem_size..(start + len) * elem_size);
            }
        }

        #[test]
        fn blocks_tile_their_total(lengths in proptest::collection::vec(0usize..1000, 0..20), unit in 1usize..9) {
            let blocks = Blocks::from_lengths(&lengths, unit).unwrap();
            let mut next = 0;
            for (i, &length) in lengths.iter().enumerate() {
                prop_assert_eq!(blocks.range(i), next..next + length * unit);
                next += length * unit;
            }
            prop_assert_eq!(blocks.total(), next);
        }
    }
}
