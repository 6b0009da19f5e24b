//! Buddy replication: every few steps each rank keeps a copy of its own state and sends a copy
//! of the chunks it owns to its buddy (the next member on the backup ring, `plan::replica`).
//! When a rank vanishes, the survivors roll back to that backup, take the lost rank's chunks
//! from its buddy, and replay the steps since: micro-batches are pure functions of the step,
//! so nothing is lost.
//!
//! A rank and its buddy dying together loses the chunks only they held; recovery then refuses
//! and names them, rather than continuing with wrong state.
//!
//! With state on the tier, both halves of the backup go to files in the rank's tier folder
//! (`storage::ChunkFile`), written a group at a time, and the replica travels in pieces of at
//! most `GROUP_ELEMS` elements, each sent before the next is received from the predecessor: a
//! backup of a model larger than memory holds a few pieces in RAM, not the model.

use crate::plan::replica::{buddy, predecessor};
use crate::runtime::step::comm::{Comm, CommError};
use crate::runtime::step::elastic::chunk_set::{ChunkSet, Filling};
use crate::runtime::step::elastic::parcel::{decode_parcel, encode_parcel};
use crate::runtime::step::progress::RunProgress;
use crate::runtime::step::state::rank_state::{ChunkState, RankState};
use crate::runtime::step::state::tier_reads::GROUP_ELEMS;
use crate::runtime::storage::TierError;
use crate::runtime::transport::{Tag, TagKind, Transport};

/// What a rank keeps to survive a peer's (or its own restart's) loss.
#[derive(Clone, Debug, Default)]
pub struct Backup {
    pub epoch: u64,
    /// The step the backup was taken before (progress.step).
    pub step: u64,
    /// Everything this rank held, as chunk states.
    local: ChunkSet,
    /// The chunks its predecessor owned, with their full state.
    held: ChunkSet,
}

impl Backup {
    /// What this rank can contribute to a rollback: its own copy, completed by the held
    /// replicas (a stage 1/2 rank holds every parameter locally, the owner's masters and
    /// optimizer state in `held`).
    /// A backup file that cannot be read is logged and its chunk reported missing, so the
    /// rollback stops rather than use it.
    pub fn chunk(&self, u: usize, i: usize) -> Option<ChunkState> {
        let read = |set: &ChunkSet| {
            set.get(u, i).unwrap_or_else(|e| {
                tracing::error!("backup of chunk {u}/{i}: {e}");
                None
            })
        };
        // The replica is read only when the local copy lacks the optimizer state, and then
        // taken whole: its parameters are the owner's masters, where the local copy's may be
        // the bf16 full copy's (under mixed precision the copy is not the master).
        match read(&self.local) {
            Some(l) if l.m.is_empty() && l.v.is_empty() => read(&self.held).or(Some(l)),
            Some(l) => Some(l),
            None => read(&self.held),
        }
    }
}

/// Takes this rank's backup before step `step`: keeps a local copy and exchanges replicas with
/// its buddy and predecessor. With `vanish` (fault injection) the rank stops after sending.
pub fn replicate<T: Transport>(
    state: &RankState,
    comm: &mut Comm<T>,
    step: u64,
    vanish: bool,
    progress: &RunProgress,
) -> Result<Backup, CommError> {
    let map = &state.map;
    let me = state.rank;
    comm.begin_step(map.epoch, step);
    // A tier that cannot be read or written makes this rank's state untrustworthy: it fails,
    // rather than its buddy blaming itself for a short parcel.
    let storage = |e: TierError| CommError::Storage(e.to_string());
    let dir = state.tier_dir();
    let mut local = Filling::new(dir.as_deref(), "local", map.epoch, step).map_err(storage)?;
    let beat = || progress.beat(me, map.epoch, step);
    state
        .for_each_held(&mut |group| {
            beat();
            local.extend(group)
        })
        .map_err(storage)?;
    let local = local.done().map_err(storage)?;
    // The replica goes to the buddy in pieces, piece k under tag k, each sent before piece k
    // from the predecessor is taken, so no link carries more than a piece or two at a time.
    let tag = |k: usize| Tag {
        kind: TagKind::Replica,
        attempt: 0,
        unit: k as u32,
        pass: 0,
        piece: 0,
    };
    let to = buddy(map, me);
    let outgoing = match to {
        Some(_) => map.owned_batches(me, GROUP_ELEMS),
        None => Vec::new(),
    };
    let from = predecessor(map, me);
    let expect: Vec<(usize, usize)> = match from {
        Some(p) => map
            .owned_chunks(p)
            .iter()
            .map(|c| (c.unit as usize, c.index as usize))
            .collect(),
        None => Vec::new(),
    };
    let mut held = Filling::new(dir.as_deref(), "held", map.epoch, step).map_err(storage)?;
    let (mut sent, mut got, mut k_in) = (0, 0, 0);
    while sent < outgoing.len() || (got < expect.len() && !vanish) {
        if let (Some(b), Some(batch)) = (to, outgoing.get(sent)) {
            let mut piece = Vec::new();
            for (u, chunks) in batch {
                piece.extend(
                    state
                        .owned_chunks_in(*u, chunks, false)
                        .map_err(CommError::Storage)?,
                );
            }
            comm.send(b, tag(sent), encode_parcel(&piece))?;
            beat();
            sent += 1;
            if vanish {
                continue; // sends everything, then stops
            }
        }
        if let Some(p) = from.filter(|_| got < expect.len()) {
            let payload = comm.recv(p, tag(k_in))?;
            let count = payload
                .get(..4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
                .filter(|&n| n > 0 && got + n <= expect.len())
                .ok_or_else(|| CommError::Protocol {
                    from: p,
                    what: format!("replica piece {k_in} does not fit the chunks still due"),
                })?;
            let chunks = decode_parcel(p, &payload, &expect[got..got + count])?;
            held.extend(chunks).map_err(storage)?;
            beat();
            got += count;
            k_in += 1;
        }
    }
    if vanish {
        return Err(CommError::Vanished);
    }
    Ok(Backup {
        epoch: map.epoch,
        step,
        local,
        held: held.done().map_err(storage)?,
    })
}
