//! Fault injection: what a fault-injection run asks the runtime to break. Kills inside the rounds
//! between steps, the in-process network's faults (rates, latencies and a partition, all
//! replayable from the seed), the tier's faults, and two test hooks that only code can set.
//!
//! The keys keep their names at the top level of a config file (`net_drop_per_mille = 10`,
//! `kill_during = [...]`, `nvme_fault = "..."`): the section is one field of `TrainConfig`,
//! flattened into its table. None of them changes the numbers a run computes.

use serde::{Deserialize, Serialize};

use super::{ConfigError, NvmeFault, RoundKill, TrainConfig};

/// Every fault a run injects; the default injects none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Faults {
    /// Ranks that die abruptly halfway through a round between steps (`RANK@STEP:ROUND`, ROUND
    /// one of reshard, replicate, restore).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kill_during: Vec<RoundKill>,
    /// Thousandths of frames the in-process network delivers twice (default 0).
    pub net_duplicate_per_mille: u32,
    /// Thousandths of frames it holds back behind the next one (default 0).
    pub net_reorder_per_mille: u32,
    /// Thousandths of frames whose first transmission is lost, so they arrive
    /// `net_retransmit_ms` late, as over a reliable transport (default 0).
    pub net_drop_per_mille: u32,
    /// Thousandths of frames delivered with a flipped bit; the receiver's checksum rejects and
    /// counts them, and the retransmission follows (default 0).
    pub net_corrupt_per_mille: u32,
    /// Every frame is delayed by a uniform 0..=this many ms (default 0).
    pub net_delay_max_ms: u64,
    /// How late a retransmitted frame arrives (default 5).
    pub net_retransmit_ms: u64,
    /// A rank whose every frame is `net_slow_ms` late (default none).
    pub net_slow_rank: Option<u32>,
    /// The extra latency of `net_slow_rank`'s frames (default 0).
    pub net_slow_ms: u64,
    /// The ranks on one side of a network partition (default none). While it lasts, frames
    /// between the two sides wait `net_partition_ms` for the link to heal.
    pub net_partition_ranks: Vec<u32>,
    /// The partition covers each rank's sends numbered `net_partition_from_frame ..` (counted
    /// per sender, so a seed replays it exactly) (default 0).
    pub net_partition_from_frame: u64,
    /// How many of each rank's sends the partition covers (default 0).
    pub net_partition_frames: u64,
    /// How long a frame across the partition waits (default 0).
    pub net_partition_ms: u64,
    /// `RANK:enospc@BYTES` or `RANK:eio@BYTES` fails that rank's tier writes past BYTES;
    /// `RANK:slow@MS` holds each of its tier reads MS milliseconds (default none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme_fault: Option<NvmeFault>,
    /// Test hook, settable from code only (no config key, no flag): (rank, step) whose compute
    /// panics. In-process ranks only.
    #[serde(skip)]
    pub panic_at: Option<(u32, u64)>,
    /// Test hook, settable from code only (no config key, no flag): the coordinator raises a
    /// real SIGTERM in this process as the first report of this step (0-based) arrives, so the
    /// snapshot the signal asks for is the one at the end of this step. In-process runs only.
    #[serde(skip)]
    pub raise_sigterm_at: Option<u64>,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            kill_during: Vec::new(),
            net_duplicate_per_mille: 0,
            net_reorder_per_mille: 0,
            net_drop_per_mille: 0,
            net_corrupt_per_mille: 0,
            net_delay_max_ms: 0,
            net_retransmit_ms: 5,
            net_slow_rank: None,
            net_slow_ms: 0,
            net_partition_ranks: Vec::new(),
            net_partition_from_frame: 0,
            net_partition_frames: 0,
            net_partition_ms: 0,
            nvme_fault: None,
            panic_at: None,
            raise_sigterm_at: None,
        }
    }
}

impl TrainConfig {
    /// Fault rates are thousandths; injected latency stays well inside the collective deadline;
    /// a partition is fully specified or absent; kills and test hooks name steps the run has.
    pub(super) fn validate_faults(&self) -> Result<(), ConfigError> {
        let f = &self.faults;
        for (field, rate) in [
            ("net_duplicate_per_mille", f.net_duplicate_per_mille),
            ("net_reorder_per_mille", f.net_reorder_per_mille),
            ("net_drop_per_mille", f.net_drop_per_mille),
            ("net_corrupt_per_mille", f.net_corrupt_per_mille),
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
            ("net_delay_max_ms", f.net_delay_max_ms),
            ("net_retransmit_ms", f.net_retransmit_ms),
            ("net_slow_ms", f.net_slow_ms),
            ("net_partition_ms", f.net_partition_ms),
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
        if let Some(k) = f.kill_during.iter().find(|k| k.step >= self.steps) {
            return Err(ConfigError::new(
                "kill_during",
                format!("{k}: the run has only {} steps", self.steps),
            ));
        }
        Ok(())
    }

    /// A partition names ranks the simulated network has, and all of its keys or none.
    fn validate_partition(&self) -> Result<(), ConfigError> {
        let f = &self.faults;
        let r = &f.net_partition_ranks;
        if let Some(&big) = r.iter().find(|&&x| x >= 64) {
            return Err(ConfigError::new(
                "net_partition_ranks",
                format!("rank {big}: the simulated partition takes ranks 0 to 63"),
            ));
        }
        let on = !r.is_empty() || f.net_partition_frames > 0 || f.net_partition_ms > 0;
        if on && (r.is_empty() || f.net_partition_frames == 0 || f.net_partition_ms == 0) {
            return Err(ConfigError::new(
                "net_partition_ranks",
                "a partition needs net_partition_ranks (one side), net_partition_frames and net_partition_ms, all non-empty/non-zero",
            ));
        }
        Ok(())
    }
}
