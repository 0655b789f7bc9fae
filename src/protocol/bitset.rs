//! [`BitSet`]: a compact set of small non-negative integers, used for response-cache bit positions.
//!
//! Bits are packed into `u64` words, bit `i` in word `i / 64`. Invariant: the last word is never zero,
//! so two sets with the same members are equal (`==`) and encode to the same bytes whatever their
//! history. Members should be small (cache capacities): the set allocates up to its largest member.

use crate::protocol::codec::{DecodeError, Wire, WireReader, WireWriter};

const WORD_BITS: usize = 64;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BitSet {
    words: Vec<u64>,
}

impl BitSet {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, bit: usize) {
        let word = bit / WORD_BITS;
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= 1 << (bit % WORD_BITS);
    }

    pub fn contains(&self, bit: usize) -> bool {
        self.words.get(bit / WORD_BITS).is_some_and(|w| w & (1 << (bit % WORD_BITS)) != 0)
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Keeps only the members also in `other` (the cross-rank AND of cache hits).
    pub fn intersect_with(&mut self, other: &BitSet) {
        self.words.truncate(other.words.len());
        for (mine, theirs) in self.words.iter_mut().zip(&other.words) {
            *mine &= theirs;
        }
        self.trim();
    }

    /// Adds every member of `other` (the cross-rank OR of invalid bits).
    pub fn union_with(&mut self, other: &BitSet) {
        if other.words.len() > self.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (mine, theirs) in self.words.iter_mut().zip(&other.words) {
            *mine |= theirs;
        }
    }

    /// Members in ascending order.
    pub fn iter_ones(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(index, &word)| {
            let base = index * WORD_BITS;
            (0..WORD_BITS).filter(move |bit| word & (1 << bit) != 0).map(move |bit| base + bit)
        })
    }

    fn trim(&mut self) {
        while self.words.last() == Some(&0) {
            self.words.pop();
        }
    }
}

impl FromIterator<usize> for BitSet {
    fn from_iter<I: IntoIterator<Item = usize>>(bits: I) -> Self {
        let mut set = BitSet::new();
        for bit in bits {
            set.insert(bit);
        }
        set
    }
}

impl BitSet {
    /// Write the encoding of the set holding `bit` alone (as `encode` would), without building the set.
    pub fn encode_single(w: &mut WireWriter, bit: usize) {
        let word = bit / 64;
        w.put_u64(word as u64 + 1);
        for _ in 0..word {
            w.put_u64(0);
        }
        w.put_u64(1 << (bit % 64));
    }
}

impl Wire for BitSet {
    fn encode(&self, w: &mut WireWriter) {
        w.put_u64s(&self.words);
    }

    /// Accepts trailing zero words (and drops them) so the invariant holds whatever the peer sent.
    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let mut set = BitSet { words: r.u64s("bit set words")? };
        set.trim();
        Ok(set)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use proptest::prelude::*;

    fn encode(set: &BitSet) -> Vec<u8> {
        let mut w = WireWriter::new();
        set.encode(&mut w);
        w.into_bytes()
    }

    #[test]
    fn insert_contains_len() {
        let mut set = BitSet::new();
        assert!(set.is_empty());
        set.insert(0);
        set.insert(64);
        set.insert(200);
        set.insert(64);
        assert!(set.contains(0) && set.contains(64) && set.contains(200));
        assert!(!set.contains(1) && !set.contains(10_000));
        assert_eq!(set.len(), 3);
        assert_eq!(set.iter_ones().collect::<Vec<_>>(), vec![0, 64, 200]);
    }

    #[test]
    fn intersection_that_empties_the_tail_stays_canonical() {
        let mut a: BitSet = [1, 300].into_iter().collect();
        let b: BitSet = [1, 301].into_iter().collect();
        a.intersect_with(&b);
        assert_eq!(a, [1].into_iter().collect());
        assert_eq!(encode(&a), encode(&[1].into_iter().collect()));
    }

    #[test]
    fn decoding_drops_trailing_zero_words() {
        let mut w = WireWriter::new();
        w.put_u64s(&[0b101, 0, 0]);
        let bytes = w.into_bytes();
        let set = BitSet::decode(&mut WireReader::new(&bytes)).unwrap();
        assert_eq!(set, [0, 2].into_iter().collect());
    }

    proptest! {
        #[test]
        fn matches_a_reference_set(
            a in prop::collection::btree_set(0usize..500, 0..40),
            b in prop::collection::btree_set(0usize..500, 0..40),
        ) {
            let set_a: BitSet = a.iter().copied().collect();
            let set_b: BitSet = b.iter().copied().collect();
            let mut and = set_a.clone();
            and.intersect_with(&set_b);
            let mut or = set_a.clone();
            or.union_with(&set_b);
            prop_assert_eq!(and.iter_ones().collect::<BTreeSet<_>>(), &a & &b);
            prop_assert_eq!(or.iter_ones().collect::<BTreeSet<_>>(), &a | &b);
            prop_assert_eq!(and.len(), (&a & &b).len());
            prop_assert_eq!(and.is_empty(), (&a & &b).is_empty());
        }

        #[test]
        fn roundtrips(bits in prop::collection::btree_set(0usize..1000, 0..50)) {
            let set: BitSet = bits.into_iter().collect();
            let bytes = encode(&set);
            let mut r = WireReader::new(&bytes);
            prop_assert_eq!(BitSet::decode(&mut r).unwrap(), set);
            prop_assert!(r.finish().is_ok());
        }

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
            let _ = BitSet::decode(&mut WireReader::new(&bytes));
        }
    }
}
