//! A measurement, not part of the runtime: how fast two processes on this host move a payload
//! through shared-memory staging slots, as NCCL's shared-memory transport does, with the same
//! CRC-32 our frames carry taken on both sides while each 64 KiB block is in cache. The sender
//! copies each 4 MiB piece into a free slot (summing it), the receiver copies it out or adds it
//! into its buffer (summing it again) and frees the slot. BENCHMARKS.md ("UCX collectives",
//! session 33) compares it with `ucx_perftest` and with our UCX plane.
//!
//! ```text
//! cargo run --release --example shm_staging_probe -- 16 copy   # MiB per iteration, copy|add
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

const PIECE_BYTES: usize = 4 << 20;
const SLOTS: usize = 4;
const BLOCK_BYTES: usize = 64 << 10;

/// The slots' hand-over, at the start of the shared mapping: per slot, how many times it was
/// filled and freed, and the CRC of its last filling.
#[repr(C)]
struct Control {
    filled: [AtomicU64; SLOTS],
    freed: [AtomicU64; SLOTS],
    crc: [AtomicU64; SLOTS],
}

fn wait_for(counter: &AtomicU64, at_least: u64) {
    let mut spins = 0u32;
    while counter.load(Ordering::Acquire) < at_least {
        spins += 1;
        if spins > 64 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(16);
    let add = match args.next().as_deref() {
        None | Some("copy") => false,
        Some("add") => true,
        Some(other) => {
            eprintln!("mode must be copy or add, not {other}");
            std::process::exit(2);
        }
    };
    let size = mib << 20;
    let control_bytes = 4096;
    // SAFETY: a fresh anonymous shared mapping, checked below; both processes use it after
    // the fork, and the control block's atomics order every slot's use.
    let shared = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            control_bytes + SLOTS * PIECE_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(shared, libc::MAP_FAILED, "mmap");
    let shared = shared as *mut u8;
    // SAFETY: the mapping starts page-aligned and holds the control block.
    let control = unsafe { &*(shared as *const Control) };
    // SAFETY: slot `i` lies inside the mapping; only the side that owns it (per the control
    // block) touches it.
    let slot = |i: usize| unsafe {
        std::slice::from_raw_parts_mut(shared.add(control_bytes + i * PIECE_BYTES), PIECE_BYTES)
    };
    let iters = ((2usize << 30) / size).max(8);
    let pieces = size.div_ceil(PIECE_BYTES);
    // SAFETY: no other threads yet; the child only computes and exits.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child != 0 {
        let src: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        for seq in 0..iters * pieces {
            let (s, round, p) = (seq % SLOTS, (seq / SLOTS) as u64, seq % pieces);
            wait_for(&control.freed[s], round);
            let piece = &src[p * PIECE_BYTES..((p + 1) * PIECE_BYTES).min(size)];
            let mut sum = crc32fast::Hasher::new();
            for (d, b) in slot(s)
                .chunks_mut(BLOCK_BYTES)
                .zip(piece.chunks(BLOCK_BYTES))
            {
                d[..b.len()].copy_from_slice(b);
                sum.update(&d[..b.len()]);
            }
            control.crc[s].store(sum.finalize() as u64, Ordering::Relaxed);
            control.filled[s].store(round + 1, Ordering::Release);
        }
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
        return;
    }
    let mut dst = vec![0u8; size];
    let mut damaged = 0;
    let mut started = Instant::now();
    for seq in 0..iters * pieces {
        // The first two iterations warm the mapping and the caches.
        if seq == 2 * pieces {
            started = Instant::now();
        }
        let (s, round, p) = (seq % SLOTS, (seq / SLOTS) as u64, seq % pieces);
        wait_for(&control.filled[s], round + 1);
        let out = &mut dst[p * PIECE_BYTES..((p + 1) * PIECE_BYTES).min(size)];
        let mut sum = crc32fast::Hasher::new();
        for (d, b) in out.chunks_mut(BLOCK_BYTES).zip(slot(s).chunks(BLOCK_BYTES)) {
            let b = &b[..d.len()];
            sum.update(b);
            if add {
                d.iter_mut()
                    .zip(b)
                    .for_each(|(x, y)| *x = x.wrapping_add(*y));
            } else {
                d.copy_from_slice(b);
            }
        }
        if sum.finalize() as u64 != control.crc[s].load(Ordering::Relaxed) {
            damaged += 1;
        }
        control.freed[s].store(round + 1, Ordering::Release);
    }
    let t = started.elapsed().as_secs_f64() / (iters - 2) as f64;
    let mode = if add { "add" } else { "copy" };
    println!(
        "{mib} MiB {mode}: {:.3} ms an iteration, {:.2} GB/s, {damaged} damaged",
        t * 1e3,
        size as f64 / t / 1e9
    );
    std::process::exit(if damaged == 0 { 0 } else { 1 });
}
