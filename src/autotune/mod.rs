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
//! header ([`TunedValues`], see [`crate::coordinator::round::RoundHeader`]), which every rank receives in
//! that same round; every rank, rank 0 included, applies the values when that round ends, so the next
//! round plans fusion, consults the cache and picks algorithms with the same values everywhere.
//! With autotune off nothing here runs and headers carry no extra byte.
//!
//! The same path carries values set by hand at run time ([`RequestedValues`], the private
//! `_rvod._set_tuned_values` hook that benchmarks use to compare settings inside one job): rank 0's request
//! rides in its next round header, with autotune on or off, and every rank applies it when that round ends.

pub mod bayesian;
pub mod gaussian_process;
pub mod log;
pub mod manager;

use std::time::Duration;

use crate::coordinator::codec::{DecodeError, Wire, WireReader, WireWriter};

/// The tunable knobs' values, as applied by every rank at the same round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunedValues {
    /// Largest fused buffer in bytes (0: no fusion).
    pub fusion_threshold: usize,
    pub cycle_time: Duration,
    /// The response cache is used (its capacity is the configured one) or bypassed.
    pub cache_enabled: bool,
    /// Forced on or off, or left to the executor (`None`), as `RVOD_HIERARCHICAL_*`.
    pub hierarchical_allreduce: Option<bool>,
    pub hierarchical_allgather: Option<bool>,
}

/// Knobs set by hand at run time (`_rvod._set_tuned_values`). Only rank 0's request counts: its loop sends it
/// as [`TunedValues`] (the hierarchical choices as they stand) in its next round header on the global
/// communicator, in a round that carries no announcement of the autotuner's, and every rank applies it when
/// that round ends; other ranks' requests are dropped. A tuning still in progress would announce its own
/// next values over it, so it is meant for after tuning is done or for autotune off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestedValues {
    pub fusion_threshold: usize,
    pub cycle_time: Duration,
    pub cache_enabled: bool,
}

fn encode_choice(choice: Option<bool>) -> u8 {
    match choice {
        None => 0,
        Some(false) => 1,
        Some(true) => 2,
    }
}

fn decode_choice(r: &mut WireReader<'_>, what: &'static str) -> Result<Option<bool>, DecodeError> {
    match r.u8(what)? {
        0 => Ok(None),
        1 => Ok(Some(false)),
        2 => Ok(Some(true)),
        tag => Err(DecodeError::BadTag { what, tag }),
    }
}

impl Wire for TunedValues {
    fn encode(&self, w: &mut WireWriter) {
        w.put_u64(self.fusion_threshold as u64);
        w.put_u64(u64::try_from(self.cycle_time.as_nanos()).unwrap_or(u64::MAX));
        w.put_bool(self.cache_enabled);
        w.put_u8(encode_choice(self.hierarchical_allreduce));
        w.put_u8(encode_choice(self.hierarchical_allgather));
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let fusion_threshold = usize::try_from(r.u64("tuned fusion threshold")?)
            .map_err(|_| DecodeError::BadTag { what: "tuned fusion threshold", tag: 0xff })?;
        Ok(TunedValues {
            fusion_threshold,
            cycle_time: Duration::from_nanos(r.u64("tuned cycle time")?),
            cache_enabled: r.bool("tuned cache flag")?,
            hierarchical_allreduce: decode_choice(r, "tuned hierarchical allreduce")?,
            hierarchical_allgather: decode_choice(r, "tuned hierarchical allgather")?,
        })
    }
}
