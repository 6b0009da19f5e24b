//! The memory model: what each rank holds between steps, per ZeRO stage.
//!
//! Two forms. `resident` is what *this* runtime holds (all-fp32 training: parameters 4 bytes,
//! Adam m and v 8 bytes, gradients 8 bytes in exact mode's 64-bit fixed point or 4 in fast mode)
//! and is what the rank ledgers are tested against. `zero_paper_bytes` is the ZeRO paper's
//! mixed-precision formula (Fig. 1), for comparing with DeepSpeed's published numbers.

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

/// What a rank that owns `owned_elems` of a `total_elems` model holds between steps.
///
/// `grad_elem_bytes` is the reduction mode's accumulator width, which stages 0-1 keep for the
/// whole model; stages 2-3 keep only the reduced shard's mean as f32 (4 bytes), made from the
/// exact sums when the unit's reduce-scatter completes. `optimizer_state_per_param` is 2 for
/// Adam (m, v), 1 for SGD with momentum.
pub fn resident(
    stage: Stage,
    total_elems: u64,
    owned_elems: u64,
    grad_elem_bytes: u64,
    optimizer_state_per_param: u64,
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
    Resident {
        params: 4 * params,
        grads: grad_bytes * grads,
        optimizer: opt * optimizer,
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
            let r = resident(Stage::Zero3, 1000, 250, width, 2);
            assert_eq!(r.total(), 16 * 250);
        }
        assert_eq!(resident(Stage::Zero1, 1000, 250, 8, 2).grads, 8 * 1000);
        assert_eq!(resident(Stage::Zero0, 1000, 250, 4, 2).total(), 16 * 1000);
    }
}
