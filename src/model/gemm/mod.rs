//! Single-threaded `f32` matrix product `C (+)= A · B` on strided views, with AVX-512, AVX2+FMA
//! and portable kernels chosen at run time, all giving the same bits.
//!
//! The contract every path keeps: each output element is **one chain of fused multiply-adds
//! along k, in increasing k**, starting from 0 (or from C's value when accumulating):
//! `c = fma(a[i, p], b[p, j], c)` for `p = 0..k`. Why that makes the paths agree:
//! - FMA is correctly rounded wherever it runs (`vfmadd` on AVX2 and AVX-512, `f32::mul_add` on
//!   the portable path, which is the C library's correctly rounded `fmaf` where the CPU has no
//!   FMA), so one step of the chain has one possible result;
//! - blocking along k stores the running value in C and reloads it, which is exact in `f32`, so
//!   cache blocks, tile shapes and vector width change speed only;
//! - padding rows and columns of a partial tile are computed and thrown away; they never meet a
//!   real element.
//!
//! So `param-sha256` is the same whichever path a rank runs, and ranks on different CPU
//! generations agree bit for bit (with `matrixmultiply`, used before, they did not: its AVX,
//! FMA and SSE kernels sum differently). `EZERO_GEMM=avx512|avx2|portable` forces a path (tests
//! and benchmarks); unset or `auto`, the widest one the CPU has is used.
//!
//! Design: docs/exact-reduction.md (the same bits on every CPU).

mod avx2;
mod avx512;
mod bf16;
mod pack;
mod portable;
mod transpose;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

pub use bf16::{from_bf16, gemm_bf16, gemm_bf16_with, round_bf16, to_bf16, Bf16Path};
pub use pack::Layout;

/// Environment variable that forces a kernel path.
pub const GEMM_ENV: &str = "EZERO_GEMM";

/// A kernel path: which microkernel computes the tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// Scalar `f32::mul_add`: any CPU, slow without hardware FMA.
    Portable,
    /// 6×16 tiles of 256-bit FMAs (needs AVX2 and FMA).
    Avx2,
    /// 8×32 tiles of 512-bit FMAs (needs AVX-512F).
    Avx512,
}

impl GemmPath {
    pub const ALL: [GemmPath; 3] = [GemmPath::Portable, GemmPath::Avx2, GemmPath::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            GemmPath::Portable => "portable",
            GemmPath::Avx2 => "avx2",
            GemmPath::Avx512 => "avx512",
        }
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            GemmPath::Portable => true,
            #[cfg(target_arch = "x86_64")]
            GemmPath::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            GemmPath::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every path this CPU can run, narrowest first.
    pub fn available() -> Vec<GemmPath> {
        Self::ALL.into_iter().filter(|p| p.supported()).collect()
    }

    /// The widest path this CPU can run.
    pub fn best() -> GemmPath {
        *Self::available().last().unwrap_or(&GemmPath::Portable)
    }

    /// The path `EZERO_GEMM` asks for (`auto` or unset: [`GemmPath::best`]), or why it cannot be
    /// used. The CLI calls this before any work, so a typo is refused rather than ignored.
    pub fn from_env() -> Result<GemmPath, String> {
        match std::env::var(GEMM_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Self::best()),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!(
                "{GEMM_ENV} is not valid UTF-8: unset it or use auto"
            )),
            Ok(v) => Self::parse(&v),
        }
    }

    /// Parses `auto|avx512|avx2|portable` and checks that this CPU can run it.
    pub fn parse(s: &str) -> Result<GemmPath, String> {
        let names = "auto, avx512, avx2, portable";
        let path = match s.trim() {
            "" | "auto" => return Ok(Self::best()),
            "avx512" => GemmPath::Avx512,
            "avx2" => GemmPath::Avx2,
            "portable" => GemmPath::Portable,
            other => {
                return Err(format!(
                    "{GEMM_ENV}={other:?}: unknown path; use one of {names}"
                ))
            }
        };
        if !path.supported() {
            let have: Vec<_> = Self::available().iter().map(|p| p.name()).collect();
            return Err(format!(
                "{GEMM_ENV}={}: this CPU cannot run that path; it can run {}",
                path.name(),
                have.join(", ")
            ));
        }
        Ok(path)
    }

    /// The path every product in this process uses: `EZERO_GEMM` read once, else the best. A
    /// value the CLI did not get to check (a library embedding) falls back to the best path
    /// with a warning; results are the same bits either way, only the speed differs.
    pub fn current() -> GemmPath {
        static CURRENT: OnceLock<GemmPath> = OnceLock::new();
        *CURRENT.get_or_init(|| {
            Self::from_env().unwrap_or_else(|e| {
                tracing::warn!("{e}; using {}", Self::best().name());
                Self::best()
            })
        })
    }
}

/// How a product's operands are stored: `Nn` both row-major, `Nt` B stored `[n, k]` (a linear
/// forward's weight), `Tn` A stored `[k, m]` (a weight gradient).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Form {
    Nn,
    Nt,
    Tn,
}

impl Form {
    /// A's and B's layouts for an `m × k × n` product in this form, and their buffers' lengths.
    pub fn layouts(self, m: usize, k: usize, n: usize) -> (Layout, Layout, usize, usize) {
        let (a, b) = match self {
            Form::Nn => (Layout::row_major(m, k), Layout::row_major(k, n)),
            Form::Nt => (
                Layout::row_major(m, k),
                Layout::row_major(n, k).transposed(),
            ),
            Form::Tn => (
                Layout::row_major(k, m).transposed(),
                Layout::row_major(k, n),
            ),
        };
        (a, b, m * k, k * n)
    }
}

/// A matrix product with [`gemm`]'s signature: what code that runs several products (attention)
/// takes, so a backend can hand it the f32 product or the bf16 one.
pub type Product = fn(&[f32], Layout, &[f32], Layout, &mut [f32], Layout, bool);

/// `C (+)= A · B` with the process's path ([`GemmPath::current`]) on up to [`threads`]
/// threads. `lc` must not map two elements to one slot (true of row-major layouts and of
/// row-major column blocks).
pub fn gemm(a: &[f32], la: Layout, b: &[f32], lb: Layout, c: &mut [f32], lc: Layout, acc: bool) {
    gemm_split(threads(), GemmPath::current(), a, la, b, lb, c, lc, acc);
}

static THREADS: AtomicUsize = AtomicUsize::new(1);

/// Sets the threads each f32 matrix product of this process may use (`compute_threads`; at
/// least 1). Every element is still one FMA chain, so the count changes no bits.
pub fn set_threads(n: usize) {
    THREADS.store(n.max(1), Ordering::Relaxed);
}

/// See [`set_threads`].
pub fn threads() -> usize {
    THREADS.load(Ordering::Relaxed)
}

/// Products below this many multiply-adds run on one thread: starting one costs tens of
/// microseconds, about what 8M multiply-adds save on a second core.
const SPLIT_MIN_FMAS: usize = 1 << 23;

/// Rows of C a thread takes at the least (a few microkernel heights).
const SPLIT_MIN_ROWS: usize = 16;

/// [`gemm_with`] on up to `threads` threads: C's rows are cut into contiguous blocks, one per
/// thread, each with A's matching rows and all of B. Only for C with rows of contiguous
/// elements (row-major or a row-major column block), so the blocks are disjoint slices.
#[allow(clippy::too_many_arguments)]
pub fn gemm_split(
    threads: usize,
    path: GemmPath,
    a: &[f32],
    la: Layout,
    b: &[f32],
    lb: Layout,
    c: &mut [f32],
    lc: Layout,
    acc: bool,
) {
    let (m, k, n) = (la.rows, la.cols, lb.cols);
    let parts = threads.min(m / SPLIT_MIN_ROWS).max(1);
    let rows_apart = lc.col_stride == 1 && lc.row_stride >= lc.cols;
    if parts < 2
        || !rows_apart
        || m.saturating_mul(k).saturating_mul(n) < SPLIT_MIN_FMAS
        || !lc.fits(c.len())
    {
        return gemm_with(path, a, la, b, lb, c, lc, acc);
    }
    let per = m.div_ceil(parts);
    let (_, mut rest) = c.split_at_mut(lc.offset);
    let mut blocks = Vec::with_capacity(parts);
    let mut r0 = 0;
    while r0 < m {
        let rows = per.min(m - r0);
        let len = if r0 + rows == m {
            rest.len()
        } else {
            rows * lc.row_stride
        };
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(len);
        rest = tail;
        let la_p = Layout {
            offset: la.offset + r0 * la.row_stride,
            rows,
            ..la
        };
        let lc_p = Layout {
            offset: 0,
            rows,
            ..lc
        };
        blocks.push((la_p, mine, lc_p));
        r0 += rows;
    }
    std::thread::scope(|s| {
        let mut blocks = blocks.into_iter();
        let (la0, c0, lc0) = blocks.next().expect("at least two blocks");
        for (la_p, c_p, lc_p) in blocks {
            s.spawn(move || gemm_with(path, a, la_p, b, lb, c_p, lc_p, acc));
        }
        gemm_with(path, a, la0, b, lb, c0, lc0, acc);
    });
}

/// [`gemm`] on a given path (tests compare paths; an unsupported path runs the portable one).
#[allow(clippy::too_many_arguments)]
pub fn gemm_with(
    path: GemmPath,
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
        "gemm shape mismatch: {la:?} x {lb:?} -> {lc:?}"
    );
    assert!(
        la.fits(a.len()) && lb.fits(b.len()) && lc.fits(c.len()),
        "gemm operand out of bounds"
    );
    if la.rows == 0 || lb.cols == 0 {
        return;
    }
    let path = if path.supported() {
        path
    } else {
        GemmPath::Portable
    };
    match path {
        GemmPath::Portable => pack::drive::<portable::Tile>(a, la, b, lb, c, lc, acc),
        GemmPath::Avx2 => pack::drive::<avx2::Tile>(a, la, b, lb, c, lc, acc),
        GemmPath::Avx512 => pack::drive::<avx512::Tile>(a, la, b, lb, c, lc, acc),
    }
}

/// The contract itself, written out: one FMA chain per element. Tests hold every path to it.
#[cfg(test)]
pub(crate) fn reference(
    a: &[f32],
    la: Layout,
    b: &[f32],
    lb: Layout,
    c: &mut [f32],
    lc: Layout,
    acc: bool,
) {
    for i in 0..la.rows {
        for j in 0..lb.cols {
            let slot = lc.index(i, j);
            let mut s = if acc { c[slot] } else { 0.0 };
            for p in 0..la.cols {
                s = a[la.index(i, p)].mul_add(b[lb.index(p, j)], s);
            }
            c[slot] = s;
        }
    }
}

#[cfg(test)]
mod tests;
