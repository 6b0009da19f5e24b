//! A Hugging Face `tokenizer.json` from a GGUF file's byte-level BPE metadata
//! (`tokenizer.ggml.model = gpt2`): vocabulary, merges, control and user-defined tokens, and
//! the pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre`.
//!
//! It follows transformers' GGUF conversion (`integrations/gguf/gguf_tokenizer_mapping.py`)
//! except for the pre-tokenizer: transformers ignores `smollm` and splits with GPT-2's regex
//! alone, while llama.cpp (`src/llama-vocab.cpp`) first isolates every digit, as SmolLM2's own
//! `tokenizer.json` does (`Digits(individual_digits)` before `ByteLevel`). On SmolLM2 the two
//! differ only where spaces precede a digit: llama.cpp (and this file) keeps `"     1"` as
//! five spaces then `1`, transformers as four spaces, then a space, then `1` (190 of 204
//! 2,000-character chunks of this repository's prose and code encoded identically).

use std::collections::HashSet;
use std::path::Path;
use std::str::FromStr;

use serde_json::{json, Map, Value};

use super::value::GgufValue;
use super::GgufFile;
use crate::checkpoint::error::{CheckpointError, IoContext};

/// `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The pre-tokenizers written here, by `tokenizer.ggml.pre`.
const SUPPORTED_PRE: &str = "\"smollm\", \"gpt-2\" or none";

/// GPT-2's byte-to-character table (`bytes_to_unicode`): printable bytes stand for
/// themselves, the rest take the characters from U+0100 on, in byte order.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        // Every code here is below U+0200, a valid scalar value.
        *slot = char::from_u32(code).unwrap_or('\u{fffd}');
    }
    table
}

fn string_array<'a>(file: &'a GgufFile, key: &str) -> Result<&'a [String], CheckpointError> {
    file.metadata(key)
        .and_then(GgufValue::as_array)
        .and_then(|a| a.as_strings())
        .ok_or_else(|| {
            CheckpointError::incompatible(
                file.path(),
                format!("{key} is missing or not a string array"),
            )
        })
}

/// The `tokenizer.json` text for `file`, checked to load with the `tokenizers` crate.
pub fn tokenizer_json(file: &GgufFile) -> Result<String, CheckpointError> {
    let bad = |what: String| CheckpointError::incompatible(file.path(), what);
    let model = file
        .metadata("tokenizer.ggml.model")
        .and_then(GgufValue::as_str);
    if model != Some("gpt2") {
        return Err(bad(format!(
            "tokenizer.ggml.model is {model:?}: only byte-level BPE (\"gpt2\") is converted"
        )));
    }
    let tokens = string_array(file, "tokenizer.ggml.tokens")?;
    let merges = string_array(file, "tokenizer.ggml.merges")?;
    let types = token_types(file, tokens.len())?;
    let chars = byte_chars();
    let alphabet: HashSet<char> = chars.iter().copied().collect();
    let spelled = |t: &str| t.chars().all(|c| alphabet.contains(&c));

    // A token outside the byte alphabet is stored as raw text; respell its bytes, as
    // transformers does, so the BPE model can reach it.
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        let key = match spelled(t) {
            true => t.clone(),
            false => t.bytes().map(|b| chars[b as usize]).collect(),
        };
        vocab.insert(key, json!(id));
    }
    let pairs = merge_pairs(file, merges, &vocab)?;
    let added = added_tokens(tokens, &types, &spelled);

    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(file)?,
        "post_processor": post_processor(file, tokens)?,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": pairs,
        },
    });
    let text = serde_json::to_string(&json).map_err(|e| bad(format!("tokenizer.json: {e}")))?;
    tokenizers::Tokenizer::from_str(&text).map_err(|e| {
        bad(format!(
            "the tokenizer built from the metadata does not load: {e}"
        ))
    })?;
    Ok(text)
}

/// `tokenizer.ggml.token_type`, one per token (all normal when the file has none).
fn token_types(file: &GgufFile, tokens: usize) -> Result<Vec<i64>, CheckpointError> {
    match file.metadata("tokenizer.ggml.token_type") {
        None => Ok(vec![0; tokens]),
        Some(v) => match v.as_array().and_then(|a| a.to_i64s()) {
            Some(t) if t.len() == tokens => Ok(t),
            _ => Err(CheckpointError::incompatible(
                file.path(),
                format!("tokenizer.ggml.token_type is not an integer array of {tokens} elements"),
            )),
        },
    }
}

/// The BPE model's merges as pairs, each of whose halves and result is in `vocab`.
fn merge_pairs(
    file: &GgufFile,
    merges: &[String],
    vocab: &Map<String, Value>,
) -> Result<Vec<Value>, CheckpointError> {
    let bad = |what: String| CheckpointError::incompatible(file.path(), what);
    let mut pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        // llama.cpp splits at the first space after the first character.
        let cut = m
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == ' ')
            .map(|(at, _)| at);
        let Some((a, b)) = cut.map(|at| (&m[..at], &m[at + 1..])) else {
            return Err(bad(format!(
                "tokenizer.ggml.merges[{i}] = {m:?} is not two tokens"
            )));
        };
        for part in [a.to_string(), b.to_string(), format!("{a}{b}")] {
            if !vocab.contains_key(&part) {
                return Err(bad(format!(
                    "tokenizer.ggml.merges[{i}] = {m:?}: {part:?} is not in tokenizer.ggml.tokens"
                )));
            }
        }
        pairs.push(json!([a, b]));
    }
    Ok(pairs)
}

/// The added tokens: control tokens (special) and user-defined ones, by id.
fn added_tokens(tokens: &[String], types: &[i64], spelled: &dyn Fn(&str) -> bool) -> Vec<Value> {
    // Control tokens are special and matched whole; one that is not spelled in the byte
    // alphabet is a mislabel transformers skips, and so do we.
    tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (t, &ty))| (ty == CONTROL || ty == USER_DEFINED) && spelled(t))
        .map(|(id, (t, &ty))| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": ty == CONTROL})
        })
        .collect()
}

/// The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre`.
fn pre_tokenizer(file: &GgufFile) -> Result<Value, CheckpointError> {
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre = file
        .metadata("tokenizer.ggml.pre")
        .map(|v| v.as_str().unwrap_or("(not a string)"));
    Ok(match pre {
        None | Some("gpt-2") => byte_level,
        Some("smollm") => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level]}),
        Some(other) => {
            return Err(CheckpointError::incompatible(
                file.path(),
                format!(
                    "tokenizer.ggml.pre is {other:?}, whose pre-tokenizer is not written \
                     (supported: {SUPPORTED_PRE})"
                ),
            ))
        }
    })
}

/// BOS/EOS insertion when the file asks for it (`tokenizer.ggml.add_bos_token`, `…_eos_…`);
/// otherwise GPT-2's ByteLevel post-processor, which only adjusts offsets.
fn post_processor(file: &GgufFile, tokens: &[String]) -> Result<Value, CheckpointError> {
    let flag = |key: &str| {
        file.metadata(key)
            .and_then(GgufValue::as_bool)
            .unwrap_or(false)
    };
    let token = |key: &str| -> Result<Option<(String, u64)>, CheckpointError> {
        let Some(v) = file.metadata(key) else {
            return Ok(None);
        };
        match v
            .as_u64()
            .and_then(|id| Some((tokens.get(usize::try_from(id).ok()?)?, id)))
        {
            Some((t, id)) => Ok(Some((t.clone(), id))),
            None => Err(CheckpointError::incompatible(
                file.path(),
                format!(
                    "{key} is {v:?}, not an id among the {} tokens",
                    tokens.len()
                ),
            )),
        }
    };
    let bos =
        token("tokenizer.ggml.bos_token_id")?.filter(|_| flag("tokenizer.ggml.add_bos_token"));
    let eos =
        token("tokenizer.ggml.eos_token_id")?.filter(|_| flag("tokenizer.ggml.add_eos_token"));
    if bos.is_none() && eos.is_none() {
        return Ok(
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
        );
    }
    let wrapped = |id: &str, type_id: u32| -> Vec<Value> {
        let special = |t: &Option<(String, u64)>| {
            t.as_ref()
                .map(|(s, _)| json!({"SpecialToken": {"id": s, "type_id": type_id}}))
        };
        let seq = json!({"Sequence": {"id": id, "type_id": type_id}});
        special(&bos)
            .into_iter()
            .chain([seq])
            .chain(special(&eos))
            .collect()
    };
    let single = wrapped("A", 0);
    let pair: Vec<Value> = single.iter().cloned().chain(wrapped("B", 1)).collect();
    let mut specials = Map::new();
    for (s, id) in bos.iter().chain(&eos) {
        specials.insert(s.clone(), json!({"id": s, "ids": [id], "tokens": [s]}));
    }
    Ok(
        json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}),
    )
}

/// Writes the tokenizer to `path`.
pub fn write(file: &GgufFile, path: &Path) -> Result<(), CheckpointError> {
    let text = tokenizer_json(file)?;
    std::fs::write(path, text).at(path, "write")
}
