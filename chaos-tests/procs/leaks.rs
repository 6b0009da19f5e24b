//! What a scenario must not leave behind: processes, bound ports, files, harness threads.

use std::path::Path;

/// No process still runs with this scenario's secrets directory on its command line, and the
/// temporary directory its processes were given (`TMPDIR`) is empty.
pub fn check(dir: &Path, secrets: &Path) -> Result<(), String> {
    let needle = secrets.to_string_lossy().to_string();
    let me = std::process::id();
    let mut left = Vec::new();
    for entry in std::fs::read_dir("/proc")
        .map_err(|e| format!("/proc: {e}"))?
        .flatten()
    {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(&needle) {
            left.push(format!("{pid}: {}", cmdline.trim()));
        }
    }
    if !left.is_empty() {
        return Err(format!("processes left running: {left:?}"));
    }
    let tmp = dir.join("tmp");
    let files: Vec<String> = std::fs::read_dir(&tmp)
        .map_err(|e| format!("{}: {e}", tmp.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    if !files.is_empty() {
        return Err(format!(
            "files left in the processes' TMPDIR {}: {files:?}",
            tmp.display()
        ));
    }
    Ok(())
}

/// None of `ports` is still listening (TCP) or bound (UDP) on this machine.
pub fn ports_free(ports: &[u16]) -> Result<(), String> {
    let mut bound = Vec::new();
    for (file, listen_only) in [
        ("/proc/net/tcp", true),
        ("/proc/net/tcp6", true),
        ("/proc/net/udp", false),
        ("/proc/net/udp6", false),
    ] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() < 4 || (listen_only && cols[3] != "0A") {
                continue;
            }
            if let Some(p) = proc_net_port(cols[1]).filter(|p| ports.contains(p)) {
                bound.push(format!("{p} ({file})"));
            }
        }
    }
    if bound.is_empty() {
        Ok(())
    } else {
        Err(format!("ports still bound after the scenario: {bound:?}"))
    }
}

/// Threads of this process, to check that a scenario's proxies and readers all ended.
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// Open file descriptors of this process.
pub fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Resident memory of process `pid` (a number, or "self": the harness, which runs every proxy
/// and must not grow over a soak), KiB; `None` once it is gone.
pub fn rss_kib(pid: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
}

/// The port of an address column of /proc/net/{tcp,udp}[6] (`0100007F:1F90`: hex after the
/// colon).
pub fn proc_net_port(column: &str) -> Option<u16> {
    column
        .rsplit(':')
        .next()
        .and_then(|p| u16::from_str_radix(p, 16).ok())
}
