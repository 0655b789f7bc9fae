//! The engine thread's table of tensors submitted on this rank and not yet completed, with how far
//! each one has got in negotiation. Iteration follows submission order, which keeps what a rank sends
//! in a round deterministic.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;
use std::time::Instant;

use crate::coordinator::pending::{Announcement, PendingRequest, PendingRequests};
use crate::engine::handles::HandleId;
use crate::fusion::packed_group::PackedGroup;
use crate::fusion::tensor_io::TensorMemory;
use crate::gpu::tensor::DeviceInput;
use crate::protocol::message::Request;
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
    /// A tensor in GPU memory: `input` stays empty until the executor stages it (see
    /// [`crate::engine::execute_device`]).
    pub device: Option<DeviceInput>,
    /// Caller-owned memory for the result (see [`crate::engine::submission::TensorSubmission::into`]).
    pub into: Option<RawTensor>,
}

impl TensorEntry {
    /// Its memory as a fused op reads and writes it (see [`TensorMemory`]).
    pub fn memory(&mut self) -> TensorMemory<'_> {
        match &mut self.packed {
            Some(group) => TensorMemory::Packed(group),
            None => TensorMemory::Plain {
                input: &mut self.input,
                in_place: self.in_place,
                shape: &self.request.params.shape,
            },
        }
    }
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

/// Tensors in negotiation on this rank: each entry, with its announcement, under its submission number
/// (so iterating is in submission order), and its name's number.
#[derive(Default)]
pub struct TensorTable {
    entries: BTreeMap<u64, (TensorEntry, Announcement)>,
    sequence_of: HashMap<String, u64>,
    next_sequence: u64,
}

impl TensorTable {
    pub fn insert(&mut self, entry: TensorEntry) {
        self.insert_announced(entry, Announcement::Unsent);
    }

    /// Insert an entry that already stands at `announcement` (the fast lane's op, announced as a cache hit).
    pub fn insert_announced(&mut self, entry: TensorEntry, announcement: Announcement) {
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        // A name is in the table at most once (the handle table refuses a second one in flight).
        if let Some(replaced) = self.sequence_of.insert(entry.request.name.clone(), sequence) {
            self.entries.remove(&replaced);
        }
        self.entries.insert(sequence, (entry, announcement));
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn take(&mut self, name: &str) -> Option<TensorEntry> {
        let sequence = self.sequence_of.remove(name)?;
        self.entries.remove(&sequence).map(|(entry, _)| entry)
    }

    /// Everything left, in submission order (used to fail them all).
    pub fn drain(&mut self) -> Vec<TensorEntry> {
        self.sequence_of.clear();
        std::mem::take(&mut self.entries).into_values().map(|(entry, _)| entry).collect()
    }

    pub fn announcement(&self, name: &str) -> Option<Announcement> {
        self.entries.get(self.sequence_of.get(name)?).map(|(_, announcement)| *announcement)
    }

    /// The oldest submission time among entries in `state`, if any.
    pub fn oldest_cache_hit(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter(|(_, announcement)| matches!(announcement, Announcement::CacheHit(_)))
            .map(|(entry, _)| entry.submitted)
            .min()
    }
}

impl PendingRequests for TensorTable {
    type Entry = TensorEntry;

    fn for_each(&mut self, mut visit: impl FnMut(&TensorEntry, &mut Announcement)) {
        for (entry, announcement) in self.entries.values_mut() {
            visit(entry, announcement);
        }
    }

    fn request(&self, name: &str) -> Option<&Request> {
        self.entries.get(self.sequence_of.get(name)?).map(|(entry, _)| &entry.request)
    }

    fn has_join(&self) -> bool {
        self.entries.values().any(|(entry, _)| entry.request.params.kind == CollectiveKind::Join)
    }
}
