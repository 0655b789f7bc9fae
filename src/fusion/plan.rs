//! [`plan_fusion`]: merges compatible ready responses into fused responses, following Horovod's
//! `FuseResponses`.
//!
//! Starting from the first response, later responses of its kind (allreduce or reduce-scatter) with the
//! same dtype, reduce op, prescale and postscale are appended while the fused tensors still fit in `threshold_bytes` of fusion
//! buffer, measured with [`FusionLayout`]'s 64-byte alignment (so every fused response's layout fits
//! a threshold-sized buffer; Horovod counts unpadded bytes). Responses that do not match are skipped
//! with look-ahead while the fused bytes plus the skipped bytes stay within the threshold, and are then
//! planned, in their original order, before anything after them; a compatible response that does not fit
//! ends the group, so compatible responses never overtake each other. A single response larger than the
//! threshold still runs, alone.
//!
//! Tensors on GPUs fuse only with tensors on GPUs (their fusion buffer is on the device), host tensors only
//! with host tensors. Only error-free allreduce responses (Adasum included) and reduce-scatter responses of
//! small host tensors are fused, each with its own kind; every other response passes through unchanged. A
//! threshold of 0 disables fusion. The plan is a pure function of its input, so every rank that plans the
//! same responses gets the same result.
//!
//! [`FusionLayout`]: crate::fusion::layout::FusionLayout

use std::collections::VecDeque;

use crate::fusion::layout::aligned;
use crate::protocol::message::Response;
use crate::types::CollectiveKind;

/// Fuses `responses` (in the order every rank agreed on) into the responses to execute, in order. With
/// `staged_reducescatters` (the communicator reduce-scatters through shared staging areas, the same on every
/// rank) reduce-scatters of any size fuse, since they are packed into the staging area either way.
pub fn plan_fusion(responses: Vec<Response>, threshold_bytes: usize, staged_reducescatters: bool) -> Vec<Response> {
    if threshold_bytes == 0 {
        return responses;
    }
    let mut pending: VecDeque<Response> = responses.into();
    let mut planned = Vec::with_capacity(pending.len());
    while let Some(mut group) = pending.pop_front() {
        if is_fusable(&group, staged_reducescatters) {
            absorb_following(&mut group, &mut pending, threshold_bytes, staged_reducescatters);
        }
        planned.push(group);
    }
    planned
}

/// Moves the responses that fuse with `group` from the front part of `pending` into it.
fn absorb_following(group: &mut Response, pending: &mut VecDeque<Response>, threshold_bytes: usize, staged: bool) {
    let mut group_end = layout_end(0, group);
    let mut skipped = Vec::new();
    let mut skipped_bytes = 0usize;
    while let Some(next) = pending.pop_front() {
        if fuses_with(group, &next, staged) {
            let end_with_next = layout_end(group_end, &next);
            if end_with_next > threshold_bytes {
                // Never jump over a compatible response: tensors of one kind keep their order.
                pending.push_front(next);
                break;
            }
            group_end = end_with_next;
            group.entries.extend(next.entries);
            continue;
        }
        // Mixed-precision models interleave dtypes, so look past a few non-matching responses rather
        // than end the group at the first one.
        skipped_bytes = skipped_bytes.saturating_add(tensor_bytes(&next));
        skipped.push(next);
        if group_end.saturating_add(skipped_bytes) > threshold_bytes {
            break;
        }
    }
    for response in skipped.into_iter().rev() {
        pending.push_front(response);
    }
}

/// Largest tensor a reduce-scatter fuses: above it, packing the fused buffer costs more than the collectives
/// it saves (2 ranks over shared memory: 256 reduce-scatters of 4 KiB 2.5x faster fused, of 64 KiB even, 12
/// of 4 MiB 2.2x slower).
pub const REDUCESCATTER_FUSION_MAX_TENSOR_BYTES: usize = 64 << 10;

/// Whether a reduce-scatter of tensors of these sizes in bytes runs fused (see
/// [`REDUCESCATTER_FUSION_MAX_TENSOR_BYTES`]).
pub fn reducescatter_fuses(mut tensor_bytes: impl Iterator<Item = usize>) -> bool {
    tensor_bytes.all(|bytes| bytes <= REDUCESCATTER_FUSION_MAX_TENSOR_BYTES)
}

fn is_fusable(response: &Response, staged_reducescatters: bool) -> bool {
    let kind_fuses = match response.kind {
        CollectiveKind::Allreduce => true,
        // Host tensors only (a GPU's reduce-scatters run one by one, see engine::execute_device), small ones
        // unless they are staged.
        CollectiveKind::Reducescatter => {
            !response.on_gpu && (staged_reducescatters || reducescatter_fuses(entry_bytes(response)))
        }
        _ => false,
    };
    kind_fuses && response.error.is_none()
}

fn fuses_with(group: &Response, next: &Response, staged_reducescatters: bool) -> bool {
    is_fusable(next, staged_reducescatters)
        && next.kind == group.kind
        && next.dtype == group.dtype
        && next.reduce_op == group.reduce_op
        && next.prescale == group.prescale
        && next.postscale == group.postscale
        && next.on_gpu == group.on_gpu
        && next.compression == group.compression
}

/// Bytes of each of the response's tensors, saturating instead of overflowing.
fn entry_bytes(response: &Response) -> impl Iterator<Item = usize> + '_ {
    let element_bytes = response.dtype.size();
    response.entries.iter().map(move |entry| entry.num_elements().saturating_mul(element_bytes))
}

fn tensor_bytes(response: &Response) -> usize {
    entry_bytes(response).fold(0, usize::saturating_add)
}

/// End of the fusion-buffer layout after appending the response's tensors to a layout ending at `end`.
fn layout_end(end: usize, response: &Response) -> usize {
    entry_bytes(response)
        .fold(end, |end, bytes| aligned(end).and_then(|offset| offset.checked_add(bytes)).unwrap_or(usize::MAX))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::error::ErrorKind;
    use crate::fusion::layout::FusionLayout;
    use crate::types::{DataType, ReduceOp};
    use proptest::prelude::*;

    fn response(kind: CollectiveKind, name: &str, dtype: DataType, elements: i64) -> Response {
        Response::for_one_tensor(kind, name, dtype, elements)
    }

    fn f32_allreduce(name: &str, elements: i64) -> Response {
        response(CollectiveKind::Allreduce, name, DataType::Float32, elements)
    }

    fn names(planned: &[Response]) -> Vec<Vec<&str>> {
        planned.iter().map(|r| r.entries.iter().map(|e| e.name.as_str()).collect()).collect()
    }

    #[test]
    fn compatible_allreduces_fuse_up_to_the_threshold() {
        // 16 floats = 64 bytes each: three fit in 192 bytes, the fourth starts a new group.
        let input: Vec<_> = ["a", "b", "c", "d"].iter().map(|n| f32_allreduce(n, 16)).collect();
        let planned = plan_fusion(input, 192, false);
        assert_eq!(names(&planned), vec![vec!["a", "b", "c"], vec!["d"]]);
        assert_eq!(FusionLayout::for_response(&planned[0]).unwrap().total_bytes(), 192);
    }

    #[test]
    fn padding_counts_against_the_threshold() {
        // 1 float each: 4 bytes, but the second tensor starts at offset 64.
        let input = vec![f32_allreduce("a", 1), f32_allreduce("b", 1)];
        assert_eq!(names(&plan_fusion(input.clone(), 67, false)), vec![vec!["a"], vec!["b"]]);
        assert_eq!(names(&plan_fusion(input, 68, false)), vec![vec!["a", "b"]]);
    }

    #[test]
    fn gpu_tensors_fuse_only_with_gpu_tensors() {
        let gpu = |name| Response { on_gpu: true, ..f32_allreduce(name, 1) };
        let input = vec![gpu("g1"), f32_allreduce("h1", 1), gpu("g2"), f32_allreduce("h2", 1)];
        assert_eq!(names(&plan_fusion(input, 1024, false)), vec![vec!["g1", "g2"], vec!["h1", "h2"]]);
    }

    #[test]
    fn zero_threshold_disables_fusion() {
        let input = vec![f32_allreduce("a", 0), f32_allreduce("b", 0)];
        assert_eq!(plan_fusion(input.clone(), 0, false), input);
    }

    #[test]
    fn a_tensor_over_the_threshold_runs_alone() {
        let input = vec![f32_allreduce("big", 1000), f32_allreduce("a", 1), f32_allreduce("b", 1)];
        assert_eq!(names(&plan_fusion(input, 128, false)), vec![vec!["big"], vec!["a", "b"]]);
    }

    #[test]
    fn look_ahead_skips_mismatches_and_keeps_them_in_order() {
        let input = vec![
            f32_allreduce("a", 1),
            response(CollectiveKind::Allreduce, "h1", DataType::Float16, 1),
            response(CollectiveKind::Broadcast, "bc", DataType::Float32, 1),
            response(CollectiveKind::Allreduce, "h2", DataType::Float16, 1),
            f32_allreduce("b", 1),
        ];
        let planned = plan_fusion(input, 1024, false);
        assert_eq!(names(&planned), vec![vec!["a", "b"], vec!["h1", "h2"], vec!["bc"]]);
    }

    #[test]
    fn a_compatible_tensor_that_does_not_fit_ends_the_group() {
        // "c" would fit after "a", but must not overtake "b".
        let input = vec![f32_allreduce("a", 81), f32_allreduce("b", 195), f32_allreduce("c", 1)];
        assert_eq!(names(&plan_fusion(input, 1104, false)), vec![vec!["a"], vec!["b", "c"]]);
    }

    #[test]
    fn look_ahead_stops_when_skipped_bytes_exceed_the_threshold() {
        let input = vec![
            f32_allreduce("a", 1),
            response(CollectiveKind::Allreduce, "h", DataType::Float16, 100),
            f32_allreduce("b", 1),
        ];
        assert_eq!(names(&plan_fusion(input, 200, false)), vec![vec!["a"], vec!["h"], vec!["b"]]);
    }

    #[test]
    fn scale_factors_and_errors_prevent_fusion() {
        let mut scaled = f32_allreduce("scaled", 1);
        scaled.postscale = 0.5;
        let mut failed = f32_allreduce("failed", 1);
        failed.error = Some((ErrorKind::Mismatch, "shapes differ".into()));
        let input = vec![f32_allreduce("a", 1), scaled, failed, f32_allreduce("b", 1)];
        assert_eq!(names(&plan_fusion(input, 4096, false)), vec![vec!["a", "b"], vec!["scaled"], vec!["failed"]]);
    }

    #[test]
    fn reducescatters_fuse_with_reducescatters_only() {
        let rs = |name| response(CollectiveKind::Reducescatter, name, DataType::Float32, 4);
        let input = vec![rs("a"), f32_allreduce("x", 4), rs("b"), f32_allreduce("y", 4), rs("c")];
        assert_eq!(names(&plan_fusion(input, 4096, false)), vec![vec!["a", "b", "c"], vec!["x", "y"]]);
        let big = response(CollectiveKind::Reducescatter, "big", DataType::Float32, 1 << 20);
        let around_big = || vec![rs("a"), big.clone(), rs("b")];
        assert_eq!(names(&plan_fusion(around_big(), 64 << 20, false)), vec![vec!["a", "b"], vec!["big"]]);
        // Staged, large ones fuse too (up to the threshold).
        assert_eq!(names(&plan_fusion(around_big(), 64 << 20, true)), vec![vec!["a", "big", "b"]]);
        assert_eq!(names(&plan_fusion(around_big(), 1 << 20, true)), vec![vec!["a"], vec!["big"], vec!["b"]]);
        let mut on_gpu = rs("g");
        on_gpu.on_gpu = true;
        let around_gpu = || vec![rs("a"), on_gpu.clone(), rs("b")];
        assert_eq!(names(&plan_fusion(around_gpu(), 4096, false)), vec![vec!["a", "b"], vec!["g"]]);
        assert_eq!(names(&plan_fusion(around_gpu(), 4096, true)), vec![vec!["a", "b"], vec!["g"]]);
    }

    const KINDS: [CollectiveKind; 5] = [
        CollectiveKind::Allreduce,
        CollectiveKind::Allgather,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
        CollectiveKind::Reducescatter,
    ];

    /// Mostly allreduces over two dtypes, two ops and two postscales, sometimes failed, sometimes other kinds.
    fn arb_responses() -> impl Strategy<Value = Vec<Response>> {
        prop::collection::vec((0usize..8, any::<bool>(), any::<bool>(), any::<bool>(), 0i64..200, 0u8..10), 0..30)
            .prop_map(|specs| {
                specs
                    .into_iter()
                    .enumerate()
                    .map(|(i, (kind, half, max, halve, elements, error))| {
                        let dtype = if half { DataType::Float16 } else { DataType::Float32 };
                        let mut r = response(
                            KINDS.get(kind).copied().unwrap_or(CollectiveKind::Allreduce),
                            &format!("t{i}"),
                            dtype,
                            elements,
                        );
                        r.reduce_op = if max { ReduceOp::Max } else { ReduceOp::Sum };
                        r.postscale = if halve { 0.5 } else { 1.0 };
                        if error == 0 {
                            r.error = Some((ErrorKind::Mismatch, "mismatch".into()));
                        }
                        r
                    })
                    .collect()
            })
    }

    /// Responses that may fuse with each other share a class; every other response is its own class.
    fn class(r: &Response, staged: bool) -> String {
        if is_fusable(r, staged) {
            format!("{:?}/{:?}/{:?}/{}/{}", r.kind, r.dtype, r.reduce_op, r.prescale, r.postscale)
        } else {
            r.entries[0].name.clone()
        }
    }

    proptest! {
        #[test]
        fn plan_properties(input in arb_responses(), threshold in 0usize..2048, staged in any::<bool>()) {
            let planned = plan_fusion(input.clone(), threshold, staged);
            let by_name: HashMap<&str, &Response> = input.iter().map(|r| (r.entries[0].name.as_str(), r)).collect();
            let flat: Vec<&str> = planned.iter().flat_map(|r| r.entries.iter().map(|e| e.name.as_str())).collect();

            // Every tensor exactly once.
            let mut sorted = flat.clone();
            sorted.sort_unstable();
            let mut expected: Vec<&str> = by_name.keys().copied().collect();
            expected.sort_unstable();
            prop_assert_eq!(sorted, expected);

            for r in &planned {
                let first = by_name[r.entries[0].name.as_str()];
                if r.entries.len() == 1 {
                    // Unfused responses, fusable or not, are passed through unchanged.
                    prop_assert_eq!(r, first);
                    continue;
                }
                prop_assert!(threshold > 0);
                prop_assert!(FusionLayout::for_response(r).unwrap().total_bytes() <= threshold);
                for entry in &r.entries {
                    let original = by_name[entry.name.as_str()];
                    prop_assert!(is_fusable(original, staged));
                    prop_assert_eq!(class(original, staged), class(first, staged));
                    prop_assert_eq!(&original.entries[0], entry);
                }
            }

            // Relative order within each class is the input order.
            let position: HashMap<&str, usize> = flat.iter().enumerate().map(|(i, n)| (*n, i)).collect();
            for (i, a) in input.iter().enumerate() {
                for b in &input[i + 1..] {
                    if class(a, staged) == class(b, staged) {
                        prop_assert!(position[a.entries[0].name.as_str()] < position[b.entries[0].name.as_str()]);
                    }
                }
            }

            // Responses that never fuse keep their relative order too.
            let unfusable = |names: Vec<&str>| -> Vec<String> {
                names.into_iter().filter(|n| !is_fusable(by_name[n], staged)).map(str::to_owned).collect()
            };
            prop_assert_eq!(unfusable(flat.clone()), unfusable(input.iter().map(|r| r.entries[0].name.as_str()).collect()));

            if threshold == 0 {
                prop_assert_eq!(&planned, &input);
            }
        }
    }
}
