//! Setting up a process set's GPU route over its own transport (already authenticated by the job's
//! secret): every member learns every other's host, GPU and NCCL, all take the same route
//! ([`choice::choose`] on the same table), and for NCCL rank 0's unique id reaches every member by
//! broadcast; after each member tried to start its communicator, all learn whether every one succeeded
//! ([`agree_on_outcome`]). No NCCL or CUDA call is made here (the caller passes what it found and how to make an id), so
//! it is tested with the in-memory transport.

use crate::config::GpuTransport;
use crate::gpu::choice::{choose, Member, Route};
use crate::gpu::nccl::version_text;
use crate::ring::{allgatherv, broadcast};
use crate::transport::{Transport, TransportError};

/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// What this rank brings: where it runs and the NCCL it loaded (its version code, or why none).
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub host: String,
    /// The GPU's PCI bus id.
    pub gpu: String,
    pub nccl: Result<i32, String>,
}

/// The route every member agreed on.
#[derive(Clone, Debug, PartialEq)]
pub enum Setup {
    Nccl { unique_id: [u8; UNIQUE_ID_BYTES], reason: String },
    HostStaging { reason: String },
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("{0}")]
    Refused(String),
}

/// Agree on the route of the process set `t` connects (`global_ranks[i]` is member i's global rank, for
/// messages). `make_id` is called on rank 0 only, when the route is NCCL. Every member returns the same
/// route and reason, or the same refusal.
pub fn agree_on_route(
    t: &mut dyn Transport,
    global_ranks: &[usize],
    mine: &Placement,
    setting: GpuTransport,
    make_id: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES], String>,
) -> Result<Setup, BootstrapError> {
    let everyone = exchange(t, &encode(mine))?;
    let global = |i: usize| global_ranks.get(i).copied().unwrap_or(i);
    let placements = everyone
        .iter()
        .enumerate()
        .map(|(i, bytes)| decode(bytes).ok_or_else(|| format!("rank {} sent a malformed GPU placement", global(i))))
        .collect::<Result<Vec<Placement>, String>>()
        .map_err(BootstrapError::Refused)?;
    let members: Vec<Member> = placements
        .iter()
        .enumerate()
        .map(|(i, p)| Member { rank: global(i), host: p.host.clone(), gpu: p.gpu.clone() })
        .collect();
    let nccl = common_nccl(&placements, &global).map(version_text);
    let nccl = match &nccl {
        Ok(version) => Ok(version.as_str()),
        Err(why) => Err(why.as_str()),
    };
    let (route, reason) = choose(setting, &members, nccl).map_err(BootstrapError::Refused)?;
    if route == Route::HostStaging {
        return Ok(Setup::HostStaging { reason });
    }
    // Rank 0 sends its id with a flag, so a failure to make one reaches every member instead of a hang.
    let mut message = [0u8; 1 + UNIQUE_ID_BYTES];
    let mut made = Ok(());
    if t.rank() == 0 {
        match make_id() {
            Ok(id) => {
                message[0] = 1;
                message[1..].copy_from_slice(&id);
            }
            Err(why) => made = Err(why),
        }
    }
    broadcast(t, &mut message, 0)?;
    made.map_err(BootstrapError::Refused)?;
    if message[0] != 1 {
        return Err(BootstrapError::Refused(format!("rank {} could not create the NCCL unique id", global(0))));
    }
    let mut unique_id = [0u8; UNIQUE_ID_BYTES];
    unique_id.copy_from_slice(&message[1..]);
    Ok(Setup::Nccl { unique_id, reason })
}

/// After each member tried a step of the set-up (e.g. `ncclCommInitRank`), whether all succeeded: every
/// member returns the same answer, the first failure as "rank R: why" (global rank), so none goes on to a
/// collective that a member that failed would never join.
pub fn agree_on_outcome(
    t: &mut dyn Transport,
    global_ranks: &[usize],
    mine: Result<(), &str>,
) -> Result<Result<(), String>, BootstrapError> {
    let text = mine.err().map(|why| if why.is_empty() { "failed" } else { why }).unwrap_or("");
    let everyone = exchange(t, text.as_bytes())?;
    let failed = everyone.iter().enumerate().find(|(_, why)| !why.is_empty());
    Ok(match failed {
        Some((i, why)) => {
            Err(format!("rank {}: {}", global_ranks.get(i).copied().unwrap_or(i), String::from_utf8_lossy(why)))
        }
        None => Ok(()),
    })
}

/// The NCCL version every member loaded, or why NCCL cannot serve them all (one lacks it, or versions differ).
fn common_nccl(placements: &[Placement], global: &dyn Fn(usize) -> usize) -> Result<i32, String> {
    if let Some((i, Err(why))) = placements.iter().map(|p| &p.nccl).enumerate().find(|(_, n)| n.is_err()) {
        return Err(format!("rank {}: {why}", global(i)));
    }
    let versions: Vec<i32> = placements.iter().filter_map(|p| p.nccl.as_ref().ok().copied()).collect();
    match versions.first() {
        Some(&first) if versions.iter().all(|&v| v == first) => Ok(first),
        Some(_) => {
            let listed: Vec<String> = versions
                .iter()
                .enumerate()
                .map(|(i, &v)| format!("rank {} has {}", global(i), version_text(v)))
                .collect();
            Err(format!("NCCL versions differ ({})", listed.join(", ")))
        }
        None => Err("no member".into()),
    }
}

/// Longest placement a peer may announce (a host name and a bus id take far less): a bound on what a
/// peer's bytes can make this rank allocate.
const MAX_PLACEMENT_BYTES: usize = 64 * 1024;

/// Every member's bytes, in member order: first every length, then the bytes.
fn exchange(t: &mut dyn Transport, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
    let n = t.size();
    let mut lengths = vec![0u8; 8 * n];
    allgatherv(t, &(mine.len() as u64).to_le_bytes(), &mut lengths, &vec![8; n])?;
    let lengths: Vec<usize> =
        lengths.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as usize).collect();
    if let Some((member, len)) = lengths.iter().enumerate().find(|(_, &len)| len > MAX_PLACEMENT_BYTES) {
        return Err(BootstrapError::Refused(format!("member {member} announced a GPU placement of {len} bytes")));
    }
    let mut all = vec![0u8; lengths.iter().sum()];
    allgatherv(t, mine, &mut all, &lengths)?;
    let mut rest = all.as_slice();
    Ok(lengths
        .iter()
        .map(|&len| {
            let (one, tail) = rest.split_at(len.min(rest.len()));
            rest = tail;
            one.to_vec()
        })
        .collect())
}

/// `version: i32, then host, gpu and the NCCL error, each u32 length + UTF-8`.
fn encode(p: &Placement) -> Vec<u8> {
    let mut bytes = p.nccl.as_ref().map_or(0, |v| *v).to_le_bytes().to_vec();
    for text in [p.host.as_str(), p.gpu.as_str(), p.nccl.as_ref().err().map_or("", String::as_str)] {
        bytes.extend_from_slice(&(text.len() as u32).to_le_bytes());
        bytes.extend_from_slice(text.as_bytes());
    }
    bytes
}

/// A peer's placement, or `None` for bytes that are not one (checked, never trusted).
fn decode(bytes: &[u8]) -> Option<Placement> {
    let version = i32::from_le_bytes(bytes.get(..4)?.try_into().ok()?);
    let mut rest = bytes.get(4..)?;
    let mut text = || -> Option<String> {
        let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let value = String::from_utf8(rest.get(4..4 + len)?.to_vec()).ok()?;
        rest = rest.get(4 + len..)?;
        Some(value)
    };
    let (host, gpu, error) = (text()?, text()?, text()?);
    let nccl = if error.is_empty() { Ok(version) } else { Err(error) };
    Some(Placement { host, gpu, nccl })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    fn placement(host: &str, gpu: &str, nccl: Result<i32, &str>) -> Placement {
        Placement { host: host.into(), gpu: gpu.into(), nccl: nccl.map_err(String::from) }
    }

    /// Run the bootstrap on one rank per placement; rank 0 makes the id `[7; 128]` (or fails with `id_error`).
    fn agree(placements: Vec<Placement>, setting: GpuTransport, id_error: Option<&str>) -> Vec<Result<Setup, String>> {
        let mesh = MemoryTransport::mesh_with_timeout(placements.len(), std::time::Duration::from_secs(5));
        let globals: Vec<usize> = (0..placements.len()).map(|i| 10 + i).collect();
        run_ranks(mesh, |t| {
            let made = || id_error.map_or(Ok([7u8; UNIQUE_ID_BYTES]), |e| Err(e.to_string()));
            let mine = &placements[t.rank()];
            agree_on_route(t, &globals, mine, setting, made).map_err(|e| e.to_string())
        })
    }

    #[test]
    fn ranks_with_their_own_gpus_get_rank_zeros_unique_id() {
        let own = vec![
            placement("a", "0:3b", Ok(23007)),
            placement("a", "0:5e", Ok(23007)),
            placement("b", "0:3b", Ok(23007)),
        ];
        let setups = agree(own, GpuTransport::Auto, None);
        let expected = Setup::Nccl {
            unique_id: [7; UNIQUE_ID_BYTES],
            reason: "every rank of the process set has a GPU of its own; NCCL 2.30.7".into(),
        };
        assert!(setups.iter().all(|s| *s == Ok(expected.clone())), "{setups:?}");
    }

    #[test]
    fn every_rank_takes_host_staging_for_the_same_reason() {
        let shared = vec![placement("a", "0:3b", Ok(23007)), placement("a", "0:3b", Ok(23007))];
        let setups = agree(shared, GpuTransport::Auto, None);
        let reason =
            "ranks 10 and 11 share GPU 0:3b on host a; NCCL refuses a GPU shared by two ranks, so collectives \
                      stage through host memory";
        assert!(setups.iter().all(|s| *s == Ok(Setup::HostStaging { reason: reason.into() })), "{setups:?}");

        let one_lacks = vec![placement("a", "0:3b", Ok(23007)), placement("b", "0:3b", Err("libnccl.so.2 not found"))];
        let setups = agree(one_lacks, GpuTransport::Auto, None);
        let reason = "NCCL is not available (rank 11: libnccl.so.2 not found); staging through host memory";
        assert!(setups.iter().all(|s| *s == Ok(Setup::HostStaging { reason: reason.into() })), "{setups:?}");

        let differ = vec![placement("a", "0:3b", Ok(23007)), placement("b", "0:3b", Ok(22105))];
        let setups = agree(differ, GpuTransport::Auto, None);
        let Ok(Setup::HostStaging { reason }) = &setups[1] else { panic!("{setups:?}") };
        assert!(reason.contains("NCCL versions differ (rank 10 has 2.30.7, rank 11 has 2.21.5)"), "{reason}");
        assert_eq!(setups[0], setups[1]);
    }

    #[test]
    fn refusals_reach_every_rank_instead_of_a_hang() {
        let shared = vec![placement("a", "0:3b", Ok(23007)), placement("a", "0:3b", Ok(23007))];
        let setups = agree(shared, GpuTransport::Nccl, None);
        assert!(setups.iter().all(|s| s.as_ref().is_err_and(|e| e.contains("Duplicate GPU detected"))), "{setups:?}");

        let own = vec![placement("a", "0:3b", Ok(23007)), placement("a", "0:5e", Ok(23007))];
        let setups = agree(own, GpuTransport::Auto, Some("ncclGetUniqueId failed: ncclSystemError"));
        assert_eq!(setups[0], Err("ncclGetUniqueId failed: ncclSystemError".to_string()));
        assert_eq!(setups[1], Err("rank 10 could not create the NCCL unique id".to_string()));
    }

    #[test]
    fn every_rank_learns_the_first_failure_of_a_step() {
        let mesh = MemoryTransport::mesh_with_timeout(3, std::time::Duration::from_secs(5));
        let outcomes = run_ranks(mesh, |t| {
            let mine = if t.rank() == 0 { Ok(()) } else { Err("ncclCommInitRank failed") };
            agree_on_outcome(t, &[4, 5, 6], mine).map_err(|e| e.to_string())
        });
        assert!(outcomes.iter().all(|o| *o == Ok(Err("rank 5: ncclCommInitRank failed".to_string()))), "{outcomes:?}");
        let mesh = MemoryTransport::mesh_with_timeout(2, std::time::Duration::from_secs(5));
        let outcomes = run_ranks(mesh, |t| agree_on_outcome(t, &[0, 1], Ok(())).map_err(|e| e.to_string()));
        assert!(outcomes.iter().all(|o| *o == Ok(Ok(()))), "{outcomes:?}");
    }

    #[test]
    fn a_peer_announcing_a_huge_placement_is_refused_without_allocating_it() {
        let mesh = MemoryTransport::mesh_with_timeout(2, std::time::Duration::from_secs(5));
        let outcomes = run_ranks(mesh, |t| {
            let mine =
                if t.rank() == 1 { vec![0u8; MAX_PLACEMENT_BYTES + 1] } else { encode(&placement("a", "g", Ok(1))) };
            exchange(t, &mine).map(|_| ()).map_err(|e| e.to_string())
        });
        let refused = Err(format!("member 1 announced a GPU placement of {} bytes", MAX_PLACEMENT_BYTES + 1));
        assert_eq!(outcomes, vec![refused.clone(), refused]);
    }

    #[test]
    fn placements_round_trip_and_garbage_is_refused() {
        for p in [placement("host-1", "0000:3b:00.0", Ok(23007)), placement("", "", Err("no driver"))] {
            assert_eq!(decode(&encode(&p)), Some(p));
        }
        let good = encode(&placement("h", "g", Ok(1)));
        for cut in 0..good.len() {
            assert_eq!(decode(&good[..cut]), None, "truncated at {cut}");
        }
        assert_eq!(decode(&[0, 0, 0, 0, 255, 255, 255, 255]), None);
    }
}
