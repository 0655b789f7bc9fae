//! Negotiation: deciding, identically on every rank, which collectives run next and in what order.
//!
//! What the ranks send each other in a round (requests, responses, round headers, their codec) is the wire
//! layer below, [`crate::protocol`].
//!
//! - [`cache`]: the response cache that lets steady-state rounds skip the coordinator.
//! - [`negotiation`]: one round, run in lockstep by every rank.
//! - [`tree`]: how a round's messages travel on larger communicators (recursive doubling, binomial trees).
//! - [`pending`]: what a round needs of this rank's pending requests (the engine's table implements it).
//! - [`message_table`]: the coordinator's requests-so-far, join state and stall detection.
//! - [`validate`]: every rank's requests for a tensor turned into one response or one error.
//! - [`result_size`]: allgathers and alltoalls whose result no rank could hold become errors.
//! - [`stall`]: the stall warning and its clock; [`lateness`]: how late each rank announces what runs, and
//!   the straggler it names.
//! - `test_requests` (tests only): the request the unit tests start from, and a table of them.
//! - `scale_counting` (tests only): messages and bytes per rank counted at 2 to 256 ranks.
//!
//! Invariant: every rank applies the same responses, in the same order, to the same cache state.

pub mod cache;
pub mod lateness;
pub mod message_table;
pub mod negotiation;
pub mod pending;
pub mod result_size;
#[cfg(test)]
mod scale_counting;
pub mod stall;
#[cfg(test)]
pub mod test_requests;
pub mod tree;
pub mod validate;
