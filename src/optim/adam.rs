//! Adam and AdamW on a flat `f32` shard, with PyTorch (`torch.optim.AdamW`, `foreach=False`)
//! semantics, in one fused pass over memory.
//!
//! The step is memory-bound (28 bytes per parameter: reads of p, g, m, v and writes of p, m, v),
//! so the kernel touches each array exactly once, runs in fixed 16-lane chunks that LLVM turns
//! into SIMD, and is compiled for AVX2 and AVX-512 behind run-time detection. Bits are identical
//! to [`adam_step_scalar`] on every path; see the module docs of [`crate::optim`].

use serde::{Deserialize, Serialize};

use super::{multiversion, piece_len, prefetch_streams, Isa, PREFETCH_AHEAD};

/// Adam hyper-parameters.
///
/// Defaults: `lr` 1e-3, `beta1` 0.9, `beta2` 0.95, `eps` 1e-8, `weight_decay` 0.1, `decoupled`
/// true (AdamW): the usual GPT-style settings. Everything but `lr` is `f64`, like the Python
/// floats PyTorch derives its per-step scalars from, so each scalar is rounded to `f32` once.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdamHyper {
    /// Base learning rate; the schedule scales it and the step receives the result.
    pub lr: f32,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// `true`: AdamW, `p *= 1 - lr * wd` before the update. `false`: Adam with L2,
    /// `g += wd * p`.
    pub decoupled: bool,
}

impl Default for AdamHyper {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: true,
        }
    }
}

/// Everything that is constant across the elements of one step, each rounded to `f32` once from
/// an `f64` computation, exactly as PyTorch turns its Python-float scalars into `f32` operands.
#[derive(Clone, Copy, Debug)]
struct StepScalars {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    /// `lr / (1 - beta1^t)`.
    step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    sqrt_bias_c2: f32,
    eps: f32,
    /// AdamW: `1 - lr * wd`.
    decay: f32,
    /// Adam-L2: `wd`.
    weight_decay: f32,
}

impl StepScalars {
    fn new(hp: &AdamHyper, t: u64, lr: f32) -> Self {
        assert!(t >= 1, "Adam step numbers are 1-based (t = {t})");
        let (beta1, beta2) = (hp.beta1, hp.beta2);
        // `powf` is libm's pow, what Python's `beta ** step` calls (`powi` would multiply
        // repeatedly and round differently).
        let bias_c1 = 1.0 - beta1.powf(t as f64);
        let bias_c2 = 1.0 - beta2.powf(t as f64);
        let lr = f64::from(lr);
        Self {
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            step_size: (lr / bias_c1) as f32,
            sqrt_bias_c2: bias_c2.sqrt() as f32,
            eps: hp.eps as f32,
            decay: (1.0 - lr * hp.weight_decay) as f32,
            weight_decay: hp.weight_decay as f32,
        }
    }
}

/// One Adam step on a shard, in place: `p` parameters, `g` gradients, `m`/`v` moments (all the
/// same length), `t` the 1-based step, `lr` this step's learning rate (`hp.lr` is not read).
///
/// `threads` contiguous pieces run on the current rayon pool (`threads <= 1`, or a shard too
/// small to be worth splitting, runs inline on the caller). Results are bit-identical to
/// [`adam_step_scalar`] whatever `threads` and wherever the shard was cut.
#[allow(clippy::too_many_arguments)] // the four arrays plus per-step inputs are the interface
pub fn adam_step(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamHyper,
    t: u64,
    lr: f32,
    threads: usize,
) {
    adam_step_isa(Isa::best(), p, g, m, v, hp, t, lr, threads);
}

#[allow(clippy::too_many_arguments)] // adam_step plus the instruction set, for tests
pub(crate) fn adam_step_isa(
    isa: Isa,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamHyper,
    t: u64,
    lr: f32,
    threads: usize,
) {
    check_lengths(p, g, m, v);
    let k = StepScalars::new(hp, t, lr);
    let decoupled = hp.decoupled;
    let piece = piece_len(p.len(), threads);
    if piece >= p.len() {
        adam_kernel(isa, p, g, m, v, &k, decoupled);
        return;
    }
    rayon::scope(|s| {
        let mut pieces = p
            .chunks_mut(piece)
            .zip(g.chunks(piece))
            .zip(m.chunks_mut(piece))
            .zip(v.chunks_mut(piece));
        // The caller's thread takes the first piece instead of idling in the scope.
        let first = pieces.next();
        for (((p, g), m), v) in pieces {
            s.spawn(move |_| adam_kernel(isa, p, g, m, v, &k, decoupled));
        }
        if let Some((((p, g), m), v)) = first {
            adam_kernel(isa, p, g, m, v, &k, decoupled);
        }
    });
}

/// The reference: the PyTorch formula written out one element at a time. The kernels must match
/// it bit for bit.
pub fn adam_step_scalar(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamHyper,
    t: u64,
    lr: f32,
) {
    check_lengths(p, g, m, v);
    let k = StepScalars::new(hp, t, lr);
    for i in 0..p.len() {
        let mut grad = g[i];
        if hp.decoupled {
            p[i] *= k.decay;
        } else {
            grad += k.weight_decay * p[i];
        }
        m[i] = k.beta1 * m[i] + k.one_minus_beta1 * grad;
        v[i] = k.beta2 * v[i] + k.one_minus_beta2 * grad * grad;
        let denom = v[i].sqrt() / k.sqrt_bias_c2 + k.eps;
        p[i] -= k.step_size * m[i] / denom;
    }
}

fn check_lengths(p: &[f32], g: &[f32], m: &[f32], v: &[f32]) {
    assert!(
        g.len() == p.len() && m.len() == p.len() && v.len() == p.len(),
        "adam: shard lengths differ (p {}, g {}, m {}, v {})",
        p.len(),
        g.len(),
        m.len(),
        v.len()
    );
}

/// Width of the fixed chunks the kernel is written in: one AVX-512 register of `f32`, two AVX2
/// registers, four SSE registers.
const LANES: usize = 16;

/// The per-element update. The operation order mirrors PyTorch's CPU kernels (`mul_`,
/// `addcmul_` = `v*b2 + (c*g)*g`, `addcdiv_` = `p + (-s*m)/d`, where `p + (-x) == p - x`
/// exactly). One deliberate difference: the first moment is the textbook `b1*m + (1-b1)*g`;
/// PyTorch 2.x writes it as `m.lerp_(g, 1-b1)`, which can differ in the last bit.
/// Every path, vector lanes and scalar tail alike, goes through this one function.
#[inline(always)]
fn update<const DECOUPLED: bool>(
    k: &StepScalars,
    p: f32,
    g: f32,
    m: f32,
    v: f32,
) -> (f32, f32, f32) {
    let (p, g) = if DECOUPLED {
        (p * k.decay, g)
    } else {
        (p, g + k.weight_decay * p)
    };
    let m = k.beta1 * m + k.one_minus_beta1 * g;
    let v = k.beta2 * v + k.one_minus_beta2 * g * g;
    let denom = v.sqrt() / k.sqrt_bias_c2 + k.eps;
    (p - k.step_size * m / denom, m, v)
}

#[inline(always)]
fn adam_lanes<const DECOUPLED: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &StepScalars,
) {
    // Re-slicing to one length lets LLVM see the chunk iterators end together (one loop exit
    // test instead of four); the caller checked the lengths are equal.
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    // Only used as prefetch addresses, never dereferenced.
    let streams = [p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr()];
    let prefetch_end = p.len().saturating_sub(PREFETCH_AHEAD);
    let mut p_chunks = p.chunks_exact_mut(LANES);
    let mut g_chunks = g.chunks_exact(LANES);
    let mut m_chunks = m.chunks_exact_mut(LANES);
    let mut v_chunks = v.chunks_exact_mut(LANES);
    let chunks = (&mut p_chunks)
        .zip(&mut g_chunks)
        .zip(&mut m_chunks)
        .zip(&mut v_chunks);
    for (c, (((p, g), m), v)) in chunks.enumerate() {
        prefetch_streams(&streams, c * LANES, prefetch_end);
        for j in 0..LANES {
            (p[j], m[j], v[j]) = update::<DECOUPLED>(k, p[j], g[j], m[j], v[j]);
        }
    }
    let tail = p_chunks
        .into_remainder()
        .iter_mut()
        .zip(g_chunks.remainder())
        .zip(m_chunks.into_remainder())
        .zip(v_chunks.into_remainder());
    for (((p, g), m), v) in tail {
        (*p, *m, *v) = update::<DECOUPLED>(k, *p, *g, *m, *v);
    }
}

#[inline(always)]
fn adam_body(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &StepScalars,
    decoupled: bool,
) {
    if decoupled {
        adam_lanes::<true>(p, g, m, v, k);
    } else {
        adam_lanes::<false>(p, g, m, v, k);
    }
}

multiversion!(fn adam_kernel(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &StepScalars,
    decoupled: bool,
) => adam_body);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Deterministic pseudo-random values in roughly [-scale, scale], never denormal.
    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|f| f.to_bits()).collect()
    }

    struct Shard {
        p: Vec<f32>,
        m: Vec<f32>,
        v: Vec<f32>,
    }

    fn shard(n: usize, seed: u64) -> Shard {
        Shard {
            p: values(n, seed, 1.0),
            m: values(n, seed + 1, 0.01),
            v: values(n, seed + 2, 1e-4).iter().map(|x| x.abs()).collect(),
        }
    }

    #[test]
    fn every_path_matches_scalar_bitwise() {
        for n in [0usize, 1, 15, 16, 17, 1000, 100_003] {
            for decoupled in [true, false] {
                let hp = AdamHyper {
                    decoupled,
                    ..AdamHyper::default()
                };
                for isa in Isa::available() {
                    for threads in [1usize, 2, 3] {
                        let mut want = shard(n, 7);
                        let mut got = shard(n, 7);
                        // Several consecutive steps with fresh gradients each time.
                        for t in 1..=3u64 {
                            let g = values(n, 100 + t, 0.5);
                            let lr = 1e-3 * t as f32;
                            adam_step_scalar(&mut want.p, &g, &mut want.m, &mut want.v, &hp, t, lr);
                            adam_step_isa(
                                isa, &mut got.p, &g, &mut got.m, &mut got.v, &hp, t, lr, threads,
                            );
                        }
                        let ctx = format!("n={n} decoupled={decoupled} {isa:?} threads={threads}");
                        assert_eq!(bits(&got.p), bits(&want.p), "p {ctx}");
                        assert_eq!(bits(&got.m), bits(&want.m), "m {ctx}");
                        assert_eq!(bits(&got.v), bits(&want.v), "v {ctx}");
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Updating a shard as arbitrary sub-slices (any offsets, so any alignment and any
        /// lane phase), on every instruction set, gives the reference's bits for the whole.
        #[test]
        fn cut_anywhere_is_bit_identical(
            n in 0usize..4000,
            cuts in proptest::collection::vec(0usize..4000, 0..5),
            threads in 1usize..4,
            decoupled in any::<bool>(),
            seed in 0u64..1000,
        ) {
            let hp = AdamHyper { decoupled, ..AdamHyper::default() };
            let g = values(n, seed + 50, 0.3);
            let mut whole = shard(n, seed);
            adam_step_scalar(&mut whole.p, &g, &mut whole.m, &mut whole.v, &hp, 5, 3e-4);

            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c.min(n)).collect();
            bounds.push(0);
            bounds.push(n);
            bounds.sort_unstable();
            for isa in Isa::available() {
                let mut parts = shard(n, seed);
                for w in bounds.windows(2) {
                    let r = w[0]..w[1];
                    adam_step_isa(
                        isa,
                        &mut parts.p[r.clone()],
                        &g[r.clone()],
                        &mut parts.m[r.clone()],
                        &mut parts.v[r],
                        &hp, 5, 3e-4, threads,
                    );
                }
                prop_assert_eq!(bits(&parts.p), bits(&whole.p), "{:?}", isa);
                prop_assert_eq!(bits(&parts.m), bits(&whole.m), "{:?}", isa);
                prop_assert_eq!(bits(&parts.v), bits(&whole.v), "{:?}", isa);
            }
        }
    }

    #[test]
    fn large_shard_split_across_threads_matches_inline() {
        // Big enough that piece_len really splits it.
        let n = 300_017;
        let hp = AdamHyper::default();
        let g = values(n, 3, 1.0);
        let mut one = shard(n, 9);
        let mut three = shard(n, 9);
        adam_step(&mut one.p, &g, &mut one.m, &mut one.v, &hp, 2, 1e-3, 1);
        adam_step(
            &mut three.p,
            &g,
            &mut three.m,
            &mut three.v,
            &hp,
            2,
            1e-3,
            3,
        );
        assert_eq!(bits(&one.p), bits(&three.p));
        assert_eq!(bits(&one.m), bits(&three.m));
        assert_eq!(bits(&one.v), bits(&three.v));
    }

    /// Within a few f32 ulps: the hand values are exact decimals, the kernel rounds each op.
    fn assert_close(got: f32, want: f64) {
        let tol = 4.0 * f64::from(f32::EPSILON) * want.abs();
        assert!(
            (f64::from(got) - want).abs() <= tol,
            "got {got}, want {want}"
        );
    }

    #[test]
    fn known_single_element_values() {
        // Hand computation, defaults (b1 0.9, b2 0.95, eps 1e-8, wd 0.1), lr 1e-3, t 1,
        // p 1, g 0.5, m = v = 0:
        //   p  = 1 * (1 - 1e-3 * 0.1)                = 0.9999
        //   m  = 0.1 * 0.5                            = 0.05
        //   v  = 0.05 * 0.25                          = 0.0125
        //   step_size = 1e-3 / (1 - 0.9)              = 0.01
        //   denom = sqrt(0.0125) / sqrt(0.05) + 1e-8  = 0.5 + 1e-8
        //   p  = 0.9999 - 0.01 * 0.05 / denom         = 0.9989 (+2e-11)
        let hp = AdamHyper::default();
        let (mut p, mut m, mut v) = ([1.0f32], [0.0f32], [0.0f32]);
        adam_step(&mut p, &[0.5], &mut m, &mut v, &hp, 1, 1e-3, 1);
        assert_close(m[0], 0.05);
        assert_close(v[0], 0.0125);
        assert_close(p[0], 0.9989);

        // Adam-L2 on the same element: g = 0.5 + 0.1 * 1 = 0.6, so m = 0.06, v = 0.018,
        // denom = 0.6, and p = 1 - 0.01 * 0.06 / 0.6 = 0.999 (no decay of p itself).
        let hp = AdamHyper {
            decoupled: false,
            ..hp
        };
        let (mut p, mut m, mut v) = ([1.0f32], [0.0f32], [0.0f32]);
        adam_step(&mut p, &[0.5], &mut m, &mut v, &hp, 1, 1e-3, 1);
        assert_close(m[0], 0.06);
        assert_close(v[0], 0.018);
        assert_close(p[0], 0.999);
    }

    #[test]
    fn first_step_moves_each_weight_by_lr_against_its_gradient_sign() {
        // At t = 1 the bias-corrected update is lr * g / (|g| + eps): magnitude ~lr.
        let hp = AdamHyper {
            weight_decay: 0.0,
            ..AdamHyper::default()
        };
        let g = [3.0f32, -0.02, 1e-3];
        let mut p = [0.0f32; 3];
        let (mut m, mut v) = ([0.0f32; 3], [0.0f32; 3]);
        adam_step(&mut p, &g, &mut m, &mut v, &hp, 1, 0.01, 1);
        for (pi, gi) in p.iter().zip(g) {
            assert!((pi + 0.01 * gi.signum()).abs() < 1e-6, "p {pi} g {gi}");
        }
    }

    #[test]
    fn adamw_and_adam_l2_differ_only_through_weight_decay() {
        let n = 257;
        let g = values(n, 11, 0.2);
        let run = |decoupled: bool, weight_decay: f64| {
            let hp = AdamHyper {
                decoupled,
                weight_decay,
                ..AdamHyper::default()
            };
            let mut s = shard(n, 4);
            for t in 1..=4 {
                adam_step(&mut s.p, &g, &mut s.m, &mut s.v, &hp, t, 1e-2, 1);
            }
            s
        };
        let (w, l2) = (run(true, 0.1), run(false, 0.1));
        assert_ne!(bits(&w.p), bits(&l2.p));
        // Decoupled decay leaves the moments untouched by the weights; L2 feeds them in.
        assert_eq!(bits(&w.m), bits(&run(true, 0.0).m));
        assert_ne!(bits(&l2.m), bits(&run(false, 0.0).m));
        // Without weight decay the two are the same optimizer.
        assert_eq!(bits(&run(true, 0.0).p), bits(&run(false, 0.0).p));
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn mismatched_lengths_panic() {
        let (mut p, mut m, mut v) = (vec![0.0; 3], vec![0.0; 3], vec![0.0; 2]);
        adam_step(
            &mut p,
            &[0.0; 3],
            &mut m,
            &mut v,
            &AdamHyper::default(),
            1,
            1e-3,
            1,
        );
    }

    #[test]
    fn hyper_serde_fills_defaults() {
        let hp: AdamHyper = serde_json::from_str(r#"{"lr": 0.01}"#).unwrap();
        assert_eq!(
            hp,
            AdamHyper {
                lr: 0.01,
                ..AdamHyper::default()
            }
        );
    }
}
