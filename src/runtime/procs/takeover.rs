//! A new leader taking over a running job: it waits (at most `reattach_wait`) for the workers
//! of the committed map to re-attach, each saying what it was busy in and where its peers reach
//! it; the engine then rolls them back to the committed backup (`Coordinator::take_over`).
//! A worker whose rank the committed map does not hold (a joiner of a change the lost leader
//! never committed) is told to stop: it holds nothing the job needs. Standby workers that say
//! hello meanwhile go to the lobby as usual.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;

use super::admit::{Door, Greeted};
use super::control_plane::{write_msg, ToCoord, ToWorker, UcxBound};
use super::link::{ControlReader, ControlWriter};
use super::standby::Lobby;
use crate::plan::RankId;

/// How long a refusal may take to leave.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(2);

/// A worker that re-attached to this leader.
pub(super) struct Rejoined {
    pub(super) rank: RankId,
    pub(super) peer: SocketAddr,
    pub(super) busy: Option<(u64, u64)>,
    pub(super) data_addr: String,
    pub(super) ucx: Option<UcxBound>,
    pub(super) reader: ControlReader,
    pub(super) writer: ControlWriter,
}

/// What the leader taking over expects of a re-attaching worker.
pub(super) struct Expect<'a> {
    pub(super) token: &'a str,
    pub(super) term: u64,
    pub(super) members: &'a [RankId],
    pub(super) wait: Duration,
    /// How often the re-attached hear from this leader while it waits for the others: the
    /// wait may be longer than their heartbeat timeout.
    pub(super) heartbeat: Duration,
}

/// Accepts re-attaches until every member is back or the wait is over; the handshakes still
/// running stay in `door` for the standby lobby.
pub(super) async fn gather(door: &mut Door, expect: &Expect<'_>, lobby: &Lobby) -> Vec<Rejoined> {
    let deadline = Instant::now() + expect.wait;
    let mut back: BTreeMap<RankId, Rejoined> = BTreeMap::new();
    let mut beat = tokio::time::interval(expect.heartbeat);
    while back.len() < expect.members.len() {
        tokio::select! {
            _ = beat.tick() => heartbeat(&mut back, expect.heartbeat).await,
            g = door.next_greeted() => {
                let peer = g.peer;
                match check_back(g, expect, &back).await {
                    Ok(Back::Rank(r)) => {
                        tracing::info!("rank {} re-attached from {peer}", r.rank);
                        back.insert(r.rank, *r);
                    }
                    Ok(Back::Standby(reader, writer)) => lobby.hold(peer, reader, writer),
                    Err(why) => tracing::warn!("refused a connection from {peer}: {why}"),
                }
            }
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    back.into_values().collect()
}

/// One heartbeat to each re-attached worker; one that cannot take it within `within` is dropped
/// (its connection is broken: it will try again, or be counted lost).
async fn heartbeat(back: &mut BTreeMap<RankId, Rejoined>, within: Duration) {
    let mut broken = Vec::new();
    for (rank, r) in back.iter_mut() {
        let sent = tokio::time::timeout(within, write_msg(&mut r.writer, &ToWorker::Heartbeat));
        if !matches!(sent.await, Ok(Ok(()))) {
            broken.push(*rank);
        }
    }
    for rank in broken {
        tracing::warn!("rank {rank} re-attached but its connection broke");
        back.remove(&rank);
    }
}

enum Back {
    Rank(Box<Rejoined>),
    Standby(ControlReader, ControlWriter),
}

/// Admits a re-attach (answering `Attached`) or a standby's hello, or tells the worker why
/// not.
async fn check_back(
    g: Greeted,
    expect: &Expect<'_>,
    back: &BTreeMap<RankId, Rejoined>,
) -> Result<Back, String> {
    let Greeted {
        peer,
        msg,
        reader,
        mut writer,
    } = g;
    let answer = match msg {
        ToCoord::Reattach {
            token,
            rank,
            term_seen,
            busy,
            data_addr,
            ucx,
        } => match reattach_refusal(expect, back, &token, rank, term_seen, &data_addr) {
            None => {
                let attached = ToWorker::Attached { term: expect.term };
                write_msg(&mut writer, &attached)
                    .await
                    .map_err(|e| format!("rank {rank}: {e}"))?;
                return Ok(Back::Rank(Box::new(Rejoined {
                    rank,
                    peer,
                    busy,
                    data_addr,
                    ucx,
                    reader,
                    writer,
                })));
            }
            Some(answer) => answer,
        },
        ToCoord::Hello { token, .. } if token == expect.token => {
            return Ok(Back::Standby(reader, writer));
        }
        _ => ToWorker::Refused {
            reason: "wrong cluster token, or the first message was not a hello".into(),
        },
    };
    let why = match &answer {
        ToWorker::Refused { reason } | ToWorker::Stop { reason, .. } => reason.clone(),
        other => other.kind().to_string(),
    };
    let _ = tokio::time::timeout(REFUSAL_TIMEOUT, write_msg(&mut writer, &answer)).await;
    Err(why)
}

/// Why a re-attach is refused (the message that says so), or `None` to take it.
fn reattach_refusal(
    expect: &Expect<'_>,
    back: &BTreeMap<RankId, Rejoined>,
    token: &str,
    rank: RankId,
    term_seen: u64,
    data_addr: &str,
) -> Option<ToWorker> {
    let refuse = |reason: String| Some(ToWorker::Refused { reason });
    if token != expect.token {
        return refuse("wrong cluster token".into());
    }
    if term_seen >= expect.term {
        return refuse(format!(
            "this leader's term {} is not newer than the term {term_seen} the worker followed",
            expect.term
        ));
    }
    if !expect.members.contains(&rank) {
        return Some(ToWorker::Stop {
            ok: false,
            reason: format!(
                "rank {rank} is not a member of the job's committed map (it joined in a change \
                 the lost coordinator did not commit) and holds nothing the job needs"
            ),
        });
    }
    if back.contains_key(&rank) {
        return refuse(format!("rank {rank} re-attached already"));
    }
    if data_addr.parse::<SocketAddr>().is_err() {
        return refuse(format!("data address `{data_addr}` is invalid"));
    }
    None
}
