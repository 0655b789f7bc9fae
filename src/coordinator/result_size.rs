//! Refusing allgathers and alltoalls whose result no rank could hold.
//!
//! The size of those results comes from every rank's rows (an allgather's first dimension, an alltoall's
//! splits), so one rank's wrong (or corrupt) claim would make every other rank try to allocate it. The
//! coordinator checks each response it builds: a result on any rank larger than the physical memory of the
//! coordinator's machine (which must hold the same result, or its share of it, too) becomes the response's
//! error, so every rank fails the op alike, before anything is allocated or exchanged, with a message
//! naming the tensor and the rank whose rows make it so.

use std::cmp::Reverse;
use std::sync::OnceLock;

use crate::protocol::message::{shape_elements, Response};
use crate::types::CollectiveKind;

/// The most bytes one rank's result may take: this machine's physical memory (no limit where the system
/// does not say).
pub fn limit() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        // SAFETY: sysconf only reads system values.
        let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        match (usize::try_from(pages), usize::try_from(page)) {
            (Ok(pages), Ok(page)) if pages > 0 && page > 0 => pages.saturating_mul(page),
            _ => usize::MAX,
        }
    })
}

/// Why `response` (an allgather's or alltoall's, of a communicator whose members are `global_ranks`)
/// would give some rank a result larger than `limit` bytes, or `None` when every result fits.
pub fn oversized(response: &Response, global_ranks: &[usize], limit: usize) -> Option<String> {
    let spec = response.entries.first()?;
    let row = shape_elements(spec.shape.get(1..).unwrap_or(&[])).saturating_mul(response.dtype.size());
    let global = |position: usize| global_ranks.get(position).copied().unwrap_or(position);
    let rows = |claimed: i64| claimed.max(0) as usize;
    let name = &spec.name;
    match response.kind {
        CollectiveKind::Allgather => {
            let total = spec.allgather_total_bytes(response.dtype);
            if total.is_some_and(|total| total <= limit) {
                return None;
            }
            let (position, &most) = spec.per_rank.iter().enumerate().min_by_key(|(_, &r)| Reverse(r))?;
            Some(format!(
                "Allgather of tensor '{name}': rank {} sent {most} rows of {row} bytes, so every rank's result \
                 would be {}; this job can hold at most {} (the memory of the coordinator's machine).",
                global(position),
                bytes_text(total),
                bytes_text(Some(limit)),
            ))
        }
        CollectiveKind::Alltoall => {
            let size = global_ranks.len();
            let matrix = &spec.per_rank;
            if size == 0 || matrix.len() != size * size {
                return None; // the executor refuses a malformed matrix itself, on every rank
            }
            (0..size).find_map(|receiver| {
                let from = |sender: usize| rows(matrix[sender * size + receiver]);
                let total = (0..size).try_fold(0usize, |sum, s| sum.checked_add(from(s).checked_mul(row)?));
                if total.is_some_and(|total| total <= limit) {
                    return None;
                }
                let sender = (0..size).min_by_key(|&s| Reverse(from(s)))?;
                Some(format!(
                    "Alltoall of tensor '{name}': rank {} sends {} rows of {row} bytes to rank {}, whose result \
                     would be {}; this job can hold at most {} (the memory of the coordinator's machine).",
                    global(sender),
                    from(sender),
                    global(receiver),
                    bytes_text(total),
                    bytes_text(Some(limit)),
                ))
            })
        }
        _ => None,
    }
}

/// "4.0 TiB"; `None` (a sum that overflowed) is "beyond what memory can address".
fn bytes_text(bytes: Option<usize>) -> String {
    let Some(bytes) = bytes else { return "beyond what memory can address".into() };
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::message::{Response, ResponseEntry};
    use crate::types::DataType;

    fn response(kind: CollectiveKind, shape: &[i64], per_rank: &[i64]) -> Response {
        let mut response = Response::for_one_tensor(kind, "g", DataType::Float32, 1);
        response.entries[0] =
            ResponseEntry { name: "g".into(), shape: shape.to_vec(), per_rank: per_rank.to_vec(), packed: false };
        response
    }

    #[test]
    fn an_allgather_beyond_the_limit_names_the_tensor_and_the_rank_with_the_most_rows() {
        // Set of global ranks 4, 9, 2; the rank at position 1 (global 9) claims 2^30 rows of 8 bytes.
        let ranks = [4, 9, 2];
        let fits = response(CollectiveKind::Allgather, &[3, 2], &[3, 5, 1]);
        assert_eq!(oversized(&fits, &ranks, 1 << 20), None);
        let absurd = response(CollectiveKind::Allgather, &[3, 2], &[3, 1 << 30, 1]);
        let message = oversized(&absurd, &ranks, 1 << 30).unwrap();
        assert_eq!(
            message,
            "Allgather of tensor 'g': rank 9 sent 1073741824 rows of 8 bytes, so every rank's result would be \
             8.0 GiB; this job can hold at most 1.0 GiB (the memory of the coordinator's machine)."
        );
        let overflowing = response(CollectiveKind::Allgather, &[3, 2], &[i64::MAX, 1, i64::MAX]);
        let message = oversized(&overflowing, &ranks, usize::MAX).unwrap();
        assert!(message.contains("rank 4 sent") && message.contains("beyond what memory can address"), "{message}");
    }

    #[test]
    fn an_alltoall_beyond_the_limit_names_the_sender_and_the_receiver() {
        let ranks = [1, 3];
        // Row of 4 bytes; matrix[sender][receiver].
        let fits = response(CollectiveKind::Alltoall, &[4], &[1, 2, 3, 4]);
        assert_eq!(oversized(&fits, &ranks, 1 << 20), None);
        let absurd = response(CollectiveKind::Alltoall, &[4], &[1, 2, 1 << 40, 4]);
        let message = oversized(&absurd, &ranks, 1 << 30).unwrap();
        assert!(message.starts_with("Alltoall of tensor 'g': rank 3 sends 1099511627776 rows of 4 bytes to rank 1,"));
        assert!(message.contains("4.0 TiB"), "{message}");
    }

    #[test]
    fn the_limit_is_this_machines_memory() {
        let limit = limit();
        assert!(limit > 1 << 26 && limit < usize::MAX, "{limit}");
    }
}
