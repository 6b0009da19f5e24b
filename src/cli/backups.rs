//! `ezero train`'s default for buddy backups. Its ranks share one process, and a process dies
//! whole (an OOM kill, a signal, a lost machine), taking every in-memory backup with it: there,
//! backups protect only against losing one rank actor. So they are on by default only when the
//! run can lose one alone (`TrainConfig::in_process_losses_possible`); a flag, the config file
//! or a resumed checkpoint decides otherwise. Worker processes (`ezero launch`, `ezero worker`)
//! keep the library's default of a backup every step: there a rank is a process of its own.

use elastic_zero::config::TrainConfig;

use super::{CliError, TrainArgs};

/// Why backups are on or off when nobody chose, for the banner (`None`: somebody chose).
pub struct BackupDefault(Option<&'static str>);

/// Applies the default to `cfg` unless `--replicate-every`, the config file or `--resume` set it.
pub fn apply_default(args: &TrainArgs, cfg: &mut TrainConfig) -> Result<BackupDefault, CliError> {
    if args.replicate_every.is_some() || args.resume.is_some() || config_file_sets(args)? {
        return Ok(BackupDefault(None));
    }
    if cfg.in_process_losses_possible(args.control_allow_kill) {
        cfg.replicate_every = cfg.replicate_every.max(1);
        return Ok(BackupDefault(Some(
            "on: this run can lose a rank actor alone (a kill, an operator's kill or network faults)",
        )));
    }
    cfg.replicate_every = 0;
    Ok(BackupDefault(Some(
        "off: every rank is in this process, which dies whole; --replicate-every 1 keeps a copy of each rank's state on its buddy",
    )))
}

impl BackupDefault {
    /// `buddy backups: off (...)`, or nothing when a flag, file or checkpoint chose.
    pub fn describe(&self, cfg: &TrainConfig) -> Option<String> {
        if cfg.ranks < 2 {
            return None;
        }
        self.0.map(|why| format!("buddy backups: {why}"))
    }
}

/// Whether `--config FILE` names `replicate_every` (the file was read and parsed before).
fn config_file_sets(args: &TrainArgs) -> Result<bool, CliError> {
    let Some(path) = &args.config else {
        return Ok(false);
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Usage(format!("cannot read {}: {e}", path.display())))?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| CliError::Usage(format!("{}: {e}", path.display())))?;
    Ok(table.contains_key("replicate_every"))
}
