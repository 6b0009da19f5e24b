//! Injected network faults of the in-process network (`net_*` keys): rates, latencies and a
//! partition, all replayable from the seed.

use super::{ConfigError, TrainConfig};

impl TrainConfig {
    /// Fault rates are thousandths; injected latency stays well inside the collective deadline;
    /// a partition is fully specified or absent.
    pub(super) fn validate_faults(&self) -> Result<(), ConfigError> {
        for (field, rate) in [
            ("net_duplicate_per_mille", self.net_duplicate_per_mille),
            ("net_reorder_per_mille", self.net_reorder_per_mille),
            ("net_drop_per_mille", self.net_drop_per_mille),
            ("net_corrupt_per_mille", self.net_corrupt_per_mille),
        ] {
            if rate > 1000 {
                return Err(ConfigError::new(
                    field,
                    "fault rates are thousandths: 0 to 1000",
                ));
            }
        }
        // Injected latency far beyond the collective deadline would only turn into timeouts.
        for (field, ms) in [
            ("net_delay_max_ms", self.net_delay_max_ms),
            ("net_retransmit_ms", self.net_retransmit_ms),
            ("net_slow_ms", self.net_slow_ms),
            ("net_partition_ms", self.net_partition_ms),
        ] {
            if ms > self.collective_timeout_ms / 4 {
                return Err(ConfigError::new(
                    field,
                    format!(
                        "{ms} ms is more than a quarter of collective_timeout_ms ({}): lower it or raise the timeout",
                        self.collective_timeout_ms
                    ),
                ));
            }
        }
        self.validate_partition()?;
        Ok(())
    }

    /// A partition names ranks the simulated network has, and all of its keys or none.
    fn validate_partition(&self) -> Result<(), ConfigError> {
        let r = &self.net_partition_ranks;
        if let Some(&big) = r.iter().find(|&&x| x >= 64) {
            return Err(ConfigError::new(
                "net_partition_ranks",
                format!("rank {big}: the simulated partition takes ranks 0 to 63"),
            ));
        }
        let on = !r.is_empty() || self.net_partition_frames > 0 || self.net_partition_ms > 0;
        if on && (r.is_empty() || self.net_partition_frames == 0 || self.net_partition_ms == 0) {
            return Err(ConfigError::new(
                "net_partition_ranks",
                "a partition needs net_partition_ranks (one side), net_partition_frames and net_partition_ms, all non-empty/non-zero",
            ));
        }
        Ok(())
    }
}
