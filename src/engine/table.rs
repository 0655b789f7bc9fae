//! The engine thread's table of tensors submitted on this rank and not yet completed, with how far
//! each one has got in negotiation. Iteration follows submission order, which keeps what a rank sends
//! in a round deterministic.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;
use std::time::Instant;

use crate::coordinator::message::Request;
use crate::coordinator::pending::{Announcement, PendingRequest, PendingRequests};
use crate::engine::handles::HandleId;
use crate::engine::packed::PackedGroup;
use crate::tensor::RawTensor;
use crate::types::CollectiveKind;

/// One tensor (or barrier/join event) submitted on this rank.
#[derive(Debug)]
pub struct TensorEntry {
    pub handle: HandleId,
    /// Output slot within the handle (position in a grouped op).
    pub index: usize,
    pub request: Request,
    pub input: RawTensor,
    pub in_place: bool,
    pub submitted: Instant,
    /// A packed grouped allreduce: `input` is empty, and the group's tensors are reached through it.
    pub packed: Option<PackedGroup>,
}

impl PendingRequest for TensorEntry {
    fn request(&self) -> &Request {
        &self.request
    }

    fn submitted(&self) -> Instant {
        self.submitted
    }

    /// Its input, or a packed group's tensors back to back.
    fn contribution_len(&self) -> usize {
        self.packed.as_ref().map_or(self.input.len(), PackedGroup::len_bytes)
    }

    fn copy_contribution(&self, dst: &mut [u8]) {
        match &self.packed {
            Some(group) => group.gather_into(dst),
            None => dst.copy_from_slice(self.input.as_slice()),
        }
    }
}

struct Slot {
    sequence: u64,
    entry: TensorEntry,
    announcement: Announcement,
}

/// Tensors in negotiation on this rank.
#[derive(Default)]
pub struct TensorTable {
    slots: HashMap<String, Slot>,
    order: BTreeMap<u64, String>,
    next_sequence: u64,
}

impl TensorTable {
    pub fn insert(&mut self, entry: TensorEntry) {
        self.insert_announced(entry, Announcement::Unsent);
    }

    /// Insert an entry that already stands at `announcement` (the fast lane's op, announced as a cache hit).
    pub fn insert_announced(&mut self, entry: TensorEntry, announcement: Announcement) {
        let name = entry.request.name.clone();
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        self.order.insert(sequence, name.clone());
        self.slots.insert(name, Slot { sequence, entry, announcement });
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn take(&mut self, name: &str) -> Option<TensorEntry> {
        let slot = self.slots.remove(name)?;
        self.order.remove(&slot.sequence);
        Some(slot.entry)
    }

    /// Everything left, in submission order (used to fail them all).
    pub fn drain(&mut self) -> Vec<TensorEntry> {
        let order = std::mem::take(&mut self.order);
        order.into_values().filter_map(|name| self.slots.remove(&name).map(|s| s.entry)).collect()
    }

    pub fn announcement(&self, name: &str) -> Option<Announcement> {
        self.slots.get(name).map(|s| s.announcement)
    }

    /// The oldest submission time among entries in `state`, if any.
    pub fn oldest_cache_hit(&self) -> Option<Instant> {
        self.slots
            .values()
            .filter(|s| matches!(s.announcement, Announcement::CacheHit(_)))
            .map(|s| s.entry.submitted)
            .min()
    }
}

impl PendingRequests for TensorTable {
    type Entry = TensorEntry;

    fn for_each(&mut self, mut visit: impl FnMut(&TensorEntry, &mut Announcement)) {
        for name in self.order.values() {
            if let Some(slot) = self.slots.get_mut(name) {
                visit(&slot.entry, &mut slot.announcement);
            }
        }
    }

    fn request(&self, name: &str) -> Option<&Request> {
        self.slots.get(name).map(|s| &s.entry.request)
    }

    fn has_join(&self) -> bool {
        self.slots.values().any(|s| s.entry.request.kind == CollectiveKind::Join)
    }
}
