//! The step on a device (`plan::device`): a unit's parameters go host → device before its
//! forward and again before its backward, and are freed after; each micro-batch's gradient goes
//! device → host as soon as its backward ends, and is quantized and summed exactly on the host.
//! With two buffers a kind, the next unit's upload runs while this one computes and a
//! micro-batch's gradient travels while the next is computed.

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use crate::model::backend::Precision;
use crate::model::backend::{Device, DeviceBuffer, DeviceError, DeviceKind, Event, HostData};

/// A rank's device during one pass.
pub(super) struct OnDevice {
    pub(super) dev: Arc<dyn Device>,
    /// 2: prefetch the next unit and keep a gradient in flight; 1: wait for each copy.
    pub(super) buffers: usize,
    precision: Precision,
    /// Units whose parameters are on the device or on their way.
    params: BTreeMap<u32, (DeviceBuffer, Event)>,
    /// Activations each unit's forward left for the backward, reserved on the device.
    acts: BTreeMap<u32, DeviceBuffer>,
    /// Gradients on their way to the host: (micro-batch, the copy, its buffer).
    pub(super) grads: VecDeque<(usize, Event, DeviceBuffer)>,
}

impl OnDevice {
    pub(super) fn new(dev: Arc<dyn Device>, buffers: usize, precision: Precision) -> Self {
        Self {
            dev,
            buffers: buffers.clamp(1, 2),
            precision,
            params: BTreeMap::new(),
            acts: BTreeMap::new(),
            grads: VecDeque::new(),
        }
    }

    /// Whether `unit`'s parameters are on the device or on their way.
    pub(super) fn has_params(&self, unit: u32) -> bool {
        self.params.contains_key(&unit)
    }

    /// Whether another unit's parameters may be uploaded ahead now.
    pub(super) fn room_ahead(&self) -> bool {
        self.params.len() < self.buffers
    }

    /// What `values` (the parameters a unit computes with) look like on the link: fp32 as they
    /// are (moved, not copied, when owned), bf16 at 2 bytes.
    pub(super) fn link_data(&self, values: Cow<'_, [f32]>) -> HostData {
        match self.precision {
            Precision::Fp32 => HostData::F32(values.into_owned()),
            // The model's bf16 parameters cross the link at 2 bytes.
            Precision::Bf16 => {
                debug_assert!(values.iter().all(|x| x.to_bits() & 0xffff == 0));
                HostData::bf16_of(&values)
            }
        }
    }

    /// Queues the upload of `data` (what `unit` computes with, from
    /// [`link_data`](Self::link_data)) into a fresh buffer.
    pub(super) fn upload_params(&mut self, unit: u32, data: HostData) -> Result<(), DeviceError> {
        if self.has_params(unit) {
            return Ok(());
        }
        let name = format!("unit {unit} parameters");
        let buf = self.dev.alloc(&name, DeviceKind::Params, data.elems())?;
        let ev = match self.dev.upload(data, &buf) {
            Ok(ev) => ev,
            Err(e) => {
                self.dev.free(buf);
                return Err(e);
            }
        };
        self.params.insert(unit, (buf, ev));
        Ok(())
    }

    /// Compute waits for `unit`'s parameters to land.
    pub(super) fn wait_params(&self, unit: u32) {
        let (_, ev) = self.params.get(&unit).expect("uploaded before its wait");
        self.dev.wait(ev);
    }

    pub(super) fn params_buffer(&self, unit: u32) -> &DeviceBuffer {
        &self.params.get(&unit).expect("uploaded before use").0
    }

    pub(super) fn free_params(&mut self, unit: u32) {
        if let Some((buf, ev)) = self.params.remove(&unit) {
            // An upload still in flight finishes before its memory goes back.
            self.dev.wait(&ev);
            self.dev.free(buf);
        }
    }

    pub(super) fn reserve_acts(&mut self, unit: u32, bytes: u64) -> Result<(), DeviceError> {
        let name = format!("unit {unit} activations");
        let r = self.dev.reserve(&name, DeviceKind::Activations, bytes)?;
        if let Some(old) = self.acts.insert(unit, r) {
            self.dev.free(old);
        }
        Ok(())
    }

    pub(super) fn free_acts(&mut self, unit: u32) {
        if let Some(r) = self.acts.remove(&unit) {
            self.dev.free(r);
        }
    }

    /// A zeroed gradient buffer for one micro-batch of `unit`.
    pub(super) fn grad_buffer(&self, unit: u32, elems: usize) -> Result<DeviceBuffer, DeviceError> {
        self.dev
            .alloc(&format!("unit {unit} gradient"), DeviceKind::Grads, elems)
    }

    /// The oldest gradient in flight, on the host, its device buffer freed.
    pub(super) fn take_grad(&mut self) -> Option<(usize, Vec<f32>)> {
        let (j, ev, buf) = self.grads.pop_front()?;
        self.dev.wait(&ev);
        self.dev.free(buf);
        Some((j, ev.take().expect("a download carries its data")))
    }

    /// Returns everything the pass still holds (also after a failed pass).
    pub(super) fn release(&mut self) {
        while self.take_grad().is_some() {}
        let units: Vec<u32> = self.params.keys().copied().collect();
        units.into_iter().for_each(|u| self.free_params(u));
        let acts: Vec<u32> = self.acts.keys().copied().collect();
        acts.into_iter().for_each(|u| self.free_acts(u));
    }
}
