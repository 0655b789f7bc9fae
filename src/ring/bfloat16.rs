//! bfloat16 conversions to and from f32, written branch-free so that loops over them vectorize
//! (the `half` crate's bfloat16 slice conversions are scalar; measured 4-5x slower here).
//!
//! Widening is exact. Narrowing rounds to nearest, ties to even, overflows to infinity, and keeps NaNs
//! NaN (quieted, with the top payload bits), as IEEE 754 conversion does.

/// bfloat16 bits to the f32 of the same value.
#[inline(always)]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// The bfloat16 bits nearest to `value` (ties to even).
#[inline(always)]
pub(crate) fn f32_to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    // Adding just under half a unit of the kept bits, plus the lowest kept bit, rounds ties to even.
    let odd = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7fff + odd) >> 16;
    let quiet_nan = (bits >> 16) | 0x0040;
    let is_nan = bits & 0x7fff_ffff > 0x7f80_0000;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn same_value(a: f32, b: f32) -> bool {
        (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
    }

    fn check(value: f32) {
        let got = bf16_to_f32(f32_to_bf16(value));
        let want = bf16::from_f32(value).to_f32();
        assert!(same_value(got, want), "{value:e} ({:#010x}) narrowed to {got:e}, want {want:e}", value.to_bits());
    }

    #[test]
    fn widening_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            assert!(same_value(bf16_to_f32(bits), bf16::from_bits(bits).to_f32()), "{bits:#06x}");
        }
    }

    #[test]
    fn narrowing_rounds_like_ieee() {
        // Every bfloat16 value, the midpoints between neighbours, and the f32 values either side of them.
        for bits in 0..=u16::MAX {
            let here = bf16_to_f32(bits);
            let middle = ((here as f64 + bf16_to_f32(bits.wrapping_add(1)) as f64) / 2.0) as f32;
            for value in [
                here,
                middle,
                f32::from_bits(middle.to_bits().wrapping_add(1)),
                f32::from_bits(middle.to_bits().wrapping_sub(1)),
            ] {
                check(value);
            }
        }
        for bits in (0..=u32::MAX).step_by(9_973) {
            check(f32::from_bits(bits));
        }
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(f32_to_bf16(-0.0), 0x8000);
        assert!(bf16_to_f32(f32_to_bf16(f32::from_bits(0xff80_0001))).is_nan());
    }
}
