//! What ranks send each other, and nothing else: the wire layer below the coordinator, fusion, the
//! timeline and autotune, which all read its types.
//!
//! - [`message`]: a rank's [`Request`](message::Request), an op's parameters ([`OpParams`](message::OpParams),
//!   which the cache, the fast lane and submissions share) and the agreed [`Response`](message::Response).
//! - [`round`]: the messages of one negotiation round (round header, request list, response list).
//! - [`summary`]: the same round combined along a tree on larger communicators (round summary, gathered
//!   request lists).
//! - [`codec`]: their versioned binary wire format, decoded defensively.
//! - [`bitset`]: compact sets of response-cache bits, ANDed and ORed across ranks.
//! - [`tuned`]: the knob values rank 0 announces in its round header.
//! - `fuzz` (unit tests only): the mutation fuzzer every decoder of a peer's bytes runs under.

pub mod bitset;
pub mod codec;
#[cfg(test)]
pub(crate) mod fuzz;
pub mod message;
pub mod round;
pub mod summary;
pub mod tuned;
