//! The run's recent history behind `GET /history` (and the live page at `GET /` that draws
//! it): one point per completed step and one per event (membership change, recovery, drain,
//! failed join), each with the seconds since the endpoint's monitor started.
//!
//! Bounded: the newest [`HISTORY_STEPS_MAX`] steps and [`HISTORY_EVENTS_MAX`] events are kept
//! (about 1.5 MB of JSON at most); older ones are dropped and counted. Nothing here does I/O:
//! the caller passes the time.

use std::collections::VecDeque;

use serde::Serialize;

use crate::engine::coordinator::StepRecord;
use crate::plan::RankId;

use super::status::ChangeRecord;

/// Steps kept for `/history`.
pub const HISTORY_STEPS_MAX: usize = 10_000;
/// Events kept for `/history`.
pub const HISTORY_EVENTS_MAX: usize = 1_000;

/// One completed step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepPoint {
    /// Steps completed (1-based, as the progress line and `--metrics-file` count); a step
    /// replayed after a recovery appears again.
    pub step: u64,
    /// Seconds since the monitor started, when the step's record arrived.
    pub t_s: f64,
    pub loss: f64,
    pub lr: f32,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub step_s: f64,
    pub members: usize,
    pub epoch: u64,
    /// The held-out loss after this step, when it evaluated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    pub skipped: bool,
}

/// What happened to the membership.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A graceful change (leave, join, drain carried out).
    Membership,
    /// Ranks were lost and the survivors rolled back to a backup.
    Recovery,
    /// A drain was granted (it takes effect at the next step boundary).
    Drain,
    /// A joiner did not come up.
    FailedJoin,
}

/// One event.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EventPoint {
    pub t_s: f64,
    pub kind: EventKind,
    /// The step it struck or took effect at (0-based, as the membership records count).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub before: Vec<RankId>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<RankId>,
    /// One line for a person.
    pub detail: String,
}

/// The bounded history.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct History {
    /// Tokens one step trains on (for `tokens_per_s`).
    #[serde(skip)]
    pub tokens_per_step: u64,
    pub steps_max: usize,
    pub events_max: usize,
    /// Steps and events dropped from the front to stay within the bounds.
    pub dropped_steps: u64,
    pub dropped_events: u64,
    pub steps: VecDeque<StepPoint>,
    pub events: VecDeque<EventPoint>,
}

impl History {
    pub fn new(tokens_per_step: u64) -> Self {
        Self {
            tokens_per_step,
            steps_max: HISTORY_STEPS_MAX,
            events_max: HISTORY_EVENTS_MAX,
            ..Self::default()
        }
    }

    pub fn on_step(&mut self, rec: &StepRecord, t_s: f64) {
        let step_s = rec.duration_ms as f64 / 1e3;
        let point = StepPoint {
            step: rec.step + 1,
            t_s,
            loss: rec.loss,
            lr: rec.lr,
            grad_norm: rec.grad_norm,
            tokens_per_s: self.tokens_per_step as f64 / step_s.max(1e-3),
            step_s,
            members: rec.reports.len(),
            epoch: rec.reports.first().map_or(0, |r| r.epoch),
            eval_loss: rec.eval_loss,
            skipped: rec.skipped,
        };
        if self.steps.len() >= self.steps_max {
            self.steps.pop_front();
            self.dropped_steps += 1;
        }
        self.steps.push_back(point);
    }

    pub fn on_change(&mut self, change: &ChangeRecord, t_s: f64) {
        let m = &change.record;
        let (kind, detail) = match m.rolled_back_to {
            Some(back) => (
                EventKind::Recovery,
                format!(
                    "lost ranks {:?}; rolled back to the backup before step {back}",
                    m.lost
                ),
            ),
            None => (
                EventKind::Membership,
                format!("ranks {:?} -> {:?}", m.before, m.after),
            ),
        };
        self.push_event(EventPoint {
            t_s,
            kind,
            step: Some(m.step),
            epoch: Some(m.epoch),
            before: m.before.clone(),
            after: m.after.clone(),
            detail,
        });
    }

    /// An event without a membership record (a drain granted, a failed join).
    pub fn on_event(&mut self, kind: EventKind, detail: String, t_s: f64) {
        self.push_event(EventPoint {
            t_s,
            kind,
            step: None,
            epoch: None,
            before: Vec::new(),
            after: Vec::new(),
            detail,
        });
    }

    fn push_event(&mut self, e: EventPoint) {
        if self.events.len() >= self.events_max {
            self.events.pop_front();
            self.dropped_events += 1;
        }
        self.events.push_back(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::coordinator::MembershipRecord;

    fn record(step: u64, eval: Option<f64>) -> StepRecord {
        StepRecord {
            step,
            loss: 2.0,
            grad_norm: 1.0,
            lr: 1e-3,
            skipped: false,
            attempts: 1,
            duration_ms: 500,
            eval_loss: eval,
            reports: Vec::new(),
        }
    }

    #[test]
    fn steps_are_bounded_and_dropped_ones_counted() {
        let mut h = History::new(1000);
        h.steps_max = 3;
        for s in 0..5 {
            h.on_step(&record(s, (s == 4).then_some(1.5)), s as f64);
        }
        assert_eq!(h.steps.len(), 3);
        assert_eq!(h.dropped_steps, 2);
        assert_eq!(h.steps.front().map(|p| p.step), Some(3));
        let last = h.steps.back().unwrap();
        assert_eq!(last.eval_loss, Some(1.5));
        assert_eq!(last.tokens_per_s, 2000.0);
    }

    #[test]
    fn changes_become_membership_or_recovery_events() {
        let mut h = History::new(1);
        let m = MembershipRecord {
            step: 3,
            epoch: 2,
            before: vec![0, 1, 2],
            after: vec![0, 1],
            lost: vec![2],
            rolled_back_to: Some(2),
            takeover: false,
            moved_chunk_elems: 0,
            min_chunk_elems: 0,
            duration_ms: 10,
        };
        h.on_change(
            &ChangeRecord {
                record: m,
                moved_bytes: None,
            },
            1.0,
        );
        h.on_event(EventKind::Drain, "rank 1".into(), 2.0);
        let kinds: Vec<EventKind> = h.events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [EventKind::Recovery, EventKind::Drain]);
        let json = serde_json::to_value(&h).unwrap();
        assert_eq!(json["events"][0]["kind"], "recovery");
        assert_eq!(json["events"][0]["after"], serde_json::json!([0, 1]));
    }
}
