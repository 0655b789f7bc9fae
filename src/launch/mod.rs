//! Jobs started by a cluster's own launcher (Open MPI's mpirun, MPICH / Intel MPI's hydra, Slurm's srun,
//! PyTorch's torchrun) instead of rvodrun.
//!
//! - [`env`]: what each launcher's environment says about this rank (read by `Config::from_lookup`).
//! - [`slurm`]: Slurm's compressed host lists (`node[01-03,07]`) and task counts (`2(x3),1`).
//! - [`private_file`]: the 0600 file through which the ranks of a one-host job learn rank 0's store.
//! - [`meet`]: rank 0 serves the rendezvous store; every rank finds it, authenticates, and learns what the
//!   launcher did not say about the topology.
//!
//! Invariant: a variable set by rvodrun (`RVOD_*`) always wins over what a launcher says; a job is only
//! ever run unauthenticated across hosts when `RVOD_INSECURE_RENDEZVOUS` asks for it.

pub mod env;
pub mod meet;
pub mod private_file;
pub mod slurm;

pub use env::{LaunchEnv, LaunchPlan, Launcher};

use crate::config::Config;
use crate::error::EngineError;

/// `hvd.init(comm=...)` with an mpi4py communicator: the job is the communicator's ranks (this is `rank` of
/// `size`), whatever the launcher's variables say about the world; which host each rank runs on is learnt
/// when the ranks meet. The communicator of the whole world leaves `config` as it is.
pub fn for_communicator(mut config: Config, rank: usize, size: usize) -> Result<Config, EngineError> {
    if rank >= size {
        return Err(EngineError::InvalidArgument(format!("init(comm=...): rank {rank} of a communicator of size {size}")));
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
            local_known: false,
            cross_known: false,
        },
    });
    Ok(config)
}
