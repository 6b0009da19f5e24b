//! The tokenizer's side of a Hugging Face directory: `tokenizer_config.json`,
//! `special_tokens_map.json` and `generation_config.json`, written where the source had none.
//!
//! Without `tokenizer_config.json` transformers guesses: 4.x builds the family's tokenizer
//! class with its default specials (Llama's `<s>`/`</s>`, added past the embedding when the
//! vocabulary has no such tokens), 5.x has no eos and no chat template. So the directory names
//! the generic fast tokenizer (`tokenizer.json` as it is), the bos/eos/pad tokens by their text,
//! and the chat template of the source.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::super::error::{CheckpointError, IoContext};

/// The text of token `id` in a `tokenizer.json`: an added (special) token, else a vocabulary
/// entry.
pub fn token_text(tokenizer: &Value, id: u64) -> Option<String> {
    let added = tokenizer.get("added_tokens").and_then(Value::as_array);
    let special = added.into_iter().flatten().find_map(|t| {
        (t.get("id")?.as_u64()? == id).then(|| t.get("content")?.as_str().map(String::from))?
    });
    special.or_else(|| {
        let vocab = tokenizer.get("model")?.get("vocab")?.as_object()?;
        vocab
            .iter()
            .find_map(|(text, v)| (v.as_u64() == Some(id)).then(|| text.clone()))
    })
}

/// A token id of `config.json` (`bos_token_id`, ...): a number, or the first of a list.
fn config_id(config: &Map<String, Value>, key: &str) -> Option<u64> {
    match config.get(key)? {
        Value::Array(ids) => ids.first()?.as_u64(),
        v => v.as_u64(),
    }
}

/// Writes into `dir` (which holds `tokenizer.json`) whichever of `tokenizer_config.json`,
/// `special_tokens_map.json` and `generation_config.json` it lacks, from the model's
/// `config` and `chat_template`; a `tokenizer_config.json` without a template gets
/// `chat_template`. Returns the files written. Without `tokenizer.json` nothing is written.
pub fn complete(
    dir: &Path,
    config: &Map<String, Value>,
    chat_template: Option<&str>,
) -> Result<Vec<std::path::PathBuf>, CheckpointError> {
    let tok_path = dir.join("tokenizer.json");
    let Ok(text) = std::fs::read_to_string(&tok_path) else {
        return Ok(Vec::new());
    };
    let tokenizer: Value = serde_json::from_str(&text)
        .map_err(|e| CheckpointError::incompatible(&tok_path, format!("is not valid JSON: {e}")))?;
    let text_of = |key: &str| config_id(config, key).and_then(|id| token_text(&tokenizer, id));
    let (bos, eos) = (text_of("bos_token_id"), text_of("eos_token_id"));
    let pad = text_of("pad_token_id").or_else(|| eos.clone());
    let mut specials = Map::new();
    for (key, v) in [
        ("bos_token", &bos),
        ("eos_token", &eos),
        ("pad_token", &pad),
    ] {
        if let Some(t) = v {
            specials.insert(key.into(), t.clone().into());
        }
    }
    let mut written = Vec::new();
    let mut write = |name: &str, v: &Map<String, Value>| -> Result<(), CheckpointError> {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(v).expect("a JSON map serializes");
        std::fs::write(&path, text).at(&path, "write")?;
        written.push(path);
        Ok(())
    };
    let tc_path = dir.join("tokenizer_config.json");
    let (mut tc, had) = match read_map(&tc_path)? {
        Some(tc) => (tc, true),
        None => {
            let mut tc = Map::new();
            tc.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
            tc.insert("clean_up_tokenization_spaces".into(), false.into());
            if let Some(n) = config_id(config, "max_position_embeddings")
                .or_else(|| config_id(config, "n_positions"))
            {
                tc.insert("model_max_length".into(), n.into());
            }
            (tc, false)
        }
    };
    let before = tc.len();
    for (key, v) in &specials {
        tc.entry(key.clone()).or_insert_with(|| v.clone());
    }
    if let Some(t) = chat_template {
        tc.entry("chat_template").or_insert_with(|| t.into());
    }
    if !had || tc.len() != before {
        write("tokenizer_config.json", &tc)?;
    }
    if !dir.join("special_tokens_map.json").is_file() {
        write("special_tokens_map.json", &specials)?;
    }
    if !dir.join("generation_config.json").is_file() {
        let mut g = Map::new();
        for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            if let Some(v) = config.get(key) {
                g.insert(key.into(), v.clone());
            }
        }
        g.insert("_from_model_config".into(), json!(true));
        write("generation_config.json", &g)?;
    }
    Ok(written)
}

/// The chat template of a model directory's `tokenizer_config.json`, if it has one.
pub fn chat_template(dir: &Path) -> Option<String> {
    let tc = read_map(&dir.join("tokenizer_config.json")).ok()??;
    match tc.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        // A list of named templates: the default one.
        Value::Array(list) => list.iter().find_map(|t| {
            (t.get("name")?.as_str()? == "default")
                .then(|| t.get("template")?.as_str().map(String::from))?
        }),
        _ => None,
    }
}

fn read_map(path: &Path) -> Result<Option<Map<String, Value>>, CheckpointError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(None);
    };
    match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => Ok(Some(m)),
        _ => Err(CheckpointError::incompatible(path, "is not a JSON object")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_files_are_written_with_the_specials_and_the_template() {
        let dir = tempfile::tempdir().unwrap();
        let tok = json!({
            "added_tokens": [{"id": 0, "content": "<|endoftext|>"}, {"id": 2, "content": "<|im_end|>"}],
            "model": {"vocab": {"<|endoftext|>": 0, "a": 1, "<|im_end|>": 2}}
        });
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let config = json!({"bos_token_id": 0, "eos_token_id": [2], "max_position_embeddings": 64});
        let written = complete(
            dir.path(),
            config.as_object().unwrap(),
            Some("{{ messages }}"),
        )
        .unwrap();
        assert_eq!(written.len(), 3);
        let tc = read_map(&dir.path().join("tokenizer_config.json"))
            .unwrap()
            .unwrap();
        assert_eq!(tc["bos_token"], "<|endoftext|>");
        assert_eq!(tc["eos_token"], "<|im_end|>");
        assert_eq!(tc["pad_token"], "<|im_end|>");
        assert_eq!(tc["model_max_length"], 64);
        assert_eq!(chat_template(dir.path()).as_deref(), Some("{{ messages }}"));
        let g = read_map(&dir.path().join("generation_config.json"))
            .unwrap()
            .unwrap();
        assert_eq!(g["eos_token_id"], json!([2]));
        // Present files are kept.
        assert!(complete(dir.path(), config.as_object().unwrap(), None)
            .unwrap()
            .is_empty());
    }
}
