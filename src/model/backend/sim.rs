//! The simulated device: the reference implementation of the device seam, as the in-process
//! network is of the transport seam. Its memory is an arena of its own with a hard capacity;
//! every copy goes through one copy-engine thread that holds it for `bytes / bandwidth`, so
//! copies take the time a link of that bandwidth would and run beside compute; the kernels are
//! the CPU backend's, so a run on it gives the host run's bits. It counts bytes each way, the
//! peak and the bytes resident by kind, and the time compute waited on a copy.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::device::{
    Device, DeviceBuffer, DeviceCounters, DeviceError, DeviceKind, Event, HostData,
};

/// A PCIe 4.0 x16 link's usable bandwidth each way, bytes per second.
pub const DEFAULT_LINK_BYTES_PER_S: f64 = 25e9;

/// What a simulated device is: its memory and its link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimSpec {
    pub capacity_bytes: u64,
    pub link_bytes_per_s: f64,
}

type Mem = Arc<Mutex<Vec<f32>>>;

enum Job {
    Upload(HostData, Mem, Event),
    Download(Mem, Event),
}

#[derive(Debug, Default)]
struct Arena {
    used: u64,
    peak: u64,
    by_kind: [u64; 3],
    peak_by_kind: [u64; 3],
    /// Freed memory kept for the next allocation of its size, at most the capacity in all, as
    /// a device's allocator keeps its pool: the step frees and allocates buffers of the same
    /// sizes unit after unit, and fresh host memory costs page faults on the very cores that
    /// run the kernels.
    spare: Vec<Vec<f32>>,
}

impl Arena {
    /// A zeroed buffer of `elems`, from the spare memory when one of that size is there.
    fn buffer(&mut self, elems: usize) -> Vec<f32> {
        match self.spare.iter().position(|v| v.len() == elems) {
            Some(i) => {
                let mut v = self.spare.swap_remove(i);
                v.fill(0.0);
                v
            }
            None => vec![0f32; elems],
        }
    }

    /// Keeps `mem` for reuse within `capacity_bytes` of spare memory (the oldest goes first).
    fn keep(&mut self, mem: Vec<f32>, capacity_bytes: u64) {
        let bytes = |v: &[Vec<f32>]| v.iter().map(|m| 4 * m.len() as u64).sum::<u64>();
        self.spare.push(mem);
        while bytes(&self.spare) > capacity_bytes {
            self.spare.remove(0);
        }
    }
}

#[derive(Debug, Default)]
struct Moved {
    h2d_bytes: AtomicU64,
    d2h_bytes: AtomicU64,
    h2d_copies: AtomicU64,
    d2h_copies: AtomicU64,
    link_busy_ns: AtomicU64,
    wait_ns: AtomicU64,
}

/// One simulated accelerator.
pub struct SimDevice {
    spec: SimSpec,
    arena: Mutex<Arena>,
    moved: Arc<Moved>,
    queue: Mutex<Option<Sender<Job>>>,
    engine: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDevice")
            .field("spec", &self.spec)
            .finish()
    }
}

fn kind_index(k: DeviceKind) -> usize {
    match k {
        DeviceKind::Params => 0,
        DeviceKind::Grads => 1,
        DeviceKind::Activations => 2,
    }
}

impl SimDevice {
    /// A device of `spec` with its copy engine running.
    pub fn new(spec: SimSpec) -> Self {
        let (tx, rx) = channel::<Job>();
        let moved = Arc::new(Moved::default());
        let m = moved.clone();
        let bw = spec.link_bytes_per_s;
        let engine = std::thread::Builder::new()
            .name("sim-copy-engine".into())
            .spawn(move || {
                for job in rx {
                    run_copy(job, bw, &m);
                }
            })
            .expect("spawn the simulated device's copy engine");
        Self {
            spec,
            arena: Mutex::new(Arena::default()),
            moved,
            queue: Mutex::new(Some(tx)),
            engine: Mutex::new(Some(engine)),
        }
    }

    fn take(&self, tensor: &str, kind: DeviceKind, bytes: u64) -> Result<(), DeviceError> {
        let mut a = self.arena.lock().expect("arena lock");
        if a.used + bytes > self.spec.capacity_bytes {
            return Err(DeviceError::OutOfMemory {
                tensor: tensor.to_string(),
                kind: kind.name(),
                requested_bytes: bytes,
                in_use_bytes: a.used,
                capacity_bytes: self.spec.capacity_bytes,
            });
        }
        a.used += bytes;
        a.peak = a.peak.max(a.used);
        let k = kind_index(kind);
        a.by_kind[k] += bytes;
        a.peak_by_kind[k] = a.peak_by_kind[k].max(a.by_kind[k]);
        Ok(())
    }

    fn send(&self, job: Job) {
        self.queue
            .lock()
            .expect("queue lock")
            .as_ref()
            .expect("the copy engine runs until the device is dropped")
            .send(job)
            .expect("the copy engine outlives its queue");
    }
}

/// Moves one copy, then holds the engine until the modeled link time has passed since it
/// started (a memcpy is far faster than a PCIe link).
fn run_copy(job: Job, bytes_per_s: f64, moved: &Moved) {
    let t0 = Instant::now();
    let (bytes, ev, data) = match job {
        Job::Upload(src, dst, ev) => {
            let bytes = src.link_bytes();
            let mut d = dst.lock().expect("device memory lock");
            match src {
                HostData::F32(v) => d.copy_from_slice(&v),
                HostData::Bf16(v) => d
                    .iter_mut()
                    .zip(&v)
                    .for_each(|(o, &h)| *o = f32::from_bits((h as u32) << 16)),
            }
            moved.h2d_bytes.fetch_add(bytes, Ordering::Relaxed);
            moved.h2d_copies.fetch_add(1, Ordering::Relaxed);
            (bytes, ev, None)
        }
        Job::Download(src, ev) => {
            let v = src.lock().expect("device memory lock").clone();
            let bytes = 4 * v.len() as u64;
            moved.d2h_bytes.fetch_add(bytes, Ordering::Relaxed);
            moved.d2h_copies.fetch_add(1, Ordering::Relaxed);
            (bytes, ev, Some(v))
        }
    };
    let link = Duration::from_secs_f64(bytes as f64 / bytes_per_s);
    if let Some(rest) = link.checked_sub(t0.elapsed()) {
        std::thread::sleep(rest);
    }
    let busy = t0.elapsed().max(link);
    moved
        .link_busy_ns
        .fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
    ev.complete(data);
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        // Closing the queue ends the engine after the copies already queued.
        drop(self.queue.lock().map(|mut q| q.take()));
        if let Ok(mut e) = self.engine.lock() {
            if let Some(h) = e.take() {
                let _ = h.join();
            }
        }
    }
}

impl Device for SimDevice {
    fn name(&self) -> &str {
        "sim"
    }

    fn capacity_bytes(&self) -> u64 {
        self.spec.capacity_bytes
    }

    fn alloc(
        &self,
        tensor: &str,
        kind: DeviceKind,
        elems: usize,
    ) -> Result<DeviceBuffer, DeviceError> {
        let bytes = 4 * elems as u64;
        self.take(tensor, kind, bytes)?;
        let mem = self.arena.lock().expect("arena lock").buffer(elems);
        Ok(DeviceBuffer {
            tensor: tensor.to_string(),
            kind,
            elems,
            bytes,
            mem: Some(Arc::new(Mutex::new(mem))),
        })
    }

    fn reserve(
        &self,
        tensor: &str,
        kind: DeviceKind,
        bytes: u64,
    ) -> Result<DeviceBuffer, DeviceError> {
        self.take(tensor, kind, bytes)?;
        Ok(DeviceBuffer {
            tensor: tensor.to_string(),
            kind,
            elems: 0,
            bytes,
            mem: None,
        })
    }

    fn free(&self, buf: DeviceBuffer) {
        let mut a = self.arena.lock().expect("arena lock");
        a.used -= buf.bytes;
        a.by_kind[kind_index(buf.kind)] -= buf.bytes;
        // Memory a queued copy still holds is dropped by that copy instead.
        if let Some(mem) = buf.mem.and_then(|m| Arc::try_unwrap(m).ok()) {
            let mem = mem.into_inner().unwrap_or_else(|e| e.into_inner());
            a.keep(mem, self.spec.capacity_bytes);
        }
    }

    fn upload(&self, src: HostData, dst: &DeviceBuffer) -> Result<Event, DeviceError> {
        if src.elems() != dst.elems {
            return Err(DeviceError::SizeMismatch {
                tensor: dst.tensor.clone(),
                copy_elems: src.elems(),
                buffer_elems: dst.elems,
            });
        }
        let ev = Event::new();
        let mem = dst
            .mem
            .clone()
            .expect("an upload goes into allocated memory");
        self.send(Job::Upload(src, mem, ev.clone()));
        Ok(ev)
    }

    fn download(&self, src: &DeviceBuffer) -> Event {
        let ev = Event::new();
        let mem = src.mem.clone().expect("a download reads allocated memory");
        self.send(Job::Download(mem, ev.clone()));
        ev
    }

    fn wait(&self, ev: &Event) {
        let t0 = Instant::now();
        if ev.block() {
            self.moved
                .wait_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }

    fn with_view(&self, buf: &DeviceBuffer, kernel: &mut dyn FnMut(&[f32])) {
        let mem = buf.mem.as_ref().expect("a kernel reads allocated memory");
        kernel(&mem.lock().expect("device memory lock"));
    }

    fn with_view_mut(&self, buf: &DeviceBuffer, kernel: &mut dyn FnMut(&mut [f32])) {
        let mem = buf.mem.as_ref().expect("a kernel writes allocated memory");
        kernel(&mut mem.lock().expect("device memory lock"));
    }

    fn counters(&self) -> DeviceCounters {
        let a = self.arena.lock().expect("arena lock");
        let m = &self.moved;
        let secs = |ns: &AtomicU64| ns.load(Ordering::Relaxed) as f64 * 1e-9;
        DeviceCounters {
            capacity_bytes: self.spec.capacity_bytes,
            resident_bytes: a.used,
            peak_bytes: a.peak,
            resident_params_bytes: a.by_kind[0],
            resident_grads_bytes: a.by_kind[1],
            resident_activations_bytes: a.by_kind[2],
            peak_params_bytes: a.peak_by_kind[0],
            peak_grads_bytes: a.peak_by_kind[1],
            peak_activations_bytes: a.peak_by_kind[2],
            h2d_bytes: m.h2d_bytes.load(Ordering::Relaxed),
            d2h_bytes: m.d2h_bytes.load(Ordering::Relaxed),
            h2d_copies: m.h2d_copies.load(Ordering::Relaxed),
            d2h_copies: m.d2h_copies.load(Ordering::Relaxed),
            link_busy_s: secs(&m.link_busy_ns),
            copy_wait_s: secs(&m.wait_ns),
        }
    }
}

#[cfg(test)]
mod tests;
