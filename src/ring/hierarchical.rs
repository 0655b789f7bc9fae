//! Hierarchical collectives for communicators that span hosts: flat algorithms run over the local part
//! (this host's members, shared memory) and the cross part (one member per host, TCP or UCX) of a
//! [`HostParts`], so each byte crosses the network once per host instead of once per rank.
//!
//! Both need a homogeneous layout (every host has the same number of members); the executor takes the
//! flat algorithms elsewhere. Results are identical on every rank. Against the flat algorithms they are
//! bit-identical wherever the combination is exact whatever the order (integers, booleans, min, max,
//! floating-point values whose partial results are exact); otherwise they differ only by rounding, as
//! they combine in a different order.

use crate::ring::allgather::{allgather_ring, allgather_ring_at, allgatherv as flat_allgatherv};
use crate::ring::allreduce::allreduce as flat_allreduce;
use crate::ring::args::{expect_len, invalid_argument};
use crate::ring::chunks::{segment_bounds, Blocks};
use crate::ring::reducescatter::reduce_scatter_ring;
use crate::transport::composite::HostLayout;
use crate::transport::{HostParts, Transport, TransportError};
use crate::types::{Combine, DataType};

fn check_homogeneous(parts: &HostParts<'_>, op: &str) -> Result<(), TransportError> {
    if parts.layout.is_homogeneous() {
        Ok(())
    } else {
        Err(invalid_argument(parts.local.rank(), op, "hosts have different numbers of ranks".into()))
    }
}

/// A step of a hierarchical collective, reported to the caller as it ends on the calling thread (the
/// timeline shows them as the op's phases).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    LocalReduceScatter,
    CrossAllreduce,
    LocalAllgather,
    CrossAllgather,
}

impl Step {
    /// Whether the step runs inside the host (shared memory) rather than across hosts.
    pub fn is_local(self) -> bool {
        matches!(self, Step::LocalReduceScatter | Step::LocalAllgather)
    }

    /// The collective, as the timeline names it.
    pub fn collective(self) -> &'static str {
        match self {
            Step::LocalReduceScatter => "REDUCESCATTER",
            Step::CrossAllreduce => "ALLREDUCE",
            Step::LocalAllgather | Step::CrossAllgather => "ALLGATHER",
        }
    }
}

/// Buffers larger than twice this are reduced in pieces of this size, pipelined (see [`allreduce`]).
pub const PIPELINE_PIECE_BYTES: usize = 4 << 20;

/// Pieces whose cross-host allreduce may be in flight while this thread works on later ones.
const PIPELINE_DEPTH: usize = 2;

/// Allreduce: reduce-scatter inside each host (local rank `i` ends with block `i` reduced over its host),
/// allreduce of block `i` across hosts among the ranks with local rank `i`, allgather inside each host.
///
/// Large buffers go in pieces, and the cross-host allreduces run on a helper thread while this one works
/// inside the host, so the network stays busy during the local phases: this thread reduce-scatters piece
/// `k`, hands it over, and allgathers piece `k - 2` once it comes back. Every rank runs the same sequence of
/// operations on each part, whatever the timing, so the result is the same as without pieces.
///
/// `on_step` hears each step this thread finishes; while pipelined, `CrossAllreduce` is this thread's wait
/// for a piece to come back from across the hosts (the network time the local steps did not hide).
pub fn allreduce(
    parts: HostParts<'_>,
    buf: &mut [u8],
    dtype: DataType,
    combine: Combine,
    on_step: &mut dyn FnMut(Step),
) -> Result<(), TransportError> {
    check_homogeneous(&parts, "hierarchical allreduce")?;
    let HostParts { mut local, mut cross, .. } = parts;
    if buf.len() % dtype.size() != 0 {
        let detail = format!("{} bytes is not a whole number of {dtype} elements", buf.len());
        return Err(invalid_argument(local.rank(), "hierarchical allreduce", detail));
    }
    if buf.is_empty() {
        return Ok(());
    }
    if local.size() == 1 || buf.len() <= 2 * PIPELINE_PIECE_BYTES {
        let blocks = Blocks::even(buf.len() / dtype.size(), local.size(), dtype.size());
        return allreduce_piece(&mut local, &mut cross, buf, &blocks, dtype, combine, on_step);
    }
    let piece = PIPELINE_PIECE_BYTES - PIPELINE_PIECE_BYTES % dtype.size();
    let me = local.rank();
    let width = local.size();
    let blocks_of = |piece: &[u8]| Blocks::even(piece.len() / dtype.size(), width, dtype.size());
    std::thread::scope(|s| {
        let (to_cross, cross_inbox) = std::sync::mpsc::channel::<&mut [u8]>();
        let (cross_done, done_inbox) = std::sync::mpsc::channel::<Result<&mut [u8], TransportError>>();
        let cross = &mut cross;
        let helper = s.spawn(move || {
            for piece in cross_inbox {
                let range = blocks_of(piece).range(me);
                let reduced = flat_allreduce(cross, &mut piece[range], dtype, combine).map(|()| piece);
                let failed = reduced.is_err();
                if cross_done.send(reduced).is_err() || failed {
                    return;
                }
            }
        });
        let pipeline = Pipeline { to_cross: &to_cross, done_inbox: &done_inbox, blocks_of: &blocks_of };
        let result = feed_pipeline(&mut local, buf, piece, &pipeline, dtype, combine, on_step);
        drop(to_cross);
        let helper = helper.join();
        match (result, helper) {
            (Err(e), _) => Err(e),
            (Ok(()), Err(_)) => Err(helper_gone(me)),
            (Ok(()), Ok(())) => Ok(()),
        }
    })
}

/// The channels between this thread and the cross-host helper of a pipelined allreduce.
struct Pipeline<'p, 'b> {
    to_cross: &'p std::sync::mpsc::Sender<&'b mut [u8]>,
    done_inbox: &'p std::sync::mpsc::Receiver<Result<&'b mut [u8], TransportError>>,
    blocks_of: &'p dyn Fn(&[u8]) -> Blocks,
}

/// This thread's side of the pipelined allreduce: reduce-scatter each piece of `buf` in the host, hand it to
/// the cross-host helper, and allgather the pieces it hands back, keeping at most [`PIPELINE_DEPTH`] with it.
fn feed_pipeline<'b>(
    local: &mut dyn Transport,
    buf: &'b mut [u8],
    piece: usize,
    pipeline: &Pipeline<'_, 'b>,
    dtype: DataType,
    combine: Combine,
    on_step: &mut dyn FnMut(Step),
) -> Result<(), TransportError> {
    let mut in_flight = 0;
    for chunk in buf.chunks_mut(piece) {
        reduce_scatter_ring(local, None, chunk, &(pipeline.blocks_of)(chunk), dtype, combine)?;
        on_step(Step::LocalReduceScatter);
        pipeline.to_cross.send(chunk).map_err(|_| helper_gone(local.rank()))?;
        in_flight += 1;
        if in_flight > PIPELINE_DEPTH {
            allgather_returned(local, pipeline, on_step)?;
            in_flight -= 1;
        }
    }
    while in_flight > 0 {
        allgather_returned(local, pipeline, on_step)?;
        in_flight -= 1;
    }
    Ok(())
}

/// Wait for the oldest piece to come back from across the hosts, then allgather it in the host.
fn allgather_returned(
    local: &mut dyn Transport,
    pipeline: &Pipeline<'_, '_>,
    on_step: &mut dyn FnMut(Step),
) -> Result<(), TransportError> {
    let piece = pipeline.done_inbox.recv().map_err(|_| helper_gone(local.rank()))??;
    on_step(Step::CrossAllreduce);
    allgather_ring(local, piece, &(pipeline.blocks_of)(piece))?;
    on_step(Step::LocalAllgather);
    Ok(())
}

fn helper_gone(rank: usize) -> TransportError {
    invalid_argument(rank, "hierarchical allreduce", "the cross-host helper thread stopped".into())
}

/// One piece without pipelining: reduce-scatter in the host, allreduce across hosts, allgather in the host.
fn allreduce_piece(
    local: &mut dyn Transport,
    cross: &mut dyn Transport,
    buf: &mut [u8],
    blocks: &Blocks,
    dtype: DataType,
    combine: Combine,
    on_step: &mut dyn FnMut(Step),
) -> Result<(), TransportError> {
    if local.size() > 1 {
        reduce_scatter_ring(local, None, buf, blocks, dtype, combine)?;
        on_step(Step::LocalReduceScatter);
    }
    flat_allreduce(cross, &mut buf[blocks.range(local.rank())], dtype, combine)?;
    on_step(Step::CrossAllreduce);
    if local.size() > 1 {
        allgather_ring(local, buf, blocks)?;
        on_step(Step::LocalAllgather);
    }
    Ok(())
}

/// Results from this many bytes on are gathered in place where each host's ranks are consecutive
/// ([`allgatherv`]); smaller ones go through scratch buffers, where one local and one cross allgather (Bruck's,
/// where it pays) take fewer steps than the ring in place on more than two hosts.
pub const IN_PLACE_MIN_BYTES: usize = 1 << 20;

/// Allgather with per-rank sizes (`bytes_per_rank` by communicator rank; `recv` in rank order): allgather
/// inside each host, so every rank has its host's blocks; local rank `i` then takes slice `i` of its host's
/// bytes and allgathers it across hosts with the ranks of local rank `i`; a last allgather inside each host
/// completes every host's bytes everywhere.
///
/// Where each host's ranks are consecutive (as launchers number them) and the result is large, every step
/// works in `recv` itself: the host's bytes are then one range of it and each slice lands in its final place,
/// with no buffer of the op's size to allocate (fresh memory of that size costs its page faults: a 64 MiB
/// result on 2 x 2 ranks took 280 ms through scratch buffers, 4 times the flat ring). Elsewhere the steps
/// gather into scratch buffers and the result is reassembled from them.
/// `on_step` hears each of the three steps as it ends.
pub fn allgatherv(
    parts: HostParts<'_>,
    send: &[u8],
    recv: &mut [u8],
    bytes_per_rank: &[usize],
    on_step: &mut dyn FnMut(Step),
) -> Result<(), TransportError> {
    const OP: &str = "hierarchical allgather";
    check_homogeneous(&parts, OP)?;
    let HostParts { layout, mut local, mut cross } = parts;
    let my_index = local.rank();
    expect_len(my_index, OP, "number of per-rank byte counts", bytes_per_rank.len(), layout.size())?;
    let rank_blocks = Blocks::from_lengths(bytes_per_rank, 1)
        .ok_or_else(|| invalid_argument(my_index, OP, "per-rank byte counts overflow".into()))?;
    expect_len(my_index, OP, "receive length in bytes", recv.len(), rank_blocks.total())?;
    if recv.is_empty() {
        return Ok(());
    }
    let host_bytes: Vec<usize> =
        (0..layout.hosts()).map(|h| layout.members(h).iter().map(|&r| bytes_per_rank[r]).sum()).collect();
    let gather = HostBytes { layout, bytes_per_rank, rank_blocks: &rank_blocks, host_bytes: &host_bytes };
    match gather.host_starts().filter(|_| recv.len() >= IN_PLACE_MIN_BYTES) {
        Some(starts) => gather.in_place(&mut local, &mut cross, send, recv, &starts, on_step),
        None => gather.through_scratch(&mut local, &mut cross, send, recv, on_step),
    }
}

/// Where the bytes of each host of an allgather come from and go.
struct HostBytes<'a> {
    layout: &'a HostLayout,
    bytes_per_rank: &'a [usize],
    rank_blocks: &'a Blocks,
    /// Each host's bytes: its members' blocks, in member order.
    host_bytes: &'a [usize],
}

impl HostBytes<'_> {
    /// Slice `i` of host `h`'s bytes: (offset in them, length).
    fn slice(&self, h: usize, i: usize) -> (usize, usize) {
        segment_bounds(self.host_bytes[h], self.layout.members(h).len(), i)
    }

    /// The lengths of this host's members' blocks, in member order.
    fn local_lengths(&self, host: usize) -> Vec<usize> {
        self.layout.members(host).iter().map(|&r| self.bytes_per_rank[r]).collect()
    }

    /// Where each host's bytes start in the result, when every host's members are consecutive ranks in
    /// order (so its bytes are one range of the result); `None` otherwise.
    fn host_starts(&self) -> Option<Vec<usize>> {
        (0..self.layout.hosts())
            .map(|h| {
                let members = self.layout.members(h);
                let consecutive = members.windows(2).all(|pair| pair[1] == pair[0] + 1);
                consecutive.then(|| members.first().map_or(0, |&first| self.rank_blocks.range(first).start))
            })
            .collect()
    }

    /// The three steps in `recv`, host `h`'s bytes at `starts[h]`.
    fn in_place(
        &self,
        local: &mut dyn Transport,
        cross: &mut dyn Transport,
        send: &[u8],
        recv: &mut [u8],
        starts: &[usize],
        on_step: &mut dyn FnMut(Step),
    ) -> Result<(), TransportError> {
        let (my_host, my_index) = (cross.rank(), local.rank());
        let region = |h: usize| starts[h]..starts[h] + self.host_bytes[h];
        flat_allgatherv(local, send, &mut recv[region(my_host)], &self.local_lengths(my_host))?;
        on_step(Step::LocalAllgather);
        let slice_at = |h: usize, i: usize| {
            let (offset, len) = self.slice(h, i);
            starts[h] + offset..starts[h] + offset + len
        };
        allgather_ring_at(cross, recv, &|h| slice_at(h, my_index))?;
        on_step(Step::CrossAllgather);
        for h in (0..self.layout.hosts()).filter(|&h| h != my_host) {
            allgather_ring_at(local, recv, &|i| slice_at(h, i))?;
        }
        on_step(Step::LocalAllgather);
        Ok(())
    }

    /// The three steps through scratch buffers, for any homogeneous layout.
    fn through_scratch(
        &self,
        local: &mut dyn Transport,
        cross: &mut dyn Transport,
        send: &[u8],
        recv: &mut [u8],
        on_step: &mut dyn FnMut(Step),
    ) -> Result<(), TransportError> {
        let (my_host, my_index, width) = (cross.rank(), local.rank(), local.size());
        let hosts = self.layout.hosts();
        let mut host_block = vec![0u8; self.host_bytes[my_host]];
        flat_allgatherv(local, send, &mut host_block, &self.local_lengths(my_host))?;
        on_step(Step::LocalAllgather);

        let (start, len) = self.slice(my_host, my_index);
        let cross_lengths: Vec<usize> = (0..hosts).map(|h| self.slice(h, my_index).1).collect();
        let mut my_slices = vec![0u8; cross_lengths.iter().sum()];
        flat_allgatherv(cross, &host_block[start..start + len], &mut my_slices, &cross_lengths)?;
        on_step(Step::CrossAllgather);

        // Block `i` of `by_index`: slice `i` of every host, in host order.
        let index_lengths: Vec<usize> = (0..width).map(|i| (0..hosts).map(|h| self.slice(h, i).1).sum()).collect();
        let mut by_index = vec![0u8; index_lengths.iter().sum()];
        flat_allgatherv(local, &my_slices, &mut by_index, &index_lengths)?;
        on_step(Step::LocalAllgather);

        // Reassemble each host's bytes (host-major), then place each rank's block.
        let mut host_major = vec![0u8; self.host_bytes.iter().sum()];
        let host_start: Vec<usize> =
            self.host_bytes.iter().scan(0, |acc, &b| Some(std::mem::replace(acc, *acc + b))).collect();
        let mut read = 0;
        for i in 0..width {
            for (h, start) in host_start.iter().enumerate() {
                let (offset, len) = self.slice(h, i);
                let at = start + offset;
                host_major[at..at + len].copy_from_slice(&by_index[read..read + len]);
                read += len;
            }
        }
        let mut at = 0;
        for h in 0..hosts {
            for &rank in self.layout.members(h) {
                let range = self.rank_blocks.range(rank);
                recv[range.clone()].copy_from_slice(&host_major[at..at + range.len()]);
                at += range.len();
            }
        }
        Ok(())
    }
}
