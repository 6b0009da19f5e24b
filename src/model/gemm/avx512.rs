//! The AVX-512 microkernel: 8 × 32 tiles, sixteen 512-bit accumulators (of thirty-two
//! registers).

#[cfg(not(target_arch = "x86_64"))]
pub(super) use super::portable::Tile;
#[cfg(target_arch = "x86_64")]
pub(super) use x86::Tile;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::pack::Microkernel;

    pub(in super::super) struct Tile;

    const MR: usize = 8;
    const NR: usize = 32;

    impl Microkernel for Tile {
        const MR: usize = MR;
        const NR: usize = NR;

        unsafe fn tile(
            kc: usize,
            a: *const f32,
            b: *const f32,
            c: *mut f32,
            ldc: usize,
            load: bool,
        ) {
            // SAFETY: forwarded trait contract (CPU has AVX-512F, pointers valid).
            unsafe { tile_8x32(kc, a, b, c, ldc, load) }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn tile_8x32(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        load: bool,
    ) {
        // SAFETY (whole body): every pointer offset stays inside what the trait contract
        // promises: `a + p·MR + i`, `b + p·NR + 0..32`, `c + i·ldc + 0..32`.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            if load {
                for (i, r) in acc.iter_mut().enumerate() {
                    r[0] = _mm512_loadu_ps(c.add(i * ldc));
                    r[1] = _mm512_loadu_ps(c.add(i * ldc + 16));
                }
            }
            let (mut a, mut b) = (a, b);
            for _ in 0..kc {
                let b0 = _mm512_loadu_ps(b);
                let b1 = _mm512_loadu_ps(b.add(16));
                for (i, r) in acc.iter_mut().enumerate() {
                    let ai = _mm512_set1_ps(*a.add(i));
                    r[0] = _mm512_fmadd_ps(ai, b0, r[0]);
                    r[1] = _mm512_fmadd_ps(ai, b1, r[1]);
                }
                a = a.add(MR);
                b = b.add(NR);
            }
            for (i, r) in acc.iter().enumerate() {
                _mm512_storeu_ps(c.add(i * ldc), r[0]);
                _mm512_storeu_ps(c.add(i * ldc + 16), r[1]);
            }
        }
    }
}
