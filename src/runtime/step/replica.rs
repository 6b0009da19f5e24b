//! Buddy replication: every few steps each rank keeps a copy of its own state and sends a copy
//! of the chunks it owns to its buddy (the next member on the backup ring, `plan::replica`).
//! When a rank vanishes, the survivors roll back to that backup, take the lost rank's chunks
//! from its buddy, and replay the steps since: micro-batches are pure functions of the step,
//! so nothing is lost.
//!
//! A rank and its buddy dying together loses the chunks only they held; recovery then refuses
//! and names them, rather than continuing with wrong state.

use std::collections::BTreeMap;

use super::comm::{Comm, CommError};
use super::parcel::{decode_parcel, encode_parcel};
use super::rank_state::{ChunkState, RankState};
use crate::plan::replica::{buddy, predecessor};
use crate::runtime::transport::{Tag, TagKind, Transport};

/// What a rank keeps to survive a peer's (or its own restart's) loss.
#[derive(Clone, Debug, Default)]
pub struct Backup {
    pub epoch: u64,
    /// The step the backup was taken before (progress.step).
    pub step: u64,
    /// Everything this rank held, as chunk states.
    pub local: BTreeMap<(usize, usize), ChunkState>,
    /// The chunks its predecessor owned, with their full state.
    pub held: BTreeMap<(usize, usize), ChunkState>,
}

impl Backup {
    /// What this rank can contribute to a rollback: its own copy, completed by the held
    /// replicas (a stage 1/2 rank holds every parameter locally, optimizer state in `held`).
    pub fn chunk(&self, u: usize, i: usize) -> Option<ChunkState> {
        match (self.local.get(&(u, i)), self.held.get(&(u, i))) {
            (Some(l), Some(h)) if l.m.is_empty() && l.v.is_empty() => Some(ChunkState {
                params: l.params.clone(),
                ..h.clone()
            }),
            (Some(l), _) => Some(l.clone()),
            (None, h) => h.cloned(),
        }
    }

    pub fn bytes(&self) -> u64 {
        let size = |c: &ChunkState| 4 * (c.params.len() + c.m.len() + c.v.len()) as u64;
        self.local
            .values()
            .chain(self.held.values())
            .map(size)
            .sum()
    }
}

/// Takes this rank's backup before step `step`: keeps a local copy and exchanges replicas with
/// its buddy and predecessor. With `vanish` (fault injection) the rank stops after sending.
pub fn replicate<T: Transport>(
    state: &RankState,
    comm: &mut Comm<T>,
    step: u64,
    vanish: bool,
) -> Result<Backup, CommError> {
    let map = &state.map;
    let me = state.rank;
    comm.begin_step(map.epoch, step);
    let tag = Tag {
        kind: TagKind::Replica,
        attempt: 0,
        unit: 0,
        pass: 0,
    };
    // A tier that cannot be read makes this rank's state untrustworthy: it fails, rather than
    // its buddy blaming itself for a short parcel.
    let local: BTreeMap<(usize, usize), ChunkState> = state
        .held_chunk_states()
        .map_err(|e| CommError::Storage(e.to_string()))?
        .into_iter()
        .map(|c| ((c.unit as usize, c.index as usize), c))
        .collect();
    if let Some(b) = buddy(map, me) {
        let owned = state
            .owned_chunk_states()
            .map_err(|e| CommError::Storage(e.to_string()))?;
        comm.send(b, tag, encode_parcel(&owned))?;
    }
    if vanish {
        return Err(CommError::Vanished);
    }
    let mut held = BTreeMap::new();
    if let Some(p) = predecessor(map, me) {
        let expect: Vec<(usize, usize)> = map
            .owned_chunks(p)
            .iter()
            .map(|c| (c.unit as usize, c.index as usize))
            .collect();
        for c in decode_parcel(p, &comm.recv(p, tag)?, &expect)? {
            held.insert((c.unit as usize, c.index as usize), c);
        }
    }
    Ok(Backup {
        epoch: map.epoch,
        step,
        local,
        held,
    })
}
