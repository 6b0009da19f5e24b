//! Starting a cluster of rank actors from Rust code and watching its event stream: what a custom
//! orchestrator embeds instead of shelling out to `ezero train`.
//!
//! Run: `cargo run --release --example embedded_cluster`

use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::runtime::actors::ClusterEvent;
use elastic_zero::runtime::{Cluster, ClusterSpec};
use elastic_zero::summary::param_sha256;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let config = TrainConfig {
        ranks: 3,
        stage: 2,
        model: ModelKind::Gpt,
        steps: 20,
        ..TrainConfig::default()
    };
    let spec = ClusterSpec::from_config(config)?;
    let mut cluster = Cluster::start(spec).await?;
    println!(
        "shard map epoch {}: {} members, {} chunks",
        cluster.shard_map().epoch,
        cluster.shard_map().world_size(),
        cluster
            .shard_map()
            .units
            .iter()
            .map(|u| u.owners.len())
            .sum::<usize>()
    );
    cluster.run();
    while let Some(event) = cluster.next_event().await {
        match event {
            ClusterEvent::Step(rec) => println!(
                "step {:>3} loss {:.4} ({} ms)",
                rec.step, rec.loss, rec.duration_ms
            ),
            ClusterEvent::Snapshot(snap) => println!("snapshot at step {}", snap.progress.step),
            ClusterEvent::Membership(m) => println!("members {:?} -> {:?}", m.before, m.after),
            ClusterEvent::Finished => break,
            ClusterEvent::JoinFailed { rank, reason } => {
                println!("rank {rank} did not join: {reason}")
            }
            ClusterEvent::Aborted(reason) => anyhow::bail!("run stopped: {reason}"),
            // Events added in later versions.
            _ => {}
        }
    }
    let params = cluster.collect_params().await?;
    println!("param-sha256: {}", param_sha256(&params));
    cluster.shutdown().await;
    Ok(())
}
