//! The fast lane: a small synchronous collective run by its caller as one exchange of round headers,
//! without the handle and tensor tables.
//!
//! In steady state a script's small synchronous ops (a metric's allreduce, a barrier, a small broadcast or
//! allgather) are response-cache hits whose data rides in the round header (see [`rides_in_header`]): the
//! round is the whole op. The fast lane runs that round directly. It sends the header the ordinary round would send
//! for this op alone ([`frame_single_hit`]: the one hit, its data), and compares each peer's header with
//! its own byte for byte, the data aside. When every peer's says the same (every rank is in the same
//! steady state), the verdict needs no decoding: the op is complete, folded from the headers' data as the
//! round's eager path folds it ([`fold_contributions`], or [`concatenate`] for an allgather), so every rank
//! gets the same bits whichever path it took. Anything else (a peer with other work or a different op, a stop, a join, an invalid bit, autotuned
//! values) and the headers are decoded and decided by the ordinary round, with this op put in the tables
//! as the hit it announced: the fast lane sends nothing the ordinary round would not, so ranks on either
//! path work together, and every check the round makes (mismatches, stalls, shutdown) still happens.
//!
//! It runs where callers may run the loop ([`super::driver`]: shared memory, one-rank jobs), when this
//! rank has nothing else pending or to announce, records no timeline and runs no autotuner; otherwise the
//! op is not run ([`SmallOutcome::NotRun`]) and the caller submits it as usual.

use std::time::{Duration, Instant};

use crate::coordinator::negotiation::{count_sent, decode_message, frame_single_hit, recv_body, rides_in_header};
use crate::coordinator::pending::Announcement;
use crate::engine::execute::{combine_of, concatenate, effective_postscale, fold_contributions};
use crate::engine::handles::HandleId;
use crate::engine::metrics::METRICS;
use crate::engine::step::{naming_tensor, Loop, Scratch};
use crate::engine::table::TensorEntry;
use crate::error::EngineError;
use crate::protocol::message::{OpParams, Request};
use crate::protocol::round::RoundHeader;
use crate::tensor::RawTensor;
use crate::transport::{Transport, TransportError};
use crate::types::CollectiveKind;

/// A small synchronous collective: an allreduce, broadcast or allgather small enough to ride in the round
/// header, or a barrier.
#[derive(Debug)]
pub struct SmallOp<'a> {
    /// The name ranks match it by (`BARRIER_NAME` for a barrier).
    pub name: &'a str,
    /// Its parameters (no splits, no parts, in host memory). A broadcast's root is a global rank as the
    /// caller gives it, a communicator rank once a communicator runs it (see `Communicator::run_small`).
    pub params: OpParams,
    /// The caller's tensor (empty for a barrier); an in-place op's result is written into it.
    pub input: RawTensor,
    pub in_place: bool,
}

/// What became of a [`SmallOp`].
#[derive(Debug)]
pub enum SmallOutcome<'a> {
    /// Complete on this rank; an out-of-place result of this many bytes is at the start of the caller's `out`.
    Done(usize),
    /// Not run and nothing sent: submit it the ordinary way.
    NotRun(SmallOp<'a>),
    /// The headers showed more than this op: it is in the ordinary tables now, under this handle.
    Queued(HandleId),
    /// This op's error: the exchange failed, which ends the loop, or another thread has an op of the same
    /// name in flight.
    Failed(EngineError),
}

impl SmallOp<'_> {
    /// The data that rides in its header: the tensor, except for a barrier.
    fn payload(&self) -> Option<&[u8]> {
        (self.params.kind != CollectiveKind::Barrier).then(|| self.input.as_slice())
    }

    /// Whether its data, if any, rides in the header (up to `limit` bytes). An allgather's result is read
    /// as every rank's rows (all as many as this rank's, see [`Loop::complete_small`]), which takes rows of
    /// at least one byte.
    fn rides(&self, limit: usize) -> bool {
        match self.params.kind {
            CollectiveKind::Barrier => true,
            CollectiveKind::Allgather if self.params.shape.is_empty() || self.input.is_empty() => false,
            kind => rides_in_header(kind, self.params.reduce_op, self.params.compression, self.input.len(), limit),
        }
    }
}

/// Send `frame` to every other rank and receive each one's next message into `bodies[peer]`.
fn exchange_frames(t: &mut dyn Transport, frame: &[u8], bodies: &mut [Vec<u8>]) -> Result<(), TransportError> {
    let me = t.rank();
    for peer in (0..t.size()).filter(|&p| p != me) {
        t.send(peer, frame)?;
    }
    count_sent(t.size() - 1);
    for peer in (0..t.size()).filter(|&p| p != me) {
        recv_body(t, peer, &mut bodies[peer])?;
    }
    Ok(())
}

impl Loop {
    /// Run `op` as one exchange of headers if this rank is in steady state (see the module doc); `out`
    /// receives an out-of-place result (grown to its size if shorter).
    pub(crate) fn run_small<'a>(&mut self, op: SmallOp<'a>, out: &mut Vec<u8>) -> SmallOutcome<'a> {
        let Some(bit) = self.steady_bit(&op) else { return SmallOutcome::NotRun(op) };
        let me = self.transport.rank();
        let mut scratch = std::mem::take(&mut self.fast);
        scratch.frame = frame_single_hit(std::mem::take(&mut scratch.frame), bit, op.payload());
        scratch.bodies.resize_with(self.transport.size(), Vec::new);
        let outcome = match exchange_frames(&mut *self.transport, &scratch.frame, &mut scratch.bodies) {
            Err(e) => self.fail_small(&op, e),
            Ok(()) if every_peer_said_the_same(&scratch, me, op.input.len()) => {
                let mut op = op;
                let result_len = self.complete_small(&mut op, &scratch, out);
                METRICS.round(1, 0, Duration::ZERO);
                METRICS.ran(op.params.kind, 1, op.input.len());
                self.negotiator.ran_steady_hit(bit);
                self.rounds += 1;
                SmallOutcome::Done(result_len)
            }
            Ok(()) => self.queue_small(op, bit, &scratch),
        };
        self.fast = scratch;
        outcome
    }

    /// The cache bit `op` hits if this rank may run it by the fast lane.
    fn steady_bit(&self, op: &SmallOp<'_>) -> Option<usize> {
        let idle = self.finished.is_none()
            && self.autotune.is_none()
            && self.table.is_empty()
            && !self.shared.timeline.is_on()
            && self.shared.stop_requested().is_none()
            && !self.shared.has_queued()
            && !self.shared.has_requested_values();
        if !(idle && op.rides(self.negotiator.eager_limit())) {
            return None;
        }
        self.negotiator.steady_hit(op.name, &op.params)
    }

    /// Every peer sent the header this rank sent, and the same amount of data: write the result (into `out`,
    /// or into the input for an in-place op) and return an out-of-place result's length. Every rank hit the
    /// same cached allgather with as many bytes as this one, so with as many rows: the rows' shape is part of
    /// what the cache matched, and the fast lane takes no allgather of empty rows.
    fn complete_small(&self, op: &mut SmallOp<'_>, scratch: &Scratch, out: &mut Vec<u8>) -> usize {
        let (me, n) = (self.transport.rank(), self.transport.size());
        let len = op.input.len();
        let result_len = if op.params.kind == CollectiveKind::Allgather { n * len } else { len };
        if out.len() < result_len {
            out.resize(result_len, 0);
        }
        let data_at = scratch.frame.len() - 4 - len;
        let peer_data = |rank: usize| scratch.bodies.get(rank).and_then(|body| body.get(data_at..));
        match op.params.kind {
            CollectiveKind::Allreduce => {
                let out = &mut out[..len];
                let input = op.input.as_slice();
                let contributions = (0..n).map(|rank| if rank == me { Some(input) } else { peer_data(rank) });
                let p = &op.params;
                let postscale = effective_postscale(p.reduce_op, p.postscale, n);
                fold_contributions(contributions, p.dtype, combine_of(p.reduce_op), p.prescale, postscale, out);
                if op.in_place {
                    op.input.as_mut_slice().copy_from_slice(out);
                }
            }
            CollectiveKind::Broadcast => match usize::try_from(op.params.root_rank).ok().filter(|&root| root != me) {
                // The root's tensor already holds the result.
                None if op.in_place => {}
                None => out[..len].copy_from_slice(op.input.as_slice()),
                Some(root) => {
                    if let Some(data) = peer_data(root) {
                        let dst = if op.in_place { op.input.as_mut_slice() } else { &mut out[..len] };
                        dst.copy_from_slice(data);
                    }
                }
            },
            CollectiveKind::Allgather => {
                let input = op.input.as_slice();
                let parts = (0..n).map(|rank| if rank == me { input } else { peer_data(rank).unwrap_or_default() });
                concatenate(parts, &mut out[..result_len]);
            }
            _ => {}
        }
        result_len
    }

    /// The headers said more than this op: decode them, put the op in the tables as the hit it announced,
    /// and let the ordinary round decide (it may complete the op right away, or leave it for later rounds).
    fn queue_small<'a>(&mut self, op: SmallOp<'_>, bit: usize, scratch: &Scratch) -> SmallOutcome<'a> {
        let (me, n) = (self.transport.rank(), self.transport.size());
        let mut headers = Vec::with_capacity(n);
        for peer in 0..n {
            if peer == me {
                headers.push(RoundHeader::single_hit(bit, op.payload()));
                continue;
            }
            match decode_message::<RoundHeader>(peer, &scratch.bodies[peer]) {
                Ok(header) => headers.push(header),
                Err(e) => return self.fail_small(&op, e),
            }
        }
        let slots = usize::from(op.params.kind != CollectiveKind::Barrier);
        let names = [op.name.to_string()];
        let handle = match self.shared.handles.register(op.params.kind.name(), self.shared.set_id, &names, 1, slots) {
            Ok(handle) => handle,
            Err(err) => {
                // Another thread submitted an op of this name meanwhile, which holds the name: this one
                // fails as a second op of a name in flight does, and the round goes on without it.
                self.finish_round(headers);
                return SmallOutcome::Failed(err);
            }
        };
        let entry = TensorEntry {
            handle,
            index: 0,
            // The request the ordinary path would have made for it.
            request: Request { rank: me as u32, name: op.name.to_string(), params: op.params },
            input: op.input,
            in_place: op.in_place,
            submitted: Instant::now(),
            packed: None,
            device: None,
            into: None,
        };
        self.table.insert_announced(entry, Announcement::CacheHit(bit));
        // A round that ends the loop fails what is pending, this op included, when the loop winds up.
        self.finish_round(headers);
        SmallOutcome::Queued(handle)
    }

    /// The exchange failed: the loop ends as a failed round ends it; the op fails with the error.
    fn fail_small<'a>(&mut self, op: &SmallOp<'_>, e: TransportError) -> SmallOutcome<'a> {
        let err = self.transport_failure("negotiation", e);
        tracing::error!("rank {}: {err}", self.config.topology.rank);
        let own = naming_tensor(&err, op.params.kind, op.name);
        self.finished = Some(Err(err));
        SmallOutcome::Failed(own)
    }
}

/// Whether every peer's header body is this rank's own (in `scratch.frame`, after its length) but for
/// the last `data_len` bytes, its data.
fn every_peer_said_the_same(scratch: &Scratch, me: usize, data_len: usize) -> bool {
    let own = &scratch.frame[4..];
    let same_until = own.len() - data_len;
    scratch
        .bodies
        .iter()
        .enumerate()
        .all(|(peer, body)| peer == me || (body.len() == own.len() && body[..same_until] == own[..same_until]))
}
