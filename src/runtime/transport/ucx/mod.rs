//! UCX (UCP) between processes on one host: shared memory (`sysv`, `posix`, `cma`) behind our
//! own thin binding, built with the `ucx` cargo feature.
//!
//! - [`sys`]: bindgen output from the 1.13 headers, checked in; `libucp.so.0` is opened at run
//!   time, so a build with the feature runs on a machine without libucx and says what to
//!   install only when UCX is asked for ([`library`]).
//! - [`engine`]: one UCP context and worker per process, owned by one OS thread that
//!   progresses, arms the worker and sleeps on its event fd; other threads submit through a
//!   bounded channel and wake it with `ucp_worker_signal`. Messages are active messages whose
//!   payload the receiver places into a buffer it allocates (rendezvous above the eager size).
//!   The thread's UCP calls and callbacks are in `thread`; large receive buffers are reused
//!   (`pool`); received bytes are bounded by a receive credit (`credit`). A consumer that
//!   knows which message comes next lends the buffer it belongs in (`lent`), and the payload
//!   lands there with no copy after the transfer.
//! - Staging (`shm`, `ring`, `thread::staged`): a payload for peers on this host is written
//!   once into a slot of the sender's shared segment (encoded and checksummed there), and the
//!   receiver's engine copies it out (into the loan it matches, checksumming it in cache) and
//!   frees the slot; UCX carries only small notices. Peers that cannot map the segment (on
//!   another host, over `--ucx-net`) and payloads outside a slot's size use UCX's rendezvous.
//!
//! - [`transport`]: `Transport` over the engine, every frame checked as on the TCP and QUIC
//!   planes (version, lengths, CRC-32, and a `from` that matches the sending engine), with the
//!   `SharedMemory` capability (staged and summed sends, loans, pulls; its rules are in
//!   `transport::shared_memory`).
//! - [`mixed`]: UCX to the peers on this host and TLS TCP to the others, into one inbox: what
//!   a worker under `--transport ucx` runs (the coordinator picks the plane per pair,
//!   `procs::planes`, and worker addresses travel over the mutual-TLS control plane). It
//!   offers the capability for the peers it reaches over UCX.
//!
//! Peer death is reported by UCX's keepalive (set to 1 s; about 1 s after a kill -9 in the
//! test) as `Inbound::PeerLost`; the control plane's heartbeats decide membership.
//! `EngineConfig::with_network` adds TCP and RDMA transports on devices the operator declares
//! trusted (`--ucx-net`): unencrypted.
//!
//! Design: docs/transports.md (UCX).

mod address;
mod config;
mod credit;
pub mod engine;
mod lending;
mod lent;
pub mod mixed;
mod pool;
mod ring;
mod shm;
pub mod sys;
mod thread;
pub mod transport;

use std::sync::OnceLock;

/// The shared library that holds UCP.
pub const LIBRARY: &str = "libucp.so.0";
/// Names another libucp to load instead (a UCX built elsewhere, e.g. with RDMA support).
pub const LIBRARY_ENV: &str = "EZERO_UCX_LIBRARY";

/// UCX settings that only the environment reaches, set by [`library`] before it loads libucp.
/// No UCX signal handlers over Rust's; CMA kept under peer-failure handling (UCX.md §4); and
/// no mmap/munmap hooks patched into the process (`MEM_EVENTS`: they serve registration caches,
/// which shared memory through `sysv`/`posix`/`cma` does not use).
pub const PROCESS_SETTINGS: [(&str, &str); 3] = [
    ("UCX_ERROR_SIGNALS", ""),
    ("UCX_CMA_MEMORY_INVALIDATE", "y"),
    ("UCX_MEM_EVENTS", "n"),
];

/// Why UCX cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UcxError {
    /// libucp could not be opened or lacks a function we call.
    #[error(
        "UCX is not installed: {0} (install libucx0, e.g. `apt install libucx0`, or use another transport)"
    )]
    Missing(String),
    /// A UCP call failed.
    #[error("UCX {call} failed: {status}")]
    Call { call: &'static str, status: String },
    /// The engine's thread has stopped.
    #[error("the UCX engine has stopped")]
    Stopped,
    /// A message larger than the engine accepts.
    #[error("a message of {len} bytes is over the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    /// No endpoint to that peer.
    #[error("no UCX endpoint to peer {0}")]
    NoPeer(u32),
}

/// Sets [`PROCESS_SETTINGS`] in the environment (libucs reads them when it loads, so they
/// cannot go through `ucp_config_modify`), once. Setting variables races with other threads
/// reading the environment: a program calls this first thing, before it starts threads
/// (`ezero` does); [`library`] calls it too, for programs that did not.
pub fn prepare_environment() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        for (key, value) in PROCESS_SETTINGS {
            std::env::set_var(key, value);
        }
    });
}

/// libucp's functions, loaded once per process.
pub fn library() -> Result<&'static sys::Ucp, UcxError> {
    static LIB: OnceLock<Result<sys::Ucp, UcxError>> = OnceLock::new();
    LIB.get_or_init(|| {
        prepare_environment();
        let name = std::env::var(LIBRARY_ENV).unwrap_or_else(|_| LIBRARY.to_string());
        load(&name)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Opens `name` and resolves every UCP function we call.
fn load(name: &str) -> Result<sys::Ucp, UcxError> {
    // SAFETY: loading libucp runs its initialisers, which only set up UCX's own state.
    unsafe { sys::Ucp::new(name) }.map_err(|e| UcxError::Missing(e.to_string()))
}

/// For tests: libucx, or a panic saying what to install. The tests that call it are
/// `#[ignore = "needs libucx0 ..."]`, so plain `cargo test` lists them as ignored and
/// `cargo test -- --include-ignored` (what `.ci/run` runs) must find the library.
#[cfg(test)]
pub(crate) fn require_for_tests() {
    if let Err(e) = library() {
        panic!("this test needs libucx0 (apt-get install libucx0): {e}");
    }
}

/// For tests: `n` shared-memory engines in this process (ids `0..n`) and a `UcxTransport` on
/// each, connected to all of them.
#[cfg(test)]
pub(crate) fn transports_for_tests(
    n: u32,
) -> (
    Vec<std::sync::Arc<engine::Engine>>,
    Vec<transport::UcxTransport>,
) {
    transports_for_tests_with(n, engine::EngineConfig::shared_memory)
}

/// [`transports_for_tests`] with engine `r`'s config `cfg(r)`.
#[cfg(test)]
pub(crate) fn transports_for_tests_with(
    n: u32,
    cfg: impl Fn(u32) -> engine::EngineConfig,
) -> (
    Vec<std::sync::Arc<engine::Engine>>,
    Vec<transport::UcxTransport>,
) {
    use std::sync::Arc;
    require_for_tests();
    let engines: Vec<Arc<engine::Engine>> = (0..n)
        .map(|r| Arc::new(engine::Engine::start(cfg(r)).unwrap()))
        .collect();
    let peers: std::collections::BTreeMap<crate::plan::RankId, Vec<u8>> = engines
        .iter()
        .map(|e| (e.id(), e.address().to_vec()))
        .collect();
    let eps = engines
        .iter()
        .map(|e| transport::UcxTransport::connect(e.id(), Arc::clone(e), &peers, 64 << 20).unwrap())
        .collect();
    (engines, eps)
}

/// A UCS status as text.
fn status_text(ucp: &sys::Ucp, status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static string for any value.
    let s = unsafe { std::ffi::CStr::from_ptr((ucp.ucs_status_string)(status)) };
    format!("{} ({status})", s.to_string_lossy())
}

/// `Ok` for `UCS_OK`, else the call and its status.
fn check(ucp: &sys::Ucp, call: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
    match status {
        sys::UCS_OK => Ok(()),
        s => Err(UcxError::Call {
            call,
            status: status_text(ucp, s),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_says_what_to_install() {
        let e = load("libucp-not-here.so.0").err().unwrap();
        assert!(matches!(e, UcxError::Missing(_)));
        let msg = e.to_string();
        assert!(msg.contains("apt install libucx0"), "{msg}");
        assert!(msg.contains("libucp-not-here.so.0"), "{msg}");
    }
}
