//! rvod: Horovod's API with a Rust engine.
//!
//! One engine runs per process, started by `init()`. Framework shims hand tensors to it as DLPack
//! capsules through [`py`]; the engine's background thread negotiates with the other ranks which
//! collectives are ready everywhere ([`coordinator`], over the messages of [`protocol`]), packs compatible ones together ([`fusion`]), runs
//! the collective algorithms ([`ring`]) over a [`transport`] (shared memory inside a host, TCP or UCX between hosts, an
//! in-memory one for tests), and completes the caller's handle with the result or a precise error ([`error`]).
//! Every knob is read once into a [`config::Config`], given what [`launch`] detected about the launcher (the
//! plain data of how a rank joins its job is in [`launched`]; 0600 files of this user in [`private_file`]).
//! Jobs that mpirun, srun or torchrun started (not rvodrun) meet through [`launch`]: rank 0 serves the
//! rendezvous store. With `RVOD_AUTOTUNE`, rank 0
//! tunes the fusion threshold, cycle time and categorical knobs while the job runs ([`autotune`]). GPU
//! libraries are loaded at run time and GPU tensors are refused for now; the GPU path's parts are in [`gpu`].
//! Beneath them: [`types`] (dtypes, reduce ops, collective kinds), [`tensor`] and [`memory`] (tensor views and
//! engine-owned buffers), [`exit_signals`] (last work before SIGTERM/SIGHUP end the process); beside the
//! engine, [`timeline`] records what each op did and when (`RVOD_TIMELINE`).
//!
//! The layers, bottom to top (a module uses only its own layer or lower ones; `tests/python/test_rust_layers.py`
//! checks it): base (`types`, `tensor`, `memory`, `error`, `launched`, `private_file`, `config`, `exit_signals`), wire (`protocol`, `transport`), work
//! (`ring`, `fusion`, `gpu`, `timeline`), decide (`coordinator`, `autotune`), run (`engine`, `launch`), bind (`py`).

// No unwrap/expect where user input or a peer's bytes could reach them (DESIGN.md); tests may use them.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod autotune;
pub mod config;
pub mod coordinator;
pub mod engine;
pub mod error;
pub mod exit_signals;
pub mod fusion;
pub mod gpu;
pub mod launch;
pub mod launched;
pub mod memory;
pub mod private_file;
pub mod protocol;
pub mod ring;
pub mod tensor;
pub mod timeline;
pub mod transport;
pub mod types;

#[cfg(feature = "python")]
pub mod py;
