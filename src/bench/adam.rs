//! Throughput of the AdamW step on a flat fp32 shard, against the machine's memory bandwidth.
//!
//! The step is memory-bound, so the number that matters is how close it gets to what memory can
//! deliver. Alongside Adam this measures a STREAM-style triad (`a = b + s * c`) with the same
//! thread count and the same rayon splitting, on arrays too big for the last-level cache, and
//! reports the ratio of the two effective bandwidths.
//!
//! Conventions: Adam counts 28 bytes per parameter (reads of p, g, m, v; writes of p, m, v);
//! the triad counts 12 bytes per element (STREAM's convention: write-allocate traffic is not
//! counted). Both report the **median** of the timed repeats; GB = 1e9 bytes.

use std::time::Instant;

use serde::Serialize;

use crate::optim::{
    adam_step, multiversion, piece_len, prefetch_streams, AdamHyper, Isa, PREFETCH_AHEAD,
};

/// Bytes of memory traffic per parameter in one Adam step.
const ADAM_BYTES_PER_PARAM: f64 = 28.0;
/// STREAM triad bytes per element: read b, read c, write a.
const TRIAD_BYTES_PER_ELEM: f64 = 12.0;
/// Triad arrays have at least this many `f32`s (128 MiB each, 384 MiB for the three), beyond
/// the last-level cache of the machines this runs on (32 MiB on the reference EPYC, 300 MiB
/// shared on the Xeon VMs), so the triad measures DRAM bandwidth.
const TRIAD_MIN_ELEMS: usize = 32 << 20;
/// Timed repeats; the median is reported.
const REPEATS: usize = 5;

/// One benchmark result (serialised as JSON by the CLI).
#[derive(Clone, Debug, Serialize)]
pub struct AdamBench {
    pub numel: usize,
    pub threads: usize,
    /// Median AdamW step throughput, parameters per second.
    pub params_per_s: f64,
    /// `params_per_s * 28 B`, in GB/s.
    pub gb_per_s: f64,
    /// Median triad bandwidth (12 B/element), GB/s.
    pub triad_gb_per_s: f64,
    /// `gb_per_s / triad_gb_per_s`. Can exceed 1: the triad really moves 16 B/element (its
    /// stores first read the line, STREAM does not count that) and missing stores limit a
    /// single core, while Adam writes only lines it has just read.
    pub ratio_to_triad: f64,
}

/// Benchmarks AdamW (fp32, weight decay on, default betas) on flat buffers of `numel`
/// parameters with `threads` threads, then the triad. Each measurement is one untimed warm-up
/// call and [`REPEATS`] timed repeats of at least `min_time_s / REPEATS` each.
pub fn bench_adam(numel: usize, threads: usize, min_time_s: f64) -> AdamBench {
    bench_adam_with(numel, threads, min_time_s, numel.max(TRIAD_MIN_ELEMS))
}

fn bench_adam_with(numel: usize, threads: usize, min_time_s: f64, triad_elems: usize) -> AdamBench {
    let threads = threads.max(1);
    // A dedicated pool so `threads` means threads, not pieces on whatever pool is current.
    // Building it fails only if the OS refuses to spawn threads; nothing to measure then.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("spawning benchmark threads");
    let repeat_s = min_time_s / REPEATS as f64;

    let (adam_s, triad_s) = pool.install(|| {
        let mut p: Vec<f32> = (0..numel)
            .map(|i| ((i % 1000) as f32 - 500.0) * 1e-3)
            .collect();
        let g: Vec<f32> = (0..numel)
            .map(|i| ((i % 997) as f32 - 498.0) * 1e-3 + 0.25)
            .collect();
        let mut m = vec![0.0f32; numel];
        let mut v = vec![0.0f32; numel];
        let hp = AdamHyper::default();
        let mut t = 0u64;
        let adam_s = median_call_s(repeat_s, || {
            t += 1;
            adam_step(&mut p, &g, &mut m, &mut v, &hp, t, hp.lr, threads);
        });
        drop((p, g, m, v));

        let mut a = vec![0.0f32; triad_elems];
        let b: Vec<f32> = (0..triad_elems).map(|i| (i % 1024) as f32).collect();
        let c: Vec<f32> = (0..triad_elems).map(|i| (i % 512) as f32).collect();
        let triad_s = median_call_s(repeat_s, || triad(&mut a, &b, &c, 3.0, threads));
        (adam_s, triad_s)
    });

    let params_per_s = numel as f64 / adam_s;
    let gb_per_s = params_per_s * ADAM_BYTES_PER_PARAM / 1e9;
    let triad_gb_per_s = triad_elems as f64 * TRIAD_BYTES_PER_ELEM / triad_s / 1e9;
    AdamBench {
        numel,
        threads,
        params_per_s,
        gb_per_s,
        triad_gb_per_s,
        ratio_to_triad: gb_per_s / triad_gb_per_s,
    }
}

/// Seconds per call of `f`: one warm-up call (page faults, cache state), then the median over
/// [`REPEATS`] repeats, each calling `f` back to back for at least `repeat_s`.
pub(crate) fn median_call_s(repeat_s: f64, mut f: impl FnMut()) -> f64 {
    f();
    let mut per_call_s: Vec<f64> = (0..REPEATS)
        .map(|_| {
            let start = Instant::now();
            let mut calls = 0u32;
            loop {
                f();
                calls += 1;
                let elapsed_s = start.elapsed().as_secs_f64();
                if elapsed_s >= repeat_s {
                    return elapsed_s / f64::from(calls);
                }
            }
        })
        .collect();
    per_call_s.sort_by(f64::total_cmp);
    per_call_s[REPEATS / 2]
}

/// `a[i] = b[i] + s * c[i]`, split into pieces exactly as the optimizer splits a shard.
fn triad(a: &mut [f32], b: &[f32], c: &[f32], s: f32, threads: usize) {
    let isa = Isa::best();
    let piece = piece_len(a.len(), threads);
    rayon::scope(|scope| {
        let mut pieces = a
            .chunks_mut(piece)
            .zip(b.chunks(piece))
            .zip(c.chunks(piece));
        let first = pieces.next();
        for ((a, b), c) in pieces {
            scope.spawn(move |_| triad_kernel(isa, a, b, c, s));
        }
        if let Some(((a, b), c)) = first {
            triad_kernel(isa, a, b, c, s);
        }
    });
}

/// Written like the Adam kernel (16-lane chunks, same software prefetch) so the comparison
/// measures memory, not code generation.
#[inline(always)]
fn triad_body(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    let n = a.len();
    let (b, c) = (&b[..n], &c[..n]);
    let streams = [a.as_ptr(), b.as_ptr(), c.as_ptr()];
    let prefetch_end = a.len().saturating_sub(PREFETCH_AHEAD);
    let mut a_chunks = a.chunks_exact_mut(LANES);
    let mut b_chunks = b.chunks_exact(LANES);
    let mut c_chunks = c.chunks_exact(LANES);
    let chunks = (&mut a_chunks).zip(&mut b_chunks).zip(&mut c_chunks);
    for (i, ((a, b), c)) in chunks.enumerate() {
        prefetch_streams(&streams, i * LANES, prefetch_end);
        for j in 0..LANES {
            a[j] = b[j] + s * c[j];
        }
    }
    let tail = a_chunks
        .into_remainder()
        .iter_mut()
        .zip(b_chunks.remainder())
        .zip(c_chunks.remainder());
    for ((a, b), c) in tail {
        *a = b + s * c;
    }
}

const LANES: usize = 16;

multiversion!(fn triad_kernel(a: &mut [f32], b: &[f32], c: &[f32], s: f32) => triad_body);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triad_computes_the_triad() {
        let b: Vec<f32> = (0..100_000).map(|i| i as f32).collect();
        let c = vec![2.0f32; 100_000];
        let mut a = vec![0.0f32; 100_000];
        triad(&mut a, &b, &c, 0.5, 3);
        assert!(a.iter().enumerate().all(|(i, &x)| x == i as f32 + 1.0));
    }

    #[test]
    fn small_bench_reports_consistent_numbers() {
        let r = bench_adam_with(1 << 14, 2, 0.02, 1 << 16);
        assert_eq!((r.numel, r.threads), (1 << 14, 2));
        assert!(r.params_per_s > 0.0 && r.triad_gb_per_s > 0.0);
        assert!((r.gb_per_s - r.params_per_s * 28.0 / 1e9).abs() < 1e-9 * r.gb_per_s.max(1.0));
        assert!((r.ratio_to_triad - r.gb_per_s / r.triad_gb_per_s).abs() < 1e-12);
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"ratio_to_triad\""));
    }
}
