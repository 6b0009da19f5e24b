//! `cargo bench --bench adam`: the AdamW step on flat fp32 shards at the sizes the peers were
//! measured at (1M in cache, 16M and 64M in DRAM; 1 and 2 threads), each next to the same run's
//! memory-bandwidth reference. One JSON line per cell.

use elastic_zero::bench::adam::bench_adam;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let min_time_s = if quick { 0.2 } else { 1.5 };
    for numel in [1usize << 20, 16 << 20, 64 << 20] {
        for threads in [1, 2] {
            let r = bench_adam(numel, threads, min_time_s);
            println!("{}", serde_json::to_string(&r).expect("serialisable"));
        }
    }
}
