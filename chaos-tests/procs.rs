//! The process-level chaos harness: seeded scenarios of real `ezero coordinator` and `ezero
//! worker` processes on 127.0.0.1 under `kill -9`, SIGSTOP past the heartbeat timeout, standby
//! workers joining, drains through the HTTP endpoint, and a misbehaving network between the
//! processes (added delay, connections cut, a blackholed peer or control link, a partition that
//! heals), through the harness's own proxies (`procs/net.rs` says why not netem).
//!
//! Every scenario checks that the job ends with the fault-free `param-sha256` (or with the
//! documented stop when a loss is not covered), within its deadline, that every process is
//! reaped and ended as it should (a frozen worker is refused when it wakes, a drained one exits
//! 0), and that no process, bound port, temporary file or harness thread is left behind.
//!
//! Which scenarios: `CHAOS_PROC_SEED=S` one seed, `CHAOS_PROC_SEEDS=N` (or `A..B`) seeds,
//! `CHAOS_PROC_SCENARIO=FILE` a scenario file (as written next to a failing seed); otherwise
//! the fixed CI set. `CHAOS_PROC_COORDINATORS=1` adds faults of the leading coordinator to
//! generated seeds (kill -9 anytime, in a step, a backup or a reshard, with a worker, SIGSTOP
//! past its lease, cut off from etcd), with standby coordinators on a local etcd to take over.
//! `CHAOS_PROC_TRANSPORT=ucx` (or tcp, quic) forces generated seeds' data
//! plane; under ucx they draw process faults only. `CHAOS_PROC_REPORT=FILE` writes the totals
//! as JSON (the soak's report); `CHAOS_PROC_EVENTS=1` prints every scenario's observed events,
//! not only a failing one's.
//! Timing between processes is not deterministic: a seed replays the same schedule of faults,
//! not the same interleaving (the README says what that means).

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "procs/child.rs"]
mod child;
#[path = "procs/job.rs"]
mod job;
#[path = "procs/leaks.rs"]
mod leaks;
#[path = "procs/net.rs"]
mod net;
#[path = "procs/scenario.rs"]
mod scenario;
#[path = "procs/strike.rs"]
mod strike;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use job::Outcome;
use scenario::{
    generate, generate_on, generate_with_coordinators, seeds_from_env, During, Expect, Fault,
    Scenario, What,
};

/// One scenario at a time: they share the machine's two cores, and the leak check counts this
/// process's threads.
static SERIAL: Mutex<()> = Mutex::new(());

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chaos-procs")
}

fn fault(at_step: u64, what: What) -> Fault {
    Fault { at_step, what }
}

fn fixed(
    seed: u64,
    workers: usize,
    transport: &str,
    model: &str,
    stage: u8,
    faults: Vec<Fault>,
) -> Scenario {
    let steps = faults.last().map_or(10, |f| f.at_step + 200);
    Scenario {
        seed,
        workers,
        transport: transport.into(),
        model: model.into(),
        stage,
        steps,
        micro_batches: 6,
        backups: true,
        coordinators: 1 + faults.iter().filter(|f| f.what.loses_the_leader()).count(),
        faults,
    }
}

/// The CI set: every worker fault kind at least once, over TCP and QUIC, stages 1-3, and one
/// loss the backups do not cover. The leader's faults need etcd: a test of their own.
fn ci_set() -> Vec<Scenario> {
    vec![
        kill_in_a_step_then_freeze(),
        kill_in_a_backup_then_join_and_drain(),
        network_trouble_over_tcp(),
        lost_control_then_kill_mid_reshard(),
        network_trouble_over_quic(),
        two_losses_the_backups_cover(),
        two_losses_the_backups_miss(),
    ]
}

/// Three coordinators on a local etcd: the leader killed in a backup, the next one frozen
/// past its lease, and a worker killed under the third.
fn the_leader_lost_three_ways() -> Scenario {
    use What::*;
    fixed(
        9008,
        3,
        "tcp",
        "mlp",
        3,
        vec![
            fault(
                3,
                KillLeader {
                    during: During::Backup,
                },
            ),
            fault(8, StopLeader),
            fault(
                13,
                Kill {
                    pick: 1,
                    during: During::Anytime,
                },
            ),
        ],
    )
}

/// A kill while a step waits for the victim, then a freeze past the heartbeat timeout.
fn kill_in_a_step_then_freeze() -> Scenario {
    use What::*;
    fixed(
        9001,
        3,
        "tcp",
        "mlp",
        3,
        vec![
            fault(
                3,
                Kill {
                    pick: 1,
                    during: During::Step,
                },
            ),
            fault(8, Freeze { pick: 0 }),
        ],
    )
}

/// Over QUIC at stage 2: a kill while a backup waits for the victim, then a join and a drain.
fn kill_in_a_backup_then_join_and_drain() -> Scenario {
    use What::*;
    fixed(
        9002,
        3,
        "quic",
        "mlp",
        2,
        vec![
            fault(
                3,
                Kill {
                    pick: 2,
                    during: During::Backup,
                },
            ),
            fault(8, Join { count: 1 }),
            fault(13, Drain { pick: 0 }),
        ],
    )
}

/// Every network fault over TCP, on the GPT at stage 1.
fn network_trouble_over_tcp() -> Scenario {
    use What::*;
    fixed(
        9003,
        3,
        "tcp",
        "gpt",
        1,
        vec![
            fault(3, Cut { pick: 1 }),
            fault(
                7,
                Partition {
                    side: 1,
                    for_ms: 1200,
                },
            ),
            fault(11, Blackhole { pick: 2 }),
            fault(
                15,
                Delay {
                    pick: 0,
                    ms: 5,
                    for_ms: 800,
                },
            ),
        ],
    )
}

/// A control link gone dark, two joins, and a kill while the next joiner is admitted.
fn lost_control_then_kill_mid_reshard() -> Scenario {
    use What::*;
    fixed(
        9004,
        2,
        "tcp",
        "mlp",
        3,
        vec![
            fault(3, ControlBlackhole { pick: 1 }),
            fault(8, Join { count: 2 }),
            fault(13, KillMidReshard { pick: 0 }),
        ],
    )
}

/// A peer off the network and a partition, over QUIC.
fn network_trouble_over_quic() -> Scenario {
    use What::*;
    fixed(
        9005,
        3,
        "quic",
        "mlp",
        3,
        vec![
            fault(3, Blackhole { pick: 0 }),
            fault(
                8,
                Partition {
                    side: 2,
                    for_ms: 1000,
                },
            ),
        ],
    )
}

/// Two members at once: 0 and 2 of 4 leave every chunk a copy (each one's buddy lives).
fn two_losses_the_backups_cover() -> Scenario {
    use What::*;
    fixed(
        9006,
        4,
        "tcp",
        "mlp",
        3,
        vec![
            fault(3, KillPair { a: 0, b: 1 }),
            fault(
                8,
                Partition {
                    side: 1,
                    for_ms: 800,
                },
            ),
        ],
    )
}

/// Two members at once: 0 and 1 of 3 do not (1 held 0's backup): the documented stop.
fn two_losses_the_backups_miss() -> Scenario {
    use What::*;
    fixed(
        9007,
        3,
        "quic",
        "mlp",
        1,
        vec![fault(3, KillPair { a: 0, b: 0 })],
    )
}

/// Runs `sc`, checking this process's threads and descriptors come back to where they were.
fn run_one(
    sc: &Scenario,
    expect: &Expect,
    references: &mut BTreeMap<Vec<String>, String>,
) -> Outcome {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let key = {
        let mut k = job::train_flags(sc);
        k.push(sc.workers.to_string());
        k
    };
    let reference = match references.get(&key) {
        Some(r) => r.clone(),
        None => match job::reference_digest(sc) {
            Ok(r) => {
                references.insert(key, r.clone());
                r
            }
            Err(e) => {
                return Outcome {
                    seed: sc.seed,
                    failure: Some(e),
                    ..Outcome::default()
                }
            }
        },
    };
    let (threads, fds) = (leaks::threads(), leaks::fds());
    let mut out = job::run(sc, &reference, &root(), expect);
    let (threads_after, fds_after) = (leaks::threads(), leaks::fds());
    if out.failure.is_none() && (threads_after > threads || fds_after > fds) {
        out.failure = Some(format!(
            "the harness holds {threads_after} threads and {fds_after} descriptors after the \
             scenario, {threads} and {fds} before"
        ));
    }
    out
}

/// Writes the schedule and what was observed next to a failing seed; returns the replay line.
fn record_failure(sc: &Scenario, out: &Outcome) -> String {
    let dir = root();
    let _ = std::fs::create_dir_all(&dir);
    let file = dir.join(format!("seed-{}.json", sc.seed));
    let record = serde_json::json!({ "scenario": sc, "outcome": out });
    let _ = std::fs::write(
        &file,
        serde_json::to_string_pretty(&record).unwrap_or_default(),
    );
    let scenario_file = dir.join(format!("seed-{}.scenario.json", sc.seed));
    let _ = std::fs::write(
        &scenario_file,
        serde_json::to_string_pretty(sc).unwrap_or_default(),
    );
    format!(
        "replay: CHAOS_PROC_SCENARIO={} cargo test --release --test chaos_procs scenarios -- --nocapture\n  \
         (generated seeds also: CHAOS_PROC_SEED={}{}; schedule and observed events in {})",
        scenario_file.display(),
        sc.seed,
        match (sc.transport == "ucx", sc.coordinators > 1) {
            (true, true) => " CHAOS_PROC_TRANSPORT=ucx CHAOS_PROC_COORDINATORS=1",
            (true, false) => " CHAOS_PROC_TRANSPORT=ucx",
            (false, true) => " CHAOS_PROC_COORDINATORS=1",
            (false, false) => "",
        },
        file.display()
    )
}

/// The scenarios the environment asks for, or the CI set.
fn chosen() -> Vec<Scenario> {
    if let Ok(file) = std::env::var("CHAOS_PROC_SCENARIO") {
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("CHAOS_PROC_SCENARIO={file}: cannot read it: {e}"));
        return vec![Scenario::parse(&text, &file).unwrap_or_else(|e| panic!("{e}"))];
    }
    let one = std::env::var("CHAOS_PROC_SEED").ok();
    let many = std::env::var("CHAOS_PROC_SEEDS").ok();
    let transport = std::env::var("CHAOS_PROC_TRANSPORT").ok();
    let coordinators = std::env::var("CHAOS_PROC_COORDINATORS").is_ok_and(|v| v == "1");
    match seeds_from_env(one.as_deref(), many.as_deref()).unwrap_or_else(|e| panic!("{e}")) {
        Some(seeds) => seeds
            .into_iter()
            .map(|s| {
                let sc = if coordinators {
                    generate_with_coordinators(s, transport.as_deref())
                } else {
                    generate_on(s, transport.as_deref())
                };
                sc.check()
                    .unwrap_or_else(|e| panic!("CHAOS_PROC_TRANSPORT={transport:?}: {e}"));
                sc
            })
            .collect(),
        None => ci_set(),
    }
}

#[test]
fn scenarios() {
    run_all(&chosen());
}

#[test]
#[ignore = "needs etcd on PATH (apt-get install etcd-server; bash .ci/run installs it)"]
fn the_leader_lost_three_ways_loses_nothing() {
    run_all(&[the_leader_lost_three_ways()]);
}

/// Runs `scenarios`, prints a line per scenario and the totals (and writes them to
/// `CHAOS_PROC_REPORT`), and fails naming each failing seed with its replay command.
fn run_all(scenarios: &[Scenario]) {
    match net::probe_netem() {
        Ok(()) => eprintln!("netem is available; network faults still go through the harness's proxies"),
        Err(why) => eprintln!("netem is not available here ({why}); network faults go through the harness's TCP/UDP proxies"),
    }
    let mut references = BTreeMap::new();
    let mut failures = Vec::new();
    let mut totals: BTreeMap<String, u64> = BTreeMap::new();
    let mut add = |k: &str, v: u64| *totals.entry(k.to_string()).or_default() += v;
    let mut rss = Vec::new();
    let mut harness_rss = Vec::new();
    for sc in scenarios {
        sc.check().unwrap_or_else(|e| {
            panic!(
                "seed {}: the generator wrote an invalid scenario: {e}",
                sc.seed
            )
        });
        let out = run_one(sc, &sc.expect(), &mut references);
        eprintln!(
            "seed {} ({} workers, {}, {} stage {}): {} in {} ms; struck {:?}, skipped {}, {} recoveries, {} network retries",
            sc.seed,
            sc.workers,
            sc.transport,
            sc.model,
            sc.stage,
            if out.failure.is_some() { "FAILED" } else { "ok" },
            out.wall_ms,
            out.injected,
            out.skipped,
            out.recoveries,
            out.network_retries
        );
        if std::env::var_os("CHAOS_PROC_EVENTS").is_some() {
            eprintln!("  events:\n    {}", out.events.join("\n    "));
        }
        add("scenarios", 1);
        for (k, v) in &out.injected {
            add(&format!("injected_{k}"), *v);
        }
        add("skipped", out.skipped);
        add("recoveries", out.recoveries);
        add("rebalances", out.rebalances);
        add("network_retries", out.network_retries);
        add("documented_stops", u64::from(out.documented_stop));
        for (k, v) in &out.net {
            add(&format!("net_{k}"), *v);
        }
        rss.push(out.coord_rss_kib);
        harness_rss.push(leaks::rss_kib("self").unwrap_or(0));
        if let Some(why) = &out.failure {
            add("failures", 1);
            let replay = record_failure(sc, &out);
            eprintln!(
                "seed {} failed: {why}\n  {replay}\n  events:\n    {}",
                sc.seed,
                out.events.join("\n    ")
            );
            failures.push(sc.seed);
        }
    }
    totals.entry("failures".into()).or_default();
    if let Ok(file) = std::env::var("CHAOS_PROC_REPORT") {
        let growth = rss
            .iter()
            .map(|(a, b)| b.saturating_sub(*a))
            .max()
            .unwrap_or(0);
        let report = serde_json::json!({
            "totals": totals,
            "coordinator_rss_growth_kib_max": growth,
            "coordinator_rss_kib": rss,
            "harness_rss_kib_after_each": harness_rss,
            "failed_seeds": failures,
        });
        std::fs::write(&file, serde_json::to_string_pretty(&report).unwrap())
            .unwrap_or_else(|e| panic!("CHAOS_PROC_REPORT={file}: {e}"));
    }
    eprintln!("totals: {totals:?}");
    assert!(
        failures.is_empty(),
        "failing seeds: {failures:?} (replay lines above)"
    );
}

/// The harness must be able to fail: the same kill it passes with buddy backups, run without
/// them, ends with the documented stop instead of the fault-free digest, and the harness says
/// so.
#[test]
fn the_harness_catches_a_job_without_buddy_backups() {
    let mut sc = ci_set().remove(0);
    sc.seed = 9101;
    let expect = sc.expect();
    assert_eq!(expect, Expect::Digest);
    sc.backups = false;
    let out = run_one(&sc, &expect, &mut BTreeMap::new());
    let why = out
        .failure
        .expect("a job that lost a rank without backups passed the harness");
    assert!(why.contains(scenario::NO_BACKUP), "{why}");
    let _ = std::fs::remove_dir_all(root().join(format!("seed-{}", sc.seed)));
}

/// Input the harness cannot use is refused saying what is wrong and what it expects.
#[test]
fn bad_harness_input_is_refused_with_what_to_do() {
    for (one, many, want) in [
        (
            Some("x"),
            None,
            "CHAOS_PROC_SEED=\"x\": expected a seed number",
        ),
        (
            None,
            Some("ten"),
            "expected a count (200) or a range (100..300)",
        ),
        (None, Some("5..2"), "expected a count"),
    ] {
        let e = seeds_from_env(one, many).unwrap_err();
        assert!(e.contains(want), "{e}");
    }
    assert_eq!(
        seeds_from_env(None, Some("3..5")).unwrap(),
        Some(vec![3, 4])
    );
    assert_eq!(seeds_from_env(None, None).unwrap(), None);

    let good = serde_json::to_string(&ci_set()[0]).unwrap();
    assert_eq!(Scenario::parse(&good, "f.json").unwrap(), ci_set()[0]);
    let e = Scenario::parse("{\"seed\": 1,\n \"workers\": }", "f.json").unwrap_err();
    assert!(e.starts_with("f.json: line 2 column"), "{e}");
    let e = Scenario::parse(&good.replace("\"stage\"", "\"stag\""), "f.json").unwrap_err();
    assert!(e.contains("unknown field `stag`"), "{e}");
    let mut sc = ci_set()[0].clone();
    // Two workers: the kill leaves one, too few to freeze.
    sc.workers = 2;
    let e = Scenario::parse(&serde_json::to_string(&sc).unwrap(), "f.json").unwrap_err();
    assert!(
        e.contains("faults[1] (freeze) needs 2 members; the schedule leaves 1"),
        "{e}"
    );
    sc.transport = "udp".into();
    assert!(sc
        .check()
        .unwrap_err()
        .contains("\"tcp\", \"quic\" or \"ucx\""));
    // UCX shared memory passes beside the harness's proxies: network faults are refused.
    let mut sc = generate(0);
    sc.transport = "ucx".into();
    sc.faults = vec![Fault {
        at_step: 3,
        what: What::Cut { pick: 0 },
    }];
    let e = sc.check().unwrap_err();
    assert!(e.contains("process faults only"), "{e}");
}

/// Every generated schedule is one the harness can run (the in-process soak once failed on
/// scenarios its own config refused).
#[test]
fn generated_scenarios_are_valid() {
    for seed in 0..5000 {
        let sc = generate(seed);
        sc.check().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        if sc.pair().is_none() {
            assert_eq!(sc.expect(), Expect::Digest, "seed {seed}");
        }
        let ucx = generate_on(seed, Some("ucx"));
        ucx.check()
            .unwrap_or_else(|e| panic!("seed {seed} under ucx: {e}"));
        assert_eq!(ucx.transport, "ucx");
    }
}
