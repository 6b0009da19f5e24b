//! The AVX2+FMA microkernel: 6 × 16 tiles, twelve 256-bit accumulators (of sixteen registers).

#[cfg(not(target_arch = "x86_64"))]
pub(super) use super::portable::Tile;
#[cfg(target_arch = "x86_64")]
pub(super) use x86::Tile;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::pack::Microkernel;

    pub(in super::super) struct Tile;

    const MR: usize = 6;
    const NR: usize = 16;

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
            // SAFETY: forwarded trait contract (CPU has AVX2 and FMA, pointers valid).
            unsafe { tile_6x16(kc, a, b, c, ldc, load) }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_6x16(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        load: bool,
    ) {
        // SAFETY (whole body): every pointer offset stays inside what the trait contract
        // promises: `a + p·MR + i`, `b + p·NR + 0..16`, `c + i·ldc + 0..16`.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; MR];
            if load {
                for (i, r) in acc.iter_mut().enumerate() {
                    r[0] = _mm256_loadu_ps(c.add(i * ldc));
                    r[1] = _mm256_loadu_ps(c.add(i * ldc + 8));
                }
            }
            let (mut a, mut b) = (a, b);
            for _ in 0..kc {
                let b0 = _mm256_loadu_ps(b);
                let b1 = _mm256_loadu_ps(b.add(8));
                for (i, r) in acc.iter_mut().enumerate() {
                    let ai = _mm256_broadcast_ss(&*a.add(i));
                    r[0] = _mm256_fmadd_ps(ai, b0, r[0]);
                    r[1] = _mm256_fmadd_ps(ai, b1, r[1]);
                }
                a = a.add(MR);
                b = b.add(NR);
            }
            for (i, r) in acc.iter().enumerate() {
                _mm256_storeu_ps(c.add(i * ldc), r[0]);
                _mm256_storeu_ps(c.add(i * ldc + 8), r[1]);
            }
        }
    }
}
