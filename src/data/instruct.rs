//! Instruction data: JSON Lines records of a chat (`{"messages": [{"role", "content"}, ..]}`,
//! rendered with the model's chat template), a `{"prompt", "completion"}` pair, or `{"text"}`,
//! with the loss on the assistant's or the completion's tokens only.
//!
//! Layout: padding, one record a row. Row `r` of micro-batch `i` of step `s` is record
//! `mix(seed, s, i, r) mod records`, its first `seq + 1` tokens (the rest is cut and never
//! trained), padded to `seq + 1` with the end-of-text id; padded and prompt targets are masked.
//! Rows never share a record, and causal attention keeps the padding out of the record's
//! logits. The step's loss is the mean over its unmasked targets: their count over the step's
//! micro-batches is part of every micro-batch ([`LossMask`]), computed from the same pure
//! function of `(seed, step, index, row)`, so every rank weighs them alike.
//!
//! What is trained: a chat's assistant turns, each with the end-of-turn text its template
//! writes after it; a completion and the end-of-text token after it; all of a `text` record
//! and the end-of-text token after it. A record with nothing trained in its first `seq + 1`
//! tokens (a prompt longer than the window) is refused by [`InstructData::validate`], naming
//! its file and line, so no step can have zero unmasked targets.

use std::path::{Path, PathBuf};

use super::chat::{ChatTemplate, Message};
use super::{mix, DataError};
use crate::model::{LossMask, MicroBatch};

/// One JSON Lines record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    Text(String),
    Completion { prompt: String, completion: String },
    Chat(Vec<Message>),
}

impl Record {
    /// The record of one JSON line, or what is wrong with it.
    pub fn parse(line: &str) -> Result<Record, String> {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        if let Some(m) = v.get("messages") {
            let messages: Vec<Message> = serde_json::from_value(m.clone()).map_err(|e| {
                format!("`messages` is not a list of {{\"role\", \"content\"}} strings: {e}")
            })?;
            if messages.is_empty() {
                return Err("`messages` is empty".into());
            }
            return Ok(Record::Chat(messages));
        }
        let text = |k: &str| v.get(k).and_then(|t| t.as_str()).map(String::from);
        match (text("prompt"), text("completion"), text("text")) {
            (Some(prompt), Some(completion), _) => Ok(Record::Completion { prompt, completion }),
            (_, _, Some(t)) => Ok(Record::Text(t)),
            _ => Err(
                "has no `messages` list, string `prompt` and `completion`, or string \
                      `text`: give each record one of them"
                    .into(),
            ),
        }
    }

    pub fn is_text(&self) -> bool {
        matches!(self, Record::Text(_))
    }
}

/// A record with where it was read (file and 1-based line).
#[derive(Clone, Debug)]
pub struct Sourced {
    pub record: Record,
    pub path: PathBuf,
    pub line: usize,
}

/// Every record of the JSON Lines `files` in order (blank lines skipped); a text file is one
/// `text` record (line 1). `jsonl(path)` says which files are JSON Lines.
pub fn read_records(
    files: &[PathBuf],
    jsonl: impl Fn(&Path) -> bool,
) -> Result<Vec<Sourced>, DataError> {
    let mut out = Vec::new();
    for path in files {
        let bytes = std::fs::read(path).map_err(|source| DataError::Io {
            path: path.clone(),
            source,
        })?;
        let text = String::from_utf8(bytes).map_err(|e| DataError::Source {
            path: path.clone(),
            what: format!("is not UTF-8 text: {e}"),
        })?;
        if !jsonl(path) {
            out.push(Sourced {
                record: Record::Text(text),
                path: path.clone(),
                line: 1,
            });
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let record = Record::parse(line).map_err(|what| DataError::Jsonl {
                path: path.clone(),
                line: i + 1,
                what,
            })?;
            out.push(Sourced {
                record,
                path: path.clone(),
                line: i + 1,
            });
        }
    }
    Ok(out)
}

/// One tokenized record: its ids and which of them are trained.
#[derive(Clone, Debug)]
struct Row {
    ids: Vec<u32>,
    trained: Vec<bool>,
    path: PathBuf,
    line: usize,
}

impl Row {
    /// Trained targets in a window of `seq + 1` tokens (position 0 is never a target).
    fn kept(&self, seq: usize) -> usize {
        let end = self.ids.len().min(seq + 1);
        self.trained
            .get(1..end)
            .map_or(0, |t| t.iter().filter(|&&k| k).count())
    }
}

/// Instruction records as token ids with their loss mask (see the module docs).
#[derive(Clone, Debug)]
pub struct InstructData {
    rows: Vec<Row>,
    /// The end-of-text id: after completions and texts, and the padding.
    pad: u32,
    vocab: usize,
    /// Micro-batches a step has: the count of unmasked targets spans all of them.
    micro_batches: u32,
    describe: String,
}

/// What tokenizing instruction records needs besides the records.
pub struct InstructSetup<'a> {
    pub tokenizer: &'a tokenizers::Tokenizer,
    /// The model's chat template (needed by chat records only).
    pub template: Option<&'a ChatTemplate>,
    /// Where a template was looked for, for the message when there is none.
    pub template_looked_at: &'a Path,
    pub micro_batches: u32,
    pub describe: String,
}

impl InstructData {
    /// Tokenizes `records`; a chat record without a template is an error naming its line.
    pub fn new(records: &[Sourced], setup: &InstructSetup<'_>) -> Result<Self, DataError> {
        let tok = setup.tokenizer;
        let eos_text = setup.template.map(|t| t.eos_token()).unwrap_or_default();
        let eos = tok
            .token_to_id(eos_text)
            .or_else(|| super::tokens::end_of_text(tok));
        let mut rows = Vec::with_capacity(records.len());
        for s in records {
            let bad = |what: String| DataError::Jsonl {
                path: s.path.clone(),
                line: s.line,
                what,
            };
            let parts: Vec<(String, bool)> = match &s.record {
                Record::Text(t) => vec![(t.clone(), true)],
                Record::Completion { prompt, completion } => {
                    vec![(prompt.clone(), false), (completion.clone(), true)]
                }
                Record::Chat(messages) => {
                    let t = setup.template.ok_or_else(|| {
                        bad(format!(
                            "a chat record, but the model has no chat template ({} has no \
                             `chat_template`): use prompt/completion records, or a model \
                             (or --tokenizer beside a tokenizer_config.json) with a template",
                            setup.template_looked_at.display()
                        ))
                    })?;
                    t.segments(messages).map_err(bad)?
                }
            };
            let mut row = Row {
                ids: Vec::new(),
                trained: Vec::new(),
                path: s.path.clone(),
                line: s.line,
            };
            for (text, trained) in &parts {
                let enc = tok
                    .encode(text.as_str(), false)
                    .map_err(|e| bad(format!("cannot tokenize: {e}")))?;
                row.ids.extend_from_slice(enc.get_ids());
                row.trained.extend(std::iter::repeat_n(*trained, enc.len()));
            }
            // A chat's turns end with the template's own end-of-turn text.
            if !matches!(s.record, Record::Chat(_)) {
                row.ids.extend(eos);
                row.trained.extend(eos.map(|_| true));
            }
            rows.push(row);
        }
        Ok(Self {
            rows,
            pad: eos.unwrap_or(0),
            vocab: tok.get_vocab_size(true),
            micro_batches: setup.micro_batches,
            describe: setup.describe.clone(),
        })
    }

    /// Checks that there is a record and that each has a trained target within `seq + 1`
    /// tokens, naming the first that has none.
    pub fn validate(&self, seq: usize) -> Result<(), DataError> {
        if self.rows.is_empty() {
            return Err(DataError::Source {
                path: PathBuf::from(&self.describe),
                what: "holds no records".into(),
            });
        }
        match self.rows.iter().find(|r| r.kept(seq) == 0) {
            Some(r) => Err(DataError::Jsonl {
                path: r.path.clone(),
                line: r.line,
                what: format!(
                    "no assistant or completion token within the first {} tokens (seq-len + 1; \
                     the record has {}, its prompt takes {}): a step of such rows would have \
                     nothing to learn; use a longer --seq-len or a shorter prompt",
                    seq + 1,
                    r.ids.len(),
                    r.trained.iter().take_while(|&&k| !k).count()
                ),
            }),
            None => Ok(()),
        }
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    pub fn records(&self) -> usize {
        self.rows.len()
    }

    /// The record row `row` of micro-batch `index` of `step` reads.
    fn pick(&self, coords: [u64; 3], row: usize) -> &Row {
        let [seed, step, index] = coords;
        let n = self.rows.len() as u64;
        // The remainder is below the record count, itself a usize.
        &self.rows[(mix(&[seed, step, index, row as u64]) % n) as usize]
    }

    /// Micro-batch `index` of step `step` (see the module docs). Call
    /// [`InstructData::validate`] first: it guarantees every row, so every step, an unmasked
    /// target.
    pub fn micro_batch(
        &self,
        seed: u64,
        step: u64,
        index: u64,
        batch: usize,
        seq: usize,
    ) -> MicroBatch {
        // Validating every record here would cost records x seq per micro-batch.
        assert!(
            !self.rows.is_empty(),
            "instruction data without records: validate it first"
        );
        let mut inputs = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        let mut keep = Vec::with_capacity(batch * seq);
        for r in 0..batch {
            let row = self.pick([seed, step, index], r);
            let at = |j: usize| row.ids.get(j).copied().unwrap_or(self.pad);
            inputs.extend((0..seq).map(at));
            targets.extend((1..=seq).map(at));
            keep.extend((1..=seq).map(|j| row.trained.get(j).copied().unwrap_or(false)));
        }
        let step_tokens: usize = (0..u64::from(self.micro_batches))
            .flat_map(|i| (0..batch).map(move |r| (i, r)))
            .map(|(i, r)| self.pick([seed, step, i], r).kept(seq))
            .sum();
        MicroBatch {
            inputs,
            targets,
            batch,
            seq,
            loss_mask: Some(LossMask {
                keep,
                step_tokens: step_tokens as u64,
                micro_batches: self.micro_batches,
            }),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "instruct({}, {} records of a {}-id vocabulary, padded rows, loss on the \
             assistant/completion tokens)",
            self.describe,
            self.rows.len(),
            self.vocab
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The step's count is the kept targets of all its micro-batches, the same in each; rows
    /// are padded past their record with masked targets.
    #[test]
    fn every_micro_batch_carries_the_steps_count_of_kept_targets() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-tiny");
        let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let records: Vec<Sourced> = [("Q: a", " yes"), ("Q: longer prompt", " no!"), ("x", "y")]
            .iter()
            .enumerate()
            .map(|(i, (p, c))| Sourced {
                record: Record::Completion {
                    prompt: p.to_string(),
                    completion: c.to_string(),
                },
                path: PathBuf::from("d.jsonl"),
                line: i + 1,
            })
            .collect();
        let setup = InstructSetup {
            tokenizer: &tok,
            template: None,
            template_looked_at: Path::new("none"),
            micro_batches: 3,
            describe: "d.jsonl".into(),
        };
        let data = InstructData::new(&records, &setup).unwrap();
        data.validate(24).unwrap();
        let mbs: Vec<MicroBatch> = (0..3).map(|i| data.micro_batch(5, 2, i, 4, 24)).collect();
        let kept: usize = mbs
            .iter()
            .map(|mb| {
                mb.loss_mask
                    .as_ref()
                    .unwrap()
                    .keep
                    .iter()
                    .filter(|&&k| k)
                    .count()
            })
            .sum();
        for mb in &mbs {
            let m = mb.loss_mask.as_ref().unwrap();
            assert_eq!((m.step_tokens, m.micro_batches), (kept as u64, 3));
            // The last target of every row is padding (records are shorter than 24).
            assert!(m.keep.chunks(24).all(|row| !row[23]));
        }
        // Too short a window for the second record's prompt: refused, naming its line.
        let err = data.validate(4).unwrap_err().to_string();
        assert!(err.starts_with("d.jsonl:2:"), "{err}");
    }

    #[test]
    fn records_parse_by_their_fields() {
        let chat =
            r#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}"#;
        assert!(matches!(Record::parse(chat), Ok(Record::Chat(m)) if m.len() == 2));
        assert_eq!(
            Record::parse(r#"{"prompt":"p","completion":"c"}"#),
            Ok(Record::Completion {
                prompt: "p".into(),
                completion: "c".into()
            })
        );
        assert_eq!(
            Record::parse(r#"{"text":"t"}"#),
            Ok(Record::Text("t".into()))
        );
        for bad in [
            r#"{"prompt":"p"}"#,
            r#"{"messages":[]}"#,
            r#"{"messages":[{"role":"user"}]}"#,
            r#"{"text":3}"#,
            "nope",
        ] {
            assert!(Record::parse(bad).is_err(), "{bad}");
        }
    }
}
