//! Resharding in place: ranks move chunk states peer to peer to go from one shard map to the
//! next, then rebuild their state for the new map. No process restarts, no checkpoint.
//!
//! Who sends what is a pure function of (old map, new map, stage, where the masters live),
//! computed identically on every rank, so each rank knows exactly which frames to expect. Only
//! what the receiver lacks travels: a stage 0-2 member already holds every parameter, so in fp32
//! training it receives optimizer state only (under bf16 its copy is not the master: the fp32
//! master travels with the state); a stage 0 member already holds everything; a joiner receives
//! all it must keep. Every chunk carries a checksum computed by its sender and verified by its
//! receiver.
//!
//! What moves is bounded by pieces, not by the model: each link's list travels in pieces of at
//! most `GROUP_ELEMS` elements (12 MiB of Adam state), piece k of every link in round k, and with
//! a tier the receiver appends what arrives to a chunk file in its tier folder (`chunk_set.rs`)
//! rather than RAM, so a leave or join of state larger than memory holds a round's pieces.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::model::backend::Precision;
use crate::model::Model;
use crate::plan::memory::masters_in_shard;
use crate::plan::{RankId, ShardMap, Stage};
use crate::reduce::ReduceMode;
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::step::elastic::chunk_set::{ChunkSet, Filling};
use crate::runtime::step::elastic::parcel::{decode_parcel, encode_parcel};
use crate::runtime::step::progress::RunProgress;
use crate::runtime::step::state::rank_state::{ChunkSource, ChunkState, OptimSettings, RankState};
use crate::runtime::step::state::tier_reads::GROUP_ELEMS;
use crate::runtime::storage::{TierError, TierSpec};
use crate::runtime::transport::{Tag, TagKind, Transport};

/// What one chunk transfer carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Need {
    pub params: bool,
    pub opt: bool,
}

/// One chunk transfer: (unit, index, what travels).
pub type Move = (usize, usize, Need);

/// (from, to) -> the chunks that travel, where `from` is a member of the old map that holds
/// the chunk's state.
pub type Transfers = BTreeMap<(RankId, RankId), Vec<Move>>;

/// A link's transfers cut into pieces: (the peer, the pieces in order).
type Link = (RankId, Vec<Vec<Move>>);

/// Transfers for a reshard from `old` to `new`, where `sender(unit, index)` is the rank that
/// holds the chunk's state (its owner under `old`, or its buddy if the owner was lost).
/// `masters_in_shard`: the fp32 masters live with the optimizer state, not in a full copy
/// (`plan::memory::masters_in_shard`), so a new owner needs them from the sender.
pub fn transfers(
    old: &ShardMap,
    new: &ShardMap,
    stage: Stage,
    masters_in_shard: bool,
    sender: &dyn Fn(usize, usize) -> RankId,
) -> Transfers {
    let mut out = Transfers::new();
    let joiners: Vec<RankId> = new
        .members
        .iter()
        .copied()
        .filter(|r| !old.is_member(*r))
        .collect();
    for (u, unit) in new.units.iter().enumerate() {
        for (i, &to) in unit.owners.iter().enumerate() {
            let from = sender(u, i);
            let need = if joiners.contains(&to) {
                Some(Need {
                    params: true,
                    opt: true,
                })
            } else if from != to {
                match stage {
                    Stage::Zero0 => None,
                    Stage::Zero1 | Stage::Zero2 => Some(Need {
                        params: masters_in_shard,
                        opt: true,
                    }),
                    Stage::Zero3 => Some(Need {
                        params: true,
                        opt: true,
                    }),
                }
            } else {
                None
            };
            if let Some(need) = need {
                out.entry((from, to)).or_default().push((u, i, need));
            }
            if stage != Stage::Zero3 {
                // Joiners keep every parameter (stages 0-2) and all optimizer state (stage 0).
                for &j in joiners.iter().filter(|&&j| j != to) {
                    out.entry((from, j)).or_default().push((
                        u,
                        i,
                        Need {
                            params: true,
                            opt: stage == Stage::Zero0,
                        },
                    ));
                }
            }
        }
    }
    out
}

/// Everything a rank needs to rebuild itself for the new map.
pub struct Reshard<'a> {
    /// Who sends each chunk (see `transfers`).
    pub sender: &'a dyn Fn(usize, usize) -> RankId,
    pub old: &'a ShardMap,
    pub new: &'a ShardMap,
    pub stage: Stage,
    pub mode: ReduceMode,
    pub model: Arc<dyn Model>,
    pub optim: OptimSettings,
    pub precision: Precision,
    /// Where the rebuilt state puts what the placement moves out of RAM.
    pub storage: Option<&'a TierSpec>,
    pub step: u64,
    /// Fault injection: the rank vanishes after sending half of what it owes.
    pub vanish: bool,
    /// Where each parcel sent or received counts as progress (a reshard of state on a slow disk
    /// takes as long as it needs while pieces move).
    pub progress: &'a RunProgress,
}

impl Reshard<'_> {
    /// Sends what this rank owes, receives what it is owed, verifies it, and returns the rank's
    /// state under the new map (`None` for a rank that is leaving). `base` is what this rank
    /// holds: its current state, or its backups when rolling back; nothing for a joiner.
    pub fn run<T: Transport>(
        &self,
        me: RankId,
        base: &ChunkSource<'_>,
        comm: &mut Comm<T>,
    ) -> Result<Option<RankState>, CommError> {
        comm.begin_step(self.new.epoch, self.step);
        let (outgoing, incoming) = self.links(me);
        let received = self.exchange(me, base, comm, &outgoing, &incoming)?;
        if !self.new.is_member(me) {
            return Ok(None);
        }
        let received = received
            .done()
            .map_err(|e| CommError::Storage(e.to_string()))?;
        self.rebuild(me, base, &received).map(Some)
    }

    /// This rank's links, each list cut in pieces: those it sends on, and those it receives on
    /// (none for a rank that is leaving).
    fn links(&self, me: RankId) -> (Vec<Link>, Vec<Link>) {
        let masters = masters_in_shard(self.stage, self.precision.param_bytes());
        let plan = transfers(self.old, self.new, self.stage, masters, self.sender);
        let cut = |list: &[Move]| pieces(list, self.old, GROUP_ELEMS);
        let outgoing: Vec<Link> = plan
            .iter()
            .filter(|((f, _), _)| *f == me)
            .map(|((_, to), list)| (*to, cut(list)))
            .collect();
        let incoming: Vec<Link> = plan
            .iter()
            .filter(|((_, t), _)| *t == me && self.new.is_member(me))
            .map(|((from, _), list)| (*from, cut(list)))
            .collect();
        (outgoing, incoming)
    }

    /// Moves the pieces, round by round, and returns what arrived.
    ///
    /// Every list travels in pieces of at most GROUP_ELEMS elements, piece k of every link in
    /// round k: each rank sends its round's pieces, then takes the pieces due to it, so no link
    /// carries more than a round's piece or two whatever the model's size.
    fn exchange<T: Transport>(
        &self,
        me: RankId,
        base: &ChunkSource<'_>,
        comm: &mut Comm<T>,
        outgoing: &[Link],
        incoming: &[Link],
    ) -> Result<Filling, CommError> {
        let tag = |k: usize| Tag {
            kind: TagKind::Reshard,
            attempt: 0,
            unit: k as u32,
            pass: 0,
            piece: 0,
        };
        let rounds = outgoing
            .iter()
            .chain(incoming)
            .map(|(_, p)| p.len())
            .max()
            .unwrap_or(0);
        let owed: usize = outgoing.iter().map(|(_, p)| p.len()).sum();
        let vanish_after = self.vanish.then_some(owed / 2);
        let storage = |e: TierError| CommError::Storage(e.to_string());
        // With a tier, what arrives goes to a file in the rank's tier folder, not RAM.
        let dir = self.storage.map(|s| s.rank_dir(me));
        let mut received =
            Filling::new(dir.as_deref(), "reshard", self.new.epoch, self.step).map_err(storage)?;
        let mut sent = 0;
        for k in 0..rounds {
            for (to, piece) in outgoing.iter().filter_map(|(to, p)| Some((to, p.get(k)?))) {
                if vanish_after == Some(sent) {
                    return Err(CommError::Vanished);
                }
                let chunks: Vec<ChunkState> = piece
                    .iter()
                    .map(|&(u, i, need)| pick(base, me, self.optim, u, i, need))
                    .collect::<Result<_, _>>()?;
                comm.send(*to, tag(k), encode_parcel(&chunks))?;
                sent += 1;
                self.progress.beat(me, self.new.epoch, self.step);
            }
            for (from, piece) in incoming.iter().filter_map(|(f, p)| Some((f, p.get(k)?))) {
                let payload = comm.recv(*from, tag(k))?;
                let expect: Vec<(usize, usize)> = piece.iter().map(|&(u, i, _)| (u, i)).collect();
                received
                    .extend(decode_parcel(*from, &payload, &expect)?)
                    .map_err(storage)?;
                self.progress.beat(me, self.new.epoch, self.step);
            }
        }
        if vanish_after.is_some() {
            return Err(CommError::Vanished);
        }
        Ok(received)
    }

    /// The rank's state under the new map: what it received over what it held.
    fn rebuild(
        &self,
        me: RankId,
        base: &ChunkSource<'_>,
        received: &ChunkSet,
    ) -> Result<RankState, CommError> {
        // A received chunk that cannot be read back fails the rebuild with its error, never
        // falls back to what this rank held before.
        let unreadable: std::cell::RefCell<Option<String>> = Default::default();
        let source = |u: usize, i: usize| -> Option<ChunkState> {
            let got = match received.get(u, i) {
                Ok(got) => got,
                Err(e) => {
                    unreadable.borrow_mut().get_or_insert(e.to_string());
                    return None;
                }
            };
            let own = base(u, i);
            match (got, own) {
                (Some(r), Some(mut o)) => {
                    if !r.params.is_empty() {
                        o.params = r.params;
                    }
                    if !(r.m.is_empty() && r.v.is_empty()) {
                        o.m = r.m;
                        o.v = r.v;
                    }
                    Some(o)
                }
                (Some(r), None) => Some(r),
                (None, own) => own,
            }
        };
        RankState::from_chunks(
            me,
            self.stage,
            self.mode,
            Arc::clone(&self.model),
            self.new.clone(),
            self.optim,
            self.precision,
            &source,
            self.storage,
        )
        .map_err(|what| match unreadable.take() {
            Some(e) => CommError::Storage(e),
            None => CommError::Protocol { from: me, what },
        })
    }
}

/// `list` cut, in order, into pieces of at most `max_elems` elements of `map`'s chunks (a chunk
/// larger than that is a piece of its own).
pub fn pieces(list: &[Move], map: &ShardMap, max_elems: usize) -> Vec<Vec<Move>> {
    let mut out: Vec<Vec<Move>> = Vec::new();
    let mut elems = 0;
    for &(u, i, need) in list {
        let n = map.chunk_range(u, i).len();
        match out.last_mut() {
            Some(last) if elems + n <= max_elems => last.push((u, i, need)),
            _ => {
                out.push(vec![(u, i, need)]);
                elems = 0;
            }
        }
        elems += n;
    }
    out
}

fn pick(
    base: &ChunkSource<'_>,
    me: RankId,
    optim: OptimSettings,
    u: usize,
    i: usize,
    need: Need,
) -> Result<ChunkState, CommError> {
    let mut c = base(u, i).ok_or_else(|| CommError::Protocol {
        from: me,
        what: format!("chunk {u}/{i} is not held here"),
    })?;
    if !need.params {
        c.params.clear();
    }
    if !need.opt {
        c.m.clear();
        c.v.clear();
    }
    if need.opt && c.m.is_empty() && c.v.is_empty() && optim.state_per_param() > 0 {
        return Err(CommError::Protocol {
            from: me,
            what: format!("optimizer state of chunk {u}/{i} is not held here"),
        });
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_cut_into_pieces_of_bounded_elements_in_order() {
        let map = ShardMap::plan(&[1000, 600], &[0, 1], 100, 1).unwrap();
        let need = Need {
            params: true,
            opt: true,
        };
        let list: Vec<_> = (0..10)
            .map(|i| (0, i, need))
            .chain([(1, 0, need)])
            .collect();
        let p = pieces(&list, &map, 250);
        assert_eq!(
            p.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![2, 2, 2, 2, 2, 1]
        );
        assert_eq!(p.concat(), list);
        // A chunk larger than a piece is a piece of its own; nothing is a piece of nothing.
        assert_eq!(pieces(&list, &map, 50).len(), list.len());
        assert!(pieces(&[], &map, 250).is_empty());
    }

    #[test]
    fn a_stage1_leave_moves_optimizer_state_only_and_a_join_gets_everything() {
        let old = ShardMap::plan(&[1000, 600], &[0, 1, 2], 100, 1).unwrap();
        let (leave, _) = crate::plan::rebalance::rebalance(&old, &[0, 2]).unwrap();
        let owner = |u, i| old.owner(u, i);
        let t = transfers(&old, &leave, Stage::Zero1, false, &owner);
        assert!(t.keys().all(|(f, _)| *f == 1));
        assert!(t.values().flatten().all(|(_, _, n)| !n.params && n.opt));
        // Under bf16 the full copy is not the master: the master moves with the state.
        let t = transfers(&old, &leave, Stage::Zero1, true, &owner);
        assert!(t.keys().all(|(f, _)| *f == 1));
        assert!(t.values().flatten().all(|(_, _, n)| n.params && n.opt));
        assert!(transfers(&old, &leave, Stage::Zero0, false, &owner).is_empty());
        assert!(transfers(&old, &leave, Stage::Zero0, true, &owner).is_empty());
        let (join, _) = crate::plan::rebalance::rebalance(&old, &[0, 1, 2, 3]).unwrap();
        let t = transfers(&old, &join, Stage::Zero2, false, &owner);
        // The joiner receives every parameter once, and optimizer state for what it owns.
        let to_joiner: Vec<_> = t
            .iter()
            .filter(|((_, to), _)| *to == 3)
            .flat_map(|(_, l)| l)
            .collect();
        let params: usize = to_joiner
            .iter()
            .filter(|(_, _, n)| n.params)
            .map(|&&(u, i, _)| join.chunk_range(u, i).len())
            .sum();
        assert_eq!(params, 1600);
        let opt: usize = to_joiner
            .iter()
            .filter(|(_, _, n)| n.opt)
            .map(|&&(u, i, _)| join.chunk_range(u, i).len())
            .sum();
        assert_eq!(opt, join.owned_elems(3));
    }
}
