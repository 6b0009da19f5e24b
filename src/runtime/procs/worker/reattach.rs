//! A worker outliving its coordinator. When the job keeps its state in a metadata store (the
//! welcome carries a leader term), a worker whose coordinator is lost (its connection closed,
//! or silent past the heartbeat timeout) keeps its rank, its state, its backups and its data
//! plane: it interrupts the work in flight, finds the next leader among the coordinator
//! addresses it was given, and re-attaches, saying what it was still busy in. The new leader
//! rolls every rank back to the committed backup and goes on (`engine::coordinator::durable`).
//!
//! Everything the worker tells its coordinator goes through the `Relay`, so the rank actor's
//! reports reach whichever connection is current, and the relay knows whether the rank is busy:
//! a command starts work, a report ends it. The hello of a re-attach is queued under the same
//! lock as that bookkeeping, so the busy work it names and the reports after it agree.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{connect, handshake, write_loop, ControlReader, WorkerOptions};
use crate::plan::RankId;
use crate::runtime::procs::control_plane::{
    read_msg, RankCommand, ToCoord, ToWorker, UcxBound, HELLO_FRAME_MAX_BYTES,
};
use crate::runtime::procs::error::ProcError;
use crate::runtime::procs::link::LINK_QUEUE_MAX;
use crate::runtime::procs::proxy::lock;

/// The queue every message to the coordinator takes, and the connection it currently goes to.
#[derive(Clone)]
pub(super) struct Relay {
    state: Arc<Mutex<RelayState>>,
}

struct RelayState {
    /// The current connection's writer queue (`None` while no coordinator is attached).
    target: Option<mpsc::Sender<Option<ToCoord>>>,
    /// The (epoch, step) of the work the rank was told to do and has not answered yet.
    busy: Option<(u64, u64)>,
    /// The epoch of the map the rank holds or is moving to (a backup runs under it).
    epoch: u64,
}

impl Relay {
    /// A relay to `first`, and the sender the worker's parts use; a task forwards.
    pub(super) fn start(
        first: mpsc::Sender<Option<ToCoord>>,
        epoch: u64,
    ) -> (mpsc::Sender<Option<ToCoord>>, Relay) {
        let relay = Relay {
            state: Arc::new(Mutex::new(RelayState {
                target: Some(first),
                busy: None,
                epoch,
            })),
        };
        let (tx, mut rx) = mpsc::channel::<Option<ToCoord>>(LINK_QUEUE_MAX);
        let forward = relay.clone();
        tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                let target = forward.passing(msg.as_ref());
                if let Some(t) = target {
                    // A closed connection drops the message: the next leader asks afresh.
                    let _ = t.send(msg).await;
                }
            }
        });
        (tx, relay)
    }

    /// Notes what `msg` says of the rank's work; the connection it goes to.
    fn passing(&self, msg: Option<&ToCoord>) -> Option<mpsc::Sender<Option<ToCoord>>> {
        let mut st = lock(&self.state);
        if let Some(ToCoord::Report(_)) = msg {
            st.busy = None;
        }
        st.target.clone()
    }

    /// The rank was told to do `cmd`.
    pub(super) fn began(&self, cmd: &RankCommand) {
        let mut st = lock(&self.state);
        let round = match cmd {
            RankCommand::RunStep(plan) => Some((plan.epoch, plan.step)),
            RankCommand::Reshard { new, step, .. } | RankCommand::Restore { new, step, .. } => {
                Some((new.epoch, *step))
            }
            RankCommand::Replicate { step } => Some((st.epoch, *step)),
            RankCommand::KillAt(_) => None,
        };
        if let Some((epoch, step)) = round {
            st.epoch = epoch;
            st.busy = Some((epoch, step));
        }
    }

    /// Resolves once the current connection's writer has stopped (after a `None`).
    pub(super) async fn flushed(&self) {
        let target = lock(&self.state).target.clone();
        if let Some(t) = target {
            t.closed().await;
        }
    }

    /// No coordinator: messages are dropped until the next attach. What the rank is busy in.
    fn detach(&self) -> Option<(u64, u64)> {
        let mut st = lock(&self.state);
        st.target = None;
        st.busy
    }

    /// Queues the hello `hello(busy)` first on `tx` and sends everything after it there.
    fn attach(
        &self,
        tx: mpsc::Sender<Option<ToCoord>>,
        hello: impl FnOnce(Option<(u64, u64)>) -> ToCoord,
    ) {
        let mut st = lock(&self.state);
        let _ = tx.try_send(Some(hello(st.busy)));
        st.target = Some(tx);
    }
}

/// What a worker needs to re-attach.
pub(super) struct Reattach {
    pub(super) rank: RankId,
    pub(super) coordinators: Vec<String>,
    /// How long to look for a new leader before giving up (`--leader-wait-ms`).
    pub(super) leader_wait: Duration,
    pub(super) heartbeat_timeout_ms: u64,
    pub(super) term_seen: u64,
    pub(super) data_addr: String,
    pub(super) ucx: Option<UcxBound>,
    /// The index in `coordinators` of the leader this worker re-attached to last: the next
    /// search starts after it (that one was just lost).
    pub(super) at: Option<usize>,
}

/// Why one coordinator did not take the re-attach.
enum Attempt {
    /// Not reachable, not the leader, or not yet: try the next.
    Retry(String),
    /// The leader refused this worker (it was declared failed): it must not go on.
    Refused(String),
}

impl Reattach {
    /// Interrupts the rank's work, then tries the coordinators in turn until one leads and
    /// takes this worker back, within `leader_wait`. Returns the new connection's reader.
    pub(super) async fn run(
        &mut self,
        relay: &Relay,
        interrupt: &(dyn Fn(u64, u64) + Send + Sync),
        opts: &WorkerOptions,
        why: &str,
    ) -> Result<ControlReader, ProcError> {
        let rank = self.rank;
        if let Some((epoch, step)) = relay.detach() {
            interrupt(epoch, step);
        }
        println!(
            "ezero worker: rank {rank}: lost the coordinator ({why}); looking for the next leader"
        );
        let deadline = Instant::now() + self.leader_wait;
        let mut last = String::new();
        let list = self.coordinators.clone();
        let start = self.at.map_or(0, |a| a + 1);
        for i in (0..list.len()).cycle().skip(start) {
            let addr = &list[i];
            if Instant::now() >= deadline {
                break;
            }
            match self.attempt(addr, relay, opts).await {
                Ok((reader, term)) => {
                    println!("ezero worker: rank {rank}: re-attached to the leader at {addr} (term {term})");
                    self.at = Some(i);
                    return Ok(reader);
                }
                Err(Attempt::Refused(r)) => {
                    return Err(ProcError::Aborted(format!(
                        "rank {rank}: the new leader at {addr} refused it: {r}"
                    )))
                }
                Err(Attempt::Retry(r)) => last = format!("{addr}: {r}"),
            }
            relay.detach();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(ProcError::Aborted(format!(
            "rank {rank}: no coordinator took the job over within leader_wait_ms ({} ms) after \
             the last one was lost ({why}); tried {}; last answer: {last}. Check the \
             coordinators and their metadata store",
            self.leader_wait.as_millis(),
            self.coordinators.join(", ")
        )))
    }

    async fn attempt(
        &mut self,
        addr: &str,
        relay: &Relay,
        opts: &WorkerOptions,
    ) -> Result<(ControlReader, u64), Attempt> {
        // A coordinator frozen (or cut off) accepts connections in its kernel but never
        // answers: each try is bounded by a heartbeat timeout, so that the worker moves on to
        // the one that leads well within the new leader's re-attach wait.
        let wait = Duration::from_millis(self.heartbeat_timeout_ms.max(1_000));
        let dial = async {
            let stream = connect(addr, 1_000).await?;
            let _ = stream.set_nodelay(true);
            handshake(stream, opts, addr).await
        };
        let stream = tokio::time::timeout(wait, dial)
            .await
            .map_err(|_| {
                Attempt::Retry(format!("no TLS handshake within {} ms", wait.as_millis()))
            })?
            .map_err(|e| Attempt::Retry(e.to_string()))?;
        let (mut reader, writer) = tokio::io::split(stream);
        let (tx, rx) = mpsc::channel(LINK_QUEUE_MAX);
        tokio::spawn(write_loop(writer, rx));
        let (rank, term_seen) = (self.rank, self.term_seen);
        let (data_addr, ucx, token) =
            (self.data_addr.clone(), self.ucx.clone(), opts.token.clone());
        relay.attach(tx, move |busy| ToCoord::Reattach {
            token,
            rank,
            term_seen,
            busy,
            data_addr,
            ucx,
        });
        let reply = tokio::time::timeout(
            wait,
            read_msg::<_, ToWorker>(&mut reader, HELLO_FRAME_MAX_BYTES),
        )
        .await
        .map_err(|_| Attempt::Retry("no answer".into()))?
        .map_err(|e| Attempt::Retry(e.to_string()))?;
        let term = answer(&mut self.term_seen, reply)?;
        Ok((reader, term))
    }
}

/// A coordinator's answer to a re-attach: only a leader of a newer term than any this worker
/// has obeyed takes it (a deposed leader, or one replaying an old term, is passed over), and
/// then that term is the one it has seen.
fn answer(term_seen: &mut u64, reply: ToWorker) -> Result<u64, Attempt> {
    match reply {
        ToWorker::Attached { term } if term > *term_seen => {
            *term_seen = term;
            Ok(term)
        }
        ToWorker::Attached { term } => Err(Attempt::Retry(format!(
            "a coordinator of term {term}, not newer than {term_seen}"
        ))),
        ToWorker::NotLeader { leader } => Err(Attempt::Retry(match leader {
            Some(l) => format!("not the leader (the leader takes workers at {l})"),
            None => "not the leader, and no leader yet".into(),
        })),
        ToWorker::Refused { reason } | ToWorker::Stop { reason, .. } => {
            Err(Attempt::Refused(reason))
        }
        other => Err(Attempt::Retry(format!("answered with {}", other.kind()))),
    }
}

/// The coordinator addresses of `--join` (comma-separated).
pub(super) fn coordinator_list(join: &str) -> Vec<String> {
    join.split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(String::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attached(term: u64) -> ToWorker {
        ToWorker::Attached { term }
    }

    #[test]
    fn only_a_newer_term_is_obeyed() {
        let mut seen = 7;
        // The deposed leader (or a replay of its welcome) is passed over, and changes nothing.
        for stale in [3, 7] {
            let refused = answer(&mut seen, attached(stale));
            assert!(
                matches!(refused, Err(Attempt::Retry(ref r)) if r.contains("not newer than 7"))
            );
            assert_eq!(seen, 7);
        }
        assert!(matches!(answer(&mut seen, attached(9)), Ok(9)));
        assert_eq!(seen, 9);
        // Once term 9 is obeyed, term 8 is old too.
        assert!(answer(&mut seen, attached(8)).is_err());
        assert_eq!(seen, 9);
    }

    #[test]
    fn a_standby_is_passed_over_and_a_refusal_ends_the_worker() {
        let mut seen = 1;
        let standby = ToWorker::NotLeader { leader: None };
        assert!(matches!(answer(&mut seen, standby), Err(Attempt::Retry(_))));
        let refused = ToWorker::Refused {
            reason: "rank 2 was declared failed".into(),
        };
        assert!(matches!(
            answer(&mut seen, refused),
            Err(Attempt::Refused(_))
        ));
        assert_eq!(seen, 1);
    }

    #[test]
    fn join_lists_are_split_on_commas() {
        assert_eq!(
            coordinator_list(" a:1, b:2,,c:3 "),
            vec!["a:1".to_string(), "b:2".into(), "c:3".into()]
        );
    }
}
