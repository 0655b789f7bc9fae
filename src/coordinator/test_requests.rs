//! Requests for the coordinator's unit tests: one rank's float32 sum allreduce of a CPU tensor, which a
//! test changes with [`changed`] where it needs to, and a [`FakeTable`] of them to negotiate over.

use std::time::Instant;

use crate::coordinator::pending::{Announcement, PendingRequest, PendingRequests};
use crate::protocol::message::{OpParams, Request};
use crate::types::{CollectiveKind, DataType};

/// Rank `rank`'s request to sum the float32 CPU tensor `name` of shape `shape`.
pub fn allreduce_request(rank: u32, name: &str, shape: &[i64]) -> Request {
    let params = OpParams::new(CollectiveKind::Allreduce).for_tensor(DataType::Float32, shape.to_vec(), Vec::new());
    Request { rank, name: name.into(), params }
}

/// `request` with its parameters changed by `change`.
pub fn changed(mut request: Request, change: impl FnOnce(&mut OpParams)) -> Request {
    change(&mut request.params);
    request
}

/// A table of pending requests without an engine: each rank's contribution is plain bytes.
#[derive(Default)]
pub struct FakeTable {
    pub entries: Vec<(FakeEntry, Announcement)>,
}

pub struct FakeEntry {
    pub request: Request,
    pub submitted: Instant,
    pub data: Vec<u8>,
}

impl PendingRequest for FakeEntry {
    fn request(&self) -> &Request {
        &self.request
    }
    fn submitted(&self) -> Instant {
        self.submitted
    }
    fn contribution_len(&self) -> usize {
        self.data.len()
    }
    fn copy_contribution(&self, dst: &mut [u8]) {
        dst.copy_from_slice(&self.data);
    }
}

impl PendingRequests for FakeTable {
    type Entry = FakeEntry;
    fn for_each(&mut self, mut visit: impl FnMut(&FakeEntry, &mut Announcement)) {
        for (entry, announcement) in &mut self.entries {
            visit(entry, announcement);
        }
    }
    fn request(&self, name: &str) -> Option<&Request> {
        self.entries.iter().map(|(e, _)| &e.request).find(|r| r.name == name)
    }
    fn has_join(&self) -> bool {
        self.entries.iter().any(|(e, _)| e.request.params.kind == CollectiveKind::Join)
    }
}

impl FakeTable {
    /// Submit an allreduce of `count` float32 values, each byte of the contribution set to `fill`.
    pub fn submit(&mut self, rank: usize, name: &str, count: i64, fill: u8) {
        let request = allreduce_request(rank as u32, name, &[count]);
        let data = vec![fill; count as usize * 4];
        self.entries.push((FakeEntry { request, submitted: Instant::now(), data }, Announcement::Unsent));
    }

    /// What the engine does once a response ran: the entry leaves the table.
    pub fn complete(&mut self, name: &str) {
        self.entries.retain(|(e, _)| e.request.name != name);
    }
}
