//! A tiny deterministic RNG for parameter init and sampling.
//!
//! Initial parameters must be a pure function of `(seed, unit)` on every rank and every run, so we
//! own the generator instead of depending on a crate whose stream could change between versions.
//! SplitMix64 (Steele, Lea, Flood 2014) is one add and a 64-bit finaliser per draw: fast, with
//! good statistical quality for this use, and trivially reproducible in any language.
//!
//! The GPT-2 init rule that draws from it lives here too, and, under `cfg(test)`, the seeded test
//! data and the finite-difference checker shared by every gradient test.

/// Weyl-sequence increment of SplitMix64 (the odd integer closest to 2^64 / golden ratio).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 output finaliser: a bijection on `u64` with full avalanche.
fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes two values into one, for deriving independent sub-seeds (e.g. `mix(seed, unit)`).
///
/// Not symmetric: `mix(a, b)` and `mix(b, a)` differ, so `(seed, unit)` pairs do not collide
/// merely by swapping.
pub fn mix(a: u64, b: u64) -> u64 {
    finalize(finalize(a.wrapping_add(GOLDEN)) ^ b.wrapping_mul(GOLDEN))
}

/// SplitMix64 generator; the stream is a pure function of the seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        finalize(self.state)
    }

    /// Uniform in `[0, 1)`, from the top 53 bits (every value is exactly representable).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal via Box-Muller. Uses two uniforms per call and discards the second normal,
    /// so the stream position after `n` calls is always `2n` draws (easy to reason about).
    pub fn normal(&mut self) -> f64 {
        // 1 - u lies in (0, 1], so the log is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

// ---------------------------------------------------------------------------------------------
// GPT-2 style init
// ---------------------------------------------------------------------------------------------

use super::{ParamSpec, UnitSpec};

/// Std of GPT-2 init for Linear and Embedding weights (as in the PyTorch reference).
pub const INIT_STD: f64 = 0.02;

/// How one parameter is initialised (GPT-2 style).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// Linear and Embedding weights: normal(0, `INIT_STD`).
    Normal,
    /// LayerNorm weights.
    Ones,
    /// Biases.
    Zeros,
}

/// A unit's initial flat buffer: parameters of `(numel, init)` concatenated, normals drawn in
/// buffer order from `rng`.
pub fn init_buffer(params: &[(usize, Init)], rng: &mut SplitMix64) -> Vec<f32> {
    let mut out = Vec::with_capacity(params.iter().map(|p| p.0).sum());
    for &(n, init) in params {
        match init {
            Init::Normal => out.extend((0..n).map(|_| (rng.normal() * INIT_STD) as f32)),
            Init::Ones => out.extend(std::iter::repeat_n(1.0, n)),
            Init::Zeros => out.extend(std::iter::repeat_n(0.0, n)),
        }
    }
    out
}

/// A unit's spec from `(name, shape, init)` triples, with its init rules alongside.
pub fn unit_spec(name: String, params: Vec<(String, Vec<usize>, Init)>) -> (UnitSpec, Vec<Init>) {
    let inits = params.iter().map(|p| p.2).collect();
    let params = params
        .into_iter()
        .map(|(name, shape, _)| ParamSpec { name, shape })
        .collect();
    (UnitSpec { name, params }, inits)
}

/// Initial flat buffer of unit number `unit`, drawn from a generator seeded with
/// `mix(seed, unit)`: a pure function of `(seed, unit)`, whichever rank asks and in what order.
pub fn init_unit_buffer(spec: &UnitSpec, inits: &[Init], seed: u64, unit: usize) -> Vec<f32> {
    let sizes = spec.params.iter().map(ParamSpec::numel);
    let params: Vec<(usize, Init)> = sizes.zip(inits.iter().copied()).collect();
    init_buffer(&params, &mut SplitMix64::new(mix(seed, unit as u64)))
}

/// Helpers shared by the gradient-check tests of every model file.
#[cfg(test)]
pub(crate) mod test_util {
    use super::SplitMix64;

    pub fn randn(n: usize, seed: u64, std: f64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..n).map(|_| (rng.normal() * std) as f32).collect()
    }

    pub fn dot(a: &[f32], b: &[f32]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
    }

    pub fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Central difference of `f` at `x` along the direction `v`.
    fn directional(f: &dyn Fn(&[f32]) -> f64, x: &[f32], v: &[f32], eps: f32) -> f64 {
        let shift = |sign: f32| -> Vec<f32> {
            x.iter().zip(v).map(|(&a, &b)| a + sign * eps * b).collect()
        };
        (f(&shift(1.0)) - f(&shift(-1.0))) / (2.0 * eps as f64)
    }

    /// Checks the analytic gradient `grad` of the scalar `f` at `x` against central differences,
    /// on every coordinate and along one random direction. A coordinate passes when
    /// `|analytic - numeric| <= tol · (|numeric| + 1% of the largest gradient)`, so a missing
    /// term fails unless it is negligible next to both the coordinate and the whole gradient.
    pub fn check_grad(
        name: &str,
        x: &[f32],
        grad: &[f32],
        eps: f32,
        tol: f64,
        f: &dyn Fn(&[f32]) -> f64,
    ) {
        assert_eq!(x.len(), grad.len(), "{name}: gradient length");
        let mut numeric = Vec::with_capacity(x.len());
        let mut xp = x.to_vec();
        for i in 0..x.len() {
            let orig = xp[i];
            xp[i] = orig + eps;
            let (hi, up) = (f(&xp), xp[i]);
            xp[i] = orig - eps;
            let (lo, down) = (f(&xp), xp[i]);
            xp[i] = orig;
            numeric.push((hi - lo) / (up - down) as f64);
        }
        let largest = |v: &mut dyn Iterator<Item = f64>| v.fold(0.0f64, |m, g| m.max(g.abs()));
        let scale =
            largest(&mut numeric.iter().copied()).max(largest(&mut grad.iter().map(|&g| g as f64)));
        assert!(
            scale > 1e-6,
            "{name}: gradient is identically ~0, the check would be vacuous"
        );
        for (i, (&a, &n)) in grad.iter().zip(&numeric).enumerate() {
            let allowed = tol * (n.abs() + 0.01 * scale);
            assert!(
                (a as f64 - n).abs() <= allowed,
                "{name}[{i}]: analytic {a} vs numeric {n} (allowed {allowed:e}, max |grad| {scale:e})"
            );
        }
        // A unit-length random direction: every coordinate contributes, none dominates.
        let v = randn(x.len(), 0xD1CE, 1.0);
        let norm = dot(&v, &v).sqrt() as f32;
        let v: Vec<f32> = v.iter().map(|c| c / norm).collect();
        let (want, got) = (directional(f, x, &v, eps), dot(grad, &v));
        let typical = dot(grad, grad).sqrt() / (x.len() as f64).sqrt();
        assert!(
            (want - got).abs() <= tol * want.abs().max(typical),
            "{name}: directional derivative analytic {got} vs numeric {want}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_stream() {
        // Same stream as `splitmix64_stream(seed, n)` in ../shared/peers/train_fsdp.py.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn same_seed_same_stream_and_mix_separates() {
        let a: Vec<u64> = (0..8)
            .map({
                let mut r = SplitMix64::new(42);
                move |_| r.next_u64()
            })
            .collect();
        let mut r = SplitMix64::new(42);
        let b: Vec<u64> = (0..8).map(|_| r.next_u64()).collect();
        assert_eq!(a, b);
        assert_ne!(mix(1, 2), mix(2, 1));
        assert_ne!(mix(0, 0), mix(0, 1));
        assert_eq!(mix(7, 3), mix(7, 3));
    }

    #[test]
    fn uniform_and_normal_moments() {
        let mut r = SplitMix64::new(9);
        let n = 200_000;
        let (mut s, mut s2, mut umin, mut umax) = (0.0, 0.0, 1.0f64, 0.0f64);
        for _ in 0..n {
            let u = r.next_f64();
            umin = umin.min(u);
            umax = umax.max(u);
            let z = r.normal();
            assert!(z.is_finite());
            s += z;
            s2 += z * z;
        }
        assert!((0.0..1e-4).contains(&umin) && umax < 1.0 && umax > 1.0 - 1e-4);
        let mean = s / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }

    #[test]
    fn init_buffer_follows_rules() {
        let mut rng = SplitMix64::new(1);
        let init = init_buffer(
            &[(2, Init::Ones), (3, Init::Normal), (1, Init::Zeros)],
            &mut rng,
        );
        assert_eq!((init[0], init[1], init[5]), (1.0, 1.0, 0.0));
        assert!(init[2..5].iter().all(|v| v.abs() < 0.2 && *v != 0.0));
    }
}
