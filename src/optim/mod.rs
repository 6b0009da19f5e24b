//! Optimizers for one ZeRO partition: flat `f32` shards updated elementwise.
//!
//! Reproducibility contract: every update here is a pure per-element function of that element's
//! `p`, `g` and state plus per-step scalars that are computed once (in `f64`, cast to `f32` once).
//! The per-element formulas use a fixed operation order and never a fused multiply-add, so an
//! element's new bits do not depend on where the shard was cut, on the thread count, or on which
//! SIMD path ran. The runtime relies on this for bitwise-identical training across world sizes.
//!
//! `step` is the one entry point the runtime needs; `adam_step` / `sgd_step` are the kernels and
//! `*_scalar` the plain references the kernels are tested against.
//!
//! Design: docs/exact-reduction.md (the update's gradient).

pub mod adam;
pub mod lr;
pub mod settings;
pub mod sgd;

pub use adam::{adam_step, adam_step_scalar, AdamHyper};
pub use lr::LrSchedule;
pub use settings::OptimSettings;
pub use sgd::{sgd_step, sgd_step_scalar, SgdHyper};

use serde::{Deserialize, Serialize};

/// Which update rule to run. Serialized as `"adamw"`, `"adam"` or
/// `{"sgd": {"momentum": 0.9, "nesterov": false}}`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Adam with decoupled weight decay (Loshchilov & Hutter), `torch.optim.AdamW`.
    AdamW,
    /// Adam with L2 weight decay added to the gradient, `torch.optim.Adam`.
    Adam,
    /// SGD with (optionally Nesterov) momentum and L2 weight decay, `torch.optim.SGD`.
    Sgd {
        #[serde(default)]
        momentum: f64,
        #[serde(default)]
        nesterov: bool,
    },
}

/// Per-element optimizer state for one shard. Adam uses `m` (first moment) and `v` (second
/// moment); SGD keeps its momentum buffer in `m` and leaves `v` empty (both empty without
/// momentum). Shards of the same state cut at different boundaries are plain sub-slices.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimState {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

impl OptimState {
    /// Zeroed state for a shard of `numel` parameters.
    pub fn new(kind: OptimizerKind, numel: usize) -> Self {
        let (m_len, v_len) = match kind {
            OptimizerKind::AdamW | OptimizerKind::Adam => (numel, numel),
            OptimizerKind::Sgd { momentum, .. } if momentum != 0.0 => (numel, 0),
            OptimizerKind::Sgd { .. } => (0, 0),
        };
        Self {
            m: vec![0.0; m_len],
            v: vec![0.0; v_len],
        }
    }

    /// Memory held by the state, in bytes (what ZeRO-1 shards away).
    pub fn bytes(&self) -> usize {
        (self.m.len() + self.v.len()) * std::mem::size_of::<f32>()
    }
}

/// One optimizer step on a shard: `t` is the 1-based step number, `lr` the scheduled learning
/// rate for this step (see [`LrSchedule`]), `threads` how many contiguous pieces to run in
/// parallel on the current rayon pool.
///
/// `kind` decides Adam vs AdamW (it overrides `hp.decoupled`); SGD uses only
/// `hp.weight_decay` from `hp`.
#[allow(clippy::too_many_arguments)] // mirrors the kernels; a params struct would only rename them
pub fn step(
    kind: OptimizerKind,
    hp: &AdamHyper,
    p: &mut [f32],
    g: &[f32],
    state: &mut OptimState,
    t: u64,
    lr: f32,
    threads: usize,
) {
    match kind {
        OptimizerKind::AdamW | OptimizerKind::Adam => {
            let hp = AdamHyper {
                decoupled: kind == OptimizerKind::AdamW,
                ..*hp
            };
            adam_step(p, g, &mut state.m, &mut state.v, &hp, t, lr, threads);
        }
        OptimizerKind::Sgd { momentum, nesterov } => {
            let sgd = SgdHyper {
                momentum,
                nesterov,
                weight_decay: hp.weight_decay,
            };
            sgd_step(p, g, &mut state.m, &sgd, t, lr, threads);
        }
    }
}

/// Instruction sets the elementwise kernels are compiled for, chosen at run time. All of them run
/// the same per-element source, and IEEE `+ - * / sqrt` are correctly rounded at every vector
/// width, so the choice changes speed only, never bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Whatever the build target allows (SSE2 on plain x86_64).
    Portable,
    Avx2,
    Avx512,
}

impl Isa {
    /// The widest instruction set this CPU supports.
    pub(crate) fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every instruction set this CPU supports (tests compare them all).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut all = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                all.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                all.push(Isa::Avx512);
            }
        }
        all
    }
}

/// Defines `fn $name(isa: Isa, args...)` that runs the `#[inline(always)]` function `$body`
/// compiled for `isa`. The body is inlined into `#[target_feature]` copies, so LLVM vectorises
/// the same source at each width; "fma" is deliberately never enabled (it would not be used
/// without fast-math anyway, and keeping it off makes that explicit).
macro_rules! multiversion {
    ($vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) => $body:ident) => {
        $vis fn $name(isa: $crate::optim::Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) {
                    $body($($arg),*)
                }
                // The feature is re-checked here (a cached atomic load) so that a hand-made
                // `Isa` value can never run an instruction the CPU lacks.
                match isa {
                    $crate::optim::Isa::Avx512
                        if std::arch::is_x86_feature_detected!("avx512f") =>
                    {
                        // SAFETY: avx512f was detected on this CPU just above.
                        return unsafe { avx512($($arg),*) };
                    }
                    $crate::optim::Isa::Avx2 if std::arch::is_x86_feature_detected!("avx2") => {
                        // SAFETY: avx2 was detected on this CPU just above.
                        return unsafe { avx2($($arg),*) };
                    }
                    _ => {}
                }
            }
            let _ = isa;
            $body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// How far ahead of the current chunk the kernels prefetch each stream, in `f32`s (1 KiB).
/// With 3-4 streams per core the hardware prefetcher alone leaves DRAM bandwidth unused; this
/// distance measured ~8% faster on 16M-64M shards and costs nothing on cache-resident ones.
pub(crate) const PREFETCH_AHEAD: usize = 256;

/// Hints the CPU to pull the cache line holding `ptr` into L1. Only a hint: it never faults,
/// whatever the address, and has no effect on results.
#[inline(always)]
fn prefetch(ptr: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 has no architectural effect and never faults, even on invalid addresses.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}

/// Prefetches each stream (base pointers, only used as addresses) `PREFETCH_AHEAD` elements
/// past `start`, unless that would run past `prefetch_end`.
#[inline(always)]
pub(crate) fn prefetch_streams(streams: &[*const f32], start: usize, prefetch_end: usize) {
    if start < prefetch_end {
        for &s in streams {
            prefetch(s.wrapping_add(start + PREFETCH_AHEAD));
        }
    }
}

/// Elements below which a shard is updated inline: under this, handing a piece to another
/// thread costs more than the update itself (~20 µs of work at >1.5 G elements/s).
const MIN_PIECE: usize = 32 * 1024;

/// Piece boundaries are multiples of this many `f32`s (256 B) so threads never share a cache
/// line and each piece starts with the same alignment as the shard.
const PIECE_ALIGN: usize = 64;

/// Length of each contiguous piece when a shard of `n` elements is split for `threads` threads
/// (the last piece may be shorter). Returns `n` (or 1 when `n == 0`) when the shard should run
/// inline on the caller.
pub(crate) fn piece_len(n: usize, threads: usize) -> usize {
    let threads = threads.max(1);
    if threads == 1 || n < 2 * MIN_PIECE {
        return n.max(1);
    }
    let per_thread = n.div_ceil(threads).max(MIN_PIECE);
    per_thread.div_ceil(PIECE_ALIGN) * PIECE_ALIGN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn piece_len_covers_and_aligns() {
        assert_eq!(piece_len(0, 4), 1);
        assert_eq!(piece_len(1000, 2), 1000);
        assert_eq!(piece_len(1 << 20, 1), 1 << 20);
        for (n, threads) in [(1usize << 20, 2usize), (1_000_003, 3), (100_000, 7)] {
            let piece = piece_len(n, threads);
            assert_eq!(piece % PIECE_ALIGN, 0);
            assert!(n.div_ceil(piece) <= threads, "n={n} threads={threads}");
        }
    }

    #[test]
    fn kind_serde_uses_lowercase_names() {
        assert_eq!(
            serde_json::to_string(&OptimizerKind::AdamW).unwrap(),
            "\"adamw\""
        );
        assert_eq!(
            serde_json::from_str::<OptimizerKind>("\"adam\"").unwrap(),
            OptimizerKind::Adam
        );
        let sgd: OptimizerKind = serde_json::from_str(r#"{"sgd":{"momentum":0.9}}"#).unwrap();
        assert_eq!(
            sgd,
            OptimizerKind::Sgd {
                momentum: 0.9,
                nesterov: false
            }
        );
        let back: OptimizerKind =
            serde_json::from_str(&serde_json::to_string(&sgd).unwrap()).unwrap();
        assert_eq!(back, sgd);
    }

    #[test]
    fn state_sizes_and_bytes() {
        assert_eq!(OptimState::new(OptimizerKind::AdamW, 10).bytes(), 80);
        let sgd = |momentum| OptimizerKind::Sgd {
            momentum,
            nesterov: false,
        };
        assert_eq!(OptimState::new(sgd(0.9), 10).bytes(), 40);
        assert_eq!(OptimState::new(sgd(0.0), 10).bytes(), 0);
    }

    #[test]
    fn step_dispatch_matches_kernels() {
        let hp = AdamHyper::default();
        let g: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) * 0.01).collect();
        let p0: Vec<f32> = (0..100).map(|i| (i as f32) * 0.02 - 1.0).collect();
        for (kind, decoupled) in [(OptimizerKind::AdamW, true), (OptimizerKind::Adam, false)] {
            let mut p = p0.clone();
            let mut state = OptimState::new(kind, p.len());
            // `hp.decoupled` is deliberately the opposite: `kind` must win.
            let wrong = AdamHyper {
                decoupled: !decoupled,
                ..hp
            };
            step(kind, &wrong, &mut p, &g, &mut state, 1, 1e-3, 1);
            let (mut pr, mut m, mut v) = (p0.clone(), vec![0.0; 100], vec![0.0; 100]);
            let right = AdamHyper { decoupled, ..hp };
            adam_step_scalar(&mut pr, &g, &mut m, &mut v, &right, 1, 1e-3);
            assert_eq!(p, pr);
            assert_eq!(state.m, m);
            assert_eq!(state.v, v);
        }
        let kind = OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: true,
        };
        let mut p = p0.clone();
        let mut state = OptimState::new(kind, p.len());
        step(kind, &hp, &mut p, &g, &mut state, 1, 0.1, 2);
        let mut pr = p0.clone();
        let mut buf = vec![0.0; 100];
        let sgd = SgdHyper {
            momentum: 0.9,
            nesterov: true,
            weight_decay: hp.weight_decay,
        };
        sgd_step_scalar(&mut pr, &g, &mut buf, &sgd, 1, 0.1);
        assert_eq!(p, pr);
        assert_eq!(state.m, buf);
    }
}
