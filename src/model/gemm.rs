//! Single-threaded `f32` matrix product for x86-64 with AVX2 and FMA, in the BLIS structure:
//! blocks of B (`KC × NC`) and A (`MC × KC`) are packed into contiguous panels, and a 6 × 16
//! register-tile kernel multiplies one A panel by one B panel.
//!
//! Why not `matrixmultiply`: its AVX2 kernel is 8 × 8, eight accumulators. An FMA has a latency
//! of 4 cycles, so eight independent chains cap it at two FMAs per cycle however many FMA
//! pipes the core has; on the development machine (`BENCHMARKS.md`, GEMM) that held it to
//! ~45% of what the core sustains. A 6 × 16 tile keeps twelve accumulators in flight (plus two
//! B vectors and one broadcast A value: 15 of the 16 `ymm` registers).
//!
//! **Determinism.** Every element of C is `Σ_k a·b` accumulated in increasing `k` with one FMA
//! per term, restarting at each `KC` boundary and added to C in block order. The blocking
//! depends only on the shapes, never on the data, the thread or the buffers, so equal inputs give
//! equal bits, which the ranks rely on (`model/mod.rs`). Hosts without AVX2+FMA use
//! `matrixmultiply` (the caller decides through [`available`]), which rounds differently: a
//! cluster mixing such hosts with AVX2 hosts is not bitwise reproducible across them.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Rows of the register tile.
pub const MR: usize = 6;
/// Columns of the register tile (two 8-lane vectors).
pub const NR: usize = 16;
/// Depth of one packed block: a `KC × NR` B panel (16 KiB) stays in L1.
pub const KC: usize = 256;
/// Rows of one packed A block: `MC × KC` (96 KiB) stays in L2.
pub const MC: usize = 16 * MR;
/// Columns of one packed B block: `KC × NC` (1 MiB) stays in L3.
pub const NC: usize = 64 * NR;

/// Lengths of the packing buffers [`sgemm`] needs: `[A, B]`.
pub const PACK_LENS: [usize; 2] = [MC * KC, KC * NC];

/// Whether this CPU runs the kernel (AVX2 and FMA); otherwise the caller uses its fallback.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A strided matrix operand: element `(i, j)` is at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub struct Strided<P> {
    pub ptr: P,
    pub rs: isize,
    pub cs: isize,
}

/// `C[m,n] = A[m,k]·B[k,n]`, or `C += A·B` when `acc`. `pack` holds [`PACK_LENS`] elements
/// (contents unspecified; every packed element is written before it is read). With `acc` false
/// C is never read, so stale or NaN contents cannot leak in.
///
/// # Safety
/// [`available`] is true; every `(i, j)` with `i < m`, `j < k` (A), `j < n` (B, C) addresses a
/// valid element; C's elements are distinct and alias neither A nor B.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: Strided<*const f32>,
    b: Strided<*const f32>,
    c: Strided<*mut f32>,
    acc: bool,
    pack: [&mut [f32]; 2],
) {
    let [pa, pb] = pack;
    assert!(
        pa.len() >= PACK_LENS[0] && pb.len() >= PACK_LENS[1],
        "gemm packing buffers too short"
    );
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let overwrite = pc == 0 && !acc;
            pack_b(kc, nc, at(b, pc, jc), pb);
            for ic in (0..m).step_by(MC) {
                let mc = MC.min(m - ic);
                pack_a(mc, kc, at(a, ic, pc), pa);
                for jr in (0..nc).step_by(NR) {
                    let bp = pb.as_ptr().add(jr * kc);
                    for ir in (0..mc).step_by(MR) {
                        let ap = pa.as_ptr().add(ir * kc);
                        let cp = at(c, ic + ir, jc + jr);
                        let (mr, nr) = (MR.min(mc - ir), NR.min(nc - jr));
                        kernel(kc, ap, bp, cp, mr, nr, overwrite);
                    }
                }
            }
        }
    }
}

fn at<P: Offset>(s: Strided<P>, i: usize, j: usize) -> Strided<P> {
    Strided {
        ptr: s.ptr.offset_by(i as isize * s.rs + j as isize * s.cs),
        ..s
    }
}

trait Offset: Copy {
    fn offset_by(self, d: isize) -> Self;
}
impl Offset for *const f32 {
    fn offset_by(self, d: isize) -> Self {
        self.wrapping_offset(d)
    }
}
impl Offset for *mut f32 {
    fn offset_by(self, d: isize) -> Self {
        self.wrapping_offset(d)
    }
}

/// Packs `mc × kc` of A into row panels of `MR`: panel `r` holds, for each `p`, the `MR` values
/// `A[r·MR + i, p]`, zero past the last row (those lanes are computed and never stored).
unsafe fn pack_a(mc: usize, kc: usize, a: Strided<*const f32>, out: &mut [f32]) {
    for (r, panel) in out[..mc.div_ceil(MR) * MR * kc]
        .chunks_exact_mut(MR * kc)
        .enumerate()
    {
        pack_panel::<MR>(MR.min(mc - r * MR), kc, at(a, r * MR, 0), a.rs, a.cs, panel);
    }
}

/// Packs `kc × nc` of B into column panels of `NR`, zero past the last column.
unsafe fn pack_b(kc: usize, nc: usize, b: Strided<*const f32>, out: &mut [f32]) {
    for (q, panel) in out[..nc.div_ceil(NR) * NR * kc]
        .chunks_exact_mut(NR * kc)
        .enumerate()
    {
        pack_panel::<NR>(NR.min(nc - q * NR), kc, at(b, 0, q * NR), b.cs, b.rs, panel);
    }
}

/// One panel: `panel[p·L + l] = src[l·lane_stride + p·depth_stride]` for `l < lanes`, zero for
/// `lanes ≤ l < L`. The source is walked in `p` order with `L` lanes side by side, so the panel
/// is written sequentially; a contiguous lane dimension (`lane_stride == 1`) is a plain copy.
unsafe fn pack_panel<const L: usize>(
    lanes: usize,
    kc: usize,
    src: Strided<*const f32>,
    lane_stride: isize,
    depth_stride: isize,
    panel: &mut [f32],
) {
    let panel = &mut panel[..kc * L];
    if lanes == L && lane_stride == 1 {
        for (p, dst) in panel.chunks_exact_mut(L).enumerate() {
            let from = src.ptr.offset(p as isize * depth_stride);
            std::ptr::copy_nonoverlapping(from, dst.as_mut_ptr(), L);
        }
        return;
    }
    let mut starts = [src.ptr; L];
    for (l, s) in starts.iter_mut().enumerate().take(lanes) {
        *s = src.ptr.offset(l as isize * lane_stride);
    }
    for (p, dst) in panel.chunks_exact_mut(L).enumerate() {
        let d = p as isize * depth_stride;
        for (l, v) in dst.iter_mut().enumerate() {
            *v = if l < lanes { *starts[l].offset(d) } else { 0.0 };
        }
    }
}

/// One `MR × NR` tile: `acc = Σ_p a[p]·b[p]`, then `C = acc` (`overwrite`) or `C = C + acc`,
/// for the `mr × nr` elements that exist.
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: Strided<*mut f32>,
    mr: usize,
    nr: usize,
    overwrite: bool,
) {
    let z = _mm256_setzero_ps();
    let mut t = [[z; 2]; MR];
    for p in 0..kc {
        let b0 = _mm256_loadu_ps(b.add(p * NR));
        let b1 = _mm256_loadu_ps(b.add(p * NR + 8));
        for (i, row) in t.iter_mut().enumerate() {
            let ai = _mm256_broadcast_ss(&*a.add(p * MR + i));
            row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
            row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
        }
    }
    if mr == MR && nr == NR && c.cs == 1 {
        for (i, row) in t.iter().enumerate() {
            let dst = c.ptr.offset(i as isize * c.rs);
            let (lo, hi) = if overwrite {
                (row[0], row[1])
            } else {
                (
                    _mm256_add_ps(_mm256_loadu_ps(dst), row[0]),
                    _mm256_add_ps(_mm256_loadu_ps(dst.add(8)), row[1]),
                )
            };
            _mm256_storeu_ps(dst, lo);
            _mm256_storeu_ps(dst.add(8), hi);
        }
        return;
    }
    let mut tile = [[0.0f32; NR]; MR];
    for (row, out) in t.iter().zip(tile.iter_mut()) {
        _mm256_storeu_ps(out.as_mut_ptr(), row[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), row[1]);
    }
    for (i, row) in tile.iter().enumerate().take(mr) {
        for (j, &v) in row.iter().enumerate().take(nr) {
            let dst = c.ptr.offset(i as isize * c.rs + j as isize * c.cs);
            *dst = if overwrite { v } else { *dst + v };
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::model::rng::SplitMix64;

    fn random(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
        (0..n)
            .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
            .collect()
    }

    fn strided<P>(ptr: P, rs: usize, cs: usize) -> Strided<P> {
        Strided {
            ptr,
            rs: rs as isize,
            cs: cs as isize,
        }
    }

    /// `C = A·B (+ C)` by the definition, summed in `f64`.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        (ars, acs): (usize, usize),
        b: &[f32],
        (brs, bcs): (usize, usize),
        c: &[f32],
        acc: bool,
    ) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s: f64 = if acc { c[i * n + j] as f64 } else { 0.0 };
                for p in 0..k {
                    s += a[i * ars + p * acs] as f64 * b[p * brs + j * bcs] as f64;
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    fn run(m: usize, k: usize, n: usize, a_t: bool, b_t: bool, acc: bool, seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let (a, b) = (random(m * k, &mut rng), random(k * n, &mut rng));
        let start = if acc {
            random(m * n, &mut rng)
        } else {
            vec![f32::NAN; m * n]
        };
        let sa = if a_t { (1, m) } else { (k, 1) };
        let sb = if b_t { (1, k) } else { (n, 1) };
        let want = reference(m, k, n, &a, sa, &b, sb, &start, acc);
        let mut c = start.clone();
        let mut pa = vec![f32::NAN; PACK_LENS[0]];
        let mut pb = vec![f32::NAN; PACK_LENS[1]];
        // SAFETY: the test only runs where `available()`; the strides address exactly the
        // row-major or transposed buffers allocated above.
        unsafe {
            sgemm(
                m,
                k,
                n,
                strided(a.as_ptr(), sa.0, sa.1),
                strided(b.as_ptr(), sb.0, sb.1),
                strided(c.as_mut_ptr(), n, 1),
                acc,
                [&mut pa, &mut pb],
            );
        }
        for (idx, (&got, &w)) in c.iter().zip(&want).enumerate() {
            let tol = 1e-5 * (k as f64 + 1.0);
            assert!(
                (got as f64 - w).abs() <= tol,
                "{m}x{k}x{n} a_t={a_t} b_t={b_t} acc={acc}: C[{idx}] = {got}, want {w}"
            );
        }
    }

    #[test]
    fn matches_the_definition_on_edges_strides_and_blocks() {
        if !available() {
            return;
        }
        let shapes = [
            (1, 1, 1),
            (5, 3, 15),
            (6, 7, 16),
            (7, 1, 17),
            (13, 300, 33),
            (MC + 5, KC + 1, NR * 3 + 1),
            (130, 64, NC + 17),
        ];
        for (s, &(m, k, n)) in shapes.iter().enumerate() {
            for flags in 0..8u64 {
                let (a_t, b_t, acc) = (flags & 1 != 0, flags & 2 != 0, flags & 4 != 0);
                run(m, k, n, a_t, b_t, acc, 17 * s as u64 + flags);
            }
        }
    }

    #[test]
    fn equal_inputs_give_equal_bits_whatever_the_buffers_held() {
        if !available() {
            return;
        }
        let (m, k, n) = (37, KC * 2 + 3, 40);
        let mut rng = SplitMix64::new(5);
        let (a, b) = (random(m * k, &mut rng), random(k * n, &mut rng));
        let once = |poison: f32| {
            let mut c = vec![poison; m * n];
            let mut pa = vec![poison; PACK_LENS[0]];
            let mut pb = vec![poison; PACK_LENS[1]];
            // SAFETY: as in `run`.
            unsafe {
                sgemm(
                    m,
                    k,
                    n,
                    strided(a.as_ptr(), k, 1),
                    strided(b.as_ptr(), n, 1),
                    strided(c.as_mut_ptr(), n, 1),
                    false,
                    [&mut pa, &mut pb],
                );
            }
            c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(once(0.0), once(f32::NAN));
        assert!(once(1.0).iter().all(|&b| f32::from_bits(b).is_finite()));
    }

    /// Our kernel rounds exactly as `matrixmultiply`'s FMA kernel does (same `KC`, one FMA per
    /// term in `k` order, `C + AB` at the end), so parameter digests from before the switch
    /// still hold on AVX2 hosts.
    #[test]
    fn same_bits_as_matrixmultiply() {
        if !available() {
            return;
        }
        for &(m, k, n) in &[(64, 256, 96), (29, 3 * KC + 7, 45), (128, 64, 128)] {
            let mut rng = SplitMix64::new(m as u64);
            let (a, b) = (random(m * k, &mut rng), random(k * n, &mut rng));
            let start = random(m * n, &mut rng);
            let (mut ours, mut theirs) = (start.clone(), start);
            let mut pa = vec![0.0; PACK_LENS[0]];
            let mut pb = vec![0.0; PACK_LENS[1]];
            // SAFETY: as in `run`; matrixmultiply gets the same row-major buffers.
            unsafe {
                sgemm(
                    m,
                    k,
                    n,
                    strided(a.as_ptr(), k, 1),
                    strided(b.as_ptr(), n, 1),
                    strided(ours.as_mut_ptr(), n, 1),
                    true,
                    [&mut pa, &mut pb],
                );
                matrixmultiply::sgemm(
                    m,
                    k,
                    n,
                    1.0,
                    a.as_ptr(),
                    k as isize,
                    1,
                    b.as_ptr(),
                    n as isize,
                    1,
                    1.0,
                    theirs.as_mut_ptr(),
                    n as isize,
                    1,
                );
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ours), bits(&theirs), "{m}x{k}x{n}");
        }
    }
}
