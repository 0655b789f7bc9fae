//! [`ResponseCache`]: responses negotiated before, so steady-state training skips the coordinator.
//!
//! Each cached entry is a single-tensor response plus the parameters this rank submitted it with
//! ([`OpParams`]; a hit requires equal ones), and owns a bit position: ranks exchange the bits of their cache hits, and a tensor
//! whose bit is set on every rank runs without a round trip to the coordinator.
//!
//! Determinism invariant: the bit assigned to each name depends only on the sequence of
//! [`put`](ResponseCache::put), [`erase`](ResponseCache::erase) and [`touch`](ResponseCache::touch) calls
//! and on the responses' contents, never on the rank's own parameters. Every rank must make the same
//! calls in the same order (all ranks see the same responses and the same agreed bit sets, so they can:
//! put the responses of a response list in list order, erase the agreed invalid bits in ascending order,
//! touch executed hits in execution order); then every rank has identical bit assignments and LRU order.
//!
//! Bit assignment: a new name takes the lowest free bit; when all `capacity` bits are taken, the least
//! recently used entry (oldest `put` or `touch`) is evicted and its bit reused. Capacity 0 disables the
//! cache: every lookup misses and `put` does nothing.
//!
//! As in Horovod, only allreduce, allgather and alltoall responses without an error are cached
//! (allreduce includes Adasum, which is an allreduce with `ReduceOp::Adasum` here); broadcast,
//! reducescatter, barrier and join are always negotiated.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap as HashMap;

use crate::protocol::bitset::BitSet;
use crate::protocol::message::{OpParams, Request, Response, ResponseEntry};
use crate::types::CollectiveKind;

/// Parameters read off the response, for a rank that has no request of its own for the tensor (it joined).
/// If it later submits the tensor with other parameters, the lookup says invalid.
fn params_of_response(response: &Response, entry: &ResponseEntry) -> OpParams {
    OpParams {
        kind: response.kind,
        dtype: response.dtype,
        shape: entry.shape.clone(),
        reduce_op: response.reduce_op,
        root_rank: response.root_rank,
        prescale: response.prescale,
        postscale: response.postscale,
        splits: Vec::new(),
        parts: Vec::new(),
        // A response says whether its tensors are on GPUs, not which GPU (each rank has its own): a joined
        // rank that later submits a GPU tensor of this name finds other parameters, and every rank
        // renegotiates it once.
        device: crate::protocol::message::CPU_DEVICE,
        compression: response.compression,
    }
}

/// What the cache knows about a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheLookup {
    /// Cached with exactly these parameters, at this bit.
    Hit(usize),
    /// Cached under this name with other parameters, at this bit: every rank must erase it.
    Invalid(usize),
    Miss,
}

#[derive(Debug)]
struct CachedResponse {
    response: Response,
    params: OpParams,
    /// Recency stamp; larger is more recent.
    stamp: u64,
}

#[derive(Debug)]
pub struct ResponseCache {
    capacity: usize,
    /// Indexed by bit; `None` marks a free bit below the high-water mark.
    slots: Vec<Option<CachedResponse>>,
    free_bits: BTreeSet<usize>,
    bits_by_name: HashMap<String, usize>,
    /// Stamp -> bit, least recently used first.
    recency: BTreeMap<u64, usize>,
    next_stamp: u64,
    eviction_warned: bool,
}

impl ResponseCache {
    pub fn new(capacity: usize) -> Self {
        ResponseCache {
            capacity,
            slots: Vec::new(),
            free_bits: BTreeSet::new(),
            bits_by_name: HashMap::default(),
            recency: BTreeMap::new(),
            next_stamp: 0,
            eviction_warned: false,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of cached responses.
    pub fn len(&self) -> usize {
        self.bits_by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bits_by_name.is_empty()
    }

    pub fn lookup(&self, req: &Request) -> CacheLookup {
        self.lookup_params(&req.name, &req.params)
    }

    /// [`lookup`](Self::lookup) of the tensor `name` submitted with `params`, without a [`Request`] (what
    /// the fast lane, `engine::fast_lane`, looks up).
    pub fn lookup_params(&self, name: &str, params: &OpParams) -> CacheLookup {
        let Some(&bit) = self.bits_by_name.get(name) else {
            return CacheLookup::Miss;
        };
        match self.slots.get(bit).and_then(Option::as_ref) {
            Some(cached) if cached.params == *params => CacheLookup::Hit(bit),
            Some(_) => CacheLookup::Invalid(bit),
            None => CacheLookup::Miss,
        }
    }

    /// Every bit that holds a response (what a joined rank reports as its hits).
    pub fn occupied_bits(&self) -> BitSet {
        self.bits_by_name.values().copied().collect()
    }

    /// The single-tensor response cached at `bit`.
    pub fn get(&self, bit: usize) -> Option<&Response> {
        self.slots.get(bit).and_then(Option::as_ref).map(|cached| &cached.response)
    }

    /// Caches each tensor of a (possibly fused) response as its own single-tensor response, in entry
    /// order. `own_params` gives this rank's parameters for a tensor name (from its own request), or
    /// `None` if it submitted none (a joined rank). A name already cached keeps its bit and is refreshed.
    /// Responses of kinds that are not cached, and error responses, are ignored.
    pub fn put(&mut self, response: &Response, mut own_params: impl FnMut(&str) -> Option<OpParams>) {
        if self.capacity == 0 || !is_cacheable(response) {
            return;
        }
        for entry in &response.entries {
            let single = Response {
                kind: response.kind,
                entries: vec![entry.clone()],
                dtype: response.dtype,
                reduce_op: response.reduce_op,
                root_rank: response.root_rank,
                prescale: response.prescale,
                postscale: response.postscale,
                error: None,
                last_joined_rank: response.last_joined_rank,
                on_gpu: response.on_gpu,
                compression: response.compression,
            };
            let params = own_params(&entry.name).unwrap_or_else(|| params_of_response(response, entry));
            self.insert(single, params);
        }
    }

    /// Marks the entry at `bit` as most recently used (call when a hit is executed).
    pub fn touch(&mut self, bit: usize) {
        if self.slots.get(bit).and_then(Option::as_ref).is_some_and(|cached| cached.stamp + 1 == self.next_stamp) {
            return; // already the most recent (the same on every rank: all make the same calls)
        }
        let stamp = self.take_stamp();
        if let Some(cached) = self.slots.get_mut(bit).and_then(Option::as_mut) {
            self.recency.remove(&cached.stamp);
            cached.stamp = stamp;
            self.recency.insert(stamp, bit);
        }
    }

    /// Removes the entry at `bit`, if any; the bit becomes free for the next new name.
    pub fn erase(&mut self, bit: usize) {
        let Some(cached) = self.slots.get_mut(bit).and_then(Option::take) else {
            return;
        };
        self.recency.remove(&cached.stamp);
        if let Some(entry) = cached.response.entries.first() {
            self.bits_by_name.remove(&entry.name);
        }
        self.free_bits.insert(bit);
    }

    fn insert(&mut self, response: Response, params: OpParams) {
        let Some(name) = response.entries.first().map(|entry| entry.name.clone()) else {
            return;
        };
        let bit = match self.bits_by_name.get(&name) {
            Some(&bit) => bit,
            None => match self.claim_bit() {
                Some(bit) => bit,
                None => return,
            },
        };
        if let Some(old) = self.slots.get_mut(bit).and_then(Option::take) {
            self.recency.remove(&old.stamp);
        }
        let stamp = self.take_stamp();
        self.recency.insert(stamp, bit);
        self.bits_by_name.insert(name, bit);
        if let Some(slot) = self.slots.get_mut(bit) {
            *slot = Some(CachedResponse { response, params, stamp });
        }
    }

    /// A bit for a new name: the lowest free one, a fresh one below capacity, or the LRU entry's.
    fn claim_bit(&mut self) -> Option<usize> {
        if let Some(bit) = self.free_bits.pop_first() {
            return Some(bit);
        }
        if self.slots.len() < self.capacity {
            self.slots.push(None);
            return Some(self.slots.len() - 1);
        }
        let (_, &lru_bit) = self.recency.first_key_value()?;
        self.warn_eviction_once();
        self.erase(lru_bit);
        self.free_bits.remove(&lru_bit);
        Some(lru_bit)
    }

    fn warn_eviction_once(&mut self) {
        if !self.eviction_warned {
            self.eviction_warned = true;
            tracing::warn!(
                "A response has been evicted from the response cache, which may reduce performance. \
                 Better performance may be obtained by disabling caching (RVOD_CACHE_CAPACITY=0) or by \
                 raising the capacity above {} (RVOD_CACHE_CAPACITY).",
                self.capacity
            );
        }
    }

    fn take_stamp(&mut self) -> u64 {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        stamp
    }
}

fn is_cacheable(response: &Response) -> bool {
    response.error.is_none() && caches_kind(response.kind)
}

/// Whether responses of this kind are cached. Join is not: it is how ranks leave, and negotiates through the
/// coordinator every time. A cached barrier is a round whose headers all announce it (no data moves).
pub fn caches_kind(kind: CollectiveKind) -> bool {
    matches!(
        kind,
        CollectiveKind::Allreduce
            | CollectiveKind::Allgather
            | CollectiveKind::Alltoall
            | CollectiveKind::Broadcast
            | CollectiveKind::Reducescatter
            | CollectiveKind::Barrier
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::test_requests::allreduce_request;
    use crate::error::ErrorKind;
    use crate::types::{DataType, ReduceOp};
    use proptest::prelude::*;

    fn request(name: &str, shape: Vec<i64>) -> Request {
        allreduce_request(0, name, &shape)
    }

    fn response(kind: CollectiveKind, names: &[&str]) -> Response {
        Response {
            entries: names
                .iter()
                .map(|name| ResponseEntry { name: (*name).into(), shape: vec![4], per_rank: vec![], packed: false })
                .collect(),
            ..Response::for_one_tensor(kind, "", DataType::Float32, 4)
        }
    }

    /// Caches `names` as one allreduce, with params as if this rank requested shape `[4]`.
    fn put_names(cache: &mut ResponseCache, names: &[&str]) {
        cache.put(&response(CollectiveKind::Allreduce, names), |name| Some(request(name, vec![4]).params));
    }

    fn bit_of(cache: &ResponseCache, name: &str) -> Option<usize> {
        match cache.lookup(&request(name, vec![4])) {
            CacheLookup::Hit(bit) | CacheLookup::Invalid(bit) => Some(bit),
            CacheLookup::Miss => None,
        }
    }

    #[test]
    fn hit_invalid_and_miss() {
        let mut cache = ResponseCache::new(4);
        put_names(&mut cache, &["a"]);
        assert_eq!(cache.lookup(&request("a", vec![4])), CacheLookup::Hit(0));
        assert_eq!(cache.lookup(&request("a", vec![5])), CacheLookup::Invalid(0));
        let mut other_op = request("a", vec![4]);
        other_op.params.reduce_op = ReduceOp::Max;
        assert_eq!(cache.lookup(&other_op), CacheLookup::Invalid(0));
        let mut on_gpu = request("a", vec![4]);
        on_gpu.params.device = 0;
        assert_eq!(cache.lookup(&on_gpu), CacheLookup::Invalid(0), "a tensor that moved to a GPU is renegotiated");
        assert_eq!(cache.lookup(&request("b", vec![4])), CacheLookup::Miss);
        assert_eq!(cache.get(0).unwrap().entries[0].name, "a");
        assert!(cache.get(1).is_none());
        let gpu = Response { on_gpu: true, ..response(CollectiveKind::Allreduce, &["g"]) };
        cache.put(&gpu, |_| None);
        assert!(cache.get(1).unwrap().on_gpu, "a hit on a GPU tensor runs on the GPU route, on a joined rank too");
    }

    #[test]
    fn fused_responses_are_split_into_single_tensor_entries() {
        let mut cache = ResponseCache::new(4);
        put_names(&mut cache, &["a", "b", "c"]);
        assert_eq!(cache.len(), 3);
        for (bit, name) in ["a", "b", "c"].into_iter().enumerate() {
            let cached = cache.get(bit).unwrap();
            assert_eq!(cached.entries.len(), 1);
            assert_eq!(cached.entries[0].name, name);
        }
    }

    #[test]
    fn uncacheable_responses_are_ignored() {
        let mut cache = ResponseCache::new(8);
        cache.put(&response(CollectiveKind::Join, &["x"]), |_| None);
        let mut failed = response(CollectiveKind::Allreduce, &["y"]);
        failed.error = Some((ErrorKind::Mismatch, "shapes differ".into()));
        cache.put(&failed, |_| None);
        assert!(cache.is_empty());
        let cached = [
            CollectiveKind::Allreduce,
            CollectiveKind::Allgather,
            CollectiveKind::Alltoall,
            CollectiveKind::Broadcast,
            CollectiveKind::Reducescatter,
            CollectiveKind::Barrier,
        ];
        for kind in cached {
            cache.put(&response(kind, &[kind.name()]), |_| None);
        }
        assert_eq!(cache.len(), cached.len());
    }

    #[test]
    fn lru_entry_is_evicted_and_its_bit_reused() {
        let mut cache = ResponseCache::new(3);
        put_names(&mut cache, &["a", "b", "c"]);
        cache.touch(0); // "a" is now the most recent; "b" is the LRU entry
        put_names(&mut cache, &["d"]);
        assert_eq!(bit_of(&cache, "b"), None);
        assert_eq!(bit_of(&cache, "d"), Some(1));
        put_names(&mut cache, &["e"]);
        assert_eq!(bit_of(&cache, "c"), None);
        assert_eq!(bit_of(&cache, "e"), Some(2));
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn erased_bits_are_reused_lowest_first() {
        let mut cache = ResponseCache::new(8);
        put_names(&mut cache, &["a", "b", "c", "d"]);
        cache.erase(2);
        cache.erase(1);
        assert_eq!(cache.lookup(&request("b", vec![4])), CacheLookup::Miss);
        put_names(&mut cache, &["x", "y", "z"]);
        assert_eq!(bit_of(&cache, "x"), Some(1));
        assert_eq!(bit_of(&cache, "y"), Some(2));
        assert_eq!(bit_of(&cache, "z"), Some(4));
        assert_eq!(cache.occupied_bits().iter_ones().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn putting_a_cached_name_keeps_its_bit_and_refreshes_it() {
        let mut cache = ResponseCache::new(2);
        put_names(&mut cache, &["a", "b"]);
        cache.put(&response(CollectiveKind::Allreduce, &["a"]), |name| Some(request(name, vec![9]).params));
        assert_eq!(cache.lookup(&request("a", vec![9])), CacheLookup::Hit(0));
        put_names(&mut cache, &["c"]); // "b" is now the LRU entry
        assert_eq!(bit_of(&cache, "b"), None);
        assert_eq!(bit_of(&cache, "c"), Some(1));
    }

    #[test]
    fn joined_rank_caches_the_response_parameters() {
        let mut cache = ResponseCache::new(2);
        cache.put(&response(CollectiveKind::Allreduce, &["a"]), |_| None);
        assert_eq!(cache.lookup(&request("a", vec![4])), CacheLookup::Hit(0));
    }

    #[test]
    fn capacity_zero_disables_the_cache() {
        let mut cache = ResponseCache::new(0);
        put_names(&mut cache, &["a"]);
        assert!(cache.is_empty());
        assert_eq!(cache.capacity(), 0);
        assert_eq!(cache.lookup(&request("a", vec![4])), CacheLookup::Miss);
        cache.touch(0);
        cache.erase(0);
        assert!(cache.get(0).is_none());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Put(Vec<u8>),
        Touch(usize),
        Erase(usize),
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            prop::collection::vec(0u8..12, 1..4).prop_map(Op::Put),
            (0usize..8).prop_map(Op::Touch),
            (0usize..8).prop_map(Op::Erase),
        ]
    }

    /// Reference model: a list of (name, bit), least recently used first.
    fn model_apply(model: &mut Vec<(String, usize)>, capacity: usize, op: &Op) {
        match op {
            Op::Put(names) => {
                for name in names.iter().map(|n| format!("t{n}")) {
                    if let Some(pos) = model.iter().position(|(m, _)| *m == name) {
                        let entry = model.remove(pos);
                        model.push(entry);
                        continue;
                    }
                    let used: Vec<usize> = model.iter().map(|&(_, bit)| bit).collect();
                    let bit = if model.len() == capacity {
                        model.remove(0).1
                    } else {
                        (0..).find(|bit| !used.contains(bit)).unwrap()
                    };
                    model.push((name, bit));
                }
            }
            Op::Touch(bit) => {
                if let Some(pos) = model.iter().position(|&(_, b)| b == *bit) {
                    let entry = model.remove(pos);
                    model.push(entry);
                }
            }
            Op::Erase(bit) => model.retain(|&(_, b)| b != *bit),
        }
    }

    fn cache_apply(cache: &mut ResponseCache, op: &Op, shape: i64) {
        match op {
            Op::Put(names) => {
                let names: Vec<String> = names.iter().map(|n| format!("t{n}")).collect();
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                cache.put(&response(CollectiveKind::Allreduce, &names), |name| Some(request(name, vec![shape]).params));
            }
            Op::Touch(bit) => cache.touch(*bit),
            Op::Erase(bit) => cache.erase(*bit),
        }
    }

    proptest! {
        #[test]
        fn matches_a_reference_lru(capacity in 1usize..6, ops in prop::collection::vec(arb_op(), 0..40)) {
            let mut cache = ResponseCache::new(capacity);
            let mut model = Vec::new();
            for op in &ops {
                cache_apply(&mut cache, op, 4);
                model_apply(&mut model, capacity, op);
                prop_assert_eq!(cache.len(), model.len());
                for (name, bit) in &model {
                    prop_assert_eq!(bit_of(&cache, name), Some(*bit));
                    prop_assert_eq!(&cache.get(*bit).unwrap().entries[0].name, name);
                }
            }
        }

        #[test]
        fn ranks_with_different_params_assign_identical_bits(
            capacity in 1usize..6,
            ops in prop::collection::vec(arb_op(), 0..40),
        ) {
            let mut rank0 = ResponseCache::new(capacity);
            let mut rank1 = ResponseCache::new(capacity);
            for op in &ops {
                cache_apply(&mut rank0, op, 4);
                cache_apply(&mut rank1, op, 7);
            }
            for bit in 0..capacity {
                prop_assert_eq!(rank0.get(bit), rank1.get(bit));
            }
        }
    }
}
