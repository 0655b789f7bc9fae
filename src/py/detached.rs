//! The one way a call from Python blocks: with the GIL released, turning Ctrl-C into `KeyboardInterrupt`.
//!
//! Every blocking call of `rvod._rvod` goes through [`detached`] (a wait in slices, checking for signals
//! between them) or [`detached_once`] (one call that cannot be sliced: it returns on its own, by its timeout
//! or its peers'). Nothing else in `py/` releases the GIL. Modelled on tokenizers' `detached` helpers.

use std::time::Duration;

use pyo3::prelude::*;

/// How long one slice of a wait lasts before checking for signals.
pub const WAIT_SLICE: Duration = Duration::from_millis(50);

/// Call `step(WAIT_SLICE)` with the GIL released until it returns `Some`; between calls a pending signal
/// runs its Python handler, so Ctrl-C raises `KeyboardInterrupt` here within a slice. `step` waits at most
/// about the slice it is given.
pub fn detached<T: Send>(py: Python<'_>, mut step: impl FnMut(Duration) -> Option<T> + Send) -> PyResult<T> {
    loop {
        #[allow(clippy::disallowed_methods)] // the one place (clippy.toml)
        if let Some(done) = py.allow_threads(|| step(WAIT_SLICE)) {
            return Ok(done);
        }
        py.check_signals()?;
    }
}

/// The engine's way to wait without the GIL (see `engine::small_op`): [`detached_once`].
pub struct Detached<'py>(pub Python<'py>);

impl crate::engine::small_op::Detach for Detached<'_> {
    fn detach<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        detached_once(self.0, f)
    }
}

/// Call `f` once with the GIL released (a call that cannot be sliced, or one too short to need it). A
/// Ctrl-C meanwhile raises `KeyboardInterrupt` once it returns, as Python raises it at its next instruction.
pub fn detached_once<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    #[allow(clippy::disallowed_methods)] // the one place (clippy.toml)
    py.allow_threads(f)
}
