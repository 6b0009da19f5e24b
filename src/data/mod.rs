//! Training data: where micro-batches come from.
//!
//! Determinism contract: micro-batch `index` of step `step` is a pure function of
//! `(seed, step, index, batch, seq)` and the dataset, never of the world size or of which rank
//! asks, so an elastic run that re-deals micro-batches over a different number of ranks sees
//! exactly the same tokens. Tokens are bytes (`vocab() == 256`).
//!
//! Design: docs/models.md (tokens).

pub mod chat;
pub mod instruct;
pub mod markov;
pub mod sources;
pub mod text;
pub mod tokens;

pub use instruct::InstructData;
pub use markov::MarkovSource;
pub use text::TextData;
pub use tokens::{DataFormat, TokenData};

use std::fmt;
use std::path::PathBuf;

use crate::model::MicroBatch;

/// Number of distinct token ids: every source is byte-level.
pub const VOCAB: usize = 256;

/// A source of micro-batches.
#[derive(Clone, Debug)]
pub enum Dataset {
    /// Synthetic Markov chain with a known entropy rate (the loss floor).
    Markov(MarkovSource),
    /// The bytes of a file.
    Text(TextData),
    /// A corpus's token ids under a Hugging Face tokenizer.
    Tokens(TokenData),
    /// Chat, prompt/completion or text records with the loss on the answers only.
    Instruct(InstructData),
}

impl Dataset {
    /// Micro-batch `index` of step `step`: `batch` rows of `seq` input tokens, targets shifted by
    /// one. Call [`Dataset::validate`] for `seq` first (a too-short text file panics here).
    pub fn micro_batch(
        &self,
        seed: u64,
        step: u64,
        index: u64,
        batch: usize,
        seq: usize,
    ) -> MicroBatch {
        match self {
            Dataset::Markov(source) => source.micro_batch(seed, step, index, batch, seq),
            Dataset::Text(text) => text.micro_batch(seed, step, index, batch, seq),
            Dataset::Tokens(t) => t.micro_batch(seed, step, index, batch, seq),
            Dataset::Instruct(d) => d.micro_batch(seed, step, index, batch, seq),
        }
    }

    /// Checks that rows of `seq` tokens (plus the one target beyond) can be cut.
    pub fn validate(&self, seq: usize) -> Result<(), DataError> {
        match self {
            Dataset::Markov(_) => Ok(()),
            Dataset::Text(text) => text.validate(seq),
            Dataset::Tokens(t) => t.validate(seq),
            Dataset::Instruct(d) => d.validate(seq),
        }
    }

    /// Ids the source can produce: [`VOCAB`] for bytes, the tokenizer's vocabulary otherwise.
    pub fn vocab(&self) -> usize {
        match self {
            Dataset::Tokens(t) => t.vocab(),
            Dataset::Instruct(d) => d.vocab(),
            _ => VOCAB,
        }
    }

    /// The lowest achievable mean cross-entropy (nats/token) when it is known exactly.
    pub fn entropy_floor_nats(&self) -> Option<f64> {
        match self {
            Dataset::Markov(source) => Some(source.entropy_rate_nats()),
            Dataset::Text(_) | Dataset::Tokens(_) | Dataset::Instruct(_) => None,
        }
    }

    /// One line for logs and reports.
    pub fn describe(&self) -> String {
        match self {
            Dataset::Markov(source) => source.describe(),
            Dataset::Text(text) => text.describe(),
            Dataset::Tokens(t) => t.describe(),
            Dataset::Instruct(d) => d.describe(),
        }
    }
}

/// Why a dataset cannot be used.
#[derive(Debug)]
pub enum DataError {
    /// The file could not be read.
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A data path names nothing usable (no match, an empty directory, a bad pattern).
    Source { path: PathBuf, what: String },
    /// The tokenizer could not be read or could not encode the corpus.
    Tokenizer { path: PathBuf, what: String },
    /// A JSON Lines record that is not JSON or has no `text`.
    Jsonl {
        path: PathBuf,
        line: usize,
        what: String,
    },
    /// The file is shorter than one training row.
    TooShort {
        path: PathBuf,
        len_bytes: usize,
        seq: usize,
        /// What `len_bytes` counts: bytes, or tokens.
        unit: &'static str,
    },
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataError::Io { path, source } => {
                write!(f, "cannot read text data file {}: {source}", path.display())
            }
            DataError::Tokenizer { path, what } | DataError::Source { path, what } => {
                write!(f, "{}: {what}", path.display())
            }
            DataError::Jsonl { path, line, what } => {
                write!(f, "{}:{line}: {what}", path.display())
            }
            DataError::TooShort {
                path,
                len_bytes: 0,
                seq,
                unit,
            } => write!(
                f,
                "data file {} is empty (0 {unit}): give --data a file with at least {} {unit} \
                 (seq {seq} + 1)",
                path.display(),
                seq + 1
            ),
            DataError::TooShort {
                path,
                len_bytes,
                seq,
                unit,
            } => write!(
                f,
                "text data file {} has {len_bytes} {unit}, but seq {seq} needs at least {} \
                 (seq + 1: the inputs plus one next-token target); use a longer file or \
                 seq <= {}",
                path.display(),
                seq + 1,
                len_bytes.saturating_sub(1)
            ),
        }
    }
}

impl std::error::Error for DataError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DataError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Checks that a corpus of `len` ids (counted in `unit`) at `path` holds one window of
/// `seq + 1`: the inputs plus one next-token target.
pub(crate) fn check_windows(
    path: &std::path::Path,
    len: usize,
    seq: usize,
    unit: &'static str,
) -> Result<(), DataError> {
    if len < seq + 1 {
        return Err(DataError::TooShort {
            path: path.to_path_buf(),
            len_bytes: len,
            seq,
            unit,
        });
    }
    Ok(())
}

/// `batch` rows of `seq + 1` consecutive ids of `data` starting at hashed offsets
/// (`mix(coords ++ [row])` modulo the number of windows); inputs are the first `seq` of each
/// window, targets the last `seq`. The caller checked that `data` holds one window.
pub(crate) fn sample_windows<T: Copy + Into<u32>>(
    data: &[T],
    coords: [u64; 3],
    batch: usize,
    seq: usize,
) -> MicroBatch {
    // Windows of seq + 1 ids start at 0..=len - seq - 1.
    let windows = (data.len() - seq) as u64;
    let mut inputs = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    let [seed, step, index] = coords;
    for r in 0..batch {
        // The remainder is below `windows`, itself a usize, so the cast is lossless.
        let start = (mix(&[seed, step, index, r as u64]) % windows) as usize;
        let window = &data[start..start + seq + 1];
        inputs.extend(window[..seq].iter().map(|&b| b.into()));
        targets.extend(window[1..].iter().map(|&b| b.into()));
    }
    MicroBatch {
        loss_mask: None,
        inputs,
        targets,
        batch,
        seq,
    }
}

/// The splitmix64 finaliser: a bijective 64-bit mixer with full avalanche.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes a tuple of words (order matters) to one well-mixed word: the seed of every random
/// stream in the data pipeline, e.g. `mix(&[seed, step, index, row])`.
pub fn mix(words: &[u64]) -> u64 {
    words
        .iter()
        .fold(0x243F_6A88_85A3_08D3, |h, &w| splitmix64(h ^ splitmix64(w)))
}

/// A small splitmix64 stream: fast, seedable from one word, and good enough for sampling.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.0)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_depends_on_every_word_and_order() {
        let base = mix(&[1, 2, 3, 4]);
        assert_eq!(base, mix(&[1, 2, 3, 4]));
        for other in [
            [0, 2, 3, 4],
            [1, 3, 3, 4],
            [1, 2, 4, 4],
            [1, 2, 3, 5],
            [2, 1, 3, 4],
        ] {
            assert_ne!(base, mix(&other));
        }
        assert_ne!(mix(&[0]), mix(&[0, 0]));
    }

    #[test]
    fn uniform_floats_are_in_range_and_spread() {
        let mut rng = SplitMix64::new(5);
        let xs: Vec<f64> = (0..10_000).map(|_| rng.next_f64()).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }

    #[test]
    fn dataset_dispatch() {
        let d = Dataset::Markov(MarkovSource::new(1));
        assert_eq!(d.vocab(), 256);
        assert!(d.entropy_floor_nats().is_some());
        assert!(d.describe().starts_with("markov"));
        assert!(d.validate(1 << 20).is_ok());
        let mb = d.micro_batch(0, 1, 2, 3, 8);
        assert_eq!((mb.batch, mb.seq, mb.inputs.len()), (3, 8, 24));
        assert!(mb.inputs.iter().all(|&t| (t as usize) < d.vocab()));
    }
}
