//! What a bad config gets: the key that was wrong and what would be valid.

/// A configuration error: which field, and what would be valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{field}`: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(field: &str, message: impl Into<String>) -> Self {
        Self {
            field: field.to_string(),
            message: message.into(),
        }
    }
}

/// A TOML error of the config file `text`, naming the key and its line: from the error's
/// position where the parser gave one, else from the line holding the value it quotes (an
/// unknown enum value found after merging a file over a checkpoint's config).
pub(super) fn toml_error(e: toml::de::Error, text: &str) -> ConfigError {
    let msg = e.message().replace('\n', " ");
    let unknown = unknown_field(&msg);
    // An unknown key's error spans its whole table: find the key's own line.
    let key_line = unknown.as_deref().and_then(|k| {
        text.lines()
            .position(|l| l.split_once('=').is_some_and(|(a, _)| a.trim() == k))
            .map(|i| i + 1)
    });
    let line = key_line.or_else(|| match e.span() {
        Some(span) => Some(text[..span.start.min(text.len())].lines().count().max(1)),
        None => quoted(&msg).and_then(|v| {
            let needle = format!("\"{v}\"");
            text.lines()
                .position(|l| l.contains(&needle))
                .map(|i| i + 1)
        }),
    });
    let key = line
        .and_then(|n| text.lines().nth(n - 1))
        .and_then(|l| l.split_once('='))
        .map(|(k, _)| k.trim().trim_matches('"').to_string())
        .filter(|k| !k.is_empty() && !k.starts_with('['));
    let field = unknown.or(key).unwrap_or_else(|| "config".to_string());
    match line {
        Some(n) => ConfigError::new(&field, format!("line {n}: {msg}")),
        None => ConfigError::new(&field, msg),
    }
}

/// The first `quoted` token of a serde message (the offending value).
fn quoted(msg: &str) -> Option<&str> {
    msg.split('`').nth(1)
}

fn unknown_field(msg: &str) -> Option<String> {
    let rest = msg.split("unknown field `").nth(1)?;
    Some(rest.split('`').next()?.to_string())
}
