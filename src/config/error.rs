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

pub(super) fn toml_error(e: toml::de::Error) -> ConfigError {
    let msg = e.message().to_string();
    let field = unknown_field(&msg).unwrap_or_else(|| "config".to_string());
    ConfigError::new(&field, msg.replace('\n', " "))
}

fn unknown_field(msg: &str) -> Option<String> {
    let rest = msg.split("unknown field `").nth(1)?;
    Some(rest.split('`').next()?.to_string())
}
