//! Time is injected: only the driver files below read the wall (`Instant::now`, `SystemTime`);
//! everything else reads `runtime::clock` (a `Clock` to decide by, a `Stopwatch` for reports),
//! so a simulated clock reaches every deadline and delay. The pure parts never read it at all.

use super::*;

/// Paths under `src/` (a file, or a folder ending in `/`) that read the wall, and why.
const CLOCK_DRIVERS: &[(&str, &str)] = &[
    (
        "runtime/clock.rs",
        "the clock itself: the wall clock, the stopwatch, the wall date",
    ),
    (
        "runtime/transport/tcp.rs",
        "a real socket's I/O thread; its test waits on a real peer",
    ),
    (
        "runtime/transport/quic/",
        "real sockets: the QUIC endpoint's tasks and their inbox",
    ),
    (
        "runtime/transport/ucx/",
        "the UCX worker thread polls real hardware",
    ),
    (
        "runtime/procs/",
        "the process mode: tokio timers over real sockets and child processes, always on the wall",
    ),
    (
        "runtime/api/http.rs",
        "the control API's socket read deadline",
    ),
    ("cli/ticker.rs", "the CLI's progress line and its rates"),
    ("cli/launch.rs", "starting and stopping real host processes"),
    ("cli/launch_coords.rs", "waiting on the real coordinator processes of a launch"),
    ("bench/", "benchmarks measure the wall"),
    (
        "model/backend/sim.rs",
        "the simulated device's copy engine holds each copy for its link time, in real time beside real compute, and counts compute's real waits",
    ),
    (
        "model/backend/sim/",
        "its tests time copies against the modeled link",
    ),
];

/// Parts that may not read the wall even through a driver's exemption: time comes in as an
/// argument.
const TIMELESS: &[&str] = &["plan/", "engine/", "reduce/", "optim/"];

/// What reading the wall looks like in the source.
const WALL: &[&str] = &["Instant::now", "SystemTime"];

fn under(rel: &str, entry: &str) -> bool {
    if entry.ends_with('/') {
        rel.starts_with(entry)
    } else {
        rel == entry
    }
}

/// Every read of the wall under `root/src` outside the drivers (and any in the timeless parts).
pub(super) fn clock_findings(root: &Path) -> Vec<Finding> {
    let src = root.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut findings = Vec::new();
    for path in files {
        let rel = path.strip_prefix(&src).unwrap_or(&path);
        let rel_s = rel.to_string_lossy().replace('\\', "/");
        let timeless = TIMELESS.iter().any(|t| under(&rel_s, t));
        let driver = CLOCK_DRIVERS.iter().any(|(d, _)| under(&rel_s, d));
        if driver && !timeless {
            continue;
        }
        let text = strip(&fs::read_to_string(&path).unwrap_or_default());
        for (i, line) in text.lines().enumerate() {
            let Some(wall) = WALL.iter().find(|w| line.contains(*w)) else {
                continue;
            };
            let why = if timeless {
                "plan, engine, reduce and optim take the time as an argument"
            } else {
                "read `runtime::clock` instead (a `Clock` to decide by, a `Stopwatch` for \
                 reports, `unix_time` for a date), or add a driver to CLOCK_DRIVERS \
                 (tests/tidy/clock.rs) saying why"
            };
            findings.push(Finding {
                file: Path::new("src").join(rel),
                line: i + 1,
                what: format!("`{wall}` reads the wall: {why}"),
            });
        }
    }
    findings
}

#[cfg(test)]
mod planted {
    use super::*;

    fn found(files: &[(&str, &str)]) -> Vec<String> {
        let dir = tempfile::tempdir().expect("temp dir");
        for (path, text) in files {
            let p = dir.path().join(path);
            fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            fs::write(p, text).expect("write");
        }
        clock_findings(dir.path())
            .iter()
            .map(|f| f.to_string())
            .collect()
    }

    const NOW: &str = "fn f() {\n    let _ = std::time::Instant::now();\n}\n";

    #[test]
    fn the_wall_in_an_engine_is_refused() {
        let got = found(&[("src/engine/x.rs", NOW)]);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with("src/engine/x.rs:2: `Instant::now`"),
            "{got:?}"
        );
    }

    #[test]
    fn the_wall_in_a_runtime_file_that_is_no_driver_is_refused() {
        let got = found(&[
            ("src/runtime/step/exec/mod.rs", NOW),
            (
                "src/runtime/api/cluster.rs",
                "fn f() { let _ = std::time::SystemTime::now(); }\n",
            ),
        ]);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            got.iter()
                .any(|f| f.starts_with("src/runtime/step/exec/mod.rs:2:")),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|f| f.starts_with("src/runtime/api/cluster.rs:1: `SystemTime`")),
            "{got:?}"
        );
    }

    #[test]
    fn the_wall_in_a_driver_comments_and_strings_passes() {
        let got = found(&[
            ("src/runtime/clock.rs", NOW),
            ("src/runtime/transport/quic/io.rs", NOW),
            ("src/bench/io.rs", NOW),
            (
                "src/runtime/step/comm/communicator.rs",
                "// Instant::now in a comment\nfn f() { let _ = \"SystemTime\"; }\n",
            ),
        ]);
        assert!(got.is_empty(), "{got:?}");
    }
}
