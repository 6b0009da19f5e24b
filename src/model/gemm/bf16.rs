//! The bf16 matrix product: `C (+)= A · B` with A and B rounded to bf16 and `f32` accumulation,
//! the arithmetic of AVX512_BF16's `vdpbf16ps`, and the same bits on every CPU.
//!
//! The contract, which is what `vdpbf16ps` computes (checked against the instruction on 3.2
//! million lanes, denormal ranges included): operands are rounded to bf16 to nearest even, a
//! bf16 denormal counts as a signed zero (DAZ), and each output element is one chain along k
//! taken in pairs, the odd k of a pair first:
//! `c = ftz(fma(a[2q+1], b[2q+1], c)); c = ftz(fma(a[2q], b[2q], c))` for `q = 0, 1, ..`, where
//! `ftz` flushes a denormal result to a signed zero, the chain starts from 0 (or from C, a
//! denormal C counting as zero) and an odd k is padded with a zero pair. A bf16 product is exact
//! in `f32`, so each step has one possible result wherever it runs: the `vdpbf16ps` path and the
//! portable path (scalar, with the flushes written out) agree bit for bit, and blocking along k
//! stores and reloads the running value exactly.
//!
//! The paths: [`Bf16Path::Avx512Bf16`] (8 × 32 tiles of `vdpbf16ps`) where the CPU has
//! AVX512_BF16, else [`Bf16Path::Portable`], which is exact but slow (about 1 GFLOP/s).

use std::sync::Mutex;

use super::pack::{on_tile, Layout};
use super::GemmPath;

/// A bf16 kernel path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Path {
    /// Scalar emulation of `vdpbf16ps`: any CPU.
    Portable,
    /// 8×32 tiles of `vdpbf16ps` (needs AVX512_BF16, AVX-512F and AVX512BW).
    Avx512Bf16,
}

impl Bf16Path {
    pub const ALL: [Bf16Path; 2] = [Bf16Path::Portable, Bf16Path::Avx512Bf16];

    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::Portable => "portable",
            Bf16Path::Avx512Bf16 => "avx512_bf16",
        }
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            Bf16Path::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Bf16Path::Avx512Bf16 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Bf16Path::Avx512Bf16 => false,
        }
    }

    /// Every path this CPU can run, slowest first.
    pub fn available() -> Vec<Bf16Path> {
        Self::ALL.into_iter().filter(|p| p.supported()).collect()
    }

    /// The path the process uses: `vdpbf16ps` where the CPU has it, unless `EZERO_GEMM` forced
    /// the portable f32 path (then the portable bf16 one, so tests can force both).
    pub fn current() -> Bf16Path {
        let native = Bf16Path::Avx512Bf16;
        if GemmPath::current() != GemmPath::Portable && native.supported() {
            native
        } else {
            Bf16Path::Portable
        }
    }
}

/// `x` rounded to bf16 as `vcvtne2ps2bf16` does: a denormal is a signed zero, NaN stays NaN
/// (made quiet), anything else rounds to nearest even. (A normal `f32` cannot round to a
/// denormal bf16, so the product never sees one.)
#[inline(always)]
pub fn to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    if x.is_subnormal() {
        return ((bits >> 16) & 0x8000) as u16;
    }
    // No overflow: the largest non-NaN pattern is -inf, 0xff80_0000.
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// The `f32` a bf16 stands for.
#[inline(always)]
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `x` rounded to bf16 and back (what the product sees of an operand).
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    from_bf16(to_bf16(x))
}

/// A denormal flushed to a signed zero.
#[inline(always)]
fn ftz(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// k pairs per packed block (512 values of k), so a B micro-panel (`KCP × 32` words, 32 KiB)
/// stays in L1. Measured on the model's shapes (Zen 4) against 512 and 128 pairs and other
/// MC/NC: 256 / 16 / 16 was fastest, 512 pairs lost 10% on k >= 768.
const KCP: usize = 256;
/// Rows of A packed at once, in tiles.
const MC_TILES: usize = 16;
/// Columns of B packed at once, in tiles (512 KiB of words at KCP: half of L2).
const NC_TILES: usize = 16;
const POOL_MAX: usize = 16;

/// A bf16 microkernel: an `MR × NR` tile from a packed A panel (`kcp` pairs of `MR` words) and
/// a packed B panel (`kcp` pairs of `NR` words); a word holds the even k's bf16 in its low half
/// and the odd k's in its high half.
trait Bf16Kernel {
    const MR: usize;
    const NR: usize;
    /// Packing may use the AVX512_BF16 conversions (the path's CPU has them).
    const CONVERT: bool;

    /// # Safety
    /// The CPU runs the path; `a` holds `kcp·MR` and `b` `kcp·NR` words; `c + i·ldc + j` is
    /// valid for reads and writes for every `i < MR`, `j < NR`.
    unsafe fn tile(kcp: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool);
}

struct PortableTile;

impl Bf16Kernel for PortableTile {
    const MR: usize = 4;
    const NR: usize = 8;
    const CONVERT: bool = false;

    unsafe fn tile(kcp: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
        const MR: usize = PortableTile::MR;
        const NR: usize = PortableTile::NR;
        let mut acc = [[0.0f32; NR]; MR];
        if load {
            for (i, row) in acc.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    // SAFETY: the tile is valid (trait contract).
                    *v = ftz(unsafe { *c.add(i * ldc + j) });
                }
            }
        }
        // SAFETY: the caller guarantees kcp·MR words at `a` and kcp·NR at `b`.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(a, kcp * MR),
                std::slice::from_raw_parts(b, kcp * NR),
            )
        };
        let halves = |w: u32| (from_bf16(w as u16), from_bf16((w >> 16) as u16));
        for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
            for (row, &aw) in acc.iter_mut().zip(ap) {
                let (a0, a1) = halves(aw);
                for (v, &bw) in row.iter_mut().zip(bp) {
                    let (b0, b1) = halves(bw);
                    *v = ftz(a0.mul_add(b0, ftz(a1.mul_add(b1, *v))));
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

#[cfg(target_arch = "x86_64")]
struct Avx512Bf16Tile;

#[cfg(target_arch = "x86_64")]
impl Bf16Kernel for Avx512Bf16Tile {
    const MR: usize = 8;
    const NR: usize = 32;
    const CONVERT: bool = true;

    unsafe fn tile(kcp: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
        // SAFETY: forwarded trait contract (the CPU has AVX512_BF16, pointers valid).
        unsafe { tile_8x32(kcp, a, b, c, ldc, load) }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_8x32(kcp: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
    use std::arch::x86_64::*;
    const MR: usize = 8;
    const NR: usize = 32;
    // SAFETY (whole body): offsets stay inside the trait contract: `a + q·MR + i`,
    // `b + q·NR + 0..32`, `c + i·ldc + 0..32`. `__m512bh` and `__m512i` are both 64 bytes of
    // plain data, so reinterpreting one as the other is sound.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        if load {
            for (i, r) in acc.iter_mut().enumerate() {
                r[0] = _mm512_loadu_ps(c.add(i * ldc));
                r[1] = _mm512_loadu_ps(c.add(i * ldc + 16));
            }
        }
        let (mut a, mut b) = (a, b);
        for _ in 0..kcp {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(16).cast()));
            for (i, r) in acc.iter_mut().enumerate() {
                let ai: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(i) as i32));
                r[0] = _mm512_dpbf16_ps(r[0], ai, b0);
                r[1] = _mm512_dpbf16_ps(r[1], ai, b1);
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

/// 64-byte aligned storage for packed words.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u32; 16]);

#[derive(Default)]
struct Buffers {
    a: Vec<Line>,
    b: Vec<Line>,
}

static POOL: Mutex<Vec<Buffers>> = Mutex::new(Vec::new());

fn words(v: &mut Vec<Line>, len: usize) -> &mut [u32] {
    let lines = len.div_ceil(16);
    if v.len() < lines {
        v.resize(lines, Line([0; 16]));
    }
    // SAFETY: `Line` is `repr(C)` around `[u32; 16]` with no padding, so `lines` of them are
    // `16·lines` initialised, contiguous `u32`s.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u32>(), lines * 16) }
}

/// Packs the `width × 2·kcp` block at (`w0`, `p0`) of `view` (element `(w, p)`), `k` values
/// of it real, into panels of `pw` words per k pair: word `(q, w)` of panel `t` holds the bf16
/// of `(t·pw + w, p0 + 2q)` low and of `(.., p0 + 2q + 1)` high; zero past the width or `k`.
/// With `convert` (the CPU has AVX512_BF16), the bulk converts sixteen values per instruction;
/// the conversion instruction rounds exactly as [`to_bf16`], so the words are the same.
#[allow(clippy::too_many_arguments)]
pub(super) fn pack(
    src: &[f32],
    view: Layout,
    w0: usize,
    width: usize,
    p0: usize,
    k: usize,
    pw: usize,
    dst: &mut [u32],
    convert: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if convert {
        if view.row_stride == 1 {
            // SAFETY: the caller checked AVX512_BF16; bounds are checked inside.
            return unsafe { simd::pack_width_contiguous(src, view, w0, width, p0, k, pw, dst) };
        }
        if view.col_stride == 1 {
            // SAFETY: as above.
            return unsafe { simd::pack_k_contiguous(src, view, w0, width, p0, k, pw, dst) };
        }
    }
    let _ = convert;
    pack_scalar(src, view, w0, width, p0, k, pw, dst);
}

/// [`pack`], one value at a time.
#[allow(clippy::too_many_arguments)]
pub(super) fn pack_scalar(
    src: &[f32],
    view: Layout,
    w0: usize,
    width: usize,
    p0: usize,
    k: usize,
    pw: usize,
    dst: &mut [u32],
) {
    let kcp = k.div_ceil(2);
    let at = |w: usize, p: usize| -> u32 {
        if p < k {
            to_bf16(src[view.index(w0 + w, p0 + p)]) as u32
        } else {
            0
        }
    };
    for (t, panel) in dst
        .chunks_exact_mut(kcp * pw)
        .take(width.div_ceil(pw))
        .enumerate()
    {
        let live = (width - t * pw).min(pw);
        for q in 0..kcp {
            let step = &mut panel[q * pw..(q + 1) * pw];
            for (w, word) in step.iter_mut().enumerate() {
                *word = if w < live {
                    let ww = t * pw + w;
                    at(ww, 2 * q) | (at(ww, 2 * q + 1) << 16)
                } else {
                    0
                };
            }
        }
    }
}

/// The vector packing of the AVX512_BF16 path.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{pack_scalar, to_bf16, Layout, KCP};
    use crate::model::gemm::transpose::transpose_8x8;

    /// Sixteen words from sixteen values of two k steps: `lo` in the low halves, `hi` in the
    /// high ones.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn pair_words(lo: __m512, hi: __m512) -> __m512i {
        // After the conversion, lo's 16 bf16 are elements 0..16 and hi's 16..32; interleave.
        let idx = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        // SAFETY: `__m512bh` and `__m512i` are both 64 bytes of plain data.
        let v: __m512i = unsafe { std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo)) };
        _mm512_permutexvar_epi16(idx, v)
    }

    /// [`super::pack`] where the width is contiguous (B of a linear forward's input gradient, a
    /// transposed A): sixteen columns of two k steps make sixteen words.
    ///
    /// # Safety
    /// The CPU has AVX512_BF16 and AVX512BW.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pack_width_contiguous(
        src: &[f32],
        view: Layout,
        w0: usize,
        width: usize,
        p0: usize,
        k: usize,
        pw: usize,
        dst: &mut [u32],
    ) {
        // The scalar pass writes the ragged edge and the padding; the vector pass below
        // overwrites the whole runs of sixteen with the same words.
        let whole = width / 16 * 16;
        if whole < width || !pw.is_multiple_of(8) || pw > 32 {
            pack_scalar(src, view, w0, width, p0, k, pw, dst);
        }
        if whole == 0 || !pw.is_multiple_of(8) || pw > 32 {
            return;
        }
        let kcp = k.div_ceil(2);
        let mut words = [0u32; 16];
        for q in 0..kcp {
            let (p_lo, p_hi) = (p0 + 2 * q, p0 + 2 * q + 1);
            for c in (0..whole).step_by(16) {
                let at = |p: usize| view.index(w0 + c, p);
                assert!(at(p_lo) + 16 <= src.len());
                // SAFETY: 16 contiguous values from `at(p)` are in `src` (asserted; the run
                // p_hi is checked below), the CPU has the features (caller).
                let v = unsafe {
                    let lo = _mm512_loadu_ps(src.as_ptr().add(at(p_lo)));
                    let hi = if p_hi < p0 + k {
                        assert!(at(p_hi) + 16 <= src.len());
                        _mm512_loadu_ps(src.as_ptr().add(at(p_hi)))
                    } else {
                        _mm512_setzero_ps()
                    };
                    pair_words(lo, hi)
                };
                // SAFETY: `words` holds 16 u32.
                unsafe { _mm512_storeu_si512(words.as_mut_ptr().cast(), v) };
                // Deal the sixteen words out to their panels, `pw` (8, 16 or 32) per step.
                for (s, piece) in words.chunks_exact(8).enumerate() {
                    let w = c + 8 * s;
                    let (t, at_w) = (w / pw, w % pw);
                    let base = (t * kcp + q) * pw + at_w;
                    dst[base..base + 8].copy_from_slice(piece);
                }
            }
        }
    }

    /// [`super::pack`] where k is contiguous (a linear forward's weight, a row-major A): each
    /// row of eight converts to a run of words, and 8 × 8 transposes move them into the panel.
    ///
    /// # Safety
    /// The CPU has AVX512_BF16 and AVX512BW.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pack_k_contiguous(
        src: &[f32],
        view: Layout,
        w0: usize,
        width: usize,
        p0: usize,
        k: usize,
        pw: usize,
        dst: &mut [u32],
    ) {
        if !pw.is_multiple_of(8) {
            return pack_scalar(src, view, w0, width, p0, k, pw, dst);
        }
        let kcp = k.div_ceil(2);
        let k32 = k / 32 * 32;
        let mut rows = [0u32; 8 * KCP];
        for (t, panel) in dst
            .chunks_exact_mut(kcp * pw)
            .take(width.div_ceil(pw))
            .enumerate()
        {
            let live = (width - t * pw).min(pw);
            let whole = live / 8 * 8;
            for w in (0..whole).step_by(8) {
                for r in 0..8 {
                    let row = view.index(w0 + t * pw + w + r, p0);
                    let out = &mut rows[r * KCP..r * KCP + kcp];
                    assert!(row + k <= src.len());
                    for p in (0..k32).step_by(32) {
                        // SAFETY: values row + p .. row + p + 32 are in `src` (p + 32 <= k,
                        // asserted), `out[p/2..p/2 + 16]` is in `rows`.
                        unsafe {
                            let lo = _mm512_loadu_ps(src.as_ptr().add(row + p));
                            let hi = _mm512_loadu_ps(src.as_ptr().add(row + p + 16));
                            // The pairs are adjacent values: the conversion's natural order.
                            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                            _mm512_storeu_si512(out.as_mut_ptr().add(p / 2).cast(), v);
                        }
                    }
                    let at = |p: usize| {
                        if p < k {
                            to_bf16(src[row + p]) as u32
                        } else {
                            0
                        }
                    };
                    for (q, word) in out.iter_mut().enumerate().skip(k32 / 2) {
                        *word = at(2 * q) | (at(2 * q + 1) << 16);
                    }
                }
                let q8 = kcp / 8 * 8;
                for q in (0..q8).step_by(8) {
                    // SAFETY: AVX is part of AVX-512; rows r·KCP + q..q+8 are in `rows`, and
                    // panel rows q..q+8 hold words w..w+8 (w + 8 <= pw).
                    unsafe {
                        transpose_8x8(
                            rows.as_ptr().add(q).cast(),
                            KCP,
                            panel.as_mut_ptr().add(q * pw + w).cast(),
                            pw,
                        )
                    };
                }
                for q in q8..kcp {
                    for r in 0..8 {
                        panel[q * pw + w + r] = rows[r * KCP + q];
                    }
                }
            }
            for w in whole..pw {
                for q in 0..kcp {
                    panel[q * pw + w] = if w < live {
                        let row = view.index(w0 + t * pw + w, p0);
                        let at = |p: usize| {
                            if p < k {
                                to_bf16(src[row + p]) as u32
                            } else {
                                0
                            }
                        };
                        at(2 * q) | (at(2 * q + 1) << 16)
                    } else {
                        0
                    };
                }
            }
        }
    }
}

/// `C (+)= A · B` in bf16 with the process's path ([`Bf16Path::current`]); see the module docs
/// for the arithmetic. `lc` must not map two elements to one slot.
pub fn gemm_bf16(
    a: &[f32],
    la: Layout,
    b: &[f32],
    lb: Layout,
    c: &mut [f32],
    lc: Layout,
    acc: bool,
) {
    gemm_bf16_with(Bf16Path::current(), a, la, b, lb, c, lc, acc);
}

/// [`gemm_bf16`] on a given path (an unsupported path runs the portable one).
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_with(
    path: Bf16Path,
    a: &[f32],
    la: Layout,
    b: &[f32],
    lb: Layout,
    c: &mut [f32],
    lc: Layout,
    acc: bool,
) {
    assert!(
        la.cols == lb.rows && lc.rows == la.rows && lc.cols == lb.cols,
        "gemm_bf16 shape mismatch: {la:?} x {lb:?} -> {lc:?}"
    );
    assert!(
        la.fits(a.len()) && lb.fits(b.len()) && lc.fits(c.len()),
        "gemm_bf16 operand out of bounds"
    );
    if la.rows == 0 || lb.cols == 0 {
        return;
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        Bf16Path::Avx512Bf16 if path.supported() => {
            drive::<Avx512Bf16Tile>(a, la, b, lb, c, lc, acc)
        }
        _ => drive::<PortableTile>(a, la, b, lb, c, lc, acc),
    }
}

fn drive<K: Bf16Kernel>(
    a: &[f32],
    la: Layout,
    b: &[f32],
    lb: Layout,
    c: &mut [f32],
    lc: Layout,
    acc: bool,
) {
    let (m, k, n) = (la.rows, la.cols, lb.cols);
    if k == 0 {
        if !acc {
            for i in 0..m {
                for j in 0..n {
                    c[lc.index(i, j)] = 0.0;
                }
            }
        }
        return;
    }
    let kc_max = 2 * KCP;
    let (mc_max, nc_max) = (MC_TILES * K::MR, NC_TILES * K::NR);
    let mut bufs = POOL
        .lock()
        .ok()
        .and_then(|mut p| p.pop())
        .unwrap_or_default();
    let kcp_max = k.min(kc_max).div_ceil(2);
    let Buffers { a: abuf, b: bbuf } = &mut bufs;
    let apack = words(abuf, m.min(mc_max).next_multiple_of(K::MR) * kcp_max);
    let bpack = words(bbuf, n.min(nc_max).next_multiple_of(K::NR) * kcp_max);
    let lbt = lb.transposed();
    for j0 in (0..n).step_by(nc_max) {
        let nc = (n - j0).min(nc_max);
        for p0 in (0..k).step_by(kc_max) {
            let kc = (k - p0).min(kc_max);
            let kcp = kc.div_ceil(2);
            pack(b, lbt, j0, nc, p0, kc, K::NR, bpack, K::CONVERT);
            let load = acc || p0 > 0;
            for i0 in (0..m).step_by(mc_max) {
                let mc = (m - i0).min(mc_max);
                pack(a, la, i0, mc, p0, kc, K::MR, apack, K::CONVERT);
                for jr in (0..nc).step_by(K::NR) {
                    let nr = (nc - jr).min(K::NR);
                    let bp = bpack[jr * kcp..].as_ptr();
                    for ir in (0..mc).step_by(K::MR) {
                        let mr = (mc - ir).min(K::MR);
                        let ap = apack[ir * kcp..].as_ptr();
                        let (i, j) = (i0 + ir, j0 + jr);
                        let tile = (K::MR, K::NR);
                        on_tile(c, lc, (i, j), (mr, nr), tile, load, |dst, row_stride| {
                            // SAFETY: the caller checked the CPU; the panels hold kcp·MR and
                            // kcp·NR words; `on_tile` hands a whole MR × NR tile, columns
                            // contiguous.
                            unsafe { K::tile(kcp, ap, bp, dst, row_stride, load) }
                        });
                    }
                }
            }
        }
    }
    if let Ok(mut p) = POOL.lock() {
        if p.len() < POOL_MAX {
            p.push(bufs);
        }
    }
}

/// The contract written out, element by element. Tests hold every path to it.
#[cfg(test)]
pub(crate) fn reference_bf16(
    a: &[f32],
    la: Layout,
    b: &[f32],
    lb: Layout,
    c: &mut [f32],
    lc: Layout,
    acc: bool,
) {
    let k = la.cols;
    let op = |x: &[f32], l: Layout, i: usize, p: usize| {
        if p < k {
            round_bf16(x[l.index(i, p)])
        } else {
            0.0
        }
    };
    for i in 0..la.rows {
        for j in 0..lb.cols {
            let slot = lc.index(i, j);
            let mut s = if acc { ftz(c[slot]) } else { 0.0 };
            for q in 0..k.div_ceil(2) {
                let (odd, even) = (2 * q + 1, 2 * q);
                let bt = lb.transposed();
                s = ftz(op(a, la, i, odd).mul_add(op(b, bt, j, odd), s));
                s = ftz(op(a, la, i, even).mul_add(op(b, bt, j, even), s));
            }
            c[slot] = s;
        }
    }
}
