//! The real device: one file, one io_uring, one dedicated OS thread.
//!
//! The thread owns the ring; callers hand it requests through a bounded channel and get each
//! buffer back on the request's own completion channel. A request is cut into blocks of
//! `block_bytes` and at most `queue_depth` blocks are in flight, so a 100 MB record and a 4 KiB
//! one both stream at the disk's rate without a per-tensor buffer limit. The file is opened with
//! O_DIRECT unless buffered I/O was asked for, so offload traffic neither fills the page cache
//! nor counts against the process's memory cgroup.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;

use io_uring::{opcode, types, IoUring};

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

pub struct UringDevice {
    tx: Option<SyncSender<IoRequest>>,
    thread: Option<JoinHandle<()>>,
    file: Arc<File>,
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
        let thread = std::thread::Builder::new()
            .name("ezero-io".into())
            .spawn(move || io_thread(ring, fd, cfg, rx))
            .map_err(|e| IoError::Os(format!("spawning the I/O thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            file,
        })
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

fn io_thread(mut ring: IoUring, fd: i32, cfg: UringConfig, rx: Receiver<IoRequest>) {
    let block = cfg.block_bytes.max(4096);
    let depth = cfg.queue_depth.max(1) as usize;
    let mut active: HashMap<u64, Active> = HashMap::new();
    let mut order: VecDeque<u64> = VecDeque::new();
    let mut next_id: u64 = 0;
    let mut in_flight = 0usize;
    let mut open = true;
    loop {
        // Take new requests: block only when there is nothing else to do.
        while open && active.len() < MAX_ACTIVE_REQUESTS {
            let got = if active.is_empty() {
                rx.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                rx.try_recv()
            };
            match got {
                Ok(req) => {
                    next_id += 1;
                    order.push_back(next_id);
                    active.insert(
                        next_id,
                        Active {
                            req,
                            sent: 0,
                            outstanding: 0,
                            failed: None,
                        },
                    );
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        if !open && active.is_empty() {
            return;
        }
        // Fill the queue, oldest request first.
        while in_flight < depth {
            let Some(&id) = order.iter().find(|id| {
                let a = &active[id];
                a.sent < a.req.len && a.failed.is_none()
            }) else {
                break;
            };
            let a = active.get_mut(&id).expect("listed");
            let len = block.min(a.req.len - a.sent);
            let offset = a.req.offset + a.sent as u64;
            // SAFETY of the pointers: the buffer stays in `active` (not moved or dropped) until
            // every block of it has completed.
            let entry = match a.req.op {
                Op::Read => opcode::Read::new(
                    types::Fd(fd),
                    unsafe { a.req.buf.as_mut_ptr().add(a.sent) },
                    len as u32,
                )
                .offset(offset)
                .build(),
                Op::Write => opcode::Write::new(
                    types::Fd(fd),
                    unsafe { a.req.buf.as_ptr().add(a.sent) },
                    len as u32,
                )
                .offset(offset)
                .build(),
            }
            .user_data((id << 24) | (len as u64 >> 12));
            // SAFETY: the entry's buffer outlives the operation (see above).
            if unsafe { ring.submission().push(&entry) }.is_err() {
                break;
            }
            a.sent += len;
            a.outstanding += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            finish_ready(&mut active, &mut order);
            continue;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // The ring itself failed: fail everything in flight and stop.
            for (_, mut a) in active.drain() {
                a.failed
                    .get_or_insert(IoError::Os(format!("io_uring_enter: {e}")));
                let _ = a.req.done.send(IoDone {
                    buf: a.req.buf,
                    result: Err(a.failed.expect("set")),
                });
            }
            return;
        }
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (data, res) in done {
            in_flight -= 1;
            let id = data >> 24;
            let want = ((data & 0xff_ffff) << 12) as usize;
            let a = active.get_mut(&id).expect("completion of a known request");
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
        finish_ready(&mut active, &mut order);
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
