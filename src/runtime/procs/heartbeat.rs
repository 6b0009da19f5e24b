//! Failure detection between processes: the settings (validated once) and a pure liveness check.
//!
//! Each side of a control connection sends a heartbeat every `heartbeat_ms` and declares the
//! other side failed once nothing (heartbeat or any other message) has arrived for
//! `heartbeat_timeout_ms`. A closed connection is reported at once; the timeout covers the cases
//! a socket cannot see (a stopped process, a silent link).

use serde::{Deserialize, Serialize};

/// Timing of the process runtime. Defaults: heartbeats every 500 ms, a peer silent for 5 s is
/// failed, workers get 60 s to join and retry an unanswering coordinator for 10 s, and a rank
/// joining the running job waits 10 s for a standby worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcsConfig {
    pub heartbeat_ms: u64,
    pub heartbeat_timeout_ms: u64,
    /// How long the coordinator waits for all workers to join, and a worker for its welcome.
    pub join_timeout_ms: u64,
    /// How long a worker keeps trying to reach the coordinator before giving up.
    pub connect_timeout_ms: u64,
    /// How long a rank joining the running job waits for a standby worker to take it; past
    /// that the join fails (and the job stops saying why).
    pub join_wait_ms: u64,
}

impl Default for ProcsConfig {
    fn default() -> Self {
        Self {
            heartbeat_ms: 500,
            heartbeat_timeout_ms: 5_000,
            join_timeout_ms: 60_000,
            connect_timeout_ms: 10_000,
            join_wait_ms: 10_000,
        }
    }
}

/// A setting out of range: which one, and what is valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{field}`: {message}")]
pub struct ProcsConfigError {
    pub field: &'static str,
    pub message: String,
}

impl ProcsConfig {
    pub fn validate(&self) -> Result<(), ProcsConfigError> {
        let err = |field, message: String| Err(ProcsConfigError { field, message });
        if !(10..=60_000).contains(&self.heartbeat_ms) {
            return err("heartbeat_ms", "must be between 10 and 60000".into());
        }
        if self.heartbeat_timeout_ms < 2 * self.heartbeat_ms
            || self.heartbeat_timeout_ms > 3_600_000
        {
            return err(
                "heartbeat_timeout_ms",
                format!(
                    "must be at least twice heartbeat_ms ({}) and at most 3600000",
                    2 * self.heartbeat_ms
                ),
            );
        }
        let zero = [
            ("join_timeout_ms", self.join_timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("join_wait_ms", self.join_wait_ms),
        ];
        if let Some((field, _)) = zero.iter().find(|(_, v)| *v == 0) {
            return err(field, "must be at least 1".into());
        }
        Ok(())
    }
}

/// When a peer was last heard from; decides, given the time, whether it has gone silent.
#[derive(Clone, Copy, Debug)]
pub struct Liveness {
    last_seen_ms: u64,
    timeout_ms: u64,
}

impl Liveness {
    pub fn new(now_ms: u64, timeout_ms: u64) -> Self {
        Self {
            last_seen_ms: now_ms,
            timeout_ms,
        }
    }

    /// A different silence bound from now on (e.g. the setup phase's longer one).
    pub fn set_timeout(&mut self, timeout_ms: u64) {
        self.timeout_ms = timeout_ms;
    }

    /// Anything arrived from the peer.
    pub fn observe(&mut self, now_ms: u64) {
        self.last_seen_ms = self.last_seen_ms.max(now_ms);
    }

    /// `Some(silent_ms)` once the peer has been silent for longer than the timeout.
    pub fn silent(&self, now_ms: u64) -> Option<u64> {
        let quiet = now_ms.saturating_sub(self.last_seen_ms);
        (quiet > self.timeout_ms).then_some(quiet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_is_declared_only_past_the_timeout() {
        let mut l = Liveness::new(1_000, 500);
        assert_eq!(l.silent(1_500), None);
        assert_eq!(l.silent(1_501), Some(501));
        l.observe(1_400);
        assert_eq!(l.silent(1_900), None);
        // An observation from the past never moves the mark back.
        l.observe(10);
        assert_eq!(l.silent(1_901), Some(501));
    }

    #[test]
    fn settings_are_validated_with_the_field_named() {
        assert!(ProcsConfig::default().validate().is_ok());
        let bad = ProcsConfig {
            heartbeat_timeout_ms: 900,
            ..ProcsConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "heartbeat_timeout_ms");
        let bad = ProcsConfig {
            heartbeat_ms: 0,
            ..ProcsConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "heartbeat_ms");
    }
}
