//! The accelerator a run computes on: none (the host CPU), or the simulated device with its
//! memory budget and link. Where state lives across device, host and NVMe is planned in
//! `plan::device` beside `plan::tier`; this file checks the keys and builds the backend.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{ConfigError, TrainConfig};
use crate::model::backend::{Backend, SimBackend, SimSpec};

/// The smallest `device_memory_max_bytes` accepted.
const MIN_DEVICE_MEMORY_BYTES: u64 = 1 << 20;

/// Which accelerator the kernels run on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// The host CPU: no device, no copies.
    #[default]
    None,
    /// The simulated device (`model::backend::sim`): CPU kernels, device memory of its own
    /// under `device_memory_max_bytes`, copies over a link of `sim_link_gbps`.
    Sim,
}

impl DeviceChoice {
    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::None => "none",
            DeviceChoice::Sim => "sim",
        }
    }
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" | "cpu" => Ok(DeviceChoice::None),
            "sim" => Ok(DeviceChoice::Sim),
            other => Err(format!(
                "'{other}' is not a device: use none (the host CPU) or sim (the simulated device)"
            )),
        }
    }
}

impl TrainConfig {
    /// The backend the model computes on: the CPU kernels of `precision`, with the simulated
    /// device when `device = "sim"`.
    pub fn backend(&self) -> Arc<dyn Backend> {
        let kernels = self.precision.cpu_backend();
        match self.device {
            DeviceChoice::None => kernels,
            DeviceChoice::Sim => Arc::new(SimBackend::new(
                kernels,
                SimSpec {
                    capacity_bytes: self.device_memory_max_bytes.unwrap_or(0),
                    link_bytes_per_s: self.sim_link_gbps * 1e9,
                },
            )),
        }
    }

    pub(super) fn validate_device(&self) -> Result<(), ConfigError> {
        let link = self.sim_link_gbps;
        if !(link.is_finite() && link > 0.0) {
            return Err(ConfigError::new(
                "sim_link_gbps",
                format!("{link} must be a positive number of GB/s (25 is a PCIe 4.0 x16 link)"),
            ));
        }
        match (self.device, self.device_memory_max_bytes) {
            (DeviceChoice::Sim, None) => Err(ConfigError::new(
                "device_memory_max_bytes",
                "--device sim needs the device's memory: set --device-memory-max SIZE (e.g. 2GiB)",
            )),
            (DeviceChoice::Sim, Some(b)) if b < MIN_DEVICE_MEMORY_BYTES => Err(ConfigError::new(
                "device_memory_max_bytes",
                format!("{b} bytes is below the 1 MiB a device needs"),
            )),
            (DeviceChoice::None, Some(_)) => Err(ConfigError::new(
                "device_memory_max_bytes",
                "a device memory budget needs a device: add --device sim, or drop --device-memory-max",
            )),
            _ => Ok(()),
        }
    }
}
