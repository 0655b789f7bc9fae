//! Jobs started by a cluster's own launcher (Open MPI's mpirun, MPICH / Intel MPI's hydra, Slurm's srun,
//! PyTorch's torchrun) instead of rvodrun.
//!
//! - [`env`]: what each launcher's environment says about this rank ([`config_from_env`] hands it to
//!   `Config::from_lookup`; the types it fills are in `crate::launched`).
//! - [`slurm`]: Slurm's compressed host lists (`node[01-03,07]`) and task counts (`2(x3),1`).
//! - [`meet`]: rank 0 serves the rendezvous store; every rank finds it, authenticates, and learns what the
//!   launcher did not say about the topology.
//!
//! Invariant: a variable set by rvodrun (`RVOD_*`) always wins over what a launcher says; a job is only
//! ever run unauthenticated across hosts when `RVOD_INSECURE_RENDEZVOUS` asks for it.

pub mod env;
pub mod meet;
pub mod slurm;

use crate::config::{Config, ConfigError};
use crate::error::EngineError;
use crate::launched::{LaunchPlan, Launcher};

/// The engine's configuration from the process environment, with what the launcher's variables say.
pub fn config_from_env() -> Result<Config, ConfigError> {
    config_from_lookup(|name| std::env::var(name).ok())
}

/// The configuration through `lookup` (variable name -> value): the launcher is detected from the same
/// variables and its findings handed to [`Config::from_lookup`].
pub fn config_from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let launched = env::detect(&lookup)?;
    Config::from_lookup(lookup, launched)
}

/// `hvd.init(comm=...)` with an mpi4py communicator: the job is the communicator's ranks (this is `rank` of
/// `size`), whatever the launcher's variables say about the world; which host each rank runs on is learnt
/// when the ranks meet. The communicator of the whole world leaves `config` as it is.
pub fn for_communicator(mut config: Config, rank: usize, size: usize) -> Result<Config, EngineError> {
    if rank >= size {
        return Err(EngineError::InvalidArgument(format!(
            "init(comm=...): rank {rank} of a communicator of size {size}"
        )));
    }
    if config.launch.is_none() && config.rendezvous.is_some() {
        return Err(EngineError::InvalidArgument(
            "init(comm=...) needs a job started by an MPI launcher (mpirun); this job was started by rvodrun, \
             which connects every rank itself: call init() without comm"
                .into(),
        ));
    }
    let topology = &config.topology;
    if (topology.rank, topology.size) == (rank, size) && (size == 1 || config.launch.is_some()) {
        return Ok(config);
    }
    config.topology.rank = rank;
    config.topology.size = size;
    (config.topology.local_rank, config.topology.local_size) = (0, 1);
    (config.topology.cross_rank, config.topology.cross_size) = (0, 1);
    if size == 1 {
        config.launch = None;
        return Ok(config);
    }
    config.launch = Some(match config.launch.take() {
        Some(plan) => LaunchPlan {
            run_key: format!("{}-comm{size}", plan.run_key),
            local_known: false,
            cross_known: false,
            ..plan
        },
        None => LaunchPlan {
            launcher: Launcher::Mpi4py,
            run_key: format!("mpi4py-ppid{}", std::os::unix::process::parent_id()),
            one_host: None,
            store_host: None,
            store_port: None,
            secret: None,
            insecure: false,
            iface_addr: None,
            data_bind: crate::launched::BindAddress::Auto,
            local_known: false,
            cross_known: false,
        },
    });
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::meet::{meet, serve};
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, String)]) -> Result<Config, crate::config::ConfigError> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        config_from_lookup(move |name| map.get(name).cloned())
    }

    fn ompi(rank: usize, size: usize) -> Vec<(&'static str, String)> {
        vec![
            ("OMPI_COMM_WORLD_RANK", rank.to_string()),
            ("OMPI_COMM_WORLD_SIZE", size.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", rank.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", size.to_string()),
            ("PMIX_NAMESPACE", format!("test{}", std::process::id())),
        ]
    }

    #[test]
    fn a_launcher_job_gets_a_plan_and_no_rendezvous_yet() {
        let c = config(&ompi(1, 2)).unwrap();
        assert_eq!((c.topology.rank, c.topology.size, c.topology.local_rank, c.topology.local_size), (1, 2, 1, 2));
        assert!(c.rendezvous.is_none());
        let plan = c.launch.unwrap();
        assert_eq!((plan.launcher, plan.one_host, plan.secret.is_none()), (Launcher::OpenMpi, Some(true), true));
        assert!(plan.local_known && plan.cross_known);
        assert!(config(&ompi(0, 1)).unwrap().launch.is_none(), "one rank needs nobody");
    }

    #[test]
    fn rvod_variables_win_over_the_launchers() {
        let mut vars = ompi(1, 2);
        vars.extend([
            ("RVOD_SIZE", "2".to_string()),
            ("RVOD_RENDEZVOUS_ADDR", "127.0.0.1".into()),
            ("RVOD_RENDEZVOUS_PORT", "4000".into()),
            ("RVOD_SECRET", "00ff".into()),
        ]);
        let c = config(&vars).unwrap();
        assert!(c.launch.is_none(), "RVOD_SIZE: rvodrun serves the store");
        assert_eq!((c.topology.rank, c.rendezvous.unwrap().port), (1, 4000), "the rank the launcher gave");
        let mut vars = ompi(1, 2);
        vars.extend([("RVOD_LOCAL_RANK", "0".to_string()), ("RVOD_RENDEZVOUS_ADDR", "10.1.2.3".into())]);
        let c = config(&vars).unwrap();
        assert_eq!(c.topology.local_rank, 0);
        assert_eq!(c.launch.unwrap().store_host, Some(("10.1.2.3".into(), "RVOD_RENDEZVOUS_ADDR".into())));
    }

    #[test]
    fn launcher_secrets_are_long_enough() {
        let mut vars = ompi(0, 2);
        vars.push(("RVOD_SECRET", "00ff".into()));
        let err = config(&vars).unwrap_err();
        assert_eq!(err.name, "RVOD_SECRET");
        assert!(err.reason.contains("at least 16"), "{err}");
        let mut vars = ompi(0, 2);
        vars.push(("RVOD_SECRET_FILE", "/nonexistent/rvod-secret".into()));
        let err = config(&vars).unwrap_err();
        assert_eq!(err.name, "RVOD_SECRET_FILE");
        assert!(err.reason.contains("does not exist"), "{err}");
    }

    #[test]
    fn a_communicator_replaces_the_worlds_rank_and_size() {
        let world = config(&ompi(2, 4)).unwrap();
        assert_eq!(for_communicator(world.clone(), 2, 4).unwrap(), world, "COMM_WORLD changes nothing");
        let sub = for_communicator(world.clone(), 1, 2).unwrap();
        assert_eq!((sub.topology.rank, sub.topology.size), (1, 2));
        let plan = sub.launch.unwrap();
        assert!(!plan.local_known && !plan.cross_known, "learnt from the hosts when the ranks meet");
        assert!(for_communicator(world, 0, 1).unwrap().launch.is_none());
        let rvodrun = config(&[
            ("RVOD_SIZE", "2".into()),
            ("RVOD_RENDEZVOUS_ADDR", "127.0.0.1".into()),
            ("RVOD_RENDEZVOUS_PORT", "4000".into()),
            ("RVOD_SECRET", "00ff".into()),
        ])
        .unwrap();
        assert!(
            matches!(for_communicator(rvodrun, 0, 2), Err(EngineError::InvalidArgument(m)) if m.contains("rvodrun"))
        );
    }

    /// Every rank's config after `serve` and `meet`, the ranks being threads of this process.
    fn meet_all(configs: Vec<Config>) -> Vec<Result<Config, EngineError>> {
        let (hosted, _) = serve(&configs[0], false).unwrap();
        let hosted = std::sync::Arc::new(hosted);
        let threads: Vec<_> = configs
            .into_iter()
            .map(|c| {
                let hosted = hosted.clone();
                std::thread::spawn(move || {
                    let own = if c.topology.rank == 0 { hosted.as_ref().as_ref() } else { None };
                    meet(c, 0, own, None)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn one_host_ranks_meet_through_the_private_file() {
        let configs: Vec<Config> = (0..3).map(|r| config(&ompi(r, 3)).unwrap()).collect();
        let met: Vec<Config> = meet_all(configs).into_iter().map(Result::unwrap).collect();
        let rendezvous: Vec<_> = met.iter().map(|c| c.rendezvous.clone().unwrap()).collect();
        assert!(rendezvous.iter().all(|r| r == &rendezvous[0]), "{rendezvous:?}");
        assert_eq!(rendezvous[0].addr, "127.0.0.1");
        assert_eq!(rendezvous[0].bind, crate::launched::BindAddress::Explicit(std::net::Ipv4Addr::LOCALHOST.into()));
        assert_eq!(rendezvous[0].secret.len(), 32, "a fresh secret");
    }

    #[test]
    fn ranks_meet_at_an_address_and_learn_local_ranks_from_their_hosts() {
        // PMI without local ranks, "several hosts" (unknown): RVOD_RENDEZVOUS_ADDR and a secret are needed.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let vars = |rank: usize| {
            vec![
                ("PMI_RANK", rank.to_string()),
                ("PMI_SIZE", "2".to_string()),
                ("RVOD_RENDEZVOUS_ADDR", "127.0.0.1".into()),
                ("RVOD_RENDEZVOUS_PORT", port.to_string()),
                ("RVOD_SECRET", "11".repeat(16)),
                ("RVOD_START_TIMEOUT", "10".into()),
            ]
        };
        let met: Vec<Config> =
            meet_all((0..2).map(|r| config(&vars(r)).unwrap()).collect()).into_iter().map(Result::unwrap).collect();
        for (rank, c) in met.iter().enumerate() {
            let t = &c.topology;
            assert_eq!((t.local_rank, t.local_size, t.cross_rank, t.cross_size), (rank, 2, 0, 1));
            assert_eq!(c.rendezvous.as_ref().unwrap().port, port);
        }
        let mut refused = vars(1);
        refused.retain(|(k, _)| *k != "RVOD_SECRET");
        let err = serve(&config(&refused).unwrap(), false).err().unwrap().to_string();
        assert!(err.contains("no secret is set") && err.contains("install mpi4py"), "{err}");
    }
}
