//! An orchestrator that embeds the runtime: it starts a job with the HTTP control endpoint on,
//! watches the stream of membership changes from another task, scales the job up over HTTP
//! (`POST /join`) and back down with the Rust handle (`drain`), and reads `/status` and
//! `/metrics` like a dashboard would.
//!
//! Run: `cargo run --release --example embedded_orchestrator`

use std::io::{Read, Write};
use std::net::SocketAddr;

use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::runtime::actors::ClusterEvent;
use elastic_zero::runtime::{Cluster, ClusterSpec};
use elastic_zero::summary::param_sha256;

/// A one-shot HTTP/1.1 request (the endpoint closes every connection after its answer).
fn http(addr: SocketAddr, method: &str, target: &str) -> anyhow::Result<(u16, String)> {
    let mut sock = std::net::TcpStream::connect(addr)?;
    write!(
        sock,
        "{method} {target} HTTP/1.1\r\nHost: orchestrator\r\n\r\n"
    )?;
    let mut text = String::new();
    sock.read_to_string(&mut text)?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("truncated answer"))?;
    let status = head.split(' ').nth(1).unwrap_or("0").parse()?;
    Ok((status, body.to_string()))
}

/// Blocking socket calls off the async workers.
async fn http_async(
    addr: SocketAddr,
    method: &'static str,
    target: &'static str,
) -> anyhow::Result<(u16, String)> {
    tokio::task::spawn_blocking(move || http(addr, method, target)).await?
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let config = TrainConfig {
        ranks: 2,
        max_ranks: 4,
        min_ranks: 2,
        stage: 2,
        model: ModelKind::Mlp,
        layers: 3,
        d_model: 64,
        seq_len: 16,
        micro_batches: 8,
        micro_batch_size: 2,
        steps: 30,
        chunk_elems: 1024,
        sample_tokens: 0,
        ..TrainConfig::default()
    };
    let mut job = Cluster::builder(ClusterSpec::from_config(config)?)
        .control_addr("127.0.0.1:0".parse()?)
        .paused(true)
        .start()
        .await?;
    let addr = job.control_addr().expect("asked for an endpoint");
    println!("control endpoint on http://{addr}");
    let control = job.handle();

    // A watcher, as a separate task would run in a real orchestrator.
    let mut changes = control.subscribe();
    let watcher = tokio::spawn(async move {
        let mut seen = 0;
        while let Ok(c) = changes.recv().await {
            seen += 1;
            let r = &c.record;
            println!(
                "[watcher] epoch {}: {:?} -> {:?}, {} bytes moved in {} ms",
                r.epoch,
                r.before,
                r.after,
                c.moved_bytes.unwrap_or(0),
                r.duration_ms
            );
        }
        seen
    });

    let (code, status) = http_async(addr, "GET", "/status").await?;
    println!("GET /status -> {code}: {}", status.trim());
    job.run();
    while let Some(event) = job.next_event().await {
        match event {
            ClusterEvent::Step(rec) if rec.step == 2 => {
                // Load is up: ask for two more ranks over HTTP.
                let (code, body) = http_async(addr, "POST", "/join?count=2").await?;
                println!("POST /join?count=2 -> {code} {}", body.trim());
                // A third would exceed max_ranks: refused, nothing changes.
                let (code, body) = http_async(addr, "POST", "/join?count=1").await?;
                println!("POST /join?count=1 -> {code} {}", body.trim());
            }
            ClusterEvent::Step(rec) if rec.step == 10 => {
                // Load is down: give two ranks back, through the Rust handle this time.
                control.drain(0).await?;
                control.drain(3).await?;
                println!("drained ranks 0 and 3");
                let refused = control.drain(1).await;
                println!(
                    "a third drain: {}",
                    refused.map_or_else(|e| e.to_string(), |_| "accepted".into())
                );
            }
            ClusterEvent::Step(rec) if rec.step == 20 => {
                let (_, metrics) = http_async(addr, "GET", "/metrics").await?;
                for line in metrics.lines().filter(|l| !l.starts_with('#')).take(12) {
                    println!("  {line}");
                }
            }
            ClusterEvent::Finished => break,
            ClusterEvent::Aborted(reason) => anyhow::bail!("run stopped: {reason}"),
            _ => {}
        }
    }
    let outcome = job.finish().await?;
    let end = control.status().await?;
    println!(
        "finished at step {} with ranks {:?} after {} membership changes; param-sha256 {}",
        end.step,
        end.members,
        end.membership.len(),
        param_sha256(&outcome.params)
    );
    // The stream ends when the last handle goes.
    drop(control);
    let seen = watcher.await?;
    anyhow::ensure!(
        seen == end.membership.len(),
        "the watcher saw {seen} changes"
    );
    Ok(())
}
