//! The shared-memory segment a process stages its outgoing payloads in (`ring`), and the
//! read-only mappings of its peers' segments.
//!
//! SysV, not POSIX: the creator marks the segment for removal right after attaching it, and
//! Linux still lets peers attach a marked segment by id, so the kernel frees it once the last
//! process detaches, a kill -9 included; nothing is left in `/dev/shm`. The segment is the
//! creating user's only (mode 0600), and a peer checks the owner and a random nonce written at
//! its start before using it: a descriptor from another host (over `--ucx-net`) names some
//! other segment here, or none, and is not used.
//!
//! The descriptor travels inside the engine's address, over the mutual-TLS control plane.

use std::io;

/// Bytes before the first slot: the magic and nonce, padded to a page.
pub const HEAD_BYTES: usize = 4096;
const MAGIC: [u8; 8] = *b"ezstage1";
/// A descriptor's encoded length.
pub const DESCRIPTOR_BYTES: usize = 8 + 4 + 4 + 4 + 16;

/// What a peer needs to map a segment: its id, its layout, and the nonce at its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub shmid: i32,
    pub slots: u32,
    pub slot_bytes: u32,
    pub nonce: [u8; 16],
}

impl Descriptor {
    /// The segment's length.
    pub fn bytes(&self) -> usize {
        HEAD_BYTES + self.slots as usize * self.slot_bytes as usize
    }

    pub fn encode(&self) -> [u8; DESCRIPTOR_BYTES] {
        let mut out = [0u8; DESCRIPTOR_BYTES];
        out[..8].copy_from_slice(&MAGIC);
        out[8..12].copy_from_slice(&self.shmid.to_le_bytes());
        out[12..16].copy_from_slice(&self.slots.to_le_bytes());
        out[16..20].copy_from_slice(&self.slot_bytes.to_le_bytes());
        out[20..].copy_from_slice(&self.nonce);
        out
    }

    /// Decodes a descriptor; `max_bytes` bounds the segment a peer may ask us to map.
    pub fn decode(b: &[u8], max_bytes: usize) -> Result<Self, String> {
        if b.len() != DESCRIPTOR_BYTES || b[..8] != MAGIC {
            return Err(format!(
                "a staging descriptor of {} bytes without its magic",
                b.len()
            ));
        }
        let word = |at: usize| [b[at], b[at + 1], b[at + 2], b[at + 3]];
        let d = Self {
            shmid: i32::from_le_bytes(word(8)),
            slots: u32::from_le_bytes(word(12)),
            slot_bytes: u32::from_le_bytes(word(16)),
            nonce: b[20..].try_into().expect("length checked"),
        };
        if d.slots == 0 || d.slot_bytes == 0 || d.slots > 1024 || d.bytes() > max_bytes {
            return Err(format!(
                "a staging segment of {} slots of {} bytes (at most {max_bytes} bytes in all)",
                d.slots, d.slot_bytes
            ));
        }
        Ok(d)
    }
}

/// An attached segment: this process's own (read and write) or a peer's (read only).
#[derive(Debug)]
pub struct Segment {
    base: *mut u8,
    desc: Descriptor,
    /// The process that made it (a peer's: as the kernel recorded it), 0 for our own.
    creator_pid: i32,
}

// SAFETY: the mapping is process-wide memory; who writes which slot when is ordered by the
// ring's bookkeeping (own segment) or by the peer's notices (a peer's).
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates, attaches and marks for removal a segment of `slots` slots of `slot_bytes`.
    pub fn create(slots: u32, slot_bytes: u32) -> io::Result<Self> {
        let mut nonce = [0u8; 16];
        // SAFETY: getrandom writes at most `nonce.len()` bytes into it.
        let got = unsafe { libc::getrandom(nonce.as_mut_ptr().cast(), nonce.len(), 0) };
        if got != nonce.len() as isize {
            return Err(io::Error::last_os_error());
        }
        let mut desc = Descriptor {
            shmid: -1,
            slots,
            slot_bytes,
            nonce,
        };
        // SAFETY: plain SysV calls; the id is ours until marked, and the mapping is checked.
        unsafe {
            let id = libc::shmget(libc::IPC_PRIVATE, desc.bytes(), libc::IPC_CREAT | 0o600);
            if id < 0 {
                return Err(io::Error::last_os_error());
            }
            let base = libc::shmat(id, std::ptr::null(), 0);
            // Marked at once, attached or not: the kernel frees it with its last user.
            libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut());
            if base as isize == -1 {
                return Err(io::Error::last_os_error());
            }
            desc.shmid = id;
            let base = base as *mut u8;
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), base, 8);
            std::ptr::copy_nonoverlapping(nonce.as_ptr(), base.add(8), 16);
            Ok(Self {
                base,
                desc,
                creator_pid: 0,
            })
        }
    }

    /// Attaches a peer's segment read-only, if it is the one `desc` describes: owned by this
    /// user, large enough, and holding the nonce.
    pub fn attach(desc: &Descriptor) -> Result<Self, String> {
        // SAFETY: IPC_STAT fills the zeroed struct; shmat maps read-only what the checks allow.
        unsafe {
            let mut ds: libc::shmid_ds = std::mem::zeroed();
            if libc::shmctl(desc.shmid, libc::IPC_STAT, &mut ds) != 0 {
                return Err(format!(
                    "segment {}: {}",
                    desc.shmid,
                    io::Error::last_os_error()
                ));
            }
            if ds.shm_perm.uid != libc::geteuid() || ds.shm_segsz < desc.bytes() {
                return Err(format!(
                    "segment {} is another user's or smaller than described",
                    desc.shmid
                ));
            }
            let base = libc::shmat(desc.shmid, std::ptr::null(), libc::SHM_RDONLY);
            if base as isize == -1 {
                return Err(format!(
                    "attaching segment {}: {}",
                    desc.shmid,
                    io::Error::last_os_error()
                ));
            }
            let seg = Self {
                base: base as *mut u8,
                desc: *desc,
                creator_pid: ds.shm_cpid,
            };
            let head = std::slice::from_raw_parts(seg.base, 24);
            if head[..8] != MAGIC || head[8..24] != desc.nonce {
                return Err(format!(
                    "segment {} is not the peer's (its nonce differs)",
                    desc.shmid
                ));
            }
            Ok(seg)
        }
    }

    pub fn descriptor(&self) -> &Descriptor {
        &self.desc
    }

    /// The process that made an attached peer's segment, as the kernel recorded it: the
    /// process a pull from that peer reads (`UcxPlane::peer_memory`). The nonce check tied the
    /// segment to the address that came over the authenticated control plane.
    pub fn creator_pid(&self) -> i32 {
        self.creator_pid
    }

    /// The start of slot `i` (`i` below the slot count).
    pub fn slot(&self, i: usize) -> *mut u8 {
        assert!(i < self.desc.slots as usize, "slot {i} is in the segment");
        // SAFETY: inside the mapping, by the assertion.
        unsafe {
            self.base
                .add(HEAD_BYTES + i * self.desc.slot_bytes as usize)
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: attached by `create` or `attach`, detached once.
        unsafe { libc::shmdt(self.base as *const libc::c_void) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_maps_the_segment_it_is_described_and_refuses_others() {
        let own = Segment::create(2, 1 << 16).unwrap();
        // SAFETY: the slot is this test's, 64 KiB long.
        unsafe { std::ptr::write_bytes(own.slot(1), 0xab, 1 << 16) };
        let d = *own.descriptor();
        let bytes = d.encode();
        assert_eq!(Descriptor::decode(&bytes, 1 << 20).unwrap(), d);
        let peer = Segment::attach(&d).unwrap();
        // SAFETY: the slot lies in the read-only mapping.
        let seen = unsafe { std::slice::from_raw_parts(peer.slot(1), 1 << 16) };
        assert!(seen.iter().all(|&b| b == 0xab));
        // The same id with another nonce (a descriptor from another host, or a stale one).
        let other = Descriptor {
            nonce: [7; 16],
            ..d
        };
        assert!(Segment::attach(&other).unwrap_err().contains("nonce"));
        // Larger than the segment is.
        let larger = Descriptor { slots: 3, ..d };
        assert!(Segment::attach(&larger).unwrap_err().contains("smaller"));
        // Malformed or over the bound.
        assert!(Descriptor::decode(&bytes[1..], 1 << 20).is_err());
        assert!(Descriptor::decode(&bytes, 1 << 16)
            .unwrap_err()
            .contains("at most"));
        let mut zero = bytes;
        zero[12..16].copy_from_slice(&0u32.to_le_bytes());
        assert!(Descriptor::decode(&zero, 1 << 20).is_err());
        // Gone with its last user: once both detach, the id names nothing.
        drop((own, peer));
        assert!(Segment::attach(&d).is_err());
    }
}
