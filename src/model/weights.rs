//! Where a run's starting weights come from: the model's own initialisation, parameters in
//! memory, or a checkpoint on disk read a piece at a time.
//!
//! A rank asks for the element ranges of the chunks it keeps, unit by unit, so a source that
//! can read ranges (safetensors offsets, GGUF blocks) never has the whole model in memory:
//! under stage 3 each rank reads only its own chunks.

use std::ops::Range;
use std::sync::Arc;

use super::Model;

/// A model's starting parameters, read by unit and element range of the unit's flat buffer.
pub trait WeightSource: Send + Sync {
    /// The values of `ranges` (sorted, disjoint, inside the unit) of unit `unit`'s flat
    /// parameters, one vector per range. Fails with a message naming what is missing or
    /// unreadable.
    fn read(&self, unit: usize, ranges: &[Range<usize>]) -> Result<Vec<Vec<f32>>, String>;
    /// For messages: where the weights come from.
    fn describe(&self) -> String;
    /// All of unit `unit`, which has `numel` elements.
    fn read_unit(&self, unit: usize, numel: usize) -> Result<Vec<f32>, String> {
        let whole = 0..numel;
        let mut read = self.read(unit, std::slice::from_ref(&whole))?;
        Ok(read.pop().unwrap_or_default())
    }
}

/// Cuts `ranges` out of `unit`, refusing a range past its end.
fn cut(unit: &[f32], ranges: &[Range<usize>]) -> Result<Vec<Vec<f32>>, String> {
    ranges
        .iter()
        .map(|r| {
            unit.get(r.clone()).map(<[f32]>::to_vec).ok_or_else(|| {
                format!(
                    "elements {}..{} are past the unit's {}",
                    r.start,
                    r.end,
                    unit.len()
                )
            })
        })
        .collect()
}

/// Full parameters per unit, in memory.
impl WeightSource for Vec<Vec<f32>> {
    fn read(&self, unit: usize, ranges: &[Range<usize>]) -> Result<Vec<Vec<f32>>, String> {
        let u = self
            .get(unit)
            .ok_or_else(|| format!("unit {unit} of {}: no such unit", self.len()))?;
        cut(u, ranges).map_err(|e| format!("unit {unit}: {e}"))
    }

    fn describe(&self) -> String {
        format!("parameters in memory ({} units)", self.len())
    }
}

/// The model's own seeded initialisation. A unit is made whole for each read, so a caller
/// asks for all it needs of a unit at once.
pub struct ModelInit {
    pub model: Arc<dyn Model>,
    pub seed: u64,
}

impl WeightSource for ModelInit {
    fn read(&self, unit: usize, ranges: &[Range<usize>]) -> Result<Vec<Vec<f32>>, String> {
        let units = self.model.units().len();
        if unit >= units {
            return Err(format!("unit {unit} of {units}: no such unit"));
        }
        cut(&self.model.init_unit(unit, self.seed), ranges).map_err(|e| format!("unit {unit}: {e}"))
    }

    fn describe(&self) -> String {
        format!("the model's initialisation (seed {})", self.seed)
    }
}

/// Sorted, disjoint `ranges` with neighbours that touch merged, so a source reads each
/// contiguous run once.
pub fn coalesce(ranges: impl IntoIterator<Item = Range<usize>>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in ranges {
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    #[test]
    fn memory_reads_ranges_and_refuses_what_is_not_there() {
        let p: Vec<Vec<f32>> = vec![vec![0.0, 1.0, 2.0, 3.0], vec![4.0]];
        assert_eq!(
            p.read(0, &[0..1, 2..4]).unwrap(),
            vec![vec![0.0], vec![2.0, 3.0]]
        );
        assert!(p
            .read(1, &[0..2])
            .unwrap_err()
            .contains("past the unit's 1"));
        assert!(p.read(2, &[0..1]).unwrap_err().contains("no such unit"));
    }

    #[test]
    fn coalesce_merges_touching_runs_only() {
        assert_eq!(coalesce([0..4, 4..8, 12..16, 16..17]), vec![0..8, 12..17]);
        assert_eq!(coalesce([]), Vec::<Range<usize>>::new());
    }
}
