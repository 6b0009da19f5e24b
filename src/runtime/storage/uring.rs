//! The real device: one file, one io_uring, one dedicated OS thread.
//!
//! The thread owns the ring; callers hand it requests through a bounded channel and get each
//! buffer back on the request's own completion channel. A request is cut into blocks of
//! `block_bytes` and at most `queue_depth` blocks are in flight, so a 100 MB record and a 4 KiB
//! one both stream at the disk's rate without a per-tensor buffer limit. The file is opened with
//! O_DIRECT unless buffered I/O was asked for, so offload traffic neither fills the page cache
//! nor counts against the process's memory cgroup.
//!
//! The owner's staging buffers are registered with the ring (`IORING_REGISTER_BUFFERS`) when
//! the kernel allows it, and requests on them use the fixed-buffer reads and writes: the pages
//! are pinned once, not on every request. Registration counts against `RLIMIT_MEMLOCK` for a
//! process without `CAP_IPC_LOCK`; when the kernel refuses, the buffers work unregistered.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;

use io_uring::{opcode, types, IoUring};

use super::aligned::AlignedBuf;
use super::device::{Device, IoDone, IoError, IoRequest, Op};

/// How the device talks to the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringConfig {
    /// Blocks in flight at once.
    pub queue_depth: u32,
    /// Bytes per block (a multiple of 4096).
    pub block_bytes: usize,
    /// O_DIRECT (the default) or buffered I/O (only when asked for).
    pub direct: bool,
}

/// Requests accepted but not yet finished, beyond which `submit` waits.
const MAX_ACTIVE_REQUESTS: usize = 64;

/// Ring ids, so that a buffer names the ring it is registered with.
static RING_SEQ: AtomicU64 = AtomicU64::new(1);
/// `IORING_REGISTER_BUFFERS`.
const REGISTER_BUFFERS: libc::c_uint = 0;

pub struct UringDevice {
    tx: Option<SyncSender<IoRequest>>,
    thread: Option<JoinHandle<()>>,
    file: Arc<File>,
    ring_id: u64,
    /// The ring's fd, for registration (the I/O thread owns the ring; it lives until `drop`
    /// joins that thread).
    ring_fd: i32,
    registered: bool,
    /// Blocks moved through registered buffers.
    fixed_blocks: Arc<AtomicU64>,
}

impl UringDevice {
    /// Opens (creating if needed) `path` and starts the I/O thread.
    pub fn open(path: &Path, cfg: UringConfig) -> Result<Self, IoError> {
        let mut opts = OpenOptions::new();
        opts.read(true).write(true).create(true).truncate(false);
        if cfg.direct {
            opts.custom_flags(libc::O_DIRECT);
        }
        let file = Arc::new(
            opts.open(path)
                .map_err(|e| IoError::Os(format!("opening {}: {e}", path.display())))?,
        );
        let ring = IoUring::new(cfg.queue_depth.max(1).next_power_of_two())
            .map_err(|e| IoError::Os(format!("io_uring_setup: {e}")))?;
        let (tx, rx) = sync_channel(MAX_ACTIVE_REQUESTS);
        let fd = file.as_raw_fd();
        let ring_id = RING_SEQ.fetch_add(1, Ordering::Relaxed);
        let ring_fd = ring.as_raw_fd();
        let fixed_blocks: Arc<AtomicU64> = Arc::default();
        let counted = Arc::clone(&fixed_blocks);
        let thread = std::thread::Builder::new()
            .name("ezero-io".into())
            .spawn(move || io_thread(ring, fd, cfg, (ring_id, &counted), rx))
            .map_err(|e| IoError::Os(format!("spawning the I/O thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            file,
            ring_id,
            ring_fd,
            registered: false,
            fixed_blocks,
        })
    }

    /// Blocks read or written through registered buffers so far.
    pub fn fixed_blocks(&self) -> u64 {
        self.fixed_blocks.load(Ordering::Relaxed)
    }
}

impl Device for UringDevice {
    fn submit(&mut self, req: IoRequest) -> Result<(), IoError> {
        self.tx
            .as_ref()
            .ok_or(IoError::Stopped)?
            .send(req)
            .map_err(|_| IoError::Stopped)
    }

    fn reserve(&mut self, bytes: u64) -> Result<(), IoError> {
        let fd = self.file.as_raw_fd();
        // SAFETY: plain syscall on an fd we own.
        let r = unsafe { libc::fallocate(fd, 0, 0, bytes as libc::off_t) };
        if r == 0 {
            return Ok(());
        }
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        if errno == libc::EOPNOTSUPP {
            // No preallocation on this file system: size the file; space is taken on write.
            return self
                .file
                .set_len(bytes)
                .map_err(|e| IoError::from_errno(e.raw_os_error().unwrap_or(libc::EIO)));
        }
        Err(IoError::from_errno(errno))
    }

    fn register(&mut self, bufs: &mut [AlignedBuf]) -> usize {
        // A ring takes one set; and an index is 16 bits.
        if self.registered || bufs.is_empty() || bufs.len() > u16::MAX as usize {
            return 0;
        }
        let iovecs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: the iovecs describe live buffers; the kernel pins their pages and keeps them
        // until the ring is closed, whatever becomes of the buffers (an index is used only
        // through the buffer that carries it, see `AlignedBuf::fixed_in`). No request is in
        // flight: the owner registers before its first.
        let r = unsafe {
            libc::syscall(
                libc::SYS_io_uring_register,
                self.ring_fd,
                REGISTER_BUFFERS,
                iovecs.as_ptr(),
                iovecs.len() as libc::c_uint,
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            tracing::debug!(
                "io_uring buffer registration refused ({e}); buffers stay unregistered"
            );
            return 0;
        }
        self.registered = true;
        for (i, b) in bufs.iter_mut().enumerate() {
            b.mark_fixed(self.ring_id, i as u16);
        }
        bufs.len()
    }
}

impl Drop for UringDevice {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Active {
    req: IoRequest,
    /// Bytes handed to the ring so far.
    sent: usize,
    /// Blocks in flight.
    outstanding: usize,
    failed: Option<IoError>,
}

fn io_thread(
    ring: IoUring,
    fd: i32,
    cfg: UringConfig,
    (ring_id, fixed_blocks): (u64, &AtomicU64),
    rx: Receiver<IoRequest>,
) {
    let mut io = IoLoop {
        ring,
        fd,
        ring_id,
        fixed_blocks,
        block: cfg.block_bytes.max(4096),
        depth: cfg.queue_depth.max(1) as usize,
        active: HashMap::new(),
        order: VecDeque::new(),
        next_id: 0,
        in_flight: 0,
    };
    let mut open = true;
    loop {
        if open {
            open = io.take_requests(&rx);
        }
        if !open && io.active.is_empty() {
            return;
        }
        io.fill_queue();
        if io.in_flight == 0 {
            finish_ready(&mut io.active, &mut io.order);
            continue;
        }
        if let Err(e) = io.ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // The ring itself failed: fail everything in flight and stop.
            io.fail_all(&e);
            return;
        }
        io.reap();
        finish_ready(&mut io.active, &mut io.order);
    }
}

/// The I/O thread's state: its ring, and the requests accepted and not yet handed back.
struct IoLoop<'a> {
    ring: IoUring,
    fd: i32,
    ring_id: u64,
    fixed_blocks: &'a AtomicU64,
    block: usize,
    depth: usize,
    active: HashMap<u64, Active>,
    order: VecDeque<u64>,
    next_id: u64,
    /// Blocks handed to the ring and not yet completed.
    in_flight: usize,
}

impl IoLoop<'_> {
    /// Takes new requests, blocking only when there is nothing else to do; `false` once the
    /// owner has hung up.
    fn take_requests(&mut self, rx: &Receiver<IoRequest>) -> bool {
        while self.active.len() < MAX_ACTIVE_REQUESTS {
            let got = if self.active.is_empty() {
                rx.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                rx.try_recv()
            };
            match got {
                Ok(req) => {
                    self.next_id += 1;
                    self.order.push_back(self.next_id);
                    self.active.insert(
                        self.next_id,
                        Active {
                            req,
                            sent: 0,
                            outstanding: 0,
                            failed: None,
                        },
                    );
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
        true
    }

    /// Fills the queue with blocks, oldest request first.
    fn fill_queue(&mut self) {
        while self.in_flight < self.depth {
            let Some(&id) = self.order.iter().find(|id| {
                let a = &self.active[id];
                a.sent < a.req.len && a.failed.is_none()
            }) else {
                break;
            };
            let a = self.active.get_mut(&id).expect("listed");
            let len = self.block.min(a.req.len - a.sent);
            let offset = a.req.offset + a.sent as u64;
            // SAFETY of the pointers: the buffer stays in `active` (not moved or dropped) until
            // every block of it has completed.
            let fixed = a.req.buf.fixed_in(self.ring_id);
            let at = unsafe { a.req.buf.as_mut_ptr().add(a.sent) };
            let (file, n) = (types::Fd(self.fd), len as u32);
            let entry = match (a.req.op, fixed) {
                (Op::Read, None) => opcode::Read::new(file, at, n).offset(offset).build(),
                (Op::Write, None) => opcode::Write::new(file, at, n).offset(offset).build(),
                // A block anywhere inside the registered buffer, by its index.
                (Op::Read, Some(i)) => opcode::ReadFixed::new(file, at, n, i)
                    .offset(offset)
                    .build(),
                (Op::Write, Some(i)) => opcode::WriteFixed::new(file, at, n, i)
                    .offset(offset)
                    .build(),
            }
            .user_data((id << 24) | (len as u64 >> 12));
            // SAFETY: the entry's buffer outlives the operation (see above).
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                break;
            }
            a.sent += len;
            a.outstanding += 1;
            self.in_flight += 1;
            if fixed.is_some() {
                self.fixed_blocks.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Records the completed blocks: a request fails at its first error or short transfer.
    fn reap(&mut self) {
        let done: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (data, res) in done {
            self.in_flight -= 1;
            let id = data >> 24;
            let want = ((data & 0xff_ffff) << 12) as usize;
            let a = self
                .active
                .get_mut(&id)
                .expect("completion of a known request");
            a.outstanding -= 1;
            if a.failed.is_none() {
                if res < 0 {
                    a.failed = Some(IoError::from_errno(-res));
                } else if (res as usize) < want {
                    a.failed = Some(IoError::Short {
                        op: a.req.op,
                        offset: a.req.offset,
                        want: a.req.len,
                        done: a.sent - want + res as usize,
                    });
                }
            }
        }
    }

    /// Hands every request back failed, with the ring's error where it had none of its own.
    fn fail_all(&mut self, e: &std::io::Error) {
        for (_, mut a) in self.active.drain() {
            a.failed
                .get_or_insert(IoError::Os(format!("io_uring_enter: {e}")));
            let _ = a.req.done.send(IoDone {
                buf: a.req.buf,
                result: Err(a.failed.expect("set")),
            });
        }
    }
}

/// Hands back every request whose blocks have all completed (or that failed and has nothing
/// in flight).
fn finish_ready(active: &mut HashMap<u64, Active>, order: &mut VecDeque<u64>) {
    order.retain(|id| {
        let a = &active[id];
        let complete = a.outstanding == 0 && (a.sent == a.req.len || a.failed.is_some());
        if complete {
            let a = active.remove(id).expect("listed");
            let _ = a.req.done.send(IoDone {
                buf: a.req.buf,
                result: a.failed.map_or(Ok(()), Err),
            });
        }
        !complete
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::storage::device::submit;

    /// A scratch folder with direct I/O: the temporary directory, or the target directory
    /// where that is RAM (tmpfs has no O_DIRECT).
    fn disk_dir() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let probe = t.path().join("probe");
        File::create(&probe).unwrap();
        if crate::runtime::storage::preflight::direct_write(&probe).is_ok() {
            return t;
        }
        tempfile::tempdir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/target")).unwrap()
    }

    fn device(dir: &Path) -> UringDevice {
        let cfg = UringConfig {
            queue_depth: 4,
            block_bytes: 8192,
            direct: true,
        };
        let mut dev = UringDevice::open(&dir.join("t.bin"), cfg).unwrap();
        dev.reserve(1 << 20).unwrap();
        dev
    }

    fn round_trip(dev: &mut UringDevice, out: AlignedBuf, back: AlignedBuf, at: u64) {
        let len = out.len();
        let w = submit(dev, Op::Write, at, len, out).unwrap().wait();
        w.result.unwrap();
        let r = submit(dev, Op::Read, at, len, back).unwrap().wait();
        r.result.unwrap();
        assert_eq!(r.buf.bytes(), w.buf.bytes(), "read back at {at}");
    }

    fn pattern(len: usize, seed: u8) -> AlignedBuf {
        let mut b = AlignedBuf::new(len);
        for (i, x) in b.bytes_mut().iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        b
    }

    /// Registered staging buffers move through the fixed-buffer operations, block by block;
    /// a buffer registered with another ring, or never, goes the ordinary way.
    #[test]
    fn registered_buffers_use_fixed_operations_and_others_still_work() {
        let dir = disk_dir();
        let mut dev = device(dir.path());
        let mut bufs = vec![pattern(24 << 10, 1), AlignedBuf::new(24 << 10)];
        assert_eq!(
            dev.register(&mut bufs),
            2,
            "two small buffers fit any memlock limit"
        );
        assert_eq!(dev.register(&mut bufs), 0, "a ring takes one set");
        let (back, out) = (bufs.pop().unwrap(), bufs.pop().unwrap());
        round_trip(&mut dev, out, back, 4096);
        // 24 KiB in 8 KiB blocks, written then read.
        assert_eq!(dev.fixed_blocks(), 6);
        // Unregistered, and registered with another ring: ordinary reads and writes.
        let other_dir = disk_dir();
        let mut other = device(other_dir.path());
        let mut theirs = vec![pattern(8192, 7)];
        assert_eq!(other.register(&mut theirs), 1);
        round_trip(
            &mut dev,
            theirs.pop().unwrap(),
            AlignedBuf::new(8192),
            65536,
        );
        round_trip(&mut dev, pattern(16384, 9), AlignedBuf::new(16384), 131072);
        assert_eq!(dev.fixed_blocks(), 6);
        assert_eq!(other.fixed_blocks(), 0);
    }
}
