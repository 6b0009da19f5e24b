//! The optional capability of a transport that shares memory with its peers (UCX on one host,
//! and the UCX half of the mixed plane): sends whose payload is written straight into memory
//! the receiver reads, sends that reuse a checksum the sender already took, loans of the
//! receiver's own memory for payloads to land in, and reads of a peer's memory (pulls).
//!
//! A transport offers it through
//! [`Transport::shared_memory`](super::Transport::shared_memory); `step::comm::Comm` asks for
//! it in one place and, where it is absent, sends and receives every payload as a frame. Nothing
//! a collective computes depends on which way a byte travelled: the capability only saves
//! copies and passes over memory.
//!
//! # The unsafe surface: loans
//!
//! [`SharedMemory::lend`] is the one unsafe method; every rule about lent memory is here, and
//! the `# Safety` sections of the callers (`Comm::lent`, `Comm::recv_all_lent`, `place_later`)
//! and of the UCX implementation point to this section.
//!
//! - **What is borrowed**: the `len` bytes at `at` a rank lends for one expected payload (one
//!   piece of a frame, named by sender, (epoch, step) and tag, and of exactly that length).
//!   The transport may write them (or add into them, with an [`AddFn`]) from its own thread at
//!   any moment while the loan is open.
//! - **For how long**: from `lend` until [`SharedMemory::end_loans`] returns. `end_loans`
//!   withdraws every loan not matched yet and waits for the matched ones to be written and
//!   checked; a transport that cannot get that far (its engine stuck past a bound) stops the
//!   process rather than return while it may still write. The memory must stay valid (not
//!   freed, moved or reallocated) for that whole time, and a panic in between must not hand it
//!   back either: `Comm::lent` aborts the process on an unwind.
//! - **Who may touch it**: nobody but the transport while a loan is open, not even to read.
//!   The one exception is a piece whose frame already arrived as placed
//!   ([`SharedMemory::was_placed`]): a loan is matched once, so the transport is done with that
//!   piece's memory. A piece that arrived with its payload instead (it came before its loan,
//!   or the loan was refused) is kept aside and copied in only after `end_loans`, because the
//!   transport may still be writing its neighbours.
//! - **Why a landed payload is trusted**: the transport checks it where it landed exactly as it
//!   checks a frame (header, length, CRC-32) before it reports it placed; a payload that fails
//!   is counted and never reported placed, so the rank times out as for a lost frame. With an
//!   [`AddFn`] the payload is summed while it is added, so a damaged one has been added by the
//!   time it fails: the collective then fails too, and its memory holds an unspecified mix, as
//!   after any failed collective. Loans of the same memory are added in the order their frames
//!   arrive, so the addition must not depend on that order.
//!
//! # Pulls
//!
//! [`SharedMemory::peer_memory`] reads a peer's memory with one copy made by the kernel, at an
//! address the peer named in a frame of this step. The peer keeps that memory unchanged until
//! it hears that the reader is done, but a peer that gave up early (its deadline, a member
//! gone) may free or reuse it while the read runs, and the kernel copies whatever is there:
//! what was read is never trusted until it matches the checksums the peer sent with the
//! address. Reading is safe Rust: the kernel checks the address against the peer's mappings
//! and fails the read rather than fault. A transport lets a rank read only processes on its
//! host whose identity it verified (the trust shared memory already assumes).

use std::sync::Arc;

use super::{Frame, Tag, TransportError};
use crate::plan::RankId;

/// Adds encoded values `src` into `dst` (the same length): how a payload lent memory to be
/// added into meets it ([`SharedMemory::lend`]).
pub type AddFn = fn(&mut [u8], &[u8]);

/// What a transport that shares memory with its peers can do beyond
/// [`Transport`](super::Transport) (see the module docs for the rules of lent memory and pulled
/// bytes).
pub trait SharedMemory {
    /// [`Transport::send_to_each`](super::Transport::send_to_each) of a frame whose payload's
    /// CRC-32 ([`crate::wire::crc32_of`]) the sender computed while it wrote the payload: the
    /// transport combines it with its header's instead of reading the payload again. It must
    /// be the payload's. A caller with this capability takes the checksum as it writes.
    fn send_to_each_summed(
        &self,
        to: &[RankId],
        frame: Frame,
        payload_crc: u32,
    ) -> Result<(), TransportError>;

    /// Sends `frame` (its own payload ignored) to each of `to` with a `len`-byte payload that
    /// `fill` writes straight into memory the receivers read it from (a shared-memory slot),
    /// returning the payload's CRC-32 ([`crate::wire::crc32_of`]); `fill` writes all `len`
    /// bytes. `Ok(false)`: no such memory for these receivers now, and nothing was written or
    /// sent: send the frame another way.
    fn send_to_each_staged(
        &self,
        to: &[RankId],
        frame: &Frame,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> u32,
    ) -> Result<bool, TransportError>;

    /// Lends `len` bytes at `at` for the payload of the frame `from` sends at (epoch, step)
    /// with `tag`, if it has exactly that length: the payload lands there without a copy, is
    /// checked there, and its frame arrives with an empty payload that
    /// [`SharedMemory::was_placed`] recognises. With `add`, the payload is added into the
    /// memory (`add(dst, src)` over consecutive parts of it) instead of written there. `false`:
    /// not lent (too small to be worth it, a peer not reached through shared memory, too many
    /// loans open), and the frame comes with its payload as usual.
    ///
    /// # Safety
    /// The memory is borrowed as the module docs' *loans* section says: valid and touched by
    /// nobody else until [`SharedMemory::end_loans`] returns (a placed piece excepted).
    unsafe fn lend(
        &self,
        from: RankId,
        at_step: (u64, u64),
        tag: Tag,
        memory: (*mut u8, usize),
        add: Option<AddFn>,
    ) -> bool;

    /// Ends every loan: once it returns, the transport no longer touches lent memory.
    fn end_loans(&self);

    /// The rank, its loans still open, is about to wait for a frame it lent nothing for: a
    /// transport that keeps unmatched payloads back while loans are open (for loans still to
    /// come) must deliver them from now on, or that wait lasts until its deadline.
    fn fetch_unlent(&self);

    /// Whether `frame` is the notice that its payload landed in lent memory and passed every
    /// check there, rather than a frame carrying its payload (true once per frame).
    fn was_placed(&self, frame: &Frame) -> bool;

    /// Whether [`SharedMemory::peer_memory`] can read `from`'s memory: a process on this host
    /// whose identity the transport verified. Collectives choose their path by it on both
    /// sides of a pair, so a transport answers it alike on both (once either says yes, the
    /// other does too, waiting a bounded time if it must).
    fn can_pull(&self, from: RankId) -> bool;

    /// `from`'s memory, to read from any thread ([`SharedMemory::can_pull`]); an error for a
    /// peer it cannot read.
    fn peer_memory(&self, from: RankId) -> Result<Arc<dyn PeerMemory>, TransportError>;
}

/// A peer's memory that this process can read ([`SharedMemory::peer_memory`]); `Send` and
/// `Sync` so that a collective can read one peer from two threads.
pub trait PeerMemory: Send + Sync {
    /// Copies `dst.len()` bytes at address `at` of the peer's memory into `dst`, in one copy
    /// made by the kernel. What was read is not trusted: the caller checks it against the
    /// checksum the peer sent (the module docs' *pulls* section says why).
    fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), TransportError>;
}
