//! The held-out evaluation a step runs after its update when its plan asks (`StepPlan::eval`):
//! the forward alone over this rank's share of the eval windows, with the parameters reached
//! the way the step's forward reaches them (at stage 3 gathered a unit at a time, never the
//! whole model; off the tier when they live there), then an agreement on every window's loss.
//!
//! The windows are `job::eval::eval_batches`'s (the same at every evaluation), split among the
//! ranks as the step's micro-batches are, so the agreed losses, and their mean, are those of
//! `job::eval::evaluate` on the full parameters whatever the world size.

use super::reduce::place_losses;
use super::{Agreed, ExecConfig, Pass, MAX_ATTEMPTS};
use crate::engine::messages::StepPlan;
use crate::job::eval::EVAL_STEP;
use crate::model::MicroBatch;
use crate::plan::schedule::eval_phases;
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::step::state::rank_state::RankState;
use crate::runtime::transport::Transport;

/// The eval micro-batches' losses in index order, agreed by every rank of `plan`.
pub(super) fn evaluate<T: Transport>(
    st: &mut RankState,
    comm: &mut Comm<T>,
    plan: &StepPlan,
    cfg: &ExecConfig,
) -> Result<Vec<f32>, CommError> {
    let Some(data) = cfg.eval_data.as_deref() else {
        return Err(CommError::Protocol {
            from: st.rank,
            what: "the coordinator asked for an evaluation, but this rank has no eval data".into(),
        });
    };
    let mbs: Vec<(u32, MicroBatch)> = plan
        .local_micro_batches(st.rank)
        .map(|i| {
            let mb = data.micro_batch(
                cfg.seed,
                EVAL_STEP,
                u64::from(i),
                cfg.micro_batch_size,
                cfg.seq_len,
            );
            (i, mb)
        })
        .collect();
    // Nothing is kept for a backward that does not come.
    let cfg = ExecConfig {
        keep_activations: false,
        ..cfg.clone()
    };
    let (ties, terms) = super::gradient_terms(st, plan)?;
    let program = eval_phases(st.stage, st.units() as u32, cfg.max_live_units);
    let exps = vec![0; st.units()];
    // Its frames are tagged past the step's attempts, so none is taken for a training frame.
    let mut pass = Pass::bare(st, plan, &mbs, &cfg, MAX_ATTEMPTS, exps, (&ties, &terms));
    pass.eval = true;
    let outcome = pass.run(comm, &program, None);
    pass.release();
    Ok(outcome?.losses)
}

/// What every rank contributes to the evaluation's agreement: its windows' losses.
type EvalMsg = Vec<(u32, f32)>;

impl Pass<'_> {
    /// Agrees on the eval losses: every window's loss, from the rank that computed it.
    pub(super) fn agree_eval<T: Transport>(&mut self, comm: &mut Comm<T>) -> Result<(), CommError> {
        let all: Vec<(u32, EvalMsg)> =
            self.exchange_agree(comm, &self.losses, "eval agree message")?;
        let mut losses = self.loss_slots();
        for (from, msg) in all {
            place_losses(&mut losses, from, msg, "eval loss for window batch")?;
        }
        let losses = self.all_losses(losses, "some eval micro-batch has no loss")?;
        self.agreed = Some(Agreed {
            losses,
            max_abs: Vec::new(),
            overflow: false,
            non_finite: false,
            norm: 0.0,
        });
        Ok(())
    }
}
