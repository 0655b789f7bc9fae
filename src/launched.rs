//! How this rank joins its job, as plain data: which launcher started it and what the launcher's variables
//! say ([`LaunchEnv`], found by `launch::env::detect`), the plan for meeting the other ranks that
//! `config.rs` makes from it ([`LaunchPlan`]), where data listeners bind ([`BindAddress`], resolved by
//! `transport::net`), and this machine's host name.
//!
//! It sits in the base layer so that the configuration holds these values without calling the launcher
//! detection, and the transports read the bind setting without depending on the configuration.

/// Which launcher started the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    OpenMpi,
    /// MPICH's or Intel MPI's hydra (the PMI interface).
    Pmi,
    Torchrun,
    Slurm,
    /// `hvd.init(comm=...)` with an mpi4py communicator: rank and size come from it.
    Mpi4py,
}

impl Launcher {
    /// The launcher as users know it, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::OpenMpi => "Open MPI",
            Launcher::Pmi => "MPICH/Intel MPI (PMI)",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm",
            Launcher::Mpi4py => "mpi4py communicator",
        }
    }

    /// A short stable identifier (`rvod._rvod.launcher()` returns it; names private files).
    pub fn id(self) -> &'static str {
        match self {
            Launcher::OpenMpi => "openmpi",
            Launcher::Pmi => "pmi",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "slurm",
            Launcher::Mpi4py => "mpi4py",
        }
    }

    /// Whether ranks can exchange the rendezvous through MPI (mpi4py) when it is importable.
    pub fn is_mpi(self) -> bool {
        matches!(self, Launcher::OpenMpi | Launcher::Pmi | Launcher::Mpi4py)
    }
}

/// What the launcher's variables say; `None` where they say nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchEnv {
    pub launcher: Launcher,
    pub rank: usize,
    pub size: usize,
    /// (local rank, local size)
    pub local: Option<(usize, usize)>,
    /// (cross rank, cross size), as Horovod defines them: this host's index among the hosts that run a rank
    /// with this local rank, and the number of such hosts.
    pub cross: Option<(usize, usize)>,
    pub hostname: Option<String>,
    /// Whether every rank runs on this host (`None`: the launcher does not say).
    pub one_host: Option<bool>,
    /// Host of rank 0's store, and the variable it came from.
    pub store_host: Option<(String, String)>,
    /// Port of rank 0's store, and how it was chosen.
    pub store_port: Option<(u16, String)>,
    /// Names this job among others on the host (file names); the same on every rank of the job.
    pub run_key: String,
}

/// A job started by a launcher, with what the user set for meeting the other ranks (read by `config.rs`).
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchPlan {
    pub launcher: Launcher,
    pub run_key: String,
    pub one_host: Option<bool>,
    /// Host of rank 0's store and where it came from (`RVOD_RENDEZVOUS_ADDR` wins over the launcher's).
    pub store_host: Option<(String, String)>,
    pub store_port: Option<(u16, String)>,
    /// The job's secret as the user gave it, and the variable it came from.
    pub secret: Option<(Vec<u8>, String)>,
    /// `RVOD_INSECURE_RENDEZVOUS`: run across hosts without a secret.
    pub insecure: bool,
    /// `RVOD_IFACE_ADDR`: the address this rank listens on and advertises.
    pub iface_addr: Option<String>,
    /// How the data listeners pick their address (`RVOD_IFACE_ADDR`, `RVOD_NETWORK_INTERFACE`, or automatic:
    /// then the address the ranks' hosts show, see `meet`).
    pub data_bind: BindAddress,
    /// Whether local rank/size and cross rank/size are known; otherwise they are learnt from the ranks' hosts.
    pub local_known: bool,
    pub cross_known: bool,
}

/// Where this rank's data listeners bind (resolved to an address by `transport::net`).
#[derive(Clone, Debug, PartialEq)]
pub enum BindAddress {
    /// `RVOD_IFACE_ADDR`: this address.
    Explicit(std::net::IpAddr),
    /// `RVOD_NETWORK_INTERFACE` (`HOROVOD_GLOO_IFACE`): the first IPv4 address of the first of these NICs
    /// that exists.
    Interfaces(Vec<String>),
    /// Neither: loopback for a loopback rendezvous address, else the local address that routes to it.
    Auto,
}

/// This machine's host name as the kernel knows it (per UTS namespace); `localhost` if unknown.
pub fn system_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
