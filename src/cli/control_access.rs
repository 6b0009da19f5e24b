//! Who may change a job through its control endpoint: the operator token, read from a file or
//! the environment (never from a flag's value, which `ps` shows to every user of the host), and
//! which requests need it.

use std::net::SocketAddr;

use elastic_zero::runtime::api::http::{Access, AuthScope};

use super::{CliError, TrainArgs};

/// Longest operator token accepted.
const TOKEN_MAX_BYTES: usize = 4096;

/// `--control-auth`.
pub fn parse_auth_scope(s: &str) -> Result<AuthScope, String> {
    match s {
        "writes" => Ok(AuthScope::Writes),
        "all" => Ok(AuthScope::All),
        _ => Err(format!(
            "unknown scope `{s}`: use writes (drain, kill, join, checkpoint) or all (status and metrics too)"
        )),
    }
}

/// The endpoint's access rules for `addr`, from `--control-token-file` (or
/// `EZERO_CONTROL_TOKEN_FILE`), `EZERO_CONTROL_TOKEN` and `--control-auth`; says on stderr when
/// an endpoint beyond loopback will refuse every change for want of a token.
pub fn control_access(args: &TrainArgs, addr: SocketAddr) -> Result<Access, CliError> {
    let token = match &args.control_token_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                CliError::Usage(format!("--control-token-file {}: {e}", path.display()))
            })?;
            Some(checked(
                text.trim(),
                &format!("--control-token-file {}", path.display()),
            )?)
        }
        None => match std::env::var("EZERO_CONTROL_TOKEN") {
            Ok(t) => Some(checked(t.trim(), "EZERO_CONTROL_TOKEN")?),
            Err(_) => None,
        },
    };
    let scope = args.control_auth.unwrap_or_default();
    if scope == AuthScope::All && token.is_none() {
        return Err(CliError::Usage(
            "--control-auth all needs an operator token: set EZERO_CONTROL_TOKEN_FILE (or --control-token-file FILE)".into(),
        ));
    }
    let access = Access::new(addr, token, scope);
    if access.beyond_loopback && access.token.is_none() {
        eprintln!(
            "warning: the control endpoint on {addr} listens beyond loopback without an operator token: it serves GET /status and /metrics and refuses every change (set EZERO_CONTROL_TOKEN_FILE to allow them)"
        );
    }
    Ok(access)
}

fn checked(token: &str, from: &str) -> Result<String, CliError> {
    if token.is_empty() || token.len() > TOKEN_MAX_BYTES || token.chars().any(char::is_whitespace) {
        return Err(CliError::Usage(format!(
            "{from}: the operator token must be 1-{TOKEN_MAX_BYTES} bytes without spaces"
        )));
    }
    Ok(token.to_string())
}
