//! Which host each rank of the job runs on, learnt once at `init()` ([`super::connect::job_hosts`]), so
//! that an error about a peer names its host as well as its rank ("no progress from rank 2 on host b").

use std::sync::Arc;

use crate::error::{EngineError, TransportErrorInfo};
use crate::transport::TransportError;

/// The host name of every global rank. Messages name hosts only when the job spans more than one: on one
/// host the name adds nothing.
#[derive(Clone, Debug, Default)]
pub struct PeerHosts {
    names: Arc<Vec<String>>,
}

impl PeerHosts {
    /// `names[r]` is the host global rank `r` runs on.
    pub fn new(names: Vec<String>) -> PeerHosts {
        PeerHosts { names: Arc::new(names) }
    }

    pub fn spans_hosts(&self) -> bool {
        self.names.iter().any(|name| *name != self.names[0])
    }

    /// The host global rank `rank` runs on, where the job spans hosts.
    pub fn host_of(&self, rank: usize) -> Option<&str> {
        self.names.get(rank).filter(|_| self.spans_hosts()).map(String::as_str)
    }

    /// `e` (its peers numbered as global ranks) as the engine's record of the failure of `op`, each peer
    /// named with its host.
    pub fn failure(&self, op: impl Into<String>, e: &TransportError) -> EngineError {
        let mut info = TransportErrorInfo::from(e);
        let mut unmentioned = Vec::new();
        for peer in e.peers() {
            let Some(host) = self.host_of(peer) else { continue };
            match with_host(&info.message, peer, host) {
                Some(message) => info.message = message,
                None => unmentioned.push(format!("rank {peer} on host {host}")),
            }
        }
        if !unmentioned.is_empty() {
            info.message = format!("{} ({})", info.message, unmentioned.join(", "));
        }
        EngineError::Transport { op: op.into(), cause: info }
    }
}

/// `message` with " on host `host`" after its first mention of "rank `rank`" (not inside "rank 12" for rank
/// 1); `None` where it names the rank only otherwise ("ranks 1, 3").
fn with_host(message: &str, rank: usize, host: &str) -> Option<String> {
    let mention = format!("rank {rank}");
    let mut from = 0;
    while let Some(found) = message[from..].find(&mention) {
        let end = from + found + mention.len();
        if !message[end..].starts_with(|c: char| c.is_ascii_digit()) {
            return Some(format!("{} on host {host}{}", &message[..end], &message[end..]));
        }
        from = end;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts() -> PeerHosts {
        PeerHosts::new(["a", "a", "b", "b", "c", "c", "c", "c", "c", "c", "c", "c", "d"].map(String::from).to_vec())
    }

    fn message(e: EngineError) -> String {
        e.to_string()
    }

    #[test]
    fn a_dead_or_silent_peer_is_named_with_its_host() {
        let h = hosts();
        assert_eq!(
            message(h.failure("allreduce 'w'", &TransportError::PeerClosed { peer: 2 })),
            "allreduce 'w' failed: rank 2 on host b exited or closed its connection"
        );
        let timeout = h.failure("negotiation", &TransportError::Timeout { peer: 12, seconds: 4.0 });
        assert_eq!(message(timeout.clone()), "negotiation failed: no progress from rank 12 on host d for 4.0 s");
        assert!(matches!(timeout, EngineError::Transport { cause: TransportErrorInfo { timed_out: true, .. }, .. }));
        let detail = TransportError::Connect { peer: 1, detail: "UCX said: rank 12 unreachable".into() };
        assert_eq!(
            message(h.failure("connecting", &detail)),
            "connecting failed: connection set-up with rank 1 on host a failed: UCX said: rank 12 unreachable"
        );
    }

    #[test]
    fn rank_one_is_not_found_inside_rank_twelve_and_lists_get_the_hosts_at_their_end() {
        assert_eq!(with_host("rank 12 and rank 1 left", 1, "a").as_deref(), Some("rank 12 and rank 1 on host a left"));
        assert_eq!(
            message(hosts().failure("set-up", &TransportError::NotConnected { peers: vec![1, 4] })),
            "set-up failed: connection set-up failed: ranks 1, 4 did not connect in time (rank 1 on host a, rank 4 on \
             host c)"
        );
    }

    #[test]
    fn one_host_or_unknown_hosts_leave_the_message_as_it_was() {
        let one = PeerHosts::new(vec!["a".into(); 3]);
        assert_eq!(
            message(one.failure("op", &TransportError::PeerClosed { peer: 2 })),
            "op failed: rank 2 exited or closed its connection"
        );
        let unknown = PeerHosts::default();
        assert_eq!(
            message(unknown.failure("op", &TransportError::PeerClosed { peer: 2 })),
            "op failed: rank 2 exited or closed its connection"
        );
    }
}
