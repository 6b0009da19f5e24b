//! The control plane between the coordinator process and its worker processes: the messages
//! (serialisable mirrors of `CoordMsg` and `RankMsg`) and their framing on a byte stream.
//!
//! A frame is `[version u8][length u32 LE][crc32 u32 LE][bincode payload]`. The reader checks the
//! version, refuses a length over the limit it was given before allocating, and checks the
//! checksum before decoding; a frame that fails any check is an error, never applied.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::heartbeat::ProcsConfig;
use crate::engine::messages::{StepPlan, StepReport};
use crate::plan::{RankId, ShardMap};
use crate::runtime::actors::CoordMsg;
use crate::runtime::actors::RankMsg;
use crate::runtime::step::state::rank_state::ChunkState;
use crate::runtime::transport::Transport;

/// Version of the control protocol; a peer speaking another is refused.
pub const CONTROL_VERSION: u8 = 6;
/// Largest control frame after the handshake (chunk states for consolidation travel here).
pub const CONTROL_FRAME_MAX_BYTES: u32 = 1 << 30;
/// Largest frame accepted before a peer has authenticated.
pub const HELLO_FRAME_MAX_BYTES: u32 = 64 << 10;
const HEADER_BYTES: usize = 9;

/// Why a control frame could not be read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("the connection closed")]
    Closed,
    #[error("i/o error: {0}")]
    Io(String),
    #[error("protocol version {got}, expected {CONTROL_VERSION}")]
    Version { got: u8 },
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: u32, max: u32 },
    #[error("frame checksum mismatch")]
    Checksum,
    #[error("undecodable frame: {0}")]
    Decode(String),
}

fn codec() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// Encodes `msg` as one frame.
pub fn encode<M: Serialize>(msg: &M) -> Result<Vec<u8>, WireError> {
    let body = bincode::serde::encode_to_vec(msg, codec())
        .map_err(|e| WireError::Decode(e.to_string()))?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|l| *l <= CONTROL_FRAME_MAX_BYTES)
        .ok_or(WireError::TooLarge {
            len: u32::MAX,
            max: CONTROL_FRAME_MAX_BYTES,
        })?;
    let mut out = Vec::with_capacity(HEADER_BYTES + body.len());
    out.push(CONTROL_VERSION);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes one complete frame (header and body), checking everything.
pub fn decode<M: DeserializeOwned>(frame: &[u8], max: u32) -> Result<M, WireError> {
    let (header, body) = frame
        .split_at_checked(HEADER_BYTES)
        .ok_or_else(|| WireError::Decode("truncated header".into()))?;
    let (len, crc) = check_header(header, max)?;
    if body.len() != len as usize {
        return Err(WireError::Decode(format!(
            "header says {len} bytes, frame has {}",
            body.len()
        )));
    }
    decode_body(body, crc)
}

fn check_header(h: &[u8], max: u32) -> Result<(u32, u32), WireError> {
    if h[0] != CONTROL_VERSION {
        return Err(WireError::Version { got: h[0] });
    }
    // Invariant: `h` is HEADER_BYTES long, so both 4-byte slices exist.
    let len = u32::from_le_bytes(h[1..5].try_into().expect("4 bytes"));
    let crc = u32::from_le_bytes(h[5..9].try_into().expect("4 bytes"));
    if len > max {
        return Err(WireError::TooLarge { len, max });
    }
    Ok((len, crc))
}

fn decode_body<M: DeserializeOwned>(body: &[u8], crc: u32) -> Result<M, WireError> {
    if crc32fast::hash(body) != crc {
        return Err(WireError::Checksum);
    }
    let (msg, used) = bincode::serde::decode_from_slice(body, codec())
        .map_err(|e| WireError::Decode(e.to_string()))?;
    if used != body.len() {
        return Err(WireError::Decode(format!(
            "{} trailing bytes",
            body.len() - used
        )));
    }
    Ok(msg)
}

/// Reads one frame of at most `max` body bytes.
pub async fn read_msg<R: AsyncRead + Unpin, M: DeserializeOwned>(
    r: &mut R,
    max: u32,
) -> Result<M, WireError> {
    let mut header = [0u8; HEADER_BYTES];
    r.read_exact(&mut header).await.map_err(io_err)?;
    let (len, crc) = check_header(&header, max)?;
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await.map_err(io_err)?;
    decode_body(&body, crc)
}

/// Writes one frame.
pub async fn write_msg<W: AsyncWrite + Unpin, M: Serialize>(
    w: &mut W,
    msg: &M,
) -> Result<(), WireError> {
    let frame = encode(msg)?;
    w.write_all(&frame).await.map_err(io_err)?;
    w.flush().await.map_err(io_err)
}

fn io_err(e: std::io::Error) -> WireError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        WireError::Closed
    } else {
        WireError::Io(e.to_string())
    }
}

/// Worker to coordinator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToCoord {
    /// The first message on a connection.
    Hello {
        token: String,
        /// The rank this worker would like (an orchestrator's hint); the coordinator may differ.
        rank_hint: Option<RankId>,
        /// Only join as a new rank of the running job, never as one of its initial ranks.
        /// Every worker that connects once the job has started is a standby anyway.
        standby: bool,
        /// The memory this worker's host has free, for the coordinator to refuse a model that
        /// cannot fit before it plans the shard map (`None`: unknown on this platform).
        available_memory_bytes: Option<u64>,
    },
    /// The first message on a connection to a new leader, from a worker whose coordinator was
    /// lost: it kept its rank, its state and its backups, and its data plane is still bound.
    Reattach {
        token: String,
        rank: RankId,
        /// The highest leader term this worker has followed: a coordinator of no higher term
        /// is refused.
        term_seen: u64,
        /// The (epoch, step) of the work the rank was still busy in, if any (it was
        /// interrupted; its answer follows on this connection).
        busy: Option<(u64, u64)>,
        data_addr: String,
        ucx: Option<UcxBound>,
    },
    /// The data plane is bound (after the welcome, which says which one): peers reach this
    /// worker there.
    Bound {
        data_addr: String,
        /// Under `DataPlane::Ucx`: the worker's UCX address and where it runs, for the
        /// coordinator to pick UCX for the peers on its host.
        ucx: Option<UcxBound>,
    },
    /// Connected to every peer, state built, the rank actor running: it can take steps.
    Ready,
    Report(RankReport),
    /// A collect's chunks arrive in parts of at most `Welcome::part_max_bytes`, so no frame
    /// nears the frame limit: `CollectPart`s first, then the `CollectReply` with the last part.
    CollectPart {
        id: u64,
        chunks: Vec<ChunkState>,
    },
    CollectReply {
        id: u64,
        chunks: Vec<ChunkState>,
    },
    /// A piece collect the rank could not answer, and why.
    CollectFailed {
        id: u64,
        reason: String,
    },
    Heartbeat,
    /// The worker's rank finished units within (epoch, step) since its last `Progress`: a
    /// long step is moving.
    Progress {
        epoch: u64,
        step: u64,
    },
    /// The worker was given notice (a SIGTERM: a pod eviction, a spot preemption) and asks to
    /// be drained at the next step boundary; it takes the abrupt path itself after `grace_ms`.
    Leave {
        /// What gave notice, for the coordinator's log (`SIGTERM`).
        cause: String,
        grace_ms: u64,
    },
}

impl ToCoord {
    /// The message's name, for errors: a part's chunks are too long to print, and a worker
    /// that sends the wrong message must not be able to fill the log.
    pub fn kind(&self) -> &'static str {
        match self {
            ToCoord::Hello { .. } => "a hello",
            ToCoord::Reattach { .. } => "a re-attach",
            ToCoord::Bound { .. } => "its data address",
            ToCoord::Ready => "ready",
            ToCoord::Report(_) => "a report",
            ToCoord::CollectPart { .. } => "a collect part",
            ToCoord::CollectReply { .. } => "a collect reply",
            ToCoord::CollectFailed { .. } => "a failed collect",
            ToCoord::Heartbeat => "a heartbeat",
            ToCoord::Progress { .. } => "progress",
            ToCoord::Leave { .. } => "a notice",
        }
    }
}

/// Coordinator to worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToWorker {
    Welcome(Box<Welcome>),
    /// With `Welcome::restore`: part of the saved state the rank starts from (`last` ends it).
    StatePart {
        chunks: Vec<ChunkState>,
        last: bool,
    },
    /// Every member's data-plane address, once all are bound.
    Peers {
        peers: Vec<DataPeer>,
    },
    /// The hello was refused (bad token, too many standbys); the connection closes next.
    Refused {
        reason: String,
    },
    /// This coordinator stands by and does not lead the job: try the leader (its worker
    /// address, when the metadata store names one) or another coordinator.
    NotLeader {
        leader: Option<String>,
    },
    /// A re-attach was accepted by the leader of `term`; its commands follow.
    Attached {
        term: u64,
    },
    /// The job holds this worker as a standby until a join needs a rank: it heartbeats at the
    /// coordinator's pace meanwhile, and a welcome comes when it is taken.
    Standby {
        heartbeat_ms: u64,
        heartbeat_timeout_ms: u64,
        /// `Welcome::term`: above 0, a standby whose coordinator is lost looks for the next
        /// leader instead of stopping.
        term: u64,
    },
    /// A rank joined the running job: the data plane can reach it here.
    AddPeer(DataPeer),
    Command(RankCommand),
    Collect {
        id: u64,
    },
    /// A piece of what the rank owns (`RankMsg::OwnedChunks`), answered like a collect.
    OwnedChunks {
        id: u64,
        unit: usize,
        chunks: Vec<usize>,
        params_only: bool,
    },
    /// Stop waiting in (epoch, step): it is being abandoned.
    Interrupt {
        epoch: u64,
        step: u64,
    },
    Heartbeat,
    /// The job is over for this worker: finished (`ok`), left, or aborted with a reason.
    Stop {
        ok: bool,
        reason: String,
    },
}

impl ToWorker {
    /// The message's name, for errors (a part's chunks are too long to print).
    pub fn kind(&self) -> &'static str {
        match self {
            ToWorker::Welcome(_) => "a welcome",
            ToWorker::StatePart { .. } => "a state part",
            ToWorker::Peers { .. } => "the peer list",
            ToWorker::Refused { .. } => "a refusal",
            ToWorker::Command(_) => "a command",
            ToWorker::Collect { .. } => "a collect",
            ToWorker::OwnedChunks { .. } => "a piece collect",
            ToWorker::Interrupt { .. } => "an interrupt",
            ToWorker::Heartbeat => "a heartbeat",
            ToWorker::Stop { .. } => "a stop",
            ToWorker::Standby { .. } => "a standby notice",
            ToWorker::AddPeer(_) => "a new peer",
            ToWorker::NotLeader { .. } => "a not-leader answer",
            ToWorker::Attached { .. } => "an attach",
        }
    }
}

/// Everything a worker needs to build its rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    /// A rank that is not a member of `map` is a joiner: it starts with no state and receives
    /// its chunks in the reshard that admits it.
    pub rank: RankId,
    /// The job's `TrainConfig` as JSON (it skips absent options, which bincode cannot).
    pub config_json: String,
    pub map: ShardMap,
    pub world: u32,
    pub data_plane: DataPlane,
    /// Under `DataPlane::Ucx`: network devices UCX may use between hosts (`--ucx-net`),
    /// unencrypted; `None`: shared memory only.
    pub ucx_net: Option<String>,
    pub procs: ProcsConfig,
    /// `StatePart`s follow with the chunks this rank starts from (`--resume`, `--init`),
    /// instead of the model's initialisation.
    pub restore: bool,
    /// Largest part of chunk states in one frame, both ways (`state::parts`).
    pub part_max_bytes: u64,
    /// The job's workers whose control connections came from this worker's address, itself
    /// included: the coordinator's count of the ranks sharing its host, over which an automatic
    /// `compute_threads` (0) divides the host's cores (`job::compute_threads_for`).
    pub ranks_on_host: u32,
    /// The leader's term when the job keeps its state in a metadata store: the worker then
    /// re-attaches to the next leader when this one is lost. 0: the job ends with its
    /// coordinator.
    pub term: u64,
}

/// Which transport ranks use between themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataPlane {
    /// TCP with mutual TLS against the cluster CA.
    Tcp,
    /// QUIC with mutual TLS against the cluster CA.
    Quic,
    /// UCX shared memory between the workers the coordinator confirmed to share a host and
    /// user; TCP with mutual TLS between the others (`procs::planes`).
    Ucx,
}

impl DataPlane {
    pub fn name(self) -> &'static str {
        match self {
            DataPlane::Tcp => "tcp",
            DataPlane::Quic => "quic",
            DataPlane::Ucx => "ucx",
        }
    }
}

/// A worker's UCX side, as it reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UcxBound {
    /// `ucp_worker_get_address`: only ever sent over this authenticated connection.
    pub address: Vec<u8>,
    /// The host and its namespaces (`planes::host_identity`).
    pub host: String,
    /// The worker's effective user id.
    pub uid: u32,
    /// UCX may also reach it over the network (`--ucx-net`).
    pub net: bool,
}

/// A peer's data-plane address as the coordinator sends it to one worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPeer {
    pub rank: RankId,
    /// The TCP or QUIC address.
    pub data_addr: String,
    /// Set when this pair uses UCX: the peer's worker address.
    pub ucx: Option<Vec<u8>>,
}

/// The rank-bound commands of `RankMsg`, without reply ports or local handles.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RankCommand {
    RunStep(Box<StepPlan>),
    Reshard {
        old: Box<ShardMap>,
        new: Box<ShardMap>,
        step: u64,
    },
    Restore {
        old: Box<ShardMap>,
        new: Box<ShardMap>,
        step: u64,
        lost: Vec<RankId>,
    },
    Replicate {
        step: u64,
    },
    /// An operator's kill (`POST /ranks/{id}/kill`): the worker ends its own process abruptly
    /// halfway through this step.
    KillAt(u64),
}

/// What a rank tells the coordinator: the rank-sent variants of `CoordMsg`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RankReport {
    StepDone(Box<StepReport>),
    RankFailed { rank: RankId, reason: String },
    ReshardDone { rank: RankId, epoch: u64 },
    StepAborted { rank: RankId, reason: String },
    ReplicateDone { rank: RankId, epoch: u64, step: u64 },
}

impl RankReport {
    /// The wire form of a message a rank actor sent its coordinator; `None` for messages only
    /// the runtime sends (start, ticks, operator requests).
    pub fn from_msg<T: Transport>(msg: CoordMsg<T>) -> Option<Self> {
        Some(match msg {
            CoordMsg::StepDone(r) => Self::StepDone(r),
            CoordMsg::RankFailed { rank, reason } => Self::RankFailed { rank, reason },
            CoordMsg::ReshardDone { rank, epoch } => Self::ReshardDone { rank, epoch },
            CoordMsg::StepAborted { rank, reason } => Self::StepAborted { rank, reason },
            CoordMsg::ReplicateDone { rank, epoch, step } => {
                Self::ReplicateDone { rank, epoch, step }
            }
            _ => return None,
        })
    }

    /// The message for the coordinator actor. `rank` is the sender the connection belongs to:
    /// a report naming another rank is rewritten to it, so one worker cannot speak for another.
    pub fn into_msg<T: Transport>(self, rank: RankId) -> CoordMsg<T> {
        match self {
            Self::StepDone(mut r) => {
                r.rank = rank;
                CoordMsg::StepDone(r)
            }
            Self::RankFailed { reason, .. } => CoordMsg::RankFailed { rank, reason },
            Self::ReshardDone { epoch, .. } => CoordMsg::ReshardDone { rank, epoch },
            Self::StepAborted { reason, .. } => CoordMsg::StepAborted { rank, reason },
            Self::ReplicateDone { epoch, step, .. } => {
                CoordMsg::ReplicateDone { rank, epoch, step }
            }
        }
    }
}

impl RankCommand {
    /// The wire form of a command for a rank; `None` for local-only messages.
    pub fn from_msg<T: Transport>(msg: RankMsg<T>) -> Option<Self> {
        Some(match msg {
            RankMsg::RunStep(p) => Self::RunStep(p),
            RankMsg::Reshard { old, new, step } => Self::Reshard { old, new, step },
            RankMsg::Restore {
                old,
                new,
                step,
                lost,
            } => Self::Restore {
                old,
                new,
                step,
                lost,
            },
            RankMsg::Replicate { step } => Self::Replicate { step },
            RankMsg::KillAt(step) => Self::KillAt(step),
            _ => return None,
        })
    }

    pub fn into_msg<T: Transport>(self) -> RankMsg<T> {
        match self {
            Self::RunStep(p) => RankMsg::RunStep(p),
            Self::Reshard { old, new, step } => RankMsg::Reshard { old, new, step },
            Self::Restore {
                old,
                new,
                step,
                lost,
            } => RankMsg::Restore {
                old,
                new,
                step,
                lost,
            },
            Self::Replicate { step } => RankMsg::Replicate { step },
            Self::KillAt(step) => RankMsg::KillAt(step),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_every_check_rejects() {
        let msg = ToWorker::Interrupt { epoch: 3, step: 9 };
        let frame = encode(&msg).unwrap();
        let back: ToWorker = decode(&frame, CONTROL_FRAME_MAX_BYTES).unwrap();
        assert!(matches!(back, ToWorker::Interrupt { epoch: 3, step: 9 }));

        let mut bad = frame.clone();
        bad[0] = 9;
        assert_eq!(
            decode::<ToWorker>(&bad, CONTROL_FRAME_MAX_BYTES).unwrap_err(),
            WireError::Version { got: 9 }
        );
        let mut bad = frame.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(
            decode::<ToWorker>(&bad, CONTROL_FRAME_MAX_BYTES).unwrap_err(),
            WireError::Checksum
        );
        assert!(matches!(
            decode::<ToWorker>(&frame, 1).unwrap_err(),
            WireError::TooLarge { max: 1, .. }
        ));
        assert!(matches!(
            decode::<ToWorker>(&frame[..frame.len() - 1], CONTROL_FRAME_MAX_BYTES),
            Err(WireError::Decode(_))
        ));
    }

    #[test]
    fn a_report_is_attributed_to_its_connection() {
        let r = RankReport::ReshardDone { rank: 7, epoch: 2 };
        let CoordMsg::<crate::runtime::transport::local::LocalEndpoint>::ReshardDone {
            rank,
            epoch,
        } = r.into_msg(1)
        else {
            panic!("wrong variant");
        };
        assert_eq!((rank, epoch), (1, 2));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(0u8..=255, 0..64)) {
            let _ = decode::<ToCoord>(&bytes, HELLO_FRAME_MAX_BYTES);
        }
    }
}
