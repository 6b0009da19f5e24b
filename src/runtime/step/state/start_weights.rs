//! Reading a rank's starting parameters from a [`WeightSource`]: which chunks of a unit the
//! rank keeps, and those chunks in one read of coalesced ranges.

use std::collections::BTreeMap;

use crate::model::weights::{coalesce, WeightSource};
use crate::plan::{RankId, ShardMap, Stage};

/// The chunks of unit `u` whose parameters `rank` starts from under `stage`: all of them for
/// stages 0-2 (which keep a full copy), its own for stage 3.
pub fn kept_chunks(map: &ShardMap, u: usize, rank: RankId, stage: Stage) -> Vec<usize> {
    match stage {
        Stage::Zero3 => map.owned_in_unit(u, rank).collect(),
        _ => (0..map.units[u].owners.len()).collect(),
    }
}

/// Chunks `indices` (ascending) of unit `u`, by index, read from `weights` in one request for
/// their ranges with touching neighbours merged.
pub fn read_chunks(
    weights: &dyn WeightSource,
    map: &ShardMap,
    u: usize,
    indices: &[usize],
) -> Result<BTreeMap<usize, Vec<f32>>, String> {
    let runs = coalesce(indices.iter().map(|&i| map.chunk_range(u, i)));
    let read = weights.read(u, &runs)?;
    if read.len() != runs.len() || read.iter().zip(&runs).any(|(v, r)| v.len() != r.len()) {
        return Err(format!(
            "{} gave unit {u} pieces of the wrong sizes",
            weights.describe()
        ));
    }
    let mut out = BTreeMap::new();
    let mut pieces = runs.iter().zip(read);
    let mut current = pieces.next();
    for &i in indices {
        let r = map.chunk_range(u, i);
        // Runs are in chunk order, so the run holding chunk i is the current one or a later one.
        while let Some((run, _)) = &current {
            if r.start < run.end {
                break;
            }
            current = pieces.next();
        }
        let (run, values) = current
            .as_ref()
            .ok_or_else(|| format!("chunk {u}/{i} lies outside what was read"))?;
        out.insert(i, values[r.start - run.start..r.end - run.start].to_vec());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records each read's ranges.
    struct Recording(
        Vec<Vec<f32>>,
        std::sync::Mutex<Vec<Vec<std::ops::Range<usize>>>>,
    );

    impl WeightSource for Recording {
        fn read(
            &self,
            unit: usize,
            ranges: &[std::ops::Range<usize>],
        ) -> Result<Vec<Vec<f32>>, String> {
            self.1.lock().unwrap().push(ranges.to_vec());
            self.0.read(unit, ranges)
        }
        fn describe(&self) -> String {
            "recording".into()
        }
    }

    #[test]
    fn stage_3_reads_only_its_own_chunks_in_one_request() {
        let unit: Vec<f32> = (0..10).map(|x| x as f32).collect();
        let map = ShardMap::plan(&[10], &[0, 1], 2, 1).unwrap();
        let src = Recording(vec![unit.clone()], Default::default());
        for rank in [0, 1] {
            let kept = kept_chunks(&map, 0, rank, Stage::Zero3);
            let got = read_chunks(&src, &map, 0, &kept).unwrap();
            for (i, v) in &got {
                assert_eq!(map.owner(0, *i), rank);
                assert_eq!(v[..], unit[map.chunk_range(0, *i)]);
            }
        }
        let reads = src.1.lock().unwrap();
        assert_eq!(reads.len(), 2, "one request per rank and unit");
        let elems: usize = reads.iter().flatten().map(|r| r.len()).sum();
        assert_eq!(elems, 10, "together the ranks read the unit once");
        drop(reads);
        let all = read_chunks(&src, &map, 0, &kept_chunks(&map, 0, 0, Stage::Zero2)).unwrap();
        assert_eq!(all.len(), 5);
        let last = src.1.lock().unwrap().last().unwrap().clone();
        assert_eq!((last.len(), last[0].clone()), (1, 0..10));
    }
}
