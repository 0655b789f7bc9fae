//! Who runs a communicator's [`Loop`]: its engine thread, or a caller waiting for its own op.
//!
//! The loop sits behind a mutex; whoever holds it runs [`Loop::step`]s. Where the transport can be waited
//! on without borrowing it (an [`IdleWaiter`]: shared memory, a job of one rank), a caller that waits for
//! an op runs the loop itself, with the GIL released, as an MPI rank progresses its own operations: a
//! synchronous op is queued without waking the engine thread ([`Driver::drive`]), and the caller then
//! steps the loop while it waits ([`Driver::wait_driving`]), sleeping on the transport between steps.
//! A small op then costs no hand-off to the engine thread and back (two thread wake-ups, most of the time
//! of a 4-byte allreduce).
//!
//! The engine thread runs the loop when no caller does: it steps, and sleeps on the transport when there is
//! nothing to do. While callers drive, and until a whole [`PARK`] passes without one, it sleeps on the waker
//! alone, so that peers publishing bytes do not wake it (waking it would cost every publish a futex
//! wake-up and this rank's caller a context switch); a submission or a stop still wakes it at once, and a
//! peer's round that no caller answers is answered when the park ends. Over TCP the engine thread keeps the
//! loop while it sleeps in `poll(2)`, and callers wait for it as before.
//!
//! A caller never sleeps for work while it holds the loop, runs at most [`MAX_CALLER_STEPS`] steps at a
//! time, and returns to its interruptible wait (Ctrl-C) at the end of each wait slice; a round it starts
//! ends as soon as the peers answer (their engine or their waiting caller answers every round).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use crate::engine::fast_lane::{SmallOp, SmallOutcome};
use crate::engine::handles::HandleId;
use crate::engine::shared::Shared;
use crate::engine::step::{Loop, Mode, Step, JOIN_GRACE};
use crate::transport::IdleWaiter;

/// Most steps a caller runs before it lets go of the loop and looks at its op again.
const MAX_CALLER_STEPS: usize = 8;
/// How long the engine thread sleeps at a time while it leaves the transport to callers (see the module doc).
const PARK: Duration = Duration::from_millis(1);
/// Longest sleep of a waiting caller on the transport before it checks its op again (another thread may
/// have completed it without ringing).
const CALLER_SLEEP: Duration = Duration::from_millis(1);
/// How long a waiting caller sleeps on its op's completion when another thread holds the loop.
const LOOP_BUSY_SLEEP: Duration = Duration::from_micros(200);

/// A communicator's loop and how its engine thread sleeps.
pub(crate) struct Driver {
    the_loop: Mutex<Loop>,
    /// `Some` where callers may run the loop (see the module doc).
    waiter: Option<Box<dyn IdleWaiter>>,
    shared: Arc<Shared>,
    /// Callers waiting for their ops and driving the loop now (the fast lane is not counted: see `run_small`).
    drivers: AtomicUsize,
    /// Bumped whenever a caller stops driving: the engine thread parks while it moves (see `callers_active`).
    drives: AtomicU64,
    /// Rounds callers ran (for diagnostics and tests: how often small ops avoided the hand-off).
    caller_rounds: AtomicU64,
}

/// What a caller's steps came to.
enum Driven {
    /// Its op is done (or the loop ended: the op's handle carries the error).
    Done,
    /// Its op waits for the peers; nothing else to do now.
    Waiting,
    /// Another thread holds the loop.
    Busy,
    /// The loop ended while this caller ran it: the engine thread must wind it up.
    Ended,
}

impl Driver {
    pub(crate) fn new(the_loop: Loop, waiter: Option<Box<dyn IdleWaiter>>, shared: Arc<Shared>) -> Driver {
        Driver {
            the_loop: Mutex::new(the_loop),
            waiter,
            shared,
            drivers: AtomicUsize::new(0),
            drives: AtomicU64::new(0),
            caller_rounds: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Loop> {
        self.the_loop.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The engine thread: step until the loop ends, then close the transport and fail what is pending.
    pub(crate) fn run_engine_thread(&self) {
        let Some(waiter) = self.waiter.as_deref() else {
            let mut the_loop = self.lock();
            while !matches!(the_loop.step(Mode::Sleep), Step::Finished) {}
            the_loop.wind_up();
            return;
        };
        let mut answer_peers = false;
        let mut drives_seen = self.drives.load(Ordering::SeqCst);
        loop {
            if self.callers_active(&mut drives_seen) {
                self.sleep(|| {
                    self.shared.waker.wait(PARK);
                });
                if !self.shared.waker.is_signalled() {
                    continue; // park again while callers keep driving
                }
            }
            let mut the_loop = self.lock();
            match the_loop.step(Mode::Poll { answer_peers, batch: true }) {
                Step::Progress => answer_peers = false,
                Step::Finished => {
                    the_loop.wind_up();
                    return;
                }
                Step::Idle { timeout, peer_waiting } => {
                    drop(the_loop);
                    self.sleep(|| {
                        if peer_waiting {
                            // A peer started a round: give this rank's own op (about to be submitted, in a
                            // lockstep loop) the chance to join it, by the engine or by its caller.
                            self.shared.waker.wait(JOIN_GRACE);
                        } else if !self.callers_active(&mut drives_seen.clone()) {
                            waiter.wait(&self.shared.waker, timeout);
                        }
                    });
                    answer_peers = peer_waiting;
                }
            }
        }
    }

    /// Whether the engine thread should leave the transport to callers (see the module doc): some drive the
    /// loop now, or some drove it since the engine thread last looked (`seen`, updated).
    fn callers_active(&self, seen: &mut u64) -> bool {
        let drives = self.drives.load(Ordering::SeqCst);
        let moved = drives != *seen;
        *seen = drives;
        moved || self.drivers.load(Ordering::SeqCst) > 0
    }

    /// Sleep with `how`, announced as idle so that submissions wake the engine thread; a submission made
    /// before the announcement is seen by the check after it (SeqCst on both sides, see
    /// `Communicator::enqueue`).
    fn sleep(&self, how: impl FnOnce()) {
        self.shared.idle.store(true, Ordering::SeqCst);
        if !self.shared.has_queued() {
            how();
        }
        self.shared.idle.store(false, Ordering::SeqCst);
    }

    /// A caller whose op `id` was queued without waking the engine thread: run the loop here if it is free;
    /// if another thread holds it, wake the engine thread (the op must not wait unseen). The caller then
    /// waits with [`wait_driving`](Self::wait_driving).
    pub(crate) fn drive(&self, id: HandleId) {
        if self.waiter.is_none() {
            // As an asynchronous submission does: a busy engine thread picks the op up by itself.
            if self.shared.idle.load(Ordering::SeqCst) {
                self.shared.waker.wake();
            }
            return;
        }
        self.drivers.fetch_add(1, Ordering::SeqCst);
        let driven = self.steps_for(id);
        self.leave();
        if matches!(driven, Driven::Busy | Driven::Ended) {
            self.shared.waker.wake();
        }
    }

    /// Whether every peer has already sent this rank something (the next round's header, in a lockstep
    /// loop), so that a fast-lane op started now is not expected to wait for them.
    pub(crate) fn peers_sent(&self) -> bool {
        self.waiter.as_deref().is_some_and(IdleWaiter::every_peer_sent)
    }

    /// Run `op` on this thread by the fast lane (see [`super::fast_lane`]) if callers may run the loop and it
    /// is free; otherwise it is not run. `out` receives an out-of-place result.
    pub(crate) fn run_small<'a>(&self, op: SmallOp<'a>, out: &mut Vec<u8>) -> SmallOutcome<'a> {
        if self.waiter.is_none() {
            return SmallOutcome::NotRun(op);
        }
        let mut the_loop = match self.the_loop.try_lock() {
            Ok(the_loop) => the_loop,
            Err(TryLockError::WouldBlock) => return SmallOutcome::NotRun(op),
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        };
        let outcome = the_loop.run_small(op, out);
        let ended = the_loop.is_finished();
        if !matches!(outcome, SmallOutcome::NotRun(_)) {
            self.count_caller_round();
        }
        // Not counted in `drivers`, and `drives` bumped by a plain load and store under the loop's lock: the
        // engine thread parks on `drives` moving (and meets the lock if it woke meanwhile), so an op costs no
        // atomic read-modify-write here. A bump lost to a waiting caller's at the same moment still moves it.
        self.drives.store(self.drives.load(Ordering::Relaxed).wrapping_add(1), Ordering::Release);
        drop(the_loop);
        if ended {
            // The engine thread winds the loop up.
            self.shared.waker.wake();
        }
        outcome
    }

    /// Wait up to `slice` for `id`, running the loop whenever it is free and sleeping on the transport in
    /// between. Returns at once where callers do not run the loop.
    pub(crate) fn wait_driving(&self, id: HandleId, slice: Duration) {
        let Some(waiter) = self.waiter.as_deref() else { return };
        let deadline = Instant::now() + slice;
        self.drivers.fetch_add(1, Ordering::SeqCst);
        loop {
            let driven = self.steps_for(id);
            let left = deadline.saturating_duration_since(Instant::now());
            match driven {
                Driven::Done => break,
                Driven::Ended => {
                    self.shared.waker.wake();
                    break;
                }
                _ if left.is_zero() => break,
                Driven::Waiting => waiter.wait(&self.shared.waker, left.min(CALLER_SLEEP)),
                Driven::Busy => {
                    self.shared.handles.wait_done(id, left.min(LOOP_BUSY_SLEEP));
                }
            }
        }
        self.leave();
    }

    /// Run steps for the caller of `id` while the loop is free, the op pending and progress being made.
    fn steps_for(&self, id: HandleId) -> Driven {
        if self.shared.handles.is_done(id) != Some(false) {
            return Driven::Done;
        }
        let mut the_loop = match self.the_loop.try_lock() {
            Ok(the_loop) => the_loop,
            Err(TryLockError::WouldBlock) => return Driven::Busy,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        };
        for _ in 0..MAX_CALLER_STEPS {
            let step = the_loop.step(Mode::Poll { answer_peers: true, batch: false });
            if matches!(step, Step::Progress) {
                self.count_caller_round();
            }
            match step {
                Step::Progress if self.shared.handles.is_done(id) == Some(false) => {}
                Step::Progress => return Driven::Done,
                Step::Finished => return Driven::Ended,
                Step::Idle { .. } => break,
            }
        }
        if self.shared.handles.is_done(id) == Some(false) {
            Driven::Waiting
        } else {
            Driven::Done
        }
    }

    /// Count a round a caller ran; only a holder of the loop's lock calls this, so a load and a store suffice.
    fn count_caller_round(&self) {
        self.caller_rounds.store(self.caller_rounds.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    /// Steps that made progress run by callers so far.
    pub(crate) fn caller_rounds(&self) -> u64 {
        self.caller_rounds.load(Ordering::Relaxed)
    }

    /// A caller stops driving.
    fn leave(&self) {
        self.drives.fetch_add(1, Ordering::SeqCst);
        self.drivers.fetch_sub(1, Ordering::SeqCst);
    }
}
