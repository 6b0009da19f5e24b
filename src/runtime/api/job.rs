//! The elastic job of an embedding program: a builder that starts a cluster in-process with
//! its control handle (`control.rs`), an event stream and, optionally, the HTTP endpoint
//! (`http.rs`).
//!
//! A task (the pump) owns the cluster: it reads the coordinator's events, feeds the handle's
//! `Monitor` (the counters behind `status()` and `/metrics`), forwards every event to the job's
//! stream, and at the end consolidates the parameters and shuts the actors down.

use std::net::SocketAddr;
use std::time::Duration;

use ractor::rpc::CallResult;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;

use super::cluster::{Cluster, ClusterError, ClusterSpec, Observer, TrainOutcome};
use super::control::{layout_of, ControlHandle, Monitor, CONTROL_DEADLINE_MS};
use super::http::{self, Access, AuthScope, HttpLimits};
use super::status::{ChangeRecord, StateLayout};
use crate::config::TrainConfig;
use crate::runtime::actors::{ClusterEvent, CoordMsg};

/// What a builder starts from.
enum Source {
    Spec(Box<ClusterSpec>),
    /// Already started (its saved state read), with the layout of its config and the tokens
    /// a step trains on.
    Started(Box<Cluster>, (StateLayout, u64)),
}

/// Starts a cluster in-process with the control API. See `Cluster::builder`.
pub struct ClusterBuilder {
    source: Source,
    control_addr: Option<SocketAddr>,
    http_limits: HttpLimits,
    access: Option<Access>,
    allow_kill: bool,
    snapshots: bool,
    paused: bool,
}

impl Cluster {
    /// A builder for a job with a control handle, an event stream and, optionally, an HTTP
    /// control endpoint.
    ///
    /// ```no_run
    /// # async fn demo() -> anyhow::Result<()> {
    /// use elastic_zero::config::TrainConfig;
    /// use elastic_zero::runtime::{Cluster, ClusterSpec};
    /// let spec = ClusterSpec::from_config(TrainConfig { ranks: 4, ..TrainConfig::default() })?;
    /// let job = Cluster::builder(spec).start().await?;
    /// job.handle().drain(2).await?; // a spot notice for rank 2
    /// let outcome = job.finish().await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(spec: ClusterSpec) -> ClusterBuilder {
        ClusterBuilder::with_source(Source::Spec(Box::new(spec)))
    }
}

impl ClusterBuilder {
    /// A builder over a cluster already started from `config` (e.g. once its saved state was
    /// read and checked); `start` then starts its run.
    pub fn for_started(cluster: Cluster, config: &TrainConfig) -> ClusterBuilder {
        let layout = (layout_of(config), config.tokens_per_step() as u64);
        ClusterBuilder::with_source(Source::Started(Box::new(cluster), layout))
    }

    fn with_source(source: Source) -> ClusterBuilder {
        ClusterBuilder {
            source,
            control_addr: None,
            http_limits: HttpLimits::default(),
            access: None,
            allow_kill: false,
            snapshots: false,
            paused: false,
        }
    }

    /// Serve the HTTP control endpoint on this address (port 0 picks a free one; see
    /// `ElasticJob::control_addr`).
    pub fn control_addr(mut self, addr: SocketAddr) -> Self {
        self.control_addr = Some(addr);
        self
    }

    /// Who may change the job through the endpoint [default: anyone on loopback; beyond
    /// loopback, no one: `Access::new(addr, None, AuthScope::Writes)`].
    pub fn control_access(mut self, access: Access) -> Self {
        self.access = Some(access);
        self
    }

    pub fn http_limits(mut self, limits: HttpLimits) -> Self {
        self.http_limits = limits;
        self
    }

    /// Let `kill` (and `POST /ranks/{id}/kill`) inject abrupt rank losses. Off by default.
    pub fn allow_kill(mut self, allow: bool) -> Self {
        self.allow_kill = allow;
        self
    }

    /// Say that the event stream's consumer keeps snapshots, so `request_snapshot` (and
    /// `POST /checkpoint`) are accepted. Off by default.
    pub fn on_demand_snapshots(mut self, keep: bool) -> Self {
        self.snapshots = keep;
        self
    }

    /// Start the actors and the endpoint but not training: requests made before
    /// `ElasticJob::run` apply at step 0. Off by default.
    pub fn paused(mut self, paused: bool) -> Self {
        self.paused = paused;
        self
    }

    /// Starts the actors, the pump and the endpoint, and (unless paused) the first step.
    pub async fn start(self) -> Result<ElasticJob, ClusterError> {
        let (cluster, layout) = match self.source {
            Source::Spec(spec) => {
                let layout = (
                    layout_of(&spec.config),
                    spec.config.tokens_per_step() as u64,
                );
                (Cluster::start(*spec).await?, layout)
            }
            Source::Started(cluster, layout) => (*cluster, layout),
        };
        let (handle, monitor) = ControlHandle::in_process(
            cluster.coordinator().clone(),
            cluster.shard_map().clone(),
            layout,
            self.allow_kill,
            self.snapshots,
        );
        let server = match self.control_addr {
            Some(addr) => {
                let access = self
                    .access
                    .clone()
                    .unwrap_or_else(|| Access::new(addr, None, AuthScope::Writes));
                let served = http::serve(addr, handle.clone(), self.http_limits, access).await;
                match served {
                    Ok(s) => Some(s),
                    Err(e) => {
                        cluster.shutdown().await;
                        return Err(ClusterError::Spawn(format!(
                            "cannot serve the control endpoint on {addr}: {e}"
                        )));
                    }
                }
            }
            None => None,
        };
        let (tx, events) = unbounded_channel();
        let (done_tx, outcome) = oneshot::channel();
        let (go, go_rx) = oneshot::channel();
        // Subscribed before the run starts, so `drive` prices every change, even one that
        // completes before it is called.
        let changes = handle.subscribe();
        let pump = tokio::spawn(pump(cluster, monitor, tx, done_tx, go_rx));
        let mut job = ElasticJob {
            handle,
            events,
            outcome,
            control_addr: server.as_ref().map(|s| s.0),
            server: server.map(|s| s.1),
            pump,
            go: Some(go),
            changes: Some(changes),
        };
        if !self.paused {
            job.run();
        }
        Ok(job)
    }
}

/// A job started by `ClusterBuilder::start`, training until it finishes or fails.
pub struct ElasticJob {
    handle: ControlHandle,
    events: UnboundedReceiver<ClusterEvent>,
    outcome: oneshot::Receiver<Result<TrainOutcome, ClusterError>>,
    control_addr: Option<SocketAddr>,
    server: Option<JoinHandle<()>>,
    pump: JoinHandle<()>,
    /// Starts training (see `ClusterBuilder::paused`); `None` once sent.
    go: Option<oneshot::Sender<()>>,
    /// Changes since the start, for `drive`.
    changes: Option<broadcast::Receiver<ChangeRecord>>,
}

impl ElasticJob {
    /// Starts training if the job was built paused; does nothing otherwise.
    pub fn run(&mut self) {
        if let Some(go) = self.go.take() {
            // The pump only goes away after the run, so it is listening.
            let _ = go.send(());
        }
    }

    pub fn handle(&self) -> ControlHandle {
        self.handle.clone()
    }

    /// The address the HTTP endpoint listens on, if it was asked for.
    pub fn control_addr(&self) -> Option<SocketAddr> {
        self.control_addr
    }

    /// The next event; `None` after `Finished` or `Aborted` has been delivered. A paused job
    /// sends none until `run`.
    pub async fn next_event(&mut self) -> Option<ClusterEvent> {
        self.events.recv().await
    }

    /// Waits for the end of the run (events not read are dropped) and returns every step's
    /// record and the consolidated parameters.
    pub async fn finish(mut self) -> Result<TrainOutcome, ClusterError> {
        self.run();
        let outcome = (&mut self.outcome)
            .await
            .unwrap_or_else(|_| Err(ClusterError::Aborted("the cluster task stopped".into())));
        self.stop_server();
        let _ = (&mut self.pump).await;
        outcome
    }

    /// Feeds every event to `observer` until the run ends, then returns as `finish` does.
    /// Membership changes arrive with their cost (`Observer::on_change`); the first snapshot
    /// after `request_snapshot` arrives as `Observer::on_requested_snapshot`.
    pub async fn drive(
        mut self,
        mut observer: impl Observer,
    ) -> Result<TrainOutcome, ClusterError> {
        let mut changes = match self.changes.take() {
            Some(c) => c,
            None => self.handle.subscribe(),
        };
        self.run();
        while let Some(event) = self.next_event().await {
            match event {
                ClusterEvent::Step(rec) => observer.on_step(&rec),
                ClusterEvent::Snapshot(snap) => {
                    if self.handle.requested_snapshot() {
                        observer.on_requested_snapshot(*snap)
                    } else {
                        observer.on_snapshot(*snap)
                    }
                }
                ClusterEvent::Membership(rec) => {
                    // The pump publishes each change before it forwards the event.
                    let mut costed = None;
                    while let Ok(c) = changes.try_recv() {
                        if c.record == *rec {
                            costed = Some(c);
                            break;
                        }
                    }
                    match costed {
                        Some(c) => observer.on_change(&c),
                        None => observer.on_membership(&rec),
                    }
                }
                ClusterEvent::SnapshotStreamed { step, saved } => {
                    self.handle.requested_snapshot();
                    observer.on_snapshot_streamed(step, &saved)
                }
                ClusterEvent::JoinFailed { rank, reason } => observer.on_join_failed(rank, &reason),
                ClusterEvent::Finished | ClusterEvent::Aborted(_) | ClusterEvent::Deposed(_) => {
                    break
                }
            }
        }
        self.finish().await
    }

    fn stop_server(&mut self) {
        if let Some(s) = self.server.take() {
            s.abort();
        }
    }
}

impl Drop for ElasticJob {
    fn drop(&mut self) {
        self.stop_server();
    }
}

/// Owns the cluster: keeps the counters, forwards events, and finishes the run.
async fn pump(
    mut cluster: Cluster,
    mut monitor: Monitor,
    tx: UnboundedSender<ClusterEvent>,
    done: oneshot::Sender<Result<TrainOutcome, ClusterError>>,
    go: oneshot::Receiver<()>,
) {
    if go.await.is_err() {
        // The job was dropped before it ran.
        cluster.shutdown().await;
        return;
    }
    cluster.run();
    let mut records = Vec::new();
    let end = loop {
        let Some(event) = cluster.next_event().await else {
            break Err(ClusterError::Aborted("the coordinator stopped".into()));
        };
        monitor.observe(&event);
        let end = match &event {
            ClusterEvent::Step(rec) => {
                records.push((**rec).clone());
                None
            }
            ClusterEvent::Membership(_)
            | ClusterEvent::Snapshot(_)
            | ClusterEvent::SnapshotStreamed { .. }
            | ClusterEvent::JoinFailed { .. } => None,
            ClusterEvent::Finished => Some(Ok(())),
            ClusterEvent::Aborted(reason) | ClusterEvent::Deposed(reason) => {
                Some(Err(ClusterError::Aborted(reason.clone())))
            }
        };
        if let Some(end) = end {
            // Keep the coordinator's last word for `status()` before the actors go.
            let view = cluster
                .coordinator()
                .call(
                    CoordMsg::View,
                    Some(Duration::from_millis(CONTROL_DEADLINE_MS)),
                )
                .await;
            let view = match view {
                Ok(CallResult::Success(v)) => Some(v),
                _ => None,
            };
            monitor.ended(view, end.as_ref().map(|_| ()).map_err(|e| e.to_string()));
            let _ = tx.send(event);
            break end;
        }
        // The job may have stopped reading its events; that is its choice.
        let _ = tx.send(event);
    };
    let outcome = match end {
        Ok(()) => cluster.outcome(records).await,
        Err(e) => Err(e),
    };
    cluster.shutdown().await;
    let _ = done.send(outcome);
}
