//! Checks on a tier directory before any state is written to it, and the lock that keeps a
//! second run out of it. Each failure is one line that says what to do.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::aligned::AlignedBuf;
use crate::plan::tier::gib;

/// Why a tier directory cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PreflightError {
    #[error(
        "nvme_dir {0} does not exist: create it on a local SSD or NVMe file system (mkdir -p)"
    )]
    Missing(PathBuf),
    #[error("nvme_dir {0} is not a directory")]
    NotDir(PathBuf),
    #[error("nvme_dir {dir} is not writable: {why}")]
    NotWritable { dir: PathBuf, why: String },
    #[error("nvme_dir {0} is on tmpfs or ramfs, which is RAM: the tier would take the memory it is meant to save; use a disk file system (ext4, xfs)")]
    InRam(PathBuf),
    #[error("nvme_dir {dir} does not support direct I/O (O_DIRECT: {why}); use a disk file system (ext4, xfs), or pass --nvme-buffered to accept buffered I/O through the page cache")]
    NoDirect { dir: PathBuf, why: String },
    #[error("nvme_dir {dir} has {} free but the tier needs {}: free space there or point --nvme-dir at a larger disk", gib(*.free), gib(*.need))]
    NoSpace { dir: PathBuf, free: u64, need: u64 },
    #[error("nvme_dir {dir} is in use by another run ({holder}); give each run its own directory")]
    InUse { dir: PathBuf, holder: String },
}

/// What the checks found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirReport {
    pub free_bytes: u64,
    pub direct: bool,
}

const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// Checks that `dir` exists, is writable, is not RAM, supports O_DIRECT (unless `buffered`), and
/// has `need_bytes` free.
pub fn check_dir(dir: &Path, need_bytes: u64, buffered: bool) -> Result<DirReport, PreflightError> {
    let meta = std::fs::metadata(dir).map_err(|_| PreflightError::Missing(dir.to_path_buf()))?;
    if !meta.is_dir() {
        return Err(PreflightError::NotDir(dir.to_path_buf()));
    }
    let probe = dir.join(format!(".ezero-probe-{}", std::process::id()));
    let result = probe_dir(dir, &probe, need_bytes, buffered);
    let _ = std::fs::remove_file(&probe);
    result
}

fn probe_dir(
    dir: &Path,
    probe: &Path,
    need_bytes: u64,
    buffered: bool,
) -> Result<DirReport, PreflightError> {
    let not_writable = |e: std::io::Error| PreflightError::NotWritable {
        dir: dir.to_path_buf(),
        why: e.to_string(),
    };
    File::create(probe).map_err(not_writable)?;
    let (fs_type, free) = fs_stats(dir).map_err(not_writable)?;
    if fs_type == TMPFS_MAGIC || fs_type == RAMFS_MAGIC {
        return Err(PreflightError::InRam(dir.to_path_buf()));
    }
    if !buffered {
        direct_write(probe).map_err(|e| PreflightError::NoDirect {
            dir: dir.to_path_buf(),
            why: e.to_string(),
        })?;
    }
    if free < need_bytes {
        return Err(PreflightError::NoSpace {
            dir: dir.to_path_buf(),
            free,
            need: need_bytes,
        });
    }
    Ok(DirReport {
        free_bytes: free,
        direct: !buffered,
    })
}

/// The file system's magic number and the bytes an unprivileged user may still write.
fn fs_stats(dir: &Path) -> std::io::Result<(i64, u64)> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::other("path contains a NUL byte"))?;
    // SAFETY: zeroed plain-old-data structs filled by the kernel.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointers.
    if unsafe { libc::statfs(c.as_ptr(), &mut fs) } != 0
        || unsafe { libc::statvfs(c.as_ptr(), &mut vfs) } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok((fs.f_type as i64, vfs.f_bavail as u64 * vfs.f_frsize as u64))
}

/// Writes one aligned block to `probe` (an existing file) with O_DIRECT: fails where the file
/// system has no direct I/O.
pub(super) fn direct_write(probe: &Path) -> std::io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(probe)?;
    let buf = AlignedBuf::new(4096);
    f.write_all(buf.bytes())
}

/// An exclusive lock on a tier directory for as long as the value lives (closing the file
/// releases it, so a killed run leaves no stale lock behind).
pub struct DirLock {
    _file: File,
}

/// Locks `dir` for this run, or says which process holds it.
pub fn lock_dir(dir: &Path) -> Result<DirLock, PreflightError> {
    let path = dir.join(".ezero.lock");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| PreflightError::NotWritable {
            dir: dir.to_path_buf(),
            why: e.to_string(),
        })?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = match holder.trim() {
            "" => "another process holds its lock".to_string(),
            pid => format!("process {pid} holds {}", path.display()),
        };
        return Err(PreflightError::InUse {
            dir: dir.to_path_buf(),
            holder,
        });
    }
    let _ = file.set_len(0);
    let _ = write!(file, "{}", std::process::id());
    Ok(DirLock { _file: file })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_not_a_dir_and_too_small() {
        let t = tempfile::tempdir().unwrap();
        let missing = t.path().join("nope");
        assert_eq!(
            check_dir(&missing, 0, false),
            Err(PreflightError::Missing(missing.clone()))
        );
        let file = t.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(
            check_dir(&file, 0, false),
            Err(PreflightError::NotDir(file.clone()))
        );
        let err = check_dir(t.path(), u64::MAX / 2, true).unwrap_err();
        assert!(matches!(err, PreflightError::NoSpace { .. }), "{err}");
        assert!(err.to_string().contains("the tier needs"), "{err}");
    }

    #[test]
    fn a_second_lock_is_refused_and_names_the_holder() {
        let t = tempfile::tempdir().unwrap();
        let held = lock_dir(t.path()).unwrap();
        let err = lock_dir(t.path()).err().unwrap();
        assert!(
            err.to_string()
                .contains(&format!("process {} holds", std::process::id())),
            "{err}"
        );
        drop(held);
        lock_dir(t.path()).unwrap();
    }

    #[test]
    fn tmpfs_is_refused_where_there_is_one() {
        let shm = Path::new("/dev/shm");
        if fs_stats(shm).is_ok_and(|s| s.0 == TMPFS_MAGIC) {
            let t = tempfile::tempdir_in(shm).unwrap();
            assert_eq!(
                check_dir(t.path(), 0, false),
                Err(PreflightError::InRam(t.path().to_path_buf()))
            );
        }
    }
}
