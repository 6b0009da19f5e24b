//! A model's chat template (the Jinja text of its `tokenizer_config.json` or of a GGUF file's
//! `tokenizer.chat_template`), rendered as transformers renders it: blocks trimmed and
//! left-stripped, `bos_token`/`eos_token`, `add_generation_prompt`, `raise_exception`, and
//! Python's string methods (`.strip()`, `.startswith()`, ...).
//!
//! Which text is the assistant's: the template renders every prefix of the conversation, and
//! assistant turn `i` is the text between the conversation up to `i` with the generation prompt
//! and the conversation through `i` (its content and the end-of-turn marker the template writes
//! after it). Templates whose renders are not prefixes of each other are refused: their
//! assistant text cannot be told apart.

use std::path::{Path, PathBuf};

use minijinja::{context, Environment, Error, ErrorKind};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A chat template with the special tokens it may name.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
    /// Where the template came from, for messages.
    origin: PathBuf,
}

/// The text of a special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(m)) => m
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    pub fn new(source: impl Into<String>, bos_token: &str, eos_token: &str) -> Self {
        Self {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            origin: PathBuf::new(),
        }
    }

    /// The template of `tokenizer_config.json` at `path`; `Ok(None)` if the file is missing or
    /// has no `chat_template` (a list of named templates gives its `default`).
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>, String> {
        let Ok(text) = std::fs::read_to_string(path) else {
            return Ok(None);
        };
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
        let source = match v.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => {
                let default = list.iter().find_map(|t| {
                    (t.get("name")?.as_str()? == "default")
                        .then(|| t.get("template")?.as_str().map(String::from))?
                });
                match default {
                    Some(s) => s,
                    None => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        Ok(Some(Self {
            source,
            bos_token: token_text(v.get("bos_token")),
            eos_token: token_text(v.get("eos_token")),
            origin: path.to_path_buf(),
        }))
    }

    /// The text of the model's end-of-sequence token (empty if the config names none).
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Where the template was read from (empty for one built in code).
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    fn environment(&self) -> Result<Environment<'_>, String> {
        let mut env = Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source)
            .map_err(|e| format!("the chat template does not parse: {e}"))?;
        Ok(env)
    }

    /// The conversation as the template writes it.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let env = self.environment()?;
        self.render_in(&env, messages, add_generation_prompt)
    }

    fn render_in(
        &self,
        env: &Environment<'_>,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let tmpl = env.get_template("chat").map_err(|e| e.to_string())?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| format!("the chat template failed: {e}"))
    }

    /// The rendered conversation cut into parts, each with whether it is assistant text (see
    /// the module docs); the parts join to [`ChatTemplate::render`] without a generation prompt.
    pub fn segments(&self, messages: &[Message]) -> Result<Vec<(String, bool)>, String> {
        let env = self.environment()?;
        let full = self.render_in(&env, messages, false)?;
        let mut parts = Vec::new();
        let mut at = 0;
        for (i, m) in messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let before = self.render_in(&env, &messages[..i], true)?;
            let through = self.render_in(&env, &messages[..=i], false)?;
            let prefixes =
                through.starts_with(&before) && full.starts_with(&through) && before.len() >= at;
            if !prefixes {
                return Err(format!(
                    "the chat template does not render the conversation up to assistant message \
                     {} as a prefix of the whole, so its tokens cannot be told apart; use \
                     prompt/completion records instead",
                    i + 1
                ));
            }
            parts.push((full[at..before.len()].to_string(), false));
            parts.push((full[before.len()..through.len()].to_string(), true));
            at = through.len();
        }
        if at < full.len() {
            parts.push((full[at..].to_string(), false));
        }
        parts.retain(|(text, _)| !text.is_empty());
        Ok(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' \
        + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}\
        {{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn segments_mark_the_assistant_turns_and_join_to_the_render() {
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>");
        let conv = [
            msg("user", "Hi"),
            msg("assistant", "Hello."),
            msg("user", "Bye"),
            msg("assistant", "Bye."),
        ];
        let parts = t.segments(&conv).unwrap();
        let joined: String = parts.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(joined, t.render(&conv, false).unwrap());
        let trained: Vec<&str> = parts
            .iter()
            .filter(|(_, k)| *k)
            .map(|(s, _)| s.as_str())
            .collect();
        assert_eq!(trained, ["Hello.<|im_end|>\n", "Bye.<|im_end|>\n"]);
        assert!(parts[0].0.ends_with("<|im_start|>assistant\n") && !parts[0].1);
    }

    #[test]
    fn python_methods_raise_exception_and_special_tokens_work() {
        let src =
            "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}\
            {{ raise_exception('bad role ' + m.role) }}{% endif %}{{ m.content.strip().upper() }}\
            {{ eos_token }}{% endfor %}";
        let t = ChatTemplate::new(src, "<s>", "</s>");
        assert_eq!(
            t.render(&[msg("user", "  hi ")], false).unwrap(),
            "<s>HI</s>"
        );
        let err = t.render(&[msg("tool", "x")], false).unwrap_err();
        assert!(err.contains("bad role tool"), "{err}");
    }

    #[test]
    fn templates_that_rewrite_earlier_turns_are_refused() {
        // The last message is rendered differently, so prefixes do not line up.
        let src = "{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}\
            {{ m.content }}{% endif %}{% endfor %}";
        let t = ChatTemplate::new(src, "", "");
        let err = t
            .segments(&[msg("user", "a"), msg("assistant", "b"), msg("user", "c")])
            .unwrap_err();
        assert!(err.contains("prefix"), "{err}");
    }
}
