//! Running a step's phase program in order, with one liberty: a gather whose shard is still
//! coming off the tier is posted after the next compute instead of holding the compute up.

use crate::runtime::clock::Stopwatch;

use super::{Agreed, Pass};
use crate::plan::schedule::Phase;
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::transport::Transport;

/// Whether `phase` may run before `deferred`, a gather's post waiting for its shard: the
/// waits for other gathers and the compute (after which it is posted) may, anything else, or
/// its own wait, may not. Each rank's deferred post is of a unit it gathers after every unit it
/// may wait for in the meantime, whose posts it made already, so no two ranks wait on each
/// other.
fn may_pass(phase: Phase, deferred: Phase) -> bool {
    match (phase, deferred) {
        (Phase::WaitGather { unit, pass }, Phase::PostGather { unit: u, pass: p }) => {
            (unit, pass) != (u, p)
        }
        (Phase::Forward { .. } | Phase::Backward { .. }, _) => true,
        _ => false,
    }
}

impl Pass<'_> {
    pub(super) fn run<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
        program: &[Phase],
        stop: Option<usize>,
    ) -> Result<Agreed, CommError> {
        // A gather whose shard is still coming off the tier, posted after the next compute
        // phase instead of waiting for the disk before it (its index in `program`).
        let mut deferred: Option<usize> = None;
        for (i, &phase) in program.iter().enumerate() {
            if stop == Some(i) {
                return Err(CommError::Vanished);
            }
            if let Some(d) = deferred.take_if(|&mut d| !may_pass(phase, program[d])) {
                self.run_phase(comm, program, d)?;
            }
            if matches!(phase, Phase::PostGather { unit, .. } if self.reading(unit)) {
                deferred = Some(i);
                continue;
            }
            self.run_phase(comm, program, i)?;
            if matches!(phase, Phase::Forward { .. } | Phase::Backward { .. }) {
                if let Some(d) = deferred.take() {
                    self.run_phase(comm, program, d)?;
                }
            }
            if let Some(a) = &self.agreed {
                if a.overflow {
                    break; // nothing after Agree may run on an overflowed pass
                }
            }
        }
        if let Some(d) = deferred {
            self.run_phase(comm, program, d)?;
        }
        self.agreed.take().ok_or_else(|| CommError::Protocol {
            from: self.st.rank,
            what: "phase program has no Agree".into(),
        })
    }

    /// Runs `program[i]`, traced, and after a gather's post starts reading the next shard.
    fn run_phase<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
        program: &[Phase],
        i: usize,
    ) -> Result<(), CommError> {
        let phase = program[i];
        let t0 = Stopwatch::start();
        self.exec(comm, phase)?;
        // Where a step's time goes, phase by phase (`EZERO_LOG=elastic_zero=trace`).
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        tracing::trace!(
            rank = self.st.rank,
            step = self.plan.step,
            ?phase,
            ms,
            "phase"
        );
        if let Phase::PostGather { .. } = phase {
            self.read_ahead(&program[i + 1..]);
        }
        Ok(())
    }

    /// Whether unit `unit`'s shard is being read off the tier and is not there yet.
    fn reading(&self, unit: u32) -> bool {
        self.tier_io
            .as_ref()
            .is_some_and(|io| io.reading(unit as usize))
    }
}
