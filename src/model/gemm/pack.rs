//! The blocked driver every kernel path shares: cache blocking, packing of A and B into
//! contiguous zero-padded panels, partial tiles. Only the microkernel differs between paths.

use std::sync::Mutex;

use super::transpose;

/// Where a (possibly strided) matrix lives inside a flat buffer.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl Layout {
    /// Rows of `cols` contiguous elements, `row_stride` apart, starting at `offset`.
    pub fn strided(offset: usize, rows: usize, cols: usize, row_stride: usize) -> Self {
        let col_stride = 1;
        Self {
            offset,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    pub fn row_major(rows: usize, cols: usize) -> Self {
        Self::strided(0, rows, cols, cols)
    }

    pub fn transposed(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Flat index of element `(i, j)`.
    #[inline(always)]
    pub fn index(&self, i: usize, j: usize) -> usize {
        self.offset + i * self.row_stride + j * self.col_stride
    }

    /// Whether every element lies inside a buffer of `len` elements (overflow means no).
    pub fn fits(&self, len: usize) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last_row = (self.rows - 1).checked_mul(self.row_stride);
        let last_col = (self.cols - 1).checked_mul(self.col_stride);
        let last = last_row
            .zip(last_col)
            .and_then(|(r, c)| r.checked_add(c)?.checked_add(self.offset));
        last.is_some_and(|i| i < len)
    }
}

/// One path's microkernel: an `MR × NR` tile of C from a packed A panel (`kc` steps of `MR`
/// values) and a packed B panel (`kc` steps of `NR` values).
pub(super) trait Microkernel {
    const MR: usize;
    const NR: usize;

    /// `c[i][j] = fma chain over p of a[p·MR + i] · b[p·NR + j]`, starting from `c[i][j]` when
    /// `load`, else from 0; row `i` of the tile starts at `c + i·ldc`.
    ///
    /// # Safety
    /// The CPU runs the path's instructions; `a` holds `kc·MR` and `b` `kc·NR` readable values;
    /// `c + i·ldc + j` is valid for reads and writes for every `i < MR`, `j < NR`.
    unsafe fn tile(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, load: bool);
}

/// Depth of a packed block, so C is loaded and stored once per 512 steps of each chain. At 512
/// a B micro-panel (`KC × NR`, 64 KiB on AVX-512) streams from L2 rather than staying in L1;
/// 512 still measured fastest on the k = 1024 model shapes (256 and 1024 were slower).
const KC: usize = 512;
/// Rows of A packed at once, in tiles (the packed block stays in L2).
const MC_TILES: usize = 16;
/// Columns of B packed at once, in tiles (the packed block stays in L2/L3).
const NC_TILES: usize = 32;
/// Largest `MR · NR` of any path (the scratch tile of partial tiles).
const MAX_TILE: usize = 256;
/// Packing buffer pairs kept for reuse (rank threads are short-lived; a fresh megabyte per
/// product would cost page faults).
const POOL_MAX: usize = 16;

/// 64-byte aligned storage, so panel rows start on cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

#[derive(Default)]
struct Buffers {
    a: Vec<Line>,
    b: Vec<Line>,
}

static POOL: Mutex<Vec<Buffers>> = Mutex::new(Vec::new());

impl Buffers {
    fn take() -> Self {
        POOL.lock()
            .ok()
            .and_then(|mut p| p.pop())
            .unwrap_or_default()
    }

    fn give_back(self) {
        if let Ok(mut p) = POOL.lock() {
            if p.len() < POOL_MAX {
                p.push(self);
            }
        }
    }
}

/// `v` grown to at least `len` floats, as an `f32` slice.
fn floats(v: &mut Vec<Line>, len: usize) -> &mut [f32] {
    let lines = len.div_ceil(16);
    if v.len() < lines {
        v.resize(lines, Line([0.0; 16]));
    }
    // SAFETY: `Line` is `repr(C)` around `[f32; 16]` with no padding (64 bytes, align 64), so
    // `lines` of them are `16·lines` initialised, contiguous `f32`s.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<f32>(), lines * 16) }
}

/// Copies the `width × kc` block of `src` at (`w0`, `p0`) of `view` (element `(w, p)` at
/// `view.index(w, p)`) into panels of `pw` rows of the width: panel `t` holds, for each `p`,
/// the `pw` values `w = t·pw ..` (0 past `width`). The loop runs along whichever dimension is
/// contiguous in `src`, so a transposed operand is read in order too.
#[allow(clippy::too_many_arguments)]
fn pack(
    src: &[f32],
    view: Layout,
    w0: usize,
    width: usize,
    p0: usize,
    kc: usize,
    pw: usize,
    dst: &mut [f32],
) {
    if view.row_stride != 1 {
        return gather(src, view, w0, width, p0, kc, pw, dst);
    }
    #[cfg(target_arch = "x86_64")]
    if transpose::supported() {
        // SAFETY: AVX is present.
        return unsafe { deal_avx(src, view, w0, width, p0, kc, pw, dst) };
    }
    deal(src, view, w0, width, p0, kc, pw, dst)
}

/// [`pack`] where k is contiguous (a linear forward's weight, a row-major A), or nothing is:
/// read each row of the width along k, eight rows by eight k steps at a time with AVX
/// transposes where the block is whole.
#[allow(clippy::too_many_arguments)]
fn gather(
    src: &[f32],
    view: Layout,
    w0: usize,
    width: usize,
    p0: usize,
    kc: usize,
    pw: usize,
    dst: &mut [f32],
) {
    let fast = view.col_stride == 1 && transpose::supported();
    let kc8 = kc / 8 * 8;
    for (t, panel) in dst
        .chunks_exact_mut(kc * pw)
        .take(width.div_ceil(pw))
        .enumerate()
    {
        let live = (width - t * pw).min(pw);
        let wt = w0 + t * pw;
        let whole = if fast { live / 8 * 8 } else { 0 };
        for w in (0..whole).step_by(8) {
            let row = view.index(wt + w, p0);
            // Bounds of the block, checked once: rows w..w+8 of the width, k steps 0..kc8.
            assert!(row + 7 * view.row_stride + kc8 <= src.len() || kc8 == 0);
            for p in (0..kc8).step_by(8) {
                // SAFETY: AVX is present (`supported`); the 8 source rows hold k steps
                // p..p+8 (asserted above), and the destination rows p..p+8 of the panel
                // hold columns w..w+8 (w + 8 <= pw, (p + 8)·pw <= kc·pw).
                unsafe {
                    transpose::transpose_8x8(
                        src.as_ptr().add(row + p),
                        view.row_stride,
                        panel.as_mut_ptr().add(p * pw + w),
                        pw,
                    )
                };
            }
        }
        for w in 0..pw {
            let first_p = if w < whole { kc8 } else { 0 };
            if w < live {
                let row = view.index(wt + w, p0);
                for p in first_p..kc {
                    panel[p * pw + w] = src[row + p * view.col_stride];
                }
            } else {
                for p in 0..kc {
                    panel[p * pw + w] = 0.0;
                }
            }
        }
    }
}

/// [`pack`] where the width is contiguous (a transposed A, a row-major B): read each k step's
/// whole run of the width in order (one pass down the source, which the prefetcher follows)
/// and deal it out to the panels. The copies are one panel width (4 to 32 floats): as
/// `copy_from_slice` each was a `memmove` call, a fifth of a weight-gradient product's time, so
/// full runs are copied as fixed-size arrays, which compile to a few vector moves (with AVX, in
/// [`deal_avx`]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn deal(
    src: &[f32],
    view: Layout,
    w0: usize,
    width: usize,
    p0: usize,
    kc: usize,
    pw: usize,
    dst: &mut [f32],
) {
    fn fixed<const N: usize>(dst: &mut [f32], src: &[f32]) {
        let v: &[f32; N] = src.try_into().expect("equal lengths");
        let d: &mut [f32; N] = dst.try_into().expect("equal lengths");
        *d = *v;
    }
    let panels = width.div_ceil(pw);
    for p in 0..kc {
        let s = view.index(w0, p0 + p);
        let run = &src[s..s + width];
        for t in 0..panels {
            let live = (width - t * pw).min(pw);
            let step = &mut dst[(t * kc + p) * pw..(t * kc + p + 1) * pw];
            let from = &run[t * pw..t * pw + live];
            // Every path's MR and NR.
            match (live == pw, pw) {
                (true, 4) => fixed::<4>(step, from),
                (true, 6) => fixed::<6>(step, from),
                (true, 8) => fixed::<8>(step, from),
                (true, 16) => fixed::<16>(step, from),
                (true, 32) => fixed::<32>(step, from),
                _ => {
                    step[..live].copy_from_slice(from);
                    step[live..].fill(0.0);
                }
            }
        }
    }
}

/// [`deal`] compiled with AVX.
///
/// # Safety
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[allow(clippy::too_many_arguments)]
unsafe fn deal_avx(
    src: &[f32],
    view: Layout,
    w0: usize,
    width: usize,
    p0: usize,
    kc: usize,
    pw: usize,
    dst: &mut [f32],
) {
    deal(src, view, w0, width, p0, kc, pw, dst)
}

/// `C (+)= A · B` through microkernel `K`. Shapes and bounds were checked by the caller, and
/// the caller checked that the CPU runs `K`'s instructions.
pub(super) fn drive<K: Microkernel>(
    a: &[f32],
    la: Layout,
    b: &[f32],
    lb: Layout,
    c: &mut [f32],
    lc: Layout,
    acc: bool,
) {
    let (m, k, n) = (la.rows, la.cols, lb.cols);
    debug_assert!(K::MR * K::NR <= MAX_TILE);
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
    let (mc_max, nc_max) = (MC_TILES * K::MR, NC_TILES * K::NR);
    let mut bufs = Buffers::take();
    let kc_max = k.min(KC);
    let a_len = m.min(mc_max).next_multiple_of(K::MR) * kc_max;
    let b_len = n.min(nc_max).next_multiple_of(K::NR) * kc_max;
    let Buffers { a: abuf, b: bbuf } = &mut bufs;
    let apack = floats(abuf, a_len);
    let bpack = floats(bbuf, b_len);
    for j0 in (0..n).step_by(nc_max) {
        let nc = (n - j0).min(nc_max);
        for p0 in (0..k).step_by(KC) {
            let kc = (k - p0).min(KC);
            pack(b, lb.transposed(), j0, nc, p0, kc, K::NR, bpack);
            // After the first k block, C holds the chain so far: continue it.
            let load = acc || p0 > 0;
            for i0 in (0..m).step_by(mc_max) {
                let mc = (m - i0).min(mc_max);
                pack(a, la, i0, mc, p0, kc, K::MR, apack);
                for jr in (0..nc).step_by(K::NR) {
                    let nr = (nc - jr).min(K::NR);
                    let bp = bpack[jr * kc..].as_ptr();
                    for ir in (0..mc).step_by(K::MR) {
                        let mr = (mc - ir).min(K::MR);
                        let ap = apack[ir * kc..].as_ptr();
                        let (i, j) = (i0 + ir, j0 + jr);
                        let tile = (K::MR, K::NR);
                        on_tile(c, lc, (i, j), (mr, nr), tile, load, |dst, row_stride| {
                            // SAFETY: the caller checked the CPU; the panels hold kc·MR and
                            // kc·NR values (packed above); `on_tile` hands a whole MR × NR
                            // tile, columns contiguous.
                            unsafe { K::tile(kc, ap, bp, dst, row_stride, load) }
                        });
                    }
                }
            }
        }
    }
    bufs.give_back();
}

/// Runs a microkernel on the `mr × nr` block of C at `(i, j)`, whose whole tile is `tile`
/// (rows × columns): straight into C when the block is a whole tile with contiguous columns,
/// else through a scratch tile that starts as C's block (when the chain continues, `load`) and
/// is copied back. `kernel(dst, row_stride)` writes one whole tile at `dst`.
pub(super) fn on_tile(
    c: &mut [f32],
    lc: Layout,
    (i, j): (usize, usize),
    (mr, nr): (usize, usize),
    tile: (usize, usize),
    load: bool,
    kernel: impl FnOnce(*mut f32, usize),
) {
    if (mr, nr) == tile && lc.col_stride == 1 {
        kernel(c[lc.index(i, j)..].as_mut_ptr(), lc.row_stride);
        return;
    }
    let tnr = tile.1;
    let mut t = [0.0f32; MAX_TILE];
    debug_assert!(tile.0 * tnr <= MAX_TILE);
    if load {
        for ii in 0..mr {
            for jj in 0..nr {
                t[ii * tnr + jj] = c[lc.index(i + ii, j + jj)];
            }
        }
    }
    kernel(t.as_mut_ptr(), tnr);
    for ii in 0..mr {
        for jj in 0..nr {
            c[lc.index(i + ii, j + jj)] = t[ii * tnr + jj];
        }
    }
}
