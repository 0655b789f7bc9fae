//! The store's blocking client: one authenticated connection, one request at a time.
//!
//! Every failure is a [`TransportError::Setup`] whose message names the store's address, the operation and
//! the key. After an I/O failure the connection's framing is unknown, so the client should be dropped.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::wire::{
    read_arriving, request_header, Op, MAX_KEY_LEN, MAX_VALUE_LEN, STATUS_FAILED, STATUS_MISSING, STATUS_OK,
};
use crate::transport::handshake::{self, Purpose};
use crate::transport::TransportError;

/// Most `get` requests [`StoreClient::get_all_from`] writes before it reads their answers (a batch's
/// requests and answers, some tens of KiB, fit the sockets' buffers, so neither side blocks the other).
pub const GET_BATCH: usize = 256;

/// Pause between attempts to reach a store that is not listening yet.
const CONNECT_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// A connection to a [`super::RendezvousServer`].
pub struct StoreClient {
    stream: TcpStream,
    addr: SocketAddr,
    /// How long one request may wait for its answer (a `get` adds its own wait on top).
    io_timeout: Duration,
}

impl StoreClient {
    /// Connects and authenticates, retrying until `timeout` passes, since ranks may start before the store
    /// listens. `timeout` also bounds every later request.
    pub fn connect(addr: SocketAddr, secret: &[u8], timeout: Duration) -> Result<StoreClient, TransportError> {
        let deadline = handshake::deadline_after(timeout);
        let mut stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = if left.is_zero() {
                Err(io::Error::new(io::ErrorKind::TimedOut, "no time left"))
            } else {
                TcpStream::connect_timeout(&addr, left)
            };
            match attempt {
                Ok(stream) => break stream,
                Err(err) if Instant::now() + CONNECT_RETRY_PAUSE >= deadline => {
                    return Err(TransportError::Setup(format!(
                        "could not reach the rendezvous store at {addr} within {:.1} s: {err}",
                        timeout.as_secs_f64()
                    )));
                }
                Err(_) => std::thread::sleep(CONNECT_RETRY_PAUSE),
            }
        };
        handshake::connect(&mut stream, secret, Purpose::Store, b"", deadline)
            .map_err(|err| TransportError::Setup(format!("rendezvous store at {addr}: {err}")))?;
        stream.set_nodelay(true).map_err(|err| TransportError::Setup(format!("rendezvous store at {addr}: {err}")))?;
        Ok(StoreClient { stream, addr, io_timeout: timeout.max(Duration::from_millis(1)) })
    }

    /// A second connection to the same store (authenticated with `secret`, the same limits), for a user that
    /// looks keys up later on a thread of its own.
    pub fn another(&self, secret: &[u8]) -> Result<StoreClient, TransportError> {
        StoreClient::connect(self.addr, secret, self.io_timeout)
    }

    /// Stores `value` under `key`, replacing any previous value, and wakes every `get` waiting for it.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), TransportError> {
        check_key(key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(TransportError::Setup(format!(
                "value for rendezvous key '{key}' is {} bytes, the limit is {MAX_VALUE_LEN}",
                value.len()
            )));
        }
        let mut request = request_header(Op::Set, key.as_bytes(), 4 + value.len());
        request.extend_from_slice(&(value.len() as u32).to_be_bytes());
        request.extend_from_slice(value);
        self.round_trip("set", key, &request, Duration::ZERO, set_answer)
    }

    /// Returns the value of `key`, waiting up to `timeout` for some client to set it.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, TransportError> {
        self.try_get(key, timeout)?.ok_or_else(|| self.missing(key, timeout))
    }

    /// Like [`get`](Self::get), for a key that rank `peer` of a communicator sets: a timeout is a
    /// [`TransportError::KeyTimeout`] naming `peer` (a position, which callers renumber into the rank users
    /// know, as they do for every transport error).
    pub fn get_from(&mut self, peer: usize, key: &str, timeout: Duration) -> Result<Vec<u8>, TransportError> {
        self.try_get(key, timeout)?.ok_or_else(|| self.missing_from(peer, key, timeout))
    }

    /// Like [`get_from`](Self::get_from), but runs `check` every `slice` of the wait and fails with its error
    /// at once (for example when `peer` has died).
    pub fn get_from_checking(
        &mut self,
        peer: usize,
        key: &str,
        timeout: Duration,
        slice: Duration,
        mut check: impl FnMut() -> Result<(), TransportError>,
    ) -> Result<Vec<u8>, TransportError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(value) = self.try_get(key, left.min(slice))? {
                return Ok(value);
            }
            check()?;
            if left <= slice {
                return Err(self.missing_from(peer, key, timeout));
            }
        }
    }

    /// The values of `keys`, each set by the rank it names (as [`get_from`](Self::get_from)), in order, waiting
    /// up to `timeout` for each to appear. The requests go out [`GET_BATCH`] at a time, each batch written
    /// at once and its answers read after it, so a rank learning N keys waits for N / [`GET_BATCH`] round
    /// trips, not N. A key still missing is a [`TransportError::KeyTimeout`] naming its rank; the client must
    /// then be dropped (the batch's later answers are still on their way).
    pub fn get_all_from(
        &mut self,
        keys: &[(usize, String)],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let deadline = handshake::deadline_after(timeout);
        let mut values = Vec::with_capacity(keys.len());
        for batch in keys.chunks(GET_BATCH) {
            let left = deadline.saturating_duration_since(Instant::now());
            let wait_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
            let mut requests = Vec::new();
            for (_, key) in batch {
                check_key(key)?;
                requests.extend_from_slice(&request_header(Op::Get, key.as_bytes(), 8));
                requests.extend_from_slice(&wait_ms.to_be_bytes());
            }
            let first = &batch[0].1;
            self.send_request(&requests, left).map_err(|failure| self.failed("get", first, failure))?;
            for (peer, key) in batch {
                match get_answer(&mut self.stream) {
                    Ok(Some(value)) => values.push(value),
                    Ok(None) => return Err(self.missing_from(*peer, key, timeout)),
                    Err(failure) => return Err(self.failed("get", key, failure)),
                }
            }
        }
        Ok(values)
    }

    fn missing_from(&self, peer: usize, key: &str, timeout: Duration) -> TransportError {
        TransportError::KeyTimeout {
            peer,
            key: key.to_string(),
            seconds: timeout.as_secs_f64(),
            store: self.addr.to_string(),
        }
    }

    pub(crate) fn missing(&self, key: &str, timeout: Duration) -> TransportError {
        TransportError::Setup(format!(
            "timed out after {:.1} s waiting for key '{key}' in the rendezvous store at {}",
            timeout.as_secs_f64(),
            self.addr
        ))
    }

    /// Like [`get`](Self::get), but a key still missing after `timeout` is `None` instead of an error.
    pub fn try_get(&mut self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>, TransportError> {
        check_key(key)?;
        let wait_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let mut request = request_header(Op::Get, key.as_bytes(), 8);
        request.extend_from_slice(&wait_ms.to_be_bytes());
        self.round_trip("get", key, &request, timeout, get_answer)
    }

    /// Adds `delta` to the integer counter at `key` (a missing key counts as 0) and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, TransportError> {
        check_key(key)?;
        let mut request = request_header(Op::Add, key.as_bytes(), 8);
        request.extend_from_slice(&delta.to_be_bytes());
        self.round_trip("add", key, &request, Duration::ZERO, add_answer)
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&mut self, key: &str) -> Result<bool, TransportError> {
        check_key(key)?;
        let request = request_header(Op::Delete, key.as_bytes(), 0);
        self.round_trip("delete", key, &request, Duration::ZERO, delete_answer)
    }

    /// Sends `request` and reads its answer with `read_answer`, allowing `extra_wait` beyond the usual
    /// timeout for the server to answer.
    fn round_trip<T>(
        &mut self,
        op: &str,
        key: &str,
        request: &[u8],
        extra_wait: Duration,
        read_answer: impl FnOnce(&mut TcpStream) -> Result<T, Failure>,
    ) -> Result<T, TransportError> {
        let answer = self.send_request(request, extra_wait).and_then(|()| read_answer(&mut self.stream));
        answer.map_err(|failure| self.failed(op, key, failure))
    }

    /// The error a request `op` on `key` that ended in `failure` reports.
    fn failed(&self, op: &str, key: &str, failure: Failure) -> TransportError {
        let detail = match failure {
            Failure::Io(err) if matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                "no answer in time".to_string()
            }
            Failure::Io(err) if err.kind() == io::ErrorKind::UnexpectedEof => "the store closed the connection".into(),
            Failure::Io(err) => err.to_string(),
            Failure::Framing(what) => format!("malformed answer: {what}"),
            Failure::Refused(message) => message,
        };
        TransportError::Setup(format!("rendezvous store at {}: {op} '{key}' failed: {detail}", self.addr))
    }

    fn send_request(&mut self, request: &[u8], extra_wait: Duration) -> Result<(), Failure> {
        self.stream.set_write_timeout(Some(self.io_timeout))?;
        self.stream.set_read_timeout(Some(self.io_timeout.saturating_add(extra_wait)))?;
        self.stream.write_all(request)?;
        Ok(())
    }
}

// The store's answers to each operation, read from `stream` (the client's connection; any bytes in tests).

fn set_answer(stream: &mut impl Read) -> Result<(), Failure> {
    match read_u8(stream)? {
        STATUS_OK => Ok(()),
        status => failure_or_unknown(stream, status),
    }
}

fn get_answer(stream: &mut impl Read) -> Result<Option<Vec<u8>>, Failure> {
    match read_u8(stream)? {
        STATUS_OK => {
            let len = u32::from_be_bytes(read_array(stream)?) as usize;
            if len > MAX_VALUE_LEN {
                return Err(Failure::Framing(format!("a value of {len} bytes")));
            }
            Ok(Some(read_arriving(stream, len)?))
        }
        STATUS_MISSING => Ok(None),
        status => failure_or_unknown(stream, status),
    }
}

fn add_answer(stream: &mut impl Read) -> Result<i64, Failure> {
    match read_u8(stream)? {
        STATUS_OK => Ok(i64::from_be_bytes(read_array(stream)?)),
        status => failure_or_unknown(stream, status),
    }
}

fn delete_answer(stream: &mut impl Read) -> Result<bool, Failure> {
    match read_u8(stream)? {
        STATUS_OK => Ok(read_u8(stream)? != 0),
        status => failure_or_unknown(stream, status),
    }
}

fn read_array<const N: usize>(stream: &mut impl Read) -> Result<[u8; N], Failure> {
    let mut bytes = [0u8; N];
    stream.read_exact(&mut bytes)?;
    Ok(bytes)
}

fn read_u8(stream: &mut impl Read) -> Result<u8, Failure> {
    Ok(read_array::<1>(stream)?[0])
}

/// Reads the message of a FAILED answer, or reports an unknown status.
fn failure_or_unknown<T>(stream: &mut impl Read, status: u8) -> Result<T, Failure> {
    if status != STATUS_FAILED {
        return Err(Failure::Framing(format!("unknown status {status}")));
    }
    let len = u16::from_be_bytes(read_array(stream)?) as usize;
    let message = read_arriving(stream, len)?;
    Err(Failure::Refused(String::from_utf8_lossy(&message).into_owned()))
}

/// Why one request failed, before it is put into words.
enum Failure {
    Io(io::Error),
    Framing(String),
    Refused(String),
}

impl From<io::Error> for Failure {
    fn from(err: io::Error) -> Failure {
        Failure::Io(err)
    }
}

fn check_key(key: &str) -> Result<(), TransportError> {
    if key.len() > MAX_KEY_LEN {
        return Err(TransportError::Setup(format!(
            "rendezvous key of {} bytes, the limit is {MAX_KEY_LEN}",
            key.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::fuzz::{self, Target};
    use crate::transport::rendezvous::RendezvousServer;
    use std::net::{Ipv4Addr, TcpListener};

    /// Reads `bytes[1..]` as the answer to the operation `bytes[0]` picks; true when it is well framed.
    fn client_reads(bytes: &[u8]) -> bool {
        let Some((&op, mut answer)) = bytes.split_first() else { return false };
        let stream = &mut answer;
        let read = match op % 4 {
            0 => set_answer(stream),
            1 => get_answer(stream).map(drop),
            2 => add_answer(stream).map(drop),
            _ => delete_answer(stream).map(drop),
        };
        matches!(read, Ok(()) | Err(Failure::Refused(_)))
    }

    fn answers_target() -> Target {
        let value = b"10.0.0.1:4000";
        let seeds = vec![
            vec![0, STATUS_OK],
            [&[1, STATUS_OK][..], &(value.len() as u32).to_be_bytes(), value].concat(),
            [&[1, STATUS_OK][..], &0u32.to_be_bytes()].concat(),
            vec![1, STATUS_MISSING],
            [&[2, STATUS_OK][..], &(-7i64).to_be_bytes()].concat(),
            vec![3, STATUS_OK, 1],
            [&[2, STATUS_FAILED][..], &9u16.to_be_bytes(), b"not a num"].concat(),
        ];
        Target { name: "store_answers", seeds, decode: client_reads }
    }

    #[test]
    fn fuzz_short_store_answers() {
        fuzz::run(&answers_target(), fuzz::SHORT_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_store_answers() {
        fuzz::run(&answers_target(), fuzz::LONG_RUN);
    }

    #[test]
    fn answers_are_read_as_framed_and_a_huge_value_costs_nothing_before_it_comes() {
        let answer = [&[STATUS_OK][..], &3u32.to_be_bytes(), b"abc"].concat();
        assert_eq!(get_answer(&mut &answer[..]).ok(), Some(Some(b"abc".to_vec())));
        let declared = [&[STATUS_OK][..], &(MAX_VALUE_LEN as u32).to_be_bytes()].concat();
        assert!(
            matches!(get_answer(&mut &declared[..]), Err(Failure::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof)
        );
        let over = [&[STATUS_OK][..], &(MAX_VALUE_LEN as u32 + 1).to_be_bytes()].concat();
        assert!(matches!(get_answer(&mut &over[..]), Err(Failure::Framing(what)) if what.contains("bytes")));
        let refused = [&[STATUS_FAILED][..], &2u16.to_be_bytes(), b"no"].concat();
        assert!(matches!(add_answer(&mut &refused[..]), Err(Failure::Refused(message)) if message == "no"));
        assert!(matches!(delete_answer(&mut &[7u8][..]), Err(Failure::Framing(what)) if what == "unknown status 7"));
    }

    /// Found by the fuzzer (tests/fuzz_corpus/store_answers/crash-4c3f197fbbbe1d0c.bin): an answer to a get
    /// declaring a value of 33,619,967 bytes made the client set them all aside before they came; now a
    /// value's memory grows as its bytes arrive.
    #[test]
    fn a_declared_value_costs_memory_only_as_it_arrives() {
        let answer = [
            0x00, 0x02, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xf9, 0x02, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff,
            0xff, 0xff, 0xf9,
        ];
        let (read, held) = fuzz::measure(|| get_answer(&mut &answer[..]));
        assert!(matches!(read, Err(Failure::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof));
        assert!(held <= fuzz::allowance(answer.len()), "held {held} bytes for a {}-byte answer", answer.len());
    }

    #[test]
    fn connect_waits_for_a_late_server() {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let client = std::thread::spawn(move || StoreClient::connect(addr, b"k", Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(200));
        let _server = RendezvousServer::start(Ipv4Addr::LOCALHOST.into(), port, b"k".to_vec()).unwrap();
        let mut client = client.join().unwrap().unwrap();
        client.set("a", b"1").unwrap();
        assert_eq!(client.get("a", Duration::ZERO).unwrap(), b"1");
    }

    #[test]
    fn operations_and_their_errors() {
        let server = RendezvousServer::start(Ipv4Addr::LOCALHOST.into(), 0, b"k".to_vec()).unwrap();
        let mut client = StoreClient::connect(server.addr(), b"k", Duration::from_secs(5)).unwrap();
        assert_eq!(client.add("count", 2).unwrap(), 2);
        assert_eq!(client.add("count", 3).unwrap(), 5);
        assert_eq!(client.get("count", Duration::ZERO).unwrap(), b"5");
        client.set("text", b"x").unwrap();
        let err = client.add("text", 1).unwrap_err().to_string();
        assert!(err.contains("not an integer"), "{err}");
        assert!(client.delete("text").unwrap());
        assert!(!client.delete("text").unwrap());
        let err = client.get("text", Duration::from_millis(50)).unwrap_err().to_string();
        assert!(err.contains("'text'") && err.contains("timed out"), "{err}");
        let long_key = "k".repeat(MAX_KEY_LEN + 1);
        assert!(client.set(&long_key, b"").is_err());
        // The connection is still usable after refused requests.
        client.set("empty", b"").unwrap();
        assert_eq!(client.get("empty", Duration::ZERO).unwrap(), b"");
    }

    #[test]
    fn many_keys_come_back_in_order_in_batches_waiting_for_late_ones_and_a_missing_one_is_named() {
        let server = RendezvousServer::start(Ipv4Addr::LOCALHOST.into(), 0, b"k".to_vec()).unwrap();
        let mut client = StoreClient::connect(server.addr(), b"k", Duration::from_secs(5)).unwrap();
        let count = 2 * GET_BATCH + 3;
        for rank in (0..count).filter(|rank| rank % 97 != 5) {
            client.set(&format!("host/{rank}"), format!("h{rank}").as_bytes()).unwrap();
        }
        let mut late = client.another(b"k").unwrap();
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            for rank in (0..count).filter(|rank| rank % 97 == 5) {
                late.set(&format!("host/{rank}"), format!("h{rank}").as_bytes()).unwrap();
            }
        });
        let keys: Vec<(usize, String)> = (0..count).map(|rank| (rank, format!("host/{rank}"))).collect();
        let values = client.get_all_from(&keys, Duration::from_secs(10)).unwrap();
        setter.join().unwrap();
        let expected: Vec<Vec<u8>> = (0..count).map(|rank| format!("h{rank}").into_bytes()).collect();
        assert_eq!(values, expected);
        let mut fresh = client.another(b"k").unwrap();
        let keys = [(0, "host/0".to_string()), (7, "host/never".to_string())];
        let err = fresh.get_all_from(&keys, Duration::from_millis(100)).unwrap_err();
        assert!(matches!(&err, TransportError::KeyTimeout { peer: 7, key, .. } if key == "host/never"), "{err}");
    }

    #[test]
    fn waiting_get_fails_fast_when_the_server_stops() {
        let server = RendezvousServer::start(Ipv4Addr::LOCALHOST.into(), 0, b"k".to_vec()).unwrap();
        let mut client = StoreClient::connect(server.addr(), b"k", Duration::from_secs(5)).unwrap();
        let started = Instant::now();
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            server.stop();
        });
        let err = client.get("never", Duration::from_secs(30)).unwrap_err().to_string();
        assert!(err.contains("closed"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        stopper.join().unwrap();
    }
}
