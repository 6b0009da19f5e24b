//! The portable microkernel: scalar `f32::mul_add`, for CPUs without AVX2+FMA (and the
//! reference the vector paths must match bit for bit).

use super::pack::Microkernel;

pub(super) struct Tile;

const MR: usize = 4;
const NR: usize = 8;

impl Microkernel for Tile {
    const MR: usize = MR;
    const NR: usize = NR;

    unsafe fn tile(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, load: bool) {
        let mut acc = [[0.0f32; NR]; MR];
        if load {
            for (i, row) in acc.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    // SAFETY: the caller guarantees the tile is valid (trait contract).
                    *v = unsafe { *c.add(i * ldc + j) };
                }
            }
        }
        // SAFETY: the caller guarantees kc·MR values at `a` and kc·NR at `b`.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(a, kc * MR),
                std::slice::from_raw_parts(b, kc * NR),
            )
        };
        for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
            for (row, &ai) in acc.iter_mut().zip(ap) {
                for (v, &bj) in row.iter_mut().zip(bp) {
                    *v = ai.mul_add(bj, *v);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                // SAFETY: as above.
                unsafe { *c.add(i * ldc + j) = v };
            }
        }
    }
}
