//! Helpers for tests that drive the `ezero` binary: run it, read its digest, and check that a
//! refusal is one clear line with exit 2.

use std::path::{Path, PathBuf};
use std::process::Command;

use elastic_zero::checkpoint;

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn sha(&self) -> String {
        self.stdout
            .lines()
            .find_map(|l| l.strip_prefix("param-sha256: "))
            .unwrap_or_else(|| panic!("no digest:\n{}\n{}", self.stdout, self.stderr))
            .to_string()
    }

    pub fn trained(&self) -> bool {
        self.stdout.lines().any(|l| l.starts_with("step "))
    }
}

pub fn ezero<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Run {
    ezero_hooked(args, None)
}

/// `ezero` with a test hook (`EZERO_TEST_HOOK_*`, see `src/cli/test_hooks.rs`) set to a value.
pub fn ezero_hooked<S: AsRef<std::ffi::OsStr>>(args: &[S], hook: Option<(&str, &str)>) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ezero"));
    if let Some((name, value)) = hook {
        cmd.env(name, value);
    }
    let out = cmd.args(args).output().expect("ezero runs");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

/// `ezero train` with the tiny MLP and `extra` flags.
pub fn train_cli(extra: &[&str]) -> Run {
    train_cli_hooked(extra, None)
}

/// `ezero train` with the tiny MLP, `extra` flags and a test hook.
pub fn train_cli_hooked(extra: &[&str], hook: Option<(&str, &str)>) -> Run {
    let mut args = vec![
        "train",
        "--model",
        "mlp",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--seq-len",
        "8",
        "--micro-batches",
        "4",
        "--micro-batch-size",
        "2",
        "--sample-tokens",
        "0",
        "--chunk-elems",
        "1000",
    ];
    args.extend_from_slice(extra);
    ezero_hooked(&args, hook)
}

pub fn ok(r: &Run) -> &Run {
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    r
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(checkpoint::manifest::checkpoint_dir_name(step))
}

/// Exit 2, one line naming `file` and containing `what`, and no training.
pub fn refused(r: &Run, file: &str, what: &str) {
    assert_eq!(r.code, 2, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    let err = r.stderr.trim();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(file) && err.contains(what),
        "want `{file}` and `{what}` in: {err}"
    );
    assert!(
        !r.trained() && !r.stdout.contains("param-sha256"),
        "{}",
        r.stdout
    );
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

pub fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}
