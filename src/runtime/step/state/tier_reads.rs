//! Reading many chunks' state off the tier at once. A chunk (8192 elements by default) is far
//! smaller than a tier record (up to 262,144), so reading chunk by chunk would read each record
//! dozens of times over; these read runs of consecutive chunks in one pass through the records,
//! a bounded group at a time.

use std::sync::Mutex;

use crate::plan::Stage;
use crate::runtime::step::state::offload::read_shard_values;
use crate::runtime::step::state::rank_state::{ChunkState, RankState};
use crate::runtime::storage::{TierError, TierFile};

/// Elements read per group: 1 Mi elements, 12 MiB for parameters and Adam's m and v.
pub const GROUP_ELEMS: usize = crate::plan::tier::SNAPSHOT_PIECE_ELEMS as usize;

/// Takes one group of chunk states.
pub type Emit<'a> = dyn FnMut(Vec<ChunkState>) -> Result<(), TierError> + 'a;

/// Staging buffers a read ahead for the optimizer leaves in the pool: the optimizer's own stream
/// reads one record past the ones read ahead while it updates another, and a gradient write
/// stages through one.
const KEEP_FOR_STREAM: usize = 2;

/// Starts reading records `recs` (all their values) for the next optimizer phase
/// (`tier_file::read_ahead`), in order, while staging buffers are free beyond
/// [`KEEP_FOR_STREAM`]; only where the tier holds the optimizer's state and perhaps the
/// gradients, which is all the phase reads. How many were started (or already were).
pub fn read_ahead_for_optimizer(
    t: &mut TierFile,
    recs: std::ops::Range<usize>,
) -> Result<usize, TierError> {
    let kinds = t.layout.kinds;
    if kinds.params {
        // The phase gets the parameters from RAM and reads what follows them.
        return Ok(0);
    }
    t.land_finished_writes();
    let mut started = 0;
    for rec in recs {
        if !t.read_ahead(rec, 0..kinds.values(), KEEP_FOR_STREAM)? {
            break;
        }
        started += 1;
    }
    Ok(started)
}

impl RankState {
    /// With only the optimizer's state on the tier (nothing the backward writes), starts the
    /// next optimizer phase's reads, in its order, into the staging buffers free: the
    /// backward's compute then hides them. With the gradients there too, each unit's records
    /// are read ahead once its gradient is written (`TierIo::write_grads`) instead. Writes the
    /// last phase left in flight that have landed give their buffers back first; one still
    /// landing is waited for only where it writes a record read ahead. How many records were
    /// read ahead.
    pub fn read_ahead_for_optimizer(&self) -> Result<usize, TierError> {
        let (Some(tier), None, None) = (&self.tier, &self.owed, &self.in_backward) else {
            return Ok(0);
        };
        if self.tier_kinds().grads > 0 {
            return Ok(0);
        }
        let mut t = tier.lock().unwrap_or_else(|p| p.into_inner());
        let records = t.layout.records();
        read_ahead_for_optimizer(&mut t, 0..records)
    }

    /// Everything this rank holds, as chunk states: [`RankState::try_chunk_state`] of every
    /// chunk it has, with the tier read in groups.
    pub fn held_chunk_states(&self) -> Result<Vec<ChunkState>, TierError> {
        let mut out = Vec::new();
        self.for_each_held(&mut |group| {
            out.extend(group);
            Ok(())
        })?;
        Ok(out)
    }

    /// [`RankState::held_chunk_states`] a group at a time, in (unit, index) order within each
    /// unit: with a tier, at most [`GROUP_ELEMS`] elements of it are in memory at once.
    pub fn for_each_held(&self, emit: &mut Emit<'_>) -> Result<(), TierError> {
        let Some(t) = &self.tier else {
            let mut out = Vec::new();
            for (u, unit) in self.map.units.iter().enumerate() {
                for i in 0..unit.owners.len() {
                    out.extend(self.try_chunk_state(u, i)?);
                }
            }
            return emit(out);
        };
        for u in 0..self.shards.len() {
            self.tiered_chunks(t, u, false, &|_| true, false, emit)?;
            if self.stage != Stage::Zero3 {
                // Stages 0-2 hold every parameter: the chunks without optimizer state here.
                let shard = &self.shards[u];
                for i in 0..self.map.units[u].owners.len() {
                    if !shard.chunks.contains(&i) {
                        emit(vec![ChunkState {
                            unit: u as u32,
                            index: i as u32,
                            params: self.full[u].values(self.map.chunk_range(u, i)),
                            m: Vec::new(),
                            v: Vec::new(),
                        }])?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Appends the state of the chunks of unit `u` in this rank's shard (only those it owns
    /// with `owned_only`), in index order, reading what lives on the tier in groups of
    /// consecutive chunks of at most [`GROUP_ELEMS`] (a larger chunk is one group).
    pub(super) fn tiered_in_unit(
        &self,
        tier: &Mutex<TierFile>,
        u: usize,
        owned_only: bool,
        out: &mut Vec<ChunkState>,
    ) -> Result<(), TierError> {
        self.tiered_chunks(tier, u, owned_only, &|_| true, false, &mut |group| {
            out.extend(group);
            Ok(())
        })
    }

    /// [`RankState::tiered_in_unit`] for the chunks `within` says, a group at a time; with
    /// `params_only`, without their optimizer state (not read).
    pub(super) fn tiered_chunks(
        &self,
        tier: &Mutex<TierFile>,
        u: usize,
        owned_only: bool,
        within: &dyn Fn(usize) -> bool,
        params_only: bool,
        emit: &mut Emit<'_>,
    ) -> Result<(), TierError> {
        // The state is the tier's with the owed updates applied.
        if let Some(owed) = &self.owed {
            owed.settle(tier)?;
        }
        let shard = &self.shards[u];
        let kinds = self.tier_kinds();
        let masters_in_shard = self.masters_in_shard();
        let per = if params_only {
            0
        } else {
            self.optim.state_per_param() as usize
        };
        // (chunk, its range in the unit, its offset in the shard) of the chunks wanted.
        let mut owned = Vec::new();
        let mut off = 0;
        for (&c, r) in shard.chunks.iter().zip(&shard.ranges) {
            if within(c) && (!owned_only || self.map.owner(u, c) == self.rank) {
                owned.push((c, r.clone(), off));
            }
            off += r.len();
        }
        let mut at = 0;
        while at < owned.len() {
            // A group: consecutive in the shard, at most GROUP_ELEMS (or one chunk).
            let mut end = at + 1;
            let start = owned[at].2;
            while end < owned.len()
                && owned[end].2 == owned[end - 1].2 + owned[end - 1].1.len()
                && owned[end].2 + owned[end].1.len() - start <= GROUP_ELEMS
            {
                end += 1;
            }
            let stop = owned[end - 1].2 + owned[end - 1].1.len();
            let mut t = tier.lock().unwrap_or_else(|p| p.into_inner());
            let params = kinds
                .params
                .then(|| read_shard_values(&mut t, u, 0, start..stop))
                .transpose()?;
            let mut state = Vec::new();
            for k in 0..per {
                state.push(if kinds.state > 0 {
                    Some(read_shard_values(
                        &mut t,
                        u,
                        kinds.state_at() + k,
                        start..stop,
                    )?)
                } else {
                    None
                });
            }
            drop(t);
            let mut group = Vec::with_capacity(end - at);
            for (c, r, off) in owned[at..end].iter().cloned() {
                let local = off - start..off - start + r.len();
                let p = match (&params, masters_in_shard) {
                    (Some(p), _) => p[local.clone()].to_vec(),
                    (None, true) => shard.params[off..off + r.len()].to_vec(),
                    (None, false) => self.full[u].values(r.clone()),
                };
                let value = |k: usize| match state.get(k) {
                    Some(Some(v)) => v[local.clone()].to_vec(),
                    Some(None) => {
                        let v = if k == 0 { &shard.opt.m } else { &shard.opt.v };
                        v[off..off + r.len()].to_vec()
                    }
                    None => Vec::new(),
                };
                group.push(ChunkState {
                    unit: u as u32,
                    index: c as u32,
                    params: p,
                    m: value(0),
                    v: value(1),
                });
            }
            emit(group)?;
            at = end;
        }
        Ok(())
    }

    /// The state of chunks `chunks` of unit `u` (ascending indices), every one of which this
    /// rank must own, in index order; with `params_only`, without optimizer state. Streamed
    /// snapshots and digests read a rank's chunks a bounded piece at a time with this.
    pub fn owned_chunks_in(
        &self,
        u: usize,
        chunks: &[usize],
        params_only: bool,
    ) -> Result<Vec<ChunkState>, String> {
        let unit = self
            .map
            .units
            .get(u)
            .ok_or_else(|| format!("unit {u} does not exist"))?;
        if chunks.is_empty() || !chunks.is_sorted_by(|a, b| a < b) {
            return Err(format!(
                "unit {u}: chunks {chunks:?} are not an ascending list"
            ));
        }
        if let Some(&c) = chunks
            .iter()
            .find(|&&c| unit.owners.get(c) != Some(&self.rank))
        {
            return Err(format!("chunk {u}/{c} is not owned by rank {}", self.rank));
        }
        let mut out = Vec::with_capacity(chunks.len());
        match &self.tier {
            Some(t) => {
                let wanted = |c: usize| chunks.binary_search(&c).is_ok();
                self.tiered_chunks(t, u, true, &wanted, params_only, &mut |group| {
                    out.extend(group);
                    Ok(())
                })
                .map_err(|e| e.to_string())?
            }
            None => {
                for &c in chunks {
                    out.extend(self.try_chunk_state(u, c).map_err(|e| e.to_string())?);
                }
            }
        }
        if params_only {
            for c in &mut out {
                c.m = Vec::new();
                c.v = Vec::new();
            }
        }
        if out.len() != chunks.len() {
            return Err(format!(
                "rank {} holds {} of chunks {u}/{chunks:?}",
                self.rank,
                out.len()
            ));
        }
        Ok(out)
    }
}

/// Chunk states for a reshard's base, read through a one-group cache: with a tier, a miss reads
/// the group of the shard that starts at the chunk (at most [`GROUP_ELEMS`] elements) and keeps
/// it, so reading a unit's chunks in order passes through each tier record once rather than
/// once per chunk (a record holds up to 32 default chunks).
pub struct CachedChunks<'a> {
    state: &'a RankState,
    group: std::cell::RefCell<std::collections::BTreeMap<(usize, usize), ChunkState>>,
}

impl RankState {
    pub fn cached_chunks(&self) -> CachedChunks<'_> {
        CachedChunks {
            state: self,
            group: Default::default(),
        }
    }
}

impl CachedChunks<'_> {
    /// [`RankState::chunk_state`] of (`u`, `i`).
    pub fn get(&self, u: usize, i: usize) -> Option<ChunkState> {
        let st = self.state;
        let Some(t) = &st.tier else {
            return st.chunk_state(u, i);
        };
        if let Some(c) = self.group.borrow().get(&(u, i)) {
            return Some(c.clone());
        }
        let shard = st.shards.get(u)?;
        let Some(at) = shard.chunks.iter().position(|&c| c == i) else {
            return st.chunk_state(u, i); // not in the shard: nothing of it is on the tier
        };
        let mut elems = 0;
        let window: Vec<usize> = shard.chunks[at..]
            .iter()
            .zip(&shard.ranges[at..])
            .take_while(|(_, r)| {
                elems += r.len();
                elems <= GROUP_ELEMS
            })
            .map(|(&c, _)| c)
            .collect();
        let window = if window.is_empty() { vec![i] } else { window };
        let mut sorted = window.clone();
        sorted.sort_unstable();
        let wanted = |c: usize| sorted.binary_search(&c).is_ok();
        let mut group = std::collections::BTreeMap::new();
        let read = st.tiered_chunks(t, u, false, &wanted, false, &mut |chunks| {
            group.extend(chunks.into_iter().map(|c| ((u, c.index as usize), c)));
            Ok(())
        });
        if let Err(e) = read {
            tracing::error!(rank = st.rank, "{e}");
            return None;
        }
        let c = group.get(&(u, i)).cloned();
        *self.group.borrow_mut() = group;
        c
    }
}
