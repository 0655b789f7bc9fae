//! The store's server: a tokio runtime on a background thread serving every connection concurrently.
//!
//! A connection must finish the handshake within five seconds or it is dropped (with a warning
//! naming the peer address). A client that breaks the framing loses only its own connection. `get` waits
//! on the server for the key to appear, woken by every `set` and `add`; stopping the server (or dropping it)
//! closes every connection, so waiting clients fail at once instead of timing out.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Notify};

use super::wire::{read_arriving_async, Op, MAX_KEY_LEN, MAX_VALUE_LEN, STATUS_FAILED, STATUS_MISSING, STATUS_OK};
use crate::transport::dropped_connections::DropLog;
use crate::transport::handshake::{self, Purpose};

/// How long a new connection may take to authenticate.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);

/// Longest server-side wait of one `get`, whatever the client asks for.
const MAX_GET_WAIT: Duration = Duration::from_secs(24 * 3600);

/// Pause after a failed `accept` (e.g. out of file descriptors) so the loop does not spin.
const ACCEPT_RETRY_PAUSE: Duration = Duration::from_millis(20);

/// The keys and values, and a signal raised whenever a key is written.
#[derive(Default)]
struct Store {
    entries: Mutex<HashMap<Vec<u8>, Arc<[u8]>>>,
    written: Notify,
}

impl Store {
    fn entries(&self) -> MutexGuard<'_, HashMap<Vec<u8>, Arc<[u8]>>> {
        // No code panics while holding the lock, but a poisoned map is still a consistent map.
        self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn set(&self, key: Vec<u8>, value: Vec<u8>) {
        self.entries().insert(key, value.into());
        self.written.notify_waiters();
    }

    /// Waits up to `wait` for `key` to exist.
    async fn get(&self, key: &[u8], wait: Duration) -> Option<Arc<[u8]>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Register for the wake-up before looking, so a write in between is not missed.
            let written = self.written.notified();
            tokio::pin!(written);
            written.as_mut().enable();
            if let Some(value) = self.entries().get(key) {
                return Some(value.clone());
            }
            if tokio::time::timeout_at(deadline, written).await.is_err() {
                return None;
            }
        }
    }

    fn add(&self, key: Vec<u8>, delta: i64) -> Result<i64, String> {
        let mut entries = self.entries();
        let current = match entries.get(&key) {
            None => 0,
            Some(text) => std::str::from_utf8(text)
                .ok()
                .and_then(|text| text.parse::<i64>().ok())
                .ok_or_else(|| "the key holds a value that is not an integer counter".to_string())?,
        };
        let updated = current.checked_add(delta).ok_or_else(|| format!("{current} + {delta} overflows i64"))?;
        entries.insert(key, updated.to_string().into_bytes().into());
        drop(entries);
        self.written.notify_waiters();
        Ok(updated)
    }

    fn delete(&self, key: &[u8]) -> bool {
        self.entries().remove(key).is_some()
    }
}

/// A running rendezvous store. Stops when [`RendezvousServer::stop`] is called or when dropped.
pub struct RendezvousServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl RendezvousServer {
    /// Listens on `bind:port` (port 0 picks a free one) and serves on a background thread.
    pub fn start(bind: IpAddr, port: u16, secret: Vec<u8>) -> io::Result<RendezvousServer> {
        let listener = std::net::TcpListener::bind((bind, port))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let listener = {
            let _context = runtime.enter();
            TcpListener::from_std(listener)?
        };
        let (stop, stopped) = oneshot::channel();
        let secret: Arc<[u8]> = secret.into();
        let thread = std::thread::Builder::new()
            .name("rvod-rendezvous".into())
            .spawn(move || runtime.block_on(serve(listener, secret, stopped)))?;
        Ok(RendezvousServer { addr, stop: Some(stop), thread: Some(thread) })
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and closes every connection.
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        if let Some(stop) = self.stop.take() {
            // The server thread may already be gone; then there is nothing to tell.
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("rendezvous server thread panicked");
            }
        }
    }
}

impl Drop for RendezvousServer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Accepts until told to stop; returning drops the runtime and with it every connection task.
async fn serve(listener: TcpListener, secret: Arc<[u8]>, mut stopped: oneshot::Receiver<()>) {
    let store = Arc::new(Store::default());
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    tokio::spawn(serve_connection(stream, peer, secret.clone(), store.clone()));
                }
                Err(err) => {
                    tracing::warn!(error = %err, "rendezvous server: accept failed");
                    tokio::time::sleep(ACCEPT_RETRY_PAUSE).await;
                }
            },
        }
    }
}

/// Connections the rendezvous servers of this process dropped (rate-limited warnings).
static STORE_DROPS: DropLog = DropLog::new("rendezvous server");

async fn serve_connection(mut stream: TcpStream, peer: SocketAddr, secret: Arc<[u8]>, store: Arc<Store>) {
    let authenticated =
        tokio::time::timeout(HANDSHAKE_LIMIT, handshake::accept_async(&mut stream, &secret, Purpose::Store, |_| true))
            .await;
    match authenticated {
        Ok(Ok(_)) => {}
        Ok(Err(err)) => {
            STORE_DROPS.dropped(peer, &format!("it failed authentication: {err}"));
            return;
        }
        Err(_) => {
            STORE_DROPS.dropped(peer, "it did not authenticate in time");
            return;
        }
    }
    if let Err(err) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %err, "rendezvous server: could not set TCP_NODELAY");
    }
    let mut stream = BufReader::new(stream);
    if let Err(err) = answer_requests(&mut stream, &store).await {
        if err.kind() != io::ErrorKind::UnexpectedEof {
            tracing::warn!(%peer, error = %err, "rendezvous server: closed a client connection");
        }
    }
}

fn invalid(detail: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, detail)
}

/// One request as a client framed it (see [`super::wire`]).
#[derive(Debug, PartialEq)]
enum Request {
    Set { key: Vec<u8>, value: Vec<u8> },
    Get { key: Vec<u8>, wait: Duration },
    Add { key: Vec<u8>, delta: i64 },
    Delete { key: Vec<u8> },
}

/// Reads a client's next request; an error (the end of the stream included) ends the connection.
async fn read_request<R: AsyncRead + Unpin>(stream: &mut R) -> io::Result<Request> {
    let code = stream.read_u8().await?;
    let op = Op::from_code(code).ok_or_else(|| invalid(format!("unknown operation {code}")))?;
    let key_len = stream.read_u16().await? as usize;
    if key_len > MAX_KEY_LEN {
        return Err(invalid(format!("key of {key_len} bytes, the limit is {MAX_KEY_LEN}")));
    }
    let mut key = vec![0u8; key_len];
    stream.read_exact(&mut key).await?;
    Ok(match op {
        Op::Set => {
            let value_len = stream.read_u32().await? as usize;
            if value_len > MAX_VALUE_LEN {
                return Err(invalid(format!("value of {value_len} bytes, the limit is {MAX_VALUE_LEN}")));
            }
            Request::Set { key, value: read_arriving_async(stream, value_len).await? }
        }
        Op::Get => Request::Get { key, wait: Duration::from_millis(stream.read_u64().await?).min(MAX_GET_WAIT) },
        Op::Add => Request::Add { key, delta: stream.read_i64().await? },
        Op::Delete => Request::Delete { key },
    })
}

/// Serves one authenticated client until it hangs up or breaks the framing.
async fn answer_requests(stream: &mut BufReader<TcpStream>, store: &Store) -> io::Result<()> {
    loop {
        let response = match read_request(stream).await? {
            Request::Set { key, value } => {
                store.set(key, value);
                vec![STATUS_OK]
            }
            Request::Get { key, wait } => match store.get(&key, wait).await {
                Some(value) => {
                    let mut response = Vec::with_capacity(5 + value.len());
                    response.push(STATUS_OK);
                    // Stored values passed the MAX_VALUE_LEN check (counters are short), so they fit in u32.
                    response.extend_from_slice(&(value.len() as u32).to_be_bytes());
                    response.extend_from_slice(&value);
                    response
                }
                None => vec![STATUS_MISSING],
            },
            Request::Add { key, delta } => match store.add(key, delta) {
                Ok(updated) => {
                    let mut response = vec![STATUS_OK];
                    response.extend_from_slice(&updated.to_be_bytes());
                    response
                }
                Err(message) => failure(&message),
            },
            Request::Delete { key } => vec![STATUS_OK, u8::from(store.delete(&key))],
        };
        stream.write_all(&response).await?;
    }
}

fn failure(message: &str) -> Vec<u8> {
    let bytes = message.as_bytes();
    let len = bytes.len().min(u16::MAX as usize);
    let mut response = vec![STATUS_FAILED];
    response.extend_from_slice(&(len as u16).to_be_bytes());
    response.extend_from_slice(&bytes[..len]);
    response
}

#[cfg(test)]
mod tests {
    use super::super::wire::request_header;
    use super::*;
    use crate::protocol::fuzz::{self, Target};

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(future)
    }

    #[test]
    fn counters_count_and_refuse_text_and_overflow() {
        let store = Store::default();
        assert_eq!(store.add(b"n".to_vec(), 5), Ok(5));
        assert_eq!(store.add(b"n".to_vec(), -7), Ok(-2));
        store.set(b"text".to_vec(), b"hello".to_vec());
        assert!(store.add(b"text".to_vec(), 1).is_err());
        store.set(b"big".to_vec(), i64::MAX.to_string().into_bytes());
        assert!(store.add(b"big".to_vec(), 1).unwrap_err().contains("overflows"));
        assert!(store.delete(b"n"));
        assert!(!store.delete(b"n"));
    }

    #[test]
    fn get_waits_for_a_later_write() {
        let store = Arc::new(Store::default());
        let value = block_on(async {
            let writer = store.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                writer.set(b"k".to_vec(), b"v".to_vec());
            });
            store.get(b"k", Duration::from_secs(5)).await
        });
        assert_eq!(value.as_deref(), Some(&b"v"[..]));
        assert_eq!(block_on(store.get(b"absent", Duration::from_millis(20))), None);
    }

    /// Reads requests from `bytes` until they end; true when it read at least one and ended between two.
    fn server_reads(bytes: &[u8]) -> bool {
        let mut stream = bytes;
        let mut requests = 0;
        loop {
            match fuzz::ready(read_request(&mut stream)) {
                Ok(_) => requests += 1,
                Err(err) => return requests > 0 && stream.is_empty() && err.kind() == io::ErrorKind::UnexpectedEof,
            }
        }
    }

    fn requests_target() -> Target {
        let set = |key: &[u8], value: &[u8]| {
            let mut request = request_header(Op::Set, key, 4 + value.len());
            request.extend_from_slice(&(value.len() as u32).to_be_bytes());
            request.extend_from_slice(value);
            request
        };
        let with = |op, key: &[u8], body: &[u8]| [request_header(op, key, body.len()), body.to_vec()].concat();
        let requests = [
            set(b"rank/0/addr", b"10.0.0.1:4000"),
            set(b"", b""),
            with(Op::Get, b"rank/1/addr", &5000u64.to_be_bytes()),
            with(Op::Add, b"count", &(-3i64).to_be_bytes()),
            with(Op::Delete, b"count", b""),
        ];
        let mut seeds: Vec<Vec<u8>> = requests.to_vec();
        seeds.push(requests.concat());
        Target { name: "store_requests", seeds, decode: server_reads }
    }

    #[test]
    fn fuzz_short_store_requests() {
        fuzz::run(&requests_target(), fuzz::SHORT_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_store_requests() {
        fuzz::run(&requests_target(), fuzz::LONG_RUN);
    }

    #[test]
    fn requests_are_read_as_framed_and_a_huge_value_costs_nothing_before_it_comes() {
        let mut set = request_header(Op::Set, b"k", 4);
        set.extend_from_slice(&3u32.to_be_bytes());
        set.extend_from_slice(b"abc");
        assert_eq!(
            fuzz::ready(read_request(&mut &set[..])).unwrap(),
            Request::Set { key: b"k".to_vec(), value: b"abc".to_vec() }
        );
        // A value declared at the limit but never sent: an early end, not 64 MiB set aside.
        let mut huge = request_header(Op::Set, b"k", 4);
        huge.extend_from_slice(&(MAX_VALUE_LEN as u32).to_be_bytes());
        let err = fuzz::ready(read_request(&mut &huge[..])).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        let mut over = request_header(Op::Set, b"k", 4);
        over.extend_from_slice(&(MAX_VALUE_LEN as u32 + 1).to_be_bytes());
        let err = fuzz::ready(read_request(&mut &over[..])).unwrap_err();
        assert!(err.to_string().contains("limit"), "{err}");
        let mut get = request_header(Op::Get, b"k", 8);
        get.extend_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(
            fuzz::ready(read_request(&mut &get[..])).unwrap(),
            Request::Get { key: b"k".to_vec(), wait: MAX_GET_WAIT }
        );
        let err = fuzz::ready(read_request(&mut &[9u8, 0, 0][..])).unwrap_err();
        assert!(err.to_string().contains("unknown operation 9"), "{err}");
    }

    /// Found by the fuzzer (tests/fuzz_corpus/store_requests/crash-ad775a0733a0ab27.bin): a set declaring a
    /// value of 262,149 bytes and sending 5 made the server set all 262,149 aside before they came (up to
    /// 64 MiB per request); now a value's memory grows as its bytes arrive.
    #[test]
    fn a_declared_value_costs_memory_only_as_it_arrives() {
        let input = [0x01, 0x00, 0x00, 0x00, 0x04, 0x00, 0x05, 0x63, 0x01, 0x75, 0x6e, 0x74];
        let (read, held) = fuzz::measure(|| fuzz::ready(read_request(&mut &input[..])));
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        assert!(held <= fuzz::allowance(input.len()), "held {held} bytes for a {}-byte request", input.len());
    }

    #[test]
    fn failure_messages_are_framed() {
        assert_eq!(failure("no"), vec![STATUS_FAILED, 0, 2, b'n', b'o']);
    }
}
