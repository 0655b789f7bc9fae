//! Mutual authentication of a freshly connected stream with the job's shared secret.
//!
//! Both ends prove that they know the secret with HMAC-SHA256 over a transcript that holds a fresh
//! random nonce from each side, so a recorded conversation cannot be replayed and one side's proof
//! cannot be reflected back as the other's. Wire format (integers big-endian):
//!
//! ```text
//! connector -> acceptor  hello      "RVOD" | version u16 | purpose u8 | connector nonce [32] | claim length u16 | claim
//! acceptor  -> connector challenge  "RVOD" | version u16 | purpose u8 | acceptor nonce [32]
//! connector -> acceptor  proof      HMAC(secret, CONNECTOR_LABEL | transcript)
//! acceptor  -> connector verdict    HMAC(secret, ACCEPTOR_LABEL | transcript) | accepted u8
//! transcript = version | purpose | connector nonce | acceptor nonce | claim length | claim
//! ```
//!
//! The claim is the identity the connector asserts (for the mesh: its rank and the communicator's scope);
//! both proofs cover it. The acceptor sends nothing derived from the secret before the connector has proven
//! itself, and drops a connection that fails any check without answering. Every read has a fixed size
//! bound (at most [`MAX_CLAIM_LEN`] bytes of claim) and a deadline, so a stranger sending a huge length or
//! nothing at all costs at most a short wait; the acceptor checks the 7-byte preamble before reading on, so
//! one speaking another protocol is dropped at once.
//!
//! The protocol steps live in a sans-IO core (`ConnectorSide`, `AcceptorSide`); [`connect`] and
//! [`accept`] drive it over a blocking `std` stream, [`accept_async`] over a tokio stream.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

type HmacSha256 = Hmac<Sha256>;

const MAGIC: [u8; 4] = *b"RVOD";
const VERSION: u16 = 1;
const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
const CONNECTOR_LABEL: &[u8] = b"rvod handshake: connector proof\0";
const ACCEPTOR_LABEL: &[u8] = b"rvod handshake: acceptor proof\0";

/// Longest identity a connector may claim.
pub const MAX_CLAIM_LEN: usize = 1024;

const PREAMBLE_LEN: usize = MAGIC.len() + 2 + 1;
const HELLO_HEADER_LEN: usize = PREAMBLE_LEN + NONCE_LEN + 2;
const CHALLENGE_LEN: usize = MAGIC.len() + 2 + 1 + NONCE_LEN;
const VERDICT_LEN: usize = MAC_LEN + 1;

/// What a connection is for. Part of the transcript, so a proof made for one purpose is useless for another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Purpose {
    /// A client of the rendezvous store.
    Store = 1,
    /// A link of the TCP mesh between ranks.
    Mesh = 2,
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("I/O error during authentication: {0}")]
    Io(#[from] io::Error),
    #[error("authentication did not finish in time")]
    TimedOut,
    #[error("the peer closed the connection during authentication")]
    Closed,
    #[error("the peer does not speak the rvod protocol")]
    NotRvod,
    #[error("the peer speaks rvod handshake version {0}, this process speaks version {VERSION}")]
    Version(u16),
    #[error("the peer connected for a different purpose")]
    WrongPurpose,
    #[error("the claimed identity is {0} bytes long, the limit is {MAX_CLAIM_LEN}")]
    ClaimTooLong(usize),
    #[error("the peer's proof is wrong: it does not know the job secret")]
    BadProof,
    #[error("the peer rejected our proof: is the job secret the same everywhere?")]
    Rejected,
    #[error("the peer authenticated but is not expected here")]
    Unexpected,
    #[error("the job secret cannot be used as an HMAC key")]
    BadSecret,
    #[error("no system randomness for a nonce: {0}")]
    Random(getrandom::Error),
}

fn fresh_nonce() -> Result<[u8; NONCE_LEN], HandshakeError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut nonce).map_err(HandshakeError::Random)?;
    Ok(nonce)
}

/// Everything both proofs cover.
struct Transcript {
    purpose: Purpose,
    connector_nonce: [u8; NONCE_LEN],
    acceptor_nonce: [u8; NONCE_LEN],
    claim: Vec<u8>,
}

impl Transcript {
    fn keyed_mac(&self, secret: &[u8], label: &[u8]) -> Result<HmacSha256, HandshakeError> {
        let mut mac = HmacSha256::new_from_slice(secret).map_err(|_| HandshakeError::BadSecret)?;
        mac.update(label);
        mac.update(&VERSION.to_be_bytes());
        mac.update(&[self.purpose as u8]);
        mac.update(&self.connector_nonce);
        mac.update(&self.acceptor_nonce);
        // The claim length is bounded by MAX_CLAIM_LEN, so it fits in u16.
        mac.update(&(self.claim.len() as u16).to_be_bytes());
        mac.update(&self.claim);
        Ok(mac)
    }

    fn proof(&self, secret: &[u8], label: &[u8]) -> Result<[u8; MAC_LEN], HandshakeError> {
        Ok(self.keyed_mac(secret, label)?.finalize().into_bytes().into())
    }

    /// Constant-time check of a proof the peer sent.
    fn verify(&self, secret: &[u8], label: &[u8], proof: &[u8]) -> Result<(), HandshakeError> {
        self.keyed_mac(secret, label)?.verify_slice(proof).map_err(|_| HandshakeError::BadProof)
    }
}

/// Checks the magic, version and purpose that open both the hello and the challenge.
fn check_preamble(bytes: &[u8], purpose: Purpose) -> Result<(), HandshakeError> {
    let [m0, m1, m2, m3, v0, v1, claimed_purpose, ..] = *bytes else {
        return Err(HandshakeError::NotRvod);
    };
    if [m0, m1, m2, m3] != MAGIC {
        return Err(HandshakeError::NotRvod);
    }
    let version = u16::from_be_bytes([v0, v1]);
    if version != VERSION {
        return Err(HandshakeError::Version(version));
    }
    if claimed_purpose != purpose as u8 {
        return Err(HandshakeError::WrongPurpose);
    }
    Ok(())
}

/// How both the hello and the challenge begin.
fn preamble_and_nonce(purpose: Purpose, nonce: &[u8; NONCE_LEN]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HELLO_HEADER_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_be_bytes());
    out.push(purpose as u8);
    out.extend_from_slice(nonce);
    out
}

/// The connecting side's protocol state.
struct ConnectorSide<'a> {
    secret: &'a [u8],
    transcript: Transcript,
}

impl<'a> ConnectorSide<'a> {
    /// Starts a handshake; returns the hello to send.
    fn start(secret: &'a [u8], purpose: Purpose, claim: &[u8]) -> Result<(Self, Vec<u8>), HandshakeError> {
        if claim.len() > MAX_CLAIM_LEN {
            return Err(HandshakeError::ClaimTooLong(claim.len()));
        }
        let transcript = Transcript {
            purpose,
            connector_nonce: fresh_nonce()?,
            acceptor_nonce: [0; NONCE_LEN],
            claim: claim.to_vec(),
        };
        let mut hello = preamble_and_nonce(purpose, &transcript.connector_nonce);
        hello.extend_from_slice(&(claim.len() as u16).to_be_bytes());
        hello.extend_from_slice(claim);
        Ok((ConnectorSide { secret, transcript }, hello))
    }

    /// Takes the acceptor's challenge; returns our proof.
    fn on_challenge(&mut self, challenge: &[u8; CHALLENGE_LEN]) -> Result<[u8; MAC_LEN], HandshakeError> {
        check_preamble(challenge, self.transcript.purpose)?;
        self.transcript.acceptor_nonce.copy_from_slice(&challenge[PREAMBLE_LEN..]);
        self.transcript.proof(self.secret, CONNECTOR_LABEL)
    }

    /// Checks the acceptor's proof and verdict.
    fn on_verdict(&self, verdict: &[u8; VERDICT_LEN]) -> Result<(), HandshakeError> {
        self.transcript.verify(self.secret, ACCEPTOR_LABEL, &verdict[..MAC_LEN])?;
        if verdict[MAC_LEN] == 1 {
            Ok(())
        } else {
            Err(HandshakeError::Unexpected)
        }
    }
}

/// The accepting side's protocol state.
struct AcceptorSide<'a> {
    secret: &'a [u8],
    transcript: Transcript,
}

impl<'a> AcceptorSide<'a> {
    fn new(secret: &'a [u8], purpose: Purpose) -> Self {
        AcceptorSide {
            secret,
            transcript: Transcript {
                purpose,
                connector_nonce: [0; NONCE_LEN],
                acceptor_nonce: [0; NONCE_LEN],
                claim: Vec::new(),
            },
        }
    }

    /// Takes the first bytes of the hello on their own, so a stranger speaking some other protocol is
    /// dropped at once instead of being waited for.
    fn on_preamble(&self, preamble: &[u8]) -> Result<(), HandshakeError> {
        check_preamble(preamble, self.transcript.purpose)
    }

    /// Takes the whole fixed part of the hello (its preamble already checked); returns the length of the
    /// claim that follows.
    fn on_hello_header(&mut self, header: &[u8; HELLO_HEADER_LEN]) -> Result<usize, HandshakeError> {
        self.transcript.connector_nonce.copy_from_slice(&header[PREAMBLE_LEN..PREAMBLE_LEN + NONCE_LEN]);
        let claim_len = u16::from_be_bytes([header[HELLO_HEADER_LEN - 2], header[HELLO_HEADER_LEN - 1]]) as usize;
        if claim_len > MAX_CLAIM_LEN {
            return Err(HandshakeError::ClaimTooLong(claim_len));
        }
        Ok(claim_len)
    }

    /// Takes the claim; returns the challenge to send.
    fn on_claim(&mut self, claim: Vec<u8>) -> Result<[u8; CHALLENGE_LEN], HandshakeError> {
        self.transcript.claim = claim;
        self.transcript.acceptor_nonce = fresh_nonce()?;
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge.copy_from_slice(&preamble_and_nonce(self.transcript.purpose, &self.transcript.acceptor_nonce));
        Ok(challenge)
    }

    /// Checks the connector's proof; on success the claim is authentic.
    fn on_proof(&self, proof: &[u8; MAC_LEN]) -> Result<&[u8], HandshakeError> {
        self.transcript.verify(self.secret, CONNECTOR_LABEL, proof)?;
        Ok(&self.transcript.claim)
    }

    /// Our proof and whether we keep the connection.
    fn verdict(&self, accepted: bool) -> Result<[u8; VERDICT_LEN], HandshakeError> {
        let mut verdict = [0u8; VERDICT_LEN];
        verdict[..MAC_LEN].copy_from_slice(&self.transcript.proof(self.secret, ACCEPTOR_LABEL)?);
        verdict[MAC_LEN] = u8::from(accepted);
        Ok(verdict)
    }

    fn into_claim(self) -> Vec<u8> {
        self.transcript.claim
    }
}

/// The instant `timeout` from now, for the deadlines this module takes. A timeout too long to represent
/// (say `Duration::MAX` for "wait forever") becomes about 136 years.
pub fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).or_else(|| now.checked_add(Duration::from_secs(u32::MAX.into()))).unwrap_or(now)
}

/// Arms the stream's timeouts with what is left until `deadline`.
fn arm(stream: &TcpStream, deadline: Instant) -> Result<(), HandshakeError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(HandshakeError::TimedOut);
    }
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))?;
    Ok(())
}

fn blocking_error(err: io::Error) -> HandshakeError {
    match err.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => HandshakeError::TimedOut,
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
            HandshakeError::Closed
        }
        _ => HandshakeError::Io(err),
    }
}

fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), HandshakeError> {
    let mut filled = 0;
    while filled < buf.len() {
        arm(stream, deadline)?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(HandshakeError::Closed),
            Ok(n) => filled += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(blocking_error(err)),
        }
    }
    Ok(())
}

fn write_by(stream: &mut TcpStream, bytes: &[u8], deadline: Instant) -> Result<(), HandshakeError> {
    arm(stream, deadline)?;
    stream.write_all(bytes).map_err(blocking_error)
}

/// Authenticates `stream` as the connecting side, claiming the identity `claim`.
///
/// Leaves the stream's read and write timeouts set; callers set their own afterwards.
pub fn connect(
    stream: &mut TcpStream,
    secret: &[u8],
    purpose: Purpose,
    claim: &[u8],
    deadline: Instant,
) -> Result<(), HandshakeError> {
    let (mut side, hello) = ConnectorSide::start(secret, purpose, claim)?;
    write_by(stream, &hello, deadline)?;
    let mut challenge = [0u8; CHALLENGE_LEN];
    read_by(stream, &mut challenge, deadline)?;
    let proof = side.on_challenge(&challenge)?;
    write_by(stream, &proof, deadline)?;
    let mut verdict = [0u8; VERDICT_LEN];
    match read_by(stream, &mut verdict, deadline) {
        // An acceptor that did not like our proof hangs up without a word.
        Err(HandshakeError::Closed) => return Err(HandshakeError::Rejected),
        other => other?,
    }
    side.on_verdict(&verdict)
}

/// Authenticates `stream` as the accepting side; `is_expected` decides whether the (authentic) claim is
/// welcome here. Returns the claim.
///
/// Leaves the stream's read and write timeouts set; callers set their own afterwards.
pub fn accept(
    stream: &mut TcpStream,
    secret: &[u8],
    purpose: Purpose,
    deadline: Instant,
    is_expected: impl FnOnce(&[u8]) -> bool,
) -> Result<Vec<u8>, HandshakeError> {
    let mut side = AcceptorSide::new(secret, purpose);
    let mut header = [0u8; HELLO_HEADER_LEN];
    let (preamble, rest) = header.split_at_mut(PREAMBLE_LEN);
    read_by(stream, preamble, deadline)?;
    side.on_preamble(preamble)?;
    read_by(stream, rest, deadline)?;
    let mut claim = vec![0u8; side.on_hello_header(&header)?];
    read_by(stream, &mut claim, deadline)?;
    let challenge = side.on_claim(claim)?;
    write_by(stream, &challenge, deadline)?;
    let mut proof = [0u8; MAC_LEN];
    read_by(stream, &mut proof, deadline)?;
    let accepted = is_expected(side.on_proof(&proof)?);
    write_by(stream, &side.verdict(accepted)?, deadline)?;
    if accepted {
        Ok(side.into_claim())
    } else {
        Err(HandshakeError::Unexpected)
    }
}

fn async_error(err: io::Error) -> HandshakeError {
    match err.kind() {
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
            HandshakeError::Closed
        }
        _ => HandshakeError::Io(err),
    }
}

/// [`accept`] for a tokio stream. It has no deadline of its own: wrap it in `tokio::time::timeout`.
pub async fn accept_async<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
    purpose: Purpose,
    is_expected: impl FnOnce(&[u8]) -> bool,
) -> Result<Vec<u8>, HandshakeError> {
    let mut side = AcceptorSide::new(secret, purpose);
    let mut header = [0u8; HELLO_HEADER_LEN];
    let (preamble, rest) = header.split_at_mut(PREAMBLE_LEN);
    stream.read_exact(preamble).await.map_err(async_error)?;
    side.on_preamble(preamble)?;
    stream.read_exact(rest).await.map_err(async_error)?;
    let mut claim = vec![0u8; side.on_hello_header(&header)?];
    stream.read_exact(&mut claim).await.map_err(async_error)?;
    let challenge = side.on_claim(claim)?;
    stream.write_all(&challenge).await.map_err(async_error)?;
    let mut proof = [0u8; MAC_LEN];
    stream.read_exact(&mut proof).await.map_err(async_error)?;
    let accepted = is_expected(side.on_proof(&proof)?);
    stream.write_all(&side.verdict(accepted)?).await.map_err(async_error)?;
    if accepted {
        Ok(side.into_claim())
    } else {
        Err(HandshakeError::Unexpected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::fuzz::{self, Target};
    use std::net::TcpListener;
    use std::thread;

    /// Runs the sans-IO sides against each other in memory.
    fn run_in_memory(
        connector_secret: &[u8],
        acceptor_secret: &[u8],
        claim: &[u8],
        expected: bool,
    ) -> (Result<(), HandshakeError>, Result<Vec<u8>, HandshakeError>) {
        let (mut connector, hello) = ConnectorSide::start(connector_secret, Purpose::Mesh, claim).unwrap();
        let mut acceptor = AcceptorSide::new(acceptor_secret, Purpose::Mesh);
        let header: [u8; HELLO_HEADER_LEN] = hello[..HELLO_HEADER_LEN].try_into().unwrap();
        acceptor.on_preamble(&header[..PREAMBLE_LEN]).unwrap();
        let claim_len = acceptor.on_hello_header(&header).unwrap();
        assert_eq!(claim_len, claim.len());
        let challenge = acceptor.on_claim(hello[HELLO_HEADER_LEN..].to_vec()).unwrap();
        let proof = connector.on_challenge(&challenge).unwrap();
        let claimed = match acceptor.on_proof(&proof) {
            Ok(claimed) => claimed.to_vec(),
            Err(err) => return (Err(HandshakeError::Rejected), Err(err)),
        };
        let verdict = acceptor.verdict(expected).unwrap();
        (connector.on_verdict(&verdict), Ok(claimed))
    }

    #[test]
    fn same_secret_authenticates_both_ways() {
        let (connector, acceptor) = run_in_memory(b"s3cret", b"s3cret", b"rank 3", true);
        connector.unwrap();
        assert_eq!(acceptor.unwrap(), b"rank 3");
    }

    #[test]
    fn wrong_secret_is_refused() {
        let (connector, acceptor) = run_in_memory(b"guess", b"s3cret", b"", true);
        assert!(matches!(connector, Err(HandshakeError::Rejected)));
        assert!(matches!(acceptor, Err(HandshakeError::BadProof)));
    }

    #[test]
    fn unexpected_claim_is_reported_to_connector() {
        let (connector, _) = run_in_memory(b"k", b"k", b"other scope", false);
        assert!(matches!(connector, Err(HandshakeError::Unexpected)));
    }

    #[test]
    fn forged_verdict_is_detected() {
        let (mut connector, _hello) = ConnectorSide::start(b"k", Purpose::Store, b"").unwrap();
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge[..7].copy_from_slice(&[b'R', b'V', b'O', b'D', 0, 1, Purpose::Store as u8]);
        connector.on_challenge(&challenge).unwrap();
        let mut verdict = [0u8; VERDICT_LEN];
        verdict[MAC_LEN] = 1;
        assert!(matches!(connector.on_verdict(&verdict), Err(HandshakeError::BadProof)));
    }

    #[test]
    fn malformed_hellos_are_refused() {
        let mut acceptor = AcceptorSide::new(b"k", Purpose::Store);
        assert!(matches!(acceptor.on_preamble(b"GET / H"), Err(HandshakeError::NotRvod)));
        assert!(matches!(acceptor.on_preamble(b"RVOD"), Err(HandshakeError::NotRvod)));
        assert!(matches!(acceptor.on_preamble(b"RVOD\x00\x09\x01"), Err(HandshakeError::Version(9))));
        assert!(matches!(acceptor.on_preamble(b"RVOD\x00\x01\x02"), Err(HandshakeError::WrongPurpose)));
        acceptor.on_preamble(b"RVOD\x00\x01\x01").unwrap();
        let mut header = [0u8; HELLO_HEADER_LEN];
        header[HELLO_HEADER_LEN - 2..].copy_from_slice(&u16::MAX.to_be_bytes());
        assert!(matches!(acceptor.on_hello_header(&header), Err(HandshakeError::ClaimTooLong(65535))));
        assert!(matches!(
            ConnectorSide::start(b"k", Purpose::Store, &[0; MAX_CLAIM_LEN + 1]),
            Err(HandshakeError::ClaimTooLong(_))
        ));
    }

    /// The acceptor fed `bytes` as everything the connector sends; true when it got as far as the proof.
    fn acceptor_reads(bytes: &[u8]) -> bool {
        let accepted = fuzz::ready(accept_async(&mut fuzz::Scripted(bytes), b"k", Purpose::Store, |_| true));
        matches!(accepted, Ok(_) | Err(HandshakeError::BadProof))
    }

    /// The connector's steps (as `connect` takes them) fed `bytes` as the acceptor's challenge and verdict;
    /// true when it took the challenge.
    fn connector_reads(bytes: &[u8]) -> bool {
        let (mut side, _hello) = ConnectorSide::start(b"k", Purpose::Store, b"claim").unwrap();
        let Some((challenge, rest)) = bytes.split_first_chunk::<CHALLENGE_LEN>() else { return false };
        if side.on_challenge(challenge).is_err() {
            return false;
        }
        if let Some(verdict) = rest.first_chunk::<VERDICT_LEN>() {
            assert!(side.on_verdict(verdict).is_err(), "a verdict made without the secret was taken");
        }
        true
    }

    fn acceptor_target() -> Target {
        let seeds = [&b""[..], b"rank 3", &[7u8; MAX_CLAIM_LEN]]
            .iter()
            .map(|claim| {
                let (_, mut hello) = ConnectorSide::start(b"k", Purpose::Store, claim).unwrap();
                hello[PREAMBLE_LEN..PREAMBLE_LEN + NONCE_LEN].fill(0x11); // the same seed every run
                hello.extend_from_slice(&[0x5a; MAC_LEN]);
                hello
            })
            .collect();
        Target { name: "handshake_acceptor", seeds, decode: acceptor_reads }
    }

    fn connector_target() -> Target {
        let mut seed = preamble_and_nonce(Purpose::Store, &[3; NONCE_LEN]);
        seed.extend_from_slice(&[0xa5; VERDICT_LEN]);
        Target { name: "handshake_connector", seeds: vec![seed], decode: connector_reads }
    }

    #[test]
    fn fuzz_short_handshake_acceptor() {
        fuzz::run(&acceptor_target(), fuzz::SHORT_RUN);
    }

    #[test]
    fn fuzz_short_handshake_connector() {
        fuzz::run(&connector_target(), fuzz::SHORT_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_handshake_acceptor() {
        fuzz::run(&acceptor_target(), fuzz::LONG_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_handshake_connector() {
        fuzz::run(&connector_target(), fuzz::LONG_RUN);
    }

    #[test]
    fn blocking_sides_over_tcp() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let deadline = Instant::now() + Duration::from_secs(5);
            accept(&mut stream, b"k", Purpose::Mesh, deadline, |claim| claim == b"me")
        });
        let mut stream = TcpStream::connect(addr).unwrap();
        connect(&mut stream, b"k", Purpose::Mesh, b"me", Instant::now() + Duration::from_secs(5)).unwrap();
        assert_eq!(acceptor.join().unwrap().unwrap(), b"me");
    }

    #[test]
    fn silent_peer_times_out_quickly() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let _silent = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut stream, _) = listener.accept().unwrap();
        let started = Instant::now();
        let result = accept(&mut stream, b"k", Purpose::Mesh, started + Duration::from_millis(200), |_| true);
        assert!(matches!(result, Err(HandshakeError::TimedOut)));
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn async_acceptor_talks_to_blocking_connector() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let connector = thread::spawn(move || {
            let mut stream = TcpStream::connect(addr).unwrap();
            connect(&mut stream, b"k", Purpose::Store, b"", Instant::now() + Duration::from_secs(5))
        });
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let claim = runtime.block_on(async {
            listener.set_nonblocking(true).unwrap();
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let (mut stream, _) = listener.accept().await.unwrap();
            accept_async(&mut stream, b"k", Purpose::Store, |_| true).await
        });
        assert_eq!(claim.unwrap(), b"");
        connector.join().unwrap().unwrap();
    }
}
