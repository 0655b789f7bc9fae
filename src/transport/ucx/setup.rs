//! Building a [`UcxTransport`] over an authenticated TCP mesh: a UCP context and worker, a random key per
//! pair of ranks (drawn by the lower rank) and the worker addresses exchanged over the mesh, an endpoint
//! per peer (peer-failure error handling), and one hello message each way over UCX, so that a peer UCX
//! cannot reach is a set-up error naming it rather than a hang in the first collective.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicI8, Ordering};
use std::time::{Duration, Instant};

use super::ffi::{self, posted, EpParams, ErrHandler, Posted, RequestParam, SockAddr, Status, WorkerParams};
use super::{tag, Peer, Tuning, Ucx, UcxTransport, HELLO};
use crate::transport::handshake;
use crate::transport::tcp::TcpTransport;
use crate::transport::{Transport, TransportError};

/// Longest worker address accepted from a peer (UCX's are a few hundred bytes, a few KiB with many devices).
const MAX_ADDRESS_LEN: usize = 1 << 16;

/// The byte each rank sends each peer as its hello.
static HELLO_BYTE: [u8; 1] = [1];

/// UCX's error handler for an endpoint: records the status for the transport to see.
unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, _ep: ffi::Ep, status: Status) {
    // SAFETY: `arg` is the peer's boxed AtomicI8, which outlives its endpoint (closed before peers drop).
    let failure = unsafe { &*arg.cast::<AtomicI8>() };
    failure.store(status, Ordering::SeqCst);
}

fn setup_error(ucx: &Ucx, what: &str, status: Status) -> TransportError {
    TransportError::Setup(format!("UCX {what} failed: {}", ucx.status_text(status)))
}

impl UcxTransport {
    /// UCX links between the ranks `control` links (its authenticated connections), numbered as there.
    /// `control` is kept: its end says a peer is gone, and `close` passes this rank's cause over it.
    /// `timeout` bounds the set-up and is then the no-progress limit of every operation.
    /// `tuning` says what goes to UCX over the environment's and whether UCX handles peer failures (see
    /// [`super::library::tuned`]).
    pub fn over(
        control: TcpTransport,
        ucx: &'static Ucx,
        tuning: &Tuning,
        timeout: Duration,
    ) -> Result<UcxTransport, TransportError> {
        let (rank, size) = (control.rank(), control.size());
        let linked: Vec<usize> = control.peer_fds().into_iter().map(|(peer, _)| peer).collect();
        let context = ucx.new_context(&tuning.settings).map_err(|e| TransportError::Setup(format!("UCX: {e}")))?;
        let params = WorkerParams {
            field_mask: ffi::UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: ffi::UCS_THREAD_MODE_SERIALIZED,
            cpu_mask: [0; 16],
            events: 0,
            user_data: std::ptr::null_mut(),
            event_fd: 0,
            flags: 0,
            name: std::ptr::null(),
            am_alignment: 0,
            client_id: 0,
        };
        let mut worker: ffi::Worker = std::ptr::null_mut();
        // SAFETY: a live context, valid params and out-pointer.
        let status = unsafe { (ucx.api.worker_create)(context, &params, &mut worker) };
        if status != ffi::UCS_OK {
            // SAFETY: the context made above, used by nothing else.
            unsafe { (ucx.api.cleanup)(context) };
            return Err(setup_error(ucx, "ucp_worker_create", status));
        }
        // From here on, dropping the transport releases the worker and the context.
        let mut transport = UcxTransport {
            rank,
            size,
            ucx,
            context,
            worker,
            efd: -1,
            peers: (0..size).map(|_| None).collect(),
            control,
            timeout,
            spare: Vec::new(),
            poll_fds: Vec::new(),
            peer_error_handling: tuning.peer_error_handling,
            closed: false,
        };
        let mut efd = -1;
        // SAFETY: a live worker made with UCP_FEATURE_WAKEUP; valid out-pointer.
        let status = unsafe { (ucx.api.worker_get_efd)(worker, &mut efd) };
        if status != ffi::UCS_OK {
            return Err(setup_error(ucx, "ucp_worker_get_efd", status));
        }
        transport.efd = efd;
        let deadline = handshake::deadline_after(timeout);
        let address = transport.worker_address()?;
        transport.connect_peers(&linked, &address)?;
        transport.greet(&linked, deadline)?;
        Ok(transport)
    }

    fn worker_address(&self) -> Result<Vec<u8>, TransportError> {
        let (mut address, mut len): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: a live worker; valid out-pointers.
        let status = unsafe { (self.ucx.api.worker_get_address)(self.worker, &mut address, &mut len) };
        if status != ffi::UCS_OK {
            return Err(setup_error(self.ucx, "ucp_worker_get_address", status));
        }
        // SAFETY: UCX gave `len` readable bytes at `address`, released right after the copy.
        let bytes = unsafe { std::slice::from_raw_parts(address.cast::<u8>(), len) }.to_vec();
        // SAFETY: the address this worker handed out above, released once.
        unsafe { (self.ucx.api.worker_release_address)(self.worker, address) };
        Ok(bytes)
    }

    /// Over the control mesh, sends every linked peer `key | address length | address` (both u32,
    /// big-endian; the key counts from the lower rank of the pair), then reads theirs and connects.
    fn connect_peers(&mut self, linked: &[usize], address: &[u8]) -> Result<(), TransportError> {
        let mut keys = vec![0u32; self.size];
        for &peer in linked.iter().filter(|&&peer| peer > self.rank) {
            let mut key = [0u8; 4];
            getrandom::getrandom(&mut key)
                .map_err(|e| TransportError::Setup(format!("no randomness for a key: {e}")))?;
            keys[peer] = u32::from_be_bytes(key);
        }
        for &peer in linked {
            let mut hello = keys[peer].to_be_bytes().to_vec();
            hello.extend_from_slice(&(address.len() as u32).to_be_bytes());
            hello.extend_from_slice(address);
            self.control.send(peer, &hello)?;
        }
        for &peer in linked {
            let mut head = [0u8; 8];
            self.control.recv(peer, &mut head)?;
            let [k0, k1, k2, k3, l0, l1, l2, l3] = head;
            let len = u32::from_be_bytes([l0, l1, l2, l3]) as usize;
            if len == 0 || len > MAX_ADDRESS_LEN {
                let detail = format!("a UCX worker address of {len} bytes");
                return Err(TransportError::Protocol { peer, detail });
            }
            let mut remote = vec![0u8; len];
            self.control.recv(peer, &mut remote)?;
            if peer < self.rank {
                keys[peer] = u32::from_be_bytes([k0, k1, k2, k3]);
            }
            self.connect_peer(peer, keys[peer], &remote)?;
        }
        Ok(())
    }

    fn connect_peer(&mut self, peer: usize, key: u32, address: &[u8]) -> Result<(), TransportError> {
        let failure = Box::new(AtomicI8::new(0));
        let no_sockaddr = || SockAddr { addr: std::ptr::null(), addrlen: 0 };
        let params = EpParams {
            field_mask: ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr().cast(),
            err_mode: if self.peer_error_handling {
                ffi::UCP_ERR_HANDLING_MODE_PEER
            } else {
                ffi::UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: ErrHandler {
                cb: Some(on_endpoint_error),
                arg: (&*failure as *const AtomicI8).cast_mut().cast(),
            },
            user_data: std::ptr::null_mut(),
            flags: 0,
            sockaddr: no_sockaddr(),
            conn_request: std::ptr::null_mut(),
            name: std::ptr::null(),
            local_sockaddr: no_sockaddr(),
        };
        let mut ep: ffi::Ep = std::ptr::null_mut();
        // SAFETY: a live worker; `params` points at the peer's address (read during the call) and at the boxed
        // failure cell, which the peer keeps until its endpoint is closed.
        let status = unsafe { (self.ucx.api.ep_create)(self.worker, &params, &mut ep) };
        if status != ffi::UCS_OK {
            let detail = format!("UCX ucp_ep_create failed: {}", self.ucx.status_text(status));
            return Err(TransportError::Connect { peer, detail });
        }
        self.peers[peer] =
            Some(Peer { ep, key, failure, incoming: VecDeque::new(), ended_at: None, control_ended: false });
        Ok(())
    }

    /// One hello message each way with every linked peer, by `deadline`.
    fn greet(&mut self, linked: &[usize], deadline: Instant) -> Result<(), TransportError> {
        let param = RequestParam::plain();
        let mut sends = Vec::new();
        for &peer in linked {
            let Some(p) = self.peers[peer].as_ref() else { continue };
            let hello = tag(p.key, self.rank, HELLO);
            // SAFETY: a live endpoint; the byte is static.
            let sent = unsafe { (self.ucx.api.tag_send_nbx)(p.ep, HELLO_BYTE.as_ptr().cast(), 1, hello, &param) };
            match posted(sent) {
                Posted::Done => {}
                Posted::Pending(request) => sends.push((peer, request)),
                Posted::Failed(status) => return Err(self.unreachable(peer, status)),
            }
        }
        let mut waiting: Vec<usize> = linked.to_vec();
        let mut scratch = [0u8; 1];
        loop {
            self.progress();
            for i in (0..waiting.len()).rev() {
                let peer = waiting[i];
                let Some(key) = self.peers[peer].as_ref().map(|p| p.key) else { continue };
                let Some((message, len)) = self.probe(peer, key, HELLO) else { continue };
                if len != 1 {
                    let detail = format!("a UCX hello of {len} bytes");
                    return Err(TransportError::Protocol { peer, detail });
                }
                match self.receive_into(message, scratch.as_mut_ptr(), 1) {
                    Posted::Done => {}
                    Posted::Pending(request) => self.await_request(peer, request, "hello")?,
                    Posted::Failed(status) => return Err(self.unreachable(peer, status)),
                }
                waiting.swap_remove(i);
            }
            let mut failed = None;
            sends.retain(|&(peer, request)| match self.finished(request) {
                None => true,
                Some(ffi::UCS_OK) => false,
                Some(status) => {
                    failed.get_or_insert((peer, status));
                    false
                }
            });
            if let Some((peer, status)) = failed {
                return Err(self.unreachable(peer, status));
            }
            if waiting.is_empty() && sends.is_empty() {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let mut peers: Vec<usize> = waiting.into_iter().chain(sends.iter().map(|&(peer, _)| peer)).collect();
                peers.sort_unstable();
                peers.dedup();
                return Err(TransportError::NotConnected { peers });
            }
            self.sleep(None, left.min(Duration::from_millis(50)))?;
        }
    }

    fn unreachable(&self, peer: usize, status: Status) -> TransportError {
        let detail = format!("UCX could not reach it: {}", self.ucx.status_text(status));
        TransportError::Connect { peer, detail }
    }
}
