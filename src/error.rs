//! The engine's error type. Every variant says what failed in words a user can act on: which tensor,
//! which op, which ranks. `py/error.rs` maps each variant to one Python exception. A transport failure is
//! recorded here as text ([`TransportErrorInfo`]); its conversion from the transport's own error lives with
//! that error (`transport`), so this base module depends on no layer above it.

/// What kind of error a failed negotiation reports; decides the Python exception.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorKind {
    /// Ranks disagree about a tensor (RvodMismatchError).
    Mismatch = 0,
    /// The request itself is not allowed (ValueError-like, e.g. an op not supported with join).
    Invalid = 1,
}

impl ErrorKind {
    pub fn from_code(code: u8) -> Option<ErrorKind> {
        match code {
            0 => Some(ErrorKind::Mismatch),
            1 => Some(ErrorKind::Invalid),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum EngineError {
    /// An op was called before `init()` or after `shutdown()` on this rank.
    #[error("rvod has not been initialized; use hvd.init().")]
    NotInitialized,
    /// The communicator stopped while this op was pending: some rank called `shutdown()` or exited (the
    /// message starts "rvod has been shut down"), or its process set was removed (the message says so).
    #[error("{0}")]
    ShutDown(String),
    /// The same name is already in flight on this rank.
    #[error(
        "Requested to {op} a tensor with the same name as another tensor that is currently being processed: \
         '{name}'. Give every in-flight collective a unique name."
    )]
    DuplicateName { op: String, name: String },
    /// The caller's arguments are wrong (caught before anything was sent).
    #[error("{0}")]
    InvalidArgument(String),
    /// Ranks disagreed about a tensor; the message names the ranks and the values.
    #[error("{0}")]
    Mismatch(String),
    /// Negotiation rejected the request for every rank (e.g. an op that cannot run while ranks are joined).
    #[error("{0}")]
    Rejected(String),
    /// A collective failed because a peer died, a link broke or a peer went silent.
    #[error("{op} failed: {cause}")]
    Transport { op: String, cause: TransportErrorInfo },
    /// The engine could not start: the machine failed it (a thread or event that cannot be created, a host
    /// name that does not resolve, the rendezvous unreachable).
    #[error("rvod initialization failed: {0}")]
    Init(String),
    /// The configuration (environment variables) is invalid.
    #[error("rvod initialization failed: {0}")]
    Config(String),
    /// `init()` did not meet every other rank within the start timeout; the message names those that never came.
    #[error("rvod initialization failed: {0}")]
    StartTimeout(String),
    /// rvod was called in a process forked from an initialized one; the parent's job is not reachable here.
    #[error(
        "rvod cannot be used in this process: it was forked (pid {child}) from rank {rank} (pid {parent}) after \
         init(), and the job's connections belong to the parent. Use rvod in the parent only (DataLoader workers \
         and other forked helpers must not call collectives), or start helpers with the 'spawn' or 'forkserver' method."
    )]
    Forked { rank: usize, parent: u32, child: u32 },
    /// An engine bug or an impossible state reached through bad peer data.
    #[error("internal error: {0}")]
    Internal(String),
    /// A CUDA or NCCL call failed; the message names the rank, the device, the call and the library's text.
    #[error("{0}")]
    Gpu(String),
}

/// A cloneable record of a transport failure (handles of several tensors report the same failure).
#[derive(Debug, Clone, PartialEq)]
pub struct TransportErrorInfo {
    pub message: String,
    pub timed_out: bool,
}

impl std::fmt::Display for TransportErrorInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl EngineError {
    /// The error every rank reports for a negotiated failure.
    pub fn negotiated(kind: ErrorKind, message: String) -> EngineError {
        match kind {
            ErrorKind::Mismatch => EngineError::Mismatch(message),
            ErrorKind::Invalid => EngineError::Rejected(message),
        }
    }
}
