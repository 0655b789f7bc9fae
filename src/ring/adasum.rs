//! Adasum allreduce (adaptive summation, Horovod's `op=Adasum`): every rank's buffer becomes the
//! Adasum combination of all ranks' buffers, tensor by tensor, with identical bits on every rank.
//!
//! Two vectors combine as `(1 - a·b / (2|a|²)) a + (1 - a·b / (2|b|²)) b`, where a coefficient is 1 if its
//! vector's squared norm is below `sqrt(f64::MIN_POSITIVE)` (Horovod's threshold): orthogonal vectors add,
//! equal vectors give themselves. A buffer holds several tensors back to back (a fusion buffer); each
//! tensor gets its own dot product, norms and coefficients, so fusing never changes a result.
//!
//! Combination order, for `n` ranks and `p` the largest power of two `<= n`:
//! 1. Fold: each rank `r >= p` sends its buffer to rank `r - p`, which combines the two (its own vector as
//!    `a`), so the `p` lower ranks each hold one vector or a pair.
//! 2. Horovod's vector-halving, distance-doubling tree over ranks `0..p`: at distance `d = 1, 2, 4, ...`
//!    the groups of `d` ranks `[k·2d, k·2d + d)` and `[k·2d + d, (k+1)·2d)` combine their vectors (the
//!    lower group's as `a`). Partners at distance `d` split the slice they hold in two halves (the lower
//!    rank keeps the first, elements rounded down), swap the other halves, compute partial dot products
//!    and squared norms of each tensor on the half they kept, sum them (in f64) over the `2d` ranks of the
//!    group so that every coefficient sees whole tensors, and combine their half. Then the halves travel
//!    back in the mirror order, so every rank of `0..p` holds the whole result.
//! 3. Each rank `r - p` sends the result to rank `r >= p`.
//!
//! So 4 ranks compute `((g0, g1), (g2, g3))`, 3 ranks `((g0, g2), g1)` and 5 ranks
//! `(((g0, g4), g1), (g2, g3))`. Each element of the result is computed by exactly one rank and copied
//! to the others, which is why every rank ends with the same bits. Arithmetic is in f64 (dot products,
//! norms, coefficients and the scaled add), rounded once to the element type.
//!
//! [`adasum_allreduce_hierarchical`] is Horovod's GPU variant for communicators that span hosts: a sum
//! inside each host, the same order across hosts on each host rank's block (dot products and norms also
//! summed over the host's ranks), the host average, and an allgather inside each host (docs/adasum.md).

use half::f16;

use crate::ring::allgather::{allgather_ring, allgatherv};
use crate::ring::args::invalid_argument;
use crate::ring::bfloat16::{bf16_to_f32, f32_to_bf16};
use crate::ring::chunks::Blocks;
use crate::ring::reduce::scale_in_place;
use crate::ring::reducescatter::reduce_scatter_ring;
use crate::transport::{HostParts, Transport, TransportError};
use crate::types::{Combine, DataType};

/// A squared norm below this leaves its vector's coefficient at 1 (Horovod's `sqrt(DBL_MIN)`).
pub fn norm_threshold() -> f64 {
    f64::MIN_POSITIVE.sqrt()
}

/// The Adasum coefficients `(a_coeff, b_coeff)` of two vectors with dot product `dot` and squared norms
/// `a_norm2`, `b_norm2`.
pub fn coefficients(dot: f64, a_norm2: f64, b_norm2: f64) -> (f64, f64) {
    let coefficient = |norm2: f64| if norm2 >= norm_threshold() { 1.0 - dot / norm2 * 0.5 } else { 1.0 };
    (coefficient(a_norm2), coefficient(b_norm2))
}

/// Combine `buf` across all ranks with Adasum, in place. `counts` are the element counts of the tensors
/// laid out back to back in `buf` (they must add up to its length); every rank passes the same counts.
/// Only floating-point types are accepted.
/// `scratch` is working memory, grown as needed and worth keeping between calls.
pub fn adasum_allreduce(
    t: &mut dyn Transport,
    buf: &mut [u8],
    dtype: DataType,
    counts: &[usize],
    scratch: &mut Vec<u8>,
) -> Result<(), TransportError> {
    let bounds = checked_bounds(t.rank(), buf, dtype, counts)?;
    if t.size() <= 1 || buf.is_empty() {
        return Ok(());
    }
    adasum_part(t, None, buf, 0, dtype, &bounds, scratch)
}

/// Hierarchical Adasum for a communicator that spans hosts (Horovod's GPU variant): the buffer is summed
/// inside each host by a reduce-scatter (local index `i` ends with block `i` of its host's sum), block `i`
/// is combined with Adasum across hosts among the ranks of local index `i` (the order of the module doc,
/// with hosts for ranks), scaled by `1 / ranks per host`, and allgathered inside each host. So the result
/// is the Adasum over hosts of each host's average, as Horovod's GPU build gives (its `postscale_factor /=
/// local_size`). Every coefficient sees whole tensors: each level's partial dot products and norms are
/// summed over the host's ranks (in local-index order, from an allgather, so every rank of the host has
/// the same bits) before they are summed across the level's hosts. Needs every host to have the same
/// number of ranks.
pub fn adasum_allreduce_hierarchical(
    parts: HostParts<'_>,
    buf: &mut [u8],
    dtype: DataType,
    counts: &[usize],
    scratch: &mut Vec<u8>,
) -> Result<(), TransportError> {
    let HostParts { layout, mut local, mut cross } = parts;
    let bounds = checked_bounds(local.rank(), buf, dtype, counts)?;
    if !layout.is_homogeneous() {
        let detail = "hosts have different numbers of ranks".to_string();
        return Err(invalid_argument(local.rank(), "hierarchical adasum", detail));
    }
    if buf.is_empty() {
        return Ok(());
    }
    let size = dtype.size();
    let width = local.size();
    let blocks = Blocks::even(bounds.total(), width, size);
    if width > 1 {
        reduce_scatter_ring(&mut local, None, buf, &blocks, dtype, Combine::Sum)?;
    }
    let range = blocks.range(local.rank());
    let base = range.start / size;
    if cross.size() > 1 {
        adasum_part(&mut cross, Some(&mut local), &mut buf[range.clone()], base, dtype, &bounds, scratch)?;
    }
    if width > 1 {
        scale_in_place(&mut buf[range], dtype, 1.0 / width as f64);
        allgather_ring(&mut local, buf, &blocks)?;
    }
    Ok(())
}

/// The tensors' bounds, after checking that `dtype` is a float type and that `counts` fill `buf`.
fn checked_bounds(rank: usize, buf: &[u8], dtype: DataType, counts: &[usize]) -> Result<Bounds, TransportError> {
    if !dtype.is_float() {
        return Err(invalid_argument(rank, "adasum", format!("{dtype} is not a floating-point type")));
    }
    let elements: usize = counts.iter().sum();
    if elements * dtype.size() != buf.len() {
        let detail = format!("tensors of {elements} elements in total do not fill {} bytes of {dtype}", buf.len());
        return Err(invalid_argument(rank, "adasum", detail));
    }
    Ok(Bounds::new(counts))
}

/// Steps 1-3 of the module doc over `t`'s ranks, on `part`: elements `base..` of the buffer `bounds`
/// describes (the whole buffer when `host` is `None`). With `host`, every rank of `t` holds its own part
/// of a buffer that this rank's host shares out among its ranks, and the partial dot products and norms
/// are also summed over `host`'s ranks, which run the same steps on the other parts.
fn adasum_part(
    t: &mut dyn Transport,
    mut host: Option<&mut dyn Transport>,
    part: &mut [u8],
    base: usize,
    dtype: DataType,
    bounds: &Bounds,
    scratch: &mut Vec<u8>,
) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    let core = 1usize << n.ilog2();
    if rank >= core {
        t.send(rank - core, part)?;
        return t.recv(rank - core, part);
    }
    let folded = rank + core;
    let len = part.len() / dtype.size();
    // The fold receives a whole part, the tree at most the larger half of one.
    let need = if folded < n { part.len() } else { (len - len / 2) * dtype.size() };
    if scratch.len() < need {
        scratch.resize(need, 0);
    }
    let scratch = &mut scratch[..need];
    if folded < n {
        t.recv(folded, scratch)?;
        let mut sums = vec![0.0; 3 * bounds.len()];
        partial_dots(dtype, bounds, base, part, scratch, &mut sums);
        if let Some(host) = host.as_deref_mut() {
            host_sum(host, &mut sums)?;
        }
        combine(dtype, bounds, base, part, scratch, &sums, true);
    }
    if core > 1 {
        halving_doubling(t, host, part, base, scratch, dtype, bounds, core)?;
    }
    if folded < n {
        t.send(folded, part)?;
    }
    Ok(())
}

/// Step 2 of the module doc over ranks `0..core` (a power of two), on `part` (elements `base..`).
#[allow(clippy::too_many_arguments)]
fn halving_doubling(
    t: &mut dyn Transport,
    mut host: Option<&mut dyn Transport>,
    buf: &mut [u8],
    base: usize,
    scratch: &mut [u8],
    dtype: DataType,
    bounds: &Bounds,
    core: usize,
) -> Result<(), TransportError> {
    let rank = t.rank();
    let size = dtype.size();
    // Byte offset in `buf` of element `x` of the whole buffer.
    let at = |x: usize| (x - base) * size;
    let (mut lo, mut hi) = (base, base + buf.len() / size);
    // (partner, the partner's range) per level, for the way back.
    let mut levels = Vec::new();
    let mut distance = 1;
    while distance < core {
        let partner = rank ^ distance;
        let mid = lo + (hi - lo) / 2;
        let lower = rank & distance == 0;
        let (keep, give) = if lower { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
        let kept_bytes = (keep.1 - keep.0) * size;
        t.sendrecv(partner, &buf[at(give.0)..at(give.1)], partner, &mut scratch[..kept_bytes])?;
        let mine = &mut buf[at(keep.0)..at(keep.1)];
        let theirs = &scratch[..kept_bytes];
        let mut sums = vec![0.0; 3 * bounds.len()];
        if lower {
            partial_dots(dtype, bounds, keep.0, mine, theirs, &mut sums);
        } else {
            partial_dots(dtype, bounds, keep.0, theirs, mine, &mut sums);
        }
        if let Some(host) = host.as_deref_mut() {
            host_sum(host, &mut sums)?;
        }
        group_sum(t, &mut sums, distance)?;
        combine(dtype, bounds, keep.0, mine, theirs, &sums, lower);
        levels.push((partner, give));
        (lo, hi) = keep;
        distance <<= 1;
    }
    for (partner, give) in levels.into_iter().rev() {
        let (mine, theirs) = if give.0 < lo {
            let (head, tail) = buf.split_at_mut(at(lo));
            (&tail[..(hi - lo) * size], &mut head[at(give.0)..])
        } else {
            let (head, tail) = buf.split_at_mut(at(hi));
            (&head[at(lo)..], &mut tail[..(give.1 - give.0) * size])
        };
        t.sendrecv(partner, mine, partner, theirs)?;
        (lo, hi) = (lo.min(give.0), hi.max(give.1));
    }
    Ok(())
}

/// Sum `values` over the ranks of `host`: gathered from all of them and added in rank order, so every
/// rank of the host gets the same bits.
fn host_sum(host: &mut dyn Transport, values: &mut [f64]) -> Result<(), TransportError> {
    let width = host.size();
    if width <= 1 {
        return Ok(());
    }
    let mine: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let mut all = vec![0u8; mine.len() * width];
    allgatherv(host, &mine, &mut all, &vec![mine.len(); width])?;
    values.iter_mut().for_each(|v| *v = 0.0);
    for from_rank in all.chunks_exact(mine.len().max(1)) {
        for (v, bytes) in values.iter_mut().zip(from_rank.chunks_exact(8)) {
            *v += f64_at(bytes);
        }
    }
    Ok(())
}

/// Sum `values` over the `2 * distance` ranks of this rank's group (recursive doubling; f64 addition is
/// commutative, so every rank of the group gets the same bits).
fn group_sum(t: &mut dyn Transport, values: &mut [f64], distance: usize) -> Result<(), TransportError> {
    let rank = t.rank();
    let mut mine: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let mut theirs = vec![0u8; mine.len()];
    let mut step = 1;
    while step <= distance {
        t.sendrecv(rank ^ step, &mine, rank ^ step, &mut theirs)?;
        for (m, o) in mine.chunks_exact_mut(8).zip(theirs.chunks_exact(8)) {
            let sum = f64_at(m) + f64_at(o);
            m.copy_from_slice(&sum.to_ne_bytes());
        }
        step <<= 1;
    }
    for (v, m) in values.iter_mut().zip(mine.chunks_exact(8)) {
        *v = f64_at(m);
    }
    Ok(())
}

fn f64_at(bytes: &[u8]) -> f64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(bytes);
    f64::from_ne_bytes(raw)
}

/// Where each tensor starts, in elements, plus the end of the last.
struct Bounds {
    starts: Vec<usize>,
}

impl Bounds {
    fn new(counts: &[usize]) -> Bounds {
        let mut starts = Vec::with_capacity(counts.len() + 1);
        let mut at = 0;
        starts.push(0);
        for &count in counts {
            at += count;
            starts.push(at);
        }
        Bounds { starts }
    }

    fn len(&self) -> usize {
        self.starts.len() - 1
    }

    fn total(&self) -> usize {
        self.starts[self.len()]
    }

    /// `(tensor, start, end)` of each tensor's part within elements `lo..hi`, relative to `lo`.
    fn within(&self, lo: usize, hi: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let first = self.starts[1..].partition_point(|&end| end <= lo);
        (first..self.len())
            .take_while(move |&i| self.starts[i] < hi)
            .map(move |i| (i, self.starts[i].max(lo) - lo, self.starts[i + 1].min(hi) - lo))
    }
}

/// Adds each tensor's partial `[a·b, |a|², |b|²]` over the slice at element `lo` to `sums` (3 per tensor).
fn partial_dots(dtype: DataType, bounds: &Bounds, lo: usize, a: &[u8], b: &[u8], sums: &mut [f64]) {
    match dtype {
        DataType::Float32 => dots_of::<F32>(bounds, lo, a, b, sums),
        DataType::Float64 => dots_of::<F64>(bounds, lo, a, b, sums),
        DataType::Float16 => dots_of::<F16>(bounds, lo, a, b, sums),
        DataType::Bfloat16 => dots_of::<Bf16>(bounds, lo, a, b, sums),
        _ => {}
    }
}

/// `mine = c_mine · mine + c_theirs · theirs` per tensor, where `mine` is the `a` vector when `mine_is_a`.
fn combine(dtype: DataType, bounds: &Bounds, lo: usize, mine: &mut [u8], theirs: &[u8], sums: &[f64], mine_is_a: bool) {
    match dtype {
        DataType::Float32 => combine_as::<F32>(bounds, lo, mine, theirs, sums, mine_is_a),
        DataType::Float64 => combine_as::<F64>(bounds, lo, mine, theirs, sums, mine_is_a),
        DataType::Float16 => combine_as::<F16>(bounds, lo, mine, theirs, sums, mine_is_a),
        DataType::Bfloat16 => combine_as::<Bf16>(bounds, lo, mine, theirs, sums, mine_is_a),
        _ => {}
    }
}

/// Lanes of independent partial sums in [`dots_of`]: they let the loop vectorize, and their fixed order
/// keeps the result deterministic.
const LANES: usize = 8;

fn dots_of<E: Element>(bounds: &Bounds, lo: usize, a: &[u8], b: &[u8], sums: &mut [f64]) {
    let hi = lo + a.len() / E::SIZE;
    for (tensor, s, e) in bounds.within(lo, hi) {
        let (xs, ys) = (&a[s * E::SIZE..e * E::SIZE], &b[s * E::SIZE..e * E::SIZE]);
        let (mut dot, mut aa, mut bb) = ([0.0f64; LANES], [0.0f64; LANES], [0.0f64; LANES]);
        let block = LANES * E::SIZE;
        let (x_blocks, y_blocks) = (xs.chunks_exact(block), ys.chunks_exact(block));
        let (x_rest, y_rest) = (x_blocks.remainder(), y_blocks.remainder());
        for (xb, yb) in x_blocks.zip(y_blocks) {
            for lane in 0..LANES {
                let at = lane * E::SIZE..(lane + 1) * E::SIZE;
                let (x, y) = (E::load(&xb[at.clone()]), E::load(&yb[at]));
                dot[lane] += x * y;
                aa[lane] += x * x;
                bb[lane] += y * y;
            }
        }
        for (lane, (x, y)) in x_rest.chunks_exact(E::SIZE).zip(y_rest.chunks_exact(E::SIZE)).enumerate() {
            let (x, y) = (E::load(x), E::load(y));
            dot[lane] += x * y;
            aa[lane] += x * x;
            bb[lane] += y * y;
        }
        sums[3 * tensor] += dot.iter().sum::<f64>();
        sums[3 * tensor + 1] += aa.iter().sum::<f64>();
        sums[3 * tensor + 2] += bb.iter().sum::<f64>();
    }
}

fn combine_as<E: Element>(bounds: &Bounds, lo: usize, mine: &mut [u8], theirs: &[u8], sums: &[f64], mine_is_a: bool) {
    let hi = lo + mine.len() / E::SIZE;
    for (tensor, s, e) in bounds.within(lo, hi) {
        let (a_coeff, b_coeff) = coefficients(sums[3 * tensor], sums[3 * tensor + 1], sums[3 * tensor + 2]);
        let (c_mine, c_theirs) = if mine_is_a { (a_coeff, b_coeff) } else { (b_coeff, a_coeff) };
        let (xs, ys) = (&mut mine[s * E::SIZE..e * E::SIZE], &theirs[s * E::SIZE..e * E::SIZE]);
        for (x, y) in xs.chunks_exact_mut(E::SIZE).zip(ys.chunks_exact(E::SIZE)) {
            let value = c_mine * E::load(x) + c_theirs * E::load(y);
            E::store(value, x);
        }
    }
}

/// A floating-point element read as f64 and written back rounded to its type.
trait Element {
    const SIZE: usize;
    fn load(bytes: &[u8]) -> f64;
    fn store(value: f64, bytes: &mut [u8]);
}

struct F32;
struct F64;
struct F16;
struct Bf16;

fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut raw = [0u8; N];
    raw.copy_from_slice(bytes);
    raw
}

impl Element for F32 {
    const SIZE: usize = 4;
    fn load(bytes: &[u8]) -> f64 {
        f64::from(f32::from_ne_bytes(array(bytes)))
    }
    fn store(value: f64, bytes: &mut [u8]) {
        bytes.copy_from_slice(&(value as f32).to_ne_bytes());
    }
}

impl Element for F64 {
    const SIZE: usize = 8;
    fn load(bytes: &[u8]) -> f64 {
        f64::from_ne_bytes(array(bytes))
    }
    fn store(value: f64, bytes: &mut [u8]) {
        bytes.copy_from_slice(&value.to_ne_bytes());
    }
}

impl Element for F16 {
    const SIZE: usize = 2;
    fn load(bytes: &[u8]) -> f64 {
        f16::from_bits(u16::from_ne_bytes(array(bytes))).to_f64()
    }
    fn store(value: f64, bytes: &mut [u8]) {
        bytes.copy_from_slice(&f16::from_f64(value).to_bits().to_ne_bytes());
    }
}

impl Element for Bf16 {
    const SIZE: usize = 2;
    fn load(bytes: &[u8]) -> f64 {
        f64::from(bf16_to_f32(u16::from_ne_bytes(array(bytes))))
    }
    fn store(value: f64, bytes: &mut [u8]) {
        bytes.copy_from_slice(&f32_to_bf16(value as f32).to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    /// The Adasum of two vectors, tensor by tensor, straight from the formula.
    fn pair(a: &[f64], b: &[f64], counts: &[usize]) -> Vec<f64> {
        let mut out = Vec::with_capacity(a.len());
        let mut at = 0;
        for &count in counts {
            let (x, y) = (&a[at..at + count], &b[at..at + count]);
            let dot: f64 = x.iter().zip(y).map(|(p, q)| p * q).sum();
            let (aa, bb): (f64, f64) = (x.iter().map(|p| p * p).sum(), y.iter().map(|q| q * q).sum());
            let (ca, cb) = coefficients(dot, aa, bb);
            out.extend(x.iter().zip(y).map(|(p, q)| ca * p + cb * q));
            at += count;
        }
        out
    }

    /// The combination order of the module doc, on whole vectors.
    fn reference(inputs: &[Vec<f64>], counts: &[usize]) -> Vec<f64> {
        let n = inputs.len();
        let core = 1usize << n.ilog2();
        let mut vectors = inputs.to_vec();
        for extra in core..n {
            vectors[extra - core] = pair(&vectors[extra - core], &vectors[extra], counts);
        }
        let mut distance = 1;
        while distance < core {
            for base in (0..core).step_by(2 * distance) {
                vectors[base] = pair(&vectors[base], &vectors[base + distance], counts);
            }
            distance <<= 1;
        }
        vectors.swap_remove(0)
    }

    fn encode(values: &[f64], dtype: DataType) -> Vec<u8> {
        let mut out = vec![0u8; values.len() * dtype.size()];
        for (v, bytes) in values.iter().zip(out.chunks_exact_mut(dtype.size())) {
            match dtype {
                DataType::Float32 => F32::store(*v, bytes),
                DataType::Float64 => F64::store(*v, bytes),
                DataType::Float16 => F16::store(*v, bytes),
                DataType::Bfloat16 => Bf16::store(*v, bytes),
                _ => unreachable!(),
            }
        }
        out
    }

    fn decode(bytes: &[u8], dtype: DataType) -> Vec<f64> {
        bytes
            .chunks_exact(dtype.size())
            .map(|b| match dtype {
                DataType::Float32 => F32::load(b),
                DataType::Float64 => F64::load(b),
                DataType::Float16 => F16::load(b),
                DataType::Bfloat16 => Bf16::load(b),
                _ => unreachable!(),
            })
            .collect()
    }

    /// Deterministic pseudo-random values in [-1, 1), different per rank and element.
    fn values(rank: usize, len: usize, salt: u64) -> Vec<f64> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (rank as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ salt;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 11) as f64 / (1u64 << 52) as f64 - 1.0
            })
            .collect()
    }

    fn run(n: usize, dtype: DataType, counts: &[usize], inputs: &[Vec<f64>]) -> Vec<Vec<u8>> {
        run_ranks(MemoryTransport::mesh(n), |t| {
            let mut buf = encode(&inputs[t.rank()], dtype);
            adasum_allreduce(t, &mut buf, dtype, counts, &mut Vec::new()).unwrap();
            buf
        })
    }

    #[test]
    fn matches_the_reference_tree_for_2_to_5_ranks_and_every_float_type() {
        let counts = [7usize, 0, 1, 33, 4097, 2];
        let total: usize = counts.iter().sum();
        for n in 1..=5 {
            for (dtype, tolerance) in [
                (DataType::Float64, 1e-12),
                (DataType::Float32, 1e-5),
                (DataType::Float16, 2e-2),
                (DataType::Bfloat16, 1e-1),
            ] {
                // Inputs already rounded to the type, so the reference sees what the ranks see.
                let inputs: Vec<Vec<f64>> =
                    (0..n).map(|r| decode(&encode(&values(r, total, n as u64), dtype), dtype)).collect();
                let want = reference(&inputs, &counts);
                let results = run(n, dtype, &counts, &inputs);
                assert!(results.iter().all(|r| r == &results[0]), "n={n} {dtype}: ranks differ");
                let got = decode(&results[0], dtype);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= tolerance * (1.0 + w.abs()), "n={n} {dtype} element {i}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn orthogonal_vectors_add_and_equal_vectors_stay() {
        for n in 2..=5 {
            // Rank r holds (r + 1) e_r: every pair is orthogonal (a·b = 0, both coefficients 1), and so is
            // every partial sum to the vectors it has not met, so the result is the plain sum.
            let inputs: Vec<Vec<f64>> =
                (0..n).map(|r| (0..n).map(|i| if i == r { (r + 1) as f64 } else { 0.0 }).collect()).collect();
            let got = decode(&run(n, DataType::Float64, &[n], &inputs)[0], DataType::Float64);
            assert_eq!(got, (1..=n).map(|i| i as f64).collect::<Vec<_>>(), "n={n}");
        }
        for n in 2..=5 {
            let same = values(7, 100, 1);
            let inputs = vec![same.clone(); n];
            let got = decode(&run(n, DataType::Float64, &[100], &inputs)[0], DataType::Float64);
            for (g, w) in got.iter().zip(&same) {
                assert!((g - w).abs() < 1e-12, "n={n}: {g} vs {w}");
            }
        }
    }

    /// The weight of rank `r`'s multiple in the Adasum of parallel vectors `c_r a` over `n` ranks (`p` the
    /// largest power of two `<= n`): each pair averages (see below), so a rank that the fold pairs up
    /// (`r < n - p` or `r >= p`) counts `1 / 2p` and any other `1 / p`.
    fn parallel_weight(r: usize, n: usize) -> f64 {
        let p = 1usize << n.ilog2();
        if r < n - p || r >= p {
            0.5 / p as f64
        } else {
            1.0 / p as f64
        }
    }

    #[test]
    fn parallel_vectors_of_different_magnitudes_average() {
        // b = c a with c != 0: a·b = c|a|², |b|² = c²|a|², so the coefficients are 1 - c/2 and 1 - 1/(2c),
        // and (1 - c/2) a + (1 - 1/(2c)) c a = (1 + c)/2 a: the average of a and b, whatever c (also < 0).
        for c in [3.0, 0.25, -2.0] {
            let norm2 = 1.7;
            let (ca, cb) = coefficients(c * norm2, norm2, c * c * norm2);
            assert!((ca - (1.0 - c / 2.0)).abs() < 1e-15 && (cb - (1.0 - 0.5 / c)).abs() < 1e-15, "c={c}");
            let a = values(3, 9, 2);
            let b: Vec<f64> = a.iter().map(|x| c * x).collect();
            for (got, x) in pair(&a, &b, &[9]).iter().zip(&a) {
                assert!((got - (1.0 + c) / 2.0 * x).abs() < 1e-14, "c={c}: {got} vs {}", (1.0 + c) / 2.0 * x);
            }
        }
        // Over n ranks, rank r holding (r + 1) a (and one tensor with a negative multiple), the tree of pair
        // averages gives sum_r w_r c_r a: the plain mean of the c_r for a power of two.
        let counts = [37usize, 5];
        let a = values(11, 42, 3);
        for n in 2..=5 {
            let multiple = |r: usize, tensor: usize| if tensor == 1 && r == 1 { -2.0 } else { (r + 1) as f64 };
            let inputs: Vec<Vec<f64>> = (0..n)
                .map(|r| a.iter().enumerate().map(|(i, x)| multiple(r, usize::from(i >= counts[0])) * x).collect())
                .collect();
            let got = decode(&run(n, DataType::Float64, &counts, &inputs)[0], DataType::Float64);
            for (i, (g, x)) in got.iter().zip(&a).enumerate() {
                let tensor = usize::from(i >= counts[0]);
                let scale: f64 = (0..n).map(|r| parallel_weight(r, n) * multiple(r, tensor)).sum();
                assert!((g - scale * x).abs() < 1e-12, "n={n} element {i}: {g} vs {}", scale * x);
            }
            if n.is_power_of_two() {
                let mean = (1..=n).sum::<usize>() as f64 / n as f64;
                assert!((got[0] - mean * a[0]).abs() < 1e-12, "n={n}: the mean multiple");
            }
        }
    }

    #[test]
    fn each_tensor_of_a_fused_buffer_keeps_its_own_coefficients() {
        // Tensor 0 is parallel across ranks (averages), tensor 1 orthogonal (adds): fused as separate calls.
        let counts = [3usize, 2];
        let inputs = vec![vec![1.0, 2.0, 3.0, 1.0, 0.0], vec![1.0, 2.0, 3.0, 0.0, 5.0]];
        let fused = decode(&run(2, DataType::Float64, &counts, &inputs)[0], DataType::Float64);
        assert_eq!(fused, vec![1.0, 2.0, 3.0, 1.0, 5.0]);
        let as_one = decode(&run(2, DataType::Float64, &[5], &inputs)[0], DataType::Float64);
        assert_ne!(as_one, fused, "one coefficient pair for the whole buffer would differ");
    }

    #[test]
    fn zero_vectors_and_tiny_norms_keep_coefficient_one() {
        // A joined rank contributes zeros: the others' combination is unchanged by it.
        let inputs = vec![vec![1.0, -2.0], vec![0.0, 0.0], vec![3.0, 1.0]];
        let got = decode(&run(3, DataType::Float64, &[2], &inputs)[0], DataType::Float64);
        let want = pair(&inputs[0], &inputs[2], &[2]);
        assert_eq!(got, want);
        assert_eq!(coefficients(1.0, 0.0, 4.0), (1.0, 0.875));
    }

    #[test]
    fn integer_types_and_wrong_counts_are_refused() {
        let results = run_ranks(MemoryTransport::mesh(1), |t| {
            (
                adasum_allreduce(t, &mut [0; 8], DataType::Int32, &[2], &mut Vec::new()),
                adasum_allreduce(t, &mut [0; 8], DataType::Float32, &[3], &mut Vec::new()),
            )
        });
        let (int, counts) = &results[0];
        assert!(matches!(int, Err(TransportError::Io { source, .. }) if source.to_string().contains("int32")));
        assert!(matches!(counts, Err(TransportError::Io { .. })));
    }
}
