//! Block codecs of the quantized allreduce. A buffer of float32 values is cut into blocks ([`BLOCK`] values
//! for int8, [`ONEBIT_BLOCK`] for 1-bit; the last may be shorter); each block is sent as its float32 scale
//! (native-endian, 4 bytes) and then its payload:
//!
//! - int8: one signed byte per value, `value / scale` rounded half away from zero, with
//!   `scale = max |value| / 127`, so each value comes back within half a step (`scale / 2`) of what it was;
//! - 1-bit: one bit per value (set for `value >= 0`, first value in the lowest bit), with `scale` the root mean
//!   square of the block; every value comes back as `+scale` or `-scale`, so the block comes back with the
//!   length (L2 norm) it had, as DeepSpeed's 1-bit compression scales its chunks. The mean magnitude, which
//!   makes each step's error smallest, sends less than the block each step and leaves error feedback more to
//!   send later; at a large learning rate with momentum that delay cost the benchmark's MLP 8-10 points of
//!   accuracy (docs/compression.md).
//!
//! Encoding also yields the residual `value - decoded`, what error feedback carries to the next step. A
//! block holding a NaN or an infinity decodes to NaN throughout (its scale is not finite), as an
//! uncompressed sum with one would.
//!
//! [`Codec::Float32`] is no compression: the values as they are, 4 bytes each and no scale (the residual is
//! zero), for the tensors the allreduce does not compress (see `quantized`).

/// Values per int8 block, and the unit the allreduce cuts a buffer into chunks by (a multiple of every
/// codec's block).
pub const BLOCK: usize = 256;
/// Values per 1-bit block: small, because a value much larger than the rest of its block is sent at the
/// block's scale until its residual has grown large enough (error feedback's memory).
pub const ONEBIT_BLOCK: usize = 32;
const SCALE_BYTES: usize = 4;

/// A block codec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Int8,
    OneBit,
    /// The values as they are (no compression).
    Float32,
}

impl Codec {
    /// The codec the reduced sums travel in: int8 for both compressing codecs (a sum of 1-bit values
    /// re-encoded as signs loses what error feedback then needs many steps to send); float32 stays float32.
    pub fn for_sums(self) -> Codec {
        match self {
            Codec::Float32 => Codec::Float32,
            Codec::Int8 | Codec::OneBit => Codec::Int8,
        }
    }

    /// Values per block.
    #[inline(always)]
    pub fn block(self) -> usize {
        match self {
            Codec::Int8 | Codec::Float32 => BLOCK,
            Codec::OneBit => ONEBIT_BLOCK,
        }
    }

    #[inline(always)]
    fn payload_bytes(self, values: usize) -> usize {
        match self {
            Codec::Int8 => values,
            Codec::OneBit => values.div_ceil(8),
            Codec::Float32 => values * 4,
        }
    }

    /// Bytes of `values` values encoded.
    pub fn encoded_len(self, values: usize) -> usize {
        if self == Codec::Float32 {
            return values * 4;
        }
        let block = self.block();
        let (full, rest) = (values / block, values % block);
        let last = if rest > 0 { SCALE_BYTES + self.payload_bytes(rest) } else { 0 };
        full * (SCALE_BYTES + self.payload_bytes(block)) + last
    }

    /// Encode `values` into `out` (`encoded_len(values.len())` bytes) and write `value - decoded` into
    /// `residual` (as long as `values`).
    pub fn encode(self, values: &[f32], out: &mut [u8], residual: &mut [f32]) {
        if self == Codec::Float32 {
            out.copy_from_slice(crate::ring::compressed::f32_bytes(values));
            residual.fill(0.0);
            return;
        }
        encode_blocks(self, values, out, residual);
    }

    /// Add the values `bytes` encodes to `out` (as many values as `out` holds).
    pub fn decode_add(self, bytes: &[u8], out: &mut [f32]) {
        if self == Codec::Float32 {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o += f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            }
            return;
        }
        decode_blocks(self, bytes, out, true);
    }

    /// Write the values `bytes` encodes into `out` (as many values as `out` holds).
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        if self == Codec::Float32 {
            let len = out.len() * 4;
            crate::ring::compressed::f32_bytes_mut(out).copy_from_slice(&bytes[..len]);
            return;
        }
        decode_blocks(self, bytes, out, false);
    }

    #[inline(always)]
    fn decode_block(self, scale: f32, payload: &[u8], out: &mut [f32]) {
        match self {
            Codec::Int8 => {
                for (o, &q) in out.iter_mut().zip(payload) {
                    *o = f32::from(q as i8) * scale;
                }
            }
            Codec::OneBit => {
                for (eight, &bits) in out.chunks_mut(8).zip(payload) {
                    for (i, o) in eight.iter_mut().enumerate() {
                        *o = if bits >> i & 1 == 1 { scale } else { -scale };
                    }
                }
            }
            // Not in blocks (see `encode`); the values as they are.
            Codec::Float32 => {
                for (o, b) in out.iter_mut().zip(payload.chunks_exact(4)) {
                    *o = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }
}

wide_where_possible! {
    /// [`Codec::encode`], block by block.
    fn encode_blocks(codec: Codec, values: &[f32], out: &mut [u8], residual: &mut [f32]) {
        let mut at = 0;
        for (block, res) in values.chunks(codec.block()).zip(residual.chunks_mut(codec.block())) {
            let end = at + SCALE_BYTES + codec.payload_bytes(block.len());
            let (head, payload) = out[at..end].split_at_mut(SCALE_BYTES);
            let scale = match codec {
                Codec::Int8 => encode_int8(block, payload),
                Codec::OneBit => encode_onebit(block, payload),
                Codec::Float32 => encode_float32(block, payload),
            };
            head.copy_from_slice(&scale.to_ne_bytes());
            codec.decode_block(scale, payload, res);
            for (r, &v) in res.iter_mut().zip(block) {
                *r = v - *r;
            }
            at = end;
        }
    }
}

wide_where_possible! {
    /// [`Codec::decode`] (`add`: [`Codec::decode_add`]), block by block.
    fn decode_blocks(codec: Codec, bytes: &[u8], out: &mut [f32], add: bool) {
        let mut decoded = [0.0f32; BLOCK];
        let mut at = 0;
        for block in out.chunks_mut(codec.block()) {
            let end = at + SCALE_BYTES + codec.payload_bytes(block.len());
            let (head, payload) = bytes[at..end].split_at(SCALE_BYTES);
            let scale = f32::from_ne_bytes([head[0], head[1], head[2], head[3]]);
            if add {
                let decoded = &mut decoded[..block.len()];
                codec.decode_block(scale, payload, decoded);
                for (o, d) in block.iter_mut().zip(decoded.iter()) {
                    *o += d;
                }
            } else {
                codec.decode_block(scale, payload, block);
            }
            at = end;
        }
    }
}

/// Encode one block as int8; returns its scale. Rounds half away from zero through a truncating cast (no
/// call to `round` per value); the largest magnitude and the NaN check are separate passes, so each
/// vectorises (the NaN check without stopping early, which would not).
#[inline(always)]
fn encode_int8(block: &[f32], payload: &mut [u8]) -> f32 {
    let max = block.iter().fold(0.0f32, |max, v| max.max(v.abs()));
    let scale = max / 127.0;
    if !scale.is_finite() || block.iter().fold(false, |nan, v| nan | v.is_nan()) {
        payload.fill(0);
        return f32::NAN;
    }
    let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (p, &v) in payload.iter_mut().zip(block) {
        let x = v * inverse;
        *p = ((x + 0.5f32.copysign(x)) as i32).clamp(-127, 127) as i8 as u8;
    }
    scale
}

/// Float32 is not sent in blocks ([`Codec::encode`] copies it whole); as a block it would be its values and a
/// scale of 1.
#[inline(always)]
fn encode_float32(block: &[f32], payload: &mut [u8]) -> f32 {
    for (p, v) in payload.chunks_exact_mut(4).zip(block) {
        p.copy_from_slice(&v.to_ne_bytes());
    }
    1.0
}

/// Encode one block as signs (a byte of eight values at a time); returns its scale (the root mean square).
#[inline(always)]
fn encode_onebit(block: &[f32], payload: &mut [u8]) -> f32 {
    let squares: f64 = block.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    for (byte, values) in payload.iter_mut().zip(block.chunks(8)) {
        *byte = values.iter().enumerate().fold(0u8, |bits, (i, &v)| bits | (u8::from(v >= 0.0) << i));
    }
    let scale = (squares / block.len() as f64).sqrt() as f32;
    if scale.is_finite() {
        scale
    } else {
        f32::NAN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect()
    }

    fn round_trip(codec: Codec, input: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut bytes = vec![0u8; codec.encoded_len(input.len())];
        let mut residual = vec![0.0; input.len()];
        codec.encode(input, &mut bytes, &mut residual);
        let mut decoded = vec![0.0; input.len()];
        codec.decode(&bytes, &mut decoded);
        (decoded, residual)
    }

    #[test]
    fn float32_travels_as_it_is_with_nothing_left_over() {
        let input = values(BLOCK + 7);
        assert_eq!(Codec::Float32.encoded_len(input.len()), 4 * input.len());
        let (decoded, residual) = round_trip(Codec::Float32, &input);
        assert_eq!(decoded, input);
        assert!(residual.iter().all(|&r| r == 0.0));
        let mut bytes = vec![0u8; 4 * input.len()];
        Codec::Float32.encode(&input, &mut bytes, &mut vec![1.0; input.len()]);
        let mut sum = vec![1.0f32; input.len()];
        Codec::Float32.decode_add(&bytes, &mut sum);
        assert!(sum.iter().zip(&input).all(|(s, v)| *s == 1.0 + v));
        assert_eq!(Codec::Float32.for_sums(), Codec::Float32);
    }

    #[test]
    fn sizes_count_a_scale_per_block() {
        assert_eq!(Codec::Int8.encoded_len(0), 0);
        assert_eq!(Codec::Int8.encoded_len(BLOCK), 4 + BLOCK);
        assert_eq!(Codec::Int8.encoded_len(BLOCK + 3), 4 + BLOCK + 4 + 3);
        assert_eq!(Codec::OneBit.encoded_len(BLOCK), (BLOCK / ONEBIT_BLOCK) * (4 + ONEBIT_BLOCK / 8));
        assert_eq!(Codec::OneBit.encoded_len(9), 4 + 2);
    }

    #[test]
    fn int8_comes_back_within_half_a_step_and_the_residual_is_what_was_lost() {
        let input = values(3 * BLOCK + 17);
        let (decoded, residual) = round_trip(Codec::Int8, &input);
        for (block, (dec, res)) in input.chunks(BLOCK).zip(decoded.chunks(BLOCK).zip(residual.chunks(BLOCK))) {
            let step = block.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            for ((&v, &d), &r) in block.iter().zip(dec).zip(res) {
                assert!((v - d).abs() <= step / 2.0 + 1e-6, "{v} came back as {d}");
                assert_eq!(r, v - d);
            }
        }
        // The largest magnitude of a block is exact (it is 127 steps).
        let (decoded, _) = round_trip(Codec::Int8, &[-3.0, 1.0, 0.0]);
        assert!((decoded[0] + 3.0).abs() < 1e-6 && decoded[2] == 0.0, "{decoded:?}");
    }

    #[test]
    fn onebit_sends_signs_with_the_blocks_root_mean_square() {
        // 1 + 1 + 9 + 25 = 36 over 4 values: a scale of 3.
        let (decoded, residual) = round_trip(Codec::OneBit, &[1.0, -1.0, 3.0, -5.0]);
        assert_eq!(decoded, [3.0, -3.0, 3.0, -3.0]);
        assert_eq!(residual, [-2.0, 2.0, 0.0, -2.0]);
        // A zero counts as non-negative, and a block of zeros sends zeros.
        assert_eq!(round_trip(Codec::OneBit, &[0.0, -4.0, 0.0, 0.0]).0, [2.0, -2.0, 2.0, 2.0]);
        assert_eq!(round_trip(Codec::OneBit, &[0.0; 5]), (vec![0.0; 5], vec![0.0; 5]));
        let input = values(ONEBIT_BLOCK + 5);
        let (decoded, _) = round_trip(Codec::OneBit, &input);
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        for block in [0..ONEBIT_BLOCK, ONEBIT_BLOCK..ONEBIT_BLOCK + 5] {
            let (sent, was) = (norm(&decoded[block.clone()]), norm(&input[block.clone()]));
            assert!((sent - was).abs() <= 1e-5 * was, "each block keeps its length: {sent} against {was}");
        }
        assert_ne!(decoded[0].abs(), decoded[ONEBIT_BLOCK].abs(), "the short last block has its own scale");
    }

    #[test]
    fn decode_add_accumulates_and_zeros_stay_zero() {
        let input = values(40);
        let mut bytes = vec![0u8; Codec::Int8.encoded_len(40)];
        let mut residual = vec![0.0; 40];
        Codec::Int8.encode(&input, &mut bytes, &mut residual);
        let mut once = vec![0.0; 40];
        Codec::Int8.decode(&bytes, &mut once);
        let mut twice = vec![0.0; 40];
        Codec::Int8.decode_add(&bytes, &mut twice);
        Codec::Int8.decode_add(&bytes, &mut twice);
        assert!(once.iter().zip(&twice).all(|(a, b)| 2.0 * a == *b));
        let (zeros, residual) = round_trip(Codec::Int8, &[0.0; 10]);
        assert_eq!((zeros, residual), (vec![0.0; 10], vec![0.0; 10]));
    }

    #[test]
    fn a_nan_spoils_only_its_block() {
        let mut input = vec![1.0f32; BLOCK + 2];
        input[3] = f32::NAN;
        for codec in [Codec::Int8, Codec::OneBit] {
            let (decoded, _) = round_trip(codec, &input);
            let block = codec.block();
            assert!(decoded[..block].iter().all(|v| v.is_nan()), "{codec:?}");
            assert!(decoded[block..].iter().all(|&v| v == 1.0), "{codec:?}");
        }
    }
}
