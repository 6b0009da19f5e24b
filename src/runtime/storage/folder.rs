//! A rank's folder under the tier directory. Whoever creates a file in it makes it, and whoever
//! removes its last file removes it: scratch leaves nothing behind. The two happen on different
//! threads (a rank's old state is dropped while its new state or a backup is being written),
//! so both go through one lock, and a folder is never removed between being made and the file
//! being created in it.

use std::path::Path;
use std::sync::Mutex;

static FOLDERS: Mutex<()> = Mutex::new(());

/// Makes the folder of `path` if it is missing, then runs `create` (which creates `path`), with
/// no folder removed in between. `folder_failed` says what making the folder's error means.
pub fn create_in<T, E>(
    path: &Path,
    folder_failed: impl FnOnce(&Path, std::io::Error) -> E,
    create: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let _held = FOLDERS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| folder_failed(dir, e))?;
    }
    create()
}

/// Removes the file at `path` (scratch: errors are of no use to anyone), and its folder if that
/// was the folder's last file.
pub fn remove_with_folder(path: &Path) {
    let _ = std::fs::remove_file(path);
    let _held = FOLDERS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(dir) = path.parent() {
        // Fails harmlessly while other files remain.
        let _ = std::fs::remove_dir(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Files come and go in one folder on two threads: every create finds its folder, and the
    /// folder goes with the last file.
    #[test]
    fn a_folder_is_never_removed_under_a_file_being_created() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("rank-0");
        let churn = |t: usize| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                for i in 0..500 {
                    let path = dir.join(format!("state-{t}-{i}.bin"));
                    create_in(&path, |_, e| e, || std::fs::File::create(&path)).unwrap();
                    remove_with_folder(&path);
                }
            })
        };
        let hs: Vec<_> = (0..2).map(churn).collect();
        for h in hs {
            h.join().unwrap();
        }
        assert!(!dir.exists(), "the folder went with its last file");
    }
}
