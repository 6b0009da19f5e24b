//! Test hooks across the process boundary: environment variables only the test suite sets, for
//! the faults a test must cause inside an `ezero train` process. They are not flags, so they are
//! neither in `--help` nor suggested for a mistyped flag, and their names say what they are:
//! each one breaks the run on purpose. Worker processes refuse them.

use elastic_zero::config::TrainConfig;

use super::CliError;

/// `RANK@STEP`: that rank's compute panics at that step (0-based).
pub const PANIC_AT: &str = "EZERO_TEST_HOOK_PANIC_AT";
/// `STEP`: a real SIGTERM is raised during this step (1-based), so the run saves after it and
/// stops.
pub const SIGTERM_AT: &str = "EZERO_TEST_HOOK_SIGTERM_AT";
/// `STEP:POINT`: the process aborts at that point of that step's save.
pub const CHECKPOINT_CRASH: &str = "EZERO_TEST_HOOK_CHECKPOINT_CRASH";
/// `BYTES`: `ezero coordinator` sends chunk states in parts of at most this many bytes, so a
/// small model crosses the control connections in many parts.
pub const STATE_PART_MAX_BYTES: &str = "EZERO_TEST_HOOK_STATE_PART_MAX_BYTES";

/// The hooks a test set for this process.
#[derive(Clone, Debug, Default)]
pub struct TestHooks {
    panic_at: Option<(u32, u64)>,
    sigterm_at: Option<u64>,
    /// Parsed where the save runs (`checkpoint::saving`).
    pub checkpoint_crash: Option<String>,
    /// The coordinator's own; it changes no bits, so it is not refused there.
    pub state_part_max_bytes: Option<usize>,
}

impl TestHooks {
    /// The hooks in this process's environment; a malformed one is a usage error.
    pub fn from_env() -> Result<TestHooks, CliError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let bad = |name: &str, why: &str| CliError::Usage(format!("{name}: {why}"));
        let panic_at = match var(PANIC_AT) {
            Some(v) => Some(parse_rank_at(&v).map_err(|e| bad(PANIC_AT, e))?),
            None => None,
        };
        let sigterm_at = match var(SIGTERM_AT) {
            Some(v) => Some(v.parse().map_err(|_| bad(SIGTERM_AT, "expected STEP"))?),
            None => None,
        };
        let state_part_max_bytes = match var(STATE_PART_MAX_BYTES) {
            Some(v) => Some(
                v.parse()
                    .map_err(|_| bad(STATE_PART_MAX_BYTES, "expected BYTES"))?,
            ),
            None => None,
        };
        Ok(TestHooks {
            panic_at,
            sigterm_at,
            checkpoint_crash: var(CHECKPOINT_CRASH),
            state_part_max_bytes,
        })
    }

    /// Puts the hooks the config's fault section carries into `cfg`.
    pub fn apply(&self, cfg: &mut TrainConfig) {
        if self.panic_at.is_some() {
            cfg.faults.panic_at = self.panic_at;
        }
        // Stopped after STEP steps, so raised during step STEP - 1 (0-based).
        if let Some(n) = self.sigterm_at {
            cfg.faults.raise_sigterm_at = n.checked_sub(1);
        }
    }

    /// The first hook that is set that worker processes cannot honour, by its variable's name.
    pub fn first_set(&self) -> Option<&'static str> {
        [
            (PANIC_AT, self.panic_at.is_some()),
            (SIGTERM_AT, self.sigterm_at.is_some()),
            (CHECKPOINT_CRASH, self.checkpoint_crash.is_some()),
        ]
        .into_iter()
        .find(|(_, on)| *on)
        .map(|(name, _)| name)
    }
}

fn parse_rank_at(s: &str) -> Result<(u32, u64), &'static str> {
    let (r, st) = s.split_once('@').ok_or("expected RANK@STEP")?;
    Ok((
        r.parse().map_err(|_| "bad RANK")?,
        st.parse().map_err(|_| "bad STEP")?,
    ))
}
