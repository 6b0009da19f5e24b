//! What a rank owns between jobs (its state, backups and communicator), moved to its worker
//! thread for each job, and what every rank of a run shares.

use std::sync::Arc;

use super::ExecConfig;
use crate::data::Dataset;
use crate::model::Model;
use crate::plan::{RankId, Stage};
use crate::reduce::ReduceMode;
use crate::runtime::step::comm::Comm;
use crate::runtime::step::elastic::replica::Backup;
use crate::runtime::step::state::rank_state::{OptimSettings, RankState};
use crate::runtime::storage::TierSpec;
use crate::runtime::transport::Transport;

/// A rank's state (none yet for a joiner), its backups and its communicator, moved to the
/// worker thread for each job.
pub struct Work<T: Transport> {
    pub state: Option<RankState>,
    /// The newest backup the coordinator committed (as far as this rank knows).
    pub backup: Option<Backup>,
    /// A backup taken since, kept apart until the next step under its (epoch, step) shows the
    /// coordinator committed it: if its round is abandoned, recovery uses `backup`.
    pub fresh: Option<Backup>,
    pub comm: Comm<T>,
}

impl<T: Transport> Work<T> {
    /// The backup taken under `epoch` before `step`, committed or fresh.
    pub fn backup_at(&self, epoch: u64, step: u64) -> Option<&Backup> {
        [self.backup.as_ref(), self.fresh.as_ref()]
            .into_iter()
            .flatten()
            .find(|b| (b.epoch, b.step) == (epoch, step))
    }
}

impl<T: Transport> Work<T> {
    pub fn new(state: Option<RankState>, comm: Comm<T>) -> Self {
        Self {
            state,
            backup: None,
            fresh: None,
            comm,
        }
    }
}

/// What every rank of a run shares, so that a joiner can build its state.
pub struct RankSetup {
    pub stage: Stage,
    pub mode: ReduceMode,
    pub model: Arc<dyn Model>,
    pub optim: OptimSettings,
    pub data: Arc<Dataset>,
    pub exec: ExecConfig,
    /// Where state the placement moves out of RAM lives (none: all in RAM).
    pub storage: Option<Arc<TierSpec>>,
    /// Disconnects a rank from the network: how an injected kill makes the rank vanish.
    pub disconnect: Box<dyn Fn(RankId) + Send + Sync>,
}
