//! `ezero train`: run a job on in-process rank actors, show progress, print the digest.

use elastic_zero::runtime::clock::Stopwatch;
use std::io::IsTerminal;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};

use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::engine::coordinator::{MembershipRecord, StepRecord};
use elastic_zero::engine::messages::StepReport;
use elastic_zero::job::{build_dataset, build_model};
use elastic_zero::model::backend::Precision;
use elastic_zero::model::gemm::Bf16Path;
use elastic_zero::model::sample::{generate, Sampling};
use elastic_zero::model::{param_count, Model};
use elastic_zero::plan::tier::{gib, Fit, Tier};
use elastic_zero::plan::RankId;
use elastic_zero::runtime::alloc::peak_rss_bytes;
use elastic_zero::runtime::api::cluster::Observer;
use elastic_zero::runtime::step::elastic::resume::ResumeSource;
use elastic_zero::runtime::{ChangeRecord, Cluster, ClusterBuilder, ClusterError, ClusterSpec};
use elastic_zero::summary::{median, rank_summaries, DeviceSummary, StepBreakdown, TrainSummary};

use super::checkpoint::{self, SaveObserver, SavePlan, Saving};
use super::ticker::Ticker;
use super::{CliError, TrainArgs};

pub fn run(args: &TrainArgs) -> Result<(), CliError> {
    let mut job = Job::resolve(args)?;
    let resume = job.resume.take();
    let resumed_from = resume.as_ref().map(|l| l.dir.clone());
    let cfg = &job.cfg;
    let bar = progress_bar(cfg.steps);
    let boundary = Saving::boundary_snapshot();
    let save_plan = SavePlan::new(cfg, job.model.as_ref(), &job.data, args)?;
    let spec = ClusterSpec {
        config: cfg.clone(),
        model: job.model.clone(),
        data: job.data.clone(),
        init: checkpoint::init_weights(args, job.model.as_ref())?,
        resume: resume.map(|s| Arc::new(s) as Arc<dyn ResumeSource>),
        // Only when a save is due: a signal asks for its own snapshot through `boundary`.
        snapshot_every: if cfg.save_dir.is_some() {
            cfg.save_every
        } else {
            0
        },
        boundary_snapshot: cfg.save_dir.is_some().then(|| boundary.clone()),
        progress: Arc::default(),
        snapshot_sink: save_plan.as_ref().map(SavePlan::sink),
        clock: elastic_zero::runtime::clock::SystemClock::shared(),
        net_trace: None,
        // Without a sample the run ends with the digest alone (no copy of every chunk).
        keep_params: wants_params(&job),
    };
    let backend = job.model.backend().name().to_string();
    let passes_per_step = 2 * job.model.units().len() as u64 * u64::from(cfg.ranks);
    let ticker = Ticker::start(
        bar.clone(),
        spec.progress.clone(),
        passes_per_step,
        cfg.steps,
    );
    let lines = StepLines::new(&job, &bar, &ticker)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::Failed(format!("cannot start the tokio runtime: {e}")))?;
    // The ranks read their saved state before anything is written: a damaged checkpoint is
    // refused without creating a save directory.
    let cluster = rt.block_on(Cluster::start(spec)).map_err(cluster_error)?;
    ticker.step_boundary(0);
    let (fit, activations) = (*cluster.memory_plan(), *cluster.activation_plan());
    let device = cluster.device_plan().copied();
    println!("{}", describe_fit(&fit, cfg));
    if let Some(d) = &device {
        println!("{}", d.describe());
    }
    println!("{}", activations.describe());
    println!("{}", describe_precision(cfg, backend.as_str()));
    let saving = match save_plan
        .map(|p| p.start(cfg, resumed_from.as_deref(), &boundary))
        .transpose()
    {
        Ok(saving) => saving,
        Err(e) => {
            rt.block_on(cluster.shutdown());
            return Err(e);
        }
    };
    let started = Stopwatch::start();
    let progress = Progress {
        bar: &bar,
        on_step: |rec: &StepRecord| lines.step(rec),
    };
    let mut observer = SaveObserver::new(progress, saving);
    let on_demand = observer.saving.is_some();
    let outcome = rt.block_on(drive(cluster, cfg, args, &bar, on_demand, &mut observer));
    ticker.stop();
    let saved = observer.saving.take().map_or(Ok(()), Saving::finish);
    let outcome = outcome.map_err(cluster_error)?;
    saved?;
    bar.finish_and_clear();
    let mut summary = summarize(
        cfg,
        job.psi,
        job.floor,
        &outcome.records,
        &outcome.param_sha256,
        &fit,
    );
    summary.peak_rss_training_bytes = lines.training_peak.get();
    summary.activations = activations.outcome().into();
    summary.backend = backend;
    summary.device = device.map(|d| {
        let warm = if outcome.records.len() > 4 { 2 } else { 0 };
        let ranks = u64::from(cfg.ranks);
        DeviceSummary::of(cfg.device.name(), &d, ranks, &outcome.records, warm)
    });
    report(
        &job,
        &outcome,
        &mut summary,
        started.elapsed().as_secs_f64(),
    )
}

/// What `ezero train` runs: the config with its flags and any checkpoint it resumes, the model,
/// the data, and what the banner says about them.
struct Job {
    cfg: TrainConfig,
    resume: Option<elastic_zero::checkpoint::CheckpointSource>,
    model: Arc<dyn Model>,
    data: Arc<elastic_zero::data::Dataset>,
    psi: usize,
    floor: Option<f64>,
}

impl Job {
    /// Resolves the job and prints its banner; a resumed checkpoint must fit it.
    fn resolve(args: &TrainArgs) -> Result<Job, CliError> {
        let (mut cfg, resume) = checkpoint::resolve_train(args)?;
        let backups = super::backups::apply_default(args, &mut cfg)?;
        super::outputs::check_train(&cfg)?;
        let model = build_model(&cfg).map_err(|e| CliError::Usage(e.to_string()))?;
        let data = build_dataset(&cfg).map_err(|e| CliError::Usage(e.to_string()))?;
        // Read once here so that bad eval data is refused before anything starts.
        elastic_zero::job::build_eval_dataset(&cfg).map_err(|e| CliError::Usage(e.to_string()))?;
        if let Some(source) = &resume {
            checkpoint::check_compatible(source, &cfg, model.as_ref(), args.reschedule)?;
        }
        let psi = param_count(&model.units());
        println!(
            "ezero train: ZeRO-{} on {} rank actors, {} model, {} parameters, {} reduction, data: {}",
            cfg.stage,
            cfg.ranks,
            cfg.model.name(),
            psi,
            if cfg.reduce == elastic_zero::reduce::ReduceMode::Exact {
                "exact"
            } else {
                "fast"
            },
            data.describe()
        );
        if let Some(line) = backups.describe(&cfg) {
            println!("{line}");
        }
        if let Some(l) = &resume {
            checkpoint::print_resumed(l);
        }
        let floor = data.entropy_floor_nats();
        Ok(Job {
            cfg,
            resume,
            model,
            data,
            psi,
            floor,
        })
    }
}

/// Runs the started cluster to its end, with the control endpoint if asked for.
async fn drive(
    cluster: Cluster,
    cfg: &TrainConfig,
    args: &TrainArgs,
    bar: &ProgressBar,
    on_demand_snapshots: bool,
    observer: impl Observer,
) -> Result<elastic_zero::runtime::TrainOutcome, ClusterError> {
    let mut builder = ClusterBuilder::for_started(cluster, cfg)
        .allow_kill(args.control_allow_kill)
        .on_demand_snapshots(on_demand_snapshots);
    if let Some(addr) = args.control {
        let access = super::control_access::control_access(args, addr).map_err(|e| {
            ClusterError::Spawn(match e {
                CliError::Usage(m) | CliError::Failed(m) => m,
            })
        })?;
        builder = builder.control_addr(addr).control_access(access);
    }
    let job = builder.start().await?;
    if let Some(addr) = job.control_addr() {
        print_line(
            bar,
            format!(
                "control endpoint: http://{addr} (GET /status, GET /metrics, POST /ranks/{{id}}/drain{}, POST /join?count=N, POST /checkpoint)",
                if args.control_allow_kill { ", POST /ranks/{id}/kill" } else { "" }
            ),
        );
        // Tests and scripts read this line to find a port chosen with :0.
        let _ = std::io::Write::flush(&mut std::io::stdout());
    }
    job.drive(observer).await
}

/// The progress bar's message and the periodic step lines.
struct StepLines<'a> {
    cfg: &'a TrainConfig,
    floor: Option<f64>,
    bar: &'a ProgressBar,
    ticker: &'a Ticker,
    log_every: u64,
    tokens: f64,
    /// The process's peak while training, before the parameters are consolidated.
    training_peak: std::cell::Cell<u64>,
    /// `--metrics-file`, appended a line a step.
    metrics: Option<super::metrics_log::MetricsLog>,
}

impl<'a> StepLines<'a> {
    fn new(job: &'a Job, bar: &'a ProgressBar, ticker: &'a Ticker) -> Result<Self, CliError> {
        let metrics = super::metrics_log::MetricsLog::open(&job.cfg)?;
        Ok(Self {
            cfg: &job.cfg,
            floor: job.floor,
            bar,
            ticker,
            log_every: (job.cfg.steps / 10).max(1),
            tokens: job.cfg.tokens_per_step() as f64,
            training_peak: std::cell::Cell::new(0),
            metrics,
        })
    }

    /// One `--metrics-file` record; a failed write is reported once per step, not fatal.
    fn log_metrics(&self, rec: &StepRecord, tps: f64) {
        if let Some(Err(e)) = self.metrics.as_ref().map(|m| m.record(self.cfg, rec, tps)) {
            print_line(self.bar, e);
        }
    }

    fn step(&self, rec: &StepRecord) {
        let cfg = self.cfg;
        self.training_peak.set(peak_rss_bytes().unwrap_or(0));
        self.ticker.step_boundary(rec.step + 1);
        let tps = self.tokens / (rec.duration_ms.max(1) as f64 / 1e3);
        let mem: Vec<String> = rec
            .reports
            .iter()
            .map(|r| format!("{:.1}", r.resident.total() as f64 / 1048576.0))
            .collect();
        self.bar.set_position(rec.step + 1);
        self.bar.set_message(format!(
            "loss {:.4}  {:.0} tok/s  MiB/rank [{}]",
            rec.loss,
            tps,
            mem.join(" ")
        ));
        self.log_metrics(rec, tps);
        let due = rec.step.is_multiple_of(self.log_every) || rec.step + 1 == cfg.steps;
        if due || rec.eval_loss.is_some() {
            let line = step_line(cfg, rec, self.floor, tps);
            print_line(self.bar, line);
        }
    }
}

/// The progress line of step `rec` (`tps`: its tokens per second), in process mode too.
pub(super) fn step_line(
    cfg: &TrainConfig,
    rec: &StepRecord,
    floor: Option<f64>,
    tps: f64,
) -> String {
    format!(
        "step {:>5}/{}  loss {:.4}{}{}  grad-norm {:.3}  lr {:.3e}  {:.0} tok/s  [{}]{}{}",
        rec.step + 1,
        cfg.steps,
        rec.loss,
        floor
            .map(|f| format!(" (floor {f:.4})"))
            .unwrap_or_default(),
        rec.eval_loss
            .map(|l| format!("  eval {l:.4} (ppl {:.3})", l.exp()))
            .unwrap_or_default(),
        rec.grad_norm,
        step_lr(cfg, rec),
        tps,
        StepBreakdown::of(rec).describe(),
        device_note(rec),
        if rec.skipped {
            "  [skipped: non-finite gradient]"
        } else {
            ""
        },
    )
}

/// On a device, where the step's state lived and what crossed the link: the largest rank's
/// device peak and its budget, the bytes up and down over all ranks, the longest wait.
fn device_note(rec: &StepRecord) -> String {
    let devs: Vec<_> = rec.reports.iter().filter_map(|r| r.device).collect();
    let Some(cap) = devs.first().map(|d| d.capacity_bytes) else {
        return String::new();
    };
    let peak = devs.iter().map(|d| d.peak_bytes).max().unwrap_or(0);
    let (up, down): (u64, u64) = devs
        .iter()
        .fold((0, 0), |(u, d), x| (u + x.h2d_bytes, d + x.d2h_bytes));
    let wait = devs.iter().map(|d| d.copy_wait_s).fold(0.0, f64::max);
    format!(
        "  [device: working params+grads, peak {} of {}; host: masters+optimizer; up {} down {}, waited {:.3} s]",
        gib(peak),
        gib(cap),
        gib(up),
        gib(down),
        wait
    )
}

/// The learning rate the schedule gives step `rec` (its 1-based optimizer step).
fn step_lr(cfg: &TrainConfig, rec: &StepRecord) -> f32 {
    elastic_zero::job::lr_schedule(cfg).lr_at(rec.step + 1)
}

/// Whether the end of the run reads the trained parameters (a sample; the ranks evaluate
/// `--eval-data` themselves).
fn wants_params(job: &Job) -> bool {
    job.cfg.model != ModelKind::Mlp && job.cfg.sample_tokens > 0
}

/// `--eval-data`'s loss after the last step (the ranks evaluate it as the step's forward
/// runs, see `runtime::step::exec`), printed and put in the summary.
pub(super) fn report_eval(cfg: &TrainConfig, summary: &mut TrainSummary) {
    let Some(path) = &cfg.eval_data else {
        return;
    };
    let Some(last) = summary.eval.last().copied() else {
        println!("eval: no evaluation ran (no step ran in this run)");
        return;
    };
    println!(
        "eval: loss {:.4}, perplexity {:.3} after step {} on {} windows of {} tokens of {}",
        last.loss,
        last.perplexity,
        last.step,
        cfg.micro_batches as usize * cfg.micro_batch_size,
        cfg.seq_len,
        path.display()
    );
    summary.eval_loss = Some(last.loss);
    summary.eval_perplexity = Some(last.perplexity);
}

/// The end of the run: the summary lines, a sample, the JSON summary and the digest.
fn report(
    job: &Job,
    outcome: &elastic_zero::runtime::TrainOutcome,
    summary: &mut TrainSummary,
    wall_s: f64,
) -> Result<(), CliError> {
    let cfg = &job.cfg;
    println!(
        "done: {} steps in {:.1} s, loss {:.4} -> {:.4}{}, median step {:.3} s, {:.0} tokens/s",
        cfg.steps,
        wall_s,
        summary.first_loss,
        summary.final_loss,
        job.floor
            .map(|f| format!(" (entropy floor {f:.4} nats)"))
            .unwrap_or_default(),
        summary.step_time_median_s,
        summary.tokens_per_s
    );
    if let Some(reads) = checkpoint::resume_reads(&outcome.resume_reads) {
        println!("  resume: each rank read only the chunks it owns: {reads}");
    }
    for r in &summary.ranks {
        println!(
            "  rank {}: resident params {} B, grads {} B, optimizer {} B; peak {} B; sent {} B/step",
            r.rank, r.resident_bytes.params, r.resident_bytes.grads, r.resident_bytes.optimizer, r.peak_bytes, r.bytes_sent_per_step
        );
    }
    if cfg.model != ModelKind::Mlp && cfg.sample_tokens > 0 {
        if outcome.params.is_empty() {
            println!(
                "sample: skipped (the parameters are on the tier and are not gathered into memory)"
            );
        } else {
            print_sample(job.model.as_ref(), &outcome.params, cfg);
        }
    }
    report_eval(cfg, summary);
    if let Some(path) = &cfg.json {
        if let Some(line) = super::gemm::add_mfu(summary, job.model.as_ref(), cfg) {
            println!("{line}");
        }
        write_json_atomically(path, summary)?;
    }
    println!("param-sha256: {}", summary.param_sha256);
    Ok(())
}

fn cluster_error(e: ClusterError) -> CliError {
    match e {
        // Damaged or unfitting saved state is bad input: nothing was trained.
        ClusterError::Resume(why) => CliError::Usage(format!("--resume: {why}")),
        // Refused before anything was allocated: the run does not fit, or its tier cannot be used.
        ClusterError::Memory(why) => CliError::Usage(why),
        e => CliError::Failed(e.to_string()),
    }
}

/// Prints above the progress bar (or plainly when there is none).
fn print_line(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        println!("{line}");
    } else {
        bar.println(line);
    }
}

/// Feeds step records to the closure and prints membership changes as they happen.
struct Progress<'a, F: FnMut(&StepRecord)> {
    bar: &'a ProgressBar,
    on_step: F,
}

impl<F: FnMut(&StepRecord)> Observer for Progress<'_, F> {
    fn on_step(&mut self, rec: &StepRecord) {
        (self.on_step)(rec)
    }

    fn on_membership(&mut self, m: &MembershipRecord) {
        print_line(self.bar, membership_line(m, None));
    }

    fn on_change(&mut self, c: &ChangeRecord) {
        print_line(self.bar, membership_line(&c.record, c.moved_bytes));
    }

    fn on_join_failed(&mut self, rank: RankId, reason: &str) {
        print_line(self.bar, join_failed_line(rank, reason));
    }
}

/// A joiner that did not come up: training goes on with the ranks it has.
pub(crate) fn join_failed_line(rank: RankId, reason: &str) -> String {
    format!("rank {rank} did not join, training goes on without it: {reason}")
}

/// One line per membership change: who, what moved, how long it took.
fn membership_line(m: &MembershipRecord, bytes: Option<u64>) -> String {
    let bytes = bytes.map_or(String::new(), |b| format!(" ({})", human_bytes(b)));
    let moved = format!(
        "moved {} chunk elements{bytes} (minimum {})",
        m.moved_chunk_elems, m.min_chunk_elems
    );
    match m.rolled_back_to {
        Some(back) if m.is_network_retry() => format!(
            "retry at step {}, epoch {}: every rank gave up on its peers and none is lost (frames lost on the network); ranks {:?} rolled back to the backup before step {back}, replaying {} step(s); {moved}; in {} ms",
            m.step,
            m.epoch,
            m.after,
            m.step.saturating_sub(back),
            m.duration_ms
        ),
        Some(back) => format!(
            "recovery at step {}, epoch {}: lost ranks {:?}, ranks {:?} -> {:?}; rolled back to the backup before step {back}, replaying {} step(s); {moved}; recovered in {} ms",
            m.step,
            m.epoch,
            m.lost,
            m.before,
            m.after,
            m.step.saturating_sub(back),
            m.duration_ms
        ),
        None => format!(
            "membership at step {}, epoch {}: ranks {:?} -> {:?}, rebalanced in place; {moved} in {} ms",
            m.step, m.epoch, m.before, m.after, m.duration_ms
        ),
    }
}

fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

fn progress_bar(steps: u64) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] step {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

pub(super) fn summarize(
    cfg: &TrainConfig,
    psi: usize,
    floor: Option<f64>,
    records: &[StepRecord],
    param_sha256: &str,
    fit: &Fit,
) -> TrainSummary {
    // Skip the first steps (allocation, page faults) when there are enough to spare.
    let warm = if records.len() > 4 { 2 } else { 0 };
    let times: Vec<f64> = records
        .iter()
        .skip(warm)
        .map(|r| r.duration_ms as f64 / 1e3)
        .collect();
    let step_time = median(times);
    // Median over steps of the sum (or the largest) over ranks.
    let per_step = |f: &dyn Fn(&StepReport) -> f64, max: bool| {
        median(
            records
                .iter()
                .skip(warm)
                .map(|r| {
                    let xs = r.reports.iter().map(f);
                    if max {
                        xs.fold(0.0, f64::max)
                    } else {
                        xs.sum()
                    }
                })
                .collect(),
        )
    };
    TrainSummary {
        eval_loss: None,
        eval_perplexity: None,
        eval: elastic_zero::summary::EvalPoint::of(records),
        param_count: psi,
        stage: cfg.stage,
        world_size: cfg.ranks,
        reduce: format!("{:?}", cfg.reduce).to_lowercase(),
        steps: cfg.steps,
        final_loss: records.last().map_or(f64::NAN, |r| r.loss),
        first_loss: records.first().map_or(f64::NAN, |r| r.loss),
        entropy_floor_nats: floor,
        step_time_median_s: step_time,
        tokens_per_s: if step_time > 0.0 {
            cfg.tokens_per_step() as f64 / step_time
        } else {
            0.0
        },
        skipped_steps: records.iter().filter(|r| r.skipped).count() as u64,
        redone_steps: records.iter().filter(|r| r.attempts > 1).count() as u64,
        param_sha256: param_sha256.to_string(),
        ranks: rank_summaries(records),
        losses: records.iter().map(|r| r.loss).collect(),
        offload_optimizer: tier_name(fit.placement.optimizer),
        offload_params: tier_name(fit.placement.params),
        offload_grads: tier_name(fit.placement.grads),
        nvme_read_bytes_per_step: per_step(&|x| x.tier_read_bytes as f64, false) as u64,
        nvme_write_bytes_per_step: per_step(&|x| x.tier_write_bytes as f64, false) as u64,
        io_wait_s_per_step: per_step(&|x| x.io_wait_s, true),
        peak_rss_bytes: peak_rss_bytes().unwrap_or(0),
        peak_rss_training_bytes: 0,
        planned_memory_bytes: fit.process_bytes,
        activations: String::new(),
        precision: cfg.precision.name().into(),
        backend: String::new(),
        model_flops_per_step: 0,
        model_gflops_per_s: 0.0,
        gemm_peak_gflops: 0.0,
        mfu: 0.0,
        device: None,
    }
}

/// The placement and the memory it needs, in one line for the banner.
/// The start-of-run line on the arithmetic: the precision, the backend and, under bf16, which
/// product path runs (the portable emulation is exact but slow).
fn describe_precision(cfg: &TrainConfig, backend: &str) -> String {
    match cfg.precision {
        Precision::Fp32 => format!("precision: fp32 on {backend}"),
        Precision::Bf16 => {
            let path = Bf16Path::current();
            let slow = if path == Bf16Path::Portable {
                " (this CPU has no AVX512_BF16: the exact portable emulation, about 1 GFLOP/s; \
                 --precision fp32 is much faster here)"
            } else {
                ""
            };
            let stage3 = if cfg.stage == 3 {
                "parameters gathered as bf16"
            } else {
                "parameters rounded to bf16 per unit (fp32 master copy)"
            };
            format!(
                "precision: bf16 on {backend}: {stage3}, bf16 products ({}){slow}, fp32 master \
                 weights and Adam state",
                path.name()
            )
        }
    }
}

pub(super) fn describe_fit(fit: &Fit, cfg: &TrainConfig) -> String {
    let r = &fit.per_rank;
    let mut line = format!(
        "memory: about {} expected (per rank: parameters {}, gradients {}, optimizer {}, working set {}",
        gib(fit.process_bytes),
        gib(r.params),
        gib(r.grads),
        gib(r.optimizer),
        gib(r.working + r.activations)
    );
    if r.backup > 0 {
        line += &format!(", buddy backups {}", gib(r.backup));
        if r.backup_disk > 0 {
            line += &format!(" in flight to {} of backup files", gib(r.backup_disk));
        }
    }
    if fit.placement.any_nvme() {
        line += &format!(
            ", staging {}); on the tier: {} per rank ({}{}{}{}) in {}, {} KiB records",
            gib(r.staging),
            gib(r.tier),
            [
                (fit.placement.optimizer == Tier::Nvme).then_some("optimizer state"),
                (fit.placement.params == Tier::Nvme).then_some("parameters"),
                (fit.placement.grads == Tier::Nvme).then_some("gradients"),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", "),
            if fit.update_in_backward {
                "; updates run in the backward, into a second copy of parameters and optimizer \
                 state, so gradients are not stored"
            } else {
                ""
            },
            if fit.update_reuses_params {
                ", with the parameters the backward read"
            } else {
                ""
            },
            if cfg.nvme_buffered {
                ", buffered I/O"
            } else {
                ""
            },
            cfg.nvme_dir
                .as_deref()
                .map_or("?".into(), |d| d.display().to_string()),
            fit.tile_elems * 4 / 1024
        );
    } else {
        line += "); all state in RAM";
    }
    if fit.snapshot_bytes > 0 {
        line += &format!(
            "; a checkpoint's snapshot holds {} while it is saved",
            gib(fit.snapshot_bytes)
        );
    }
    line
}

fn tier_name(t: Tier) -> String {
    match t {
        Tier::Ram => "ram".into(),
        Tier::Nvme => "nvme".into(),
    }
}

/// A short continuation from the trained model: of "The" through the run's tokenizer, or of
/// "the " in bytes for the built-in byte-level data.
fn print_sample(model: &dyn Model, params: &[Vec<f32>], cfg: &TrainConfig) {
    if let Some(path) = cfg.tokenizer_path() {
        let sampling = Sampling {
            new_tokens: cfg.sample_tokens,
            temperature: 0.8,
            top_k: 40,
            seed: cfg.seed,
            stop: None,
        };
        let text = super::generate::load_tokenizer(&path)
            .and_then(|t| super::generate::continue_text(model, params, Some(&t), "The", sampling));
        match text {
            Ok(text) => println!("sample: The{}", text.replace('\n', " ")),
            Err(CliError::Usage(e) | CliError::Failed(e)) => println!("sample: skipped ({e})"),
        }
        return;
    }
    let prompt: Vec<u32> = b"the ".iter().map(|&b| b as u32).collect();
    let out = generate(model, params, &prompt, cfg.sample_tokens, 0.8, cfg.seed);
    let text: String = out.iter().map(|&t| printable(t)).collect();
    println!("sample: {}{}", String::from_utf8_lossy(b"the "), text);
}

fn printable(t: u32) -> char {
    match char::from_u32(t) {
        Some(c) if c.is_ascii_graphic() || c == ' ' => c,
        Some('\n') => ' ',
        _ => '?',
    }
}

/// Writes the summary to a temporary file and renames it, so no partial file is ever seen.
pub(super) fn write_json_atomically(
    path: &std::path::Path,
    summary: &TrainSummary,
) -> Result<(), CliError> {
    let text =
        serde_json::to_string_pretty(summary).map_err(|e| CliError::Failed(e.to_string()))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| CliError::Failed(format!("cannot write {}: {e}", path.display())))
}
