//! What a launcher's environment says about this rank: its rank and size, where it sits on its host, and
//! where rank 0's rendezvous store can be found.
//!
//! Checked in this order, the first found wins: Open MPI (`OMPI_COMM_WORLD_*`), MPICH / Intel MPI
//! (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`), torchrun (`RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, ...), Slurm (`SLURM_PROCID` inside an srun step). Slurm comes last because an MPI job or a
//! torchrun agent inside a Slurm allocation inherits the allocation's `SLURM_*` variables; when those
//! describe the same ranks (srun started the MPI ranks itself), they fill in what the MPI launcher did not say.

use super::slurm;
use crate::config::ConfigError;
use crate::launched::{LaunchEnv, Launcher};

/// Reads launcher variables; blank values count as unset.
struct Vars<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Vars<'_> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
    }

    fn first(&self, names: &[&'static str]) -> Option<(String, &'static str)> {
        names.iter().find_map(|name| self.get(name).map(|value| (value, *name)))
    }

    fn number(&self, name: &str) -> Result<Option<usize>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(value) => value.parse::<usize>().map(Some).map_err(|_| ConfigError {
                name: name.to_string(),
                value,
                reason: "expected a non-negative integer (set by the launcher)".into(),
            }),
        }
    }

    fn required(&self, name: &str, because: &str) -> Result<usize, ConfigError> {
        self.number(name)?.ok_or_else(|| ConfigError {
            name: name.to_string(),
            value: String::new(),
            reason: format!("{because} is set but {name} is not"),
        })
    }

    fn pair(&self, first: &str, second: &str) -> Result<Option<(usize, usize)>, ConfigError> {
        Ok(match (self.number(first)?, self.number(second)?) {
            (Some(a), Some(b)) => Some((a, b)),
            _ => None,
        })
    }
}

/// The launcher that started this process, if any.
pub fn detect(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>, ConfigError> {
    let vars = Vars(lookup);
    let slurm = slurm_env(&vars)?;
    let found = match open_mpi(&vars)? {
        Some(found) => Some(found),
        None => match pmi(&vars)? {
            Some(found) => Some(found),
            None => torchrun(&vars)?,
        },
    };
    let found = match (found, slurm) {
        (Some(found), Some(slurm)) => Some(fill_from_slurm(found, slurm)),
        (found, slurm) => found.or(slurm),
    };
    found.map(check).transpose()
}

/// Rank below size, local rank below local size; a job on one host is its own host's every rank.
fn check(mut env: LaunchEnv) -> Result<LaunchEnv, ConfigError> {
    let bad = |what: &str, value: String| ConfigError {
        name: format!("{} {what}", env.launcher.name()),
        value,
        reason: "the launcher's rank is not smaller than its size".into(),
    };
    if env.rank >= env.size.max(1) {
        return Err(bad("rank", format!("{} of {}", env.rank, env.size)));
    }
    if let Some((local_rank, local_size)) = env.local {
        if local_rank >= local_size {
            return Err(bad("local rank", format!("{local_rank} of {local_size}")));
        }
    }
    if env.one_host == Some(true) {
        env.local = env.local.or(Some((env.rank, env.size)));
        env.cross = Some((0, 1));
    }
    Ok(env)
}

fn parent_key() -> String {
    format!("ppid{}", std::os::unix::process::parent_id())
}

fn open_mpi(vars: &Vars) -> Result<Option<LaunchEnv>, ConfigError> {
    let Some(size) = vars.number("OMPI_COMM_WORLD_SIZE")? else { return Ok(None) };
    let rank = vars.required("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")?;
    let local = vars.pair("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")?;
    let one_host = match vars.number("OMPI_MCA_orte_num_nodes")? {
        Some(nodes) => Some(nodes == 1),
        None => local.map(|(_, local_size)| local_size == size),
    };
    let job = vars.first(&["PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"]).map(|(v, _)| v);
    Ok(Some(LaunchEnv {
        launcher: Launcher::OpenMpi,
        rank,
        size,
        local,
        cross: None,
        hostname: vars.get("PMIX_HOSTNAME"),
        one_host,
        store_host: None,
        store_port: None,
        run_key: format!("openmpi-{}", job.unwrap_or_else(parent_key)),
    }))
}

fn pmi(vars: &Vars) -> Result<Option<LaunchEnv>, ConfigError> {
    let Some(size) = vars.number("PMI_SIZE")? else { return Ok(None) };
    let rank = vars.required("PMI_RANK", "PMI_SIZE")?;
    let local = vars.pair("MPI_LOCALRANKID", "MPI_LOCALNRANKS")?;
    let job = vars.first(&["PMI_KVSNAME", "PMI_JOBID", "PMIX_NAMESPACE", "PMI_PORT"]).map(|(v, _)| v);
    Ok(Some(LaunchEnv {
        launcher: Launcher::Pmi,
        rank,
        size,
        local,
        cross: None,
        hostname: None,
        one_host: local.map(|(_, local_size)| local_size == size),
        store_host: None,
        store_port: None,
        run_key: format!("pmi-{}", job.unwrap_or_else(parent_key)),
    }))
}

fn torchrun(vars: &Vars) -> Result<Option<LaunchEnv>, ConfigError> {
    let (Some(_), Some(_), Some(master)) = (vars.get("RANK"), vars.get("WORLD_SIZE"), vars.get("MASTER_ADDR")) else {
        return Ok(None);
    };
    let rank = vars.required("RANK", "MASTER_ADDR")?;
    let size = vars.required("WORLD_SIZE", "MASTER_ADDR")?;
    let local = vars.pair("LOCAL_RANK", "LOCAL_WORLD_SIZE")?;
    let groups = vars.pair("GROUP_RANK", "GROUP_WORLD_SIZE")?;
    let one_host = match groups {
        Some((_, nodes)) => Some(nodes == 1),
        None => local.map(|(_, local_size)| local_size == size),
    };
    let store_port = match vars.number("MASTER_PORT")? {
        // MASTER_PORT itself is torchrun's own store (and torch.distributed's); rvod's is the next port.
        Some(port) => Some(u16::try_from(port + 1).map(|p| (p, "MASTER_PORT + 1".to_string())).map_err(|_| {
            ConfigError {
                name: "MASTER_PORT".into(),
                value: port.to_string(),
                reason: "rvod's store listens on MASTER_PORT + 1, which must be a port number; \
                             set RVOD_RENDEZVOUS_PORT"
                    .into(),
            }
        })?),
        None => None,
    };
    let run_id = vars.get("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into());
    let restart = vars.get("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
    let port = vars.get("MASTER_PORT").unwrap_or_default();
    Ok(Some(LaunchEnv {
        launcher: Launcher::Torchrun,
        rank,
        size,
        local,
        // torchrun starts the same number of ranks on every node, so the node index is the cross rank.
        cross: groups,
        hostname: None,
        one_host,
        store_host: Some((master, "MASTER_ADDR".into())),
        store_port,
        run_key: format!("torchrun-{run_id}-{port}-{restart}"),
    }))
}

/// Horovod's cross rank and size from the number of ranks on each node (ranks placed node by node).
fn cross_from_counts(counts: &[usize], node: usize, local_rank: usize) -> Option<(usize, usize)> {
    if node >= counts.len() {
        return None;
    }
    let with_local_rank = |c: &&usize| **c > local_rank;
    let cross_size = counts.iter().filter(with_local_rank).count();
    let cross_rank = counts[..node].iter().filter(with_local_rank).count();
    Some((cross_rank, cross_size))
}

fn slurm_env(vars: &Vars) -> Result<Option<LaunchEnv>, ConfigError> {
    // Only inside an srun step: a batch script's own SLURM_PROCID is not a job of SLURM_NTASKS ranks.
    let (Some(_), Some(step)) = (vars.get("SLURM_PROCID"), vars.get("SLURM_STEP_ID")) else { return Ok(None) };
    let rank = vars.required("SLURM_PROCID", "SLURM_STEP_ID")?;
    let Some((_, size_name)) = vars.first(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"]) else { return Ok(None) };
    let size = vars.required(size_name, "SLURM_PROCID")?;
    let counts = match vars.first(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]) {
        Some((value, name)) => Some(slurm::expand_tasks_per_node(&value).map_err(|reason| ConfigError {
            name: name.into(),
            value,
            reason,
        })?),
        None => None,
    };
    let node = vars.number("SLURM_NODEID")?;
    let local_rank = vars.number("SLURM_LOCALID")?;
    let local = match (local_rank, node, &counts) {
        (Some(local_rank), Some(node), Some(counts)) => counts.get(node).map(|&n| (local_rank, n)),
        _ => None,
    };
    let cross = match (local, node, &counts) {
        (Some((local_rank, _)), Some(node), Some(counts)) => cross_from_counts(counts, node, local_rank),
        _ => None,
    };
    let nodes = match vars.first(&["SLURM_STEP_NUM_NODES", "SLURM_NNODES"]) {
        Some((_, name)) => vars.number(name)?,
        None => counts.as_ref().map(Vec::len),
    };
    let store_host = match vars.first(&["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]) {
        Some((list, name)) => Some((
            slurm::first_host(&list).map_err(|reason| ConfigError {
                name: name.into(),
                value: list.clone(),
                reason,
            })?,
            format!("the first host of {name}"),
        )),
        None => None,
    };
    let job = vars.get("SLURM_JOB_ID").or_else(|| vars.get("SLURM_JOBID"));
    let store_port = job.as_deref().and_then(|job| job.parse::<u64>().ok()).map(|job| {
        // The same on every rank of the step and unlikely to collide with another step on the host.
        let step_number = step.parse::<u64>().unwrap_or(0);
        let port = 20000 + (job.wrapping_mul(16).wrapping_add(step_number) % 30000);
        (port as u16, "derived from SLURM_JOB_ID and SLURM_STEP_ID".to_string())
    });
    Ok(Some(LaunchEnv {
        launcher: Launcher::Slurm,
        rank,
        size,
        local,
        cross,
        hostname: vars.get("SLURMD_NODENAME"),
        one_host: nodes.map(|n| n == 1),
        store_host,
        store_port,
        run_key: format!("slurm-{}.{step}", job.unwrap_or_else(parent_key)),
    }))
}

/// An MPI job that srun started itself (same rank and size): Slurm fills in what MPI's variables lack.
fn fill_from_slurm(mut found: LaunchEnv, slurm: LaunchEnv) -> LaunchEnv {
    if found.launcher == Launcher::Torchrun || (found.rank, found.size) != (slurm.rank, slurm.size) {
        return found;
    }
    found.local = found.local.or(slurm.local);
    found.cross = found.cross.or(slurm.cross);
    found.hostname = found.hostname.or(slurm.hostname);
    found.one_host = found.one_host.or(slurm.one_host);
    found.store_host = found.store_host.or(slurm.store_host);
    found.store_port = found.store_port.or(slurm.store_port);
    if found.run_key.contains("-ppid") {
        found.run_key = slurm.run_key;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn detect_in(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>, ConfigError> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        detect(&move |name: &str| map.get(name).cloned())
    }

    #[test]
    fn nothing_set_is_no_launcher() {
        assert_eq!(detect_in(&[]).unwrap(), None);
        assert_eq!(detect_in(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap(), None, "torchrun needs MASTER_ADDR");
        assert_eq!(detect_in(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]).unwrap(), None, "a batch script");
    }

    #[test]
    fn open_mpi_on_one_host() {
        let env = detect_in(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
            ("OMPI_MCA_orte_num_nodes", "1"),
            ("PMIX_NAMESPACE", "1257701377"),
            ("PMIX_HOSTNAME", "vm"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(env.launcher, Launcher::OpenMpi);
        assert_eq!((env.rank, env.size, env.local, env.cross), (1, 3, Some((1, 3)), Some((0, 1))));
        assert_eq!(env.one_host, Some(true));
        assert_eq!(env.hostname.as_deref(), Some("vm"));
        assert_eq!(env.run_key, "openmpi-1257701377");
        assert_eq!(env.store_host, None);
    }

    #[test]
    fn open_mpi_on_two_hosts_leaves_cross_unknown() {
        let env = detect_in(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_MCA_ess_base_jobid", "77"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((env.local, env.cross, env.one_host), (Some((0, 2)), None, Some(false)));
        assert_eq!(env.run_key, "openmpi-77");
        let err = detect_in(&[("OMPI_COMM_WORLD_SIZE", "4")]).unwrap_err();
        assert_eq!(err.name, "OMPI_COMM_WORLD_RANK");
        let err = detect_in(&[("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "x")]).unwrap_err();
        assert_eq!((err.name.as_str(), err.value.as_str()), ("OMPI_COMM_WORLD_RANK", "x"));
        let err = detect_in(&[("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "2")]).unwrap_err();
        assert!(err.to_string().contains("Open MPI rank"), "{err}");
    }

    #[test]
    fn mpich_and_intel_mpi_by_pmi() {
        let env = detect_in(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
            ("PMI_KVSNAME", "kvs_42_0"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(env.launcher, Launcher::Pmi);
        assert_eq!((env.rank, env.size, env.local, env.cross, env.one_host), (3, 4, Some((1, 2)), None, Some(false)));
        assert_eq!(env.run_key, "pmi-kvs_42_0");
        let env = detect_in(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")]).unwrap().unwrap();
        assert_eq!((env.local, env.one_host), (None, None));
        assert_eq!(env.run_key, format!("pmi-ppid{}", std::os::unix::process::parent_id()));
    }

    #[test]
    fn torchrun_single_and_multi_node() {
        let one = detect_in(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "0"),
            ("GROUP_WORLD_SIZE", "1"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "41825"),
            ("TORCHELASTIC_RUN_ID", "7d00"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(one.launcher, Launcher::Torchrun);
        assert_eq!(
            (one.rank, one.size, one.local, one.cross, one.one_host),
            (1, 2, Some((1, 2)), Some((0, 1)), Some(true))
        );
        assert_eq!(one.store_host, Some(("localhost".into(), "MASTER_ADDR".into())));
        assert_eq!(one.store_port, Some((41826, "MASTER_PORT + 1".into())));
        assert_eq!(one.run_key, "torchrun-7d00-41825-0");
        let multi = detect_in(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("GROUP_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((multi.local, multi.cross, multi.one_host), (Some((1, 4)), Some((1, 2)), Some(false)));
        assert_eq!(multi.run_key, "torchrun-none-29500-0");
        let err = detect_in(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "65535")])
            .unwrap_err();
        assert!(err.reason.contains("RVOD_RENDEZVOUS_PORT"), "{err}");
    }

    fn srun(rank: usize, local: usize, node: usize) -> Vec<(&'static str, String)> {
        vec![
            ("SLURM_PROCID", rank.to_string()),
            ("SLURM_LOCALID", local.to_string()),
            ("SLURM_NODEID", node.to_string()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_STEP_NUM_TASKS", "5".into()),
            ("SLURM_NTASKS", "8".into()),
            ("SLURM_STEP_NUM_NODES", "2".into()),
            ("SLURM_STEP_TASKS_PER_NODE", "3,2".into()),
            ("SLURM_JOB_NODELIST", "cn[07-09]".into()),
            ("SLURM_STEP_NODELIST", "cn[08-09]".into()),
            ("SLURM_JOB_ID", "1234".into()),
            ("SLURMD_NODENAME", if node == 0 { "cn08".into() } else { "cn09".into() }),
        ]
    }

    fn detect_owned(vars: &[(&str, String)]) -> Result<Option<LaunchEnv>, ConfigError> {
        let borrowed: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        detect_in(&borrowed)
    }

    #[test]
    fn slurm_step_on_uneven_nodes() {
        // 5 tasks: ranks 0-2 on cn08, ranks 3-4 on cn09.
        let env = detect_owned(&srun(4, 1, 1)).unwrap().unwrap();
        assert_eq!(env.launcher, Launcher::Slurm);
        assert_eq!((env.rank, env.size, env.local, env.cross), (4, 5, Some((1, 2)), Some((1, 2))));
        assert_eq!(env.one_host, Some(false));
        assert_eq!(env.hostname.as_deref(), Some("cn09"));
        assert_eq!(env.store_host, Some(("cn08".into(), "the first host of SLURM_STEP_NODELIST".into())));
        assert_eq!(env.store_port.as_ref().map(|p| p.0), Some(20000 + 1234 * 16));
        assert_eq!(env.run_key, "slurm-1234.0");
        // Local rank 2 exists only on the first node.
        let env = detect_owned(&srun(2, 2, 0)).unwrap().unwrap();
        assert_eq!((env.local, env.cross), (Some((2, 3)), Some((0, 1))));
        let mut bad = srun(0, 0, 0);
        bad.retain(|(k, _)| *k != "SLURM_STEP_NODELIST");
        bad.push(("SLURM_STEP_NODELIST", "cn[08-".into()));
        let err = detect_owned(&bad).unwrap_err();
        assert_eq!(err.name, "SLURM_STEP_NODELIST");
    }

    #[test]
    fn mpi_under_srun_takes_what_it_lacks_from_slurm() {
        let mut vars = srun(3, 0, 1);
        vars.extend([("PMI_RANK", "3".to_string()), ("PMI_SIZE", "5".to_string())]);
        let env = detect_owned(&vars).unwrap().unwrap();
        assert_eq!(env.launcher, Launcher::Pmi);
        assert_eq!((env.local, env.cross, env.one_host), (Some((0, 2)), Some((1, 2)), Some(false)));
        assert_eq!(env.store_host.as_ref().map(|h| h.0.as_str()), Some("cn08"));
        assert_eq!(env.run_key, "slurm-1234.0");
    }

    #[test]
    fn torchrun_inside_an_allocation_ignores_slurm() {
        let mut vars = srun(1, 0, 1);
        vars.extend([
            ("RANK", "6".to_string()),
            ("WORLD_SIZE", "8".to_string()),
            ("MASTER_ADDR", "cn08".to_string()),
            ("LOCAL_RANK", "2".to_string()),
            ("LOCAL_WORLD_SIZE", "4".to_string()),
        ]);
        let env = detect_owned(&vars).unwrap().unwrap();
        assert_eq!(env.launcher, Launcher::Torchrun);
        assert_eq!((env.rank, env.size, env.local), (6, 8, Some((2, 4))));
        assert_eq!(env.hostname, None);
    }
}
