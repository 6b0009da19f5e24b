//! Communication volume: the data elements and bytes each rank sends per step.
//!
//! Collectives here are direct (each owner sends its chunks to every peer; each contributor sends
//! its partial sums to each chunk's owner), so a rank owning a fraction f of a unit sends
//! f(N-1) of the unit per all-gather and (1-f) of it per reduce-scatter: (N-1)/N per collective
//! when balanced, the same per-rank volume as a ring. Per step that is 2Ψ(N-1)/N for stages 0-2
//! and 3Ψ(N-1)/N for stage 3 (the ZeRO paper's 2Ψ and 3Ψ, which drop the (N-1)/N). Under bf16
//! mixed precision every parameter gather is 2 bytes an element (stage 3's before use, stages
//! 1-2's of the updated values after the step), so stage 3's bytes per step are
//! (2·2Ψ + g·Ψ)(N-1)/N and stages 1-2's (2Ψ + g·Ψ)(N-1)/N, with g the gradient width.

use serde::{Deserialize, Serialize};

use super::schedule::Stage;
use super::shard_map::{RankId, ShardMap};

/// Data sent by one rank in one step (control messages excluded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    /// Parameter elements sent (`param_elem_bytes` each: see [`param_elem_bytes`]).
    pub param_elems: u64,
    /// Gradient elements sent (`grad_elem_bytes` each).
    pub grad_elems: u64,
}

impl Volume {
    pub fn elems(&self) -> u64 {
        self.param_elems + self.grad_elems
    }

    pub fn bytes(&self, param_elem_bytes: u64, grad_elem_bytes: u64) -> u64 {
        param_elem_bytes * self.param_elems + grad_elem_bytes * self.grad_elems
    }
}

/// Bytes of a parameter element on the wire: every parameter gather carries what the model
/// computes with (`model_param_bytes`: 2 under bf16 mixed precision, 4 in fp32). Stage 3
/// gathers before use; stages 1-2 gather the updated values into every rank's full copy, which
/// under bf16 is a bf16 copy (the owners keep the fp32 masters).
pub fn param_elem_bytes(_stage: Stage, model_param_bytes: u64) -> u64 {
    model_param_bytes
}

/// Exact per-step volume `rank` sends under `map` (without overflow redos).
pub fn per_step(map: &ShardMap, stage: Stage, rank: RankId) -> Volume {
    let peers = map.world_size() as u64 - 1;
    let owned = map.owned_elems(rank) as u64;
    let not_owned = map.total_elems() as u64 - owned;
    match stage {
        // All-reduce = reduce-scatter + all-gather of the gradient.
        Stage::Zero0 => Volume {
            param_elems: 0,
            grad_elems: not_owned + owned * peers,
        },
        // Reduce-scatter gradients, all-gather updated parameters.
        Stage::Zero1 | Stage::Zero2 => Volume {
            param_elems: owned * peers,
            grad_elems: not_owned,
        },
        // Gather in forward and again in backward, reduce-scatter gradients.
        Stage::Zero3 => Volume {
            param_elems: 2 * owned * peers,
            grad_elems: not_owned,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_volume_is_2_or_3_psi_times_n_minus_1_over_n() {
        let map = ShardMap::plan(&[4000, 4000], &[0, 1, 2, 3], 100, 0).unwrap();
        let psi = 8000u64;
        let v1 = per_step(&map, Stage::Zero1, 0);
        assert_eq!(v1.elems(), 2 * psi * 3 / 4);
        let v3 = per_step(&map, Stage::Zero3, 2);
        assert_eq!(v3.elems(), 3 * psi * 3 / 4);
        let v0 = per_step(&map, Stage::Zero0, 1);
        assert_eq!(v0.elems(), 2 * psi * 3 / 4);
        let solo = ShardMap::plan(&[4000], &[0], 100, 0).unwrap();
        assert_eq!(per_step(&solo, Stage::Zero3, 0).elems(), 0);
    }
}
