//! Which files a `--data` (or `--eval-data`) value names, in a fixed order.
//!
//! The value is a comma-separated list of items (the flag may also be repeated; its values join
//! into one list in the order given). Each item is a file, a directory (its plain files, sorted
//! by name, not descending into subdirectories) or a glob pattern (`*`, `?` or `[` in it: its
//! matches sorted by path). The files keep the order of the items, so the same value always
//! reads the same data in the same order and the batches keep their bits.

use std::path::{Path, PathBuf};

use super::DataError;

/// The separator of items in one value.
pub const LIST_SEPARATOR: char = ',';

/// The files of `spec`, in order (see the module docs). An item that names nothing readable
/// (a missing path, a pattern matching no file, an empty directory) is an error naming it.
pub fn resolve(spec: &Path) -> Result<Vec<PathBuf>, DataError> {
    let text = spec.to_string_lossy();
    let mut files = Vec::new();
    for item in text.split(LIST_SEPARATOR).map(str::trim) {
        if item.is_empty() {
            return Err(bad(
                spec,
                "has an empty item: remove the stray comma".into(),
            ));
        }
        files.extend(resolve_item(item)?);
    }
    for f in &files {
        std::fs::File::open(f).map_err(|source| DataError::Io {
            path: f.clone(),
            source,
        })?;
    }
    Ok(files)
}

fn bad(path: &Path, what: String) -> DataError {
    DataError::Source {
        path: path.to_path_buf(),
        what,
    }
}

fn resolve_item(item: &str) -> Result<Vec<PathBuf>, DataError> {
    let path = PathBuf::from(item);
    if path.is_dir() {
        let entries = std::fs::read_dir(&path).map_err(|source| DataError::Io {
            path: path.clone(),
            source,
        })?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(bad(&path, "is a directory with no files in it".into()));
        }
        return Ok(files);
    }
    if item.contains(['*', '?', '[']) {
        let pattern = glob::glob(item)
            .map_err(|e| bad(&path, format!("is not a valid glob pattern: {e}")))?;
        let mut files = Vec::new();
        for entry in pattern {
            let p = entry.map_err(|e| bad(&path, format!("cannot list a match: {e}")))?;
            if p.is_file() {
                files.push(p);
            }
        }
        files.sort();
        if files.is_empty() {
            return Err(bad(&path, "matches no file".into()));
        }
        return Ok(files);
    }
    if !path.is_file() {
        return Err(bad(&path, "does not exist or is not a file".into()));
    }
    Ok(vec![path])
}

/// One line naming `files`: the path of one, the first and a count of several.
pub fn describe(files: &[PathBuf]) -> String {
    match files {
        [one] => one.display().to_string(),
        [first, rest @ ..] => format!("{} and {} more", first.display(), rest.len()),
        [] => "no files".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_directories_and_globs_resolve_in_a_fixed_order() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for name in ["b.txt", "a.txt", "c.md"] {
            std::fs::write(d.join(name), name).unwrap();
        }
        std::fs::create_dir(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/z.txt"), "z").unwrap();
        let all = resolve(d).unwrap();
        assert_eq!(all, vec![d.join("a.txt"), d.join("b.txt"), d.join("c.md")]);
        let glob = resolve(&d.join("*.txt")).unwrap();
        assert_eq!(glob, vec![d.join("a.txt"), d.join("b.txt")]);
        let list = format!("{},{}", d.join("c.md").display(), d.join("*.txt").display());
        let listed = resolve(Path::new(&list)).unwrap();
        assert_eq!(
            listed,
            vec![d.join("c.md"), d.join("a.txt"), d.join("b.txt")]
        );
    }

    #[test]
    fn items_naming_nothing_are_errors_that_name_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let none = d.join("*.jsonl");
        let msg = resolve(&none).unwrap_err().to_string();
        assert!(msg.contains(&none.display().to_string()) && msg.contains("matches no file"));
        let missing = d.join("nope.txt");
        let msg = resolve(&missing).unwrap_err().to_string();
        assert!(
            msg.contains("nope.txt") && msg.contains("does not exist"),
            "{msg}"
        );
        let msg = resolve(d).unwrap_err().to_string();
        assert!(msg.contains("no files"), "{msg}");
    }
}
