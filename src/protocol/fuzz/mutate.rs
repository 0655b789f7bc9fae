//! The fuzzer's inputs: a fast deterministic PRNG and structure-aware mutations of valid encodings.
//!
//! Input `i` of a run depends only on the run's bases and `i` (its generator is seeded from `i`), so any
//! input a run reports can be made again. Most inputs are a base (a valid message, or one kept in the
//! corpus) with one to four stacked mutations: bit flips, byte replacements, integer fields overwritten
//! with edge values (lengths just past the end, `u64::MAX`, sign bits, little- and big-endian), truncation,
//! deleted, inserted and duplicated ranges, splices of two messages and one message appended to another.
//! The rest are random bytes.

/// Longest input made: the decoders' bases are small, and longer inputs only cost time.
const MAX_INPUT: usize = 4096;

/// SplitMix64: tiny, fast, and good enough to pick mutations.
pub(crate) struct Rng(u64);

impl Rng {
    /// The generator of input `index` of a run seeded with `seed`.
    pub(crate) fn for_input(seed: u64, index: u64) -> Rng {
        let mut rng = Rng(seed ^ index.wrapping_mul(0xa076_1d64_78bd_642f));
        rng.next();
        rng
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            ((self.next() >> 32).wrapping_mul(n as u64) >> 32) as usize
        }
    }

    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

/// Writes input `index` into `out` (cleared first), from `bases` (not empty).
pub(crate) fn make_input(bases: &[Vec<u8>], seed: u64, index: u64, out: &mut Vec<u8>) {
    let mut rng = Rng::for_input(seed, index);
    out.clear();
    if bases.is_empty() || rng.chance(16) {
        let longest = if rng.chance(4) { 512 } else { 48 };
        let len = rng.below(longest);
        out.extend((0..len).map(|_| rng.byte()));
        return;
    }
    out.extend_from_slice(&bases[rng.below(bases.len())]);
    for _ in 0..1 + rng.below(4) {
        mutate(&mut rng, bases, out);
    }
    out.truncate(MAX_INPUT);
}

/// One mutation of `input`.
fn mutate(rng: &mut Rng, bases: &[Vec<u8>], input: &mut Vec<u8>) {
    let len = input.len();
    match rng.below(10) {
        0 if len > 0 => {
            let at = rng.below(len);
            input[at] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let at = rng.below(len);
            input[at] = [0, 1, 0x7f, 0x80, 0xff, rng.byte()][rng.below(6)];
        }
        2 | 3 if len > 0 => overwrite_integer(rng, input),
        4 => input.truncate(rng.below(len + 1)),
        5 if len > 0 => {
            let from = rng.below(len);
            let to = (from + 1 + rng.below(16)).min(len);
            input.drain(from..to);
        }
        6 => {
            let at = rng.below(len + 1);
            let count = 1 + rng.below(16);
            let bytes: Vec<u8> = (0..count).map(|_| rng.byte()).collect();
            input.splice(at..at, bytes);
        }
        7 if len > 0 => {
            let from = rng.below(len);
            let to = (from + 1 + rng.below(32)).min(len);
            let chunk = input[from..to].to_vec();
            let at = rng.below(len + 1);
            input.splice(at..at, chunk);
        }
        8 => {
            // A prefix of this input, then the tail of another message.
            let other = &bases[rng.below(bases.len())];
            input.truncate(rng.below(len + 1));
            input.extend_from_slice(&other[rng.below(other.len() + 1)..]);
        }
        _ => input.extend_from_slice(&bases[rng.below(bases.len())]),
    }
}

/// Overwrites 1, 2, 4 or 8 bytes at a random place with an edge value, little- or big-endian: the way to
/// reach a length prefix, a count or a tag with values a decoder must refuse.
fn overwrite_integer(rng: &mut Rng, input: &mut [u8]) {
    let width = [1usize, 2, 4, 8][rng.below(4)];
    if input.len() < width {
        return;
    }
    let at = rng.below(input.len() - width + 1);
    let after = (input.len() - at - width) as u64;
    let bits = 8 * width as u32;
    let max = if width == 8 { u64::MAX } else { (1u64 << bits) - 1 };
    let value = match rng.below(12) {
        0 => 0,
        1 => 1,
        2 => max,
        3 => max - 1,
        4 => max >> 1,
        5 => (max >> 1) + 1,
        // Just what the rest of the input holds, and one or a few more.
        6 => after,
        7 => after + 1,
        8 => after / 8 + 1,
        9 => after + 1 + rng.below(64) as u64,
        10 => rng.below(256) as u64,
        _ => rng.next(),
    } & max;
    let bytes = value.to_le_bytes();
    let field = &mut input[at..at + width];
    field.copy_from_slice(&bytes[..width]);
    if rng.chance(2) {
        field.reverse();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_input_is_made_again_from_its_index() {
        let bases = vec![b"RVOD and some bytes".to_vec(), vec![0; 40]];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for index in 0..2000 {
            make_input(&bases, 7, index, &mut a);
            make_input(&bases, 7, index, &mut b);
            assert_eq!(a, b, "input {index}");
            assert!(a.len() <= MAX_INPUT);
        }
    }

    #[test]
    fn inputs_vary() {
        let bases = vec![vec![0u8; 64]];
        let mut distinct = std::collections::HashSet::new();
        let mut input = Vec::new();
        for index in 0..1000 {
            make_input(&bases, 1, index, &mut input);
            distinct.insert(input.clone());
        }
        assert!(distinct.len() > 700, "only {} distinct inputs of 1000", distinct.len());
    }

    #[test]
    fn below_stays_below() {
        let mut rng = Rng::for_input(3, 4);
        for n in [1, 2, 3, 10, 1000] {
            assert!((0..1000).all(|_| rng.below(n) < n));
        }
        assert_eq!(rng.below(0), 0);
    }
}
