//! Admission of worker processes: each connection's TLS handshake and hello run as a task of
//! their own under `HELLO_TIMEOUT`, so a slow or hostile peer holds up only itself; a good hello
//! gets an initial rank (its hint if free) or, once every rank is taken or when it asks, a place
//! in the lobby of standbys. A refused hello is told why before its connection closes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::control_plane::{read_msg, write_msg, ToCoord, ToWorker, HELLO_FRAME_MAX_BYTES};
use super::error::ProcError;
use super::link::{ControlReader, ControlWriter};
use super::standby::Lobby;
use crate::config::TrainConfig;
use crate::job::run_plan::StoragePlan;
use crate::model::Model;
use crate::net::tls::{check_alpn, Protocol};
use crate::plan::tier::gib;
use crate::plan::RankId;

/// How long a new connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// A worker's control connection, split.
pub(super) struct Joined {
    pub(super) rank: RankId,
    pub(super) peer: SocketAddr,
    /// What the worker said its host has free (see `ToCoord::Hello`).
    pub(super) available_memory_bytes: Option<u64>,
    pub(super) reader: ControlReader,
    pub(super) writer: ControlWriter,
}

/// A connection that completed the handshake and sent its first message.
pub(super) struct Greeted {
    pub(super) peer: SocketAddr,
    pub(super) msg: ToCoord,
    pub(super) reader: ControlReader,
    pub(super) writer: ControlWriter,
}

/// Accepts connections until every rank has a worker, refusing failed handshakes and bad
/// hellos. Handshakes run as tasks of `door`, so a slow or hostile peer holds up only itself;
/// those not done yet stay there for the standby lobby.
pub(super) async fn admit(
    door: &mut Door,
    ranks: u32,
    token: &str,
    join_timeout_ms: u64,
    deadline: Instant,
    count: &AtomicU32,
    lobby: &Lobby,
) -> Result<Vec<Joined>, ProcError> {
    let mut joined: BTreeMap<RankId, Joined> = BTreeMap::new();
    while joined.len() < ranks as usize {
        tokio::select! {
            g = door.next_greeted() => {
                let peer = g.peer;
                match check_in(g, token, &joined, ranks).await {
                    Ok(CheckedIn::Rank(j)) => {
                        tracing::info!("rank {} joined from {peer}", j.rank);
                        joined.insert(j.rank, j);
                        count.store(joined.len() as u32, Ordering::Relaxed);
                    }
                    Ok(CheckedIn::Standby(reader, writer)) => lobby.hold(peer, reader, writer),
                    Err(why) => tracing::warn!("refused a connection from {peer}: {why}"),
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                return Err(ProcError::Setup(format!(
                    "{} of {} workers joined within join_timeout_ms ({} ms)",
                    joined.len(),
                    ranks,
                    join_timeout_ms
                )));
            }
        }
    }
    Ok(joined.into_values().collect())
}

/// Where workers come in: the coordinator's port, its TLS acceptor, and the handshakes and
/// hellos in progress. One door serves the coordinator from standing by to the job's end, so
/// that a worker who connects while the coordinator changes role (elected, then admitting, then
/// running) is greeted by the next role instead of cut off mid-handshake.
pub(super) struct Door {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    greeting: JoinSet<Option<Greeted>>,
}

impl Door {
    pub(super) fn new(listener: TcpListener, acceptor: TlsAcceptor) -> Self {
        Self {
            listener,
            acceptor,
            greeting: JoinSet::new(),
        }
    }

    /// Accepts connections, greeting each on a task of its own, until one is greeted.
    /// Cancel-safe: a greeting still running stays for the next call.
    pub(super) async fn next_greeted(&mut self) -> Greeted {
        loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        self.greeting.spawn(greet(self.acceptor.clone(), stream, peer));
                    }
                    Err(e) => tracing::warn!("accepting a worker failed: {e}"),
                },
                Some(done) = self.greeting.join_next(), if !self.greeting.is_empty() => match done {
                    Ok(Some(g)) => return g,
                    Ok(None) => {}
                    Err(e) => tracing::warn!("a connection's handshake task failed: {e}"),
                },
            }
        }
    }
}

/// Once the job has started: holds every worker that connects (and authenticates) as a standby.
pub(super) async fn accept_standbys(mut door: Door, token: String, lobby: Arc<Lobby>) {
    loop {
        let g = door.next_greeted().await;
        let peer = g.peer;
        let full = BTreeMap::new();
        // World 0: there is no initial rank left to give, so a good hello is a standby.
        match check_in(g, &token, &full, 0).await {
            Ok(CheckedIn::Standby(reader, writer)) => lobby.hold(peer, reader, writer),
            Ok(CheckedIn::Rank(_)) => {}
            Err(why) => tracing::warn!("refused a connection from {peer}: {why}"),
        }
    }
}

/// The TLS handshake and the first message, within `HELLO_TIMEOUT`. A failure is logged here,
/// so that it is on record even when the job is complete before the task is joined.
async fn greet(acceptor: TlsAcceptor, stream: TcpStream, peer: SocketAddr) -> Option<Greeted> {
    let _ = stream.set_nodelay(true);
    let greeted = async {
        let tls = acceptor
            .accept(stream)
            .await
            .map_err(|e| format!("TLS handshake failed: {e}"))?;
        check_alpn(tls.get_ref().1.alpn_protocol(), Protocol::Control)?;
        let (mut reader, writer) = tokio::io::split(tls);
        let msg = read_msg::<_, ToCoord>(&mut reader, HELLO_FRAME_MAX_BYTES)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(Greeted {
            peer,
            msg,
            reader,
            writer,
        })
    };
    let why = match tokio::time::timeout(HELLO_TIMEOUT, greeted).await {
        Ok(Ok(g)) => return Some(g),
        Ok(Err(why)) => why,
        Err(_) => "no TLS handshake and hello within 5 s".to_string(),
    };
    tracing::warn!("refused a connection from {peer}: {why}");
    None
}

/// What an admitted hello becomes.
enum CheckedIn {
    Rank(Joined),
    Standby(ControlReader, ControlWriter),
}

/// Admits an authenticated connection's hello, or tells it why not.
async fn check_in(
    g: Greeted,
    token: &str,
    joined: &BTreeMap<RankId, Joined>,
    world: u32,
) -> Result<CheckedIn, String> {
    let Greeted {
        peer,
        msg,
        reader,
        mut writer,
    } = g;
    let available_memory_bytes = match &msg {
        ToCoord::Hello {
            available_memory_bytes,
            ..
        } => *available_memory_bytes,
        _ => None,
    };
    match check_hello(msg, token, joined, world) {
        Ok(Some(rank)) => Ok(CheckedIn::Rank(Joined {
            rank,
            peer,
            available_memory_bytes,
            reader,
            writer,
        })),
        Ok(None) => Ok(CheckedIn::Standby(reader, writer)),
        Err(reason) => {
            let refused = ToWorker::Refused {
                reason: reason.clone(),
            };
            let _ = tokio::time::timeout(HELLO_TIMEOUT, write_msg(&mut writer, &refused)).await;
            Err(reason)
        }
    }
}

/// The initial rank for a hello (`None`: a standby, for a standby hello or once every initial
/// rank is taken), or why it is refused.
fn check_hello(
    msg: ToCoord,
    token: &str,
    joined: &BTreeMap<RankId, Joined>,
    world: u32,
) -> Result<Option<RankId>, String> {
    let ToCoord::Hello {
        token: got,
        rank_hint,
        standby,
        ..
    } = msg
    else {
        return Err("the first message was not a hello".into());
    };
    if got != token {
        return Err("wrong cluster token".into());
    }
    if standby {
        return Ok(None);
    }
    let free = |r: &RankId| !joined.contains_key(r);
    Ok(rank_hint
        .filter(|r| *r < world && free(r))
        .or_else(|| (0..world).find(free)))
}

/// Refuses a model that cannot fit on a worker's host before the coordinator plans its shard
/// map: each worker would refuse it too, but only once it has the plan, and a model of
/// trillions of parameters takes the coordinator minutes and gigabytes to plan. Each worker's
/// check (`worker_storage`) is one rank's plan against what its host has free; this is the same
/// check against what each worker said in its hello. Every joined worker is told why.
pub(super) async fn refuse_unfit(
    cfg: &TrainConfig,
    model: &dyn Model,
    joined: &mut [Joined],
) -> Result<(), ProcError> {
    let tightest = joined
        .iter()
        .filter_map(|j| j.available_memory_bytes.map(|b| (b, j.rank, j.peer)))
        .min();
    let Some((available, rank, peer)) = tightest else {
        return Ok(());
    };
    let Err(e) = StoragePlan::new(cfg, model, 1, false, available) else {
        return Ok(());
    };
    let reason = format!(
        "the model cannot fit on rank {rank}'s host ({}, {} free): {e}",
        peer.ip(),
        gib(available)
    );
    for j in joined.iter_mut() {
        let refused = ToWorker::Refused {
            reason: reason.clone(),
        };
        let _ = tokio::time::timeout(HELLO_TIMEOUT, write_msg(&mut j.writer, &refused)).await;
    }
    Err(ProcError::Setup(reason))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::tls::{peer_server_name, ClusterTls};
    use crate::net::ClusterCa;
    use tokio_rustls::TlsConnector;

    /// A worker whose handshake is under way when the coordinator stops waiting at the door
    /// (a standby elected mid-handshake) is greeted by the next wait, not cut off.
    #[tokio::test]
    async fn a_greeting_outlives_a_cancelled_wait() {
        let ca = ClusterCa::generate("test").unwrap();
        let server = ClusterTls::new(&ca.issue("coordinator").unwrap()).unwrap();
        let client = ClusterTls::new(&ca.issue("worker").unwrap()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut door = Door::new(
            listener,
            TlsAcceptor::from(server.server(Protocol::Control)),
        );
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let worker = tokio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            // The connection is accepted while the first wait runs; the handshake starts after.
            wait.await.unwrap();
            let connector = TlsConnector::from(client.client(Protocol::Control));
            let mut tls = connector.connect(peer_server_name(), tcp).await.unwrap();
            let hello = ToCoord::Hello {
                token: "t".into(),
                rank_hint: Some(1),
                standby: false,
                available_memory_bytes: None,
            };
            write_msg(&mut tls, &hello).await.unwrap();
            tls
        });
        let first = tokio::time::timeout(Duration::from_millis(300), door.next_greeted()).await;
        assert!(first.is_err(), "nothing is greeted before the handshake");
        go.send(()).unwrap();
        let g = tokio::time::timeout(Duration::from_secs(10), door.next_greeted())
            .await
            .expect("the greeting begun under the cancelled wait completes under the next");
        assert!(matches!(
            g.msg,
            ToCoord::Hello {
                rank_hint: Some(1),
                ..
            }
        ));
        drop(worker.await.unwrap());
    }
}
