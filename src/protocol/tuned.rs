//! The values of the tunable knobs that rank 0 sends in its round header ([`TunedValues`]), and the ones a
//! user sets by hand at run time ([`RequestedValues`]); see [`crate::autotune`] for who decides them and when
//! every rank applies them.

use std::time::Duration;

use crate::protocol::codec::{DecodeError, Wire, WireReader, WireWriter};

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
