//! SGD with momentum on a flat `f32` shard, with `torch.optim.SGD` semantics (dampening 0):
//! `g += wd * p`; `buf = g` on the first step, else `buf = mu * buf + g`; Nesterov uses
//! `g + mu * buf`, plain momentum uses `buf`; then `p -= lr * update`.
//!
//! Same structure and bit-reproducibility guarantees as [`super::adam`]: one fused pass, fixed
//! 16-lane chunks, run-time SIMD dispatch, identical bits to [`sgd_step_scalar`].

use serde::{Deserialize, Serialize};

use super::{multiversion, piece_len, prefetch_streams, Isa, PREFETCH_AHEAD};

/// SGD hyper-parameters (the learning rate comes per step). `momentum` 0 disables the buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SgdHyper {
    pub momentum: f64,
    /// Nesterov momentum; needs `momentum > 0`, as in PyTorch.
    pub nesterov: bool,
    pub weight_decay: f64,
}

/// Per-step constants, rounded to `f32` once.
#[derive(Clone, Copy, Debug)]
struct StepScalars {
    momentum: f32,
    weight_decay: f32,
    lr: f32,
    /// Branches below are uniform over the shard; LLVM hoists them out of the loop.
    use_momentum: bool,
    first: bool,
    nesterov: bool,
    use_weight_decay: bool,
}

impl StepScalars {
    fn new(hp: &SgdHyper, t: u64, lr: f32) -> Self {
        assert!(t >= 1, "SGD step numbers are 1-based (t = {t})");
        assert!(
            !hp.nesterov || hp.momentum > 0.0,
            "Nesterov SGD needs momentum > 0 (got {})",
            hp.momentum
        );
        Self {
            momentum: hp.momentum as f32,
            weight_decay: hp.weight_decay as f32,
            lr,
            use_momentum: hp.momentum != 0.0,
            first: t == 1,
            nesterov: hp.nesterov,
            // PyTorch skips the add entirely when wd == 0 (so -0.0 gradients stay -0.0).
            use_weight_decay: hp.weight_decay != 0.0,
        }
    }
}

/// One SGD step on a shard, in place. `buf` is the momentum buffer (same length as `p`; may be
/// empty when `hp.momentum == 0`), `t` the 1-based step (`t == 1` initialises the buffer),
/// `threads` as in [`super::adam_step`].
pub fn sgd_step(
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    hp: &SgdHyper,
    t: u64,
    lr: f32,
    threads: usize,
) {
    sgd_step_isa(Isa::best(), p, g, buf, hp, t, lr, threads);
}

#[allow(clippy::too_many_arguments)] // sgd_step plus the instruction set, for tests
pub(crate) fn sgd_step_isa(
    isa: Isa,
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    hp: &SgdHyper,
    t: u64,
    lr: f32,
    threads: usize,
) {
    check_lengths(p, g, buf, hp);
    let k = StepScalars::new(hp, t, lr);
    let piece = piece_len(p.len(), threads);
    if !k.use_momentum {
        // No buffer: give the kernel an equally long dummy view it never touches.
        if piece >= p.len() {
            sgd_kernel(isa, p, g, &mut [], &k);
            return;
        }
        rayon::scope(|s| {
            let mut pieces = p.chunks_mut(piece).zip(g.chunks(piece));
            let first = pieces.next();
            for (p, g) in pieces {
                s.spawn(move |_| sgd_kernel(isa, p, g, &mut [], &k));
            }
            if let Some((p, g)) = first {
                sgd_kernel(isa, p, g, &mut [], &k);
            }
        });
        return;
    }
    if piece >= p.len() {
        sgd_kernel(isa, p, g, buf, &k);
        return;
    }
    rayon::scope(|s| {
        let mut pieces = p
            .chunks_mut(piece)
            .zip(g.chunks(piece))
            .zip(buf.chunks_mut(piece));
        let first = pieces.next();
        for ((p, g), b) in pieces {
            s.spawn(move |_| sgd_kernel(isa, p, g, b, &k));
        }
        if let Some(((p, g), b)) = first {
            sgd_kernel(isa, p, g, b, &k);
        }
    });
}

/// The reference, one element at a time, following `torch.optim.SGD` line by line.
pub fn sgd_step_scalar(p: &mut [f32], g: &[f32], buf: &mut [f32], hp: &SgdHyper, t: u64, lr: f32) {
    check_lengths(p, g, buf, hp);
    let k = StepScalars::new(hp, t, lr);
    for i in 0..p.len() {
        let mut d = g[i];
        if k.use_weight_decay {
            d += k.weight_decay * p[i];
        }
        if k.use_momentum {
            buf[i] = if k.first { d } else { k.momentum * buf[i] + d };
            d = if k.nesterov {
                d + k.momentum * buf[i]
            } else {
                buf[i]
            };
        }
        p[i] -= k.lr * d;
    }
}

fn check_lengths(p: &[f32], g: &[f32], buf: &[f32], hp: &SgdHyper) {
    let buf_ok = buf.len() == p.len() || (hp.momentum == 0.0 && buf.is_empty());
    assert!(
        g.len() == p.len() && buf_ok,
        "sgd: shard lengths differ (p {}, g {}, buf {}; buf may be empty only without momentum)",
        p.len(),
        g.len(),
        buf.len()
    );
}

const LANES: usize = 16;

/// The per-element update shared by vector lanes and scalar tail; returns `(p, buf)`.
#[inline(always)]
fn update(k: &StepScalars, p: f32, g: f32, buf: f32) -> (f32, f32) {
    let mut d = g;
    if k.use_weight_decay {
        d += k.weight_decay * p;
    }
    let mut b = buf;
    if k.use_momentum {
        b = if k.first { d } else { k.momentum * buf + d };
        d = if k.nesterov { d + k.momentum * b } else { b };
    }
    (p - k.lr * d, b)
}

#[inline(always)]
fn sgd_body(p: &mut [f32], g: &[f32], buf: &mut [f32], k: &StepScalars) {
    // One length for all streams (checked by the caller) so LLVM needs one loop exit test.
    let n = p.len();
    let g = &g[..n];
    let prefetch_end = n.saturating_sub(PREFETCH_AHEAD);
    if !k.use_momentum {
        let streams = [p.as_ptr(), g.as_ptr()];
        let mut p_chunks = p.chunks_exact_mut(LANES);
        let mut g_chunks = g.chunks_exact(LANES);
        for (c, (p, g)) in (&mut p_chunks).zip(&mut g_chunks).enumerate() {
            prefetch_streams(&streams, c * LANES, prefetch_end);
            for j in 0..LANES {
                p[j] = update(k, p[j], g[j], 0.0).0;
            }
        }
        for (p, g) in p_chunks
            .into_remainder()
            .iter_mut()
            .zip(g_chunks.remainder())
        {
            *p = update(k, *p, *g, 0.0).0;
        }
        return;
    }
    let buf = &mut buf[..n];
    let streams = [p.as_ptr(), g.as_ptr(), buf.as_ptr()];
    let mut p_chunks = p.chunks_exact_mut(LANES);
    let mut g_chunks = g.chunks_exact(LANES);
    let mut b_chunks = buf.chunks_exact_mut(LANES);
    let chunks = (&mut p_chunks).zip(&mut g_chunks).zip(&mut b_chunks);
    for (c, ((p, g), b)) in chunks.enumerate() {
        prefetch_streams(&streams, c * LANES, prefetch_end);
        for j in 0..LANES {
            (p[j], b[j]) = update(k, p[j], g[j], b[j]);
        }
    }
    let tail = p_chunks
        .into_remainder()
        .iter_mut()
        .zip(g_chunks.remainder())
        .zip(b_chunks.into_remainder());
    for ((p, g), b) in tail {
        (*p, *b) = update(k, *p, *g, *b);
    }
}

multiversion!(fn sgd_kernel(
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    k: &StepScalars,
) => sgd_body);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u64 + 1).wrapping_mul(seed.wrapping_mul(2654435761) | 1);
                ((x % 20011) as f32 / 20011.0 - 0.5) * 2.0
            })
            .collect()
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|f| f.to_bits()).collect()
    }

    #[test]
    fn every_path_matches_scalar_bitwise() {
        let configs = [
            SgdHyper::default(),
            SgdHyper {
                momentum: 0.9,
                nesterov: false,
                weight_decay: 0.0,
            },
            SgdHyper {
                momentum: 0.9,
                nesterov: true,
                weight_decay: 1e-2,
            },
            SgdHyper {
                momentum: 0.0,
                nesterov: false,
                weight_decay: 5e-4,
            },
        ];
        for n in [0usize, 1, 15, 16, 17, 1000, 100_003] {
            for hp in &configs {
                for isa in Isa::available() {
                    for threads in [1usize, 2, 3] {
                        let blen = if hp.momentum == 0.0 { 0 } else { n };
                        let (mut pw, mut bw) = (values(n, 1), vec![0.0; blen]);
                        let (mut pg, mut bg) = (pw.clone(), bw.clone());
                        for t in 1..=3u64 {
                            let g = values(n, 10 + t);
                            sgd_step_scalar(&mut pw, &g, &mut bw, hp, t, 0.05);
                            sgd_step_isa(isa, &mut pg, &g, &mut bg, hp, t, 0.05, threads);
                        }
                        let ctx = format!("n={n} {hp:?} {isa:?} threads={threads}");
                        assert_eq!(bits(&pg), bits(&pw), "p {ctx}");
                        assert_eq!(bits(&bg), bits(&bw), "buf {ctx}");
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Sub-slices cut anywhere, on every instruction set, give the reference's bits.
        #[test]
        fn cut_anywhere_is_bit_identical(
            n in 0usize..3000,
            cut in 0usize..3000,
            nesterov in any::<bool>(),
            t in 1u64..4,
        ) {
            let hp = SgdHyper { momentum: 0.9, nesterov, weight_decay: 1e-3 };
            let g = values(n, 5);
            let (mut pw, mut bw) = (values(n, 2), values(n, 3));
            sgd_step_scalar(&mut pw, &g, &mut bw, &hp, t, 0.1);
            let cut = cut.min(n);
            for isa in Isa::available() {
                let (mut p, mut b) = (values(n, 2), values(n, 3));
                let (p_lo, p_hi) = p.split_at_mut(cut);
                let (b_lo, b_hi) = b.split_at_mut(cut);
                sgd_step_isa(isa, p_lo, &g[..cut], b_lo, &hp, t, 0.1, 2);
                sgd_step_isa(isa, p_hi, &g[cut..], b_hi, &hp, t, 0.1, 1);
                prop_assert_eq!(bits(&p), bits(&pw), "{:?}", isa);
                prop_assert_eq!(bits(&b), bits(&bw), "{:?}", isa);
            }
        }
    }

    #[test]
    fn known_values_first_and_second_step() {
        let hp = SgdHyper {
            momentum: 0.5,
            nesterov: false,
            weight_decay: 0.0,
        };
        let (mut p, mut buf) = ([1.0f32], [123.0f32]);
        // t = 1: buf = g = 2 (the stale buffer is ignored), p = 1 - 0.1 * 2 = 0.8.
        sgd_step(&mut p, &[2.0], &mut buf, &hp, 1, 0.1, 1);
        assert_eq!((p[0], buf[0]), (0.8, 2.0));
        // t = 2: buf = 0.5 * 2 + 4 = 5, p = 0.8 - 0.1 * 5 = 0.3.
        sgd_step(&mut p, &[4.0], &mut buf, &hp, 2, 0.1, 1);
        assert_eq!(buf[0], 5.0);
        assert!((p[0] - 0.3).abs() < 1e-7);

        // Nesterov with L2 at t = 1: d = 2 + 0.5 * 1 = 2.5, buf = 2.5, update = 2.5 + 0.5 * 2.5.
        let hp = SgdHyper {
            momentum: 0.5,
            nesterov: true,
            weight_decay: 0.5,
        };
        let (mut p, mut buf) = ([1.0f32], [0.0f32]);
        sgd_step(&mut p, &[2.0], &mut buf, &hp, 1, 0.1, 1);
        assert_eq!(buf[0], 2.5);
        assert!((p[0] - (1.0 - 0.1 * 3.75)).abs() < 1e-7);
    }

    #[test]
    #[should_panic(expected = "Nesterov")]
    fn nesterov_without_momentum_panics() {
        let hp = SgdHyper {
            momentum: 0.0,
            nesterov: true,
            weight_decay: 0.0,
        };
        sgd_step(&mut [0.0], &[0.0], &mut [], &hp, 1, 0.1, 1);
    }
}
