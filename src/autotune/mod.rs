//! Autotune (`RVOD_AUTOTUNE`): the engine measures its own throughput and tunes the knobs the user left
//! unset, as Horovod's parameter manager does.
//!
//! What is tuned, in this order: the fusion threshold and the cycle time *jointly*, by Bayesian
//! optimisation ([`bayesian`], on a Gaussian process, [`gaussian_process`]); then the categorical knobs one
//! at a time: the response cache on or off, and hierarchical allreduce / allgather where the job spans
//! hosts. A knob whose variable is set keeps the user's value. The fusion threshold never exceeds the
//! shared-memory staging area (a fused buffer larger than it could not take the staged path) nor 64 MiB.
//!
//! Rank 0 writes each sample and the best values to `RVOD_AUTOTUNE_LOG` ([`log`]).
//!
//! Scoring ([`manager`]): only the global communicator's allreduces count. A *step* is one more
//! reduction of the same tensor name (a training step reduces each gradient once; a burst of N tensors
//! reduces each once), so a sample ends when some tensor has been reduced `RVOD_AUTOTUNE_STEPS_PER_SAMPLE`
//! times since the sample began; its score is the bytes reduced in it divided by its wall time. The first
//! `RVOD_AUTOTUNE_WARMUP_SAMPLES` samples are discarded.
//!
//! Lockstep: only rank 0 (the coordinator) measures and decides. Its decision rides in its next round
//! header ([`TunedValues`](crate::protocol::tuned::TunedValues), see [`crate::protocol::round::RoundHeader`]), which every rank receives in
//! that same round; every rank, rank 0 included, applies the values when that round ends, so the next
//! round plans fusion, consults the cache and picks algorithms with the same values everywhere.
//! With autotune off nothing here runs and headers carry no extra byte.
//!
//! The same path carries values set by hand at run time ([`RequestedValues`](crate::protocol::tuned::RequestedValues), the private
//! `_rvod._set_tuned_values` hook that benchmarks use to compare settings inside one job): rank 0's request
//! rides in its next round header, with autotune on or off, and every rank applies it when that round ends.

pub mod bayesian;
pub mod gaussian_process;
pub mod log;
pub mod manager;
