//! Payloads staged in shared segments (`ring`, `shm`), on the engine thread: the small active
//! messages that carry the protocol, and the copy out of a peer's segment.
//!
//! - *attached* (receiver → sender, at connect): "I mapped your segment", naming its nonce;
//!   only then does the sender stage payloads to that receiver.
//! - *notice* (sender → receiver): slot, the slot's generation, length, and the frame's header
//!   and checksum. The receiver fetches it as it would a rendezvous message (into the loan it
//!   matches, else when receive credit allows): one copy out of the mapping into the buffer,
//!   checksummed per block while the block is in cache.
//! - *freed* (receiver → sender, after the copy): the slot's generation is done with.
//! - *starved* (sender → the receivers holding its slots): it has no free slot; payloads of
//!   its that wait here for a loan are copied out now.
//!
//! Every field a notice carries is checked against the mapping before use; a payload a peer
//! changed under us fails the frame's CRC like a damaged one.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use bytes::Bytes;

use super::{finish_recv, send, Announced, EpArg, LoanAt, RecvOp, Source, State, HEADER_MAX_BYTES};
use crate::runtime::transport::ucx::shm::{Descriptor, Segment};
use crate::runtime::transport::ucx::{check, sys, UcxError};
use crate::runtime::transport::AddFn;

const NOTICE_ID: u32 = 1;
const FREED_ID: u32 = 2;
const ATTACHED_ID: u32 = 3;
const STARVED_ID: u32 = 4;
/// A notice's fields before the frame header: slot (u32), generation (u64), length (u64).
const NOTICE_BYTES: usize = 4 + 8 + 8;
/// A freed message: slot (u32), generation (u64).
const FREED_BYTES: usize = 4 + 8;
/// Bytes copied at a time before their checksum is taken: the block is still in cache.
const COPY_BLOCK_BYTES: usize = 64 << 10;

pub(super) type Handler = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    sys::size_t,
    *mut c_void,
    sys::size_t,
    *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t;

/// Sets the handlers of the three staging messages.
pub(super) unsafe fn set_handlers(
    ucp: &sys::Ucp,
    worker: sys::ucp_worker_h,
    state: *mut State,
) -> Result<(), UcxError> {
    let handlers: [(u32, Handler); 4] = [
        (NOTICE_ID, on_notice),
        (FREED_ID, on_freed),
        (ATTACHED_ID, on_attached),
        (STARVED_ID, on_starved),
    ];
    for h in handlers {
        set_handler(ucp, worker, state, h)?;
    }
    Ok(())
}

/// Sets `cb` as the handler of active messages `id`, called with the engine's state.
pub(super) unsafe fn set_handler(
    ucp: &sys::Ucp,
    worker: sys::ucp_worker_h,
    state: *mut State,
    (id, cb): (u32, Handler),
) -> Result<(), UcxError> {
    let mut hp: sys::ucp_am_handler_param_t = std::mem::zeroed();
    hp.field_mask = (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
        | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
        | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64;
    hp.id = id;
    hp.cb = Some(cb);
    hp.arg = state as *mut c_void;
    check(
        ucp,
        "ucp_worker_set_am_recv_handler",
        (ucp.ucp_worker_set_am_recv_handler)(worker, &hp),
    )
}

/// The sender's id and the rest of a staging message's header, if it is one: no payload, and
/// a header of `fields` bytes (a notice: up to [`HEADER_MAX_BYTES`] more).
unsafe fn parse<'a>(
    header: *const c_void,
    header_length: sys::size_t,
    length: sys::size_t,
    fields: usize,
    extra_max: usize,
) -> Option<(u32, &'a [u8])> {
    let n = header_length as usize;
    if length != 0 || !(4 + fields..=4 + fields + extra_max).contains(&n) {
        return None;
    }
    let h = std::slice::from_raw_parts(header as *const u8, n);
    Some((u32::from_le_bytes(h[..4].try_into().ok()?), &h[4..]))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("length checked"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("length checked"))
}

/// What a callback that refuses a message returns: an error drops a rendezvous descriptor
/// (a staging message is never one; a peer that sends one is refused).
unsafe fn refuse(st: &State, param: *const sys::ucp_am_recv_param_t) -> sys::ucs_status_t {
    st.count(|c| c.refused += 1);
    if (*param).recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
        sys::UCS_ERR_MESSAGE_TRUNCATED
    } else {
        sys::UCS_OK
    }
}

unsafe extern "C" fn on_notice(
    arg: *mut c_void,
    header: *const c_void,
    header_length: sys::size_t,
    _data: *mut c_void,
    length: sys::size_t,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let st = &mut *(arg as *mut State);
    let Some((from, h)) = parse(
        header,
        header_length,
        length,
        NOTICE_BYTES,
        HEADER_MAX_BYTES,
    ) else {
        return refuse(st, param);
    };
    let (slot, generation) = (u32_at(h, 0) as usize, u64_at(h, 4));
    let len = u64_at(h, 12);
    let Some(segment) = st.peer_rings.get(&from).cloned() else {
        return refuse(st, param);
    };
    let d = *segment.descriptor();
    if slot >= d.slots as usize {
        return refuse(st, param);
    }
    if len > d.slot_bytes as u64 || len > st.max_message_bytes as u64 {
        // The slot is named rightly: free it, or the sender waits for it until it is lost.
        st.to_free.push((from, slot, generation));
        return refuse(st, param);
    }
    st.announce(Announced {
        from,
        header: h[NOTICE_BYTES..].to_vec(),
        source: Source::Staged {
            segment,
            slot,
            generation,
            hold_until: std::time::Instant::now() + super::STAGED_HOLD,
        },
        len: len as usize,
    });
    sys::UCS_OK
}

unsafe extern "C" fn on_freed(
    arg: *mut c_void,
    header: *const c_void,
    header_length: sys::size_t,
    _data: *mut c_void,
    length: sys::size_t,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let st = &mut *(arg as *mut State);
    let (Some((from, h)), Some(ring)) = (
        parse(header, header_length, length, FREED_BYTES, 0),
        &st.ring,
    ) else {
        return refuse(st, param);
    };
    let (slot, generation) = (u32_at(h, 0) as usize, u64_at(h, 4));
    ring.update(|s| s.release(slot, generation, from));
    sys::UCS_OK
}

unsafe extern "C" fn on_attached(
    arg: *mut c_void,
    header: *const c_void,
    header_length: sys::size_t,
    _data: *mut c_void,
    length: sys::size_t,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let st = &mut *(arg as *mut State);
    let nonce_bytes = 16;
    match (
        parse(header, header_length, length, nonce_bytes, 0),
        &st.ring,
    ) {
        (Some((from, nonce)), Some(ring)) if nonce == ring.segment().descriptor().nonce => {
            ring.update(|s| {
                s.peer_ready(from);
                false
            });
            sys::UCS_OK
        }
        _ => refuse(st, param),
    }
}

unsafe extern "C" fn on_starved(
    arg: *mut c_void,
    header: *const c_void,
    header_length: sys::size_t,
    _data: *mut c_void,
    length: sys::size_t,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let st = &mut *(arg as *mut State);
    let Some((from, _)) = parse(header, header_length, length, 0, 0) else {
        return refuse(st, param);
    };
    // Its payloads waiting for a loan here are copied out now, freeing its slots.
    let now = std::time::Instant::now();
    for a in st.announced.iter_mut().filter(|a| a.from == from) {
        if let Source::Staged { hold_until, .. } = &mut a.source {
            *hold_until = now;
        }
    }
    sys::UCS_OK
}

/// Tells each of `to` that this engine's ring has no free slot.
pub(super) unsafe fn send_starved(
    state: *mut State,
    eps: &HashMap<u32, (sys::ucp_ep_h, *mut EpArg)>,
    me: u32,
    to: &[u32],
) {
    for peer in to {
        if let Some(&(ep, _)) = eps.get(peer) {
            send(state, ep, me, STARVED_ID, Vec::new(), Bytes::new(), None);
        }
    }
}

/// Maps `peer`'s segment after its endpoint `ep` opened, and tells it so; a segment that is
/// not there to map (another host's, or gone) leaves that peer's payloads on UCX's own path.
pub(super) unsafe fn attach(
    state: *mut State,
    ep: sys::ucp_ep_h,
    me: u32,
    peer: u32,
    d: &Descriptor,
) {
    match Segment::attach(d) {
        Ok(segment) => {
            super::lock_pids(&(*state).pids).insert(peer, segment.creator_pid());
            (*state).peer_rings.insert(peer, Arc::new(segment));
            let nonce = d.nonce.to_vec();
            send(state, ep, me, ATTACHED_ID, nonce, Bytes::new(), None);
        }
        Err(e) => tracing::debug!("ucx: rank {peer}'s staged payloads go through UCX: {e}"),
    }
}

/// What a notice says of a slot.
pub(super) struct Notice {
    pub slot: usize,
    pub generation: u64,
    pub len: usize,
}

/// Sends each of `to` the notice `n` of the slot holding the frame whose header is `header`.
/// A notice that cannot go frees that peer's hold on the slot.
pub(super) unsafe fn send_notices(
    state: *mut State,
    eps: &HashMap<u32, (sys::ucp_ep_h, *mut EpArg)>,
    me: u32,
    to: &[u32],
    n: Notice,
    header: &[u8],
) {
    for &peer in to {
        let mut h = Vec::with_capacity(NOTICE_BYTES + header.len());
        h.extend_from_slice(&(n.slot as u32).to_le_bytes());
        h.extend_from_slice(&n.generation.to_le_bytes());
        h.extend_from_slice(&(n.len as u64).to_le_bytes());
        h.extend_from_slice(header);
        let staged = Some((n.slot, n.generation, peer));
        match eps.get(&peer) {
            Some(&(ep, _)) => send(state, ep, me, NOTICE_ID, h, Bytes::new(), staged),
            None => {
                (*state).count(|c| c.failed += 1);
                notice_failed(&*state, staged);
            }
        }
    }
}

/// A notice failed: its peer will not free the slot.
pub(super) fn notice_failed(st: &State, staged: Option<(usize, u64, u32)>) {
    if let (Some((slot, generation, peer)), Some(ring)) = (staged, &st.ring) {
        ring.update(|s| s.release(slot, generation, peer));
    }
}

/// Tells the senders which of their slots were copied out.
pub(super) unsafe fn send_frees(
    state: *mut State,
    eps: &HashMap<u32, (sys::ucp_ep_h, *mut EpArg)>,
    me: u32,
) {
    for (peer, slot, generation) in std::mem::take(&mut (*state).to_free) {
        // A peer without an endpoint any more has lost its slots' holders already.
        if let Some(&(ep, _)) = eps.get(&peer) {
            let mut h = Vec::with_capacity(FREED_BYTES);
            h.extend_from_slice(&(slot as u32).to_le_bytes());
            h.extend_from_slice(&generation.to_le_bytes());
            send(state, ep, me, FREED_ID, h, Bytes::new(), None);
        }
    }
}

/// Where a staged payload goes: whose it is, its frame header, and the loan it fills (batch,
/// address) if any.
pub(super) struct RecvAt {
    pub from: u32,
    pub header: Vec<u8>,
    pub loan: Option<LoanAt>,
}

/// Copies a `len`-byte payload out of slot (`segment`, index, generation) into the loan (or
/// adds it there) or into a pooled buffer, checksumming it as it goes, and queues the slot's
/// "freed".
pub(super) unsafe fn copy_out(
    state: *mut State,
    at: RecvAt,
    (segment, slot, generation): (&Segment, usize, u64),
    len: usize,
) {
    let st = &mut *state;
    let mut buf = Vec::new();
    // The notice's length was checked against the slot's size when it arrived.
    let src = segment.slot(slot);
    let crc = match at.loan {
        Some(LoanAt { at, add, .. }) => {
            st.count(|c| c.lent += 1);
            match add {
                None => copy_summed(src, at as *mut u8, len),
                Some(add) => {
                    st.count(|c| c.added += 1);
                    // Each block is taken out of the mapping before it is summed and added,
                    // so what is added is what was checked.
                    let dst = std::slice::from_raw_parts_mut(at as *mut u8, len);
                    let mut block = vec![0u8; COPY_BLOCK_BYTES.min(len)];
                    let mut sum = crc32fast::Hasher::new();
                    for (k, d) in dst.chunks_mut(COPY_BLOCK_BYTES).enumerate() {
                        let b = &mut block[..d.len()];
                        let from = src.add(k * COPY_BLOCK_BYTES);
                        std::ptr::copy_nonoverlapping(from, b.as_mut_ptr(), b.len());
                        sum.update(b);
                        add(d, b);
                    }
                    sum.finalize()
                }
            }
        }
        None => {
            buf = st.pool.take(len);
            copy_summed(src, buf.as_mut_ptr(), len)
        }
    };
    st.to_free.push((at.from, slot, generation));
    st.count(|c| c.staged += 1);
    let op = RecvOp {
        from: at.from,
        header: at.header,
        buf,
        len,
        loan: at.loan,
        state,
        crc: Some(crc),
    };
    finish_recv(st, op, sys::UCS_OK);
}

/// Adds `src` into `dst` (the same length) with `add` a block at a time, taking the CRC-32 of
/// each block of `src` while it is in cache.
pub(super) fn add_summed(add: AddFn, dst: &mut [u8], src: &[u8]) -> u32 {
    let mut sum = crc32fast::Hasher::new();
    for (d, s) in dst
        .chunks_mut(COPY_BLOCK_BYTES)
        .zip(src.chunks(COPY_BLOCK_BYTES))
    {
        sum.update(s);
        add(d, s);
    }
    sum.finalize()
}

/// Copies `len` bytes from `src` to `dst` a block at a time, taking the CRC-32 of each block
/// while it is in cache.
///
/// # Safety
/// `src` and `dst` hold `len` bytes each and do not overlap; nobody else writes `dst`.
unsafe fn copy_summed(src: *const u8, dst: *mut u8, len: usize) -> u32 {
    let mut h = crc32fast::Hasher::new();
    let mut at = 0;
    while at < len {
        let n = COPY_BLOCK_BYTES.min(len - at);
        // Raw copies: the sender's process may (wrongly) write its slot meanwhile; what we
        // read is then checked by the CRC, never trusted.
        std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n);
        h.update(std::slice::from_raw_parts(dst.add(at), n));
        at += n;
    }
    h.finalize()
}
