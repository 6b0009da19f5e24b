//! The membership script (`leave`, `join`, `kill` at a step) and kills injected into the rounds
//! between steps, with the check that plays the script forward.

use serde::{Deserialize, Serialize};

use super::{ConfigError, TrainConfig};

/// `VALUE@STEP`, e.g. a rank id or a count and the step it applies at (`--leave 2@5`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct At {
    pub value: u32,
    pub step: u64,
}

impl std::str::FromStr for At {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (v, st) = s
            .split_once('@')
            .ok_or_else(|| format!("`{s}` is not VALUE@STEP (e.g. 2@5)"))?;
        Ok(At {
            value: v
                .trim()
                .parse()
                .map_err(|_| format!("`{v}` in `{s}` is not a whole number"))?,
            step: st
                .trim()
                .parse()
                .map_err(|_| format!("`{st}` in `{s}` is not a step number"))?,
        })
    }
}

impl Serialize for At {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}@{}", self.value, self.step))
    }
}

impl<'de> Deserialize<'de> for At {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A round between steps, where an injected kill can strike (`--kill-during`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Round {
    /// The chunk moves of a membership change (`--leave`, `--join`).
    Reshard,
    /// A buddy backup (every `replicate_every` steps, and after each reshard).
    Replicate,
    /// The rebuild from backups after a loss (its STEP is the step rolled back to).
    Restore,
}

impl Round {
    const ALL: [Round; 3] = [Round::Reshard, Round::Replicate, Round::Restore];

    /// The round's name in `RANK@STEP:ROUND`.
    fn name(self) -> &'static str {
        match self {
            Round::Reshard => "reshard",
            Round::Replicate => "replicate",
            Round::Restore => "restore",
        }
    }
}

/// `RANK@STEP:ROUND`: the rank vanishes halfway through its part of the first such round
/// before STEP, e.g. `2@5:reshard`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RoundKill {
    pub rank: u32,
    pub step: u64,
    pub round: Round,
}

impl std::str::FromStr for RoundKill {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (at, round) = s
            .split_once(':')
            .ok_or_else(|| format!("`{s}` is not RANK@STEP:ROUND (e.g. 2@5:reshard)"))?;
        let at: At = at.parse()?;
        let round = round.trim();
        let round = Round::ALL
            .into_iter()
            .find(|r| r.name() == round)
            .ok_or_else(|| format!("`{round}` in `{s}` is not reshard, replicate or restore"))?;
        Ok(RoundKill {
            rank: at.value,
            step: at.step,
            round,
        })
    }
}

impl std::fmt::Display for RoundKill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}:{}", self.rank, self.step, self.round.name())
    }
}

impl Serialize for RoundKill {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for RoundKill {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl TrainConfig {
    /// Plays the membership script forward and refuses one that names a rank that is not a
    /// member at that step, leaves the world outside [min_ranks, max_ranks], or acts after the
    /// last step; a kill injected into a round must come before the last step.
    pub(super) fn validate_membership(&self) -> Result<(), ConfigError> {
        if self.min_ranks == 0 || self.min_ranks > self.max_ranks {
            return Err(ConfigError::new(
                "min_ranks",
                "must be at least 1 and at most max_ranks",
            ));
        }
        if self.ranks > self.max_ranks {
            return Err(ConfigError::new(
                "ranks",
                format!("{} exceeds max_ranks {}", self.ranks, self.max_ranks),
            ));
        }
        let mut members: Vec<u32> = (0..self.ranks).collect();
        let mut next = self.ranks;
        let mut steps: Vec<u64> = self
            .leave
            .iter()
            .chain(&self.join)
            .chain(&self.kill)
            .map(|a| a.step)
            .collect();
        steps.sort_unstable();
        steps.dedup();
        for step in steps {
            let field = |f: &str, a: &At, why: String| {
                ConfigError::new(f, format!("{}@{}: {why}", a.value, a.step))
            };
            for a in self
                .leave
                .iter()
                .chain(&self.kill)
                .filter(|a| a.step == step)
            {
                let f = if self.leave.contains(a) {
                    "leave"
                } else {
                    "kill"
                };
                if a.step >= self.steps {
                    return Err(field(
                        f,
                        a,
                        format!("the run has only {} steps", self.steps),
                    ));
                }
                if !members.contains(&a.value) {
                    return Err(field(
                        f,
                        a,
                        format!(
                            "rank {} is not a member then (members: {members:?})",
                            a.value
                        ),
                    ));
                }
                members.retain(|&m| m != a.value);
            }
            for a in self.join.iter().filter(|a| a.step == step) {
                if a.step >= self.steps {
                    return Err(field(
                        "join",
                        a,
                        format!("the run has only {} steps", self.steps),
                    ));
                }
                members.extend(next..next + a.value);
                next += a.value;
            }
            if members.len() < self.min_ranks as usize {
                return Err(ConfigError::new(
                    "leave",
                    format!(
                        "at step {step} the world would shrink to {} ranks, below min_ranks {}",
                        members.len(),
                        self.min_ranks
                    ),
                ));
            }
            if members.len() > self.max_ranks as usize {
                return Err(ConfigError::new(
                    "join",
                    format!(
                        "at step {step} the world would grow to {} ranks, above max_ranks {}",
                        members.len(),
                        self.max_ranks
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl TrainConfig {
    /// Whether a run whose ranks all live in one process can lose one rank and go on, so that
    /// buddy backups there protect something. One process dies whole (an OOM kill, a signal,
    /// a lost machine) and takes every backup with it; what in-process backups survive is the
    /// loss of a single rank actor: a kill this run schedules (`kill`, `kill_during`), one an
    /// operator may order (`allow_kill`), or a rank cut off by injected network faults.
    pub fn in_process_losses_possible(&self, allow_kill: bool) -> bool {
        let f = &self.faults;
        let net_faults = f.net_drop_per_mille > 0
            || f.net_corrupt_per_mille > 0
            || f.net_slow_rank.is_some()
            || !f.net_partition_ranks.is_empty();
        allow_kill
            || !self.kill.is_empty()
            || !f.kill_during.is_empty()
            || f.panic_at.is_some()
            || net_faults
    }
}
