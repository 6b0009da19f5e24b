//! The storage seam: where a rank's shard state lives when it is not in RAM.
//!
//! A placement from `plan::tier` says which state goes to the tier; [`TierSpec`] carries it with
//! the directory and the I/O settings, and opens each rank's [`TierFile`] (one preallocated file
//! in the rank's own subfolder) on a device: [`uring::UringDevice`] on the disk, or
//! [`device::MemDevice`], the reference device tests inject faults into.
//!
//! Imports: `plan`, `crate::runtime::alloc` and below; nothing above (the step uses this).

pub mod aligned;
pub mod device;
pub mod preflight;
pub mod tier_file;
pub mod uring;

use std::path::{Path, PathBuf};

pub use self::aligned::AlignedBuf;
pub use self::device::{Faults, FaultyDevice, IoError};
pub use self::preflight::{check_dir, lock_dir, DirLock, PreflightError};
pub use self::tier_file::{RecordKinds, TierError, TierFile, TierLayout, TierStats};
pub use self::uring::UringConfig;
use self::uring::UringDevice;
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
        check_dir(dir, need_bytes, !uring.direct)?;
        let lock = lock_dir(dir)?;
        Ok((
            TierSpec {
                dir: dir.to_path_buf(),
                placement,
                tile_elems,
                staging_buffers,
                uring,
                simulate: false,
                faults: None,
            },
            lock,
        ))
    }

    /// This rank's folder under the tier directory.
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
            std::fs::create_dir_all(&dir).map_err(|e| {
                fail(
                    &path,
                    IoError::Os(format!("creating {}: {e}", dir.display())),
                )
            })?;
            let dev = UringDevice::open(&path, self.uring).map_err(|e| fail(&path, e))?;
            Box::new(FaultyDevice::new(dev, faults))
        };
        TierFile::create(&path, dev, layout, self.staging_buffers)
    }
}
