//! The step's gradient reduction and agreement: each unit's reduce-scatter posted and waited
//! for (stages 2-3), the whole-model all-gather of gradients (stage 0), the parameter gather
//! after the update (stages 1-2), and the small all-reduce on which ranks agree on losses,
//! per-unit maxima, overflow and the exact global norm.

use bytes::Bytes;

use super::{AgreeMsg, Agreed, Pass};
use crate::engine::ledger::Category;
use crate::plan::Stage;
use crate::reduce::exact;
use crate::reduce::{grad_buf, GradBuf, SumSquares};
use crate::runtime::step::comm::collectives;
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::transport::{Tag, TagKind, Transport};

impl Pass<'_> {
    /// Stages 0-1: every unit's whole-model gradient, reduce-scattered after the backward.
    pub(super) fn reduce_scatter_all<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
    ) -> Result<(), CommError> {
        for u in 0..self.st.units() {
            let tag = self.tag(TagKind::ReduceScatter, u as u32, 0);
            let w = self
                .st
                .whole_grads
                .as_mut()
                .expect("stages 0/1 keep whole-model gradients");
            collectives::reduce_scatter(comm, &self.st.map, u, tag, &mut w[u], 0)?;
        }
        Ok(())
    }

    pub(super) fn post_reduce_scatter<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
        unit: u32,
    ) -> Result<(), CommError> {
        let acc = self
            .unit_acc
            .get(&unit)
            .expect("backward ran before reduce-scatter");
        let tag = self.tag(TagKind::ReduceScatter, unit, 0);
        collectives::post_reduce_scatter(comm, &self.st.map, unit as usize, tag, acc, 0)
    }

    /// Waits for `unit`'s reduce-scatter and keeps this rank's mean gradient shard: in RAM, or
    /// spilled to the tier (and, updating in the backward, applied there at once).
    pub(super) fn wait_reduce_scatter<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
        unit: u32,
    ) -> Result<(), CommError> {
        let u = unit as usize;
        let mut acc = self
            .unit_acc
            .remove(&unit)
            .expect("reduce-scatter posted before its wait");
        let tag = self.tag(TagKind::ReduceScatter, unit, 0);
        let res = collectives::wait_reduce_scatter(comm, &self.st.map, u, tag, &mut acc, 0);
        // The owned ranges, in the shard's layout: into the shard's buffer, or into one that
        // goes to the tier.
        let on_tier = self.st.grads_on_tier() || self.st.in_backward.is_some();
        let t0 = crate::runtime::clock::Stopwatch::start();
        if on_tier {
            self.make_tier_room()?;
        }
        let room_ms = t0.elapsed().as_secs_f64() * 1e3;
        let spilled = self.mean_shard(u, &acc, on_tier);
        self.st.ledger.free(Category::Transient, acc.bytes() as u64);
        drop(acc);
        let mean_ms = t0.elapsed().as_secs_f64() * 1e3 - room_ms;
        tracing::trace!(unit, room_ms, mean_ms, "reduced shard");
        res?;
        match spilled {
            Some(spill) => self.spill(unit, spill),
            None => Ok(()),
        }
    }

    /// Earlier units' writes finish first as far as needed, so that the gradient shards in RAM
    /// besides this unit's accumulator stay bounded (`TierIo`).
    fn make_tier_room(&mut self) -> Result<(), CommError> {
        match self.tier_io.as_mut() {
            Some(io) => io
                .make_room()
                .map_err(|e| CommError::Storage(e.to_string())),
            None => Ok(()),
        }
    }

    /// The mean of unit `u`'s reduced sums over this rank's ranges, with its partial sum of
    /// squares for the global norm: into the shard's gradient buffer, or (`on_tier`) returned
    /// for the tier.
    ///
    /// The mean is kept as f32 (4 bytes, not the accumulator's 8), in RAM or on the tier,
    /// before clipping, which needs the global norm: its partial sum of squares is taken now,
    /// from the exact sums, and the optimizer applies the clip coefficient when it reads the
    /// shard.
    fn mean_shard(
        &mut self,
        u: usize,
        acc: &GradBuf,
        on_tier: bool,
    ) -> Option<(Vec<f32>, SumSquares)> {
        let mode = self.st.mode;
        let factor = grad_buf::mean_factor(mode, self.exps[u], self.plan.micro_batches);
        let shard = &mut self.st.shards[u];
        if on_tier {
            return Some(acc.shard_mean(&shard.ranges, factor));
        }
        let sg = shard
            .grads
            .as_mut()
            .expect("stages 2/3 keep a gradient shard");
        self.st.grad_ss[u] = acc.shard_mean_into(&shard.ranges, factor, sg);
        None
    }

    /// Hands `unit`'s mean gradient to the tier: written for the optimizer, or, updating in
    /// the backward, applied to the unit's shard at once.
    fn spill(
        &mut self,
        unit: u32,
        (g, sum_squares): (Vec<f32>, SumSquares),
    ) -> Result<(), CommError> {
        let u = unit as usize;
        self.st.grad_ss[u] = sum_squares;
        let io = self.tier_io.as_mut().expect("a tier holds the gradients");
        let (t, lr) = (self.plan.opt_step, self.plan.lr);
        match self.st.in_backward.is_some() {
            true => {
                let params = self.kept_params.remove(&unit);
                io.update_in_backward(u, (g, params), t, lr)
            }
            false => io.write_grads(u, g),
        }
        .map_err(|e| CommError::Storage(e.to_string()))
    }

    pub(super) fn all_gather_grads<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
    ) -> Result<(), CommError> {
        let map = &self.st.map;
        let w = self
            .st
            .whole_grads
            .as_mut()
            .expect("stage 0 keeps whole-model gradients");
        for (u, buf) in w.iter().enumerate() {
            let tag = Tag {
                kind: TagKind::GatherGrads,
                attempt: self.attempt,
                unit: u as u32,
                pass: 0,
                piece: 0,
            };
            let eb = buf.elem_bytes();
            let encode = |r, out: &mut Vec<u8>| buf.encode_into(r, out);
            collectives::post_owned_with(comm, map, u, tag, eb, encode, false)?;
        }
        let eb = self.st.mode.elem_bytes();
        for (u, buf) in w.iter_mut().enumerate() {
            let tag = Tag {
                kind: TagKind::GatherGrads,
                attempt: self.attempt,
                unit: u as u32,
                pass: 0,
                piece: 0,
            };
            collectives::wait_owned(comm, map, u, tag, eb, |r, b| {
                buf.set_encoded(r.start, b);
            })?;
        }
        Ok(())
    }

    pub(super) fn gather_params<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
    ) -> Result<(), CommError> {
        let map = &self.st.map;
        for u in 0..self.st.full.len() {
            let full = &self.st.full[u];
            let tag = Tag {
                kind: TagKind::GatherParams,
                attempt: self.attempt,
                unit: u as u32,
                pass: 0,
                piece: 0,
            };
            let encode = |r, out: &mut Vec<u8>| full.encode_into(r, out);
            collectives::post_owned_with(comm, map, u, tag, full.elem_bytes(), encode, true)?;
        }
        for u in 0..self.st.full.len() {
            let tag = Tag {
                kind: TagKind::GatherParams,
                attempt: self.attempt,
                unit: u as u32,
                pass: 0,
                piece: 0,
            };
            let full = &mut self.st.full[u];
            let elem_bytes = full.elem_bytes();
            collectives::wait_owned(comm, map, u, tag, elem_bytes, |r, b| full.decode_into(r, b))?;
        }
        Ok(())
    }

    /// Partial sum of squares of the reduced gradient over the chunks this rank owns.
    pub(super) fn owned_sum_squares(&self, u: usize) -> SumSquares {
        let mode = self.st.mode;
        // Stages 2-3 took it when the unit's reduced shard was made (in RAM or on the tier).
        if matches!(self.st.stage, Stage::Zero2 | Stage::Zero3) {
            return self.st.grad_ss[u];
        }
        match &self.st.whole_grads {
            Some(w) => self
                .st
                .map
                .owned_in_unit(u, self.st.rank)
                .map(|i| w[u].sum_squares(self.st.map.chunk_range(u, i)))
                .fold(SumSquares::zero(mode), SumSquares::plus),
            None => SumSquares::zero(mode),
        }
    }

    pub(super) fn agree<T: Transport>(&mut self, comm: &mut Comm<T>) -> Result<(), CommError> {
        let mine = AgreeMsg {
            losses: self.losses.clone(),
            max_abs: self.stats.iter().map(|s| s.max_abs).collect(),
            overflow: self.stats.iter().any(|s| s.overflow),
            sum_squares: (0..self.st.units())
                .map(|u| self.owned_sum_squares(u))
                .collect(),
        };
        let all: Vec<(u32, AgreeMsg)> = self.exchange_agree(comm, &mine, "agree message")?;
        let units = self.st.units();
        let mut losses = self.loss_slots();
        let mut max_abs = vec![0f32; units];
        let mut overflow = false;
        let mut ss = vec![SumSquares::zero(self.st.mode); units];
        for (from, msg) in all {
            if msg.max_abs.len() != units || msg.sum_squares.len() != units {
                return Err(CommError::Protocol {
                    from,
                    what: "agree message for another model".into(),
                });
            }
            place_losses(&mut losses, from, msg.losses, "loss for micro-batch")?;
            for u in 0..units {
                max_abs[u] = exact::max_nan(max_abs[u], msg.max_abs[u]);
                ss[u] = ss[u].plus(msg.sum_squares[u]);
            }
            overflow |= msg.overflow;
        }
        let losses = self.all_losses(losses, "some micro-batch has no loss")?;
        let non_finite = max_abs.iter().any(|m| !m.is_finite());
        let norm = if overflow {
            f64::NAN
        } else {
            grad_buf::global_norm(self.st.mode, &ss, &self.exps, self.plan.micro_batches)
        };
        self.agreed = Some(Agreed {
            losses,
            max_abs,
            overflow,
            non_finite,
            norm,
        });
        Ok(())
    }
}

impl Pass<'_> {
    /// Sends `mine` to every member and returns each member's message, decoded (at most
    /// 16 MiB each); `what` names the message in a protocol error.
    pub(super) fn exchange_agree<
        T: Transport,
        M: serde::Serialize,
        R: serde::de::DeserializeOwned,
    >(
        &self,
        comm: &mut Comm<T>,
        mine: &M,
        what: &str,
    ) -> Result<Vec<(u32, R)>, CommError> {
        let config = bincode::config::standard();
        let bytes =
            bincode::serde::encode_to_vec(mine, config).map_err(|e| CommError::Protocol {
                from: self.st.rank,
                what: format!("encode: {e}"),
            })?;
        let tag = self.tag(TagKind::Agree, 0, 0);
        let all = collectives::exchange_small(comm, &self.st.map.members, tag, Bytes::from(bytes))?;
        all.into_iter()
            .map(|(from, payload)| {
                bincode::serde::decode_from_slice(&payload, config.with_limit::<{ 1 << 24 }>())
                    .map(|(msg, _)| (from, msg))
                    .map_err(|e| CommError::Protocol {
                        from,
                        what: format!("{what}: {e}"),
                    })
            })
            .collect()
    }

    /// One empty slot for each micro-batch's loss.
    pub(super) fn loss_slots(&self) -> Vec<Option<f32>> {
        vec![None; self.plan.micro_batches as usize]
    }

    /// The losses in index order, or `missing` when some micro-batch has none.
    pub(super) fn all_losses(
        &self,
        slots: Vec<Option<f32>>,
        missing: &str,
    ) -> Result<Vec<f32>, CommError> {
        slots
            .into_iter()
            .collect::<Option<Vec<f32>>>()
            .ok_or_else(|| CommError::Protocol {
                from: self.st.rank,
                what: missing.into(),
            })
    }
}

/// Puts `from`'s `(index, loss)` pairs into their slots: each micro-batch's loss comes exactly
/// once, from the rank that computed it (`what` names the loss in the error).
pub(super) fn place_losses(
    slots: &mut [Option<f32>],
    from: u32,
    losses: Vec<(u32, f32)>,
    what: &str,
) -> Result<(), CommError> {
    for (i, l) in losses {
        match slots.get_mut(i as usize) {
            Some(slot @ None) => *slot = Some(l),
            _ => {
                return Err(CommError::Protocol {
                    from,
                    what: format!("{what} {i} twice or out of range"),
                })
            }
        }
    }
    Ok(())
}
