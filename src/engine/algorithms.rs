//! The flat collective algorithms one communicator runs: chosen per op by [`crate::ring::choice`] from the
//! op's size, the number of ranks and the configured overrides (`RVOD_ALLREDUCE_ALGORITHM`, ...), and each
//! (collective, algorithm) logged once, the first time it runs, at INFO on the communicator's rank 0 (shown
//! by `rvodrun --verbose`) and at DEBUG on the others.

use std::collections::HashSet;

use crate::ring::choice::{
    self, AlgorithmOverrides, AllgatherAlgorithm, AllreduceAlgorithm, BroadcastAlgorithm, Named,
};
use crate::transport::Transport;
use crate::types::CollectiveKind;

/// One communicator's algorithm choices: the configured overrides and what was logged already.
#[derive(Debug, Default)]
pub struct Algorithms {
    overrides: AlgorithmOverrides,
    /// How the log names the communicator ("the global process set", ...).
    communicator: String,
    announced: HashSet<(CollectiveKind, &'static str)>,
}

impl Algorithms {
    pub fn new(overrides: AlgorithmOverrides, communicator: String) -> Algorithms {
        Algorithms { overrides, communicator, announced: HashSet::new() }
    }

    /// The allreduce of `bytes` on `t`'s communicator.
    pub fn allreduce(&mut self, t: &dyn Transport, bytes: usize) -> AllreduceAlgorithm {
        let cheap = t.capabilities().cheap_handoffs;
        let chosen = choice::choose_allreduce(bytes, t.size(), cheap, self.overrides.allreduce);
        self.announce_chosen(t, CollectiveKind::Allreduce, chosen, self.overrides.allreduce.is_some(), bytes);
        chosen
    }

    /// Whether the allgather algorithm is configured (`RVOD_ALLGATHER_ALGORITHM`): then it runs as
    /// configured, never staged.
    pub fn allgather_configured(&self) -> bool {
        self.overrides.allgather.is_some()
    }

    /// The allgather of `total_bytes` (every rank's blocks together) on `t`'s communicator.
    pub fn allgather(&mut self, t: &dyn Transport, total_bytes: usize) -> AllgatherAlgorithm {
        let chosen = choice::choose_allgather(total_bytes, t.size(), self.overrides.allgather);
        self.announce_chosen(t, CollectiveKind::Allgather, chosen, self.overrides.allgather.is_some(), total_bytes);
        chosen
    }

    /// The broadcast of `bytes` on `t`'s communicator.
    pub fn broadcast(&mut self, t: &dyn Transport, bytes: usize) -> BroadcastAlgorithm {
        let chosen = choice::choose_broadcast(bytes, t.size(), self.overrides.broadcast);
        self.announce_chosen(t, CollectiveKind::Broadcast, chosen, self.overrides.broadcast.is_some(), bytes);
        chosen
    }

    /// Log once per communicator that a `kind` of `bytes` runs through the transport's staging areas.
    pub fn staged(&mut self, t: &dyn Transport, kind: CollectiveKind, bytes: usize) {
        self.announce(t, kind, "staged", "through the shared staging areas", bytes);
    }

    fn announce_chosen(
        &mut self,
        t: &dyn Transport,
        kind: CollectiveKind,
        chosen: impl Named,
        forced: bool,
        bytes: usize,
    ) {
        let why = if forced { "configured" } else { "by size and number of ranks" };
        self.announce(t, kind, chosen.name(), why, bytes);
    }

    fn announce(&mut self, t: &dyn Transport, kind: CollectiveKind, algorithm: &'static str, why: &str, bytes: usize) {
        if t.size() <= 1 || !self.announced.insert((kind, algorithm)) {
            return;
        }
        let (name, ranks, rank) = (kind.name(), t.size(), t.rank());
        let communicator = if self.communicator.is_empty() { "this communicator" } else { &self.communicator };
        if rank == 0 {
            tracing::info!(
                "{communicator}: {name} by {algorithm} ({why}; first at {bytes} bytes on {ranks} ranks, {})",
                t.label()
            );
        } else {
            tracing::debug!(
                "{communicator}: rank {rank}: {name} by {algorithm} ({why}; first at {bytes} bytes on {ranks} ranks)"
            );
        }
    }
}
