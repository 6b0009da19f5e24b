//! The device tier: what of a rank's training state lives on its accelerator, under
//! `device_memory_max_bytes`, and what crosses the host link each step. Pure data and
//! functions: the command line runs [`place_device`] beside the host/NVMe planner
//! (`plan::tier::place`) before anything is allocated, and the step carries the plan out.
//!
//! The placement is ZeRO-Offload's (and ZeRO-Infinity's `offload_param: cpu`): the device holds
//! only working memory, the parameters the model computes with and the gradients it produces;
//! the fp32 masters, the optimizer state, the exact reduction and the optimizer's update stay on
//! the host (RAM, or the NVMe tier where `plan::tier` puts them). Per unit, its parameters go
//! host → device before its forward and again before its backward (stage 3 gathers them a unit
//! at a time on the host first), at the width the model computes with (bf16: 2 bytes), and each
//! micro-batch's gradient of the unit goes device → host as f32 the moment its backward ends,
//! to be quantized and summed exactly there. Updated parameters reach the device through the
//! next step's uploads. Where the budget has room, the next unit's parameters are uploaded while
//! this one computes, and a micro-batch's gradient travels while the next one is computed.
//!
//! Design: docs/memory-and-tier.md (the device tier).

use serde::{Deserialize, Serialize};

use super::memory::gib;

/// What the device tier needs to know about a run, per rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceDemand {
    /// Elements each unit computes with: its own parameters and those it borrows (tied).
    pub unit_view_elems: Vec<u64>,
    /// Bytes per parameter element on the link (4 fp32, 2 bf16).
    pub param_link_bytes: u64,
    /// The most micro-batches one rank runs in a step.
    pub local_micro_batches: u64,
    /// One rank's peak activation bytes (saved unit inputs plus one unit's intermediates).
    pub activation_bytes: u64,
}

/// Where a rank's state lives with a device, and the device memory it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevicePlan {
    pub capacity_bytes: u64,
    /// Units whose parameters are on the device at once: 2 uploads the next unit while one
    /// computes, 1 waits for each upload.
    pub param_buffers: u64,
    /// Gradient buffers of a unit at once: 2 lets one micro-batch's gradient travel while the
    /// next is computed.
    pub grad_buffers: u64,
    /// The device's peak by kind, as planned.
    pub params_bytes: u64,
    pub grads_bytes: u64,
    pub activations_bytes: u64,
    /// Host → device and device → host bytes one step moves (one pass, no overflow redo).
    pub h2d_bytes_per_step: u64,
    pub d2h_bytes_per_step: u64,
}

impl DevicePlan {
    pub fn device_bytes(&self) -> u64 {
        self.params_bytes + self.grads_bytes + self.activations_bytes
    }

    /// Where state lives, for the progress line and the start of a run.
    pub fn describe(&self) -> String {
        format!(
            "device: {} of {} (params {} units, grads {} buffers, activations); host: fp32 masters, optimizer state, exact reduction",
            gib(self.device_bytes()),
            gib(self.capacity_bytes),
            self.param_buffers,
            self.grad_buffers,
        )
    }
}

/// Why a run does not fit its device.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the device cannot hold one unit's working set: it needs {need_bytes} bytes ({} parameters of the largest unit {unit} at 4 bytes, their gradient, and {} of activations) and --device-memory-max is {capacity_bytes} ({}); set --device-memory-max {} or more, or lower the activations (--micro-batch-size, --micro-batches) or the largest unit", .largest_elems, gib(*.activation_bytes), gib(*.capacity_bytes), gib(*.need_bytes))]
pub struct DeviceFitError {
    pub need_bytes: u64,
    pub capacity_bytes: u64,
    pub unit: usize,
    pub largest_elems: u64,
    pub activation_bytes: u64,
}

/// The device plan for `d` within `capacity_bytes`: the most buffering that fits (two
/// parameter and two gradient buffers, then one of each), or the refusal with the size that
/// would fit.
pub fn place_device(d: &DeviceDemand, capacity_bytes: u64) -> Result<DevicePlan, DeviceFitError> {
    let (unit, largest) = d
        .unit_view_elems
        .iter()
        .copied()
        .enumerate()
        .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))
        .unwrap_or((0, 0));
    let plan = |buffers: u64| {
        let (h2d, d2h) = bytes_per_step(d);
        DevicePlan {
            capacity_bytes,
            param_buffers: buffers,
            grad_buffers: buffers,
            params_bytes: buffers * 4 * largest,
            grads_bytes: buffers * 4 * largest,
            activations_bytes: d.activation_bytes,
            h2d_bytes_per_step: h2d,
            d2h_bytes_per_step: d2h,
        }
    };
    for buffers in [2, 1] {
        let p = plan(buffers);
        if p.device_bytes() <= capacity_bytes {
            return Ok(p);
        }
    }
    Err(DeviceFitError {
        need_bytes: plan(1).device_bytes(),
        capacity_bytes,
        unit,
        largest_elems: largest,
        activation_bytes: d.activation_bytes,
    })
}

/// Bytes one step moves each way: every unit's parameters up before its forward and before its
/// backward, every micro-batch's gradient of every unit down as f32.
pub fn bytes_per_step(d: &DeviceDemand) -> (u64, u64) {
    let elems: u64 = d.unit_view_elems.iter().sum();
    (
        2 * elems * d.param_link_bytes,
        4 * elems * d.local_micro_batches,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand() -> DeviceDemand {
        DeviceDemand {
            unit_view_elems: vec![1000, 4000, 4000, 3000],
            param_link_bytes: 2,
            local_micro_batches: 3,
            activation_bytes: 10_000,
        }
    }

    #[test]
    fn the_most_buffering_that_fits_is_chosen() {
        let d = demand();
        // Two buffers of each: 2 * 4 * 4000 * 2 + activations.
        let p = place_device(&d, 64_000 + 10_000).unwrap();
        assert_eq!((p.param_buffers, p.grad_buffers), (2, 2));
        assert_eq!(p.device_bytes(), 74_000);
        let p = place_device(&d, 73_999).unwrap();
        assert_eq!((p.param_buffers, p.grad_buffers), (1, 1));
        assert_eq!(p.device_bytes(), 42_000);
        assert!(p.describe().contains("host: fp32 masters"));
    }

    #[test]
    fn a_device_too_small_for_one_unit_is_refused_with_the_size_that_fits() {
        let e = place_device(&demand(), 41_999).unwrap_err();
        assert_eq!(e.need_bytes, 42_000);
        assert_eq!(e.unit, 1, "the first of the largest units");
        let text = e.to_string();
        assert!(text.contains("--device-memory-max"), "{text}");
        assert!(text.contains("42000 bytes"), "{text}");
        assert_eq!(place_device(&demand(), 42_000).unwrap().param_buffers, 1);
    }

    #[test]
    fn the_link_carries_parameters_twice_and_each_micro_batchs_gradient_once() {
        let d = demand();
        let (h2d, d2h) = bytes_per_step(&d);
        assert_eq!(h2d, 2 * 12_000 * 2);
        assert_eq!(d2h, 4 * 12_000 * 3);
        // fp32 parameters double the uploads, not the downloads.
        let f = DeviceDemand {
            param_link_bytes: 4,
            ..d
        };
        assert_eq!(bytes_per_step(&f), (2 * h2d, d2h));
        // Per parameter with one micro-batch a rank: 2 + 2 up (bf16 twice), 4 down.
        let one = DeviceDemand {
            local_micro_batches: 1,
            ..demand()
        };
        let (u, dn) = bytes_per_step(&one);
        assert_eq!((u / 12_000, dn / 12_000), (4, 4));
    }

    #[test]
    fn a_model_many_times_the_device_fits_when_one_unit_does() {
        // 48 units of 1 Mi elements, 20 bytes of state each on the host: 960 MiB; one unit's
        // working set with double buffering is 16 MiB.
        let d = DeviceDemand {
            unit_view_elems: vec![1 << 20; 48],
            param_link_bytes: 2,
            local_micro_batches: 1,
            activation_bytes: 4 << 20,
        };
        let p = place_device(&d, 24 << 20).unwrap();
        assert_eq!(p.param_buffers, 2);
        let host_state_bytes: u64 = (20 * 48) << 20;
        assert!(host_state_bytes >= 8 * p.capacity_bytes);
    }
}
