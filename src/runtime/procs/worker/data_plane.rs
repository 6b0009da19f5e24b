//! A worker's data plane: binding its listener, trading data addresses (and UCX worker
//! addresses) with the peers through the coordinator, and building the transport.

use std::net::SocketAddr;
#[cfg(feature = "ucx")]
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::{next, ControlReader, WorkerOptions};
use crate::config::TrainConfig;
use crate::plan::RankId;
use crate::runtime::procs::control_plane::{DataPeer, ToCoord, ToWorker, UcxBound, Welcome};
use crate::runtime::procs::error::ProcError;
use crate::runtime::transport::quic::{QuicConfig, QuicTransport};
#[cfg(feature = "ucx")]
use crate::runtime::transport::tcp::DATA_FRAME_MAX_BYTES;
use crate::runtime::transport::tcp::{TcpListenerHandle, TcpTransport};
#[cfg(feature = "ucx")]
use crate::runtime::transport::ucx::engine::{Engine, EngineConfig};

/// A peer's data-plane address as this worker uses it.
pub(super) struct Peer {
    pub(super) rank: RankId,
    pub(super) addr: SocketAddr,
    /// Its UCX worker address, when the coordinator picked UCX for this pair.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(super) ucx: Option<Vec<u8>>,
}

/// Reports this worker's data address (and UCX side) and waits for everyone's.
pub(super) async fn exchange(
    bound: SocketAddr,
    ucx: Option<UcxBound>,
    link: &mpsc::Sender<Option<ToCoord>>,
    reader: &mut ControlReader,
    join_ms: u64,
    opts: &WorkerOptions,
) -> Result<(Vec<Peer>, Bound), ProcError> {
    let data_addr = opts.data_advertise.unwrap_or(bound).to_string();
    let bound_msg = ToCoord::Bound {
        data_addr: data_addr.clone(),
        ucx: ucx.clone(),
    };
    let _ = link.send(Some(bound_msg)).await;
    let ToWorker::Peers { peers } = next(reader, join_ms, &opts.join).await? else {
        return Err(ProcError::Setup(
            "the coordinator did not send the peer list".into(),
        ));
    };
    let peers = peers.into_iter().map(peer).collect::<Result<_, _>>()?;
    Ok((peers, Bound { data_addr, ucx }))
}

/// Where this worker's peers reach it, as it told the coordinator (and tells a new leader).
#[derive(Clone, Debug)]
pub(super) struct Bound {
    pub(super) data_addr: String,
    pub(super) ucx: Option<UcxBound>,
}

pub(super) fn peer(p: DataPeer) -> Result<Peer, ProcError> {
    let addr = p.data_addr.parse::<SocketAddr>().map_err(|_| {
        ProcError::Setup(format!(
            "rank {}'s data address `{}` is invalid",
            p.rank, p.data_addr
        ))
    })?;
    Ok(Peer {
        rank: p.rank,
        addr,
        ucx: p.ucx,
    })
}

pub(super) fn bind_tcp(opts: &WorkerOptions) -> Result<TcpListenerHandle, ProcError> {
    TcpListenerHandle::bind(&opts.data_listen, &opts.token, &opts.tls).map_err(|e| {
        ProcError::Setup(format!(
            "cannot listen for peers on {}: {e}",
            opts.data_listen
        ))
    })
}

/// The TCP plane to `peers`.
pub(super) fn tcp_transport(
    data: TcpListenerHandle,
    welcome: &Welcome,
    cfg: &TrainConfig,
    peers: &[Peer],
) -> TcpTransport {
    // A write that cannot move a byte for a collective timeout (a frozen or blackholed peer
    // whose window is full) fails like a lost peer, rather than block the rank.
    let stall = Duration::from_millis(cfg.collective_timeout_ms);
    data.into_transport(
        welcome.rank,
        peers.iter().map(|p| (p.rank, p.addr)).collect(),
    )
    .with_send_stall_timeout(stall)
}

/// This rank's UCX engine: shared memory, and the trusted network devices when given;
/// frames up to the TCP plane's limit.
#[cfg(feature = "ucx")]
pub(super) fn start_ucx(rank: RankId, net: Option<&str>) -> Result<Arc<Engine>, ProcError> {
    let base = match net {
        Some(devices) => EngineConfig::with_network(rank, devices),
        None => EngineConfig::shared_memory(rank),
    };
    let cfg = EngineConfig {
        max_message_bytes: DATA_FRAME_MAX_BYTES as usize + (1 << 10),
        ..base
    };
    Engine::start(cfg)
        .map(Arc::new)
        .map_err(|e| ProcError::Setup(format!("rank {rank}: {e}")))
}

pub(super) fn bind_quic(
    welcome: &Welcome,
    opts: &WorkerOptions,
) -> Result<QuicTransport, ProcError> {
    let rank = welcome.rank;
    let addr: SocketAddr = opts.data_listen.parse().map_err(|_| {
        ProcError::Setup(format!(
            "data address `{}` is not ip:port",
            opts.data_listen
        ))
    })?;
    // Peers of a loopback address are on this machine: large datagrams are safe there.
    QuicTransport::bind_tls(rank, addr, &opts.tls, &QuicConfig::for_bind(addr))
        .map_err(|e| ProcError::Setup(format!("rank {rank}: {e}")))
}
