//! PowerSGD (Vogels et al., 2019), as PyTorch DDP's hook runs it: each tensor of two or more dimensions is
//! read as a matrix `M` of `shape[0]` rows, and where a rank-`r` pair of factors is at most half its size it
//! travels as them; other tensors (vectors, small matrices) are summed exactly.
//!
//! One step, with every rank's error feedback added to its `M` first: `P = M Q` (Q warm-started from the
//! last step; at first the same pseudo-random matrix on every rank, seeded by the tensor's name), `P`
//! summed over the ranks and orthonormalised (Gram-Schmidt on its columns), `Q = M^T P` summed over the
//! ranks; the sum of the ranks' matrices is then approximated by `P Q^T` and each rank keeps `M - P Q^T / n`
//! (its share of what the approximation missed) for the next step. Two small allreduces per step, of
//! `(rows + cols) r` values per tensor, all tensors' factors in one buffer each.

use crate::ring::compressed::feedback::{Feedback, Kind};
use crate::ring::compressed::{sum_exactly, Memory, Scales, Span};
use crate::transport::{Transport, TransportError};

/// A compressed tensor: its span and its matrix dimensions.
struct Matrix<'s, 'a> {
    span: &'s Span<'a>,
    rows: usize,
    cols: usize,
}

/// `span` as a matrix compressed at rank `r`, or `None` where it is sent exactly: fewer than two
/// dimensions, or factors more than half the matrix's size (DDP's minimum compression rate of 2).
fn as_matrix<'s, 'a>(span: &'s Span<'a>, r: usize) -> Option<Matrix<'s, 'a>> {
    let rows = usize::try_from(*span.shape.first()?).ok().filter(|&rows| rows > 0)?;
    if span.shape.len() < 2 || span.len % rows != 0 {
        return None;
    }
    let cols = span.len / rows;
    let factors = (rows + cols).checked_mul(r)?;
    (r < rows.min(cols) && factors.checked_mul(2)? <= span.len).then_some(Matrix { span, rows, cols })
}

/// Whether `span` travels compressed at rank `r` (else it is summed exactly through the dense vector).
pub fn compresses(span: &Span<'_>, r: usize) -> bool {
    as_matrix(span, r).is_some()
}

/// Allreduce (sum) `values` with rank-`r` PowerSGD; see the module doc.
pub fn allreduce(
    t: &mut dyn Transport,
    r: usize,
    values: &mut [f32],
    spans: &[Span<'_>],
    feedback: &mut Feedback,
) -> Result<(), TransportError> {
    let mut memories: Vec<Memory<'_>> = spans.iter().map(|_| Memory::Values).collect();
    allreduce_in_memory(t, r, values, spans, (&mut memories, Scales { pre: 1.0, post: 1.0 }), feedback)
}

/// [`allreduce`], where a compressed tensor whose `memories` entry is not [`Memory::Values`] is read from and written to that memory instead of `values`
/// (scaled by `scales` on the way in and out); its span in `values` is scratch.
///
/// Both factors are kept transposed (`P^T`, `r x rows`, and `Q^T`, `r x cols`, row-major; the warm-started
/// `Q` in `feedback` too) so that every inner loop runs over contiguous memory: dot products of a matrix row
/// with a factor row, and multiples of one row added to another.
pub fn allreduce_in_memory(
    t: &mut dyn Transport,
    r: usize,
    values: &mut [f32],
    spans: &[Span<'_>],
    (memories, scales): (&mut [Memory<'_>], Scales),
    feedback: &mut Feedback,
) -> Result<(), TransportError> {
    let n = t.size() as f32;
    let (matrices, plain): (Vec<_>, Vec<_>) = spans.iter().enumerate().partition(|(_, span)| compresses(span, r));
    let matrices: Vec<(Matrix<'_, '_>, usize)> =
        matrices.into_iter().filter_map(|(i, span)| Some((as_matrix(span, r)?, i))).collect();
    if !plain.is_empty() {
        let mut exact: Vec<f32> = plain.iter().flat_map(|(_, span)| values[span.range()].iter().copied()).collect();
        sum_exactly(t, &mut exact)?;
        let mut at = 0;
        for (_, span) in &plain {
            values[span.range()].copy_from_slice(&exact[at..at + span.len]);
            at += span.len;
        }
    }
    if matrices.is_empty() {
        return Ok(());
    }
    // P = (M + E) Q, the error feedback E added to each row of M as the row is first read.
    let mut ps = vec![0.0f32; matrices.iter().map(|(m, _)| m.rows * r).sum()];
    let mut at = 0;
    for (m, i) in &matrices {
        let source = memories[*i].source().map(|source| (source, scales.pre));
        let init = |q: &mut [f32]| seeded_uniform(m.span.name, q);
        let qt = feedback.get(Kind::Factor, m.span.name, m.cols * r, Some(&init)).to_vec();
        let residual =
            if m.span.contributes { Some(&*feedback.get(Kind::Worker, m.span.name, m.span.len, None)) } else { None };
        add_and_multiply(&mut values[m.span.range()], source, residual, m.cols, (&qt, &mut ps[at..at + m.rows * r]));
        at += m.rows * r;
    }
    sum_exactly(t, &mut ps)?;
    // Q = M^T P, summed.
    let mut qs = vec![0.0f32; matrices.iter().map(|(m, _)| m.cols * r).sum()];
    let (mut p_at, mut q_at) = (0, 0);
    for (m, _) in &matrices {
        let pt = &mut ps[p_at..p_at + m.rows * r];
        orthonormalise(pt, m.rows, r);
        multiply_transposed(&values[m.span.range()], m.cols, pt, &mut qs[q_at..q_at + m.cols * r]);
        p_at += m.rows * r;
        q_at += m.cols * r;
    }
    sum_exactly(t, &mut qs)?;
    // The sum is approximated by P Q^T; each rank keeps its share of what that missed.
    let (mut p_at, mut q_at) = (0, 0);
    for (m, i) in &matrices {
        let pt = &ps[p_at..p_at + m.rows * r];
        let qt = &qs[q_at..q_at + m.cols * r];
        let residual =
            if m.span.contributes { Some(feedback.get(Kind::Worker, m.span.name, m.span.len, None)) } else { None };
        let destination = memories[*i].destination().map(|destination| (destination, scales.post));
        approximate(&mut values[m.span.range()], residual, m.cols, (pt, qt, n), destination);
        feedback.get(Kind::Factor, m.span.name, m.cols * r, None).copy_from_slice(qt);
        p_at += m.rows * r;
        q_at += m.cols * r;
    }
    Ok(())
}

wide_where_possible! {
    /// Row by row in one pass: `m = source * factor` (where a source is given: the caller's tensor, else
    /// `m` holds the values already), `m += residual` (where given) and `out = (m q)^T`. `m` has rows of
    /// `cols` values; `factors` is `(q^T, out)`, `q^T` being `r x cols` and `out` `r x rows`, row-major.
    fn add_and_multiply(
        m: &mut [f32],
        source: Option<(&[f32], f32)>,
        residual: Option<&[f32]>,
        cols: usize,
        factors: (&[f32], &mut [f32]),
    ) {
        let (qt, out) = factors;
        let rows = m.len() / cols;
        for (row, m_row) in m.chunks_exact_mut(cols).enumerate() {
            let within = row * cols..(row + 1) * cols;
            if let Some((source, factor)) = source {
                scaled_copy(m_row, &source[within.clone()], factor);
            }
            if let Some(residual) = residual {
                add_multiple(m_row, 1.0, &residual[within]);
            }
            for (k, q_row) in qt.chunks_exact(cols).enumerate() {
                out[k * rows + row] = dot(m_row, q_row);
            }
        }
    }
}

wide_where_possible! {
    /// `out = (m^T p)^T`: `m` has rows of `cols` values, `pt` is `p^T` (`r x rows`), `out` is `r x cols`,
    /// row-major.
    fn multiply_transposed(m: &[f32], cols: usize, pt: &[f32], out: &mut [f32]) {
        let rows = m.len() / cols;
        out.fill(0.0);
        for (row, m_row) in m.chunks_exact(cols).enumerate() {
            for (k, out_row) in out.chunks_exact_mut(cols).enumerate() {
                add_multiple(out_row, pt[k * rows + row], m_row);
            }
        }
    }
}

wide_where_possible! {
    /// Row by row in one pass: `approx = p q^T` (`factors` = `(p^T, q^T, n)`, the factors transposed as
    /// above), `residual = m - approx * (1 / n)` (where given), and the result: `destination = approx * factor`
    /// where a destination is given (the caller's tensor), else `m = approx`.
    fn approximate(
        m: &mut [f32],
        residual: Option<&mut [f32]>,
        cols: usize,
        factors: (&[f32], &[f32], f32),
        destination: Option<(&mut [f32], f32)>,
    ) {
        let (pt, qt, n) = factors;
        // Each rank's share of the miss, by a multiplication (a division per value cost more than the rest).
        let share = 1.0 / n;
        let rows = m.len() / cols;
        let (mut residual, mut destination) = (residual, destination);
        let mut approx = vec![0.0f32; cols];
        for (row, own_row) in m.chunks_exact_mut(cols).enumerate() {
            approx.fill(0.0);
            for (k, q_row) in qt.chunks_exact(cols).enumerate() {
                add_multiple(&mut approx, pt[k * rows + row], q_row);
            }
            let within = row * cols..(row + 1) * cols;
            if let Some(residual) = residual.as_deref_mut() {
                for ((e, &v), &a) in residual[within.clone()].iter_mut().zip(own_row.iter()).zip(&approx) {
                    *e = v - a * share;
                }
            }
            match destination.as_mut() {
                Some((destination, factor)) => scaled_copy(&mut destination[within], &approx, *factor),
                None => own_row.copy_from_slice(&approx),
            }
        }
    }
}

/// `out = x * factor` (a plain copy for a factor of 1, as the executor's scaling does: the same bits).
#[inline(always)]
fn scaled_copy(out: &mut [f32], x: &[f32], factor: f32) {
    if factor == 1.0 {
        out.copy_from_slice(x);
    } else {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v * factor;
        }
    }
}

/// Lanes of the partial sums in [`dot`]: enough independent additions for the compiler to vectorise.
const LANES: usize = 16;

/// The dot product of `a` and `b`, summed in [`LANES`] partial sums (a fixed order: the same bits on every
/// rank).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut sums = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a_chunks.remainder().iter().zip(b_chunks.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for ((s, x), y) in sums.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    sums.iter().sum::<f32>() + tail
}

/// `out += factor * x`.
#[inline(always)]
fn add_multiple(out: &mut [f32], factor: f32, x: &[f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += factor * v;
    }
}

/// Gram-Schmidt on the `r` columns of `P`, given as the rows of the `r x rows` row-major `pt`: each made
/// orthogonal to the ones before and of unit length. A column that was (almost) in the span of the ones
/// before becomes zero: what is left of it after the projections is rounding noise, which normalising would
/// blow up into a direction that is not orthogonal to them.
fn orthonormalise(pt: &mut [f32], rows: usize, r: usize) {
    for k in 0..r {
        let (done, rest) = pt.split_at_mut(k * rows);
        let column = &mut rest[..rows];
        let before = dot(column, column).sqrt();
        // Twice: the second pass removes what rounding left of the first ("twice is enough").
        for _ in 0..2 {
            for other in done.chunks_exact(rows) {
                let projection = dot(column, other);
                add_multiple(column, -projection, other);
            }
        }
        let norm = dot(column, column).sqrt();
        let scale = if norm > f32::MIN_POSITIVE && norm > 1e-4 * before { 1.0 / norm } else { 0.0 };
        column.iter_mut().for_each(|v| *v *= scale);
    }
}

/// Fill `out` with values in [-1, 1) from a generator seeded by `name` (FNV-1a, then SplitMix64): the same
/// on every rank.
fn seeded_uniform(name: &str, out: &mut [f32]) {
    let mut state =
        name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    for value in out {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        *value = (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    #[test]
    fn only_matrices_whose_factors_are_at_most_half_their_size_are_compressed() {
        let span = |shape: &'static [i64], len| Span { name: "t", shape, start: 0, len, contributes: true };
        assert!(as_matrix(&span(&[64, 32], 2048), 4).is_some());
        assert!(as_matrix(&span(&[8, 3, 3, 4], 288), 2).is_some(), "a conv kernel as 8 x 36");
        assert!(as_matrix(&span(&[2048], 2048), 4).is_none(), "a vector");
        assert!(as_matrix(&span(&[10, 10], 100), 4).is_none(), "80 factor values are more than half of 100");
        assert!(as_matrix(&span(&[4, 512], 2048), 4).is_none(), "rank not below both dimensions");
        assert!(as_matrix(&span(&[0, 5], 0), 1).is_none());
    }

    #[test]
    fn orthonormalised_columns_are_orthogonal_and_of_unit_length() {
        let mut p = vec![0.0f32; 20 * 3];
        seeded_uniform("p", &mut p);
        orthonormalise(&mut p, 20, 3);
        for a in 0..3 {
            for b in 0..3 {
                let dot: f32 = (0..20).map(|i| p[a * 20 + i] * p[b * 20 + i]).sum();
                let expected = if a == b { 1.0 } else { 0.0 };
                assert!((dot - expected).abs() < 1e-5, "columns {a}, {b}: {dot}");
            }
        }
    }

    #[test]
    fn the_seed_depends_on_the_name_only() {
        let (mut a, mut b, mut c) = (vec![0.0; 8], vec![0.0; 8], vec![0.0; 8]);
        seeded_uniform("layer.weight", &mut a);
        seeded_uniform("layer.weight", &mut b);
        seeded_uniform("layer.bias", &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
    }

    /// Rank `rank`'s 48 x 40 matrix: `rank + 1` times a fixed rank-2 matrix (so the sum is rank 2 too), and
    /// a 40-value vector.
    fn contribution(rank: usize) -> Vec<f32> {
        let u = |i: usize| [(i as f32 * 0.3).sin(), (i as f32 * 0.7).cos()];
        let mut values: Vec<f32> = (0..48 * 40)
            .map(|at| {
                let (i, j) = (at / 40, at % 40);
                let (a, b) = (u(i), u(j + 100));
                (rank + 1) as f32 * (a[0] * b[0] + 0.5 * a[1] * b[1])
            })
            .collect();
        values.extend((0..40).map(|i| i as f32 + rank as f32));
        values
    }

    #[test]
    fn a_low_rank_sum_is_recovered_the_vector_is_exact_and_the_ranks_agree() {
        let n = 3;
        let results = run_ranks(MemoryTransport::mesh(n), |t| {
            let spans = [
                Span { name: "w", shape: &[48, 40], start: 0, len: 48 * 40, contributes: true },
                Span { name: "b", shape: &[40], start: 48 * 40, len: 40, contributes: true },
            ];
            let mut feedback = Feedback::default();
            let mut values = contribution(t.rank());
            allreduce(t, 4, &mut values, &spans, &mut feedback).unwrap();
            let residual = feedback.peek(Kind::Worker, "w").map(<[f32]>::to_vec);
            (values, residual, feedback.peek(Kind::Worker, "b").is_none())
        });
        let exact: Vec<f32> = (0..48 * 40 + 40).map(|i| (0..n).map(|r| contribution(r)[i]).sum()).collect();
        for (rank, (values, _, no_vector_residual)) in results.iter().enumerate() {
            assert_eq!(values, &results[0].0, "rank {rank} differs from rank 0");
            assert!(no_vector_residual, "the vector went exactly and keeps no residual");
        }
        // Each rank keeps its distance from the mean; a rank-2 sum leaves nothing behind in all.
        let missed = (0..48 * 40).map(|i| results.iter().map(|r| r.1.as_ref().unwrap()[i]).sum::<f32>().abs());
        assert!(missed.fold(0.0, f32::max) < 1e-3);
        let worst = results[0].0[..48 * 40].iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(worst < 1e-3, "rank-2 sum recovered at rank 4 within {worst}");
        assert_eq!(&results[0].0[48 * 40..], &exact[48 * 40..], "the vector is summed exactly");
    }

    #[test]
    fn a_full_rank_matrix_is_approximated_and_the_residual_is_each_ranks_share_of_the_miss() {
        let n = 2;
        let results = run_ranks(MemoryTransport::mesh(n), |t| {
            let spans = [Span { name: "w", shape: &[32, 24], start: 0, len: 32 * 24, contributes: true }];
            let mut values = vec![0.0f32; 32 * 24];
            seeded_uniform(&format!("rank {}", t.rank()), &mut values);
            let input = values.clone();
            let mut feedback = Feedback::default();
            allreduce(t, 2, &mut values, &spans, &mut feedback).unwrap();
            (input, values, feedback.peek(Kind::Worker, "w").unwrap().to_vec())
        });
        // Each rank's residual is its input less half the approximation: the residuals and the
        // approximation add up to the exact sum.
        for (input, approx, residual) in &results {
            for ((i, a), e) in input.iter().zip(approx).zip(residual) {
                assert!((i - a / 2.0 - e).abs() < 1e-5);
            }
        }
        let (a, b) = (&results[0], &results[1]);
        let sum_error: f32 =
            (0..32 * 24).map(|i| (a.0[i] + b.0[i] - a.1[i] - a.2[i] - b.2[i]).abs()).fold(0.0, f32::max);
        assert!(sum_error < 1e-4, "{sum_error}");
    }

    #[test]
    fn reading_and_writing_the_callers_memory_gives_the_same_bits_as_the_dense_vector() {
        // Two steps (the second uses the first's residual and Q), a matrix in place, one into a separate
        // output, and a vector through the dense vector, against everything through the dense vector with
        // the executor's scaling around it.
        let scales = Scales { pre: 0.5, post: 0.25 };
        let scaled = |values: &mut [f32], factor: f32| values.iter_mut().for_each(|v| *v *= factor);
        let results = run_ranks(MemoryTransport::mesh(2), |t| {
            let spans = [
                Span { name: "w", shape: &[48, 40], start: 0, len: 48 * 40, contributes: true },
                Span { name: "b", shape: &[40], start: 48 * 40, len: 40, contributes: true },
                Span { name: "v", shape: &[30, 20], start: 48 * 40 + 40, len: 600, contributes: true },
            ];
            let rank = t.rank();
            let input = |step: usize| {
                let mut values = vec![0.0f32; 48 * 40 + 40 + 600];
                seeded_uniform(&format!("rank {rank} step {step}"), &mut values);
                values
            };
            let (mut dense_feedback, mut own_feedback) = (Feedback::default(), Feedback::default());
            let mut outcomes = Vec::new();
            for step in 0..2 {
                let mut dense = input(step);
                scaled(&mut dense, scales.pre);
                allreduce(t, 4, &mut dense, &spans, &mut dense_feedback).unwrap();
                scaled(&mut dense, scales.post);

                let original = input(step);
                let mut in_place = original[..48 * 40].to_vec();
                let mut separate = vec![7.0f32; 600];
                let mut values = vec![f32::NAN; original.len()];
                values[48 * 40..48 * 40 + 40].copy_from_slice(&original[48 * 40..48 * 40 + 40]);
                scaled(&mut values[48 * 40..48 * 40 + 40], scales.pre);
                let mut memories = [
                    Memory::InPlace(&mut in_place),
                    Memory::Values,
                    Memory::Separate(&original[48 * 40 + 40..], &mut separate),
                ];
                allreduce_in_memory(t, 4, &mut values, &spans, (&mut memories, scales), &mut own_feedback).unwrap();
                scaled(&mut values[48 * 40..48 * 40 + 40], scales.post);
                let residuals =
                    |feedback: &Feedback| ["w", "v"].map(|name| feedback.peek(Kind::Worker, name).unwrap().to_vec());
                outcomes.push((
                    dense,
                    in_place,
                    values,
                    separate,
                    residuals(&dense_feedback),
                    residuals(&own_feedback),
                ));
            }
            outcomes
        });
        for (rank, outcomes) in results.iter().enumerate() {
            for (step, (dense, in_place, values, separate, dense_residuals, own_residuals)) in
                outcomes.iter().enumerate()
            {
                let at = format!("rank {rank}, step {step}");
                assert_eq!(in_place[..], dense[..48 * 40], "{at}: the matrix reduced in place");
                assert_eq!(values[48 * 40..48 * 40 + 40], dense[48 * 40..48 * 40 + 40], "{at}: the vector");
                assert_eq!(separate[..], dense[48 * 40 + 40..], "{at}: the matrix with a separate output");
                assert_eq!(own_residuals, dense_residuals, "{at}: the residuals");
                assert!(dense.iter().all(|v| v.is_finite()));
            }
        }
    }

    /// A timing to run by hand: `cargo test --release --lib powersgd::tests::timing -- --ignored --nocapture`.
    #[test]
    #[ignore = "timing, run by hand in release"]
    fn timing_of_a_1024_square_matrix_and_a_vector_at_rank_4() {
        let times = run_ranks(MemoryTransport::mesh(2), |t| {
            let spans = [
                Span { name: "w", shape: &[1024, 1024], start: 0, len: 1024 * 1024, contributes: true },
                Span { name: "b", shape: &[1024], start: 1024 * 1024, len: 1024, contributes: true },
            ];
            let mut input = vec![0.0f32; 1024 * 1024 + 1024];
            seeded_uniform(&format!("rank {}", t.rank()), &mut input);
            let mut feedback = Feedback::default();
            let mut values = input.clone();
            allreduce(t, 4, &mut values, &spans, &mut feedback).unwrap();
            let start = std::time::Instant::now();
            for _ in 0..20 {
                values.copy_from_slice(&input);
                allreduce(t, 4, &mut values, &spans, &mut feedback).unwrap();
            }
            start.elapsed().as_secs_f64() * 1e3 / 20.0
        });
        eprintln!("PowerSGD rank 4, 1024 x 1024 + 1024, 2 ranks: {times:.2?} ms per allreduce");
    }
}
