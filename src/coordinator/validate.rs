//! Turning every rank's request for one tensor into the response all ranks run, or into the error all
//! ranks report. Error messages name the tensor, the ranks and the values they disagree on.

use std::fmt::Display;

use crate::coordinator::result_size;
use crate::error::ErrorKind;
use crate::protocol::message::{decode_part_shapes, Request, Response, CPU_DEVICE};
use crate::types::{CollectiveKind, ReduceOp};

/// "rank 0 sent X; ranks 1, 2 sent Y", grouping ranks that agree. Values are listed in rank order; ranks
/// are global rank numbers.
pub(crate) fn describe<T: Display>(values: &[(usize, T)]) -> String {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (rank, value) in values {
        let text = value.to_string();
        match groups.iter_mut().find(|(v, _)| *v == text) {
            Some((_, ranks)) => ranks.push(*rank),
            None => groups.push((text, vec![*rank])),
        }
    }
    groups
        .iter()
        .map(|(value, ranks)| {
            let who = if ranks.len() == 1 {
                format!("rank {}", ranks[0])
            } else {
                format!("ranks {}", ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "))
            };
            format!("{who} sent {value}")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn shape_text(shape: &[i64]) -> String {
    format!("{shape:?}")
}

/// Checks that `key` agrees on every rank; otherwise the mismatch message.
fn agree<T: PartialEq + Display>(
    requests: &[Request],
    global_ranks: &[usize],
    what: &str,
    name: &str,
    kind: CollectiveKind,
    key: impl Fn(&Request) -> T,
) -> Result<(), String> {
    let first = key(&requests[0]);
    if requests.iter().all(|r| key(r) == first) {
        return Ok(());
    }
    let global = |rank: u32| global_ranks.get(rank as usize).copied().unwrap_or(rank as usize);
    let values: Vec<(usize, T)> = requests.iter().map(|r| (global(r.rank), key(r))).collect();
    Err(format!("Mismatched {what} for {kind} of tensor '{name}': {}.", describe(&values)))
}

/// A packed group (see `OpParams::parts`) agrees when every rank has as many tensors, of the same shapes
/// in the same order. The message names the first tensor that differs as `<group>_<index>`, the name it
/// would have had as a separate tensor.
fn agree_on_group(
    requests: &[Request],
    global_ranks: &[usize],
    name: &str,
    kind: CollectiveKind,
) -> Result<(), String> {
    const MALFORMED: &str = "malformed";
    let parts: Vec<Option<Vec<&[i64]>>> = requests.iter().map(|r| decode_part_shapes(&r.params.parts)).collect();
    let count = |i: usize| parts[i].as_ref().map_or(MALFORMED.to_string(), |p| format!("{} tensors", p.len()));
    let indexed: Vec<usize> = (0..requests.len()).collect();
    let by_index = |key: &dyn Fn(usize) -> String, what: &str, tensor: &str| -> Result<(), String> {
        let first = key(0);
        if indexed.iter().all(|&i| key(i) == first) {
            return Ok(());
        }
        let global = |rank: u32| global_ranks.get(rank as usize).copied().unwrap_or(rank as usize);
        let values: Vec<(usize, String)> = indexed.iter().map(|&i| (global(requests[i].rank), key(i))).collect();
        Err(format!("Mismatched {what} for {kind} of tensor '{tensor}': {}.", describe(&values)))
    };
    by_index(&count, "numbers of tensors in the group", name)?;
    let Some(first) = parts[0].as_ref() else { return Ok(()) };
    for index in 0..first.len() {
        let shape = |i: usize| parts[i].as_ref().map_or(MALFORMED.to_string(), |p| shape_text(p[index]));
        by_index(&shape, "tensor shapes", &format!("{name}_{index}"))?;
    }
    Ok(())
}

/// Every rank's tensor is in host memory, or every rank's is on a GPU (each its own ordinal); otherwise
/// Horovod's "Mismatched CPU/GPU device selection", naming each rank's device.
fn agree_on_device(
    requests: &[Request],
    global_ranks: &[usize],
    name: &str,
    kind: CollectiveKind,
) -> Result<(), String> {
    let on_cpu = |r: &Request| r.params.device == CPU_DEVICE;
    if requests.iter().all(on_cpu) || !requests.iter().any(on_cpu) {
        return Ok(());
    }
    let global = |rank: u32| global_ranks.get(rank as usize).copied().unwrap_or(rank as usize);
    let values: Vec<(usize, String)> = requests
        .iter()
        .map(|r| (global(r.rank), if on_cpu(r) { "CPU".to_string() } else { format!("GPU {}", r.params.device) }))
        .collect();
    Err(format!("Mismatched CPU/GPU device selection for {kind} of tensor '{name}': {}.", describe(&values)))
}

fn error_response(first: &Request, kind: ErrorKind, message: String) -> Response {
    Response { error: Some((kind, message)), ..Response::for_params(first.name.clone(), &first.params, Vec::new()) }
}

struct ShapeText<'a>(&'a [i64]);
impl Display for ShapeText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&shape_text(self.0))
    }
}

/// Build the response for one tensor from the requests of every rank that submitted it (sorted by rank,
/// non-empty). `global_ranks[r]` is the global rank of communicator rank `r` (its length is the
/// communicator size); `any_joined` tells whether some ranks joined instead of submitting (they contribute
/// zeros to an allreduce; other collectives cannot run then).
pub fn construct_response(requests: &[Request], global_ranks: &[usize], any_joined: bool) -> Response {
    let size = global_ranks.len();
    let first = &requests[0];
    let name = first.name.as_str();
    let kind = first.params.kind;
    let mismatch = |message: String| error_response(first, ErrorKind::Mismatch, message);

    if let Err(m) = agree(requests, global_ranks, "operations", name, kind, |r| r.params.kind.name()) {
        return mismatch(m);
    }
    if let Err(m) = agree(requests, global_ranks, "data types", name, kind, |r| r.params.dtype.name()) {
        return mismatch(m);
    }
    if let Err(m) = agree_on_device(requests, global_ranks, name, kind) {
        return mismatch(m);
    }
    if any_joined && kind != CollectiveKind::Allreduce && kind != CollectiveKind::Barrier {
        return error_response(first, ErrorKind::Invalid, not_supported_with_join(kind, name, requests, global_ranks));
    }
    let check = match kind {
        CollectiveKind::Allreduce | CollectiveKind::Reducescatter => {
            let shapes = if requests.iter().any(|r| !r.params.parts.is_empty()) {
                agree_on_group(requests, global_ranks, name, kind)
            } else {
                agree(requests, global_ranks, "tensor shapes", name, kind, |r| shape_text(&r.params.shape))
            };
            let ops =
                || agree(requests, global_ranks, "reduction operations", name, kind, |r| r.params.reduce_op.name());
            let scales = || {
                agree(requests, global_ranks, "prescale and/or postscale factors", name, kind, |r| {
                    format!("prescale={} postscale={}", r.params.prescale, r.params.postscale)
                })
            };
            let compressions =
                || agree(requests, global_ranks, "compressions", name, kind, |r| r.params.compression.to_string());
            shapes.and_then(|_| ops()).and_then(|_| scales()).and_then(|_| compressions())
        }
        CollectiveKind::Broadcast => {
            agree(requests, global_ranks, "tensor shapes", name, kind, |r| shape_text(&r.params.shape))
                .and_then(|_| agree(requests, global_ranks, "root ranks", name, kind, |r| r.params.root_rank))
        }
        CollectiveKind::Allgather | CollectiveKind::Alltoall => {
            agree(requests, global_ranks, "tensor ranks (number of dimensions)", name, kind, |r| r.params.shape.len())
                .and_then(|_| {
                    agree(requests, global_ranks, "tensor shapes beyond the first dimension", name, kind, |r| {
                        ShapeText(r.params.shape.get(1..).unwrap_or(&[])).to_string()
                    })
                })
        }
        CollectiveKind::Barrier | CollectiveKind::Join => Ok(()),
    };
    if let Err(m) = check {
        return mismatch(m);
    }
    if matches!(kind, CollectiveKind::Allgather | CollectiveKind::Reducescatter) && first.params.shape.is_empty() {
        let message =
            format!("{} of tensor '{name}' needs at least one dimension, got a scalar.", capitalise(kind.name()));
        return error_response(first, ErrorKind::Invalid, message);
    }
    if kind == CollectiveKind::Reducescatter && !matches!(first.params.reduce_op, ReduceOp::Sum | ReduceOp::Average) {
        let message =
            format!("Reducescatter of tensor '{name}' supports only Average and Sum, not {}.", first.params.reduce_op);
        return error_response(first, ErrorKind::Invalid, message);
    }

    let per_rank = match kind {
        CollectiveKind::Allgather => requests.iter().map(|r| r.params.shape.first().copied().unwrap_or(0)).collect(),
        CollectiveKind::Alltoall => {
            let mut matrix = Vec::with_capacity(size * size);
            for r in requests {
                if r.params.splits.len() == size {
                    matrix.extend_from_slice(&r.params.splits);
                } else {
                    let rows = r.params.shape.first().copied().unwrap_or(0).max(0) / size.max(1) as i64;
                    matrix.extend(std::iter::repeat(rows).take(size));
                }
            }
            matrix
        }
        _ => Vec::new(),
    };
    let response = Response::for_params(name.to_string(), &first.params, per_rank);
    match result_size::oversized(&response, global_ranks, result_size::limit()) {
        Some(message) => error_response(first, ErrorKind::Invalid, message),
        None => response,
    }
}

/// Horovod's words for a collective some ranks cannot take part in because they joined, then which
/// tensor and which ranks.
fn not_supported_with_join(kind: CollectiveKind, name: &str, requests: &[Request], global_ranks: &[usize]) -> String {
    let horovod = match kind {
        CollectiveKind::Allgather => {
            "Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using DistributedOptimizer"
                .to_string()
        }
        other => format!("{} is not supported with Join at this time.", capitalise(other.name())),
    };
    let joined: Vec<String> = (0..global_ranks.len() as u32)
        .filter(|r| !requests.iter().any(|q| q.rank == *r))
        .map(|r| global_ranks[r as usize].to_string())
        .collect();
    let noun = if joined.len() == 1 { "rank" } else { "ranks" };
    format!(
        "{horovod} (tensor '{name}'; {noun} {} joined; only allreduce runs until every rank has)",
        joined.join(", ")
    )
}

fn capitalise(word: &str) -> String {
    let mut chars = word.chars();
    match chars.next() {
        Some(c) => c.to_uppercase().collect::<String>() + chars.as_str(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::test_requests::{allreduce_request, changed};
    use crate::types::DataType;

    fn ranks(n: usize) -> Vec<usize> {
        (0..n).collect()
    }

    fn req(rank: u32, kind: CollectiveKind, shape: &[i64]) -> Request {
        changed(allreduce_request(rank, "t", shape), |p| p.kind = kind)
    }

    #[test]
    fn agreeing_allreduce_gives_a_response() {
        let r = construct_response(
            &[req(0, CollectiveKind::Allreduce, &[2, 3]), req(1, CollectiveKind::Allreduce, &[2, 3])],
            &ranks(2),
            false,
        );
        assert!(r.error.is_none());
        assert_eq!(r.entries[0].shape, vec![2, 3]);
    }

    fn group(rank: u32, shapes: &[&[i64]]) -> Request {
        let total = shapes.iter().map(|s| s.iter().product::<i64>()).sum::<i64>();
        let parts = crate::protocol::message::encode_part_shapes(shapes.iter().copied());
        Request {
            name: "grouped_allreduce.g".into(),
            ..changed(req(rank, CollectiveKind::Allreduce, &[total]), |p| p.parts = parts)
        }
    }

    #[test]
    fn packed_groups_agree_member_by_member() {
        let ok = construct_response(&[group(0, &[&[2, 3], &[4]]), group(1, &[&[2, 3], &[4]])], &ranks(2), false);
        assert!(ok.error.is_none());
        assert_eq!(ok.entries[0].shape, vec![10]);
        assert!(ok.entries[0].packed, "a joined rank learns from the response that it runs a packed group");
        let plain = construct_response(
            &[req(0, CollectiveKind::Allreduce, &[10]), req(1, CollectiveKind::Allreduce, &[10])],
            &ranks(2),
            false,
        );
        assert!(!plain.entries[0].packed);

        // Same total, different members: the first member that differs is named.
        let r = construct_response(
            &[group(0, &[&[2, 3], &[4]]), group(1, &[&[2, 3], &[2, 2]]), group(2, &[&[2, 3], &[4]])],
            &ranks(3),
            false,
        );
        assert_eq!(
            r.error.unwrap(),
            (
                ErrorKind::Mismatch,
                "Mismatched tensor shapes for allreduce of tensor 'grouped_allreduce.g_1': ranks 0, 2 sent [4]; rank 1 sent [2, 2].".into()
            )
        );

        let r = construct_response(&[group(0, &[&[2], &[4]]), group(1, &[&[2]])], &ranks(2), false);
        assert_eq!(
            r.error.unwrap().1,
            "Mismatched numbers of tensors in the group for allreduce of tensor 'grouped_allreduce.g': rank 0 sent 2 tensors; rank 1 sent 1 tensors."
        );

        // A plain tensor against a group of the same size, and a malformed encoding from a peer.
        let plain = Request { name: "grouped_allreduce.g".into(), ..req(1, CollectiveKind::Allreduce, &[6]) };
        let r = construct_response(&[group(0, &[&[6]]), plain], &ranks(2), false);
        assert_eq!(r.error.unwrap().0, ErrorKind::Mismatch);
        let bad = changed(group(1, &[&[6]]), |p| p.parts = vec![5, 1]);
        let r = construct_response(&[group(0, &[&[6]]), bad], &ranks(2), false);
        assert!(r.error.unwrap().1.contains("rank 1 sent malformed"));
    }

    #[test]
    fn shape_mismatch_names_ranks_and_shapes() {
        let r = construct_response(
            &[
                req(0, CollectiveKind::Allreduce, &[2, 3]),
                req(1, CollectiveKind::Allreduce, &[4]),
                req(2, CollectiveKind::Allreduce, &[2, 3]),
            ],
            &ranks(3),
            false,
        );
        let (kind, msg) = r.error.unwrap();
        assert_eq!(kind, ErrorKind::Mismatch);
        assert_eq!(
            msg,
            "Mismatched tensor shapes for allreduce of tensor 't': ranks 0, 2 sent [2, 3]; rank 1 sent [4]."
        );
    }

    #[test]
    fn dtype_op_root_and_scale_mismatches() {
        let mut b = req(1, CollectiveKind::Allreduce, &[2]);
        b.params.dtype = DataType::Float64;
        let msg = construct_response(&[req(0, CollectiveKind::Allreduce, &[2]), b], &ranks(2), false).error.unwrap().1;
        assert!(msg.contains("data types") && msg.contains("rank 1 sent float64"), "{msg}");

        let mut b = req(1, CollectiveKind::Allreduce, &[2]);
        b.params.reduce_op = ReduceOp::Max;
        let msg = construct_response(&[req(0, CollectiveKind::Allreduce, &[2]), b], &ranks(2), false).error.unwrap().1;
        assert!(msg.contains("reduction operations") && msg.contains("Max"), "{msg}");

        let mut a = req(0, CollectiveKind::Broadcast, &[2]);
        a.params.root_rank = 0;
        let mut b = req(1, CollectiveKind::Broadcast, &[2]);
        b.params.root_rank = 1;
        let msg = construct_response(&[a, b], &ranks(2), false).error.unwrap().1;
        assert!(msg.contains("root ranks") && msg.contains("rank 1 sent 1"), "{msg}");

        let mut b = req(1, CollectiveKind::Allreduce, &[2]);
        b.params.prescale = 2.0;
        let msg = construct_response(&[req(0, CollectiveKind::Allreduce, &[2]), b], &ranks(2), false).error.unwrap().1;
        assert!(msg.contains("prescale"), "{msg}");

        let msg = construct_response(
            &[req(0, CollectiveKind::Allreduce, &[2]), req(1, CollectiveKind::Broadcast, &[2])],
            &ranks(2),
            false,
        )
        .error
        .unwrap()
        .1;
        assert!(msg.contains("operations") && msg.contains("broadcast"), "{msg}");
    }

    #[test]
    fn allgather_collects_first_dimensions() {
        let r = construct_response(
            &[req(0, CollectiveKind::Allgather, &[2, 3]), req(1, CollectiveKind::Allgather, &[5, 3])],
            &ranks(2),
            false,
        );
        assert!(r.error.is_none());
        assert_eq!(r.entries[0].per_rank, vec![2, 5]);
        let r = construct_response(
            &[req(0, CollectiveKind::Allgather, &[2, 3]), req(1, CollectiveKind::Allgather, &[5, 4])],
            &ranks(2),
            false,
        );
        assert!(r.error.unwrap().1.contains("beyond the first dimension"));
        let r = construct_response(
            &[req(0, CollectiveKind::Allgather, &[]), req(1, CollectiveKind::Allgather, &[])],
            &ranks(2),
            false,
        );
        assert_eq!(r.error.unwrap().0, ErrorKind::Invalid);
    }

    #[test]
    fn an_allgather_whose_rows_no_rank_could_hold_is_refused_naming_the_tensor_and_the_rank() {
        // Global ranks 2 and 7; 7 claims 2^40 rows of 3 float32 values (12 TiB): addressable, not holdable.
        let r = construct_response(
            &[req(0, CollectiveKind::Allgather, &[2, 3]), req(1, CollectiveKind::Allgather, &[1 << 40, 3])],
            &[2, 7],
            false,
        );
        let (kind, message) = r.error.unwrap();
        assert_eq!(kind, ErrorKind::Invalid);
        assert!(
            message.starts_with("Allgather of tensor 't': rank 7 sent 1099511627776 rows of 12 bytes"),
            "{message}"
        );
        assert!(message.contains("would be 12.0 TiB; this job can hold at most "), "{message}");
    }

    #[test]
    fn alltoall_builds_the_split_matrix() {
        let mut a = req(0, CollectiveKind::Alltoall, &[3]);
        a.params.splits = vec![1, 2];
        let b = req(1, CollectiveKind::Alltoall, &[4]);
        let r = construct_response(&[a, b], &ranks(2), false);
        assert_eq!(r.entries[0].per_rank, vec![1, 2, 2, 2]);
    }

    #[test]
    fn messages_name_global_ranks() {
        let r = construct_response(
            &[req(0, CollectiveKind::Allreduce, &[2]), req(1, CollectiveKind::Allreduce, &[3])],
            &[1, 3],
            false,
        );
        let msg = r.error.unwrap().1;
        assert!(msg.contains("rank 1 sent [2]; rank 3 sent [3]"), "{msg}");
    }

    #[test]
    fn join_allows_only_allreduce() {
        let r = construct_response(&[req(0, CollectiveKind::Broadcast, &[2])], &ranks(2), true);
        assert_eq!(
            r.error.unwrap(),
            (
                ErrorKind::Invalid,
                "Broadcast is not supported with Join at this time. (tensor 't'; rank 1 joined; only allreduce runs \
                 until every rank has)"
                    .into()
            )
        );
        let r = construct_response(&[req(1, CollectiveKind::Allgather, &[2])], &ranks(3), true);
        let message = r.error.unwrap().1;
        assert!(
            message.starts_with("Allgather is not supported with Join at this time. Specify sparse_to_dense=True"),
            "{message}"
        );
        assert!(message.contains("ranks 0, 2 joined"), "{message}");
        for (kind, word) in [(CollectiveKind::Alltoall, "Alltoall"), (CollectiveKind::Reducescatter, "Reducescatter")] {
            let message = construct_response(&[req(0, kind, &[2])], &ranks(2), true).error.unwrap().1;
            assert!(message.starts_with(&format!("{word} is not supported with Join at this time.")), "{message}");
        }
        let r = construct_response(&[req(0, CollectiveKind::Allreduce, &[2])], &ranks(2), true);
        assert!(r.error.is_none());
    }

    #[test]
    fn a_cpu_tensor_against_a_gpu_tensor_is_a_mismatch_naming_both() {
        let on = |rank: u32, device: i32| changed(req(rank, CollectiveKind::Allreduce, &[2]), |p| p.device = device);
        let r = construct_response(&[on(0, CPU_DEVICE), on(1, 0), on(2, 1)], &ranks(3), false);
        assert_eq!(
            r.error.unwrap(),
            (
                ErrorKind::Mismatch,
                "Mismatched CPU/GPU device selection for allreduce of tensor 't': rank 0 sent CPU; rank 1 sent GPU 0; \
                 rank 2 sent GPU 1."
                    .into()
            )
        );
        let r = construct_response(&[on(0, 0), on(1, CPU_DEVICE)], &[4, 6], false);
        assert!(r.error.unwrap().1.contains("rank 4 sent GPU 0; rank 6 sent CPU"), "global ranks are named");
        let own = construct_response(&[on(0, 0), on(1, 1)], &ranks(2), false);
        assert!(own.error.is_none() && own.on_gpu, "each rank on its own GPU: a GPU response");
        assert!(!construct_response(&[on(0, CPU_DEVICE), on(1, CPU_DEVICE)], &ranks(2), false).on_gpu);
        assert!(construct_response(&[on(0, 0), on(1, 0)], &ranks(2), false).error.is_none(), "two ranks on one GPU");
        let broadcast = |rank: u32, device: i32| {
            changed(req(rank, CollectiveKind::Broadcast, &[2]), |p| {
                p.device = device;
                p.root_rank = 0;
            })
        };
        let message =
            construct_response(&[broadcast(0, 3), broadcast(1, CPU_DEVICE)], &ranks(2), false).error.unwrap().1;
        assert!(message.starts_with("Mismatched CPU/GPU device selection for broadcast"), "{message}");
    }

    #[test]
    fn reducescatter_rejects_min() {
        let mut a = req(0, CollectiveKind::Reducescatter, &[4]);
        a.params.reduce_op = ReduceOp::Min;
        let r = construct_response(&[a], &ranks(1), false);
        assert!(r.error.unwrap().1.contains("only Average and Sum"));
    }
}
