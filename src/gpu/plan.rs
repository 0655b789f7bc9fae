//! What NCCL calls run an agreed response on this rank, or why it takes host staging instead.
//!
//! A pure function of the response, this rank's place and the loaded NCCL's version, so it is unit-tested
//! here and every rank, given the same response, takes the same route (a rank that planned NCCL while
//! another staged through the host would wait forever). What NCCL cannot do as rvod's CPU path does goes to
//! host staging with the reason: Adasum, int16/uint16 (NCCL has no such type), reductions of bools, integer
//! tensors that are averaged or scaled, scaling of Min/Max/Product, scaling before NCCL 2.11
//! (`ncclRedOpCreatePreMulSum`), fused responses of other ops than allreduce, and uneven reducescatter.
//! Layouts follow the CPU path's (`engine::execute`): allgather concatenates every rank's rows in rank
//! order; alltoall's `per_rank` is the splits matrix, row = sender; reducescatter gives the first
//! `rows % size` ranks one row more.

use std::ffi::c_int;

use crate::gpu::nccl;
use crate::protocol::message::{shape_elements, Response};
use crate::types::{CollectiveKind, DataType, ReduceOp};

/// The reduction NCCL applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NcclOp {
    /// A built-in `ncclRedOp_t` (sum, prod, max, min, avg).
    Builtin(c_int),
    /// `ncclRedOpCreatePreMulSum` with this factor: every input is multiplied by it before the sum (the
    /// prescale, the postscale and Average's 1/size folded into one, since the sum is linear).
    PreMulSum(f64),
}

/// One rank's part of a response, in elements of `dtype` (an NCCL `ncclDataType_t`).
#[derive(Clone, Debug, PartialEq)]
pub enum NcclPlan {
    AllReduce {
        count: usize,
        dtype: c_int,
        op: NcclOp,
    },
    Broadcast {
        count: usize,
        dtype: c_int,
        root: usize,
    },
    /// Every rank sends `count`; the output holds `count * size`.
    AllGather {
        count: usize,
        dtype: c_int,
    },
    /// Uneven first dimensions: one broadcast per rank, in a group, from that rank's input into the output at
    /// `offset` (Horovod's allgatherv over NCCL). `(root, offset, count)`.
    AllGatherV {
        parts: Vec<(usize, usize, usize)>,
        dtype: c_int,
    },
    /// Alltoall: sends and receives in one group. `(peer, offset, count)`, offsets into this rank's input
    /// and output.
    Exchange {
        sends: Vec<(usize, usize, usize)>,
        recvs: Vec<(usize, usize, usize)>,
        dtype: c_int,
    },
    ReduceScatter {
        recv_count: usize,
        dtype: c_int,
        op: NcclOp,
    },
}

/// The first NCCL with `ncclRedOpCreatePreMulSum` (2.11.0).
const PRE_MUL_SUM_VERSION: i32 = 21100;
/// The first NCCL with `ncclAvg` (2.10.0).
const AVG_VERSION: i32 = 21000;

/// The NCCL calls for `response` on communicator rank `rank` of `size`, or why it goes through host staging.
pub fn nccl_plan(response: &Response, rank: usize, size: usize, version: i32) -> Result<NcclPlan, String> {
    let kind = response.kind;
    let dtype = response.dtype;
    let nccl_dtype = nccl::data_type(dtype).ok_or_else(|| format!("NCCL has no {dtype} type"))?;
    let [entry] = response.entries.as_slice() else {
        if kind != CollectiveKind::Allreduce {
            return Err(format!("a fused {kind} of {} tensors runs through host staging", response.entries.len()));
        }
        let count = response.entries.iter().map(|e| e.num_elements()).sum();
        return Ok(NcclPlan::AllReduce { count, dtype: nccl_dtype, op: reduction(response, size, version)? });
    };
    let rows = |r: i64| usize::try_from(r).map_err(|_| format!("negative row count {r} in the response"));
    let row = shape_elements(entry.shape.get(1..).unwrap_or(&[]));
    match kind {
        CollectiveKind::Allreduce => {
            let op = reduction(response, size, version)?;
            Ok(NcclPlan::AllReduce { count: entry.num_elements(), dtype: nccl_dtype, op })
        }
        CollectiveKind::Broadcast => {
            let root = usize::try_from(response.root_rank).map_err(|_| "broadcast without a root".to_string())?;
            Ok(NcclPlan::Broadcast { count: entry.num_elements(), dtype: nccl_dtype, root })
        }
        CollectiveKind::Allgather => {
            let counts = entry.per_rank.iter().map(|&r| rows(r).map(|r| r * row)).collect::<Result<Vec<_>, _>>()?;
            if counts.len() != size {
                return Err(format!("allgather sizes for {} ranks in a communicator of {size}", counts.len()));
            }
            if counts.iter().all(|&c| c == counts[0]) {
                return Ok(NcclPlan::AllGather { count: counts[0], dtype: nccl_dtype });
            }
            let offsets = counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c)));
            let parts =
                offsets.zip(&counts).enumerate().map(|(root, (offset, &count))| (root, offset, count)).collect();
            Ok(NcclPlan::AllGatherV { parts, dtype: nccl_dtype })
        }
        CollectiveKind::Alltoall => {
            if entry.per_rank.len() != size * size {
                return Err(format!("an alltoall splits matrix of {} entries for {size} ranks", entry.per_rank.len()));
            }
            let cell = |sender: usize, receiver: usize| rows(entry.per_rank[sender * size + receiver]).map(|r| r * row);
            let (mut sends, mut recvs, mut sent, mut received) = (Vec::new(), Vec::new(), 0, 0);
            for peer in 0..size {
                let (out, into) = (cell(rank, peer)?, cell(peer, rank)?);
                sends.push((peer, sent, out));
                recvs.push((peer, received, into));
                sent += out;
                received += into;
            }
            Ok(NcclPlan::Exchange { sends, recvs, dtype: nccl_dtype })
        }
        CollectiveKind::Reducescatter => {
            let dim0 = rows(entry.shape.first().copied().unwrap_or(0))?;
            if size == 0 || dim0 % size != 0 {
                return Err(format!("reducescatter of {dim0} rows over {size} ranks is uneven"));
            }
            let op = reduction(response, size, version)?;
            Ok(NcclPlan::ReduceScatter { recv_count: dim0 / size * row, dtype: nccl_dtype, op })
        }
        CollectiveKind::Barrier | CollectiveKind::Join => Err(format!("{kind} moves no tensor data")),
    }
}

/// The NCCL reduction for the response's op and scale factors (see [`NcclOp`]).
fn reduction(response: &Response, size: usize, version: i32) -> Result<NcclOp, String> {
    let (op, dtype) = (response.reduce_op, response.dtype);
    if op == ReduceOp::Adasum {
        return Err("Adasum runs through host staging".into());
    }
    if dtype == DataType::Bool {
        return Err(format!("{op} of bool tensors runs through host staging"));
    }
    let average = op == ReduceOp::Average;
    let factor = response.prescale * response.postscale / if average { size as f64 } else { 1.0 };
    let scaled = response.prescale != 1.0 || response.postscale != 1.0;
    if !dtype.is_float() && (average || scaled) {
        return Err(format!("{op} of {dtype} tensors with scaling runs through host staging (as the CPU path rounds)"));
    }
    match op {
        ReduceOp::Sum if !scaled => Ok(NcclOp::Builtin(0)),
        ReduceOp::Average if !scaled && version >= AVG_VERSION => Ok(NcclOp::Builtin(4)),
        ReduceOp::Sum | ReduceOp::Average if version >= PRE_MUL_SUM_VERSION => Ok(NcclOp::PreMulSum(factor)),
        ReduceOp::Sum | ReduceOp::Average => Err(format!(
            "scaled sums need ncclRedOpCreatePreMulSum (NCCL 2.11+), and NCCL {} is loaded",
            nccl::version_text(version)
        )),
        ReduceOp::Min | ReduceOp::Max | ReduceOp::Product if scaled => {
            Err(format!("{op} with pre/postscale runs through host staging"))
        }
        other => nccl::reduce_op(other, version).map(NcclOp::Builtin).ok_or_else(|| format!("NCCL has no {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::message::ResponseEntry;

    const NCCL: i32 = 23007;

    fn response(kind: CollectiveKind, dtype: DataType, shape: &[i64], per_rank: &[i64]) -> Response {
        let mut r = Response::for_one_tensor(kind, "t", dtype, 0);
        r.entries[0] =
            ResponseEntry { name: "t".into(), shape: shape.to_vec(), per_rank: per_rank.to_vec(), packed: false };
        r
    }

    fn scaled(op: ReduceOp, dtype: DataType, prescale: f64, postscale: f64) -> Response {
        Response { reduce_op: op, prescale, postscale, ..response(CollectiveKind::Allreduce, dtype, &[6], &[]) }
    }

    #[test]
    fn allreduce_ops_and_scaling() {
        let plan = |op, dtype, pre, post, version| nccl_plan(&scaled(op, dtype, pre, post), 0, 4, version);
        let all = |op| Ok(NcclPlan::AllReduce { count: 6, dtype: 7, op });
        assert_eq!(plan(ReduceOp::Sum, DataType::Float32, 1.0, 1.0, NCCL), all(NcclOp::Builtin(0)));
        assert_eq!(plan(ReduceOp::Average, DataType::Float32, 1.0, 1.0, NCCL), all(NcclOp::Builtin(4)));
        assert_eq!(plan(ReduceOp::Average, DataType::Float32, 1.0, 1.0, 21000), all(NcclOp::Builtin(4)));
        assert_eq!(plan(ReduceOp::Max, DataType::Float32, 1.0, 1.0, NCCL), all(NcclOp::Builtin(2)));
        assert_eq!(plan(ReduceOp::Min, DataType::Float32, 1.0, 1.0, NCCL), all(NcclOp::Builtin(3)));
        assert_eq!(plan(ReduceOp::Product, DataType::Float32, 1.0, 1.0, NCCL), all(NcclOp::Builtin(1)));
        assert_eq!(plan(ReduceOp::Sum, DataType::Float32, 0.5, 3.0, NCCL), all(NcclOp::PreMulSum(1.5)));
        assert_eq!(plan(ReduceOp::Average, DataType::Float32, 2.0, 1.0, NCCL), all(NcclOp::PreMulSum(0.5)));
        let old = plan(ReduceOp::Average, DataType::Float32, 1.0, 1.0, 2804).unwrap_err();
        assert_eq!(old, "scaled sums need ncclRedOpCreatePreMulSum (NCCL 2.11+), and NCCL 2.8.4 is loaded");
        assert!(plan(ReduceOp::Max, DataType::Float32, 2.0, 1.0, NCCL).unwrap_err().contains("pre/postscale"));
        assert!(plan(ReduceOp::Average, DataType::Int32, 1.0, 1.0, NCCL).unwrap_err().contains("int32"));
        assert_eq!(
            plan(ReduceOp::Sum, DataType::Int64, 1.0, 1.0, NCCL),
            Ok(NcclPlan::AllReduce { count: 6, dtype: 4, op: NcclOp::Builtin(0) })
        );
        assert!(plan(ReduceOp::Adasum, DataType::Float32, 1.0, 1.0, NCCL).unwrap_err().contains("Adasum"));
        assert!(plan(ReduceOp::Sum, DataType::Bool, 1.0, 1.0, NCCL).unwrap_err().contains("bool"));
        assert_eq!(plan(ReduceOp::Sum, DataType::Int16, 1.0, 1.0, NCCL).unwrap_err(), "NCCL has no int16 type");
    }

    #[test]
    fn a_fused_allreduce_is_one_call_over_every_tensor() {
        let mut r = scaled(ReduceOp::Sum, DataType::Bfloat16, 1.0, 1.0);
        r.entries.push(ResponseEntry { name: "u".into(), shape: vec![2, 5], per_rank: vec![], packed: false });
        assert_eq!(nccl_plan(&r, 1, 2, NCCL), Ok(NcclPlan::AllReduce { count: 16, dtype: 9, op: NcclOp::Builtin(0) }));
        let mut b = response(CollectiveKind::Broadcast, DataType::Float32, &[2], &[]);
        b.entries.push(b.entries[0].clone());
        assert!(nccl_plan(&b, 0, 2, NCCL).unwrap_err().contains("fused broadcast of 2 tensors"));
    }

    #[test]
    fn allgather_even_and_uneven() {
        let even = response(CollectiveKind::Allgather, DataType::Float16, &[2, 3], &[2, 2, 2]);
        assert_eq!(nccl_plan(&even, 1, 3, NCCL), Ok(NcclPlan::AllGather { count: 6, dtype: 6 }));
        let uneven = response(CollectiveKind::Allgather, DataType::Float16, &[1, 3], &[1, 0, 4]);
        assert_eq!(
            nccl_plan(&uneven, 2, 3, NCCL),
            Ok(NcclPlan::AllGatherV { parts: vec![(0, 0, 3), (1, 3, 0), (2, 3, 12)], dtype: 6 })
        );
        let bad = response(CollectiveKind::Allgather, DataType::Float16, &[1], &[1, -1]);
        assert!(nccl_plan(&bad, 0, 2, NCCL).unwrap_err().contains("negative row count -1"));
    }

    #[test]
    fn alltoall_sends_its_row_and_receives_its_column() {
        // 3 ranks; rows 0..3 of the matrix are what ranks 0, 1, 2 send to ranks 0, 1, 2; 2 elements a row.
        let a2a = response(CollectiveKind::Alltoall, DataType::Int32, &[4, 2], &[1, 2, 1, 0, 3, 1, 2, 2, 0]);
        assert_eq!(
            nccl_plan(&a2a, 1, 3, NCCL),
            Ok(NcclPlan::Exchange {
                sends: vec![(0, 0, 0), (1, 0, 6), (2, 6, 2)],
                recvs: vec![(0, 0, 4), (1, 4, 6), (2, 10, 4)],
                dtype: 2
            })
        );
        assert!(nccl_plan(&a2a, 0, 2, NCCL).unwrap_err().contains("9 entries for 2 ranks"));
    }

    #[test]
    fn broadcast_and_reducescatter() {
        let b = Response { root_rank: 2, ..response(CollectiveKind::Broadcast, DataType::Uint8, &[5], &[]) };
        assert_eq!(nccl_plan(&b, 0, 3, NCCL), Ok(NcclPlan::Broadcast { count: 5, dtype: 1, root: 2 }));
        let rs = Response {
            reduce_op: ReduceOp::Average,
            ..response(CollectiveKind::Reducescatter, DataType::Float64, &[6, 2], &[])
        };
        assert_eq!(
            nccl_plan(&rs, 0, 3, NCCL),
            Ok(NcclPlan::ReduceScatter { recv_count: 4, dtype: 8, op: NcclOp::Builtin(4) })
        );
        assert!(nccl_plan(&rs, 0, 4, NCCL).unwrap_err().contains("6 rows over 4 ranks is uneven"));
        let barrier = response(CollectiveKind::Barrier, DataType::Uint8, &[], &[]);
        assert!(nccl_plan(&barrier, 0, 2, NCCL).is_err());
    }
}
