//! Snapshots taken at a step boundary resume bit for bit at any world size, stage and chunk
//! size: the in-memory mechanism under checkpoints and resharding. Resuming from a checkpoint
//! on disk, each rank reads only the records of the chunks it owns.

use crate::common;

use std::sync::Arc;

use common::{run_cfg, small, train_blocking};
use elastic_zero::checkpoint::{self, CheckpointSource};
use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::engine::coordinator::StepRecord;
use elastic_zero::runtime::actors::Snapshot;
use elastic_zero::runtime::api::cluster::Observer;
use elastic_zero::runtime::{ClusterError, ClusterSpec, TrainOutcome};
use elastic_zero::summary::param_sha256;

#[derive(Default)]
struct Keep(Vec<Snapshot>);

impl Observer for &mut Keep {
    fn on_snapshot(&mut self, s: Snapshot) {
        self.0.push(s);
    }
}

fn run(
    cfg: &TrainConfig,
    resume: Option<Snapshot>,
    snapshot_every: u64,
    keep: &mut Keep,
) -> TrainOutcome {
    let spec = ClusterSpec {
        resume: resume.map(Into::into),
        snapshot_every,
        ..ClusterSpec::from_config(cfg.clone()).unwrap()
    };
    train_blocking(spec, keep).unwrap()
}

#[test]
fn resume_at_any_world_size_stage_and_chunk_size_is_bit_identical() {
    let base = TrainConfig {
        steps: 6,
        ranks: 4,
        stage: 3,
        ..small(ModelKind::Gpt)
    };
    let want = param_sha256(&run_cfg(&base).unwrap().params);
    let mut keep = Keep::default();
    let out = run(&base, None, 3, &mut keep);
    assert_eq!(
        param_sha256(&out.params),
        want,
        "snapshots must not disturb training"
    );
    assert_eq!(
        keep.0.iter().map(|s| s.progress.step).collect::<Vec<_>>(),
        vec![3, 6]
    );
    let snap = keep.0.remove(0);
    for (ranks, stage, chunk_elems) in [(1, 1, 1000), (2, 2, 333), (3, 3, 4096), (2, 0, 1000)] {
        let cfg = TrainConfig {
            ranks,
            stage,
            chunk_elems,
            ..base.clone()
        };
        let resumed = run(&cfg, Some(snap.clone()), 0, &mut Keep::default());
        assert_eq!(
            resumed.records.first().map(|r: &StepRecord| r.step),
            Some(3)
        );
        assert_eq!(
            param_sha256(&resumed.params),
            want,
            "ranks {ranks} stage {stage} chunk {chunk_elems}"
        );
    }
}

#[test]
fn a_snapshot_of_another_model_is_refused() {
    let base = TrainConfig {
        steps: 2,
        ranks: 2,
        ..small(ModelKind::Mlp)
    };
    let mut keep = Keep::default();
    run(&base, None, 2, &mut keep);
    let other = TrainConfig {
        d_model: 16,
        ..base
    };
    let spec = ClusterSpec {
        resume: keep.0.pop().map(Into::into),
        ..ClusterSpec::from_config(other).unwrap()
    };
    let err = train_blocking(spec, ()).err().expect("must refuse");
    assert!(err.to_string().contains("another model"), "{err}");
}

/// Saves `base`'s snapshot at step 3 as a checkpoint under `root`; returns its directory and
/// the uninterrupted run's digest.
fn checkpoint_at_step_3(
    base: &TrainConfig,
    root: &std::path::Path,
) -> (std::path::PathBuf, String) {
    let mut keep = Keep::default();
    let want = param_sha256(&run(base, None, 3, &mut keep).params);
    let model = elastic_zero::job::build_model(base).unwrap();
    let data = elastic_zero::job::build_dataset(base).unwrap();
    let meta = checkpoint::CheckpointMeta::new(base, model.as_ref(), &data).unwrap();
    let report = checkpoint::save(root, &meta, &keep.0[0], &Default::default()).unwrap();
    (report.dir, want)
}

#[test]
fn each_rank_reads_only_the_records_of_the_chunks_it_owns() {
    let base = TrainConfig {
        steps: 6,
        ranks: 4,
        stage: 3,
        ..small(ModelKind::Gpt)
    };
    let t = tempfile::tempdir().unwrap();
    let (dir, want) = checkpoint_at_step_3(&base, t.path());
    let source = CheckpointSource::open(&dir).unwrap();
    let total = source.manifest.total_bytes();
    for (ranks, stage, chunk_elems) in [
        (2, 3, base.chunk_elems),
        (3, 1, base.chunk_elems),
        (2, 2, 4096),
    ] {
        let cfg = TrainConfig {
            ranks,
            stage,
            chunk_elems,
            ..base.clone()
        };
        let spec = ClusterSpec {
            resume: Some(Arc::new(source.clone())),
            ..ClusterSpec::from_config(cfg).unwrap()
        };
        let out = train_blocking(spec, ()).unwrap();
        assert_eq!(
            param_sha256(&out.params),
            want,
            "ranks {ranks} stage {stage}"
        );
        let reads: Vec<u64> = out.resume_reads.iter().map(|r| r.1).collect();
        assert_eq!(reads.len(), ranks as usize);
        let sum: u64 = reads.iter().sum();
        for &r in &reads {
            assert!(
                r > 0 && r < total,
                "one rank read {r} of {total} bytes: {reads:?}"
            );
        }
        if chunk_elems == base.chunk_elems {
            // Same chunk size: every saved record belongs to exactly one new owner.
            assert_eq!(sum, total, "{reads:?}");
        } else {
            // Re-cut chunks: a saved record straddling two new owners is read by both.
            assert!(sum >= total && sum < 2 * total, "{reads:?} of {total}");
        }
    }
}

#[test]
fn a_damaged_record_stops_the_resume_before_any_step_naming_the_file() {
    let base = TrainConfig {
        steps: 6,
        ranks: 2,
        stage: 3,
        ..small(ModelKind::Mlp)
    };
    let t = tempfile::tempdir().unwrap();
    let (dir, _) = checkpoint_at_step_3(&base, t.path());
    let source = CheckpointSource::open(&dir).unwrap();
    let victim = dir.join(&source.manifest.files[1].name);
    let mut bytes = std::fs::read(&victim).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    std::fs::write(&victim, &bytes).unwrap();
    let mut steps = 0;
    let spec = ClusterSpec {
        resume: Some(Arc::new(source)),
        ..ClusterSpec::from_config(TrainConfig { ranks: 3, ..base }).unwrap()
    };
    let err = train_blocking(spec, |_: &StepRecord| steps += 1)
        .err()
        .expect("a flipped byte must stop the resume");
    assert!(matches!(err, ClusterError::Resume(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&source_file_name(&victim)) && msg.contains("checksum mismatch"),
        "{msg}"
    );
    assert_eq!(steps, 0, "no step may run from damaged state");
}

fn source_file_name(p: &std::path::Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

/// Snapshots come when due (every N steps and after the last) and when the boundary flag is
/// set (the CLI's signal handlers set it), not at every boundary: with worker processes each
/// one carries the whole state over the network.
#[test]
fn snapshots_come_when_due_or_when_the_boundary_flag_asks() {
    let cfg = TrainConfig {
        steps: 7,
        ranks: 2,
        stage: 3,
        ..small(ModelKind::Mlp)
    };
    let steps = |keep: &Keep| keep.0.iter().map(|s| s.progress.step).collect::<Vec<_>>();
    let mut keep = Keep::default();
    run(&cfg, None, 3, &mut keep);
    assert_eq!(steps(&keep), vec![3, 6, 7]);

    let boundary = elastic_zero::runtime::actors::BoundarySnapshot::default();
    // Set before the run: the boundary after step 0 answers it, once.
    boundary
        .flag
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let spec = ClusterSpec {
        snapshot_every: 3,
        boundary_snapshot: Some(boundary.clone()),
        ..ClusterSpec::from_config(cfg.clone()).unwrap()
    };
    let mut keep = Keep::default();
    train_blocking(spec, &mut keep).unwrap();
    assert_eq!(steps(&keep), vec![1, 3, 6, 7]);
    assert!(!boundary.flag.load(std::sync::atomic::Ordering::SeqCst));
}
