//! A byte-level corpus read from any file: rows are windows at hashed offsets.
//!
//! Each row is `seq + 1` consecutive bytes starting at `mix(&[seed, step, index, row])` modulo
//! the number of such windows, so rows are pure functions of their coordinates (sampling with
//! replacement; no epoch state to keep consistent across ranks or restarts).

use std::path::{Path, PathBuf};

use super::{check_windows, sample_windows, DataError};
use crate::model::MicroBatch;

/// The whole file in memory (training corpora for this runtime are small).
#[derive(Clone, Debug)]
pub struct TextData {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl TextData {
    /// Reads `path`. The length is checked later, by [`TextData::validate`], once `seq` is known.
    pub fn load(path: impl AsRef<Path>) -> Result<TextData, DataError> {
        let path = path.as_ref().to_path_buf();
        match std::fs::read(&path) {
            Ok(bytes) => Ok(TextData { path, bytes }),
            Err(source) => Err(DataError::Io { path, source }),
        }
    }

    /// The bytes of `files` one after another, as one corpus (the first names it in messages).
    pub fn load_files(files: &[PathBuf]) -> Result<TextData, DataError> {
        let mut bytes = Vec::new();
        for f in files {
            bytes.extend(std::fs::read(f).map_err(|source| DataError::Io {
                path: f.clone(),
                source,
            })?);
        }
        Ok(TextData {
            path: files.first().cloned().unwrap_or_default(),
            bytes,
        })
    }

    /// Checks that the file holds at least one row: `seq` inputs plus one target byte.
    pub fn validate(&self, seq: usize) -> Result<(), DataError> {
        check_windows(&self.path, self.bytes.len(), seq, "bytes")
    }

    pub fn len_bytes(&self) -> usize {
        self.bytes.len()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Micro-batch `index` of step `step`: `batch` windows of `seq + 1` bytes; inputs are the
    /// first `seq`, targets the last `seq`.
    ///
    /// Panics if the file is too short for `seq`; [`TextData::validate`] reports that as an error.
    pub fn micro_batch(
        &self,
        seed: u64,
        step: u64,
        index: u64,
        batch: usize,
        seq: usize,
    ) -> MicroBatch {
        if let Err(e) = self.validate(seq) {
            panic!("{e}");
        }
        sample_windows(&self.bytes, [seed, step, index], batch, seq)
    }

    /// One line for logs.
    pub fn describe(&self) -> String {
        format!("text({}, {} bytes)", self.path.display(), self.bytes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file under the system temp dir, removed on drop (no tempfile crate in scratch).
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, contents: &[u8]) -> Self {
            let path =
                std::env::temp_dir().join(format!("ezero-text-{}-{name}", std::process::id()));
            std::fs::write(&path, contents).expect("temp dir is writable");
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn missing_file_error_names_the_file() {
        let err = TextData::load("/nonexistent/ezero/corpus.txt").unwrap_err();
        assert!(matches!(err, DataError::Io { .. }));
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/ezero/corpus.txt"), "{msg}");
        assert!(std::error::Error::source(&err).is_some());
    }

    #[test]
    fn short_file_error_says_what_would_be_valid() {
        let f = TempFile::new("short", b"hello");
        let text = TextData::load(&f.0).unwrap();
        assert!(text.validate(4).is_ok(), "5 bytes hold one row of seq 4");
        let err = text.validate(5).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&f.0.display().to_string()), "{msg}");
        assert!(
            msg.contains("5 bytes") && msg.contains("at least 6"),
            "{msg}"
        );
        assert!(msg.contains("seq <= 4"), "{msg}");
    }

    #[test]
    #[should_panic(expected = "needs at least")]
    fn micro_batch_on_too_short_file_panics_with_the_validation_message() {
        let f = TempFile::new("tiny", b"ab");
        TextData::load(&f.0).unwrap().micro_batch(0, 0, 0, 1, 8);
    }

    #[test]
    fn windows_are_pure_shifted_and_cover_the_ends() {
        let corpus: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let f = TempFile::new("corpus", &corpus);
        let text = TextData::load(&f.0).unwrap();
        let (batch, seq) = (4, 16);
        let mb = text.micro_batch(1, 2, 3, batch, seq);
        assert_eq!(mb, text.micro_batch(1, 2, 3, batch, seq));
        assert_ne!(mb, text.micro_batch(1, 2, 4, batch, seq));
        assert_ne!(mb, text.micro_batch(1, 3, 3, batch, seq));
        for r in 0..batch {
            let row = r * seq;
            // The corpus counts up mod 256, so each target is its input plus one.
            for j in 0..seq {
                assert_eq!(mb.targets[row + j], (mb.inputs[row + j] + 1) % 256);
            }
        }
        // With seq = len - 1 there is exactly one window: the whole file.
        let whole = text.micro_batch(9, 9, 9, 2, 999);
        assert_eq!(whole.inputs[..999], whole.inputs[999..]);
        assert_eq!(u32::from(corpus[999]), whole.targets[998]);
    }
}
