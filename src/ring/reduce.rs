//! Element-wise reduction and scaling kernels over native-endian byte buffers of any alignment.
//!
//! Elements are loaded from fixed-size byte chunks, which LLVM turns into the same vector code as typed
//! slices (measured: equal throughput to an aligned `&[f32]` loop, and within a few percent for
//! misaligned buffers), so there is no separate aligned path and no `unsafe`. Half-precision floats are
//! computed in f32 and rounded back to nearest-even: float16 a block at a time through `half`'s batch
//! conversions (which use the CPU's F16C instructions when present), bfloat16 element-wise through the
//! branch-free conversions in `bfloat16.rs`, which vectorize with the loop.
//! Integer Sum and Product wrap; bool treats any non-zero byte as true and writes 0/1; float Min and Max
//! propagate NaN like `numpy.minimum`/`numpy.maximum`. Results depend only on the operand values and
//! their order (`dst ⊕ src`), never on alignment, so every rank computing the same expression gets the
//! same bits.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::ring::bfloat16::{bf16_to_f32, f32_to_bf16};
use crate::types::{Combine, DataType};

/// float16 elements widened to f32 at a time: the three block buffers stay well inside L1.
const FLOAT16_BLOCK: usize = 512;

/// `dst[i] = dst[i] ⊕ src[i]` for every whole element the two buffers share.
pub fn reduce_into(dst: &mut [u8], src: &[u8], dtype: DataType, combine: Combine) {
    debug_assert_eq!(dst.len(), src.len(), "reduce_into operands differ in length");
    debug_assert_eq!(dst.len() % dtype.size(), 0, "reduce_into length is not whole {dtype} elements");
    match dtype {
        DataType::Uint8 => reduce_int::<u8>(dst, src, combine),
        DataType::Uint16 => reduce_int::<u16>(dst, src, combine),
        DataType::Int8 => reduce_int::<i8>(dst, src, combine),
        DataType::Int16 => reduce_int::<i16>(dst, src, combine),
        DataType::Int32 => reduce_int::<i32>(dst, src, combine),
        DataType::Int64 => reduce_int::<i64>(dst, src, combine),
        DataType::Float16 => reduce_float16(dst, src, combine),
        DataType::Bfloat16 => reduce_float::<Bfloat16Bits>(dst, src, combine),
        DataType::Float32 => reduce_float::<f32>(dst, src, combine),
        DataType::Float64 => reduce_float::<f64>(dst, src, combine),
        DataType::Bool => reduce_bool(dst, src, combine),
    }
}

/// Multiply every element by `factor`, with Horovod's arithmetic (its CPU `ScaleBuffer`), so scaled results
/// match Horovod's bit for bit: integers are multiplied in f64 and the product truncated toward zero
/// (saturating to the type's range where Horovod's C++ cast is undefined); float64 in f64; float32, float16
/// and bfloat16 in f32 with the factor first rounded to f32, the product then rounded to the element type.
/// Bool becomes false only when `factor == 0`.
pub fn scale_in_place(buf: &mut [u8], dtype: DataType, factor: f64) {
    if factor == 1.0 {
        return;
    }
    match dtype {
        DataType::Uint8 => scale_int::<u8>(buf, factor),
        DataType::Uint16 => scale_int::<u16>(buf, factor),
        DataType::Int8 => scale_int::<i8>(buf, factor),
        DataType::Int16 => scale_int::<i16>(buf, factor),
        DataType::Int32 => scale_int::<i32>(buf, factor),
        DataType::Int64 => scale_int::<i64>(buf, factor),
        DataType::Float16 => scale_float16(buf, factor),
        DataType::Bfloat16 => scale_float::<Bfloat16Bits>(buf, factor),
        DataType::Float32 => scale_float::<f32>(buf, factor),
        DataType::Float64 => scale_float::<f64>(buf, factor),
        DataType::Bool => {
            if factor == 0.0 {
                buf.fill(0);
            }
        }
    }
}

/// A fixed-size value stored native-endian in a byte buffer.
trait Element: Copy {
    const SIZE: usize;
    fn load(bytes: &[u8]) -> Self;
    fn store(self, bytes: &mut [u8]);
}

trait IntElement: Element + Ord {
    fn wrapping_add(self, other: Self) -> Self;
    fn wrapping_mul(self, other: Self) -> Self;
    fn to_f64(self) -> f64;
    /// Truncates toward zero and saturates (Rust's `as`).
    fn from_f64(value: f64) -> Self;
}

/// A float type that arithmetic is done in.
trait FloatValue: Copy + PartialOrd + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {
    fn is_nan(self) -> bool;
    /// Rounds to nearest (Rust's `as`).
    fn from_f64(value: f64) -> Self;
}

/// How a float dtype is stored, and the float type its arithmetic is done in.
trait FloatStorage: Element {
    type Value: FloatValue;
    fn widen(self) -> Self::Value;
    fn narrow(value: Self::Value) -> Self;
}

/// bfloat16 bits, computed in f32.
#[derive(Clone, Copy)]
struct Bfloat16Bits(u16);

macro_rules! impl_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            fn load(bytes: &[u8]) -> Self {
                let mut raw = [0u8; std::mem::size_of::<$t>()];
                raw.copy_from_slice(bytes);
                <$t>::from_ne_bytes(raw)
            }
            #[inline(always)]
            fn store(self, bytes: &mut [u8]) {
                bytes.copy_from_slice(&self.to_ne_bytes());
            }
        }
    )*};
}
impl_element!(u8, u16, i8, i16, i32, i64, f32, f64);

macro_rules! impl_int_element {
    ($($t:ty),*) => {$(
        impl IntElement for $t {
            #[inline(always)]
            fn wrapping_add(self, other: Self) -> Self {
                <$t>::wrapping_add(self, other)
            }
            #[inline(always)]
            fn wrapping_mul(self, other: Self) -> Self {
                <$t>::wrapping_mul(self, other)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(value: f64) -> Self {
                value as $t
            }
        }
    )*};
}
impl_int_element!(u8, u16, i8, i16, i32, i64);

macro_rules! impl_float {
    ($($t:ty),*) => {$(
        impl FloatValue for $t {
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn from_f64(value: f64) -> Self {
                value as $t
            }
        }

        impl FloatStorage for $t {
            type Value = $t;
            #[inline(always)]
            fn widen(self) -> $t {
                self
            }
            #[inline(always)]
            fn narrow(value: $t) -> Self {
                value
            }
        }
    )*};
}
impl_float!(f32, f64);

impl Element for Bfloat16Bits {
    const SIZE: usize = 2;
    #[inline(always)]
    fn load(bytes: &[u8]) -> Self {
        Bfloat16Bits(u16::load(bytes))
    }
    #[inline(always)]
    fn store(self, bytes: &mut [u8]) {
        self.0.store(bytes)
    }
}

impl FloatStorage for Bfloat16Bits {
    type Value = f32;
    #[inline(always)]
    fn widen(self) -> f32 {
        bf16_to_f32(self.0)
    }
    #[inline(always)]
    fn narrow(value: f32) -> Self {
        Bfloat16Bits(f32_to_bf16(value))
    }
}

/// `dst[i] = op(dst[i], src[i])` over the byte encodings of `T`.
#[inline(always)]
fn zip_bytes<T: Element>(dst: &mut [u8], src: &[u8], op: impl Fn(T, T) -> T) {
    for (d, s) in dst.chunks_exact_mut(T::SIZE).zip(src.chunks_exact(T::SIZE)) {
        op(T::load(d), T::load(s)).store(d);
    }
}

/// `dst[i] = op(dst[i], src[i])` over f32 slices.
#[inline(always)]
fn zip_values(dst: &mut [f32], src: &[f32], op: impl Fn(f32, f32) -> f32) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = op(*d, s);
    }
}

/// `buf[i] = op(buf[i])` over the byte encodings of `T`.
#[inline(always)]
fn map_bytes<T: Element>(buf: &mut [u8], op: impl Fn(T) -> T) {
    for chunk in buf.chunks_exact_mut(T::SIZE) {
        op(T::load(chunk)).store(chunk);
    }
}

/// Whether `a` is the NaN-propagating minimum of `a` and `b`: a NaN `a` wins, a NaN `b` wins over a number.
#[inline(always)]
fn first_is_min<V: FloatValue>(a: V, b: V) -> bool {
    a.is_nan() || a <= b
}

/// Whether `a` is the NaN-propagating maximum of `a` and `b`: a NaN `a` wins, a NaN `b` wins over a number.
#[inline(always)]
fn first_is_max<V: FloatValue>(a: V, b: V) -> bool {
    a.is_nan() || a >= b
}

fn reduce_int<T: IntElement>(dst: &mut [u8], src: &[u8], combine: Combine) {
    match combine {
        Combine::Sum => zip_bytes(dst, src, T::wrapping_add),
        Combine::Product => zip_bytes(dst, src, T::wrapping_mul),
        Combine::Min => zip_bytes(dst, src, <T as Ord>::min),
        Combine::Max => zip_bytes(dst, src, <T as Ord>::max),
    }
}

fn reduce_float<S: FloatStorage>(dst: &mut [u8], src: &[u8], combine: Combine) {
    match combine {
        Combine::Sum => zip_bytes(dst, src, |a: S, b: S| S::narrow(a.widen() + b.widen())),
        Combine::Product => zip_bytes(dst, src, |a: S, b: S| S::narrow(a.widen() * b.widen())),
        Combine::Min => zip_bytes(dst, src, |a: S, b: S| if first_is_min(a.widen(), b.widen()) { a } else { b }),
        Combine::Max => zip_bytes(dst, src, |a: S, b: S| if first_is_max(a.widen(), b.widen()) { a } else { b }),
    }
}

fn reduce_bool(dst: &mut [u8], src: &[u8], combine: Combine) {
    match combine {
        Combine::Sum | Combine::Max => zip_bytes(dst, src, |a: u8, b: u8| u8::from((a | b) != 0)),
        Combine::Product | Combine::Min => zip_bytes(dst, src, |a: u8, b: u8| u8::from(a != 0 && b != 0)),
    }
}

fn scale_int<T: IntElement>(buf: &mut [u8], factor: f64) {
    map_bytes(buf, |x: T| T::from_f64(x.to_f64() * factor));
}

fn scale_float<S: FloatStorage>(buf: &mut [u8], factor: f64) {
    let factor = S::Value::from_f64(factor);
    map_bytes(buf, |x: S| S::narrow(x.widen() * factor));
}

/// Up to [`FLOAT16_BLOCK`] float16 elements moved between bytes and f32.
struct Float16Block {
    bits: [u16; FLOAT16_BLOCK],
    values: [f32; FLOAT16_BLOCK],
}

impl Float16Block {
    fn new() -> Float16Block {
        Float16Block { bits: [0; FLOAT16_BLOCK], values: [0.0; FLOAT16_BLOCK] }
    }

    /// Widen the elements of `bytes` (at most [`FLOAT16_BLOCK`]) into `values`; returns how many.
    fn widen(&mut self, bytes: &[u8]) -> usize {
        let count = (bytes.len() / 2).min(FLOAT16_BLOCK);
        for (bits, chunk) in self.bits.iter_mut().zip(bytes.chunks_exact(2)) {
            *bits = u16::load(chunk);
        }
        self.bits[..count].reinterpret_cast::<f16>().convert_to_f32_slice(&mut self.values[..count]);
        count
    }

    /// Round the first `count` values to float16 and write them to `bytes`.
    fn narrow(&mut self, count: usize, bytes: &mut [u8]) {
        self.bits[..count].reinterpret_cast_mut::<f16>().convert_from_f32_slice(&self.values[..count]);
        for (&bits, chunk) in self.bits[..count].iter().zip(bytes.chunks_exact_mut(2)) {
            bits.store(chunk);
        }
    }
}

fn reduce_float16(dst: &mut [u8], src: &[u8], combine: Combine) {
    let mut acc = Float16Block::new();
    let mut operand = Float16Block::new();
    for (d, s) in dst.chunks_mut(2 * FLOAT16_BLOCK).zip(src.chunks(2 * FLOAT16_BLOCK)) {
        let count = acc.widen(d).min(operand.widen(s));
        let (values, operands) = (&mut acc.values[..count], &operand.values[..count]);
        match combine {
            Combine::Sum => zip_values(values, operands, |a, b| a + b),
            Combine::Product => zip_values(values, operands, |a, b| a * b),
            Combine::Min => zip_values(values, operands, |a, b| if first_is_min(a, b) { a } else { b }),
            Combine::Max => zip_values(values, operands, |a, b| if first_is_max(a, b) { a } else { b }),
        }
        acc.narrow(count, d);
    }
}

fn scale_float16(buf: &mut [u8], factor: f64) {
    let mut block = Float16Block::new();
    for chunk in buf.chunks_mut(2 * FLOAT16_BLOCK) {
        let count = block.widen(chunk);
        let factor = factor as f32;
        for value in &mut block.values[..count] {
            *value *= factor;
        }
        block.narrow(count, chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};
    use proptest::prelude::*;

    const COMBINES: [Combine; 4] = [Combine::Sum, Combine::Min, Combine::Max, Combine::Product];

    fn float_min(a: f64, b: f64) -> f64 {
        if a.is_nan() {
            a
        } else if b.is_nan() || b < a {
            b
        } else {
            a
        }
    }

    fn float_max(a: f64, b: f64) -> f64 {
        if a.is_nan() {
            a
        } else if b.is_nan() || b > a {
            b
        } else {
            a
        }
    }

    macro_rules! int_reference {
        ($t:ty, $combine:expr, $x:expr, $y:expr) => {{
            let a = <$t>::from_ne_bytes($x.try_into().unwrap());
            let b = <$t>::from_ne_bytes($y.try_into().unwrap());
            let r = match $combine {
                Combine::Sum => a.wrapping_add(b),
                Combine::Product => a.wrapping_mul(b),
                Combine::Min => a.min(b),
                Combine::Max => a.max(b),
            };
            r.to_ne_bytes().to_vec()
        }};
    }

    /// One element combined the obvious way. f32 arithmetic is exact in f64 followed by rounding to
    /// f32 for + and *, so f16/bf16/f32 references may compute in f64.
    fn reference_element(dtype: DataType, combine: Combine, x: &[u8], y: &[u8]) -> Vec<u8> {
        let float_op = |a: f64, b: f64| match combine {
            Combine::Sum => a + b,
            Combine::Product => a * b,
            Combine::Min => float_min(a, b),
            Combine::Max => float_max(a, b),
        };
        match dtype {
            DataType::Uint8 => int_reference!(u8, combine, x, y),
            DataType::Uint16 => int_reference!(u16, combine, x, y),
            DataType::Int8 => int_reference!(i8, combine, x, y),
            DataType::Int16 => int_reference!(i16, combine, x, y),
            DataType::Int32 => int_reference!(i32, combine, x, y),
            DataType::Int64 => int_reference!(i64, combine, x, y),
            DataType::Float32 => {
                let a = f32::from_ne_bytes(x.try_into().unwrap()) as f64;
                let b = f32::from_ne_bytes(y.try_into().unwrap()) as f64;
                (float_op(a, b) as f32).to_ne_bytes().to_vec()
            }
            DataType::Float64 => {
                let a = f64::from_ne_bytes(x.try_into().unwrap());
                let b = f64::from_ne_bytes(y.try_into().unwrap());
                float_op(a, b).to_ne_bytes().to_vec()
            }
            DataType::Float16 => {
                let a = f16::from_ne_bytes(x.try_into().unwrap()).to_f64();
                let b = f16::from_ne_bytes(y.try_into().unwrap()).to_f64();
                f16::from_f64(float_op(a, b)).to_ne_bytes().to_vec()
            }
            DataType::Bfloat16 => {
                let a = bf16::from_ne_bytes(x.try_into().unwrap()).to_f64();
                let b = bf16::from_ne_bytes(y.try_into().unwrap()).to_f64();
                bf16::from_f64(float_op(a, b)).to_ne_bytes().to_vec()
            }
            DataType::Bool => {
                let (a, b) = (x[0] != 0, y[0] != 0);
                let r = match combine {
                    Combine::Sum | Combine::Max => a || b,
                    Combine::Product | Combine::Min => a && b,
                };
                vec![r as u8]
            }
        }
    }

    fn as_f64(dtype: DataType, bytes: &[u8]) -> f64 {
        match dtype {
            DataType::Float16 => f16::from_ne_bytes(bytes.try_into().unwrap()).to_f64(),
            DataType::Bfloat16 => bf16::from_ne_bytes(bytes.try_into().unwrap()).to_f64(),
            DataType::Float32 => f32::from_ne_bytes(bytes.try_into().unwrap()) as f64,
            DataType::Float64 => f64::from_ne_bytes(bytes.try_into().unwrap()),
            _ => 0.0,
        }
    }

    /// Bitwise comparison, except that any NaN matches any NaN (payloads of Sum/Product are hardware's choice).
    fn assert_matches_reference(dtype: DataType, combine: Combine, dst: &[u8], before: &[u8], src: &[u8]) {
        let size = dtype.size();
        for (i, ((got, x), y)) in dst.chunks(size).zip(before.chunks(size)).zip(src.chunks(size)).enumerate() {
            let expected = reference_element(dtype, combine, x, y);
            let both_nan = dtype.is_float() && as_f64(dtype, got).is_nan() && as_f64(dtype, &expected).is_nan();
            assert!(
                both_nan || got == expected,
                "{dtype} {combine:?} element {i}: {x:?} ⊕ {y:?} = {got:?}, want {expected:?}"
            );
        }
    }

    /// Arbitrary bytes (so floats include NaNs, infinities and subnormals) from a xorshift generator.
    fn random_bytes(state: &mut u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|_| {
                *state ^= *state << 13;
                *state ^= *state >> 7;
                *state ^= *state << 17;
                (*state >> 24) as u8
            })
            .collect()
    }

    proptest! {
        #[test]
        fn matches_reference_at_any_alignment(
            dtype_index in 0usize..DataType::ALL.len(),
            combine_index in 0usize..4,
            elements in 0usize..1200,
            dst_offset in 0usize..8,
            src_offset in 0usize..8,
            seed in any::<u64>(),
        ) {
            let dtype = DataType::ALL[dtype_index];
            let combine = COMBINES[combine_index];
            let len = elements * dtype.size();
            let mut state = seed | 1;
            let mut dst_storage = random_bytes(&mut state, len + dst_offset);
            let src_storage = random_bytes(&mut state, len + src_offset);
            let before = dst_storage[dst_offset..].to_vec();
            let src = &src_storage[src_offset..];
            reduce_into(&mut dst_storage[dst_offset..], src, dtype, combine);
            assert_matches_reference(dtype, combine, &dst_storage[dst_offset..], &before, src);
        }
    }

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_ne_bytes()).collect()
    }

    fn f32_values(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
    }

    #[test]
    fn float_min_max_propagate_nan_from_either_side() {
        for dtype in [DataType::Float16, DataType::Bfloat16, DataType::Float32, DataType::Float64] {
            for combine in [Combine::Min, Combine::Max] {
                let encode = |v: f64| -> Vec<u8> {
                    match dtype {
                        DataType::Float16 => f16::from_f64(v).to_ne_bytes().to_vec(),
                        DataType::Bfloat16 => bf16::from_f64(v).to_ne_bytes().to_vec(),
                        DataType::Float32 => (v as f32).to_ne_bytes().to_vec(),
                        _ => v.to_ne_bytes().to_vec(),
                    }
                };
                let mut dst: Vec<u8> = [f64::NAN, 1.0, 2.0].iter().flat_map(|&v| encode(v)).collect();
                let src: Vec<u8> = [1.0, f64::NAN, -3.0].iter().flat_map(|&v| encode(v)).collect();
                reduce_into(&mut dst, &src, dtype, combine);
                let size = dtype.size();
                assert!(as_f64(dtype, &dst[..size]).is_nan());
                assert!(as_f64(dtype, &dst[size..2 * size]).is_nan());
                let expected = if combine == Combine::Min { -3.0 } else { 2.0 };
                assert_eq!(as_f64(dtype, &dst[2 * size..]), expected);
            }
        }
    }

    #[test]
    fn integers_wrap_and_bools_normalize() {
        let mut dst = [127u8, 200];
        reduce_into(&mut dst[..1], &[1], DataType::Int8, Combine::Sum);
        assert_eq!(dst[0] as i8, -128);
        reduce_into(&mut dst[1..], &[2], DataType::Uint8, Combine::Product);
        assert_eq!(dst[1], 144);
        let mut flags = vec![2u8, 0, 3, 0];
        reduce_into(&mut flags, &[0, 0, 5, 9], DataType::Bool, Combine::Sum);
        assert_eq!(flags, vec![1, 0, 1, 1]);
        let mut flags = vec![2u8, 0, 3, 0];
        reduce_into(&mut flags, &[0, 0, 5, 9], DataType::Bool, Combine::Min);
        assert_eq!(flags, vec![0, 0, 1, 0]);
    }

    #[test]
    fn half_precision_sums_round_to_nearest_even() {
        let count = 1543;
        let one = f16::from_f32(1.0).to_ne_bytes();
        let tiny = f16::from_f32(2f32.powi(-11)).to_ne_bytes();
        let mut dst: Vec<u8> = (0..count).flat_map(|_| one).collect();
        let src: Vec<u8> = (0..count).flat_map(|_| tiny).collect();
        reduce_into(&mut dst, &src, DataType::Float16, Combine::Sum);
        // 1 + 2^-11 is a tie between 1 and 1 + 2^-10; the even neighbour is 1.
        assert!(dst.chunks(2).all(|c| c == one));
        let mut dst: Vec<u8> = (0..count).flat_map(|_| bf16::from_f32(3.0).to_ne_bytes()).collect();
        let src = dst.clone();
        reduce_into(&mut dst, &src, DataType::Bfloat16, Combine::Product);
        assert!(dst.chunks(2).all(|c| c == bf16::from_f32(9.0).to_ne_bytes()));
    }

    #[test]
    fn scaling_floats_multiplies() {
        let mut buf = f32_bytes(&[1.0, -4.0, 10.0]);
        scale_in_place(&mut buf, DataType::Float32, 0.5);
        assert_eq!(f32_values(&buf), vec![0.5, -2.0, 5.0]);
        let mut buf: Vec<u8> = [2.0f32, 7.0].iter().flat_map(|&v| f16::from_f32(v).to_ne_bytes()).collect();
        scale_in_place(&mut buf, DataType::Float16, 0.25);
        assert_eq!(buf, [0.5f32, 1.75].iter().flat_map(|&v| f16::from_f32(v).to_ne_bytes()).collect::<Vec<_>>());
        let mut buf = 6.0f64.to_ne_bytes().to_vec();
        scale_in_place(&mut buf, DataType::Float64, 1.0 / 3.0);
        assert_eq!(f64::from_ne_bytes(buf.try_into().unwrap()), 2.0);
    }

    #[test]
    fn scaling_integers_truncates_toward_zero_and_saturates() {
        let mut buf: Vec<u8> = [-7i8, 7, 100].iter().map(|&v| v as u8).collect();
        scale_in_place(&mut buf, DataType::Int8, 0.5);
        assert_eq!(buf.iter().map(|&b| b as i8).collect::<Vec<_>>(), vec![-3, 3, 50]);
        scale_in_place(&mut buf, DataType::Int8, 4.0);
        assert_eq!(buf.iter().map(|&b| b as i8).collect::<Vec<_>>(), vec![-12, 12, 127]);
        let mut buf = vec![3u8, 250];
        scale_in_place(&mut buf, DataType::Uint8, -1.0);
        assert_eq!(buf, vec![0, 0]);
        let mut buf = i64::MAX.to_ne_bytes().to_vec();
        scale_in_place(&mut buf, DataType::Int64, 2.0);
        assert_eq!(i64::from_ne_bytes(buf.try_into().unwrap()), i64::MAX);
    }

    /// Horovod's CPU `ScaleBuffer`, written out per dtype: `(T)(factor * x)` with the factor as f64 for
    /// integers and f64, as f32 for f32 and the half types (computed in f32, rounded to the type).
    fn horovod_scaled(dtype: DataType, x: &[u8], factor: f64) -> Vec<u8> {
        macro_rules! int {
            ($t:ty) => {
                ((factor * <$t>::from_ne_bytes(x.try_into().unwrap()) as f64) as $t).to_ne_bytes().to_vec()
            };
        }
        let f = factor as f32;
        match dtype {
            DataType::Uint8 => int!(u8),
            DataType::Uint16 => int!(u16),
            DataType::Int8 => int!(i8),
            DataType::Int16 => int!(i16),
            DataType::Int32 => int!(i32),
            DataType::Int64 => int!(i64),
            DataType::Float16 => {
                f16::from_f32(f * f16::from_ne_bytes(x.try_into().unwrap()).to_f32()).to_ne_bytes().to_vec()
            }
            DataType::Bfloat16 => {
                bf16::from_f32(f * bf16::from_ne_bytes(x.try_into().unwrap()).to_f32()).to_ne_bytes().to_vec()
            }
            DataType::Float32 => (f * f32::from_ne_bytes(x.try_into().unwrap())).to_ne_bytes().to_vec(),
            DataType::Float64 => (factor * f64::from_ne_bytes(x.try_into().unwrap())).to_ne_bytes().to_vec(),
            DataType::Bool => vec![x[0]],
        }
    }

    #[test]
    fn scaling_matches_horovods_arithmetic_for_every_dtype() {
        // 0.1 and 1/3 are not exact in f32: multiplying in f64 and rounding once gives other bits for some
        // elements than Horovod's f32 product (float32 and the half types).
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for dtype in DataType::ALL.into_iter().filter(|&d| d != DataType::Bool) {
            for factor in [0.1, 1.0 / 3.0, 0.7310585786300049, 2.5, -1.75] {
                let mut buf = random_bytes(&mut state, 4096 * dtype.size());
                let before = buf.clone();
                scale_in_place(&mut buf, dtype, factor);
                for (i, (got, x)) in buf.chunks(dtype.size()).zip(before.chunks(dtype.size())).enumerate() {
                    let expected = horovod_scaled(dtype, x, factor);
                    let both_nan = dtype.is_float() && as_f64(dtype, got).is_nan() && as_f64(dtype, &expected).is_nan();
                    assert!(
                        both_nan || got == expected,
                        "{dtype} x {factor} element {i}: {x:?} gave {got:?}, want {expected:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn uint16_reduces_without_sign() {
        let encode = |v: &[u16]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        let mut dst = encode(&[65535, 40000, 1]);
        reduce_into(&mut dst, &encode(&[1, 30000, 2]), DataType::Uint16, Combine::Sum);
        assert_eq!(dst, encode(&[0, 4464, 3]));
        let mut dst = encode(&[65535, 40000]);
        reduce_into(&mut dst, &encode(&[1, 50000]), DataType::Uint16, Combine::Max);
        assert_eq!(dst, encode(&[65535, 50000]));
    }

    #[test]
    fn scaling_bools_only_clears_on_zero() {
        let mut buf = vec![1u8, 0, 1];
        scale_in_place(&mut buf, DataType::Bool, 0.5);
        assert_eq!(buf, vec![1, 0, 1]);
        scale_in_place(&mut buf, DataType::Bool, 0.0);
        assert_eq!(buf, vec![0, 0, 0]);
    }

    #[test]
    fn scaling_by_one_leaves_bits_alone() {
        let nan_with_payload = f32::from_bits(0x7fc0_1234);
        let mut buf = f32_bytes(&[nan_with_payload]);
        scale_in_place(&mut buf, DataType::Float32, 1.0);
        assert_eq!(f32_values(&buf)[0].to_bits(), 0x7fc0_1234);
    }
}
