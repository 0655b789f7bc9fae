//! Collective algorithms and the reduction kernels they use, written against the [`Transport`] trait
//! only: they move bytes with `send`/`recv`/`exchange` and never know what carries them (the staged
//! allreduce uses the trait's staging areas where the transport has them).
//!
//! Buffers are raw native-endian bytes of one [`DataType`]. Every collective is deterministic: the
//! combination order of each element is fixed by the algorithm, never by timing, so repeated runs and
//! all ranks of an allreduce produce the same bits. Inconsistent arguments return an `InvalidInput`
//! [`TransportError::Io`] instead of panicking.
//!
//! - [`choice`]: which algorithm a flat allreduce, allgather or broadcast runs, by size and number of ranks.
//! - [`allreduce`], [`reducescatter`], [`allgather`], [`broadcast`], [`alltoall`]: the flat collectives
//!   (recursive doubling, ring, pipelined two-rank, tree, chain); [`rabenseifner`]: allreduce by recursive
//!   halving and doubling; [`bruck`]: Bruck's allgather; [`adasum`]: Adasum's combination; [`staged`]:
//!   allreduce through staging areas every rank can read, [`staged_blocks`] reduce-scatter and allgather
//!   likewise; [`hierarchical`]: the same over a communicator's
//!   local and cross parts; [`compressed`]: int8, 1-bit and PowerSGD allreduce with error feedback.
//! - [`reduce`]: the element-wise reduction and scaling kernels; [`bfloat16`]: their bfloat16 conversions;
//!   [`streaming`]: reducing a message as it streams in.
//! - [`chunks`]: how a buffer is cut into blocks per rank and step; [`disjoint`]: reading one range of a
//!   buffer while writing another; [`args`]: argument checks shared by the collectives.
//!
//! [`Transport`]: crate::transport::Transport
//! [`TransportError::Io`]: crate::transport::TransportError::Io
//! [`DataType`]: crate::types::DataType

pub mod adasum;
pub mod allgather;
pub mod allreduce;
pub mod alltoall;
mod args;
mod bfloat16;
pub mod broadcast;
mod bruck;
pub mod choice;
pub mod chunks;
pub mod compressed;
mod disjoint;
pub mod hierarchical;
mod rabenseifner;
pub mod reduce;
pub mod reducescatter;
pub mod staged;
pub mod staged_blocks;
mod streaming;

pub use adasum::adasum_allreduce;
pub use allgather::{allgatherv, allgatherv_by};
pub use allreduce::{allreduce, allreduce_by, allreduce_into, allreduce_scaled_by};
pub use alltoall::alltoallv;
pub use broadcast::{broadcast, broadcast_by};
pub use choice::{BROADCAST_CHAIN_THRESHOLD_BYTES, BROADCAST_CHUNK_BYTES};
pub use chunks::{segment_bounds, Blocks};
pub use reduce::{reduce_into, scale_in_place};
pub use reducescatter::reducescatter;
