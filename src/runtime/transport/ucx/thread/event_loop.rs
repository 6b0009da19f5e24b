//! The engine thread's loop. Once the worker is open it repeats: run the commands other
//! threads submitted, progress the worker (unless the inbox is full), hand what arrived to the
//! engine's inbox as room allows, and sleep on the worker's event fd until something happens
//! or a wait for loans ends. Told to stop, it lets the sends in flight finish and closes
//! everything.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::close::{close_all, close_failed};
use super::open::{open, worker_address};
use super::{
    connect, fetch_announced, lend, on_am, place_lent, send, staged, Cmd, EpArg, Pids, State,
    Waker, AM_ID, CLOSE_TIMEOUT, IDLE_POLL_MS, LOAN_GRACE, PROGRESS_ROUNDS_MAX,
};
use crate::runtime::transport::ucx::config::{EngineConfig, EngineCounts, Inbound};
use crate::runtime::transport::ucx::credit::Credit;
use crate::runtime::transport::ucx::lent::Loans;
use crate::runtime::transport::ucx::ring::Ring;
use crate::runtime::transport::ucx::{check, sys, UcxError};

/// The endpoints by peer, with their error handlers' arguments.
type Endpoints = HashMap<u32, (sys::ucp_ep_h, *mut EpArg)>;

/// What the loop owns beside the callbacks' state.
struct EventLoop {
    ucp: &'static sys::Ucp,
    worker: sys::ucp_worker_h,
    /// The callbacks reach the state through this pointer while progress runs, so no
    /// reference to it is held across a UCX call: each use takes a short one.
    state: *mut State,
    /// This engine's id, which every message it sends carries.
    id: u32,
    eps: Endpoints,
    /// Arrived messages the inbox had no room for yet.
    held: VecDeque<Inbound>,
    /// Failed endpoints being closed, with their error handlers' arguments.
    closing: Vec<(*mut c_void, *mut EpArg)>,
}

/// The engine thread: opens the worker, sends its address (or why it could not) on `ready`,
/// and runs the loop until [`Cmd::Stop`].
#[allow(clippy::too_many_arguments)]
pub(in crate::runtime::transport::ucx) fn run(
    ucp: &'static sys::Ucp,
    cfg: EngineConfig,
    commands: Receiver<Cmd>,
    inbox: SyncSender<Inbound>,
    ready: SyncSender<Result<Vec<u8>, UcxError>>,
    waker: Waker,
    counts: Arc<Mutex<EngineCounts>>,
    credit: Arc<Credit>,
    (ring, holding, pids): (Option<Arc<Ring>>, Arc<AtomicBool>, Pids),
) {
    let (ctx, worker) = match open(ucp, &cfg) {
        Ok(v) => v,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    // Boxed so the callbacks' pointer to it stays put.
    let state = Box::into_raw(Box::new(State {
        ucp,
        worker,
        max_message_bytes: cfg.max_message_bytes,
        received: VecDeque::new(),
        announced: VecDeque::new(),
        credit,
        counts,
        sending: 0,
        failed: Vec::new(),
        pool: Arc::default(),
        loans: Loans::default(),
        to_place: VecDeque::new(),
        batch_open: false,
        defer_until: None,
        ring,
        peer_rings: HashMap::new(),
        pids,
        to_free: Vec::new(),
        hold_staged: false,
        holding,
    }));
    // SAFETY: the worker, the state and the endpoints are used on this thread only, and each
    // op's box lives until its completion callback (or the immediate completion) frees it.
    unsafe {
        let efd = match prepare(ucp, worker, state) {
            Ok((address, efd)) => {
                *waker.lock().unwrap_or_else(|p| p.into_inner()) = Some(worker as usize);
                let _ = ready.send(Ok(address));
                efd
            }
            Err(e) => {
                let _ = ready.send(Err(e));
                drop(Box::from_raw(state));
                (ucp.ucp_worker_destroy)(worker);
                (ucp.ucp_cleanup)(ctx);
                return;
            }
        };
        let mut lp = EventLoop {
            ucp,
            worker,
            state,
            id: cfg.id,
            eps: HashMap::new(),
            held: VecDeque::new(),
            closing: Vec::new(),
        };
        while lp.run_commands(&commands) {
            // Backpressure: while the inbox is full nothing more is taken off the wire.
            if lp.held.len() < cfg.inbox_max {
                lp.progress();
            }
            if !lp.deliver(&inbox) {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            lp.sleep(efd);
        }
        lp.shut_down();
        *waker.lock().unwrap_or_else(|p| p.into_inner()) = None;
        (ucp.ucp_worker_destroy)(worker);
        drop(Box::from_raw(state));
        (ucp.ucp_cleanup)(ctx);
    }
}

/// Installs the message handlers on `worker`; its address and event fd.
unsafe fn prepare(
    ucp: &'static sys::Ucp,
    worker: sys::ucp_worker_h,
    state: *mut State,
) -> Result<(Vec<u8>, i32), UcxError> {
    staged::set_handler(ucp, worker, state, (AM_ID, on_am))?;
    staged::set_handlers(ucp, worker, state)?;
    let mut efd = -1;
    check(
        ucp,
        "ucp_worker_get_efd",
        (ucp.ucp_worker_get_efd)(worker, &mut efd),
    )?;
    Ok((worker_address(ucp, worker)?, efd))
}

impl EventLoop {
    /// Runs every command waiting; `false` once one of them was [`Cmd::Stop`] (those queued
    /// with it still run).
    unsafe fn run_commands(&mut self, commands: &Receiver<Cmd>) -> bool {
        let mut go_on = true;
        while let Ok(cmd) = commands.try_recv() {
            go_on &= self.execute(cmd);
        }
        go_on
    }

    /// Runs one command; `false` for [`Cmd::Stop`].
    unsafe fn execute(&mut self, cmd: Cmd) -> bool {
        let (state, id) = (self.state, self.id);
        match cmd {
            Cmd::Stop => return false,
            Cmd::Connect {
                peer,
                address,
                done,
            } => {
                let _ = done.send(connect(state, &mut self.eps, peer, &address, id));
            }
            Cmd::Send {
                peer,
                header,
                payload,
            } => match self.eps.get(&peer) {
                Some(&(ep, _)) => send(state, ep, id, AM_ID, header, payload, None),
                None => (*state).count(|c| c.failed += 1),
            },
            Cmd::SendStaged {
                to,
                slot,
                generation,
                len,
                header,
            } => {
                let notice = staged::Notice {
                    slot,
                    generation,
                    len,
                };
                staged::send_notices(state, &self.eps, id, &to, notice, &header)
            }
            Cmd::SendStarved { to } => staged::send_starved(state, &self.eps, id, &to),
            Cmd::Lend(loan) => lend(state, loan),
            Cmd::EndLoans { batch, done } => {
                let _ = done.send((*state).loans.end(batch));
                (*state).batch_open = false;
                (*state).defer_until = Some(Instant::now() + LOAN_GRACE);
            }
            Cmd::FetchNow => {
                (*state).batch_open = false;
                (*state).defer_until = None;
                (*state).hold_staged = false;
            }
        }
        true
    }

    /// Progresses the worker, then does what the callbacks left for after it: receives into
    /// loans and announced payloads, frees the peers' staging slots copied out, takes in what
    /// arrived and closes the endpoints that failed.
    unsafe fn progress(&mut self) {
        // Bounded: a worker that always reports more progress (a peer's endpoint failing over
        // and over) must not keep this thread from the commands, the announced receives and
        // the inbox.
        for _ in 0..PROGRESS_ROUNDS_MAX {
            if (self.ucp.ucp_worker_progress)(self.worker) == 0 {
                break;
            }
        }
        place_lent(self.state);
        fetch_announced(self.state);
        staged::send_frees(self.state, &self.eps, self.id);
        self.held.extend((*self.state).received.drain(..));
        close_failed(self.state, &mut self.eps, &mut self.closing);
    }

    /// Hands the held messages to `inbox` while it has room; whether none is left held.
    fn deliver(&mut self, inbox: &SyncSender<Inbound>) -> bool {
        while let Some(m) = self.held.pop_front() {
            match inbox.try_send(m) {
                Ok(()) => {}
                Err(TrySendError::Full(m)) => {
                    self.held.push_front(m);
                    break;
                }
                // Nobody reads any more: the engine is being dropped.
                Err(TrySendError::Disconnected(_)) => {
                    self.held.clear();
                    break;
                }
            }
        }
        self.held.is_empty()
    }

    /// Sleeps on the worker's event fd `efd` until an event, at most [`IDLE_POLL_MS`].
    unsafe fn sleep(&self, efd: i32) {
        let sleep_ms = self.sleep_ms();
        // Anything else than OK: events arrived after the last progress, so the loop
        // progresses again at once.
        if (self.ucp.ucp_worker_arm)(self.worker) == sys::UCS_OK {
            let mut fd = libc::pollfd {
                fd: efd,
                events: libc::POLLIN,
                revents: 0,
            };
            libc::poll(&mut fd, 1, sleep_ms);
        }
    }

    /// How long the loop may sleep: messages left waiting for a loan are fetched once the
    /// grace or the hold ends, so the sleep ends then too.
    unsafe fn sleep_ms(&self) -> i32 {
        let state = self.state;
        let grace = match (*state).defer_until {
            Some(t) if !(*state).announced.is_empty() && !(*state).batch_open => Some(t),
            _ => None,
        };
        let hold = (*state).held_until();
        match grace.into_iter().chain(hold).min() {
            Some(t) => {
                let left = t.saturating_duration_since(Instant::now());
                (left.as_millis() as i32 + 1).min(IDLE_POLL_MS)
            }
            None => IDLE_POLL_MS,
        }
    }

    /// Lets the sends in flight complete (a rendezvous receiver may still be reading this
    /// process's memory), within [`CLOSE_TIMEOUT`]; then gives back the payloads never
    /// fetched (their senders see the receive end) and closes every endpoint.
    unsafe fn shut_down(mut self) {
        let (ucp, worker, state) = (self.ucp, self.worker, self.state);
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        (*state).batch_open = false;
        (*state).defer_until = None;
        while (*state).sending > 0 && Instant::now() < deadline {
            if (ucp.ucp_worker_progress)(worker) == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
            fetch_announced(state);
        }
        for a in std::mem::take(&mut (*state).announced) {
            a.source.release(ucp, worker);
        }
        for (a, _) in std::mem::take(&mut (*state).to_place) {
            a.source.release(ucp, worker);
        }
        close_all(state, &mut self.eps, self.closing);
    }
}
