//! Tensor fusion: running many small compatible collectives as one over a shared buffer, from the plan to
//! the bytes (the engine calls it after a round decides, and its executor packs and unpacks through it).
//! It names no engine type: tensors come as plain views ([`tensor_io::TensorMemory`]).
//!
//! - [`plan`]: which agreed responses fuse, in which order (pure and deterministic, so every rank plans
//!   the same fused responses from the same input).
//! - [`layout`]: where each fused tensor sits in the fusion buffer, for packing and unpacking.
//! - [`tensor_io`]: one tensor of a fused op, where its contribution comes from and its result goes.
//! - [`packing`]: packing the fusion buffer from those tensors and unpacking the results into them.
//! - [`packed_group`]: a grouped allreduce's tensors of one dtype seen as one packed tensor.
//!
//! Allreduce and small reduce-scatter responses fuse (see [`plan`]); allgather and the rest run one at a time.

pub mod layout;
pub mod packed_group;
pub mod packing;
pub mod plan;
pub mod tensor_io;

pub use layout::{FusionLayout, FusionSlot, FUSION_ALIGNMENT};
pub use plan::{plan_fusion, reducescatter_fuses};
