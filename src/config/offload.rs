//! Where shard state lives: the NVMe tier, its directory and I/O settings, and the memory the
//! process may use. Placement itself is planned in `plan::tier`; this file only checks that the
//! keys make sense together.

use super::{ConfigError, TrainConfig};
use crate::plan::tier::{check_choices, Offload};
use crate::plan::Stage;

/// The smallest `memory_max_bytes` accepted: below it not even the runtime itself fits.
const MIN_MEMORY_MAX_BYTES: u64 = 64 << 20;

impl TrainConfig {
    /// Resets the keys that describe this machine's tier and memory to their defaults (a
    /// resumed run takes them from its own flags, not from the saved config).
    pub fn clear_placement(&mut self) {
        let d = TrainConfig::default();
        self.offload_optimizer = d.offload_optimizer;
        self.offload_params = d.offload_params;
        self.offload_grads = d.offload_grads;
        self.nvme_dir = d.nvme_dir;
        self.nvme_buffered = d.nvme_buffered;
        self.nvme_queue_depth = d.nvme_queue_depth;
        self.nvme_block_bytes = d.nvme_block_bytes;
        self.nvme_record_elems = d.nvme_record_elems;
        self.memory_max_bytes = d.memory_max_bytes;
        self.device = d.device;
        self.device_memory_max_bytes = d.device_memory_max_bytes;
        self.sim_link_gbps = d.sim_link_gbps;
        self.faults.nvme_fault = d.faults.nvme_fault;
    }

    /// `o` as the planner reads it: beside a device, `cpu` (ZeRO-Offload's word for host
    /// memory) is RAM; without one it stays `cpu`, which the planner refuses.
    pub fn offload_choice(&self, o: Offload) -> Offload {
        match (o, self.device) {
            (Offload::Cpu, super::DeviceChoice::Sim) => Offload::None,
            _ => o,
        }
    }

    pub(super) fn validate_offload(&self) -> Result<(), ConfigError> {
        if let Some(stage) = Stage::from_u8(self.stage) {
            check_choices(
                stage,
                self.offload_choice(self.offload_optimizer),
                self.offload_choice(self.offload_params),
                self.offload_choice(self.offload_grads),
                self.nvme_dir.is_some(),
            )
            .map_err(|e| ConfigError::new(e.key(), e.to_string()))?;
        }
        if let Some(b) = self.memory_max_bytes {
            if b < MIN_MEMORY_MAX_BYTES {
                return Err(ConfigError::new(
                    "memory_max_bytes",
                    format!(
                        "{b} bytes is below the {} MiB the runtime itself needs",
                        MIN_MEMORY_MAX_BYTES >> 20
                    ),
                ));
            }
        }
        if let Some(n) = self.nvme_record_elems {
            if n == 0 || n % 1024 != 0 || n > 1 << 24 {
                return Err(ConfigError::new(
                    "nvme_record_elems",
                    format!("{n} must be a multiple of 1024 between 1024 and 16777216"),
                ));
            }
        }
        if !(1..=256).contains(&self.nvme_queue_depth) {
            return Err(ConfigError::new(
                "nvme_queue_depth",
                format!("{} is outside 1..=256", self.nvme_queue_depth),
            ));
        }
        let b = self.nvme_block_bytes;
        if !(4096..=64 << 20).contains(&b) || !b.is_multiple_of(4096) {
            return Err(ConfigError::new(
                "nvme_block_bytes",
                format!("{b} must be a multiple of 4096 between 4 KiB and 64 MiB"),
            ));
        }
        Ok(())
    }
}

/// Fault injection on rank `rank`'s tier. Written `RANK:enospc@BYTES` or `RANK:eio@BYTES`
/// (every write past the first BYTES fails with ENOSPC or EIO) or `RANK:slow@MS` (every read
/// is held MS milliseconds before it is submitted: a slow disk, which the step must wait for
/// without losing anything).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvmeFault {
    pub rank: u32,
    pub kind: NvmeFaultKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvmeFaultKind {
    FailWrites { errno: i32, after_bytes: u64 },
    SlowReads { ms: u64 },
}

impl std::str::FromStr for NvmeFault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not RANK:enospc@BYTES, RANK:eio@BYTES or RANK:slow@MS");
        let (rank, rest) = s.split_once(':').ok_or_else(bad)?;
        let (kind, arg) = rest.split_once('@').ok_or_else(bad)?;
        let fail = |errno| -> Result<NvmeFaultKind, String> {
            Ok(NvmeFaultKind::FailWrites {
                errno,
                after_bytes: parse_bytes(arg)?,
            })
        };
        Ok(Self {
            rank: rank.parse().map_err(|_| bad())?,
            kind: match kind {
                "enospc" => fail(libc::ENOSPC)?,
                "eio" => fail(libc::EIO)?,
                "slow" => NvmeFaultKind::SlowReads {
                    ms: arg.parse().map_err(|_| bad())?,
                },
                _ => return Err(bad()),
            },
        })
    }
}

impl std::fmt::Display for NvmeFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            NvmeFaultKind::FailWrites { errno, after_bytes } => {
                let kind = if errno == libc::ENOSPC {
                    "enospc"
                } else {
                    "eio"
                };
                write!(f, "{}:{kind}@{after_bytes}", self.rank)
            }
            NvmeFaultKind::SlowReads { ms } => write!(f, "{}:slow@{ms}", self.rank),
        }
    }
}

impl serde::Serialize for NvmeFault {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for NvmeFault {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Parses a byte size: a plain number of bytes, or a number with a unit (K, M, G, T with an
/// optional `iB`/`B`, powers of 1024), e.g. `2GiB`, `512M`, `1.5G`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| {
        format!("`{s}` is not a size: use bytes or a number with K, M, G or T (e.g. 2GiB)")
    })?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "`{other}` in `{s}` is not a unit: use K, M, G or T"
            ))
        }
    };
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("`{s}` is not a usable size"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_powers_of_1024() {
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5g"), Ok(3 << 29));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("2 parsecs").is_err());
        assert!(parse_bytes("0").is_err());
    }

    #[test]
    fn faults_parse_and_print_back() {
        for (text, kind) in [
            (
                "1:eio@600KiB",
                NvmeFaultKind::FailWrites {
                    errno: libc::EIO,
                    after_bytes: 600 << 10,
                },
            ),
            (
                "0:enospc@4096",
                NvmeFaultKind::FailWrites {
                    errno: libc::ENOSPC,
                    after_bytes: 4096,
                },
            ),
            ("2:slow@25", NvmeFaultKind::SlowReads { ms: 25 }),
        ] {
            let f: NvmeFault = text.parse().unwrap();
            assert_eq!(f.kind, kind, "{text}");
            assert_eq!(f.to_string().parse::<NvmeFault>(), Ok(f));
        }
        for bad in ["1:slow@fast", "slow@5", "1:hang@5", "1:eio"] {
            let err = bad.parse::<NvmeFault>().unwrap_err();
            assert!(err.contains("RANK:slow@MS"), "{bad}: {err}");
        }
    }
}
