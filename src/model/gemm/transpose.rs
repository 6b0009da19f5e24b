//! 8 × 8 block transposes for packing operands whose k dimension is contiguous (the weight of a
//! linear forward, a row-major A): one load and one store per row of eight instead of sixty-four
//! scalar moves with strided stores. Packing only moves values, so it cannot change any bit.

/// Whether [`transpose_8x8`] may run on this CPU.
pub(super) fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst[q·ldd + r] = src[r·ld + q]` for `r, q < 8`.
///
/// # Safety
/// [`supported`] returned true; `src + r·ld + 0..8` is readable and `dst + q·ldd + 0..8`
/// writable for every `r, q < 8`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
pub(super) unsafe fn transpose_8x8(src: *const f32, ld: usize, dst: *mut f32, ldd: usize) {
    use std::arch::x86_64::*;
    // SAFETY (whole body): offsets as the contract states.
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * ld)));
        // Interleave pairs of rows, then pairs of pairs, then the 128-bit halves.
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let out = [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ];
        for (q, v) in out.iter().enumerate() {
            _mm256_storeu_ps(dst.add(q * ldd), *v);
        }
    }
}

/// Never called: [`supported`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn transpose_8x8(_: *const f32, _: usize, _: *mut f32, _: usize) {
    unreachable!("transpose_8x8 without AVX")
}
