//! Process-wide allocator settings for training processes.
//!
//! A step allocates and frees the same large buffers over and over (unit outputs, gathered
//! parameters, gradient accumulators, frames: 1-30 MiB each). glibc's malloc serves blocks above
//! a dynamic threshold with fresh `mmap`s and trims freed memory at the top of its heaps back to
//! the kernel, so every step paid again for page faults and the kernel zeroing those pages: in
//! paired runs of the ZeRO-3 benchmark (BENCHMARKS.md §2.7) that was about a tenth of the step and
//! half of the system CPU time. Keeping freed memory in the process, as PyTorch's caching
//! allocator does, removes it; the process keeps its peak heap instead of shrinking after it.

/// Largest block glibc serves from its heaps instead of `mmap` (glibc caps this at 32 MiB).
pub const MMAP_THRESHOLD_BYTES: i32 = 32 << 20;
/// Free memory at the top of a heap glibc keeps instead of returning it to the kernel.
pub const TRIM_THRESHOLD_BYTES: i32 = 1 << 30;

/// Applies the settings above to this process. Call it once, early, before threads start
/// (`ezero` does, first thing); programs that embed the runtime may call it too. Returns
/// whether they took effect (false on allocators other than glibc's).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes glibc's tuning parameters; both values are in range
        // (it returns 0 and changes nothing otherwise).
        unsafe {
            let mmap = libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
            let trim = libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES);
            mmap == 1 && trim == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_accepts_the_settings() {
        assert!(super::keep_freed_memory());
    }
}
