//! The storage seam's lowest level: a device that reads and writes aligned byte ranges of one
//! file, asynchronously. [`MemDevice`] is the reference implementation the tests use (a file in
//! RAM, with injectable faults); `uring::UringDevice` is the real one.

use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};

use super::aligned::AlignedBuf;

/// Read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

/// One request: `len` bytes at `offset` (both multiples of 4096) into or out of the start of
/// `buf`.
pub struct IoRequest {
    pub op: Op,
    pub offset: u64,
    pub len: usize,
    pub buf: AlignedBuf,
    pub done: Sender<IoDone>,
}

/// A finished request gives its buffer back, with the outcome.
pub struct IoDone {
    pub buf: AlignedBuf,
    pub result: Result<(), IoError>,
}

/// Why an I/O failed. Expected failures of a disk are values, never panics.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IoError {
    #[error("no space left on the device (ENOSPC)")]
    NoSpace,
    #[error("the device reported an I/O error (EIO)")]
    Eio,
    #[error("short {op:?}: {done} of {want} bytes at offset {offset}")]
    Short {
        op: Op,
        offset: u64,
        want: usize,
        done: usize,
    },
    #[error("{0}")]
    Os(String),
    #[error("the I/O thread has stopped")]
    Stopped,
}

impl IoError {
    pub fn from_errno(errno: i32) -> Self {
        match errno {
            libc::ENOSPC => IoError::NoSpace,
            libc::EIO => IoError::Eio,
            e => IoError::Os(std::io::Error::from_raw_os_error(e).to_string()),
        }
    }
}

/// A file the tier lives in, read and written asynchronously.
pub trait Device: Send {
    /// Queues a request; its completion arrives on `req.done`.
    fn submit(&mut self, req: IoRequest) -> Result<(), IoError>;
    /// Grows (or creates) the file to `bytes`, reserving the space now so that a full disk is
    /// found before training rather than in the middle of a step.
    fn reserve(&mut self, bytes: u64) -> Result<(), IoError>;
    /// Registers `bufs` (buffers this device's owner keeps for its life) with the device, so
    /// that requests on them skip per-request page pinning; returns how many were registered.
    /// Optional: a device that cannot (or a kernel that refuses) registers none, and every
    /// buffer still works.
    fn register(&mut self, _bufs: &mut [AlignedBuf]) -> usize {
        0
    }
}

/// A pending request's completion.
pub struct Ticket {
    rx: Receiver<IoDone>,
    /// The outcome, once [`Ticket::is_done`] has seen it.
    got: Option<IoDone>,
}

impl Ticket {
    pub fn wait(self) -> IoDone {
        match self.got {
            Some(done) => done,
            None => self.rx.recv().unwrap_or_else(|_| stopped()),
        }
    }

    /// Whether the request has finished (then [`Ticket::wait`] does not block).
    pub fn is_done(&mut self) -> bool {
        if self.got.is_none() {
            self.got = match self.rx.try_recv() {
                Ok(done) => Some(done),
                Err(TryRecvError::Disconnected) => Some(stopped()),
                Err(TryRecvError::Empty) => None,
            };
        }
        self.got.is_some()
    }
}

/// The outcome of a request whose engine went away.
fn stopped() -> IoDone {
    IoDone {
        buf: AlignedBuf::new(0),
        result: Err(IoError::Stopped),
    }
}

/// Submits `req` built around a fresh completion channel.
pub fn submit(
    dev: &mut dyn Device,
    op: Op,
    offset: u64,
    len: usize,
    buf: AlignedBuf,
) -> Result<Ticket, IoError> {
    let (tx, rx) = channel();
    dev.submit(IoRequest {
        op,
        offset,
        len,
        buf,
        done: tx,
    })?;
    Ok(Ticket { rx, got: None })
}

/// Injected faults: the write that would take the bytes written past `fail_after_write_bytes`
/// fails with `errno` (ENOSPC, EIO), and so does every later one; every read is held
/// `read_delay_ms` before it is submitted (on the submitting thread, as a slow disk holds it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    pub fail_after_write_bytes: Option<u64>,
    pub errno: i32,
    pub read_delay_ms: u64,
}

/// Any device with [`Faults`] injected in front of it.
pub struct FaultyDevice<D: Device> {
    pub inner: D,
    pub faults: Faults,
    written: u64,
}

impl<D: Device> FaultyDevice<D> {
    pub fn new(inner: D, faults: Faults) -> Self {
        Self {
            inner,
            faults,
            written: 0,
        }
    }
}

impl<D: Device> Device for FaultyDevice<D> {
    fn submit(&mut self, req: IoRequest) -> Result<(), IoError> {
        if req.op == Op::Write {
            let over = self
                .faults
                .fail_after_write_bytes
                .is_some_and(|max| self.written + req.len as u64 > max);
            if over {
                let _ = req.done.send(IoDone {
                    buf: req.buf,
                    result: Err(IoError::from_errno(self.faults.errno)),
                });
                return Ok(());
            }
            self.written += req.len as u64;
        }
        if req.op == Op::Read && self.faults.read_delay_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(self.faults.read_delay_ms));
        }
        self.inner.submit(req)
    }

    fn reserve(&mut self, bytes: u64) -> Result<(), IoError> {
        self.inner.reserve(bytes)
    }

    fn register(&mut self, bufs: &mut [AlignedBuf]) -> usize {
        self.inner.register(bufs)
    }
}

/// The reference device: the file is bytes in RAM (shared, so a test can damage them), and
/// requests complete at once.
#[derive(Default)]
pub struct MemDevice {
    pub data: Arc<Mutex<Vec<u8>>>,
}

impl MemDevice {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Device for MemDevice {
    fn submit(&mut self, mut req: IoRequest) -> Result<(), IoError> {
        let start = req.offset as usize;
        let mut data = self.data.lock().unwrap_or_else(|p| p.into_inner());
        let result = match req.op {
            Op::Read if start + req.len > data.len() => Err(IoError::Short {
                op: Op::Read,
                offset: req.offset,
                want: req.len,
                done: data.len().saturating_sub(start),
            }),
            Op::Read => {
                req.buf.bytes_mut()[..req.len].copy_from_slice(&data[start..start + req.len]);
                Ok(())
            }
            Op::Write => {
                if data.len() < start + req.len {
                    data.resize(start + req.len, 0);
                }
                data[start..start + req.len].copy_from_slice(&req.buf.bytes()[..req.len]);
                Ok(())
            }
        };
        drop(data);
        let _ = req.done.send(IoDone {
            buf: req.buf,
            result,
        });
        Ok(())
    }

    fn reserve(&mut self, bytes: u64) -> Result<(), IoError> {
        let mut data = self.data.lock().unwrap_or_else(|p| p.into_inner());
        if data.len() < bytes as usize {
            data.resize(bytes as usize, 0);
        }
        Ok(())
    }
}
