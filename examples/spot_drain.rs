//! A spot interruption notice mid-run: the cloud says rank 2 goes away, the job drains it at the
//! next step boundary, moves its shards to the others and keeps training. No process restarts,
//! no checkpoint is read, and the final parameters are bit for bit those of a run that never
//! lost the rank.
//!
//! Run: `cargo run --release --example spot_drain`

use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::runtime::actors::ClusterEvent;
use elastic_zero::runtime::{train, Cluster, ClusterSpec};
use elastic_zero::summary::param_sha256;

/// The step after which the notice arrives.
const NOTICE_AFTER_STEP: u64 = 3;
const SPOT_RANK: u32 = 2;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let config = TrainConfig {
        ranks: 4,
        stage: 3,
        model: ModelKind::Gpt,
        layers: 2,
        d_model: 64,
        seq_len: 32,
        micro_batches: 8,
        micro_batch_size: 2,
        steps: 24,
        chunk_elems: 2048,
        sample_tokens: 0,
        ..TrainConfig::default()
    };

    // The reference: the same job with the same four ranks all the way.
    let plain = train(ClusterSpec::from_config(config.clone())?, ()).await?;
    let want = param_sha256(&plain.params);

    let mut job = Cluster::builder(ClusterSpec::from_config(config)?)
        .start()
        .await?;
    let control = job.handle();
    let mut changes = control.subscribe();
    while let Some(event) = job.next_event().await {
        match event {
            ClusterEvent::Step(rec) => {
                println!("step {:>2} loss {:.4}", rec.step, rec.loss);
                if rec.step == NOTICE_AFTER_STEP {
                    println!("spot notice for rank {SPOT_RANK}: draining it");
                    control.drain(SPOT_RANK).await?;
                }
            }
            ClusterEvent::Membership(m) => {
                let costed = changes.recv().await?;
                let status = control.status().await?;
                println!(
                    "step {}: ranks {:?} -> {:?}, moved {} bytes ({} chunk elements, minimum {}) in {} ms",
                    m.step,
                    m.before,
                    m.after,
                    costed.moved_bytes.unwrap_or(0),
                    m.moved_chunk_elems,
                    m.min_chunk_elems,
                    m.duration_ms
                );
                for s in &status.shards {
                    println!(
                        "  rank {} now owns {} bytes of state",
                        s.rank, s.owned_state_bytes
                    );
                }
            }
            ClusterEvent::Finished => break,
            ClusterEvent::Aborted(reason) => anyhow::bail!("run stopped: {reason}"),
            _ => {}
        }
    }
    let got = param_sha256(&job.finish().await?.params);
    println!("param-sha256 with the drain:    {got}");
    println!("param-sha256 without the drain: {want}");
    anyhow::ensure!(got == want, "the drain changed the training trajectory");
    Ok(())
}
