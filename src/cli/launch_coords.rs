//! The coordinators of a launch: with `--coordinators K`, K `ezero coordinator` processes of
//! one job share a metadata store (a directory made for the launch, a throwaway etcd, or the
//! store `--meta` names); one leads, the others stand by. The workers are given every
//! coordinator's address. The launch ends when a coordinator finishes the job (exit 0), or
//! when none is left; a standby that outlives the job is stopped.

use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use elastic_zero::runtime::meta::{spawn_local_etcd, LocalEtcd, MetaUrl};

use super::launch::{print, terminate, LaunchArgs, Line};
use super::CliError;

/// The metadata store of a launch, and what it made for it (removed or stopped at the end).
pub struct LaunchMeta {
    /// `--meta` and `--job-id` for every coordinator.
    pub flags: Vec<String>,
    dir: Option<PathBuf>,
    _etcd: Option<LocalEtcd>,
}

impl LaunchMeta {
    /// `None` for a launch with one coordinator and no `--meta`.
    pub fn prepare(a: &LaunchArgs) -> Result<Option<Self>, CliError> {
        if a.coordinators == 0 || a.coordinators > 16 {
            return Err(CliError::Usage(
                "--coordinators must be between 1 and 16".into(),
            ));
        }
        let job_id = a
            .job_id
            .clone()
            .unwrap_or_else(|| format!("launch-{}", std::process::id()));
        let (url, dir, etcd) =
            match a.meta.as_deref() {
                None if a.coordinators == 1 => return Ok(None),
                None => {
                    let dir = launch_dir("meta", &job_id)?;
                    (format!("file:{}", dir.display()), Some(dir), None)
                }
                Some(m) => match m.parse::<MetaUrl>() {
                    Ok(MetaUrl::EtcdLocal) => {
                        let dir = launch_dir("etcd", &job_id)?;
                        let etcd = spawn_local_etcd(&dir)
                            .map_err(|e| CliError::Usage(format!("--meta etcd-local: {e}")))?;
                        let url = etcd.url().to_string();
                        println!("ezero launch: started a local etcd at {url} for this launch");
                        (url, Some(dir), Some(etcd))
                    }
                    Ok(MetaUrl::Memory) if a.coordinators > 1 => return Err(CliError::Usage(
                        "--meta memory keeps the job in one process: with --coordinators above 1 \
                         use file:DIR, etcd://HOST:PORT or etcd-local"
                            .into(),
                    )),
                    Ok(_) => (m.to_string(), None, None),
                    Err(e) => return Err(CliError::Usage(e.to_string())),
                },
            };
        let mut flags = vec!["--meta".into(), url, "--job-id".into(), job_id];
        for (name, v) in [
            ("--lease-ttl-ms", a.lease_ttl_ms),
            ("--reattach-wait-ms", a.reattach_wait_ms),
        ] {
            if let Some(v) = v {
                flags.extend([name.to_string(), v.to_string()]);
            }
        }
        Ok(Some(Self {
            flags,
            dir,
            _etcd: etcd,
        }))
    }
}

/// A directory of this launch's own under the temporary directory (removed at the end): the
/// pid keeps two launches of one job id apart.
fn launch_dir(what: &str, job_id: &str) -> Result<PathBuf, CliError> {
    let dir = std::env::temp_dir().join(format!("ezero-{what}-{job_id}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| {
        CliError::Failed(format!(
            "cannot make the launch's {what} directory {}: {e}",
            dir.display()
        ))
    })?;
    Ok(dir)
}

impl Drop for LaunchMeta {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Waits for every coordinator of the launch to print where it listens; their addresses in
/// launch order.
pub fn wait_for_addresses(
    coords: &mut [Child],
    lines: &mpsc::Receiver<Line>,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    const PREFIX: &str = "ezero coordinator: listening on ";
    let deadline = Instant::now() + timeout;
    let mut addrs = Vec::new();
    while addrs.len() < coords.len() {
        // Our own sender keeps the channel open: notice a coordinator that refused the job
        // (bad saved state, say) by its exit, not by the timeout.
        if coords
            .iter_mut()
            .any(|c| matches!(c.try_wait(), Ok(Some(_))))
        {
            return Err("a coordinator exited before listening".into());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left.min(Duration::from_millis(100))) {
            Ok((None, false, text)) if text.starts_with(PREFIX) => {
                addrs.push(text[PREFIX.len()..].trim().to_string());
                println!("{text}");
            }
            Ok(line) => print(line),
            Err(mpsc::RecvTimeoutError::Timeout) if left.is_zero() => {
                return Err(format!(
                    "the coordinators did not start listening within {} s",
                    timeout.as_secs()
                ))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err("the coordinator exited before listening".into())
            }
        }
    }
    Ok(addrs)
}

/// Prints output until a coordinator finishes the job (exit 0) or none is left, and returns
/// that exit status; the standbys still running are then stopped. Each time `stop` is set (a
/// signal to us), every coordinator gets a SIGTERM.
pub fn wait_coordinators(
    coords: &mut [Child],
    lines: &mpsc::Receiver<Line>,
    stop: &AtomicBool,
) -> Option<ExitStatus> {
    let mut running: Vec<usize> = (0..coords.len()).collect();
    let (mut last, mut finished) = (None, None);
    while !running.is_empty() {
        running.retain(|&i| match coords[i].try_wait() {
            Ok(Some(status)) => {
                if status.success() {
                    finished = Some(status);
                }
                last = Some(status);
                false
            }
            _ => true,
        });
        if finished.is_some() {
            break;
        }
        if stop.swap(false, Ordering::Relaxed) {
            for &i in &running {
                terminate(&coords[i]);
            }
        }
        if let Ok(line) = lines.recv_timeout(Duration::from_millis(50)) {
            print(line);
        }
    }
    // A standby holds nothing of the job.
    for i in running {
        let _ = coords[i].kill();
        let _ = coords[i].wait();
    }
    finished.or(last)
}
