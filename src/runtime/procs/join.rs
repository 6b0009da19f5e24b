//! Ranks joining a running job with worker processes. For each rank the engine asks for
//! (`Command::Spawn`), in order: take a standby worker (waiting at most `join_wait_ms`), welcome
//! it with its rank and the committed map, tell every member its data address and it every
//! member's, wait until it is connected and ready, then start its proxy and report
//! `CoordMsg::Joined`. Any failure is reported as the rank failing to start, with the reason.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::conn::{start_proxy, ConnEnv, Inbox};
use super::control_plane::{DataPlane, ToCoord, ToWorker, Welcome};
use super::heartbeat::ProcsConfig;
use super::link::{Links, Tasks};
use super::notice::NoticeTx;
use super::planes::Endpoints;
use super::proxy::lock;
use super::standby::{self, Lobby, Standby};
use crate::plan::RankId;
use crate::runtime::actors::CoordMsg;
use crate::runtime::actors::RankMsg;
use crate::runtime::clock::Clock;
use crate::runtime::transport::detached::Detached;

/// Everything bringing a joiner up needs.
pub(super) struct Joining {
    pub config_json: String,
    pub data_plane: DataPlane,
    /// `Welcome::ucx_net`.
    pub ucx_net: Option<String>,
    pub procs: ProcsConfig,
    /// Largest part of chunk states in one frame (`Welcome::part_max_bytes`).
    pub part_max_bytes: u64,
    pub lobby: Arc<Lobby>,
    pub links: Links,
    /// Every worker's data-plane endpoint, by rank.
    pub endpoints: Arc<Endpoints>,
    pub coordinator: ActorRef<CoordMsg<Detached>>,
    pub clock: Arc<dyn Clock>,
    pub tasks: Tasks,
    pub writers: Tasks,
    pub notices: NoticeTx,
    /// Ranks this task brought up, in order.
    pub joined: std::sync::Mutex<Vec<RankId>>,
    /// `Welcome::term`.
    pub term: u64,
}

impl Joining {
    /// Brings up the ranks the coordinator asks for, one at a time (a second joiner then hears
    /// of the first as a member), until the coordinator stops.
    pub async fn serve(self, mut ranks: mpsc::UnboundedReceiver<RankId>) {
        while let Some(rank) = ranks.recv().await {
            let (started, host) = match self.admit(rank).await {
                Ok((actor, host)) => (Ok(actor), Some(host)),
                Err(why) => {
                    tracing::warn!("rank {rank} could not join: {why}");
                    (Err(why), None)
                }
            };
            let _ = self.coordinator.cast(CoordMsg::Joined {
                rank,
                started,
                host,
            });
        }
    }

    /// The joiner's proxy actor and its host (the standby's IP address, as the initial
    /// workers' hosts are).
    async fn admit(&self, rank: RankId) -> Result<(ActorRef<RankMsg<Detached>>, String), String> {
        let wait = self.procs.join_wait_ms;
        let Some(mut standby) = self
            .lobby
            .take(Instant::now() + Duration::from_millis(wait))
            .await
        else {
            return Err(format!(
                "no standby worker connected within join_wait_ms ({wait} ms): start `ezero worker --join {}` (same cluster secrets and token) on the new machine",
                self.lobby.workers_addr()
            ));
        };
        let peer = standby.peer;
        match self.bring_up(rank, &mut standby).await {
            Ok(()) => {
                tracing::info!("rank {rank} joined from {peer}");
                let Standby {
                    link,
                    writer,
                    inbox,
                    ..
                } = standby;
                lock(&self.writers).push(writer);
                lock(&self.links).insert(rank, link.clone());
                lock(&self.joined).push(rank);
                let env = ConnEnv {
                    coordinator: &self.coordinator,
                    clock: &self.clock,
                    procs: self.procs,
                    tasks: &self.tasks,
                    notices: &self.notices,
                };
                start_proxy(rank, link, Inbox::Pumped(inbox), env)
                    .await
                    .map(|actor| (actor, peer.ip().to_string()))
            }
            Err(why) => {
                standby.dismiss(false, format!("could not join as rank {rank}: {why}"));
                Err(format!("the standby worker from {peer}: {why}"))
            }
        }
    }

    /// Welcome, data addresses both ways, ready; the joiner's endpoint is recorded.
    async fn bring_up(&self, rank: RankId, s: &mut Standby) -> Result<(), String> {
        let view = self
            .coordinator
            .call(CoordMsg::View, Some(Duration::from_secs(5)))
            .await;
        let map = match view {
            Ok(ractor::rpc::CallResult::Success(v)) => v.map,
            _ => return Err("the coordinator did not answer".into()),
        };
        let ranks = self.peers_of_joiner(&map.members);
        let welcome = Welcome {
            rank,
            config_json: self.config_json.clone(),
            world: ranks.len() as u32 + 1,
            map,
            data_plane: self.data_plane,
            ucx_net: self.ucx_net.clone(),
            procs: self.procs,
            // A joiner starts empty and gets its chunks in the reshard that admits it.
            restore: false,
            part_max_bytes: self.part_max_bytes,
            ranks_on_host: 1 + self.endpoints.count_from(s.peer.ip(), &ranks) as u32,
            term: self.term,
        };
        send(s, ToWorker::Welcome(Box::new(welcome)))?;
        let deadline = Instant::now() + Duration::from_millis(self.procs.join_timeout_ms);
        match expect(&mut s.inbox, deadline, "bound").await? {
            ToCoord::Bound { data_addr, ucx } if data_addr.parse::<SocketAddr>().is_ok() => {
                self.endpoints.record(rank, data_addr, ucx, s.peer.ip());
            }
            other => return Err(format!("sent {} instead of its data address", other.kind())),
        };
        let peers = self.endpoints.peers_for(rank, ranks.iter().copied());
        {
            let links = lock(&self.links);
            for p in &peers {
                if let Some(l) = links.get(&p.rank) {
                    for me in self.endpoints.peers_for(p.rank, [rank]) {
                        let _ = l.try_send(Some(ToWorker::AddPeer(me)));
                    }
                }
            }
        }
        let mut peers = peers;
        peers.extend(self.endpoints.peers_for(rank, [rank]));
        send(s, ToWorker::Peers { peers })?;
        match expect(&mut s.inbox, deadline, "ready").await? {
            ToCoord::Ready => Ok(()),
            other => Err(format!("sent {} instead of ready", other.kind())),
        }
    }
}

impl Joining {
    /// The ranks a joiner exchanges data with: the committed members, and the joiners of the
    /// same change brought up before it (their ids follow every member's; a joiner of an
    /// abandoned change that is still connected is included too, harmlessly).
    fn peers_of_joiner(&self, members: &[RankId]) -> Vec<RankId> {
        let links = lock(&self.links);
        let live = |r: &RankId| links.get(r).is_some_and(|l| !l.is_closed());
        let newest = members.iter().max().copied();
        let mut ranks = members.to_vec();
        ranks.extend(
            lock(&self.joined)
                .iter()
                .filter(|r| newest.is_none_or(|m| **r > m) && live(r)),
        );
        ranks
    }
}

fn send(s: &Standby, msg: ToWorker) -> Result<(), String> {
    s.link
        .try_send(Some(msg))
        .map_err(|_| "its control connection is closed or not draining".to_string())
}

/// The next message other than a heartbeat, by `deadline`.
async fn expect(
    inbox: &mut standby::Inbox,
    deadline: Instant,
    what: &str,
) -> Result<ToCoord, String> {
    loop {
        match tokio::time::timeout_at(deadline, inbox.recv()).await {
            Ok(Some(Ok(ToCoord::Heartbeat))) => continue,
            Ok(Some(Ok(msg))) => return Ok(msg),
            Ok(Some(Err(e))) => return Err(format!("failed before it was {what}: {e}")),
            Ok(None) => return Err(format!("its connection closed before it was {what}")),
            Err(_) => return Err(format!("was not {what} within join_timeout_ms")),
        }
    }
}
