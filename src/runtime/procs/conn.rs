//! A ready worker's connection in the coordinator process: its `RankProxy`, the task that
//! reads its messages (reports go to the coordinator actor, collect replies to their callers)
//! and the heartbeat task. A closed connection, a protocol error or silence past
//! `heartbeat_timeout_ms` stops the proxy, which the coordinator actor sees as the rank failing.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorRef};
use tokio::sync::mpsc;

use super::control_plane::{read_msg, ToCoord, ToWorker, WireError, CONTROL_FRAME_MAX_BYTES};
use super::heartbeat::{Liveness, ProcsConfig};
use super::link::{ControlReader, Tasks};
use super::notice::{Notice, NoticeTx};
use super::proxy::{lock, PendingCollects, RankProxy, RankProxyArgs};
use super::standby;
use crate::plan::RankId;
use crate::runtime::actors::CoordMsg;
use crate::runtime::actors::RankMsg;
use crate::runtime::clock::Clock;
use crate::runtime::step::state::rank_state::ChunkState;
use crate::runtime::transport::detached::Detached;

/// What every worker connection in the coordinator process shares.
pub(super) struct ConnEnv<'a> {
    pub coordinator: &'a ActorRef<CoordMsg<Detached>>,
    pub clock: &'a Arc<dyn Clock>,
    pub procs: ProcsConfig,
    pub tasks: &'a Tasks,
    /// Where the workers' notices (`ToCoord::Leave`) go.
    pub notices: &'a NoticeTx,
}

/// Starts the proxy of a worker that is ready, with its reader and heartbeat tasks.
pub(super) async fn start_proxy(
    rank: RankId,
    link: mpsc::Sender<Option<ToWorker>>,
    inbox: Inbox,
    env: ConnEnv<'_>,
) -> Result<ActorRef<RankMsg<Detached>>, String> {
    let ConnEnv {
        coordinator,
        clock,
        procs,
        tasks,
        notices,
    } = env;
    let pending = PendingCollects::default();
    let args = RankProxyArgs {
        rank,
        link: link.clone(),
        pending: Arc::clone(&pending),
    };
    let (proxy, _) = Actor::spawn_linked(None, RankProxy, args, coordinator.get_cell())
        .await
        .map_err(|e| e.to_string())?;
    let live = Arc::new(Mutex::new(Liveness::new(
        clock.now_ms(),
        procs.heartbeat_timeout_ms,
    )));
    let conn = Conn {
        rank,
        proxy: proxy.clone(),
        coordinator: coordinator.clone(),
        live,
        clock: Arc::clone(clock),
        notices: notices.clone(),
    };
    let mut tasks = lock(tasks);
    tasks.push(tokio::spawn(conn.clone().read_loop(inbox, pending)));
    tasks.push(tokio::spawn(conn.heartbeat_loop(link, procs)));
    Ok(proxy)
}

/// Where a worker's messages come from: its connection, or (a joiner, read since it was a
/// standby) the channel its reader task fills.
pub(super) enum Inbox {
    Stream(ControlReader),
    Pumped(standby::Inbox),
}

impl Inbox {
    async fn next(&mut self) -> Result<ToCoord, WireError> {
        match self {
            Inbox::Stream(r) => read_msg::<_, ToCoord>(r, CONTROL_FRAME_MAX_BYTES).await,
            Inbox::Pumped(rx) => rx.recv().await.unwrap_or(Err(WireError::Closed)),
        }
    }
}

/// One worker's connection as the coordinator process sees it.
#[derive(Clone)]
struct Conn {
    rank: RankId,
    proxy: ActorRef<RankMsg<Detached>>,
    coordinator: ActorRef<CoordMsg<Detached>>,
    live: Arc<Mutex<Liveness>>,
    clock: Arc<dyn Clock>,
    notices: NoticeTx,
}

impl Conn {
    async fn read_loop(self, mut inbox: Inbox, pending: PendingCollects) {
        let rank = self.rank;
        // Parts of collects in flight; only for a collect that was asked for, so a worker
        // cannot make this process hold what nobody waits for.
        let mut partial: BTreeMap<u64, Vec<ChunkState>> = BTreeMap::new();
        loop {
            let msg = match inbox.next().await {
                Ok(m) => m,
                Err(e) => {
                    self.proxy.stop(Some(format!(
                        "rank {rank}: control connection lost ({e}); its process exited or the link broke"
                    )));
                    return;
                }
            };
            lock(&self.live).observe(self.clock.now_ms());
            match msg {
                ToCoord::Report(rep) => {
                    let _ = self.coordinator.cast(rep.into_msg(rank));
                }
                ToCoord::CollectPart { id, chunks } => {
                    if lock(&pending).contains_key(&id) {
                        partial.entry(id).or_default().extend(chunks);
                    }
                }
                ToCoord::CollectReply { id, chunks } => {
                    let mut all = partial.remove(&id).unwrap_or_default();
                    all.extend(chunks);
                    if let Some(p) = lock(&pending).remove(&id) {
                        p.answer(all, None);
                    }
                }
                ToCoord::CollectFailed { id, reason } => {
                    partial.remove(&id);
                    if let Some(p) = lock(&pending).remove(&id) {
                        p.answer(Vec::new(), Some(format!("rank {rank}: {reason}")));
                    }
                }
                ToCoord::Progress { epoch, step } => {
                    let _ = self
                        .coordinator
                        .cast(CoordMsg::Progress { rank, epoch, step });
                }
                ToCoord::Leave { cause, grace_ms } => {
                    let at_ms = self.clock.now_ms();
                    let notice = Notice {
                        rank,
                        cause,
                        grace_ms,
                        at_ms,
                    };
                    // The driver is gone only when the job is over: nothing to drain then.
                    let _ = self.notices.send(notice);
                }
                ToCoord::Heartbeat | ToCoord::Ready | ToCoord::Bound { .. } => {}
                ToCoord::Hello { .. } | ToCoord::Reattach { .. } => {
                    self.proxy.stop(Some(format!(
                        "rank {rank}: protocol error (a second hello)"
                    )));
                    return;
                }
            }
        }
    }

    async fn heartbeat_loop(self, link: mpsc::Sender<Option<ToWorker>>, procs: ProcsConfig) {
        let mut every = tokio::time::interval(Duration::from_millis(procs.heartbeat_ms));
        loop {
            every.tick().await;
            // A full queue is caught by the silence check or by the proxy's next send.
            let _ = link.try_send(Some(ToWorker::Heartbeat));
            let silent = lock(&self.live).silent(self.clock.now_ms());
            if let Some(ms) = silent {
                let why = format!(
                    "rank {}: silent for {ms} ms (heartbeat_timeout_ms is {}); its process is hung or its link is down",
                    self.rank, procs.heartbeat_timeout_ms
                );
                // A hung process may wake (SIGCONT, a healed link): the last words it reads
                // say it is out, so it exits as failed and never acts on the stale state it
                // holds. The connection closes after them.
                let _ = link.try_send(Some(ToWorker::Stop {
                    ok: false,
                    reason: format!(
                        "declared failed by the coordinator ({why}); the job goes on without \
                         this rank, so this process is refused as stale"
                    ),
                }));
                let _ = link.try_send(None);
                self.proxy.stop(Some(why));
                return;
            }
        }
    }
}
