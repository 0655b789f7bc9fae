//! Which way a process set's GPU collectives travel: NCCL, or host staging through rvod's own transports.
//!
//! NCCL needs every member on a GPU of its own: two ranks of one communicator on the same GPU make
//! `ncclCommInitRank` fail with "Duplicate GPU detected". Host staging serves any placement. The choice is
//! a pure function of the setting, the members' GPUs and whether NCCL loaded, so every rank, given the same
//! table, makes the same one; its reason is what `--verbose` prints.

use crate::config::GpuTransport;

/// Where one member of the process set runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Global rank.
    pub rank: usize,
    pub host: String,
    /// The GPU's identity on its host (its PCI bus id, e.g. `0000:3b:00.0`); empty when the member has no
    /// GPU rvod can use (it joined before it submitted a GPU tensor, or its GPU failed).
    pub gpu: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Nccl,
    HostStaging,
}

/// The route for a process set, and why, or why none can serve it (only when the setting forces NCCL).
/// `nccl` is the loaded NCCL's version text (e.g. `2.30.7`), or why it is not available.
pub fn choose(setting: GpuTransport, members: &[Member], nccl: Result<&str, &str>) -> Result<(Route, String), String> {
    if setting == GpuTransport::Host {
        return Ok((Route::HostStaging, "RVOD_GPU_TRANSPORT=host".into()));
    }
    let forced = setting == GpuTransport::Nccl;
    if let Some(without) = members.iter().find(|m| m.gpu.is_empty()) {
        let why = format!(
            "rank {} has no GPU rvod can use (it joined before it submitted a GPU tensor, or its GPU failed)",
            without.rank
        );
        if forced {
            return Err(format!("RVOD_GPU_TRANSPORT=nccl, but {why}"));
        }
        return Ok((Route::HostStaging, format!("{why}; staging through host memory")));
    }
    let shared = shared_gpu(members);
    match (shared, nccl) {
        (Some(shared), _) if forced => Err(format!(
            "RVOD_GPU_TRANSPORT=nccl, but {shared}, and NCCL refuses a GPU shared by two ranks (\"Duplicate GPU \
             detected\"); give each rank its own GPU (e.g. torch.cuda.set_device(hvd.local_rank())) or use \
             RVOD_GPU_TRANSPORT=host or auto"
        )),
        (Some(shared), _) => Ok((
            Route::HostStaging,
            format!("{shared}; NCCL refuses a GPU shared by two ranks, so collectives stage through host memory"),
        )),
        (None, Err(why)) if forced => Err(format!("RVOD_GPU_TRANSPORT=nccl, but NCCL is not available: {why}")),
        (None, Err(why)) => {
            Ok((Route::HostStaging, format!("NCCL is not available ({why}); staging through host memory")))
        }
        (None, Ok(version)) => {
            let why =
                if forced { "RVOD_GPU_TRANSPORT=nccl" } else { "every rank of the process set has a GPU of its own" };
            Ok((Route::Nccl, format!("{why}; NCCL {version}")))
        }
    }
}

/// "ranks 0 and 2 share GPU 0000:3b:00.0 on host a" for the first GPU two members share.
fn shared_gpu(members: &[Member]) -> Option<String> {
    for (i, m) in members.iter().enumerate() {
        let sharing: Vec<String> =
            members[i..].iter().filter(|o| o.host == m.host && o.gpu == m.gpu).map(|o| o.rank.to_string()).collect();
        if let (true, Some((last, first))) = (sharing.len() > 1, sharing.split_last()) {
            return Some(format!("ranks {} and {last} share GPU {} on host {}", first.join(", "), m.gpu, m.host));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(placement: &[(&str, &str)]) -> Vec<Member> {
        placement
            .iter()
            .enumerate()
            .map(|(rank, (host, gpu))| Member { rank, host: host.to_string(), gpu: gpu.to_string() })
            .collect()
    }

    #[test]
    fn nccl_when_every_rank_has_its_own_gpu() {
        let own = members(&[("a", "0000:3b:00.0"), ("a", "0000:5e:00.0"), ("b", "0000:3b:00.0")]);
        let (route, why) = choose(GpuTransport::Auto, &own, Ok("2.30.7")).unwrap();
        assert_eq!(route, Route::Nccl, "the same bus id on another host is another GPU");
        assert_eq!(why, "every rank of the process set has a GPU of its own; NCCL 2.30.7");
        let (route, why) = choose(GpuTransport::Nccl, &own, Ok("2.30.7")).unwrap();
        assert_eq!((route, why.as_str()), (Route::Nccl, "RVOD_GPU_TRANSPORT=nccl; NCCL 2.30.7"));
        assert_eq!(choose(GpuTransport::Auto, &own[..1], Ok("2.30.7")).unwrap().0, Route::Nccl, "one rank");
    }

    #[test]
    fn host_staging_when_ranks_share_a_gpu_or_when_asked_or_without_nccl() {
        let shared =
            members(&[("a", "0000:3b:00.0"), ("a", "0000:5e:00.0"), ("a", "0000:3b:00.0"), ("a", "0000:3b:00.0")]);
        let (route, why) = choose(GpuTransport::Auto, &shared, Ok("2.30.7")).unwrap();
        assert_eq!(route, Route::HostStaging);
        assert_eq!(
            why,
            "ranks 0, 2 and 3 share GPU 0000:3b:00.0 on host a; NCCL refuses a GPU shared by two ranks, so \
             collectives stage through host memory"
        );
        let own = members(&[("a", "0"), ("a", "1")]);
        assert_eq!(
            choose(GpuTransport::Host, &own, Ok("2.30.7")).unwrap(),
            (Route::HostStaging, "RVOD_GPU_TRANSPORT=host".to_string())
        );
        let (route, why) = choose(GpuTransport::Auto, &own, Err("libnccl.so.2 not found")).unwrap();
        assert_eq!(route, Route::HostStaging);
        assert!(why.starts_with("NCCL is not available (libnccl.so.2 not found)"), "{why}");
    }

    #[test]
    fn forcing_nccl_where_it_cannot_go_is_an_error_that_says_why() {
        let shared = members(&[("a", "0000:3b:00.0"), ("a", "0000:3b:00.0")]);
        let error = choose(GpuTransport::Nccl, &shared, Ok("2.30.7")).unwrap_err();
        assert!(
            error.starts_with("RVOD_GPU_TRANSPORT=nccl, but ranks 0 and 1 share GPU 0000:3b:00.0 on host a"),
            "{error}"
        );
        assert!(error.contains("Duplicate GPU detected"), "{error}");
        let error = choose(GpuTransport::Nccl, &members(&[("a", "0")]), Err("no CUDA driver")).unwrap_err();
        assert_eq!(error, "RVOD_GPU_TRANSPORT=nccl, but NCCL is not available: no CUDA driver");
    }

    #[test]
    fn a_member_without_a_gpu_stages_or_is_refused_when_nccl_is_forced() {
        let one_without = members(&[("a", "0"), ("a", "")]);
        let (route, why) = choose(GpuTransport::Auto, &one_without, Ok("2.30.7")).unwrap();
        assert_eq!(route, Route::HostStaging);
        assert_eq!(
            why,
            "rank 1 has no GPU rvod can use (it joined before it submitted a GPU tensor, or its GPU failed); staging \
             through host memory"
        );
        let error = choose(GpuTransport::Nccl, &one_without, Ok("2.30.7")).unwrap_err();
        assert!(error.starts_with("RVOD_GPU_TRANSPORT=nccl, but rank 1 has no GPU"), "{error}");
    }
}
