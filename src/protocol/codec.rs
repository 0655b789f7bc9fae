//! Wire codec for negotiation messages: a small hand-written little-endian binary format.
//!
//! [`WireWriter`] appends fixed-width integers, floats, flags and length-prefixed strings, byte strings
//! and sequences to a `Vec<u8>`; [`WireReader`] reads them back from a peer's bytes. Every read is
//! bounds-checked and fails with a [`DecodeError`]; every length prefix (a `u64`) is checked against the
//! bytes that remain *before* anything is allocated, so garbage input can neither panic nor cause a large
//! allocation. Types that cross the wire implement [`Wire`]; the top-level messages (see
//! [`crate::protocol::round`]) also implement [`WireMessage`], which frames them with
//! [`WIRE_MAGIC`], a [`MessageKind`] and [`PROTOCOL_VERSION`] so that a desynchronised stream or a peer
//! running another rvod version is reported as an error instead of being misread.
//!
//! Layout of a framed message: `magic: u32, kind: u8, version: u16, body`, with no bytes after the body.

use std::fmt;

use thiserror::Error;

use crate::error::ErrorKind;
use crate::protocol::message::{OpParams, Request, Response, ResponseEntry};
use crate::types::{CollectiveKind, Compression, DataType, ReduceOp};

/// First four bytes of every framed message: `b"RVOD"` read as a little-endian `u32`.
pub const WIRE_MAGIC: u32 = u32::from_le_bytes(*b"RVOD");

/// Version of this format; ranks speaking different versions refuse each other's messages.
pub const PROTOCOL_VERSION: u16 = 9;

/// Why a peer's bytes could not be decoded.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("negotiation message truncated: {what} needs {needed} bytes but only {remaining} remain")]
    Truncated { what: &'static str, needed: usize, remaining: usize },
    #[error("not an rvod negotiation message (magic {found:#010x}); the stream is out of step")]
    BadMagic { found: u32 },
    #[error(
        "peer speaks negotiation protocol version {found} but this rank speaks {expected}; \
         every rank must run the same rvod version"
    )]
    VersionMismatch { found: u16, expected: u16 },
    #[error("expected a {expected} message but got message kind {found}; the stream is out of step")]
    WrongKind { expected: MessageKind, found: u8 },
    #[error("invalid tag {tag} for {what}")]
    BadTag { what: &'static str, tag: u8 },
    #[error("unknown {what} code {code}")]
    BadEnumCode { what: &'static str, code: u16 },
    #[error("{what} is not valid UTF-8")]
    BadUtf8 { what: &'static str },
    #[error("{what} declares a length of {declared}, more than the {limit} the rest of the message can hold")]
    LengthOverLimit { what: &'static str, declared: u64, limit: u64 },
    #[error("{count} unexpected bytes after the end of the message")]
    TrailingBytes { count: usize },
}

/// Which top-level message a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum MessageKind {
    RoundHeader = 1,
    RequestList = 2,
    ResponseList = 3,
    RoundSummary = 4,
    GatheredRequests = 5,
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MessageKind::RoundHeader => "round header",
            MessageKind::RequestList => "request list",
            MessageKind::ResponseList => "response list",
            MessageKind::RoundSummary => "round summary",
            MessageKind::GatheredRequests => "gathered request lists",
        })
    }
}

/// A value with a wire encoding.
pub trait Wire: Sized {
    fn encode(&self, w: &mut WireWriter);
    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError>;
}

/// A top-level message: framed with magic, kind and version, and decoded from a whole buffer.
pub trait WireMessage: Wire {
    const KIND: MessageKind;

    /// The framed encoding of this message.
    fn to_bytes(&self) -> Vec<u8> {
        // Most messages are round headers of a few dozen bytes: one allocation, no regrowth.
        let mut w = WireWriter { buf: Vec::with_capacity(128) };
        Self::put_head(&mut w);
        self.encode(&mut w);
        w.into_bytes()
    }

    /// What precedes the body of a framed message: magic, kind and version.
    fn put_head(w: &mut WireWriter) {
        w.put_u32(WIRE_MAGIC);
        w.put_u8(Self::KIND as u8);
        w.put_u16(PROTOCOL_VERSION);
    }

    /// Decodes a framed message that must fill `bytes` exactly.
    fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = WireReader::new(bytes);
        let magic = r.u32("message magic")?;
        if magic != WIRE_MAGIC {
            return Err(DecodeError::BadMagic { found: magic });
        }
        let kind = r.u8("message kind")?;
        let version = r.u16("protocol version")?;
        if version != PROTOCOL_VERSION {
            return Err(DecodeError::VersionMismatch { found: version, expected: PROTOCOL_VERSION });
        }
        if kind != Self::KIND as u8 {
            return Err(DecodeError::WrongKind { expected: Self::KIND, found: kind });
        }
        let message = Self::decode(&mut r)?;
        r.finish()?;
        Ok(message)
    }
}

/// Appends values in wire format to a growing buffer.
#[derive(Debug, Default)]
pub struct WireWriter {
    buf: Vec<u8>,
}

impl WireWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// A writer appending to `buf` after clearing it (its allocation is reused).
    pub fn reusing(mut buf: Vec<u8>) -> Self {
        buf.clear();
        WireWriter { buf }
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    pub fn put_u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    pub fn put_u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn put_u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn put_u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn put_i32(&mut self, v: i32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn put_i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Bit-exact: NaN payloads and the sign of zero survive the round trip.
    pub fn put_f64(&mut self, v: f64) {
        self.put_u64(v.to_bits());
    }

    pub fn put_bool(&mut self, v: bool) {
        self.put_u8(u8::from(v));
    }

    /// A `u64` count followed by the raw bytes.
    pub fn put_bytes(&mut self, v: &[u8]) {
        self.put_len(v.len());
        self.buf.extend_from_slice(v);
    }

    pub fn put_str(&mut self, v: &str) {
        self.put_bytes(v.as_bytes());
    }

    pub fn put_i64s(&mut self, v: &[i64]) {
        self.put_len(v.len());
        for &x in v {
            self.put_i64(x);
        }
    }

    pub fn put_u64s(&mut self, v: &[u64]) {
        self.put_len(v.len());
        for &x in v {
            self.put_u64(x);
        }
    }

    /// A `u64` count followed by each item's encoding.
    pub fn put_seq<T: Wire>(&mut self, items: &[T]) {
        self.put_len(items.len());
        for item in items {
            item.encode(self);
        }
    }

    fn put_len(&mut self, len: usize) {
        // usize is at most 64 bits on every supported target, so this widening is lossless.
        self.put_u64(len as u64);
    }
}

/// Reads wire values from a peer's bytes; every read checks bounds first.
///
/// Each read takes `what`, the name of the field being read, for the error message.
#[derive(Debug)]
pub struct WireReader<'a> {
    rest: &'a [u8],
}

impl<'a> WireReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// Succeeds only if every byte was read.
    pub fn finish(self) -> Result<(), DecodeError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes { count: self.rest.len() })
        }
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(u8::from_le_bytes(self.array(what)?))
    }

    pub fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_le_bytes(self.array(what)?))
    }

    pub fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }

    pub fn f64(&mut self, what: &'static str) -> Result<f64, DecodeError> {
        Ok(f64::from_bits(self.u64(what)?))
    }

    pub fn bool(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            tag => Err(DecodeError::BadTag { what, tag }),
        }
    }

    pub fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let len = self.len_prefix(what, 1)?;
        self.take(len, what)
    }

    pub fn str(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let raw = self.bytes(what)?;
        std::str::from_utf8(raw).map(str::to_owned).map_err(|_| DecodeError::BadUtf8 { what })
    }

    pub fn i64s(&mut self, what: &'static str) -> Result<Vec<i64>, DecodeError> {
        let len = self.len_prefix(what, 8)?;
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            out.push(self.i64(what)?);
        }
        Ok(out)
    }

    pub fn u64s(&mut self, what: &'static str) -> Result<Vec<u64>, DecodeError> {
        let len = self.len_prefix(what, 8)?;
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            out.push(self.u64(what)?);
        }
        Ok(out)
    }

    /// A sequence written by [`WireWriter::put_seq`].
    pub fn seq<T: Wire>(&mut self, what: &'static str) -> Result<Vec<T>, DecodeError> {
        let len = self.len_prefix(what, 1)?;
        // No reservation: an item's in-memory size can be far larger than its wire size, so the vector
        // grows only as items are actually decoded (each consumes at least one byte of input).
        let mut out = Vec::new();
        for _ in 0..len {
            out.push(T::decode(self)?);
        }
        Ok(out)
    }

    /// Reads a `u64` count of items of at least `min_item_bytes` each and checks it against the input left.
    fn len_prefix(&mut self, what: &'static str, min_item_bytes: usize) -> Result<usize, DecodeError> {
        let declared = self.u64(what)?;
        let limit = self.rest.len() / min_item_bytes.max(1);
        match usize::try_from(declared) {
            Ok(len) if len <= limit => Ok(len),
            _ => Err(DecodeError::LengthOverLimit { what, declared, limit: limit as u64 }),
        }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if n > self.rest.len() {
            return Err(DecodeError::Truncated { what, needed: n, remaining: self.rest.len() });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }
}

impl Wire for DataType {
    fn encode(&self, w: &mut WireWriter) {
        w.put_u8(self.code());
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let code = r.u8("dtype")?;
        DataType::from_code(code).ok_or(DecodeError::BadEnumCode { what: "dtype", code: code.into() })
    }
}

impl Wire for ReduceOp {
    fn encode(&self, w: &mut WireWriter) {
        w.put_u8(self.code());
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let code = r.u8("reduce op")?;
        ReduceOp::from_code(code).ok_or(DecodeError::BadEnumCode { what: "reduce op", code: code.into() })
    }
}

impl Wire for Compression {
    fn encode(&self, w: &mut WireWriter) {
        w.put_u16(self.code());
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let code = r.u16("compression")?;
        Compression::from_code(code).ok_or(DecodeError::BadEnumCode { what: "compression", code })
    }
}

impl Wire for CollectiveKind {
    fn encode(&self, w: &mut WireWriter) {
        w.put_u8(self.code());
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let code = r.u8("collective kind")?;
        CollectiveKind::from_code(code).ok_or(DecodeError::BadEnumCode { what: "collective kind", code: code.into() })
    }
}

impl Wire for ErrorKind {
    fn encode(&self, w: &mut WireWriter) {
        w.put_u8(*self as u8);
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let code = r.u8("error kind")?;
        ErrorKind::from_code(code).ok_or(DecodeError::BadEnumCode { what: "error kind", code: code.into() })
    }
}

/// A request's fields in wire order: its parameters around its name, as the format has always had them.
impl Wire for Request {
    fn encode(&self, w: &mut WireWriter) {
        let p = &self.params;
        w.put_u32(self.rank);
        p.kind.encode(w);
        w.put_str(&self.name);
        p.dtype.encode(w);
        w.put_i64s(&p.shape);
        p.reduce_op.encode(w);
        w.put_i32(p.root_rank);
        w.put_f64(p.prescale);
        w.put_f64(p.postscale);
        w.put_i64s(&p.splits);
        w.put_i64s(&p.parts);
        w.put_i32(p.device);
        p.compression.encode(w);
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let rank = r.u32("request rank")?;
        let kind = CollectiveKind::decode(r)?;
        let name = r.str("request tensor name")?;
        let params = OpParams {
            kind,
            dtype: DataType::decode(r)?,
            shape: r.i64s("request shape")?,
            reduce_op: ReduceOp::decode(r)?,
            root_rank: r.i32("request root rank")?,
            prescale: r.f64("request prescale")?,
            postscale: r.f64("request postscale")?,
            splits: r.i64s("request splits")?,
            parts: r.i64s("request group parts")?,
            device: r.i32("request device")?,
            compression: Compression::decode(r)?,
        };
        Ok(Request { rank, name, params })
    }
}

impl Wire for ResponseEntry {
    fn encode(&self, w: &mut WireWriter) {
        w.put_str(&self.name);
        w.put_i64s(&self.shape);
        w.put_i64s(&self.per_rank);
        w.put_bool(self.packed);
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        Ok(ResponseEntry {
            name: r.str("response tensor name")?,
            shape: r.i64s("response shape")?,
            per_rank: r.i64s("response per-rank sizes")?,
            packed: r.bool("response packed flag")?,
        })
    }
}

impl Wire for Response {
    fn encode(&self, w: &mut WireWriter) {
        self.kind.encode(w);
        w.put_seq(&self.entries);
        self.dtype.encode(w);
        self.reduce_op.encode(w);
        w.put_i32(self.root_rank);
        w.put_f64(self.prescale);
        w.put_f64(self.postscale);
        match &self.error {
            None => w.put_u8(0),
            Some((kind, message)) => {
                w.put_u8(1);
                kind.encode(w);
                w.put_str(message);
            }
        }
        w.put_i32(self.last_joined_rank);
        w.put_bool(self.on_gpu);
        self.compression.encode(w);
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let kind = CollectiveKind::decode(r)?;
        let entries = r.seq("response entries")?;
        let dtype = DataType::decode(r)?;
        let reduce_op = ReduceOp::decode(r)?;
        let root_rank = r.i32("response root rank")?;
        let prescale = r.f64("response prescale")?;
        let postscale = r.f64("response postscale")?;
        let error = match r.u8("response error flag")? {
            0 => None,
            1 => Some((ErrorKind::decode(r)?, r.str("response error message")?)),
            tag => return Err(DecodeError::BadTag { what: "response error flag", tag }),
        };
        let last_joined_rank = r.i32("response last joined rank")?;
        let on_gpu = r.bool("response GPU flag")?;
        let compression = Compression::decode(r)?;
        Ok(Response {
            kind,
            entries,
            dtype,
            reduce_op,
            root_rank,
            prescale,
            postscale,
            error,
            last_joined_rank,
            on_gpu,
            compression,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_compression() -> impl Strategy<Value = Compression> {
        prop_oneof![
            Just(Compression::None),
            Just(Compression::Int8),
            Just(Compression::OneBit),
            (1u8..=255).prop_map(|rank| Compression::PowerSgd { rank }),
        ]
    }

    pub(crate) fn arb_request() -> impl Strategy<Value = Request> {
        let fields = (
            any::<u32>(),
            0u8..7,
            ".{0,12}",
            0u8..10,
            prop::collection::vec(any::<i64>(), 0..4),
            0u8..6,
            any::<i32>(),
            any::<f64>(),
            any::<f64>(),
            prop::collection::vec(any::<i64>(), 0..4),
            prop::collection::vec(any::<i64>(), 0..6),
            -1i32..8,
        );
        (fields, arb_compression()).prop_map(
            |(
                (rank, kind, name, dtype, shape, op, root_rank, prescale, postscale, splits, parts, device),
                compression,
            )| Request {
                rank,
                name,
                params: OpParams {
                    kind: CollectiveKind::from_code(kind).unwrap(),
                    dtype: DataType::from_code(dtype).unwrap(),
                    shape,
                    reduce_op: ReduceOp::from_code(op).unwrap(),
                    root_rank,
                    prescale,
                    postscale,
                    splits,
                    parts,
                    device,
                    compression,
                },
            },
        )
    }

    fn arb_entry() -> impl Strategy<Value = ResponseEntry> {
        (".{0,12}", prop::collection::vec(any::<i64>(), 0..4), prop::collection::vec(any::<i64>(), 0..5), any::<bool>())
            .prop_map(|(name, shape, per_rank, packed)| ResponseEntry { name, shape, per_rank, packed })
    }

    pub(crate) fn arb_response() -> impl Strategy<Value = Response> {
        let fields = (
            0u8..7,
            prop::collection::vec(arb_entry(), 0..4),
            0u8..10,
            0u8..6,
            any::<i32>(),
            any::<f64>(),
            any::<f64>(),
            prop::option::of((0u8..2, ".{0,20}")),
            any::<i32>(),
            any::<bool>(),
        );
        (fields, arb_compression()).prop_map(
            |(
                (kind, entries, dtype, op, root_rank, prescale, postscale, error, last_joined_rank, on_gpu),
                compression,
            )| {
                Response {
                    kind: CollectiveKind::from_code(kind).unwrap(),
                    entries,
                    dtype: DataType::from_code(dtype).unwrap(),
                    reduce_op: ReduceOp::from_code(op).unwrap(),
                    root_rank,
                    prescale,
                    postscale,
                    error: error.map(|(k, m)| (ErrorKind::from_code(k).unwrap(), m)),
                    last_joined_rank,
                    on_gpu,
                    compression,
                }
            },
        )
    }

    fn encode<T: Wire>(value: &T) -> Vec<u8> {
        let mut w = WireWriter::new();
        value.encode(&mut w);
        w.into_bytes()
    }

    fn decode_all<T: Wire>(bytes: &[u8]) -> Result<T, DecodeError> {
        let mut r = WireReader::new(bytes);
        let value = T::decode(&mut r)?;
        r.finish()?;
        Ok(value)
    }

    /// Compares through the encoding, so NaN fields compare bit-exactly.
    fn assert_roundtrip<T: Wire>(value: &T) {
        let bytes = encode(value);
        let decoded: T = decode_all(&bytes).unwrap();
        assert_eq!(encode(&decoded), bytes);
    }

    fn sample_request() -> Request {
        Request {
            rank: 3,
            name: "grad.fc1".into(),
            params: OpParams {
                kind: CollectiveKind::Allreduce,
                dtype: DataType::Float32,
                shape: vec![4, 5],
                reduce_op: ReduceOp::Sum,
                root_rank: -1,
                prescale: 1.0,
                postscale: 0.5,
                splits: vec![],
                parts: vec![],
                device: -1,
                compression: Compression::PowerSgd { rank: 4 },
            },
        }
    }

    proptest! {
        #[test]
        fn request_roundtrips(req in arb_request()) {
            assert_roundtrip(&req);
        }

        #[test]
        fn response_roundtrips(resp in arb_response()) {
            assert_roundtrip(&resp);
        }

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_all::<Request>(&bytes);
            let _ = decode_all::<Response>(&bytes);
        }

        #[test]
        fn every_truncation_is_an_error(resp in arb_response()) {
            let bytes = encode(&resp);
            for cut in 0..bytes.len() {
                prop_assert!(decode_all::<Response>(&bytes[..cut]).is_err());
            }
        }
    }

    #[test]
    fn finite_values_roundtrip_equal() {
        let req = sample_request();
        assert_eq!(decode_all::<Request>(&encode(&req)).unwrap(), req);
    }

    #[test]
    fn huge_length_prefix_is_rejected_before_allocating() {
        for declared in [u64::MAX, u64::from(u32::MAX), 1 << 40, 9] {
            let mut w = WireWriter::new();
            w.put_u64(declared);
            w.put_u64(0);
            let bytes = w.into_bytes();
            let err = WireReader::new(&bytes).i64s("shape").unwrap_err();
            assert!(matches!(err, DecodeError::LengthOverLimit { declared: d, limit: 1, .. } if d == declared));
            let err = WireReader::new(&bytes).seq::<Request>("requests").unwrap_err();
            assert!(matches!(err, DecodeError::LengthOverLimit { .. }));
            assert!(WireReader::new(&bytes).str("name").is_err());
        }
    }

    #[test]
    fn bad_codes_and_tags_are_reported() {
        let mut bytes = encode(&sample_request());
        bytes[4] = 99; // collective kind follows the u32 rank
        assert_eq!(
            decode_all::<Request>(&bytes).unwrap_err(),
            DecodeError::BadEnumCode { what: "collective kind", code: 99 }
        );
        assert_eq!(WireReader::new(&[2]).bool("flag").unwrap_err(), DecodeError::BadTag { what: "flag", tag: 2 });
    }

    #[test]
    fn invalid_utf8_is_reported() {
        let mut w = WireWriter::new();
        w.put_bytes(&[0xff, 0xfe]);
        let bytes = w.into_bytes();
        assert_eq!(WireReader::new(&bytes).str("name").unwrap_err(), DecodeError::BadUtf8 { what: "name" });
    }

    #[test]
    fn trailing_bytes_are_reported() {
        let mut bytes = encode(&sample_request());
        bytes.push(0);
        assert_eq!(decode_all::<Request>(&bytes).unwrap_err(), DecodeError::TrailingBytes { count: 1 });
    }

    #[test]
    fn errors_read_well() {
        let err = DecodeError::Truncated { what: "request shape", needed: 8, remaining: 3 };
        assert_eq!(err.to_string(), "negotiation message truncated: request shape needs 8 bytes but only 3 remain");
    }
}
