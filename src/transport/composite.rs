//! [`CompositeTransport`]: a communicator whose members span hosts, as a composition of two transports: a
//! local part among the members on this host (shared memory) and a remote part to the members on other
//! hosts (TCP or UCX). Flat algorithms see one transport and each message takes the path to its peer; the
//! hierarchical algorithms (`ring::hierarchical`) ask for the parts ([`Transport::hosts`]) and run flat
//! algorithms over them: the local part, and the cross part (the members with this rank's local index,
//! one per host; see [`HostLayout`]).
//!
//! Progress: an exchange whose send and receive go over different parts (a ring step from a peer on this
//! host to one on another) sends on a helper thread while this thread receives, so both directions
//! progress however large the message, each part waiting in its own way (futex, `poll`). Waiting for a
//! round ([`Transport::wait_for_activity`]) sleeps on the local part while a helper thread waits on the
//! remote part; the engine's waker and the helper both wake the local part through a waker of the
//! composite's own, so a round started remotely is not mistaken for local work. Errors name communicator
//! ranks.
//!
//! Plain sends are routed as they are: the negotiation's header exchange (every rank sends every other a
//! header, then receives) could only block in a cycle through both parts if a header outgrew the TCP
//! socket buffers (at least 128 KiB on Linux), and headers are at most ~64 KiB.

use std::sync::Arc;
use std::time::Duration;

use crate::transport::{Activity, Capabilities, Doorbell, Staging, Transport, TransportError, Waker};

/// Which host each member of a communicator runs on, as every member agreed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLayout {
    /// Host index of each communicator rank; hosts are numbered in order of their lowest rank.
    host_of: Vec<usize>,
    /// Members of each host, ascending.
    members: Vec<Vec<usize>>,
}

impl HostLayout {
    /// The layout from one host key per communicator rank (equal keys: same host).
    pub fn from_keys<K: PartialEq>(keys: &[K]) -> HostLayout {
        let mut firsts: Vec<usize> = Vec::new();
        let mut host_of = Vec::with_capacity(keys.len());
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (rank, key) in keys.iter().enumerate() {
            let host = match firsts.iter().position(|&first| keys[first] == *key) {
                Some(host) => host,
                None => {
                    firsts.push(rank);
                    members.push(Vec::new());
                    firsts.len() - 1
                }
            };
            host_of.push(host);
            members[host].push(rank);
        }
        HostLayout { host_of, members }
    }

    pub fn size(&self) -> usize {
        self.host_of.len()
    }

    pub fn hosts(&self) -> usize {
        self.members.len()
    }

    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// Members of `host`, ascending.
    pub fn members(&self, host: usize) -> &[usize] {
        &self.members[host]
    }

    /// Position of `rank` among its host's members.
    pub fn local_index(&self, rank: usize) -> usize {
        self.members[self.host_of[rank]].iter().position(|&r| r == rank).unwrap_or(0)
    }

    /// Whether every host has the same number of members.
    pub fn is_homogeneous(&self) -> bool {
        self.members.iter().all(|m| m.len() == self.members[0].len())
    }

    /// The members with local index `index`, one per host that has one, in host order.
    pub fn cross_members(&self, index: usize) -> Vec<usize> {
        self.members.iter().filter_map(|m| m.get(index).copied()).collect()
    }
}

/// The parts of a communicator that spans hosts, for hierarchical algorithms.
pub struct HostParts<'a> {
    pub layout: &'a HostLayout,
    /// This host's members, numbered by local index.
    pub local: PartView<'a>,
    /// The members with this rank's local index, one per host, numbered by host.
    pub cross: PartView<'a>,
}

/// A transport among a subset of another transport's ranks (renumbered 0..), naming communicator ranks
/// in its errors.
pub struct PartView<'a> {
    inner: &'a mut dyn Transport,
    /// `inner`'s rank of each member of the view.
    members: Vec<usize>,
    rank: usize,
    /// Communicator rank of each of `inner`'s ranks.
    names: Vec<usize>,
}

impl<'a> PartView<'a> {
    fn new(inner: &'a mut dyn Transport, members: Vec<usize>, names: Vec<usize>) -> PartView<'a> {
        let me = inner.rank();
        let rank = members.iter().position(|&m| m == me).unwrap_or(0);
        PartView { inner, members, rank, names }
    }

    fn inner_rank(&self, peer: usize) -> Result<usize, TransportError> {
        self.members.get(peer).copied().ok_or_else(|| TransportError::Io {
            peer,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("rank {peer} is not in this part of {} ranks", self.members.len()),
            ),
        })
    }

    fn named(&self, err: TransportError) -> TransportError {
        err.renumbered(&self.names)
    }
}

impl Transport for PartView<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn label(&self) -> &'static str {
        self.inner.label()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), TransportError> {
        let to = self.inner_rank(peer)?;
        self.inner.send(to, data).map_err(|e| self.named(e))
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), TransportError> {
        let from = self.inner_rank(peer)?;
        self.inner.recv(from, buf).map_err(|e| self.named(e))
    }

    fn exchange(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError> {
        let (to, from) = (self.inner_rank(to)?, self.inner_rank(from)?);
        self.inner.exchange(to, send, from, recv_len, sink).map_err(|e| self.named(e))
    }

    fn sendrecv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<(), TransportError> {
        let (to, from) = (self.inner_rank(to)?, self.inner_rank(from)?);
        self.inner.sendrecv(to, send, from, recv).map_err(|e| self.named(e))
    }

    fn wait_for_activity(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError> {
        self.inner.wait_for_activity(waker, timeout).map_err(|e| self.named(e))
    }

    fn close(&mut self) {
        self.inner.close();
    }

    fn staging(&mut self) -> Option<&mut dyn Staging> {
        // Staging areas belong to every rank of the inner transport: usable only when the view is all of it.
        if self.members.len() == self.inner.size() && self.members.iter().enumerate().all(|(i, &m)| i == m) {
            self.inner.staging()
        } else {
            None
        }
    }
}

/// Which part carries the bytes to a peer, and the peer's rank there.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    Local(usize),
    Remote(usize),
}

pub struct CompositeTransport {
    rank: usize,
    layout: HostLayout,
    /// This host's members (communicator ranks, ascending); `local` numbers them 0..
    local_members: Vec<usize>,
    /// The communicator rank of each number the local part may name: its members, then, offset by their
    /// count, every communicator rank (a member on another host that a local peer blamed, see
    /// `note_failure`).
    local_names: Vec<usize>,
    local: Box<dyn Transport>,
    /// Numbered by communicator rank; connected (at least) to every member on another host.
    remote: Box<dyn Transport>,
    /// Tells the helper thread of `wait_for_activity` to stop waiting on the remote part.
    stop_watching: Waker,
    /// What the local part waits on in `wait_for_activity`: rung by the engine's waker (through
    /// `doorbell`) and by the helper thread when a remote peer starts a round.
    wake_local: Arc<Waker>,
}

impl CompositeTransport {
    /// `local` spans `layout.members(host of rank)` numbered by local index; `remote` spans every member
    /// numbered by communicator rank.
    pub fn new(
        rank: usize,
        layout: HostLayout,
        local: Box<dyn Transport>,
        remote: Box<dyn Transport>,
    ) -> Result<CompositeTransport, TransportError> {
        let local_members = layout.members(layout.host_of(rank)).to_vec();
        if local.size() != local_members.len() || remote.size() != layout.size() || remote.rank() != rank {
            return Err(TransportError::Setup(format!(
                "rank {rank}: the local part has {} ranks for {} members on this host, the remote part {} for {}",
                local.size(),
                local_members.len(),
                remote.size(),
                layout.size()
            )));
        }
        let eventfd = |e: std::io::Error| TransportError::Setup(format!("eventfd: {e}"));
        let stop_watching = Waker::new().map_err(eventfd)?;
        let wake_local = Arc::new(Waker::new().map_err(eventfd)?);
        wake_local.set_doorbell(local.doorbell());
        let local_names = local_members.iter().copied().chain(0..layout.size()).collect();
        Ok(CompositeTransport { rank, layout, local_members, local_names, local, remote, stop_watching, wake_local })
    }

    fn route(&self, peer: usize) -> Result<Route, TransportError> {
        if peer >= self.layout.size() {
            return Err(TransportError::Io {
                peer,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("rank {peer} is not a rank of this {}-rank communicator", self.layout.size()),
                ),
            });
        }
        Ok(if self.layout.host_of(peer) == self.layout.host_of(self.rank) {
            Route::Local(self.layout.local_index(peer))
        } else {
            Route::Remote(peer)
        })
    }

    fn local_error(&self, err: TransportError) -> TransportError {
        err.renumbered(&self.local_names)
    }
}

impl Transport for CompositeTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.layout.size()
    }

    fn label(&self) -> &'static str {
        match (self.local.label(), self.remote.label()) {
            ("shm", "tcp") => "shm+tcp",
            ("shm", "ucx") => "shm+ucx",
            // Alone on this host: every peer is reached through the remote part.
            (_, "tcp") if self.local.size() == 1 => "shm+tcp",
            (_, "ucx") if self.local.size() == 1 => "shm+ucx",
            _ => "composite",
        }
    }

    /// What holds whichever part carries the bytes to a peer.
    fn capabilities(&self) -> Capabilities {
        Capabilities::common(self.local.capabilities(), self.remote.capabilities())
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), TransportError> {
        let outcome = match self.route(peer)? {
            Route::Local(p) => self.local.send(p, data).map_err(|e| self.local_error(e)),
            Route::Remote(p) => self.remote.send(p, data),
        };
        self.noted(outcome)
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<(), TransportError> {
        let outcome = match self.route(peer)? {
            Route::Local(p) => self.local.recv(p, buf).map_err(|e| self.local_error(e)),
            Route::Remote(p) => self.remote.recv(p, buf),
        };
        self.noted(outcome)
    }

    fn exchange(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError> {
        let outcome = self.exchange_routed(to, send, from, recv_len, sink);
        self.noted(outcome)
    }

    fn sendrecv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<(), TransportError> {
        let outcome = match (self.route(to)?, self.route(from)?) {
            (Route::Remote(t), Route::Remote(f)) => self.remote.sendrecv(t, send, f, recv),
            _ => {
                let len = recv.len();
                self.exchange_routed(to, send, from, len, &mut |offset, bytes| {
                    recv[offset..offset + bytes.len()].copy_from_slice(bytes)
                })
            }
        };
        self.noted(outcome)
    }

    fn wait_for_activity(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError> {
        let outcome = self.wait_for_activity_on_both(waker, timeout);
        self.noted(outcome)
    }

    /// Both parts pass the cause on: the remote part to the other hosts, the local part to this host's
    /// members, in its own numbers (a member on another host as the local part's size plus its rank).
    fn note_failure(&mut self, cause: &TransportError) {
        self.remote.note_failure(cause);
        let local_size = self.local_members.len();
        let layout = &self.layout;
        let here = layout.host_of(self.rank);
        let in_local_numbers: Vec<usize> = (0..layout.size())
            .map(|r| if layout.host_of(r) == here { layout.local_index(r) } else { local_size + r })
            .collect();
        let cause = match cause {
            TransportError::PeerClosed { peer } | TransportError::Io { peer, .. } => {
                TransportError::PeerClosed { peer: *peer }
            }
            TransportError::Timeout { peer, seconds } => TransportError::Timeout { peer: *peer, seconds: *seconds },
            _ => return,
        };
        self.local.note_failure(&cause.renumbered(&in_local_numbers));
    }

    fn doorbell(&self) -> Option<Doorbell> {
        let wake_local = Arc::clone(&self.wake_local);
        Some(Arc::new(move || wake_local.wake()))
    }

    fn close(&mut self) {
        self.local.close();
        self.remote.close();
    }

    fn hosts(&mut self) -> Option<HostParts<'_>> {
        let layout = &self.layout;
        let index = layout.local_index(self.rank);
        let local = PartView::new(&mut *self.local, (0..self.local_members.len()).collect(), self.local_names.clone());
        let cross = PartView::new(&mut *self.remote, layout.cross_members(index), (0..layout.size()).collect());
        Some(HostParts { layout, local, cross })
    }
}

impl CompositeTransport {
    /// A failure of either part (in communicator ranks) is passed on by both parts when they close: a
    /// shared-memory peer that died is named to the other hosts, a rank on another host to this host's.
    fn noted<T>(&mut self, outcome: Result<T, TransportError>) -> Result<T, TransportError> {
        if let Err(err) = &outcome {
            self.note_failure(err);
        }
        outcome
    }

    fn exchange_routed(
        &mut self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), TransportError> {
        let (to_route, from_route) = (self.route(to)?, self.route(from)?);
        let names = &self.local_names;
        let local_error = |e: TransportError| e.renumbered(names);
        match (to_route, from_route) {
            (Route::Local(t), Route::Local(f)) => self.local.exchange(t, send, f, recv_len, sink).map_err(local_error),
            (Route::Remote(t), Route::Remote(f)) => self.remote.exchange(t, send, f, recv_len, sink),
            _ if send.is_empty() || recv_len == 0 => {
                // One direction only: no need for a second thread.
                match if send.is_empty() { from_route } else { to_route } {
                    Route::Local(p) => self.local.exchange(p, send, p, recv_len, sink).map_err(local_error),
                    Route::Remote(p) => self.remote.exchange(p, send, p, recv_len, sink),
                }
            }
            (Route::Local(t), Route::Remote(f)) => {
                let (local, remote) = (&mut self.local, &mut self.remote);
                let (sent, received) = std::thread::scope(|s| {
                    let sender = s.spawn(move || local.send(t, send));
                    let received = remote.exchange(f, &[], f, recv_len, sink);
                    (sender.join(), received)
                });
                received?;
                sent.unwrap_or_else(|_| Err(helper_panicked(to))).map_err(local_error)
            }
            (Route::Remote(t), Route::Local(f)) => {
                let (local, remote) = (&mut self.local, &mut self.remote);
                let (sent, received) = std::thread::scope(|s| {
                    let sender = s.spawn(move || remote.send(t, send));
                    let received = local.exchange(f, &[], f, recv_len, sink);
                    (sender.join(), received)
                });
                received.map_err(local_error)?;
                sent.unwrap_or_else(|_| Err(helper_panicked(to)))
            }
        }
    }

    fn wait_for_activity_on_both(&mut self, waker: &Waker, timeout: Duration) -> Result<Activity, TransportError> {
        // `waker`'s doorbell wakes `wake_local` (see `doorbell`), so draining `wake_local` before looking at
        // `waker` loses no wake-up.
        self.wake_local.drain();
        if waker.is_signalled() {
            return Ok(Activity::Local);
        }
        match self.remote.wait_for_activity(waker, Duration::ZERO)? {
            Activity::Idle => {}
            activity => return Ok(activity),
        }
        if timeout.is_zero() {
            return self.local.wait_for_activity(waker, timeout).map_err(|e| self.local_error(e));
        }
        self.stop_watching.drain();
        let (local, remote) = (&mut self.local, &mut self.remote);
        let (stop, wake_local) = (&self.stop_watching, &*self.wake_local);
        let (local_seen, remote_seen) = std::thread::scope(|s| {
            let watcher = s.spawn(move || {
                let seen = remote.wait_for_activity(stop, timeout);
                if matches!(seen, Ok(Activity::Peer) | Err(_)) {
                    wake_local.wake();
                }
                seen
            });
            let local_seen = local.wait_for_activity(wake_local, timeout);
            stop.wake();
            (local_seen, watcher.join())
        });
        let remote_seen = remote_seen.unwrap_or_else(|_| Err(helper_panicked(self.rank)))?;
        let local_seen = local_seen.map_err(|e| self.local_error(e))?;
        Ok(if waker.is_signalled() {
            Activity::Local
        } else if remote_seen == Activity::Peer || local_seen == Activity::Peer {
            Activity::Peer
        } else {
            Activity::Idle
        })
    }
}

fn helper_panicked(peer: usize) -> TransportError {
    TransportError::Io { peer, source: std::io::Error::other("the transport's helper thread panicked") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_numbers_hosts_by_lowest_rank() {
        let layout = HostLayout::from_keys(&["b", "a", "b", "a", "a"]);
        assert_eq!(layout.hosts(), 2);
        assert_eq!(layout.members(0), &[0, 2]);
        assert_eq!(layout.members(1), &[1, 3, 4]);
        assert_eq!((layout.local_index(3), layout.local_index(2)), (1, 1));
        assert!(!layout.is_homogeneous());
        assert_eq!(layout.cross_members(1), vec![2, 3]);
        assert_eq!(layout.cross_members(2), vec![4]);
        let even = HostLayout::from_keys(&[1, 1, 2, 2]);
        assert!(even.is_homogeneous());
    }
}
