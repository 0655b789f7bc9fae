//! Argument checks shared by the collectives. A violation is a caller bug, reported as an
//! `InvalidInput` I/O error naming the collective and this rank instead of a panic.

use std::io;

use crate::transport::TransportError;

/// The error for a collective called with inconsistent arguments on `rank`.
pub(crate) fn invalid_argument(rank: usize, collective: &str, detail: String) -> TransportError {
    TransportError::Io {
        peer: rank,
        source: io::Error::new(io::ErrorKind::InvalidInput, format!("{collective}: {detail}")),
    }
}

/// Fails unless `actual == expected`; `what` names the quantity in the message.
pub(crate) fn expect_len(
    rank: usize,
    collective: &str,
    what: &str,
    actual: usize,
    expected: usize,
) -> Result<(), TransportError> {
    if actual == expected {
        Ok(())
    } else {
        Err(invalid_argument(rank, collective, format!("{what} is {actual}, expected {expected}")))
    }
}
