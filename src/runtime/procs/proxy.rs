//! Stand-ins that let the unchanged coordinator and rank actors talk across processes.
//!
//! In the coordinator process a `RankProxy` per remote rank accepts the `RankMsg`s the
//! coordinator actor sends and forwards them over that worker's control connection; it is linked
//! to the coordinator, so when the connection dies or goes silent, stopping the proxy reaches the
//! coordinator as the same supervision event a crashed in-process rank produces.
//!
//! In a worker process a `CoordProxy` accepts the `CoordMsg`s the real rank actor sends and
//! forwards them to the coordinator; it supervises the rank actor and reports its failure.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::mpsc::Sender;

use super::control_plane::{RankCommand, RankReport, ToCoord, ToWorker};
use crate::plan::RankId;
use crate::runtime::actors::CoordMsg;
use crate::runtime::actors::RankMsg;
use crate::runtime::step::state::rank_state::ChunkState;
use crate::runtime::transport::detached::Detached;
use crate::runtime::transport::Transport;

/// Collect requests in flight, answered by the connection's reader when the chunks arrive.
pub type PendingCollects = Arc<Mutex<HashMap<u64, Pending>>>;

/// Who waits for a collect's chunks.
pub enum Pending {
    /// Everything the rank owns (`RankMsg::Collect`).
    All(RpcReplyPort<Vec<ChunkState>>),
    /// A piece of it (`RankMsg::OwnedChunks`), or why not.
    Piece(RpcReplyPort<Result<Vec<ChunkState>, String>>),
}

impl Pending {
    /// Answers with `chunks`, or with `failed` for a piece (a whole collect gets nothing).
    pub fn answer(self, chunks: Vec<ChunkState>, failed: Option<String>) {
        match (self, failed) {
            (Pending::All(port), None) => {
                let _ = port.send(chunks);
            }
            (Pending::All(_), Some(_)) => {}
            (Pending::Piece(port), None) => {
                let _ = port.send(Ok(chunks));
            }
            (Pending::Piece(port), Some(why)) => {
                let _ = port.send(Err(why));
            }
        }
    }
}

pub struct RankProxy;

pub struct RankProxyArgs {
    pub rank: RankId,
    pub link: Sender<Option<ToWorker>>,
    pub pending: PendingCollects,
}

pub struct RankProxyState {
    rank: RankId,
    link: Sender<Option<ToWorker>>,
    pending: PendingCollects,
    next_id: u64,
}

impl Actor for RankProxy {
    type Msg = RankMsg<Detached>;
    type State = RankProxyState;
    type Arguments = RankProxyArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        args: RankProxyArgs,
    ) -> Result<RankProxyState, ActorProcessingErr> {
        Ok(RankProxyState {
            rank: args.rank,
            link: args.link,
            pending: args.pending,
            next_id: 0,
        })
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: RankMsg<Detached>,
        st: &mut RankProxyState,
    ) -> Result<(), ActorProcessingErr> {
        let out = match msg {
            RankMsg::Collect(port) => {
                st.next_id += 1;
                lock(&st.pending).insert(st.next_id, Pending::All(port));
                ToWorker::Collect { id: st.next_id }
            }
            RankMsg::OwnedChunks {
                unit,
                chunks,
                params_only,
                reply,
            } => {
                st.next_id += 1;
                lock(&st.pending).insert(st.next_id, Pending::Piece(reply));
                ToWorker::OwnedChunks {
                    id: st.next_id,
                    unit,
                    chunks,
                    params_only,
                }
            }
            other => match RankCommand::from_msg(other) {
                Some(cmd) => ToWorker::Command(cmd),
                None => return Ok(()),
            },
        };
        // The link is bounded; a worker that stops reading is as good as gone.
        if st.link.try_send(Some(out)).is_err() {
            me.stop(Some(format!(
                "rank {}: its control connection is closed or not draining",
                st.rank
            )));
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Self::Msg>,
        st: &mut RankProxyState,
    ) -> Result<(), ActorProcessingErr> {
        // Dropping the ports fails any collect still waiting on this rank.
        lock(&st.pending).clear();
        Ok(())
    }
}

pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock means a thread panicked mid-update of a plain map; it stays usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a worker process ends, as its proxy saw it.
#[derive(Debug, Clone)]
pub enum WorkerEnd {
    /// The rank actor failed (a compute panic, an injected kill).
    RankFailed(String),
}

pub struct CoordProxy<T: Transport>(std::marker::PhantomData<fn() -> T>);

impl<T: Transport> Default for CoordProxy<T> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

pub struct CoordProxyArgs {
    pub rank: RankId,
    pub link: Sender<Option<ToCoord>>,
    /// Told when the rank actor dies, so that the worker process can exit.
    pub ended: tokio::sync::mpsc::UnboundedSender<WorkerEnd>,
}

impl<T: Transport> Actor for CoordProxy<T> {
    type Msg = CoordMsg<T>;
    type State = CoordProxyArgs;
    type Arguments = CoordProxyArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        args: CoordProxyArgs,
    ) -> Result<CoordProxyArgs, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: CoordMsg<T>,
        st: &mut CoordProxyArgs,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(report) = RankReport::from_msg(msg) {
            // A full or closed link means the coordinator is gone; the worker's reader notices.
            let _ = st.link.try_send(Some(ToCoord::Report(report)));
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _me: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        st: &mut CoordProxyArgs,
    ) -> Result<(), ActorProcessingErr> {
        let reason = match evt {
            SupervisionEvent::ActorFailed(_, err) => err.to_string(),
            SupervisionEvent::ActorTerminated(_, _, why) => {
                why.unwrap_or_else(|| "rank actor stopped".into())
            }
            _ => return Ok(()),
        };
        let report = RankReport::RankFailed {
            rank: st.rank,
            reason: reason.clone(),
        };
        let _ = st.link.try_send(Some(ToCoord::Report(report)));
        let _ = st.ended.send(WorkerEnd::RankFailed(reason));
        Ok(())
    }
}
