//! Process-wide allocator settings for training processes.
//!
//! A step allocates and frees the same large buffers over and over (unit outputs, gathered
//! parameters, gradient accumulators, frames: 1-30 MiB each). glibc's malloc serves blocks above
//! a dynamic threshold with fresh `mmap`s and trims freed memory at the top of its heaps back to
//! the kernel, so every step paid again for page faults and the kernel zeroing those pages: in
//! paired runs of the ZeRO-3 benchmark (docs/benchmark-history.md) that was about a tenth of the step and
//! half of the system CPU time. Keeping freed memory in the process, as PyTorch's caching
//! allocator does, removes it; the process keeps its peak heap instead of shrinking after it.

/// Largest block glibc serves from its heaps instead of `mmap` (glibc caps this at 32 MiB).
pub const MMAP_THRESHOLD_BYTES: i32 = 32 << 20;
/// Free memory at the top of a heap glibc keeps instead of returning it to the kernel.
pub const TRIM_THRESHOLD_BYTES: i32 = 1 << 30;
/// One heap for every thread. glibc gives threads their own arenas, and with freed memory kept
/// each arena holds on to its own peak: every step runs on a fresh thread, so a ZeRO-3 run with
/// its state on the NVMe tier peaked at 96-108 MB with the default arenas (2 or more) and 56 MB
/// with one; the demo job's median step was the same either way (0.066-0.068 s vs
/// 0.0675-0.070 s, AMD EPYC, 2 vCPU): the runtime allocates few, large buffers.
pub const ARENA_MAX: i32 = 1;

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
            let arenas = libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX);
            mmap == 1 && trim == 1 && arenas == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Blocks at least this large get transparent huge pages: the smallest that always holds a
/// whole aligned huge page. Above the glibc mmap threshold a block is a fresh mapping; below
/// it, a block from the heap's fresh top takes huge pages on its first touch, and one that
/// reuses touched heap memory is left to `khugepaged`.
pub const HUGE_PAGE_MIN_BYTES: usize = 2 * HUGE_PAGE_BYTES;
/// The x86-64 and aarch64 (4 KiB base pages) transparent huge page.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// The system allocator, asking the kernel for transparent huge pages for large blocks.
///
/// A 1B-parameter step allocates, fills and frees several 200-400 MB buffers per unit (the
/// gathered unit, its gradient accumulator and mean). Kernels that give huge pages only on
/// request (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, the Debian default)
/// back them with 4 KiB pages: 51,200 page faults per 200 MB on the rank's thread. With
/// `MADV_HUGEPAGE` on the fresh mapping the first touch takes 2 MiB at a time. Blocks of 4 to
/// 32 MiB come from glibc's heap and are advised too: a collective that reads a peer's buffer
/// (`SharedMemory::peer_memory`) makes the kernel walk the peer's page table page by page, and
/// on 4 KiB pages that walk cost as much as a third of the copy (the 16 MiB all-reduce over UCX
/// at 4 processes ran at 1.5-1.6 GB/s on 4 KiB pages, 2.8-2.9 on huge ones). Smaller blocks are
/// left alone.
/// Install it in a binary with `#[global_allocator]`; where the kernel refuses (THP off, other
/// systems) it is the system allocator.
pub struct HugePages;

// SAFETY: every call goes to `System` unchanged; `advise` only adds a hint on memory the block
// owns.
unsafe impl std::alloc::GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = std::alloc::System.alloc(layout);
        advise_huge(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = std::alloc::System.alloc_zeroed(layout);
        advise_huge(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        std::alloc::System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        let p = std::alloc::System.realloc(ptr, layout, new);
        advise_huge(p, new);
        p
    }
}

/// `MADV_HUGEPAGE` on the whole huge pages inside `len` bytes at `p` (none when shorter than
/// [`HUGE_PAGE_MIN_BYTES`]). A refusal changes nothing, so its result is not checked.
fn advise_huge(p: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    if !p.is_null() && len >= HUGE_PAGE_MIN_BYTES {
        let start = (p as usize).next_multiple_of(HUGE_PAGE_BYTES);
        let end = (p as usize + len) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
        if end > start {
            // SAFETY: [start, end) lies inside the block just allocated; the advice changes
            // how its pages are backed, not their contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, len);
}

/// Hands the free memory inside the heap back to the kernel (glibc's `malloc_trim`). Building
/// the ranks' state frees many chunk-sized buffers below the mmap threshold, which
/// [`keep_freed_memory`] would otherwise keep resident for the whole run; call it once after.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Memory this process could still use: the smaller of the kernel's `MemAvailable` and what the
/// process's memory cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`) has left. `None` when
/// neither can be read.
pub fn available_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let avail = meminfo
        .as_deref()
        .and_then(|m| kib_field(m, "MemAvailable:"));
    let cgroup = cgroup_headroom();
    match (avail, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// The process's peak resident set (`VmHWM`), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&status, "VmHWM:")
}

/// Bytes the process has read from and written to storage so far (`/proc/self/io`'s
/// `read_bytes` and `write_bytes`: the tier's O_DIRECT I/O counts, page-cache hits do not).
pub fn process_io_bytes() -> Option<(u64, u64)> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = io.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].trim().parse().ok()
    };
    Some((field("read_bytes:")?, field("write_bytes:")?))
}

/// A `Name:   1234 kB` field of a /proc file, in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

fn cgroup_headroom() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let num = |s: Option<String>| s.and_then(|s| s.trim().parse::<u64>().ok());
    let cg = read("/proc/self/cgroup")?;
    for line in cg.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let (limit, usage) = if controllers.is_empty() {
            let base = format!("/sys/fs/cgroup{path}");
            (
                num(read(&format!("{base}/memory.max"))),
                num(read(&format!("{base}/memory.current"))),
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            let base = format!("/sys/fs/cgroup/memory{path}");
            (
                num(read(&format!("{base}/memory.limit_in_bytes"))),
                num(read(&format!("{base}/memory.usage_in_bytes"))),
            )
        } else {
            continue;
        };
        // v1 reports "no limit" as a number near 2^63; v2 as "max" (not a number).
        if let Some(limit) = limit.filter(|&l| l < 1 << 60) {
            return Some(limit.saturating_sub(usage.unwrap_or(0)));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_accepts_the_settings() {
        assert!(super::keep_freed_memory());
    }

    #[test]
    fn large_blocks_through_the_huge_page_allocator_hold_their_contents() {
        use std::alloc::{GlobalAlloc, Layout};
        let a = super::HugePages;
        let n = super::HUGE_PAGE_MIN_BYTES + 4096 + 3;
        let layout = Layout::from_size_align(n, 64).unwrap();
        // SAFETY: the layout is non-zero; each block is used within its size and freed once.
        unsafe {
            let p = a.alloc_zeroed(layout);
            assert!(!p.is_null());
            assert!(std::slice::from_raw_parts(p, n).iter().all(|&b| b == 0));
            p.add(n - 1).write(7);
            let q = a.realloc(p, layout, 2 * n);
            assert_eq!(q.add(n - 1).read(), 7);
            a.dealloc(q, Layout::from_size_align(2 * n, 64).unwrap());
        }
    }
}
