//! The three messages of one negotiation round and their framed wire encodings.
//!
//! 1. Every rank sends every other rank a [`RoundHeader`]: its status flags and which response-cache
//!    bits it hit or found invalid. Each rank ANDs the hit sets and ORs the invalid sets locally, so all
//!    ranks reach the same verdict without a coordinator. With autotune on, the coordinator's header may
//!    carry the values every rank applies when the round ends (see [`crate::autotune`]).
//! 2. If any rank has uncached requests, workers send the coordinator a [`RequestList`].
//! 3. The coordinator answers every rank with the same [`ResponseList`].
//!
//! All three are [`WireMessage`]s: framed with magic, kind and protocol version (see
//! [`crate::protocol::codec`]), so the protocol version lives in the frame, not in the structs.

use crate::protocol::bitset::BitSet;
use crate::protocol::codec::{DecodeError, MessageKind, Wire, WireMessage, WireReader, WireWriter};
use crate::protocol::message::{Request, Response};
use crate::protocol::tuned::TunedValues;

const FLAG_SHUTDOWN: u8 = 1;
const FLAG_HAS_UNCACHED: u8 = 1 << 1;
const FLAG_JOINED: u8 = 1 << 2;
/// With FLAG_SHUTDOWN: the process is exiting without having called shutdown().
const FLAG_EXITING: u8 = 1 << 3;
/// With FLAG_SHUTDOWN: the process set is being removed (remove_process_set()).
const FLAG_REMOVING: u8 = 1 << 4;
/// The coordinator's header carries the autotuner's next values ([`TunedValues`]).
const FLAG_TUNED: u8 = 1 << 5;
const KNOWN_FLAGS: u8 = FLAG_SHUTDOWN | FLAG_HAS_UNCACHED | FLAG_JOINED | FLAG_EXITING | FLAG_REMOVING | FLAG_TUNED;

/// Why a rank stops a communicator; the other ranks' errors say which.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The script called shutdown().
    Shutdown,
    /// The process is ending without shutdown() (its script finished or raised): the exit handler stops it.
    Exiting,
    /// The process set was removed with remove_process_set().
    Removed,
}

/// What a rank tells every other rank at the start of a round.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoundHeader {
    /// This rank asked for a coordinated stop, and why.
    pub shutdown: Option<StopReason>,
    /// This rank has requests that missed the cache (or are never cached), so the round needs the slow path.
    pub has_uncached: bool,
    /// This rank has called join (it reports hits on every cached bit).
    pub joined: bool,
    /// Cache bits of this rank's requests that hit.
    pub cache_hits: BitSet,
    /// Cache bits this rank found invalid (same name, different parameters); every rank erases them.
    pub invalid: BitSet,
    /// The data of small cached allreduces, sent along with the header (ascending cache bit): when every
    /// rank sent its data for a tensor that all ranks hit, each reduces locally and no data round is needed.
    pub eager: Vec<EagerPayload>,
    /// From the coordinator with autotune on: values every rank applies when this round ends.
    pub tuned: Option<TunedValues>,
}

/// One tensor's data riding in a round header.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EagerPayload {
    pub bit: u64,
    pub data: Vec<u8>,
}

impl EagerPayload {
    fn encode_borrowed(w: &mut WireWriter, bit: u64, data: &[u8]) {
        w.put_u64(bit);
        w.put_bytes(data);
    }
}

impl Wire for EagerPayload {
    fn encode(&self, w: &mut WireWriter) {
        EagerPayload::encode_borrowed(w, self.bit, &self.data);
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        Ok(EagerPayload { bit: r.u64("eager payload bit")?, data: r.bytes("eager payload data")?.to_vec() })
    }
}

impl RoundHeader {
    pub fn has_invalid(&self) -> bool {
        !self.invalid.is_empty()
    }

    /// The header of a rank whose only news is the cache hit `bit`, with `data` riding along when given.
    pub fn single_hit(bit: usize, data: Option<&[u8]>) -> RoundHeader {
        RoundHeader {
            cache_hits: std::iter::once(bit).collect(),
            eager: data.map(|data| EagerPayload { bit: bit as u64, data: data.to_vec() }).into_iter().collect(),
            ..RoundHeader::default()
        }
    }

    /// Write the body of [`single_hit`](Self::single_hit)`(bit, data)` as `encode` would, without building
    /// the header (the fast lane, `engine::fast_lane`, sends it on every op).
    pub fn encode_single_hit(w: &mut WireWriter, bit: usize, data: Option<&[u8]>) {
        w.put_u8(0);
        BitSet::encode_single(w, bit);
        BitSet::new().encode(w);
        match data {
            Some(data) => {
                w.put_u64(1);
                EagerPayload::encode_borrowed(w, bit as u64, data);
            }
            None => w.put_u64(0),
        }
    }
}

/// A worker's requests for the coordinator.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestList {
    pub requests: Vec<Request>,
    /// How long each request had been waiting on its rank when sent, in milliseconds (a cache hit that
    /// stalled reaches the coordinator late; its stall time still counts from its submission).
    pub waited_ms: Vec<i64>,
}

/// The coordinator's decision, identical on every rank: run these responses in this order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResponseList {
    pub responses: Vec<Response>,
    /// Every rank leaves the background loop after running `responses`.
    pub shutdown: bool,
}

impl Wire for RoundHeader {
    fn encode(&self, w: &mut WireWriter) {
        let mut flags = match self.shutdown {
            None => 0,
            Some(StopReason::Shutdown) => FLAG_SHUTDOWN,
            Some(StopReason::Exiting) => FLAG_SHUTDOWN | FLAG_EXITING,
            Some(StopReason::Removed) => FLAG_SHUTDOWN | FLAG_REMOVING,
        };
        if self.has_uncached {
            flags |= FLAG_HAS_UNCACHED;
        }
        if self.joined {
            flags |= FLAG_JOINED;
        }
        if self.tuned.is_some() {
            flags |= FLAG_TUNED;
        }
        w.put_u8(flags);
        self.cache_hits.encode(w);
        self.invalid.encode(w);
        w.put_seq(&self.eager);
        if let Some(tuned) = &self.tuned {
            tuned.encode(w);
        }
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let flags = r.u8("round header flags")?;
        if flags & !KNOWN_FLAGS != 0 {
            return Err(DecodeError::BadTag { what: "round header flags", tag: flags });
        }
        let shutdown = match (flags & FLAG_SHUTDOWN != 0, flags & (FLAG_EXITING | FLAG_REMOVING)) {
            (false, 0) => None,
            (true, 0) => Some(StopReason::Shutdown),
            (true, FLAG_EXITING) => Some(StopReason::Exiting),
            (true, FLAG_REMOVING) => Some(StopReason::Removed),
            _ => return Err(DecodeError::BadTag { what: "round header flags", tag: flags }),
        };
        Ok(RoundHeader {
            shutdown,
            has_uncached: flags & FLAG_HAS_UNCACHED != 0,
            joined: flags & FLAG_JOINED != 0,
            cache_hits: BitSet::decode(r)?,
            invalid: BitSet::decode(r)?,
            eager: r.seq("eager payloads")?,
            tuned: if flags & FLAG_TUNED != 0 { Some(TunedValues::decode(r)?) } else { None },
        })
    }
}

impl WireMessage for RoundHeader {
    const KIND: MessageKind = MessageKind::RoundHeader;
}

impl Wire for RequestList {
    fn encode(&self, w: &mut WireWriter) {
        w.put_seq(&self.requests);
        w.put_i64s(&self.waited_ms);
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        Ok(RequestList { requests: r.seq("requests")?, waited_ms: r.i64s("request waiting times")? })
    }
}

impl WireMessage for RequestList {
    const KIND: MessageKind = MessageKind::RequestList;
}

impl Wire for ResponseList {
    fn encode(&self, w: &mut WireWriter) {
        w.put_seq(&self.responses);
        w.put_bool(self.shutdown);
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        Ok(ResponseList { responses: r.seq("responses")?, shutdown: r.bool("response list shutdown flag")? })
    }
}

impl WireMessage for ResponseList {
    const KIND: MessageKind = MessageKind::ResponseList;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::codec::tests::{arb_request, arb_response};
    use crate::protocol::codec::{PROTOCOL_VERSION, WIRE_MAGIC};
    use crate::protocol::fuzz::{self, decodes_stably, samples, Target};
    use proptest::prelude::*;

    fn arb_bitset() -> impl Strategy<Value = BitSet> {
        prop::collection::vec(0usize..300, 0..20).prop_map(|bits| bits.into_iter().collect())
    }

    fn arb_header() -> impl Strategy<Value = RoundHeader> {
        let eager = prop::collection::vec(
            (any::<u64>(), prop::collection::vec(any::<u8>(), 0..16))
                .prop_map(|(bit, data)| EagerPayload { bit, data }),
            0..4,
        );
        let reason = prop_oneof![
            Just(None),
            Just(Some(StopReason::Shutdown)),
            Just(Some(StopReason::Exiting)),
            Just(Some(StopReason::Removed)),
        ];
        let tuned = prop::option::of((any::<u32>(), any::<u32>(), any::<bool>(), 0u8..3, 0u8..3).prop_map(
            |(f, c, cache, ar, ag)| {
                let choice = |c: u8| [None, Some(false), Some(true)][c as usize];
                TunedValues {
                    fusion_threshold: f as usize,
                    cycle_time: std::time::Duration::from_micros(c as u64),
                    cache_enabled: cache,
                    hierarchical_allreduce: choice(ar),
                    hierarchical_allgather: choice(ag),
                }
            },
        ));
        (reason, any::<bool>(), any::<bool>(), arb_bitset(), arb_bitset(), eager, tuned).prop_map(
            |(shutdown, has_uncached, joined, cache_hits, invalid, eager, tuned)| RoundHeader {
                shutdown,
                has_uncached,
                joined,
                cache_hits,
                invalid,
                eager,
                tuned,
            },
        )
    }

    fn arb_request_list() -> impl Strategy<Value = RequestList> {
        (prop::collection::vec(arb_request(), 0..4), prop::collection::vec(0i64..1_000_000, 0..4))
            .prop_map(|(requests, waited_ms)| RequestList { requests, waited_ms })
    }

    fn arb_response_list() -> impl Strategy<Value = ResponseList> {
        (prop::collection::vec(arb_response(), 0..4), any::<bool>())
            .prop_map(|(responses, shutdown)| ResponseList { responses, shutdown })
    }

    /// Decodes and re-encodes: equal bytes means equal messages, NaN scale factors included.
    fn assert_roundtrip<M: WireMessage>(message: &M) {
        let bytes = message.to_bytes();
        let decoded = M::from_bytes(&bytes).unwrap();
        assert_eq!(decoded.to_bytes(), bytes);
    }

    fn assert_every_truncation_fails<M: WireMessage>(message: &M) {
        let bytes = message.to_bytes();
        for cut in 0..bytes.len() {
            assert!(M::from_bytes(&bytes[..cut]).is_err(), "prefix of {cut} bytes decoded");
        }
    }

    proptest! {
        #[test]
        fn round_header_roundtrips(header in arb_header()) {
            prop_assert_eq!(RoundHeader::from_bytes(&header.to_bytes()).unwrap(), header.clone());
            assert_every_truncation_fails(&header);
        }

        #[test]
        fn request_list_roundtrips(list in arb_request_list()) {
            assert_roundtrip(&list);
            assert_every_truncation_fails(&list);
        }

        #[test]
        fn response_list_roundtrips(list in arb_response_list()) {
            assert_roundtrip(&list);
            assert_every_truncation_fails(&list);
        }

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = RoundHeader::from_bytes(&bytes);
            let _ = RequestList::from_bytes(&bytes);
            let _ = ResponseList::from_bytes(&bytes);
        }

        #[test]
        fn random_bodies_behind_a_valid_frame_never_panic(body in prop::collection::vec(any::<u8>(), 0..512)) {
            for kind in [MessageKind::RoundHeader, MessageKind::RequestList, MessageKind::ResponseList] {
                let mut w = WireWriter::new();
                w.put_u32(WIRE_MAGIC);
                w.put_u8(kind as u8);
                w.put_u16(PROTOCOL_VERSION);
                let mut bytes = w.into_bytes();
                bytes.extend_from_slice(&body);
                let _ = RoundHeader::from_bytes(&bytes);
                let _ = RequestList::from_bytes(&bytes);
                let _ = ResponseList::from_bytes(&bytes);
            }
        }
    }

    proptest! {
        #[test]
        fn a_single_hit_encodes_as_the_header_it_stands_for(
            bit in 0usize..1000,
            data in prop::option::of(prop::collection::vec(any::<u8>(), 0..64)),
        ) {
            let mut w = WireWriter::new();
            RoundHeader::put_head(&mut w);
            RoundHeader::encode_single_hit(&mut w, bit, data.as_deref());
            let header = RoundHeader::single_hit(bit, data.as_deref());
            prop_assert_eq!(w.into_bytes(), header.to_bytes());
        }
    }

    #[test]
    fn frame_errors_are_detected() {
        let bytes = RoundHeader::default().to_bytes();

        let mut bad_magic = bytes.clone();
        bad_magic[0] ^= 0xff;
        assert!(matches!(RoundHeader::from_bytes(&bad_magic), Err(DecodeError::BadMagic { .. })));

        assert_eq!(
            RequestList::from_bytes(&bytes).unwrap_err(),
            DecodeError::WrongKind { expected: MessageKind::RequestList, found: MessageKind::RoundHeader as u8 }
        );

        let mut future = bytes.clone();
        future[5..7].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
        assert_eq!(
            RoundHeader::from_bytes(&future).unwrap_err(),
            DecodeError::VersionMismatch { found: PROTOCOL_VERSION + 1, expected: PROTOCOL_VERSION }
        );

        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(RoundHeader::from_bytes(&trailing).unwrap_err(), DecodeError::TrailingBytes { count: 1 });

        let mut unknown_flag = bytes;
        unknown_flag[7] = 0x80;
        assert!(matches!(RoundHeader::from_bytes(&unknown_flag), Err(DecodeError::BadTag { .. })));
    }

    #[test]
    fn huge_sequence_length_is_rejected() {
        let mut w = WireWriter::new();
        w.put_u32(WIRE_MAGIC);
        w.put_u8(MessageKind::ResponseList as u8);
        w.put_u16(PROTOCOL_VERSION);
        w.put_u64(u64::MAX);
        w.put_bool(false);
        assert!(matches!(
            ResponseList::from_bytes(&w.into_bytes()),
            Err(DecodeError::LengthOverLimit { declared: u64::MAX, .. })
        ));
    }

    fn round_header_target() -> Target {
        let mut seeds: Vec<Vec<u8>> = samples(arb_header(), 12).iter().map(RoundHeader::to_bytes).collect();
        seeds.push(RoundHeader::default().to_bytes());
        // What the fast lane sends: single-hit headers (coordinator::negotiation::frame_single_hit, unframed).
        for (bit, data) in [(0, None), (5, Some(&[1u8, 2, 3, 4][..])), (130, Some(&[9u8; 16][..]))] {
            let mut w = WireWriter::new();
            RoundHeader::put_head(&mut w);
            RoundHeader::encode_single_hit(&mut w, bit, data);
            seeds.push(w.into_bytes());
        }
        Target { name: "round_header", seeds, decode: decodes_stably::<RoundHeader> }
    }

    fn request_list_target() -> Target {
        let mut seeds: Vec<Vec<u8>> = samples(arb_request_list(), 12).iter().map(RequestList::to_bytes).collect();
        seeds.push(RequestList::default().to_bytes());
        Target { name: "request_list", seeds, decode: decodes_stably::<RequestList> }
    }

    fn response_list_target() -> Target {
        let mut seeds: Vec<Vec<u8>> = samples(arb_response_list(), 12).iter().map(ResponseList::to_bytes).collect();
        seeds.push(ResponseList::default().to_bytes());
        Target { name: "response_list", seeds, decode: decodes_stably::<ResponseList> }
    }

    #[test]
    fn fuzz_short_round_header() {
        fuzz::run(&round_header_target(), fuzz::SHORT_RUN);
    }

    #[test]
    fn fuzz_short_request_list() {
        fuzz::run(&request_list_target(), fuzz::SHORT_RUN);
    }

    #[test]
    fn fuzz_short_response_list() {
        fuzz::run(&response_list_target(), fuzz::SHORT_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_round_header() {
        fuzz::run(&round_header_target(), fuzz::LONG_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_request_list() {
        fuzz::run(&request_list_target(), fuzz::LONG_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_response_list() {
        fuzz::run(&response_list_target(), fuzz::LONG_RUN);
    }

    #[test]
    fn has_invalid_follows_the_invalid_set() {
        let mut header = RoundHeader::default();
        assert!(!header.has_invalid());
        header.invalid.insert(3);
        assert!(header.has_invalid());
    }
}
