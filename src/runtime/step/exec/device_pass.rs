//! The pass's side of the device (`device.rs`): which values a unit's upload carries, the
//! kernels reading the parameters where they are, the backward writing each micro-batch's
//! gradient into device memory, and the gradients taken back to the host in order.

use std::borrow::Cow;

use super::Pass;
use crate::model::backend::DeviceError;
use crate::model::Kept;
use crate::plan::Stage;
use crate::reduce::GradBuf;

impl Pass<'_> {
    /// Puts `u`'s parameters (its `view` where it borrows tied ones) on the device and waits
    /// for them, then starts uploading unit `next`'s where the plan has room and they are
    /// already on the host.
    pub(super) fn params_to_device(
        &mut self,
        u: usize,
        view: Option<&[f32]>,
        next: usize,
    ) -> Result<(), DeviceError> {
        let Some(d) = self.dev.as_ref() else {
            return Ok(());
        };
        // One host copy an upload: the values go into the link's buffer directly.
        if !d.has_params(u as u32) {
            let data = d.link_data(Cow::Borrowed(view.unwrap_or_else(|| self.params(u))));
            self.dev
                .as_mut()
                .expect("checked")
                .upload_params(u as u32, data)?;
        }
        let d = self.dev.as_ref().expect("checked");
        d.wait_params(u as u32);
        if next < self.st.units() && d.room_ahead() && !d.has_params(next as u32) {
            if let Some(values) = self.unit_values(next) {
                let data = d.link_data(values);
                self.dev
                    .as_mut()
                    .expect("checked")
                    .upload_params(next as u32, data)?;
            }
        }
        Ok(())
    }

    /// What unit `u` computes with, if it is on the host now: its gathered copy (stage 3), its
    /// full copy (stages 0-2, widened from bf16), with what it borrows once the owner lent it.
    fn unit_values(&self, u: usize) -> Option<Cow<'_, [f32]>> {
        let own: Cow<[f32]> = match (self.gathered.get(&(u as u32)), self.st.stage) {
            (Some(g), _) => Cow::Borrowed(g),
            (None, Stage::Zero3) => return None,
            (None, _) => {
                let full = &self.st.full[u];
                match full.f32s() {
                    Some(v) => Cow::Borrowed(v),
                    None => Cow::Owned(full.values(0..full.len())),
                }
            }
        };
        let ties = self.ties.0;
        if ties.borrowed_len(u) == 0 {
            // No copy here: the upload takes the values from where they are.
            return Some(own);
        }
        if ties
            .borrowed_by(u)
            .any(|(i, ..)| !self.lent.contains_key(&i))
        {
            return None;
        }
        let lent = &self.lent;
        let view = ties.view_of(u, &own, |i, _, _| lent.get(&i).expect("checked above"));
        Some(Cow::Owned(view.into_owned()))
    }

    /// Runs `f` on the parameters `u` computes with: its device buffer, or on the host its
    /// `view` or its parameters.
    pub(super) fn on_params<R>(
        &self,
        u: usize,
        view: Option<&[f32]>,
        f: impl FnOnce(&[f32]) -> R,
    ) -> R {
        match &self.dev {
            Some(d) => {
                let (mut f, mut out) = (Some(f), None);
                d.dev.with_view(d.params_buffer(u as u32), &mut |p| {
                    out = Some((f.take().expect("a kernel runs once"))(p));
                });
                out.expect("the kernel ran")
            }
            None => f(view.unwrap_or_else(|| self.params(u))),
        }
    }

    /// Micro-batch `j`'s backward of `u` on the device: its gradient into a fresh device
    /// buffer, which starts for the host at once. Returns the input's gradient.
    pub(super) fn backward_on_device(
        &mut self,
        u: usize,
        j: usize,
        view_len: usize,
        k: Option<Kept>,
    ) -> Result<Vec<f32>, DeviceError> {
        let d = self.dev.as_ref().expect("on a device");
        let grad = d.grad_buffer(u as u32, view_len)?;
        let x: &[f32] = if u == 0 { &[] } else { &self.saved[u][j] };
        let (dy, mb) = (&self.grad_out[j], &self.mbs[j].1);
        let (mut k, mut gx) = (Some(k), None);
        d.dev.with_view(d.params_buffer(u as u32), &mut |p| {
            d.dev.with_view_mut(&grad, &mut |g| {
                let kept = k.take().expect("a kernel runs once");
                gx = Some(self.st.model.backward_kept(u, p, x, kept, dy, mb, g));
            });
        });
        let ev = d.dev.download(&grad);
        self.dev
            .as_mut()
            .expect("on a device")
            .grads
            .push_back((j, ev, grad));
        Ok(gx.expect("the kernel ran"))
    }

    /// Takes the gradients of `u` that have left the device into `acc`, in micro-batch order,
    /// leaving `in_flight` of them travelling.
    pub(super) fn take_device_grads(&mut self, u: usize, acc: &mut GradBuf, draining: bool) {
        loop {
            let Some(d) = self.dev.as_mut() else {
                return;
            };
            let keep = if draining { 0 } else { d.buffers - 1 };
            if d.grads.len() <= keep {
                return;
            }
            let (_, g) = d.take_grad().expect("one is in flight");
            self.take_grad(u, acc, &g);
        }
    }
}
