//! Saving during `ezero train` and `ezero coordinator`: the background writer, the save
//! schedule, streamed snapshots when the state is on the tiers, and SIGTERM/SIGINT (a last
//! checkpoint at the next step boundary, then a clean stop).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use elastic_zero::checkpoint::{
    store, CheckpointError, CheckpointMeta, CheckpointSink, CheckpointWriter, CrashPoint,
    SaveOptions, SaveReport,
};
use elastic_zero::config::TrainConfig;
use elastic_zero::data::Dataset;
use elastic_zero::engine::coordinator::{MembershipRecord, StepRecord};
use elastic_zero::model::Model;
use elastic_zero::plan::RankId;
use elastic_zero::runtime::actors::{BoundarySnapshot, Snapshot};
use elastic_zero::runtime::api::cluster::Observer;
use elastic_zero::runtime::api::notice::Notice;
use elastic_zero::runtime::step::elastic::snapshot::SnapshotSink;
use elastic_zero::runtime::ChangeRecord;

use super::usage;
use crate::cli::{CliError, TrainArgs};

/// Saving during `ezero train`: a background writer, the save schedule, and the signal flag.
pub struct Saving {
    writer: CheckpointWriter,
    /// Outcomes of the saves streamed through [`SavePlan::sink`] (state on the tier).
    streamed: Receiver<Result<SaveReport, CheckpointError>>,
    root: PathBuf,
    save_every: u64,
    total_steps: u64,
    /// The signal number received (0: none).
    signal: Arc<AtomicUsize>,
    failures: usize,
    /// How to resume, for the line printed on a signal (`resume_with`).
    resume_hint: String,
    /// The cluster's boundary-snapshot flag, which a signal sets (and `stop_at_boundary`).
    boundary: Arc<AtomicBool>,
    /// Why the run stops at the next boundary when a signal did not ask (a notice the job
    /// cannot grant).
    stop_why: Option<String>,
    /// End the process once the last checkpoint is saved (`ezero train`); otherwise keep the
    /// line and exit code in `stopped` for the driver, which tells the workers first.
    exit_on_stop: bool,
    stopped: Option<Stopped>,
}

/// How a run that stopped early (a signal, a notice) ends the process.
#[derive(Clone, Debug)]
pub struct Stopped {
    pub code: i32,
    pub line: String,
}

const SIGNALS: [i32; 2] = [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT];

/// What saving needs before anything is written: the manifest's fixed part, the options, and
/// the sink that streamed snapshots go to (the cluster gets it at start; it writes nothing
/// until the first snapshot, after [`SavePlan::start`]).
pub struct SavePlan {
    root: PathBuf,
    meta: CheckpointMeta,
    opts: SaveOptions,
    sink: Arc<CheckpointSink>,
    streamed: Receiver<Result<SaveReport, CheckpointError>>,
}

impl SavePlan {
    /// The plan if `cfg` has a save dir.
    pub fn new(
        cfg: &TrainConfig,
        model: &dyn Model,
        data: &Dataset,
        args: &TrainArgs,
    ) -> Result<Option<SavePlan>, CliError> {
        let Some(root) = cfg.save_dir.clone() else {
            return Ok(None);
        };
        let meta = CheckpointMeta::new(cfg, model, data).map_err(usage)?;
        let crash = args
            .test_hooks
            .checkpoint_crash
            .as_deref()
            .map(parse_crash)
            .transpose()
            .map_err(CliError::Usage)?;
        let opts = SaveOptions {
            keep: cfg.keep_checkpoints,
            crash,
        };
        let (tx, streamed) = std::sync::mpsc::channel();
        let sink = Arc::new(CheckpointSink::new(root.clone(), meta.clone(), opts, tx));
        Ok(Some(SavePlan {
            root,
            meta,
            opts,
            sink,
            streamed,
        }))
    }

    /// Where the cluster streams snapshots when its state is on the tier.
    pub fn sink(&self) -> Arc<dyn SnapshotSink> {
        Arc::clone(&self.sink) as Arc<dyn SnapshotSink>
    }

    /// Checks the save directory, starts the writer and installs the SIGTERM/SIGINT handlers.
    /// `resumed_from` is the checkpoint the run continues, if any; a signal also sets
    /// `boundary`'s flag, which the cluster was given (`boundary_snapshot`).
    pub fn start(
        self,
        cfg: &TrainConfig,
        resumed_from: Option<&Path>,
        boundary: &BoundarySnapshot,
    ) -> Result<Saving, CliError> {
        let SavePlan {
            root,
            meta,
            opts,
            streamed,
            ..
        } = self;
        check_save_dir(&root, resumed_from)?;
        let writer = CheckpointWriter::spawn(root.clone(), meta, opts)
            .map_err(|e| CliError::Failed(e.to_string()))?;
        let signal = stop_signal()?;
        // The boundary flag asks the cluster for the snapshot this checkpoint is written from.
        for sig in SIGNALS {
            signal_hook::flag::register(sig, Arc::clone(&boundary.flag))
                .map_err(|e| CliError::Failed(format!("cannot install a signal handler: {e}")))?;
        }
        Ok(Saving {
            writer,
            streamed,
            root,
            save_every: cfg.save_every,
            total_steps: cfg.steps,
            signal,
            resume_hint: "ezero train --resume".into(),
            failures: 0,
            boundary: Arc::clone(&boundary.flag),
            stop_why: None,
            exit_on_stop: true,
            stopped: None,
        })
    }
}

impl Saving {
    /// What the cluster needs to answer a signal with a snapshot at the next step boundary
    /// (`SavePlan::start` makes SIGTERM and SIGINT set its flag): snapshots are taken only when
    /// a save is due or asked for, not at every boundary in case a signal comes.
    pub fn boundary_snapshot() -> BoundarySnapshot {
        BoundarySnapshot {
            flag: Arc::default(),
            // The test hook, if any, comes from the run plan's faults (the cluster sets it).
            raise_sigterm_at: None,
        }
    }

    fn report(&mut self, results: Vec<Result<SaveReport, CheckpointError>>) {
        self.failures += report(results);
    }

    /// Reports the saves that finished since the last step.
    fn poll(&mut self) {
        let mut results = self.writer.poll();
        results.extend(self.streamed.try_iter());
        self.report(results);
    }

    /// A snapshot was streamed and saved (or failed) before training went on: report it, and
    /// answer a signal as [`Saving::on_snapshot`] does.
    fn on_streamed(&mut self, step: u64) {
        self.poll();
        let signal = self.signal.load(Ordering::SeqCst);
        if signal != 0 {
            self.stop(signal as i32, step);
        }
    }

    fn on_snapshot(&mut self, snap: Snapshot) {
        let step = snap.progress.step;
        let signal = self.signal.load(Ordering::SeqCst);
        let due = self.save_every > 0
            && (step.is_multiple_of(self.save_every) || step == self.total_steps);
        if signal == 0 && !due {
            return;
        }
        if let Err(e) = self.writer.submit(snap) {
            self.report(vec![Err(e)]);
        }
        if signal != 0 {
            self.stop(signal as i32, step);
        }
    }

    /// An operator's on-demand checkpoint (`POST /checkpoint`): saved whatever `save_every` says.
    fn save_now(&mut self, snap: Snapshot) {
        if let Err(e) = self.writer.submit(snap) {
            self.report(vec![Err(e)]);
        }
    }

    /// Answers a signal: waits for the checkpoint of this boundary, then ends the process (or
    /// leaves that to the driver, see `exit_on_stop`).
    fn stop(&mut self, signal: i32, step: u64) {
        if let Err(e) = self.writer.flush() {
            self.report(vec![Err(e)]);
        }
        self.poll();
        let why = self
            .stop_why
            .clone()
            .unwrap_or_else(|| format!("stopped by {}", signal_name(signal)));
        let stopped = if self.failures > 0 {
            Stopped {
                code: 1,
                line: format!("error: {why} at step {step}, but the checkpoint could not be saved"),
            }
        } else {
            Stopped {
                code: 128 + signal,
                line: format!(
                    "{why} after step {step}; resume with: {} {}",
                    self.resume_hint,
                    self.root.display()
                ),
            }
        };
        if self.exit_on_stop {
            stopped.exit();
        }
        self.stopped = Some(stopped);
    }

    /// The run stops at the next step boundary, after its checkpoint, for `why`.
    pub fn stop_at_boundary(&mut self, why: &str) {
        self.stop_why = Some(why.to_string());
        self.signal
            .store(signal_hook::consts::SIGTERM as usize, Ordering::SeqCst);
        self.boundary.store(true, Ordering::SeqCst);
    }

    /// Leaves the process's end to the driver (a coordinator tells its workers first): a stop
    /// is reported through `SaveObserver::stop_requested`.
    pub fn stop_through_driver(mut self) -> Self {
        self.exit_on_stop = false;
        self
    }

    /// Names the command that resumes this run in the line printed on a signal (the checkpoint
    /// itself resumes under any of them).
    pub fn resume_with(mut self, hint: String) -> Self {
        self.resume_hint = hint;
        self
    }

    /// Waits for the queued saves; a failed save fails the run.
    pub fn finish(self) -> Result<(), CliError> {
        let mut results = self.writer.finish();
        results.extend(self.streamed.try_iter());
        let failures = self.failures + report(results);
        if failures > 0 {
            return Err(CliError::Failed(format!(
                "{} checkpoint save(s) into {} failed",
                failures,
                self.root.display()
            )));
        }
        Ok(())
    }
}

/// Prints one line per finished save; returns how many failed.
fn report(results: Vec<Result<SaveReport, CheckpointError>>) -> usize {
    let mut failures = 0;
    for r in results {
        match r {
            Ok(r) => println!(
                "checkpoint: saved {} ({} bytes in {} files, {:.3} s, {:.0} MB/s{}{})",
                r.dir.display(),
                r.bytes,
                r.files,
                r.write_s,
                r.mb_per_s(),
                if r.streamed {
                    ", streamed from the tier"
                } else {
                    ""
                },
                if r.removed.is_empty() {
                    String::new()
                } else {
                    format!("; removed {} older", r.removed.len())
                }
            ),
            Err(e) => {
                failures += 1;
                eprintln!("error: checkpoint save failed: {e}");
            }
        }
    }
    failures
}

/// The save directory must be creatable, and must not hold another run's checkpoints: a run
/// writes into a directory with complete checkpoints only when it resumed from one of them
/// (otherwise its saves and retention would replace them).
fn check_save_dir(root: &Path, resumed_from: Option<&Path>) -> Result<(), CliError> {
    let bad =
        |what: String| CliError::Usage(format!("invalid `save_dir`: {}: {what}", root.display()));
    std::fs::create_dir_all(root).map_err(|e| bad(format!("cannot create it: {e}")))?;
    let entries = store::list(root).map_err(|e| bad(e.to_string()))?;
    let Some(newest) = entries.iter().rev().find(|e| e.complete) else {
        return Ok(());
    };
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if resumed_from
        .and_then(Path::parent)
        .is_some_and(|p| same(p, root))
    {
        return Ok(());
    }
    Err(bad(format!(
        "it already holds checkpoints (newest {}); continue that run with --resume {}, or save into an empty directory",
        newest.path.display(),
        root.display()
    )))
}

fn parse_crash(s: &str) -> Result<(u64, CrashPoint), String> {
    let (step, point) = s
        .split_once(':')
        .ok_or("EZERO_TEST_HOOK_CHECKPOINT_CRASH expects STEP:POINT")?;
    Ok((
        step.parse()
            .map_err(|_| "EZERO_TEST_HOOK_CHECKPOINT_CRASH: bad STEP")?,
        point.parse()?,
    ))
}

impl Stopped {
    /// Prints the line (errors to stderr) and ends the process with the code.
    pub fn exit(&self) -> ! {
        if self.code == 1 {
            eprintln!("{}", self.line);
        } else {
            println!("{}", self.line);
        }
        let _ = std::io::stdout().flush();
        // Ranks and the writer hold nothing that needs unwinding: the checkpoint is synced.
        std::process::exit(self.code)
    }
}

/// The name of one of `SIGNALS`, for the line a stop prints.
fn signal_name(signal: i32) -> &'static str {
    if signal == signal_hook::consts::SIGINT {
        "SIGINT"
    } else {
        "SIGTERM"
    }
}

/// SIGTERM and SIGINT: the flag says which came (0: none); a second one ends the process at
/// once (while the last checkpoint is written, or a run without one stops).
pub fn stop_signal() -> Result<Arc<AtomicUsize>, CliError> {
    let signal = Arc::new(AtomicUsize::new(0));
    let again = Arc::new(AtomicBool::new(false));
    for sig in SIGNALS {
        signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, Arc::clone(&again))
            .and_then(|_| signal_hook::flag::register(sig, Arc::clone(&again)))
            .and_then(|_| signal_hook::flag::register_usize(sig, Arc::clone(&signal), sig as usize))
            .map_err(|e| CliError::Failed(format!("cannot install a signal handler: {e}")))?;
    }
    Ok(signal)
}

/// The train loop's observer: `inner` (the progress display), plus saving when configured.
pub struct SaveObserver<O> {
    pub inner: O,
    pub saving: Option<Saving>,
    /// Without saving, a coordinator's SIGTERM/SIGINT (`stop_signal`): the job stops at the
    /// next event, its workers told.
    pub signal: Option<Arc<AtomicUsize>>,
    /// Steps completed, for the line a stop prints.
    pub steps_done: u64,
    pub stopped: Option<Stopped>,
}

impl<O> SaveObserver<O> {
    pub fn new(inner: O, saving: Option<Saving>) -> Self {
        Self {
            inner,
            saving,
            signal: None,
            steps_done: 0,
            stopped: None,
        }
    }

    /// How the run stopped early, if it did (a signal, a notice).
    pub fn stopped(&self) -> Option<&Stopped> {
        self.stopped
            .as_ref()
            .or_else(|| self.saving.as_ref()?.stopped.as_ref())
    }
}

impl<O: Observer> Observer for &mut SaveObserver<O> {
    fn on_step(&mut self, rec: &StepRecord) {
        self.steps_done = rec.step + 1;
        self.inner.on_step(rec);
        if let Some(s) = &mut self.saving {
            s.poll();
        }
    }

    fn on_snapshot(&mut self, snap: Snapshot) {
        if let Some(s) = &mut self.saving {
            s.on_snapshot(snap);
        }
    }

    fn on_membership(&mut self, record: &MembershipRecord) {
        self.inner.on_membership(record);
    }

    fn on_change(&mut self, change: &ChangeRecord) {
        self.inner.on_change(change);
    }

    fn on_join_failed(&mut self, rank: RankId, reason: &str) {
        self.inner.on_join_failed(rank, reason);
    }

    fn on_requested_snapshot(&mut self, snap: Snapshot) {
        if let Some(s) = &mut self.saving {
            s.save_now(snap);
        }
    }

    fn on_snapshot_streamed(&mut self, step: u64, _saved: &Result<(), String>) {
        if let Some(s) = &mut self.saving {
            s.on_streamed(step);
        }
    }

    fn on_notice(&mut self, notice: &Notice, granted: &Result<(), String>) {
        self.inner.on_notice(notice, granted);
    }

    fn stop_at_boundary(&mut self, why: &str) -> bool {
        match &mut self.saving {
            Some(s) => {
                s.stop_at_boundary(why);
                true
            }
            None => {
                self.stopped = Some(Stopped {
                    code: 128 + signal_hook::consts::SIGTERM,
                    line: format!(
                        "{why}, after step {}; not saved (no --save-dir)",
                        self.steps_done
                    ),
                });
                false
            }
        }
    }

    fn stop_requested(&mut self) -> Option<String> {
        if let Some(s) = self.saving.as_ref().and_then(|s| s.stopped.as_ref()) {
            return Some(s.line.clone());
        }
        let signal = self.signal.as_ref()?.load(Ordering::SeqCst);
        if signal == 0 {
            return None;
        }
        let name = signal_name(signal as i32);
        let stopped = Stopped {
            code: 128 + signal as i32,
            line: format!(
                "stopped by {name} after step {}; not saved (no --save-dir)",
                self.steps_done
            ),
        };
        let line = stopped.line.clone();
        self.stopped = Some(stopped);
        Some(line)
    }
}
