//! Notices: a worker given SIGTERM (a pod eviction, a spot preemption passed on by the cloud)
//! asks the coordinator to drain it at the next step boundary, the graceful leave an operator's
//! `POST /ranks/{id}/drain` makes, instead of vanishing and leaving its peers to recover from
//! backups.
//!
//! The connection tasks hand each notice to the coordinator's driver ([`NoticeTx`]), which asks
//! the coordinator actor for the leave and reports what became of it; [`PendingDrains`] times
//! each granted notice until the rank is retired.

use std::collections::BTreeMap;

use tokio::sync::mpsc;

use crate::engine::coordinator::MembershipRecord;
use crate::plan::RankId;
pub use crate::runtime::api::notice::Notice;

/// Where connection tasks send notices.
pub type NoticeTx = mpsc::UnboundedSender<Notice>;

/// Granted notices waiting for their rank to leave, and when each arrived.
#[derive(Debug, Default)]
pub struct PendingDrains {
    since_ms: BTreeMap<RankId, u64>,
}

impl PendingDrains {
    pub fn granted(&mut self, notice: &Notice) {
        self.since_ms.insert(notice.rank, notice.at_ms);
    }

    /// The ranks a membership change drained (left gracefully, not lost), each with the seconds
    /// from its notice to this change; a rank lost instead is forgotten too (its notice ended in
    /// the abrupt path).
    pub fn on_change(&mut self, rec: &MembershipRecord, now_ms: u64) -> Vec<(RankId, f64)> {
        let gone: Vec<RankId> = self
            .since_ms
            .keys()
            .copied()
            .filter(|r| !rec.after.contains(r))
            .collect();
        let mut drained = Vec::new();
        for r in gone {
            let since = self.since_ms.remove(&r).unwrap_or(now_ms);
            if !rec.lost.contains(&r) {
                drained.push((r, now_ms.saturating_sub(since) as f64 / 1e3));
            }
        }
        drained
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(after: Vec<RankId>, lost: Vec<RankId>) -> MembershipRecord {
        MembershipRecord {
            step: 3,
            epoch: 2,
            before: vec![0, 1, 2],
            after,
            moved_chunk_elems: 0,
            min_chunk_elems: 0,
            duration_ms: 0,
            lost,
            rolled_back_to: None,
            takeover: false,
        }
    }

    fn notice(rank: RankId, at_ms: u64) -> Notice {
        Notice {
            rank,
            cause: "SIGTERM".into(),
            grace_ms: 25_000,
            at_ms,
        }
    }

    #[test]
    fn a_drained_rank_is_timed_from_its_notice_once() {
        let mut p = PendingDrains::default();
        p.granted(&notice(1, 1_000));
        assert!(p
            .on_change(&change(vec![0, 1, 2], vec![]), 1_500)
            .is_empty());
        assert_eq!(
            p.on_change(&change(vec![0, 2], vec![]), 3_250),
            vec![(1, 2.25)]
        );
        assert!(p.on_change(&change(vec![0, 2], vec![]), 9_000).is_empty());
    }

    #[test]
    fn a_rank_lost_after_its_notice_is_not_a_drain() {
        let mut p = PendingDrains::default();
        p.granted(&notice(2, 0));
        assert!(p.on_change(&change(vec![0, 1], vec![2]), 5_000).is_empty());
        assert!(p.since_ms.is_empty());
    }
}
