//! `ezero bench io`: the tier's I/O engine against the disk's own tools, on the same file system
//! in the same run. Sequential direct-I/O writes then reads of one file, in the engine's
//! blocks, with the same block size and queue depth for `fio` (io_uring engine) when it is
//! installed, else `dd` with direct I/O (one request at a time), the two taking turns at going
//! first.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde::Serialize;

use crate::runtime::storage::device::{submit, Device, Op, Ticket};
use crate::runtime::storage::uring::{UringConfig, UringDevice};
use crate::runtime::storage::AlignedBuf;

/// What to measure.
#[derive(Clone, Debug)]
pub struct IoBench {
    pub dir: PathBuf,
    pub bytes: u64,
    pub block_bytes: usize,
    pub queue_depth: u32,
    pub rounds: u32,
}

/// One measurement.
#[derive(Clone, Debug, Serialize)]
pub struct IoResult {
    pub round: u32,
    /// `ezero`, `fio` or `dd`.
    pub tool: String,
    /// `write` or `read`.
    pub op: String,
    pub bytes: u64,
    pub block_bytes: usize,
    pub queue_depth: u32,
    pub gb_per_s: f64,
}

/// Runs every round: the engine, then the reference tool, writes then reads.
pub fn run(b: &IoBench, mut emit: impl FnMut(IoResult)) -> Result<(), String> {
    let file = b
        .dir
        .join(format!(".ezero-bench-io-{}", std::process::id()));
    let result = (|| {
        for round in 0..b.rounds {
            // Who goes first alternates: the disk's speed drifts within a round.
            for ours in [round % 2 == 0, round % 2 == 1] {
                let (tool, w, r) = if ours {
                    let (w, r) = engine(&file, b)?;
                    ("ezero", w, r)
                } else {
                    reference(&file, b)?
                };
                let _ = std::fs::remove_file(&file);
                emit(result(b, round, tool, "write", w));
                emit(result(b, round, tool, "read", r));
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&file);
    result
}

fn result(b: &IoBench, round: u32, tool: &str, op: &str, gb_per_s: f64) -> IoResult {
    IoResult {
        round,
        tool: tool.into(),
        op: op.into(),
        bytes: b.bytes,
        block_bytes: b.block_bytes,
        queue_depth: b.queue_depth,
        gb_per_s,
    }
}

/// The engine: requests of `queue_depth` blocks, two in flight so the queue never drains.
fn engine(file: &Path, b: &IoBench) -> Result<(f64, f64), String> {
    let cfg = UringConfig {
        queue_depth: b.queue_depth,
        block_bytes: b.block_bytes,
        direct: true,
    };
    let mut dev = UringDevice::open(file, cfg).map_err(|e| e.to_string())?;
    dev.reserve(b.bytes).map_err(|e| e.to_string())?;
    let req = b.block_bytes * b.queue_depth as usize;
    let mut bufs: Vec<AlignedBuf> = (0..2).map(|_| AlignedBuf::new(req)).collect();
    // As the tier registers its staging buffers.
    dev.register(&mut bufs);
    for (i, x) in bufs[0].bytes_mut().iter_mut().enumerate() {
        *x = i as u8;
    }
    let w = stream(&mut dev, Op::Write, b.bytes, req, &mut bufs)?;
    let r = stream(&mut dev, Op::Read, b.bytes, req, &mut bufs)?;
    Ok((w, r))
}

fn stream(
    dev: &mut UringDevice,
    op: Op,
    total: u64,
    req: usize,
    bufs: &mut Vec<AlignedBuf>,
) -> Result<f64, String> {
    let t0 = Instant::now();
    let mut inflight: std::collections::VecDeque<Ticket> = Default::default();
    let mut off = 0u64;
    while off < total || !inflight.is_empty() {
        if off < total && !bufs.is_empty() {
            let len = req.min((total - off) as usize);
            let buf = bufs.pop().expect("checked");
            inflight.push_back(submit(dev, op, off, len, buf).map_err(|e| e.to_string())?);
            off += len as u64;
            continue;
        }
        let done = inflight.pop_front().expect("something in flight").wait();
        done.result.map_err(|e| e.to_string())?;
        bufs.push(done.buf);
    }
    Ok(total as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

/// fio with the same block size and depth, or dd with direct I/O.
fn reference(file: &Path, b: &IoBench) -> Result<(&'static str, f64, f64), String> {
    if Command::new("fio").arg("--version").output().is_ok() {
        let w = fio(file, b, "write")?;
        let r = fio(file, b, "read")?;
        return Ok(("fio", w, r));
    }
    let count = (b.bytes / b.block_bytes as u64).to_string();
    let bs = format!("bs={}", b.block_bytes);
    let of = format!("of={}", file.display());
    let inf = format!("if={}", file.display());
    let w = timed(
        Command::new("dd").args([
            "if=/dev/zero",
            &of,
            &bs,
            &format!("count={count}"),
            "oflag=direct",
            "conv=fsync",
        ]),
        b.bytes,
    )?;
    let r = timed(
        Command::new("dd").args([&inf, "of=/dev/null", &bs, "iflag=direct"]),
        b.bytes,
    )?;
    Ok(("dd", w, r))
}

fn timed(cmd: &mut Command, bytes: u64) -> Result<f64, String> {
    let t0 = Instant::now();
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

fn fio(file: &Path, b: &IoBench, rw: &str) -> Result<f64, String> {
    let out = Command::new("fio")
        .args([
            "--name=ezero",
            &format!("--filename={}", file.display()),
            &format!("--size={}", b.bytes),
            &format!("--rw={rw}"),
            &format!("--bs={}", b.block_bytes),
            "--direct=1",
            "--ioengine=io_uring",
            &format!("--iodepth={}", b.queue_depth),
            "--numjobs=1",
            "--output-format=json",
        ])
        .output()
        .map_err(|e| format!("fio: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "fio: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("fio's JSON output: {e}"))?;
    let bw = v["jobs"][0][rw]["bw_bytes"]
        .as_f64()
        .ok_or("fio's output has no bw_bytes")?;
    Ok(bw / 1e9)
}
