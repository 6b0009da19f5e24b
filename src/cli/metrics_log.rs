//! `--metrics-file FILE.jsonl`: one JSON record a step, appended as the step ends, from the
//! process that drives the run (`ezero train`, or the coordinator of worker processes).

use std::cell::RefCell;
use std::fs::File;
use std::io::Write;

use elastic_zero::config::TrainConfig;
use elastic_zero::engine::coordinator::StepRecord;

use super::CliError;

pub struct MetricsLog(RefCell<File>);

impl MetricsLog {
    /// Opens `cfg.metrics_file` for appending (`None` without one).
    pub fn open(cfg: &TrainConfig) -> Result<Option<Self>, CliError> {
        let Some(path) = &cfg.metrics_file else {
            return Ok(None);
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| CliError::Usage(format!("--metrics-file {}: {e}", path.display())))?;
        Ok(Some(Self(RefCell::new(file))))
    }

    /// Appends the record of `rec`; a failed write is the caller's to report, not fatal.
    pub fn record(&self, cfg: &TrainConfig, rec: &StepRecord, tps: f64) -> Result<(), String> {
        let line = serde_json::json!({
            "step": rec.step + 1,
            "loss": rec.loss,
            "lr": elastic_zero::job::lr_schedule(cfg).lr_at(rec.step + 1),
            "grad_norm": rec.grad_norm,
            "tokens_per_s": tps,
            "step_s": rec.duration_ms as f64 / 1e3,
            "members": rec.reports.len(),
            "skipped": rec.skipped,
            "eval_loss": rec.eval_loss,
        });
        writeln!(self.0.borrow_mut(), "{line}")
            .map_err(|e| format!("--metrics-file: cannot write: {e}"))
    }
}
