//! A corpus tokenized with a Hugging Face tokenizer (`tokenizer.json`), sampled like
//! [`TextData`](super::TextData): rows are windows of `seq + 1` token ids at hashed offsets, so
//! micro-batch `i` of step `s` stays a pure function of `(seed, s, i)`.
//!
//! The corpus is a text file (one document) or JSON Lines whose records have a `text` field
//! (one document each). Documents are joined with the tokenizer's end-of-text token when it has
//! one, so a window that crosses a boundary sees it, as in GPT-2's training data.
//!
//! Tokenizing is done once: the ids go to a cache file named by the SHA-256 of the corpus, the
//! tokenizer and the format, and a later run with the same three reads it back (checked by a
//! CRC32 of the ids) instead of tokenizing again.

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{check_windows, sample_windows, DataError};
use crate::model::MicroBatch;

/// How the data file is laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// `.jsonl`/`.json` files are JSON Lines, anything else is text.
    #[default]
    Auto,
    Text,
    Jsonl,
}

impl std::str::FromStr for DataFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "text" => Ok(Self::Text),
            "jsonl" => Ok(Self::Jsonl),
            _ => Err(format!(
                "unknown data format `{s}`: use auto, text or jsonl"
            )),
        }
    }
}

impl DataFormat {
    /// `Auto` decided by `path`'s extension.
    pub fn resolve(self, path: &Path) -> Self {
        match self {
            Self::Auto => match path.extension().and_then(|e| e.to_str()) {
                Some("jsonl") | Some("json") => Self::Jsonl,
                _ => Self::Text,
            },
            f => f,
        }
    }
}

/// Tokens that end a document, in the order they are looked for.
const END_OF_TEXT: &[&str] = &["<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>"];

/// The tokenizer's end-of-text token, if it has one of the usual ones.
pub fn end_of_text(tok: &tokenizers::Tokenizer) -> Option<u32> {
    END_OF_TEXT.iter().find_map(|t| tok.token_to_id(t))
}

/// Magic and version of a token cache file.
const CACHE_MAGIC: &[u8; 8] = b"EZTOKS01";

/// The token ids of a corpus.
#[derive(Clone, Debug)]
pub struct TokenData {
    /// The first file: short windows are reported against it.
    path: PathBuf,
    /// The files, for logs.
    label: String,
    tokens: Vec<u32>,
    /// Ids the tokenizer can produce (its vocabulary with added tokens).
    vocab: usize,
    /// Where the ids came from: `tokenized` or `cache FILE`.
    origin: String,
}

fn tok_err(path: &Path, what: impl Into<String>) -> DataError {
    DataError::Tokenizer {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

impl TokenData {
    /// Tokenizes `data` (laid out as `format`) with `tokenizer` (a `tokenizer.json`), or reads
    /// the ids from `cache_dir` if an earlier run cached them.
    pub fn load(
        data: &Path,
        format: DataFormat,
        tokenizer: &Path,
        cache_dir: Option<&Path>,
    ) -> Result<Self, DataError> {
        Self::load_files(&[data.to_path_buf()], format, tokenizer, cache_dir)
    }

    /// [`TokenData::load`] of several files, read in order as one corpus: each file's documents
    /// (the file, or its JSON Lines records) follow the previous file's, joined like them.
    pub fn load_files(
        files: &[PathBuf],
        format: DataFormat,
        tokenizer: &Path,
        cache_dir: Option<&Path>,
    ) -> Result<Self, DataError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| DataError::Io { path, source }
        };
        let first = files.first().cloned().unwrap_or_default();
        let mut contents = Vec::with_capacity(files.len());
        for f in files {
            contents.push(std::fs::read(f).map_err(io(f))?);
        }
        let tok_bytes = std::fs::read(tokenizer).map_err(io(tokenizer))?;
        let tok = tokenizers::Tokenizer::from_bytes(&tok_bytes)
            .map_err(|e| tok_err(tokenizer, format!("not a tokenizer.json: {e}")))?;
        let vocab = tok.get_vocab_size(true);
        let key = {
            let mut h = Sha256::new();
            h.update(CACHE_MAGIC);
            // One file hashes as it always did, so its cached ids stay valid.
            for (f, bytes) in files.iter().zip(&contents) {
                h.update(format!("{:?}", format.resolve(f)));
                h.update((bytes.len() as u64).to_le_bytes());
                h.update(bytes);
            }
            h.update(&tok_bytes);
            h.finalize()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        let cache = cache_dir.map(|d| d.join(format!("{}.tokens", &key[..32])));
        let path = first.clone();
        let label = super::sources::describe(files);
        if let Some(c) = &cache {
            if let Some(tokens) = read_cache(c) {
                return Ok(Self {
                    path,
                    label,
                    tokens,
                    vocab,
                    origin: format!("cache {}", c.display()),
                });
            }
        }
        let mut docs: Vec<String> = Vec::new();
        for (f, bytes) in files.iter().zip(contents) {
            let text = String::from_utf8(bytes)
                .map_err(|e| tok_err(f, format!("is not UTF-8 text: {e}")))?;
            match format.resolve(f) {
                DataFormat::Jsonl => docs.extend(jsonl_texts(f, &text)?),
                _ => docs.push(text),
            }
        }
        let eot = end_of_text(&tok);
        let mut tokens = Vec::new();
        for (i, doc) in docs.iter().enumerate() {
            let enc = tok.encode(doc.as_str(), false).map_err(|e| {
                tok_err(tokenizer, format!("cannot encode document {}: {e}", i + 1))
            })?;
            if i > 0 {
                tokens.extend(eot);
            }
            tokens.extend_from_slice(enc.get_ids());
        }
        if let Some(c) = &cache {
            // A cache that cannot be written costs only the next run's tokenizing.
            let _ = write_cache(c, &tokens);
        }
        Ok(Self {
            path,
            label,
            tokens,
            vocab,
            origin: "tokenized".into(),
        })
    }

    /// Checks that the corpus holds at least one row of `seq` tokens plus the target.
    pub fn validate(&self, seq: usize) -> Result<(), DataError> {
        check_windows(&self.path, self.tokens.len(), seq, "tokens")
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    pub fn len_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Micro-batch `index` of step `step` (see the module docs).
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
        sample_windows(&self.tokens, [seed, step, index], batch, seq)
    }

    pub fn describe(&self) -> String {
        format!(
            "tokens({}, {} tokens of a {}-id vocabulary, {})",
            self.label,
            self.tokens.len(),
            self.vocab,
            self.origin
        )
    }
}

/// The `text` field of every JSON Lines record; blank lines are skipped.
fn jsonl_texts(path: &Path, text: &str) -> Result<Vec<String>, DataError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: String| DataError::Jsonl {
            path: path.to_path_buf(),
            line: i + 1,
            what,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        match v.get("text").and_then(|t| t.as_str()) {
            Some(t) => out.push(t.to_string()),
            None => return Err(bad("has no string field `text`".into())),
        }
    }
    Ok(out)
}

fn read_cache(path: &Path) -> Option<Vec<u32>> {
    let bytes = std::fs::read(path).ok()?;
    let (head, rest) = bytes.split_at_checked(20)?;
    if &head[..8] != CACHE_MAGIC {
        return None;
    }
    let n = u64::from_le_bytes(head[8..16].try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(head[16..20].try_into().ok()?);
    if rest.len() != 4 * n || crc32fast::hash(rest) != crc {
        return None;
    }
    Some(
        rest.chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    )
}

/// Writes the cache atomically (a temporary file renamed into place).
fn write_cache(path: &Path, tokens: &[u32]) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let payload: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(CACHE_MAGIC)?;
    f.write_all(&(tokens.len() as u64).to_le_bytes())?;
    f.write_all(&crc32fast::hash(&payload).to_le_bytes())?;
    f.write_all(&payload)?;
    f.sync_all()?;
    std::fs::rename(tmp, path)
}
