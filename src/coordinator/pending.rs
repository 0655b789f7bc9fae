//! What a negotiation round needs to know of this rank's submitted, not yet run, collectives: the
//! [`PendingRequests`] the engine's tensor table implements. Negotiation depends on this trait, not on the
//! engine, so a round can be run (and tested) over any table of requests.
//!
//! Invariant: [`PendingRequests::for_each`] visits entries in submission order, so what a rank sends in a
//! round is deterministic.

use std::time::Instant;

use crate::protocol::message::Request;

/// Where a pending request stands in negotiation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Announcement {
    /// Not yet told to anyone; goes to the coordinator in the next slow-path round.
    Unsent,
    /// The coordinator holds our request and answers when every rank has submitted it.
    SentToCoordinator,
    /// Found in the response cache at this bit; announced in every round header until all ranks hit it.
    CacheHit(usize),
}

/// One collective submitted on this rank.
pub trait PendingRequest {
    fn request(&self) -> &Request;
    /// When it was submitted (stall times count from here).
    fn submitted(&self) -> Instant;
    /// Bytes this rank contributes (small cached allreduces travel in the round header).
    fn contribution_len(&self) -> usize;
    /// Copy this rank's contribution into `dst` (`contribution_len()` long).
    fn copy_contribution(&self, dst: &mut [u8]);
}

/// This rank's collectives in negotiation, each with its [`Announcement`].
pub trait PendingRequests {
    type Entry: PendingRequest;
    /// Visit every entry in submission order; the visitor may move its announcement on.
    fn for_each(&mut self, visit: impl FnMut(&Self::Entry, &mut Announcement));
    /// The request pending under `name`.
    fn request(&self, name: &str) -> Option<&Request>;
    /// Whether this rank has a pending join.
    fn has_join(&self) -> bool;
}
