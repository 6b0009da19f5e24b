//! A worker's control connection as the coordinator process holds it: the split TLS stream,
//! the bounded queue in front of its writer, and the registries of live links and tasks that the
//! coordinator, its connection tasks, standbys and joins share.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncWrite, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::control_plane::{write_msg, ToWorker};
use crate::plan::RankId;

/// Messages queued per connection before the peer counts as not draining.
pub const LINK_QUEUE_MAX: usize = 1024;
/// A worker's control connection, after the TLS handshake.
pub(super) type ControlStream = tokio_rustls::server::TlsStream<TcpStream>;
pub(super) type ControlReader = ReadHalf<ControlStream>;
pub(super) type ControlWriter = WriteHalf<ControlStream>;

/// Sending ends of every live worker's connection, shared with the coordinator's callbacks.
pub(super) type Links = Arc<Mutex<BTreeMap<RankId, mpsc::Sender<Option<ToWorker>>>>>;
/// Tasks to stop (or, for writers, to let finish) when the job ends; joiners add theirs.
pub(super) type Tasks = Arc<Mutex<Vec<JoinHandle<()>>>>;

/// Writes queued messages until told to stop (`None`) or the connection fails.
pub(super) async fn write_loop<M: serde::Serialize>(
    mut w: impl AsyncWrite + Unpin,
    mut rx: mpsc::Receiver<Option<M>>,
) {
    while let Some(Some(msg)) = rx.recv().await {
        if let Err(e) = write_msg(&mut w, &msg).await {
            tracing::debug!("control connection write failed: {e}");
            return;
        }
    }
}
