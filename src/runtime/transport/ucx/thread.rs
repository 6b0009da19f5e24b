//! The engine's thread: the UCP calls and the callbacks UCX makes during progress. Everything
//! here runs on that one thread (`UCS_THREAD_MODE_SINGLE`).

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CString};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::config::{EngineConfig, EngineCounts, Inbound};
use super::credit::Credit;
use super::lent::{Loan, Loans, LEND_MIN_BYTES};
use super::pool::Pool;
use super::{check, status_text, sys, UcxError};

/// The active-message id our messages use.
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
    /// Withdraws the unmatched loans of `batch` and answers how many there were.
    EndLoans {
        batch: u64,
        done: SyncSender<usize>,
    },
    /// Ends the wait for loans: the consumer now waits for messages it lent nothing for.
    FetchNow,
    Stop,
}

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

/// A rendezvous message the AM callback saw: its payload is fetched after progress returns.
struct Announced {
    from: u32,
    header: Vec<u8>,
    desc: *mut c_void,
    len: usize,
}

/// A send in flight: what must outlive it.
struct SendOp {
    /// The sender id, then the message's header.
    header: Vec<u8>,
    payload: Bytes,
    state: *mut State,
}

/// A rendezvous receive in flight.
struct RecvOp {
    from: u32,
    header: Vec<u8>,
    /// Allocated for `len` bytes, empty until the receive completes (empty for a loan).
    buf: Vec<u8>,
    len: usize,
    /// Into a lent buffer instead: its batch and address.
    loan: Option<(u64, usize)>,
    state: *mut State,
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
        if let Some(loan) = st.loans.take_match(from, &header, length) {
            let a = Announced {
                from,
                header,
                desc: data,
                len: length,
            };
            st.to_place.push_back((a, loan));
            return sys::UCS_INPROGRESS;
        }
        st.announced.push_back(Announced {
            from,
            header,
            desc: data,
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
    });
    sys::UCS_OK
}

unsafe extern "C" fn on_sent(request: *mut c_void, status: sys::ucs_status_t, user: *mut c_void) {
    let op = Box::from_raw(user as *mut SendOp);
    let st = &mut *op.state;
    st.sending -= 1;
    if status != sys::UCS_OK {
        st.count(|c| c.failed += 1);
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

fn finish_recv(st: &mut State, op: RecvOp, status: sys::ucs_status_t) {
    if let Some((batch, at)) = op.loan {
        let ok = status == sys::UCS_OK;
        if !ok {
            st.count(|c| c.failed += 1);
        }
        st.received.push_back(Inbound::Placed {
            from: op.from,
            header: op.header,
            batch,
            at,
            len: op.len,
            ok,
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

/// The context and worker, made on the engine thread.
fn open(
    ucp: &'static sys::Ucp,
    cfg: &EngineConfig,
) -> Result<(sys::ucp_context_h, sys::ucp_worker_h), UcxError> {
    // SAFETY: every parameter struct is zeroed and its field mask names the fields set.
    unsafe {
        let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
        check(
            ucp,
            "ucp_config_read",
            (ucp.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut config),
        )?;
        // The rank decides these, not the user's shell.
        let mut settings = vec![
            ("TLS", cfg.transports.as_str()),
            // Keep shared memory and CMA under peer-failure handling (§4 of UCX.md): without
            // these UCX moves same-host traffic to TCP loopback.
            // (`CMA_MEMORY_INVALIDATE` is a memory-domain setting that this call cannot reach:
            // [`super::library`] sets it in the environment before libucp is loaded.)
            ("MM_ERROR_HANDLING", "y"),
            // Shared memory notices a dead peer only by keepalive, every 20 s by default; the
            // control plane's heartbeats and every collective's deadline stay the authority.
            ("KEEPALIVE_INTERVAL", "1s"),
        ];
        if let Some(devices) = cfg.net_devices.as_deref() {
            settings.push(("NET_DEVICES", devices));
        }
        for (key, value) in settings {
            let (Ok(k), Ok(v)) = (CString::new(key), CString::new(value)) else {
                (ucp.ucp_config_release)(config);
                return Err(UcxError::Call {
                    call: "ucp_config_modify",
                    status: format!("{key}: a NUL byte in `{value}`"),
                });
            };
            let s = (ucp.ucp_config_modify)(config, k.as_ptr(), v.as_ptr());
            if let Err(e) = check(ucp, "ucp_config_modify", s) {
                (ucp.ucp_config_release)(config);
                return Err(UcxError::Call {
                    call: "ucp_config_modify",
                    status: format!("{key}={value}: {e}"),
                });
            }
        }
        let mut params: sys::ucp_params_t = std::mem::zeroed();
        params.field_mask = sys::UCP_PARAM_FIELD_FEATURES as u64;
        params.features = (sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP) as u64;
        let mut ctx: sys::ucp_context_h = std::ptr::null_mut();
        let s = (ucp.ucp_init_version)(
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR,
            &params,
            config,
            &mut ctx,
        );
        (ucp.ucp_config_release)(config);
        check(ucp, "ucp_init_version", s)?;
        let mut wp: sys::ucp_worker_params_t = std::mem::zeroed();
        wp.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
        wp.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
        if let Err(e) = check(
            ucp,
            "ucp_worker_create",
            (ucp.ucp_worker_create)(ctx, &wp, &mut worker),
        ) {
            (ucp.ucp_cleanup)(ctx);
            return Err(e);
        }
        Ok((ctx, worker))
    }
}

/// The worker's address as bytes.
unsafe fn worker_address(ucp: &sys::Ucp, worker: sys::ucp_worker_h) -> Result<Vec<u8>, UcxError> {
    let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
    let mut len: sys::size_t = 0;
    check(
        ucp,
        "ucp_worker_get_address",
        (ucp.ucp_worker_get_address)(worker, &mut addr, &mut len),
    )?;
    let out = std::slice::from_raw_parts(addr as *const u8, len as usize).to_vec();
    (ucp.ucp_worker_release_address)(worker, addr);
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    ucp: &'static sys::Ucp,
    cfg: EngineConfig,
    commands: Receiver<Cmd>,
    inbox: SyncSender<Inbound>,
    ready: SyncSender<Result<Vec<u8>, UcxError>>,
    waker: Waker,
    counts: Arc<Mutex<EngineCounts>>,
    credit: Arc<Credit>,
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
    }));
    let mut eps: HashMap<u32, (sys::ucp_ep_h, *mut EpArg)> = HashMap::new();
    // SAFETY: the worker, the state and the endpoints are used on this thread only, and each
    // op's box lives until its completion callback (or the immediate completion) frees it.
    unsafe {
        let setup = (|| {
            let mut hp: sys::ucp_am_handler_param_t = std::mem::zeroed();
            hp.field_mask = (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64;
            hp.id = AM_ID;
            hp.cb = Some(on_am);
            hp.arg = state as *mut c_void;
            check(
                ucp,
                "ucp_worker_set_am_recv_handler",
                (ucp.ucp_worker_set_am_recv_handler)(worker, &hp),
            )?;
            let mut efd = -1;
            check(
                ucp,
                "ucp_worker_get_efd",
                (ucp.ucp_worker_get_efd)(worker, &mut efd),
            )?;
            Ok::<_, UcxError>((worker_address(ucp, worker)?, efd))
        })();
        let efd = match setup {
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
        // The callbacks reach the state through its raw pointer while progress runs, so no
        // reference to it is held across a UCX call: each use below takes a short one.
        let mut stopping = false;
        let mut held: VecDeque<Inbound> = VecDeque::new();
        // Failed endpoints being closed, with their error handlers' arguments.
        let mut closing: Vec<(*mut c_void, *mut EpArg)> = Vec::new();
        loop {
            while let Ok(cmd) = commands.try_recv() {
                match cmd {
                    Cmd::Stop => stopping = true,
                    Cmd::Connect {
                        peer,
                        address,
                        done,
                    } => {
                        let _ = done.send(connect(state, &mut eps, peer, &address));
                    }
                    Cmd::Send {
                        peer,
                        header,
                        payload,
                    } => match eps.get(&peer) {
                        Some(&(ep, _)) => send(state, ep, cfg.id, header, payload),
                        None => (*state).count(|c| c.failed += 1),
                    },
                    Cmd::Lend(loan) => lend(state, loan),
                    Cmd::EndLoans { batch, done } => {
                        let _ = done.send((*state).loans.end(batch));
                        (*state).batch_open = false;
                        (*state).defer_until = Some(Instant::now() + LOAN_GRACE);
                    }
                    Cmd::FetchNow => {
                        (*state).batch_open = false;
                        (*state).defer_until = None;
                    }
                }
            }
            if stopping {
                break;
            }
            // Backpressure: while the inbox is full nothing more is taken off the wire.
            if held.len() < cfg.inbox_max {
                // Bounded: a worker that always reports more progress (a peer's endpoint
                // failing over and over) must not keep this thread from the commands, the
                // announced receives and the inbox below.
                for _ in 0..PROGRESS_ROUNDS_MAX {
                    if (ucp.ucp_worker_progress)(worker) == 0 {
                        break;
                    }
                }
                place_lent(state);
                fetch_announced(state);
                held.extend((*state).received.drain(..));
                close_failed(state, &mut eps, &mut closing);
            }
            while let Some(m) = held.pop_front() {
                match inbox.try_send(m) {
                    Ok(()) => {}
                    Err(TrySendError::Full(m)) => {
                        held.push_front(m);
                        break;
                    }
                    // Nobody reads any more: the engine is being dropped.
                    Err(TrySendError::Disconnected(_)) => {
                        held.clear();
                        break;
                    }
                }
            }
            if !held.is_empty() {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            // Messages left waiting for a loan are fetched once the grace ends, so the sleep
            // ends then too.
            let sleep_ms = match (*state).defer_until {
                Some(t) if !(*state).announced.is_empty() && !(*state).batch_open => {
                    let left = t.saturating_duration_since(Instant::now());
                    (left.as_millis() as i32 + 1).min(IDLE_POLL_MS)
                }
                _ => IDLE_POLL_MS,
            };
            match (ucp.ucp_worker_arm)(worker) {
                sys::UCS_OK => {
                    let mut fd = libc::pollfd {
                        fd: efd,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    libc::poll(&mut fd, 1, sleep_ms);
                }
                // Events arrived after the last progress: progress again.
                _ => continue,
            }
        }
        // Sends still in flight complete first (a rendezvous receiver may still be reading
        // this process's memory), within the close timeout.
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        (*state).batch_open = false;
        (*state).defer_until = None;
        while (*state).sending > 0 && Instant::now() < deadline {
            if (ucp.ucp_worker_progress)(worker) == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
            fetch_announced(state);
        }
        // Payloads never fetched: their senders see the receive end.
        for a in std::mem::take(&mut (*state).announced) {
            (ucp.ucp_am_data_release)(worker, a.desc);
        }
        for (a, _) in std::mem::take(&mut (*state).to_place) {
            (ucp.ucp_am_data_release)(worker, a.desc);
        }
        close_all(state, &mut eps, closing);
        *waker.lock().unwrap_or_else(|p| p.into_inner()) = None;
        (ucp.ucp_worker_destroy)(worker);
        drop(Box::from_raw(state));
        (ucp.ucp_cleanup)(ctx);
    }
}

unsafe fn connect(
    state: *mut State,
    eps: &mut HashMap<u32, (sys::ucp_ep_h, *mut EpArg)>,
    peer: u32,
    address: &[u8],
) -> Result<(), UcxError> {
    if eps.contains_key(&peer) {
        return Ok(());
    }
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
            Ok(())
        }
        Err(e) => {
            drop(Box::from_raw(arg));
            Err(e)
        }
    }
}

unsafe fn send(state: *mut State, ep: sys::ucp_ep_h, me: u32, header: Vec<u8>, payload: Bytes) {
    let mut h = Vec::with_capacity(4 + header.len());
    h.extend_from_slice(&me.to_le_bytes());
    h.extend_from_slice(&header);
    let op = Box::new(SendOp {
        header: h,
        payload,
        state,
    });
    let (hp, hl) = (op.header.as_ptr() as *const c_void, op.header.len());
    let (data, len) = (op.payload.as_ptr() as *const c_void, op.payload.len());
    let user = Box::into_raw(op) as *mut c_void;
    let mut p: sys::ucp_request_param_t = std::mem::zeroed();
    p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = Some(on_sent);
    p.user_data = user;
    let ucp = (*state).ucp;
    let req = (ucp.ucp_am_send_nbx)(
        ep,
        AM_ID,
        hp,
        hl as sys::size_t,
        data,
        len as sys::size_t,
        &p,
    );
    if req.is_null() {
        // Completed at once: the callback will not run.
        drop(Box::from_raw(user as *mut SendOp));
    } else if ptr_status(req).is_some() {
        drop(Box::from_raw(user as *mut SendOp));
        (*state).count(|c| c.failed += 1);
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
    let mut i = 0;
    while let Some(len) = (*state).announced.get(i).map(|a| a.len) {
        if deferring && len >= LEND_MIN_BYTES {
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

/// Opens `loan`, or, when a message it fits was announced and not fetched yet (waiting for
/// credit, or kept back for a loan), receives that message into it at once.
unsafe fn lend(state: *mut State, loan: Loan) {
    let st = &mut *state;
    st.batch_open = true;
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
        receive_into(state, a, Some((loan.batch, loan.at)));
    }
}

/// Starts the receive of the announced message `a`: into the lent memory of `loan` (its batch
/// and address), or into a pooled buffer of its length.
unsafe fn receive_into(state: *mut State, a: Announced, loan: Option<(u64, usize)>) {
    let Announced {
        from,
        header,
        desc,
        len,
    } = a;
    // Not zeroed: UCX fills all of it, and its length is set only once it has.
    let mut op = Box::new(RecvOp {
        from,
        header,
        buf: match loan {
            Some(_) => Vec::new(),
            None => (*state).pool.take(len),
        },
        len,
        loan,
        state,
    });
    let buf = match loan {
        Some((_, at)) => {
            (*state).count(|c| c.lent += 1);
            at as *mut c_void
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

/// Starts closing `ep` (forced: no flush to a peer that may be gone); the close's request, or
/// `None` if it completed at once.
unsafe fn start_close(ucp: &sys::Ucp, ep: sys::ucp_ep_h) -> Option<*mut c_void> {
    let mut p: sys::ucp_request_param_t = std::mem::zeroed();
    p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
    let req = (ucp.ucp_ep_close_nbx)(ep, &p);
    (!req.is_null() && ptr_status(req).is_none()).then_some(req)
}

/// Starts closing the endpoints that failed (a later send to that peer counts as failed; a
/// connect to it makes a new endpoint), and frees the closes that completed.
unsafe fn close_failed(
    state: *mut State,
    eps: &mut HashMap<u32, (sys::ucp_ep_h, *mut EpArg)>,
    closing: &mut Vec<(*mut c_void, *mut EpArg)>,
) {
    let ucp = (*state).ucp;
    for peer in std::mem::take(&mut (*state).failed) {
        // Its payloads still waiting for credit will not come: dropped before the endpoint
        // closes.
        let announced = std::mem::take(&mut (*state).announced);
        for a in announced {
            if a.from == peer {
                (ucp.ucp_am_data_release)((*state).worker, a.desc);
            } else {
                (*state).announced.push_back(a);
            }
        }
        if let Some((ep, arg)) = eps.remove(&peer) {
            match start_close(ucp, ep) {
                Some(req) => closing.push((req, arg)),
                None => drop(Box::from_raw(arg)),
            }
        }
    }
    closing.retain(|&(req, arg)| {
        let done = (ucp.ucp_request_check_status)(req) != sys::UCS_INPROGRESS;
        if done {
            (ucp.ucp_request_free)(req);
            drop(Box::from_raw(arg));
        }
        !done
    });
}

/// Closes every endpoint, progressing until each close (and those of failed endpoints already
/// under way, `closing`) completes or [`CLOSE_TIMEOUT`].
unsafe fn close_all(
    state: *mut State,
    eps: &mut HashMap<u32, (sys::ucp_ep_h, *mut EpArg)>,
    closing: Vec<(*mut c_void, *mut EpArg)>,
) {
    let (ucp, worker) = ((*state).ucp, (*state).worker);
    let deadline = Instant::now() + CLOSE_TIMEOUT;
    let (mut pending, mut args): (Vec<_>, Vec<_>) = closing.into_iter().unzip();
    for (_, (ep, arg)) in eps.drain() {
        if let Some(req) = start_close(ucp, ep) {
            pending.push(req);
        }
        args.push(arg);
    }
    while !pending.is_empty() && Instant::now() < deadline {
        (ucp.ucp_worker_progress)(worker);
        pending.retain(|&r| {
            let done = (ucp.ucp_request_check_status)(r) != sys::UCS_INPROGRESS;
            if done {
                (ucp.ucp_request_free)(r);
            }
            !done
        });
    }
    // An error handler may run until its endpoint's close completes: its argument is freed
    // only then (a close that timed out leaks 16 bytes rather than risk a dangling pointer).
    if pending.is_empty() {
        for arg in args {
            drop(Box::from_raw(arg));
        }
    }
}
