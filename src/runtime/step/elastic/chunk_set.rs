//! Chunk states a rank keeps aside from its training state: the halves of a buddy backup, and
//! the chunks a reshard receives. In RAM without a tier; with one, in a file in the rank's tier
//! folder (`storage::ChunkFile`), so that what a model larger than memory moves or backs up is
//! never held whole.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::runtime::step::state::rank_state::ChunkState;
use crate::runtime::storage::{ChunkFile, TierError};

/// Chunk states kept in RAM, or in a file on the rank's tier.
#[derive(Clone, Debug)]
pub enum ChunkSet {
    Ram(BTreeMap<(usize, usize), ChunkState>),
    Tier(Arc<ChunkFile>),
}

impl Default for ChunkSet {
    fn default() -> Self {
        ChunkSet::Ram(BTreeMap::new())
    }
}

impl ChunkSet {
    pub fn get(&self, u: usize, i: usize) -> Result<Option<ChunkState>, TierError> {
        match self {
            ChunkSet::Ram(m) => Ok(m.get(&(u, i)).cloned()),
            ChunkSet::Tier(f) => Ok(f.read(u, i)?.map(|[params, m, v]| ChunkState {
                unit: u as u32,
                index: i as u32,
                params,
                m,
                v,
            })),
        }
    }
}

/// A [`ChunkSet`] being filled.
pub enum Filling {
    Ram(BTreeMap<(usize, usize), ChunkState>),
    Tier(ChunkFile),
}

impl Filling {
    /// In RAM without a tier folder; else a new file in it, named apart from every other
    /// backup of the process (an older backup of the same step may still be in use).
    pub fn new(
        tier_dir: Option<&Path>,
        what: &str,
        epoch: u64,
        step: u64,
    ) -> Result<Self, TierError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let Some(dir) = tier_dir else {
            return Ok(Filling::Ram(BTreeMap::new()));
        };
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path: PathBuf = dir.join(format!("backup-e{epoch}-s{step}-{n}-{what}.bin"));
        Ok(Filling::Tier(ChunkFile::create(&path)?))
    }

    pub fn extend(&mut self, chunks: Vec<ChunkState>) -> Result<(), TierError> {
        match self {
            Filling::Ram(m) => {
                m.extend(
                    chunks
                        .into_iter()
                        .map(|c| ((c.unit as usize, c.index as usize), c)),
                );
                Ok(())
            }
            Filling::Tier(f) => chunks.iter().try_for_each(|c| {
                f.append(c.unit as usize, c.index as usize, [&c.params, &c.m, &c.v])
            }),
        }
    }

    pub fn done(self) -> Result<ChunkSet, TierError> {
        Ok(match self {
            Filling::Ram(m) => ChunkSet::Ram(m),
            Filling::Tier(mut f) => {
                f.seal()?;
                ChunkSet::Tier(Arc::new(f))
            }
        })
    }
}
