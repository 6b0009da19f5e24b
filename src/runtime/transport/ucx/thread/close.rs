//! Closing endpoints: those UCX reported failed, while the engine runs, and all of them when
//! it stops.

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::Instant;

use super::{lock_pids, ptr_status, EpArg, State, CLOSE_TIMEOUT};
use crate::runtime::transport::ucx::sys;

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
pub(super) unsafe fn close_failed(
    state: *mut State,
    eps: &mut HashMap<u32, (sys::ucp_ep_h, *mut EpArg)>,
    closing: &mut Vec<(*mut c_void, *mut EpArg)>,
) {
    let ucp = (*state).ucp;
    for peer in std::mem::take(&mut (*state).failed) {
        // Its payloads still waiting for credit will not come: dropped before the endpoint
        // closes. Its segment is not read again (a process that rejoins as this rank brings a
        // new one).
        let announced = std::mem::take(&mut (*state).announced);
        for a in announced {
            if a.from == peer {
                a.source.release(ucp, (*state).worker);
            } else {
                (*state).announced.push_back(a);
            }
        }
        (*state).peer_rings.remove(&peer);
        lock_pids(&(*state).pids).remove(&peer);
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
pub(super) unsafe fn close_all(
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
