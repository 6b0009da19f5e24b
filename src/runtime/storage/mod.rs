//! The storage seam: where a rank's shard state lives when it is not in RAM.
//!
//! A placement from `plan::tier` says which state goes to the tier; [`TierSpec`] carries it with
//! the directory and the I/O settings, and opens each rank's [`TierFile`] (one preallocated file
//! in the rank's own subfolder) on a device: [`uring::UringDevice`] on the disk, or
//! [`device::MemDevice`], the reference device tests inject faults into. Buddy backups of
//! offloaded state go to [`ChunkFile`]s beside the tier file.
//!
//! Imports: `plan`, the run plan's tier (`job::run_plan::TierPlan`), `crate::runtime::alloc` and
//! below; nothing above (the step uses this).
//!
//! Design: docs/memory-and-tier.md.

pub mod aligned;
pub mod chunk_file;
pub mod device;
pub mod folder;
pub mod preflight;
pub mod tier_file;
pub mod uring;

use std::path::{Path, PathBuf};

pub use self::aligned::AlignedBuf;
pub use self::chunk_file::ChunkFile;
pub use self::device::{Faults, FaultyDevice, IoError};
pub use self::preflight::{check_dir, lock_dir, DirLock, PreflightError};
pub use self::tier_file::{RecordKinds, TierError, TierFile, TierLayout, TierStats};
pub use self::uring::UringConfig;
use self::uring::UringDevice;
use crate::config::NvmeFaultKind;
use crate::job::run_plan::TierPlan;
use crate::plan::tier::Placement;

/// Everything a rank needs to put its state on the tier.
#[derive(Clone, Debug, PartialEq)]
pub struct TierSpec {
    pub dir: PathBuf,
    pub placement: Placement,
    pub tile_elems: usize,
    pub staging_buffers: usize,
    pub uring: UringConfig,
    /// Tests: the reference device (a file in RAM) instead of the disk.
    pub simulate: bool,
    /// Fault injection: faults in front of this rank's device.
    pub faults: Option<(u32, Faults)>,
    /// Each unit's update runs in the backward (`plan::tier::updates_in_backward`): the files
    /// keep two copies of p, m and v and no gradients.
    pub update_in_backward: bool,
    /// That update takes the parameter shard the backward's gather read (`Fit::update_reuses_params`).
    pub update_reuses_params: bool,
}

impl TierSpec {
    /// Checks the tier directory (exists, writable, not RAM, direct I/O unless `buffered`, room
    /// for `need_bytes`) and locks it for this run.
    pub fn for_run(
        dir: &Path,
        placement: Placement,
        tile_elems: usize,
        staging_buffers: usize,
        uring: UringConfig,
        need_bytes: u64,
    ) -> Result<(TierSpec, DirLock), PreflightError> {
        check_dir(dir, 0, !uring.direct)?;
        let lock = lock_dir(dir)?;
        // Files an earlier run could not remove (it was killed, or ended without dropping its
        // ranks) are scratch nobody can use: their space counts for this run.
        let swept = sweep_stale(dir);
        if swept > 0 {
            tracing::info!(
                "tier {}: removed {swept} stale files of an earlier run",
                dir.display()
            );
        }
        check_dir(dir, need_bytes, !uring.direct)?;
        Ok((
            TierSpec {
                dir: dir.to_path_buf(),
                placement,
                tile_elems,
                staging_buffers,
                uring,
                simulate: false,
                faults: None,
                update_in_backward: false,
                update_reuses_params: false,
            },
            lock,
        ))
    }

    /// The tier a run plan asks for, its directory checked and locked (see [`TierSpec::for_run`]),
    /// with the plan's fault in front of its rank's device.
    pub fn for_plan(plan: &TierPlan) -> Result<(TierSpec, DirLock), PreflightError> {
        let uring = UringConfig {
            queue_depth: plan.queue_depth,
            block_bytes: plan.block_bytes,
            direct: plan.direct,
        };
        let (spec, lock) = TierSpec::for_run(
            &plan.dir,
            plan.placement,
            plan.tile_elems,
            plan.staging_buffers,
            uring,
            plan.need_bytes,
        )?;
        let faults = plan.fault.map(|f| {
            let faults = match f.kind {
                NvmeFaultKind::FailWrites { errno, after_bytes } => Faults {
                    fail_after_write_bytes: Some(after_bytes),
                    errno,
                    ..Faults::default()
                },
                NvmeFaultKind::SlowReads { ms } => Faults {
                    read_delay_ms: ms,
                    ..Faults::default()
                },
            };
            (f.rank, faults)
        });
        let spec = TierSpec {
            update_in_backward: plan.update_in_backward,
            update_reuses_params: plan.update_reuses_params,
            faults,
            ..spec
        };
        Ok((spec, lock))
    }

    /// This rank's folder under the tier directory.
    ///
    /// (Its files are named by [`tier_file::fresh_name`] and `step::replica`'s backups, which
    /// [`sweep_stale`] knows.)
    pub fn rank_dir(&self, rank: u32) -> PathBuf {
        self.dir.join(format!("rank-{rank}"))
    }

    /// Creates a fresh tier file for `rank` with `layout`.
    pub fn open(&self, rank: u32, epoch: u64, layout: TierLayout) -> Result<TierFile, TierError> {
        let dir = self.rank_dir(rank);
        let path = dir.join(tier_file::fresh_name(epoch));
        let fail = |path: &Path, e: IoError| TierError::Io {
            path: path.to_path_buf(),
            op: device::Op::Write,
            offset: 0,
            len: 0,
            source: e,
        };
        let faults = self
            .faults
            .filter(|(r, _)| *r == rank)
            .map(|(_, f)| f)
            .unwrap_or_default();
        let dev: Box<dyn device::Device> = if self.simulate {
            Box::new(FaultyDevice::new(device::MemDevice::new(), faults))
        } else {
            let dev = folder::create_in(
                &path,
                |dir, e| {
                    fail(
                        &path,
                        IoError::Os(format!("creating {}: {e}", dir.display())),
                    )
                },
                || UringDevice::open(&path, self.uring).map_err(|e| fail(&path, e)),
            )?;
            Box::new(FaultyDevice::new(dev, faults))
        };
        TierFile::create_with(
            &path,
            dev,
            layout,
            self.staging_buffers,
            self.update_in_backward,
        )
    }
}

/// Removes the state and backup files of rank folders under `dir` (a run's scratch, which a
/// killed run leaves behind) and the folders once empty; returns how many files went. Only the
/// names this runtime writes are touched. Call it holding the directory's lock.
pub fn sweep_stale(dir: &Path) -> usize {
    let mut removed = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in entries.flatten() {
        let path = e.path();
        let is_rank = e.file_name().to_string_lossy().starts_with("rank-");
        if !is_rank || !path.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(&path).into_iter().flatten().flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            let ours = (name.starts_with("state-") || name.starts_with("backup-"))
                && name.ends_with(".bin");
            if ours && std::fs::remove_file(f.path()).is_ok() {
                removed += 1;
            }
        }
        let _ = std::fs::remove_dir(&path);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_runs_scratch_is_swept_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let rank = dir.path().join("rank-0");
        std::fs::create_dir(&rank).unwrap();
        for name in ["state-e1-0.bin", "backup-e1-s0-3-held.bin", "notes.txt"] {
            std::fs::write(rank.join(name), b"x").unwrap();
        }
        let empty = dir.path().join("rank-7");
        std::fs::create_dir(&empty).unwrap();
        std::fs::write(dir.path().join("state-e1-0.bin"), b"x").unwrap();
        assert_eq!(sweep_stale(dir.path()), 2);
        assert!(rank.join("notes.txt").exists(), "only our names go");
        assert!(!empty.exists());
        assert!(
            dir.path().join("state-e1-0.bin").exists(),
            "only in rank folders"
        );
    }
}
