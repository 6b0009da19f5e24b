//! Stage 3 with the parameters, the optimizer state and the gradients all on the tier: the
//! optimizer phase only records the step's scalars, and each unit's update is owed until the
//! next step's forward gathers that unit. The helper that reads the unit ahead then does the
//! update instead of a plain read (read p, m, v and g; update; write p, m and v back) and hands
//! the updated shard to the gather. So the update's disk traffic overlaps the previous unit's
//! compute instead of running as a phase of its own between the backward and the next forward
//! (exact clipping cannot start it earlier: it needs the global norm), and the forward's read of
//! the parameters is the update's read. With clipping off the update runs earlier still, in the
//! backward (`plan::tier::updates_in_backward`), and nothing is owed.
//!
//! The rank's state is what the tier holds with the owed updates applied. Whatever reads that
//! state between steps (backups, checkpoints, reshards, digests) goes through
//! `RankState::tiered_chunks`, which applies what is still owed first; so do a unit's gradient
//! write (the owed update reads the previous step's gradient) and the next optimizer phase. A
//! unit leaves the owed set when its update starts, so no update runs twice. The update is
//! elementwise and uses its own step's t, learning rate and clip coefficient, so when it runs
//! changes no bits.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

pub use crate::runtime::step::state::offload::StepScalars as OwedStep;
use crate::runtime::step::state::offload::{TierUpdater, UpdateStream};
use crate::runtime::storage::{TierError, TierFile};

#[derive(Default)]
struct Debts {
    step: Option<OwedStep>,
    units: BTreeSet<usize>,
}

/// The updates a rank owes its tier.
pub struct Owed {
    updater: Arc<TierUpdater>,
    debts: Mutex<Debts>,
}

impl Owed {
    pub fn new(updater: Arc<TierUpdater>) -> Self {
        Self {
            updater,
            debts: Mutex::new(Debts::default()),
        }
    }

    fn debts(&self) -> std::sync::MutexGuard<'_, Debts> {
        self.debts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Owes every unit's update for `step`. What was owed before must have been settled.
    pub fn owe(&self, step: OwedStep) {
        let mut d = self.debts();
        debug_assert!(
            d.units.is_empty(),
            "the previous step's updates were settled"
        );
        d.step = Some(step);
        d.units = (0..self.updater.units()).collect();
    }

    /// Takes unit `u`'s update to run it: the step it is for, if it was owed.
    pub fn take(&self, u: usize) -> Option<OwedStep> {
        let mut d = self.debts();
        if d.units.remove(&u) {
            d.step
        } else {
            None
        }
    }

    /// Puts back unit `u`'s update for `step`, taken but not started.
    pub fn give_back(&self, u: usize, step: OwedStep) {
        let mut d = self.debts();
        debug_assert_eq!(d.step, Some(step));
        d.units.insert(u);
    }

    /// Units still owed.
    pub fn owed_units(&self) -> usize {
        self.debts().units.len()
    }

    /// Runs unit `u`'s update for `step`; the updated masters also land in `params_out` (the
    /// shard's length, or empty). Reads go no further ahead than the unit's own records.
    pub fn apply(
        &self,
        tier: &mut TierFile,
        u: usize,
        step: OwedStep,
        params_out: &mut [f32],
    ) -> Result<(), TierError> {
        let mut stream = UpdateStream::until(tier.layout.unit_records(u).end);
        let res = self.update(tier, &mut stream, u, step, params_out);
        res.and(stream.finish(tier))
    }

    fn update(
        &self,
        tier: &mut TierFile,
        stream: &mut UpdateStream,
        u: usize,
        step: OwedStep,
        params_out: &mut [f32],
    ) -> Result<(), TierError> {
        self.updater
            .update(tier, stream, u, step, (&[], &[]), params_out, false)
    }

    /// Runs every update still owed, in unit order, each run of consecutive units as one
    /// stream of reads and writes.
    pub fn settle(&self, tier: &Mutex<TierFile>) -> Result<(), TierError> {
        let (step, units) = {
            let mut d = self.debts();
            (d.step, std::mem::take(&mut d.units))
        };
        let Some(step) = step else {
            return Ok(());
        };
        if units.is_empty() {
            return Ok(());
        }
        let mut tier = tier.lock().unwrap_or_else(|p| p.into_inner());
        let units: Vec<usize> = units.into_iter().collect();
        for run in units.chunk_by(|a, b| a + 1 == *b) {
            let last = *run.last().expect("a run is never empty");
            let mut stream = UpdateStream::until(tier.layout.unit_records(last).end);
            let res = run
                .iter()
                .try_for_each(|&u| self.update(&mut tier, &mut stream, u, step, &mut []));
            res.and(stream.finish(&mut tier))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::model::mlp::{Mlp, MlpConfig};
    use crate::model::Model;
    use crate::optim::OptimSettings;
    use crate::optim::{AdamHyper, OptimizerKind};
    use crate::runtime::step::state::offload::read_shard_values;
    use crate::runtime::storage::device::MemDevice;
    use crate::runtime::storage::{RecordKinds, TierLayout};

    const LENS: [usize; 3] = [3000, 1500, 2100];

    /// Shard values `k` (p, m, v, g) of unit `u`, made up.
    fn value(u: usize, k: usize, i: usize) -> f32 {
        let x = ((u * 7919 + k * 104_729 + i * 31) % 1000) as f32 / 1000.0 - 0.5;
        if k == 2 {
            x * x // v is never negative
        } else {
            x
        }
    }

    /// A tier of three units in records of 1024 elements holding p, m, v and g, and the same
    /// shards in RAM.
    fn tier_and_ram() -> (Mutex<TierFile>, Vec<[Vec<f32>; 4]>) {
        let kinds = RecordKinds {
            params: true,
            state: 2,
            grads: 1,
        };
        let layout = TierLayout::new(LENS.to_vec(), 1024, kinds);
        let mut tier = TierFile::create(
            Path::new("/nonexistent/owed"),
            Box::new(MemDevice::new()),
            layout,
            3,
        )
        .unwrap();
        let ram: Vec<[Vec<f32>; 4]> = (0..LENS.len())
            .map(|u| std::array::from_fn(|k| (0..LENS[u]).map(|i| value(u, k, i)).collect()))
            .collect();
        for (u, vals) in ram.iter().enumerate() {
            for rec in tier.layout.unit_records(u) {
                let (_, span) = tier.layout.record_span(rec);
                let tile = tier.layout.record_tile(rec);
                let mut buf = tier.take_buf().unwrap();
                for (k, v) in vals.iter().enumerate() {
                    buf.f32s_mut()[k * tile..k * tile + span.len()]
                        .copy_from_slice(&v[span.clone()]);
                }
                let p = tier.start_write(rec, buf).unwrap();
                let b = tier.finish(p).unwrap();
                tier.put_buf(b);
            }
        }
        (Mutex::new(tier), ram)
    }

    fn owed() -> Owed {
        let model: Arc<dyn Model> = Arc::new(
            Mlp::new(MlpConfig {
                vocab: 7,
                d_model: 6,
                hidden: 10,
                layers: 2,
            })
            .unwrap(),
        );
        let settings = OptimSettings {
            kind: OptimizerKind::AdamW,
            hyper: AdamHyper::default(),
            threads: 1,
        };
        // Chunk ranges cut where the records are not: where an update is cut changes no bits.
        let ranges = vec![
            vec![0..1000, 1000..3000],
            vec![0..1500],
            vec![0..700, 700..2100],
        ];
        Owed::new(Arc::new(TierUpdater::new(model, settings, ranges)))
    }

    #[test]
    fn owed_updates_run_once_each_and_give_what_the_optimizer_phase_gives() {
        let (tier, mut ram) = tier_and_ram();
        let o = owed();
        let step = OwedStep {
            t: 3,
            lr: 0.01,
            clip_coef: 0.5,
        };
        // What the optimizer phase computes in RAM, on the clipped mean gradient.
        for [p, m, v, g] in &mut ram {
            crate::reduce::grad_buf::apply_clip(g, step.clip_coef);
            o.updater.settings().update(p, g, m, v, step.t, step.lr);
        }
        assert_eq!(o.take(1), None, "nothing is owed yet");
        o.owe(step);
        assert_eq!(o.owed_units(), 3);
        // A forward takes unit 1's update and gets its updated shard from it.
        let s = o.take(1).unwrap();
        assert_eq!(o.take(1), None, "an update is taken once");
        let mut out = vec![0f32; LENS[1]];
        o.apply(&mut tier.lock().unwrap(), 1, s, &mut out).unwrap();
        assert_eq!(out, ram[1][0]);
        // One taken and put back (its helper did not start) is still owed.
        let s = o.take(2).unwrap();
        o.give_back(2, s);
        assert_eq!(o.owed_units(), 2);
        // A reader settles the rest; the tier then holds exactly the updated p, m and v, and
        // the gradient as it was.
        o.settle(&tier).unwrap();
        assert_eq!(o.owed_units(), 0);
        o.settle(&tier).unwrap();
        let mut t = tier.lock().unwrap();
        for (u, vals) in ram.iter().enumerate() {
            for (k, want) in vals.iter().take(3).enumerate() {
                let got = read_shard_values(&mut t, u, k, 0..LENS[u]).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(want), "unit {u} value {k}");
            }
            let g = read_shard_values(&mut t, u, 3, 0..LENS[u]).unwrap();
            assert_eq!(g, (0..LENS[u]).map(|i| value(u, 3, i)).collect::<Vec<_>>());
        }
        // Reads never ran ahead of the units updated: every buffer is back, nothing in flight.
        assert_eq!(t.free_bufs(), 3);
    }
}
