//! The memory model: what each rank holds between steps, per ZeRO stage.
//!
//! Two forms. `resident` is what *this* runtime holds and is what the rank ledgers are tested
//! against: in fp32 training parameters are 4 bytes (at stages 0-2 the full copy is also the
//! master), Adam m and v 8 bytes, gradients 8 bytes in exact mode's 64-bit fixed point or 4 in
//! fast mode. Under bf16 mixed precision stages 0-2 keep the full copy as bf16 (2 bytes) and the
//! fp32 master of the chunks each rank owns beside its optimizer state, as the paper does; stage
//! 3's fp32 shard is both the master and what its bf16 gathers are made from. `zero_paper_bytes`
//! is the ZeRO paper's mixed-precision formula (Fig. 1), for comparing with DeepSpeed's published
//! numbers.

use serde::{Deserialize, Serialize};

use super::schedule::Stage;

/// Bytes a rank holds between steps, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resident {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
}

impl Resident {
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// Whether the fp32 master parameters live in the rank's shard (beside its optimizer state)
/// rather than in a full fp32 copy: always at stage 3, and at every stage when the compute copy
/// is narrower than fp32 (`param_copy_bytes` < 4, bf16 mixed precision).
pub fn masters_in_shard(stage: Stage, param_copy_bytes: u64) -> bool {
    stage == Stage::Zero3 || param_copy_bytes < 4
}

/// What a rank that owns `owned_elems` of a `total_elems` model holds between steps.
///
/// `grad_elem_bytes` is the reduction mode's accumulator width, which stages 0-1 keep for the
/// whole model; stages 2-3 keep only the reduced shard's mean as f32 (4 bytes), made from the
/// exact sums when the unit's reduce-scatter completes. `optimizer_state_per_param` is 2 for
/// Adam (m, v), 1 for SGD with momentum. `param_copy_bytes` is the width of the parameters the
/// model computes with (4 in fp32, 2 under bf16 mixed precision): stages 0-2 then keep a full
/// copy of that width and count the owned fp32 masters as optimizer state (the paper's
/// 2Ψ + 12Ψ/N for Adam). Stage 3 keeps its fp32 shard as its parameters either way.
pub fn resident(
    stage: Stage,
    total_elems: u64,
    owned_elems: u64,
    grad_elem_bytes: u64,
    optimizer_state_per_param: u64,
    param_copy_bytes: u64,
) -> Resident {
    let opt = 4 * optimizer_state_per_param;
    let (params, grads, optimizer) = match stage {
        Stage::Zero0 => (total_elems, total_elems, total_elems),
        Stage::Zero1 => (total_elems, total_elems, owned_elems),
        Stage::Zero2 => (total_elems, owned_elems, owned_elems),
        Stage::Zero3 => (owned_elems, owned_elems, owned_elems),
    };
    let grad_bytes = match stage {
        Stage::Zero0 | Stage::Zero1 => grad_elem_bytes,
        Stage::Zero2 | Stage::Zero3 => 4,
    };
    let (param_bytes, master_bytes) = match stage {
        Stage::Zero3 => (4, 0),
        _ if masters_in_shard(stage, param_copy_bytes) => (param_copy_bytes, 4),
        _ => (4, 0),
    };
    Resident {
        params: param_bytes * params,
        grads: grad_bytes * grads,
        optimizer: (opt + master_bytes) * optimizer,
    }
}

/// The ZeRO paper's bytes per rank for mixed-precision training: Ψ parameters, world `n`, `k`
/// optimizer bytes per parameter (12 for Adam with an fp32 master copy).
pub fn zero_paper_bytes(stage: Stage, psi: f64, n: f64, k: f64) -> f64 {
    match stage {
        Stage::Zero0 => (2.0 + 2.0 + k) * psi,
        Stage::Zero1 => 4.0 * psi + k * psi / n,
        Stage::Zero2 => 2.0 * psi + (2.0 + k) * psi / n,
        Stage::Zero3 => (2.0 + 2.0 + k) * psi / n,
    }
}

/// Bytes as GiB (or MiB below one GiB) with two decimals, for messages.
pub fn gib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paper_example_7_5b_on_64() {
        // ZeRO paper Fig. 1: 120 / 31.4 / 16.6 / 1.9 GB.
        let gb = |s| zero_paper_bytes(s, 7.5e9, 64.0, 12.0) / 1e9;
        assert!((gb(Stage::Zero0) - 120.0).abs() < 0.1);
        assert!((gb(Stage::Zero1) - 31.4).abs() < 0.1);
        assert!((gb(Stage::Zero2) - 16.6).abs() < 0.1);
        assert!((gb(Stage::Zero3) - 1.9).abs() < 0.1);
    }

    #[test]
    fn stage3_is_sixteen_bytes_per_owned_param() {
        // Whatever the accumulator's width: the reduced shard is kept as its f32 mean.
        for width in [4, 8] {
            for copy in [4, 2] {
                let r = resident(Stage::Zero3, 1000, 250, width, 2, copy);
                assert_eq!(r.total(), 16 * 250);
            }
        }
        assert_eq!(resident(Stage::Zero1, 1000, 250, 8, 2, 4).grads, 8 * 1000);
        assert_eq!(
            resident(Stage::Zero0, 1000, 250, 4, 2, 4).total(),
            16 * 1000
        );
    }

    #[test]
    fn bf16_at_stages_0_to_2_is_the_papers_formula_with_our_gradient_width() {
        // The paper's (2 + 2 + 12)Ψ, 4Ψ + 12Ψ/N and 2Ψ + (2 + 12)Ψ/N with its 2-byte gradients
        // replaced by ours (g bytes at stages 0-1, 4 at stage 2).
        let (psi, n) = (1200u64, 4u64);
        for g in [4, 8] {
            let paper = |s| zero_paper_bytes(s, psi as f64, n as f64, 12.0) as u64;
            let r0 = resident(Stage::Zero0, psi, psi, g, 2, 2);
            assert_eq!((r0.params, r0.optimizer), (2 * psi, 12 * psi));
            assert_eq!(r0.total(), paper(Stage::Zero0) - 2 * psi + g * psi);
            let r1 = resident(Stage::Zero1, psi, psi / n, g, 2, 2);
            assert_eq!((r1.params, r1.optimizer), (2 * psi, 12 * psi / n));
            assert_eq!(r1.total(), paper(Stage::Zero1) - 2 * psi + g * psi);
            let r2 = resident(Stage::Zero2, psi, psi / n, g, 2, 2);
            assert_eq!(r2.total(), paper(Stage::Zero2) - 2 * psi / n + 4 * psi / n);
        }
        // Stage 3's total is the paper's (its 2-byte gradient shard is our 4-byte f32 mean,
        // and it keeps no bf16 shard: gathers are made from the fp32 master).
        let r3 = resident(Stage::Zero3, psi, psi / n, 8, 2, 2);
        assert_eq!(
            r3.total() as f64,
            zero_paper_bytes(Stage::Zero3, psi as f64, n as f64, 12.0)
        );
    }
}
