//! Running a step's phase program in order, with two liberties: a gather whose shard is still
//! coming off the tier is posted after the next compute instead of holding the compute up, and
//! on a device the wait for the next unit's gather runs before this unit's compute, so that its
//! upload to the device runs beside the compute.

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
        // Gather waits run early, before the compute ahead of them (their indices).
        let mut early = std::collections::BTreeSet::new();
        for (i, &phase) in program.iter().enumerate() {
            if stop == Some(i) {
                return Err(CommError::Vanished);
            }
            if early.remove(&i) {
                continue;
            }
            if deferred.is_none() {
                if let Some(w) = self.wait_to_run_early(program, i) {
                    self.run_phase(comm, program, w)?;
                    early.insert(w);
                }
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

    /// On a device, before the compute at `i`: the index of the wait for the gather the next
    /// compute needs, if it lies between the two and its post ran already. Every rank posts
    /// that gather before this compute, so waiting for it here waits on nothing a peer does
    /// later.
    fn wait_to_run_early(&self, program: &[Phase], i: usize) -> Option<usize> {
        if self.dev.is_none() || self.tier_io.is_some() {
            return None;
        }
        if !matches!(program[i], Phase::Forward { .. } | Phase::Backward { .. }) {
            return None;
        }
        let is_compute = |p: &Phase| matches!(p, Phase::Forward { .. } | Phase::Backward { .. });
        let k = i + 1 + program[i + 1..].iter().position(is_compute)?;
        let unit = match program[k] {
            Phase::Forward { unit } | Phase::Backward { unit } => unit,
            _ => return None,
        };
        let w = i
            + 1
            + program[i + 1..k]
                .iter()
                .position(|p| matches!(p, Phase::WaitGather { unit: v, .. } if *v == unit))?;
        let Phase::WaitGather { pass, .. } = program[w] else {
            return None;
        };
        let posted = program[..i].contains(&Phase::PostGather { unit, pass });
        posted.then_some(w)
    }

    /// Whether unit `unit`'s shard is being read off the tier and is not there yet.
    fn reading(&self, unit: u32) -> bool {
        self.tier_io
            .as_ref()
            .is_some_and(|io| io.reading(unit as usize))
    }
}
