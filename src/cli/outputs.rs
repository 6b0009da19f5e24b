//! Output paths checked before the work: a run that cannot write its summary, log or
//! checkpoints is refused at the start (exit 2) rather than after hours of training.

use std::path::Path;

use elastic_zero::config::TrainConfig;

use super::CliError;

/// Every path the run `cfg` will write, checked writable now; nothing is left behind.
pub fn check_train(cfg: &TrainConfig) -> Result<(), CliError> {
    if let Some(p) = &cfg.json {
        check_file("--json", p)?;
    }
    if let Some(p) = &cfg.metrics_file {
        check_file("--metrics-file", p)?;
    }
    if let Some(p) = &cfg.save_dir {
        check_dir("--save-dir", p)?;
    }
    Ok(())
}

/// `path` is a file that can be created or replaced: its directory exists and takes a file.
pub fn check_file(flag: &str, path: &Path) -> Result<(), CliError> {
    if path.is_dir() {
        return Err(CliError::Usage(format!(
            "{flag} {}: is a directory; give a file name",
            path.display()
        )));
    }
    let parent = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(CliError::Usage(format!(
            "{flag} {}: directory {} does not exist; create it or write elsewhere",
            path.display(),
            parent.display()
        )));
    }
    probe(flag, path, parent)
}

/// `dir` is a directory that exists and takes files, or can be created (its nearest existing
/// ancestor is a directory that takes files). It is not created here: a run refused later
/// leaves nothing behind.
pub fn check_dir(flag: &str, dir: &Path) -> Result<(), CliError> {
    let existing = dir
        .ancestors()
        .find(|a| a.exists() || a.as_os_str().is_empty());
    let existing = match existing {
        Some(a) if a.as_os_str().is_empty() => Path::new("."),
        Some(a) => a,
        None => Path::new("/"),
    };
    if !existing.is_dir() {
        return Err(CliError::Usage(format!(
            "{flag} {}: {} is not a directory",
            dir.display(),
            existing.display()
        )));
    }
    probe(flag, dir, existing)
}

/// Creates and removes a file in `dir`: permission bits alone do not say (read-only mounts,
/// ACLs, root).
fn probe(flag: &str, shown: &Path, dir: &Path) -> Result<(), CliError> {
    let file = dir.join(format!(".ezero-write-check-{}", std::process::id()));
    match std::fs::File::create(&file) {
        Ok(_) => {
            let _ = std::fs::remove_file(&file);
            Ok(())
        }
        Err(e) => Err(CliError::Usage(format!(
            "{flag} {}: cannot write in {}: {e}",
            shown.display(),
            dir.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_directories_and_directories_as_files_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let msg = |r: Result<(), CliError>| match r {
            Err(CliError::Usage(m) | CliError::Failed(m)) => m,
            Ok(()) => String::from("accepted"),
        };
        assert!(
            msg(check_file("--json", Path::new("/nonexistent-dir/run.json")))
                .contains("does not exist")
        );
        assert!(msg(check_file("--json", tmp.path())).contains("is a directory"));
        assert_eq!(
            msg(check_file("--json", &tmp.path().join("run.json"))),
            "accepted"
        );
        assert_eq!(
            msg(check_dir("--save-dir", &tmp.path().join("a/b"))),
            "accepted"
        );
        assert!(!tmp.path().join("a").exists(), "the check creates nothing");
        let file = tmp.path().join("f");
        std::fs::write(&file, "x").unwrap();
        assert!(msg(check_dir("--save-dir", &file.join("sub"))).contains("not a directory"));
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    }
}
