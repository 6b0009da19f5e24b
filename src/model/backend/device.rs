//! The device seam: memory the kernels run on, apart from the host memory where the optimizer,
//! the fp32 masters and the exact reduction live, and the copies between the two.
//!
//! A [`Device`] is an optional capability of a [`Backend`](super::Backend)
//! ([`Backend::open_device`](super::Backend::open_device)): the CPU backend has none (its
//! buffers are host memory and nothing is copied), the simulated device ([`super::sim`]) is the
//! reference implementation, and a CUDA backend implements the same trait over `cudarc`.
//!
//! The contract:
//! - **Capacity.** [`Device::alloc`] takes memory out of a hard budget. Past it the allocation
//!   fails with [`DeviceError::OutOfMemory`] naming the tensor and the numbers; nothing ever
//!   falls back to host memory silently.
//! - **Copies.** [`Device::upload`] (host → device) and [`Device::download`] (device → host) are
//!   queued on the device's copy queue and run in the order they were queued, beside whatever
//!   the kernels are doing; each returns an [`Event`] that completes when the copy has landed.
//! - **Ordering.** Kernels run on the caller's thread (the compute stream). Before a kernel
//!   reads a buffer a copy wrote, the caller waits on that copy's event with [`Device::wait`];
//!   the device counts the time compute spent waiting.
//!
//! Design: docs/models.md (the device seam).

use std::fmt;
use std::sync::{Arc, Condvar, Mutex};

use serde::{Deserialize, Serialize};

/// What a device buffer holds, for the accounting by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Working parameters a unit computes with.
    Params,
    /// Gradients the backward produced, until they leave for the host.
    Grads,
    /// Activations the forward keeps for the backward, and one unit's intermediates.
    Activations,
}

impl DeviceKind {
    pub const ALL: [DeviceKind; 3] = [
        DeviceKind::Params,
        DeviceKind::Grads,
        DeviceKind::Activations,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Params => "params",
            DeviceKind::Grads => "grads",
            DeviceKind::Activations => "activations",
        }
    }
}

/// Host data on its way to the device. `Bf16` crosses the link at 2 bytes an element and is
/// widened to f32 on the device (exactly: every bf16 value is an f32 value).
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

impl HostData {
    pub fn elems(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::Bf16(v) => v.len(),
        }
    }

    /// Bytes that cross the link.
    pub fn link_bytes(&self) -> u64 {
        match self {
            HostData::F32(v) => 4 * v.len() as u64,
            HostData::Bf16(v) => 2 * v.len() as u64,
        }
    }

    /// `values` (which must hold bf16 values) in their 2-byte form.
    pub fn bf16_of(values: &[f32]) -> HostData {
        HostData::Bf16(values.iter().map(|x| (x.to_bits() >> 16) as u16).collect())
    }
}

/// Memory on a device: a handle the device that made it reads and writes through. Freed with
/// [`Device::free`]; dropping it without freeing keeps its bytes counted (a leak shows in the
/// accounting).
#[derive(Debug)]
pub struct DeviceBuffer {
    pub(crate) tensor: String,
    pub(crate) kind: DeviceKind,
    pub(crate) elems: usize,
    /// Bytes taken from the budget (an activation reservation has bytes and no elements).
    pub(crate) bytes: u64,
    /// Where the bytes are: the device's own representation.
    pub(crate) mem: Option<Arc<Mutex<Vec<f32>>>>,
}

impl DeviceBuffer {
    pub fn tensor(&self) -> &str {
        &self.tensor
    }
    pub fn kind(&self) -> DeviceKind {
        self.kind
    }
    pub fn elems(&self) -> usize {
        self.elems
    }
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[derive(Debug, Default)]
struct EventState {
    done: bool,
    data: Option<Vec<f32>>,
}

/// The completion of one queued copy; a download's event carries the host copy.
#[derive(Clone, Debug, Default)]
pub struct Event(Arc<(Mutex<EventState>, Condvar)>);

impl Event {
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks the copy done (with a download's host data) and wakes every waiter.
    pub fn complete(&self, data: Option<Vec<f32>>) {
        let (m, cv) = &*self.0;
        let mut s = m.lock().expect("event lock");
        s.done = true;
        s.data = data;
        cv.notify_all();
    }

    pub fn is_done(&self) -> bool {
        self.0 .0.lock().expect("event lock").done
    }

    /// Blocks until the copy is done; returns whether it had to wait.
    pub fn block(&self) -> bool {
        let (m, cv) = &*self.0;
        let mut s = m.lock().expect("event lock");
        let waited = !s.done;
        while !s.done {
            s = cv.wait(s).expect("event lock");
        }
        waited
    }

    /// A completed download's host data (once).
    pub fn take(&self) -> Option<Vec<f32>> {
        self.0 .0.lock().expect("event lock").data.take()
    }
}

/// What a device has done since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceCounters {
    pub capacity_bytes: u64,
    /// Bytes allocated now, and the most at once.
    pub resident_bytes: u64,
    pub peak_bytes: u64,
    /// Bytes allocated now by kind, and each kind's peak.
    pub resident_params_bytes: u64,
    pub resident_grads_bytes: u64,
    pub resident_activations_bytes: u64,
    pub peak_params_bytes: u64,
    pub peak_grads_bytes: u64,
    pub peak_activations_bytes: u64,
    /// Bytes that crossed the link each way.
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub h2d_copies: u64,
    pub d2h_copies: u64,
    /// Seconds the copy engine spent moving data (at the modeled bandwidth).
    pub link_busy_s: f64,
    /// Seconds compute spent blocked on a copy's event.
    pub copy_wait_s: f64,
}

impl DeviceCounters {
    /// These counters with what moved, and the waits, counted since `before` (the bytes
    /// resident and the peaks stay as they are).
    pub fn since(&self, before: &DeviceCounters) -> DeviceCounters {
        DeviceCounters {
            h2d_bytes: self.h2d_bytes - before.h2d_bytes,
            d2h_bytes: self.d2h_bytes - before.d2h_bytes,
            h2d_copies: self.h2d_copies - before.h2d_copies,
            d2h_copies: self.d2h_copies - before.d2h_copies,
            link_busy_s: self.link_busy_s - before.link_busy_s,
            copy_wait_s: self.copy_wait_s - before.copy_wait_s,
            ..*self
        }
    }

    /// The most bytes of `kind` allocated at once.
    pub fn peak(&self, kind: DeviceKind) -> u64 {
        match kind {
            DeviceKind::Params => self.peak_params_bytes,
            DeviceKind::Grads => self.peak_grads_bytes,
            DeviceKind::Activations => self.peak_activations_bytes,
        }
    }

    /// Bytes allocated now of `kind`.
    pub fn resident(&self, kind: DeviceKind) -> u64 {
        match kind {
            DeviceKind::Params => self.resident_params_bytes,
            DeviceKind::Grads => self.resident_grads_bytes,
            DeviceKind::Activations => self.resident_activations_bytes,
        }
    }
}

/// Why a device operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("device out of memory allocating '{tensor}' ({kind}): it needs {requested_bytes} bytes, {in_use_bytes} of the {capacity_bytes}-byte budget are in use; raise --device-memory-max, or lower what one unit holds (--stage 3, --max-live-units 1, a smaller --micro-batch-size)")]
    OutOfMemory {
        tensor: String,
        kind: &'static str,
        requested_bytes: u64,
        in_use_bytes: u64,
        capacity_bytes: u64,
    },
    #[error("copy of {copy_elems} elements into device buffer '{tensor}' of {buffer_elems}")]
    SizeMismatch {
        tensor: String,
        copy_elems: usize,
        buffer_elems: usize,
    },
}

/// One accelerator as the step sees it: buffers under a hard capacity, a copy queue, events.
pub trait Device: Send + Sync + fmt::Debug {
    /// A short name for logs and the JSON summary (`sim`).
    fn name(&self) -> &str;

    /// The budget every allocation comes out of.
    fn capacity_bytes(&self) -> u64;

    /// `elems` f32 values of device memory for `tensor`, or the refusal with the numbers.
    fn alloc(
        &self,
        tensor: &str,
        kind: DeviceKind,
        elems: usize,
    ) -> Result<DeviceBuffer, DeviceError>;

    /// `bytes` of the budget for memory the kernels' caller holds itself (the activations a
    /// model returns), counted like an allocation.
    fn reserve(
        &self,
        tensor: &str,
        kind: DeviceKind,
        bytes: u64,
    ) -> Result<DeviceBuffer, DeviceError>;

    /// Returns `buf`'s bytes to the budget (after the copies queued on it).
    fn free(&self, buf: DeviceBuffer);

    /// Queues `src` → `dst` on the copy queue.
    fn upload(&self, src: HostData, dst: &DeviceBuffer) -> Result<Event, DeviceError>;

    /// Queues `src` → a host vector on the copy queue; the event carries it ([`Event::take`]).
    fn download(&self, src: &DeviceBuffer) -> Event;

    /// Compute waits for `ev` (its time counts as copy wait).
    fn wait(&self, ev: &Event);

    /// Runs a kernel reading `buf` (after the caller waited on the copies into it).
    fn with_view(&self, buf: &DeviceBuffer, kernel: &mut dyn FnMut(&[f32]));

    /// Runs a kernel writing `buf`.
    fn with_view_mut(&self, buf: &DeviceBuffer, kernel: &mut dyn FnMut(&mut [f32]));

    fn counters(&self) -> DeviceCounters;
}
