//! The engine's thread: the UCP calls and the callbacks UCX makes during progress. Everything
//! here runs on that one thread (`UCS_THREAD_MODE_SINGLE`). Its loop is in `event_loop`;
//! payloads staged in a peer's shared segment are in `staged`; opening the worker in `open`,
//! closing endpoints in `close`.
//!
//! Design: docs/transports.md (UCX).

mod close;
mod event_loop;
mod open;
mod staged;

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::config::{EngineCounts, Inbound};
use super::credit::Credit;
use super::lent::{Loan, Loans, LEND_MIN_BYTES};
use super::pool::Pool;
use super::ring::Ring;
use super::shm::Segment;
use super::{check, status_text, sys, UcxError};
use crate::runtime::transport::AddFn;
pub(super) use event_loop::run;

/// The active-message id our messages use (the staging notices have their own, `staged`).
const AM_ID: u32 = 0;
/// The largest header a message may carry beside its payload (it travels in UCX's active
/// message header, with the 4-byte sender id before it).
pub const HEADER_MAX_BYTES: usize = 256;
/// The longest the thread sleeps on the worker's event fd: it bounds the cost of a wake-up
/// that arrives between arming and sleeping.
const IDLE_POLL_MS: i32 = 10;
/// Most `ucp_worker_progress` calls in a row before the thread looks at its commands again.
const PROGRESS_ROUNDS_MAX: usize = 256;
/// How long after a batch of loans ends the engine still leaves unmatched rendezvous messages
/// in their senders' memory: long enough for a consumer that receives one payload after
/// another to lend the next buffer, short enough not to hold up anything else.
const LOAN_GRACE: Duration = Duration::from_millis(2);
/// How long a staged payload no loan matched waits in its sender's slot for one (unless the
/// consumer waits for frames with no loan open first): the receiver usually lends its buffer
/// right after its own sends, and a payload fetched early is copied twice. Bounded, so that a
/// consumer that waits without lending gets it late at worst, not never.
const STAGED_HOLD: Duration = Duration::from_millis(5);
/// How long closing endpoints may take when the engine stops.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

pub(super) enum Cmd {
    Connect {
        peer: u32,
        address: Vec<u8>,
        done: SyncSender<Result<(), UcxError>>,
    },
    Send {
        peer: u32,
        header: Vec<u8>,
        payload: Bytes,
    },
    /// Lends a buffer for one expected message (`lent`).
    Lend(Loan),
    /// Tells each of `to` that slot `slot` (of `generation`) of this engine's ring holds a
    /// `len`-byte payload, whose frame header is `header`.
    SendStaged {
        to: Vec<u32>,
        slot: usize,
        generation: u64,
        len: usize,
        header: Vec<u8>,
    },
    /// Tells `to` (holding slots of this engine's ring) that it has none free.
    SendStarved {
        to: Vec<u32>,
    },
    /// Withdraws the unmatched loans of `batch` and answers how many there were.
    EndLoans {
        batch: u64,
        done: SyncSender<usize>,
    },
    /// Ends the wait for loans: the consumer now waits for messages it lent nothing for.
    FetchNow,
    Stop,
}

/// The process id behind each peer whose segment is attached.
pub(super) type Pids = Arc<Mutex<HashMap<u32, i32>>>;

/// The worker pointer for `ucp_worker_signal`, cleared before the worker is destroyed.
pub(super) type Waker = Arc<Mutex<Option<usize>>>;

/// What the callbacks reach, on the engine thread only.
struct State {
    ucp: &'static sys::Ucp,
    worker: sys::ucp_worker_h,
    max_message_bytes: usize,
    received: VecDeque<Inbound>,
    /// Rendezvous messages announced in the AM callback, fetched after progress returns, in
    /// order, as credit allows.
    announced: VecDeque<Announced>,
    credit: Arc<Credit>,
    counts: Arc<Mutex<EngineCounts>>,
    /// Sends whose completion has not run yet.
    sending: usize,
    /// Peers whose endpoint failed since the loop last closed failed endpoints.
    failed: Vec<u32>,
    pool: Arc<Pool>,
    /// Buffers lent for expected messages, and the announced messages matched to one, to be
    /// received into it after progress returns (no receive starts inside the callback).
    loans: Loans,
    to_place: VecDeque<(Announced, Loan)>,
    /// While a batch of loans is open, and for [`LOAN_GRACE`] after it ends, unmatched
    /// rendezvous messages are not fetched: the next loan may be for them (the sender is often
    /// a payload ahead), and a payload fetched into the pool would be copied again.
    batch_open: bool,
    defer_until: Option<Instant>,
    /// This engine's staging ring (`None`: staging is off or its segment could not be made).
    ring: Option<Arc<Ring>>,
    /// The peers' segments this engine reads staged payloads from.
    peer_rings: HashMap<u32, Arc<Segment>>,
    /// The process behind each attached segment, for pulls (shared with the engine).
    pids: Pids,
    /// Slots of peers' rings copied out, to be freed (peer, slot, generation).
    to_free: Vec<(u32, usize, u64)>,
    /// Whether unmatched staged payloads wait for a loan ([`STAGED_HOLD`]): from a loan on,
    /// until the consumer asks for everything (`FetchNow`).
    hold_staged: bool,
    /// Set while staged payloads are held, for the consumer to see before it waits.
    holding: Arc<AtomicBool>,
}

impl State {
    /// Whether unmatched rendezvous messages wait for a loan now.
    fn deferring(&self) -> bool {
        self.batch_open || self.defer_until.is_some_and(|t| Instant::now() < t)
    }
}

impl State {
    fn count(&self, f: impl FnOnce(&mut EngineCounts)) {
        f(&mut self.counts.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

/// A message whose payload is fetched after progress returns: a rendezvous message the AM
/// callback saw, or a payload a peer staged.
struct Announced {
    from: u32,
    header: Vec<u8>,
    source: Source,
    len: usize,
}

/// Where an announced payload is.
enum Source {
    /// In the sender's memory, behind UCX's rendezvous descriptor.
    Rndv(*mut c_void),
    /// In slot `slot` of the sender's segment, for that slot's use `generation`.
    Staged {
        segment: Arc<Segment>,
        slot: usize,
        generation: u64,
        /// Until when it waits for a loan: its arrival plus [`STAGED_HOLD`], or once its
        /// sender says it has no free slot.
        hold_until: Instant,
    },
}

impl Source {
    /// Drops a payload that will not be fetched: UCX's descriptor goes back (a staged slot is
    /// the sender's to reclaim).
    unsafe fn release(self, ucp: &sys::Ucp, worker: sys::ucp_worker_h) {
        if let Source::Rndv(desc) = self {
            (ucp.ucp_am_data_release)(worker, desc);
        }
    }

    /// Until when a staged payload waits for a loan.
    fn held_until(&self) -> Option<Instant> {
        match self {
            Source::Staged { hold_until, .. } => Some(*hold_until),
            Source::Rndv(_) => None,
        }
    }
}

/// A send in flight: what must outlive it.
struct SendOp {
    /// The sender id, then the message's header.
    header: Vec<u8>,
    payload: Bytes,
    state: *mut State,
    /// A staging notice: the slot (index, generation) and the peer it tells, whose hold on the
    /// slot ends if the notice fails.
    staged: Option<(usize, u64, u32)>,
}

/// Where a lent payload goes: the loan's batch, the lent address, and, for a payload added
/// there, the addition.
#[derive(Clone, Copy)]
struct LoanAt {
    batch: u64,
    at: usize,
    add: Option<AddFn>,
}

/// A rendezvous receive in flight.
struct RecvOp {
    from: u32,
    header: Vec<u8>,
    /// Allocated for `len` bytes, empty until the receive completes (empty for a loan).
    buf: Vec<u8>,
    len: usize,
    /// Into a lent buffer instead.
    loan: Option<LoanAt>,
    state: *mut State,
    /// The payload's CRC-32, when it was taken while copying it.
    crc: Option<u32>,
}

/// The argument of an endpoint's error handler.
struct EpArg {
    peer: u32,
    state: *mut State,
}

unsafe extern "C" fn on_am(
    arg: *mut c_void,
    header: *const c_void,
    header_length: sys::size_t,
    data: *mut c_void,
    length: sys::size_t,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let st = &mut *(arg as *mut State);
    let length = length as usize;
    let rndv = (*param).recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0;
    let header_length = header_length as usize;
    if !(4..=4 + HEADER_MAX_BYTES).contains(&header_length) || length > st.max_message_bytes {
        st.count(|c| c.refused += 1);
        // A rendezvous descriptor is dropped by returning an error, which the sender sees.
        return if rndv {
            sys::UCS_ERR_MESSAGE_TRUNCATED
        } else {
            sys::UCS_OK
        };
    }
    let header = std::slice::from_raw_parts(header as *const u8, header_length);
    let from = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let header = header[4..].to_vec();
    if rndv {
        st.announce(Announced {
            from,
            header,
            source: Source::Rndv(data),
            len: length,
        });
        return sys::UCS_INPROGRESS;
    }
    let bytes = Bytes::copy_from_slice(std::slice::from_raw_parts(data as *const u8, length));
    st.credit.force(length);
    st.received.push_back(Inbound::Message {
        from,
        header,
        bytes,
        crc: None,
    });
    sys::UCS_OK
}

impl State {
    /// A payload to fetch: into the loan it matches, else when credit allows.
    fn announce(&mut self, a: Announced) {
        match self.loans.take_match(a.from, &a.header, a.len) {
            Some(loan) => self.to_place.push_back((a, loan)),
            None => self.announced.push_back(a),
        }
    }
}

unsafe extern "C" fn on_sent(request: *mut c_void, status: sys::ucs_status_t, user: *mut c_void) {
    let op = Box::from_raw(user as *mut SendOp);
    let st = &mut *op.state;
    st.sending -= 1;
    if status != sys::UCS_OK {
        st.count(|c| c.failed += 1);
        staged::notice_failed(st, op.staged);
    }
    (st.ucp.ucp_request_free)(request);
}

unsafe extern "C" fn on_received(
    request: *mut c_void,
    status: sys::ucs_status_t,
    _length: sys::size_t,
    user: *mut c_void,
) {
    let op = Box::from_raw(user as *mut RecvOp);
    let st = &mut *op.state;
    finish_recv(st, *op, status);
    (st.ucp.ucp_request_free)(request);
}

fn finish_recv(st: &mut State, mut op: RecvOp, status: sys::ucs_status_t) {
    if let Some(LoanAt { batch, at, add }) = op.loan {
        let ok = status == sys::UCS_OK;
        if !ok {
            st.count(|c| c.failed += 1);
        }
        if let (Some(add), None, true) = (add, op.crc, ok) {
            // A rendezvous payload for memory it is added into landed in a buffer first.
            st.count(|c| c.added += 1);
            let mut buf = std::mem::take(&mut op.buf);
            // SAFETY: UCX wrote all `len` bytes (the receive completed OK); the lent memory
            // holds `len` bytes that only this thread touches until the loan is settled.
            unsafe {
                buf.set_len(op.len);
                let dst = std::slice::from_raw_parts_mut(at as *mut u8, op.len);
                op.crc = Some(staged::add_summed(add, dst, &buf));
            }
            drop(st.pool.wrap(buf));
        }
        st.received.push_back(Inbound::Placed {
            from: op.from,
            header: op.header,
            batch,
            at,
            len: op.len,
            ok,
            crc: op.crc,
        });
        return;
    }
    if status == sys::UCS_OK {
        let mut bytes = op.buf;
        // SAFETY: the buffer holds `len` bytes, and UCX wrote all of them (the receive of
        // `len` bytes completed OK).
        unsafe { bytes.set_len(op.len) };
        st.received.push_back(Inbound::Message {
            from: op.from,
            header: op.header,
            bytes: st.pool.wrap(bytes),
            crc: op.crc,
        });
    } else {
        st.credit.give(op.len);
        st.count(|c| c.failed += 1);
    }
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    let a = &*(arg as *const EpArg);
    let st = &mut *a.state;
    let why = status_text(st.ucp, status);
    // Whatever it held of this engine's ring is free, and nothing more is staged to it.
    if let Some(ring) = &st.ring {
        ring.update(|s| s.peer_lost(a.peer));
    }
    st.received
        .push_back(Inbound::PeerLost { peer: a.peer, why });
    // Closed by the loop, not here: UCX wants a failed endpoint closed, but not from inside
    // its own callback.
    st.failed.push(a.peer);
}

/// `UCS_PTR_IS_ERR` / `UCS_PTR_STATUS` of a returned request pointer.
fn ptr_status(p: *mut c_void) -> Option<sys::ucs_status_t> {
    let v = p as isize;
    (v < 0 && v >= sys::UCS_ERR_LAST as isize).then_some(v as sys::ucs_status_t)
}

unsafe fn connect(
    state: *mut State,
    eps: &mut HashMap<u32, (sys::ucp_ep_h, *mut EpArg)>,
    peer: u32,
    address: &[u8],
    me: u32,
) -> Result<(), UcxError> {
    if eps.contains_key(&peer) {
        return Ok(());
    }
    let (address, staging) = super::address::split_address(address)?;
    let arg = Box::into_raw(Box::new(EpArg { peer, state }));
    let mut p: sys::ucp_ep_params_t = std::mem::zeroed();
    p.field_mask = (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
        | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
        | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64;
    p.address = address.as_ptr() as *const sys::ucp_address_t;
    p.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = Some(on_ep_error);
    p.err_handler.arg = arg as *mut c_void;
    let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
    match check(
        (*state).ucp,
        "ucp_ep_create",
        ((*state).ucp.ucp_ep_create)((*state).worker, &p, &mut ep),
    ) {
        Ok(()) => {
            eps.insert(peer, (ep, arg));
            if let Some(d) = staging {
                staged::attach(state, ep, me, peer, &d);
            }
            Ok(())
        }
        Err(e) => {
            drop(Box::from_raw(arg));
            Err(e)
        }
    }
}

/// Sends one active message `id` to `ep`: this engine's id and `header` in UCX's header, then
/// `payload`. `staged`: a staging notice's slot and peer (see [`SendOp`]).
unsafe fn send(
    state: *mut State,
    ep: sys::ucp_ep_h,
    me: u32,
    id: u32,
    header: Vec<u8>,
    payload: Bytes,
    staged: Option<(usize, u64, u32)>,
) {
    let mut h = Vec::with_capacity(4 + header.len());
    h.extend_from_slice(&me.to_le_bytes());
    h.extend_from_slice(&header);
    let op = Box::new(SendOp {
        header: h,
        payload,
        state,
        staged,
    });
    let (hp, hl) = (op.header.as_ptr() as *const c_void, op.header.len());
    let (data, len) = (op.payload.as_ptr() as *const c_void, op.payload.len());
    let user = Box::into_raw(op) as *mut c_void;
    let mut p: sys::ucp_request_param_t = std::mem::zeroed();
    p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = Some(on_sent);
    p.user_data = user;
    let ucp = (*state).ucp;
    let req = (ucp.ucp_am_send_nbx)(ep, id, hp, hl as sys::size_t, data, len as sys::size_t, &p);
    if req.is_null() {
        // Completed at once: the callback will not run.
        drop(Box::from_raw(user as *mut SendOp));
    } else if ptr_status(req).is_some() {
        let op = Box::from_raw(user as *mut SendOp);
        (*state).count(|c| c.failed += 1);
        staged::notice_failed(&*state, op.staged);
    } else {
        (*state).sending += 1;
    }
}

/// Starts the receive of the rendezvous messages the AM callback announced (kept until
/// progress returns, so that no receive starts inside the callback), in order, while the
/// receive credit allows; the rest wait for the consumer to give credit back.
unsafe fn fetch_announced(state: *mut State) {
    // While messages wait for loans, those too short for one are still fetched.
    let deferring = (*state).deferring();
    let hold = (*state).hold_staged;
    let now = Instant::now();
    let mut i = 0;
    while let Some(a) = (*state).announced.get(i) {
        let len = a.len;
        let held = hold && a.source.held_until().is_some_and(|t| now < t);
        if (deferring && len >= LEND_MIN_BYTES) || held {
            i += 1;
            continue;
        }
        if !(*state).credit.try_take(len) {
            // Then once more: credit given back before the mark would not wake this thread.
            (*state).credit.starve();
            if !(*state).credit.try_take(len) {
                return;
            }
        }
        let a = (*state).announced.remove(i).expect("the index is in range");
        receive_into(state, a, None);
    }
}

impl State {
    /// The earliest end of a staged payload's hold, if any is held; publishes whether one is.
    fn held_until(&self) -> Option<Instant> {
        let until = if self.hold_staged {
            let now = Instant::now();
            let ends = self.announced.iter().filter_map(|a| a.source.held_until());
            ends.filter(|&t| now < t).min()
        } else {
            None
        };
        self.holding.store(until.is_some(), Ordering::Relaxed);
        until
    }
}

/// Opens `loan`, or, when a message it fits was announced and not fetched yet (waiting for
/// credit, or kept back for a loan), receives that message into it at once.
unsafe fn lend(state: *mut State, loan: Loan) {
    let st = &mut *state;
    st.batch_open = true;
    st.hold_staged = true;
    let waiting = st
        .announced
        .iter()
        .position(|a| loan.fits(a.from, &a.header, a.len));
    match waiting {
        Some(i) => {
            let a = st.announced.remove(i).expect("the position is in range");
            st.to_place.push_back((a, loan));
        }
        None => {
            st.loans.lend(loan);
        }
    }
}

/// Starts the receives of the announced messages matched to a loan: into the lent memory,
/// without receive credit (the memory is the consumer's own).
unsafe fn place_lent(state: *mut State) {
    while let Some((a, loan)) = (*state).to_place.pop_front() {
        let at = LoanAt {
            batch: loan.batch,
            at: loan.at,
            add: loan.add,
        };
        receive_into(state, a, Some(at));
    }
}

/// Starts the receive of the announced message `a`: into the lent memory of `loan` (its batch
/// and address), or into a pooled buffer of its length.
unsafe fn receive_into(state: *mut State, a: Announced, loan: Option<LoanAt>) {
    let Announced {
        from,
        header,
        source,
        len,
    } = a;
    let desc = match source {
        Source::Rndv(desc) => desc,
        Source::Staged {
            segment,
            slot,
            generation,
            ..
        } => {
            let at = staged::RecvAt { from, header, loan };
            return staged::copy_out(state, at, (&*segment, slot, generation), len);
        }
    };
    // Not zeroed: UCX fills all of it, and its length is set only once it has.
    let mut op = Box::new(RecvOp {
        from,
        header,
        buf: match loan {
            Some(LoanAt { add: None, .. }) => Vec::new(),
            // Received whole, then added (by `finish_recv`).
            Some(LoanAt { add: Some(_), .. }) | None => (*state).pool.take(len),
        },
        len,
        loan,
        state,
        crc: None,
    });
    let buf = match loan {
        Some(LoanAt { at, add: None, .. }) => {
            (*state).count(|c| c.lent += 1);
            at as *mut c_void
        }
        Some(LoanAt { add: Some(_), .. }) => {
            (*state).count(|c| c.lent += 1);
            op.buf.as_mut_ptr() as *mut c_void
        }
        None => op.buf.as_mut_ptr() as *mut c_void,
    };
    let user = Box::into_raw(op) as *mut c_void;
    let mut p: sys::ucp_request_param_t = std::mem::zeroed();
    p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = Some(on_received);
    p.user_data = user;
    let (ucp, worker) = ((*state).ucp, (*state).worker);
    let req = (ucp.ucp_am_recv_data_nbx)(worker, desc, buf, len as sys::size_t, &p);
    if req.is_null() {
        finish_recv(
            &mut *state,
            *Box::from_raw(user as *mut RecvOp),
            sys::UCS_OK,
        );
    } else if let Some(s) = ptr_status(req) {
        finish_recv(&mut *state, *Box::from_raw(user as *mut RecvOp), s);
    }
}

pub(super) fn lock_pids(p: &Pids) -> std::sync::MutexGuard<'_, HashMap<u32, i32>> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}
