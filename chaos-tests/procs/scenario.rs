//! Process-level chaos scenarios: pure data, drawn from a seed or read from a file.
//!
//! A scenario is a small job (2-4 workers, TCP, QUIC or UCX, a tiny model) and a schedule of
//! faults, each at a step: the harness waits until `/status` shows that step, then strikes. What
//! a fault strikes is a pick among the members at that moment (`pick % members`), so a
//! schedule stays valid whatever the order of earlier events turned out to be.

use serde::{Deserialize, Serialize};

use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::job::build_model;
use elastic_zero::model::rng::SplitMix64;
use elastic_zero::plan::replica::holders;
use elastic_zero::plan::ShardMap;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub seed: u64,
    /// Worker processes at the start (one rank each).
    pub workers: usize,
    /// The data plane: "tcp", "quic" or "ucx" (UCX shared memory between the workers, TLS TCP
    /// beside it; only process faults, which the harness's proxies need not reach).
    pub transport: String,
    /// "mlp" or "gpt".
    pub model: String,
    pub stage: u8,
    pub steps: u64,
    pub micro_batches: u32,
    /// Buddy backups before every step (`--replicate-every 1`); off only to show that the
    /// harness notices what they protect.
    pub backups: bool,
    /// Coordinators of the job (one leads, the others stand by); above 1 the job is kept in a
    /// local etcd, each coordinator reaching it through a proxy of the harness.
    #[serde(default = "one")]
    pub coordinators: usize,
    pub faults: Vec<Fault>,
}

fn one() -> usize {
    1
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// Strike once `/status` reports this step (or later).
    pub at_step: u64,
    pub what: What,
}

/// When a kill lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum During {
    /// Whenever the harness gets there.
    Anytime,
    /// While a step waits for the victim (the harness freezes it first and checks `/status`).
    Step,
    /// While the buddy backup before a step waits for it.
    Backup,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum What {
    /// `kill -9` of a member's process.
    Kill { pick: u32, during: During },
    /// `kill -9` of two members at once: the members at positions `a % n` and the one
    /// `1 + b % (n - 1)` places after it. Only as the first fault, so that the planner can
    /// tell from the initial shard map whether the buddy backups cover the pair.
    KillPair { a: u32, b: u32 },
    /// A standby joins, its inbound data is held so that the reshard admitting it waits, and
    /// a member is killed while `/status` shows that reshard.
    KillMidReshard { pick: u32 },
    /// SIGSTOP past the heartbeat timeout, then SIGCONT: declared failed while frozen, and
    /// refused when it wakes.
    Freeze { pick: u32 },
    /// Standby workers start and `POST /join?count=N` takes them.
    Join { count: u32 },
    /// `POST /ranks/{id}/drain`.
    Drain { pick: u32 },
    /// Everything into a member's data plane waits `ms` per read, for `for_ms`.
    Delay { pick: u32, ms: u64, for_ms: u64 },
    /// Every data connection into a member is reset (QUIC: its datagrams are lost briefly).
    Cut { pick: u32 },
    /// A member drops off the network for good: everything into and out of its process (data
    /// plane and control connection) is swallowed. Declared failed after the heartbeat
    /// timeout; the worker, hearing nothing, gives up too.
    Blackhole { pick: u32 },
    /// The members whose bit is set in `side` (by position) and the rest cannot reach each
    /// other for `for_ms`; TCP bytes wait for the heal, QUIC datagrams are lost.
    Partition { side: u32, for_ms: u64 },
    /// A member's control connection goes silent for good: declared failed after the heartbeat
    /// timeout; the worker, hearing nothing, gives up too.
    ControlBlackhole { pick: u32 },
    /// `kill -9` of the leading coordinator, at any moment or while a step or a backup runs.
    KillLeader { during: During },
    /// `kill -9` of the leading coordinator and of a member at once.
    KillLeaderWithWorker { pick: u32 },
    /// A standby joins and the leading coordinator is killed while the reshard admitting it
    /// runs (or right after it was asked for).
    KillLeaderMidReshard,
    /// SIGSTOP of the leading coordinator until another leads, then SIGCONT: it must find its
    /// lease lost and exit, commanding and writing nothing.
    StopLeader,
    /// The leading coordinator's link to etcd goes dark: its lease lapses on its own clock, it
    /// exits, and a standby takes over.
    IsolateLeader,
}

impl What {
    pub fn kind(&self) -> &'static str {
        match self {
            What::Kill { .. } => "kill",
            What::KillPair { .. } => "kill_pair",
            What::KillMidReshard { .. } => "kill_mid_reshard",
            What::Freeze { .. } => "freeze",
            What::Join { .. } => "join",
            What::Drain { .. } => "drain",
            What::Delay { .. } => "delay",
            What::Cut { .. } => "cut",
            What::Blackhole { .. } => "blackhole",
            What::Partition { .. } => "partition",
            What::ControlBlackhole { .. } => "control_blackhole",
            What::KillLeader { .. } => "kill_leader",
            What::KillLeaderWithWorker { .. } => "kill_leader_with_worker",
            What::KillLeaderMidReshard => "kill_leader_mid_reshard",
            What::StopLeader => "stop_leader",
            What::IsolateLeader => "isolate_leader",
        }
    }

    /// A fault that takes the leading coordinator away (a standby must be left to lead).
    pub fn loses_the_leader(&self) -> bool {
        matches!(
            self,
            What::KillLeader { .. }
                | What::KillLeaderWithWorker { .. }
                | What::KillLeaderMidReshard
                | What::StopLeader
                | What::IsolateLeader
        )
    }

    /// A fault that takes a member away for good.
    pub fn loses_a_rank(&self) -> bool {
        matches!(
            self,
            What::Kill { .. }
                | What::KillPair { .. }
                | What::KillMidReshard { .. }
                | What::Freeze { .. }
                | What::Blackhole { .. }
                | What::ControlBlackhole { .. }
                | What::KillLeaderWithWorker { .. }
        )
    }

    /// Members it needs at least, and how it changes their number.
    fn needs_and_delta(&self) -> (usize, i64) {
        match self {
            What::Kill { .. }
            | What::Freeze { .. }
            | What::Blackhole { .. }
            | What::ControlBlackhole { .. }
            | What::Drain { .. }
            | What::KillLeaderWithWorker { .. } => (2, -1),
            What::KillPair { .. } => (2, -2),
            // The joiner joins only if the reshard admitting it was committed: count it out.
            What::KillLeader { .. }
            | What::KillLeaderMidReshard
            | What::StopLeader
            | What::IsolateLeader => (1, 0),
            What::Join { count } => (1, i64::from(*count)),
            // One joins, one dies.
            _ => (2, 0),
        }
    }

    /// Worker processes it starts.
    fn starts(&self) -> usize {
        match self {
            What::Join { count } => *count as usize,
            What::KillMidReshard { .. } | What::KillLeaderMidReshard => 1,
            _ => 0,
        }
    }
}

/// Most workers a scenario ever runs at once (initial plus joiners).
pub const MAX_WORKERS: usize = 6;

fn pick(rng: &mut SplitMix64, n: u64) -> u64 {
    rng.next_u64() % n.max(1)
}

/// The scenario of `seed`.
pub fn generate(seed: u64) -> Scenario {
    generate_on(seed, None)
}

/// Whether `what` strikes a process or the HTTP endpoint, not the network (the harness's
/// proxies sit on TCP and UDP; UCX shared memory passes beside them).
fn process_fault(what: &What) -> bool {
    matches!(
        what,
        What::Kill { .. }
            | What::KillPair { .. }
            | What::Freeze { .. }
            | What::Join { .. }
            | What::Drain { .. }
            | What::KillLeader { .. }
            | What::KillLeaderWithWorker { .. }
            | What::KillLeaderMidReshard
            | What::StopLeader
    )
}

/// The scenario of `seed`, or with `transport` forced (`CHAOS_PROC_TRANSPORT`): for "ucx" the
/// schedule draws process faults only. `generate` keeps every existing seed's scenario.
pub fn generate_on(seed: u64, transport: Option<&str>) -> Scenario {
    let ucx = transport == Some("ucx");
    let mut rng = SplitMix64::new(seed ^ 0x9E0C_E55E_D5EE_D000);
    let workers = 2 + pick(&mut rng, 3) as usize;
    let mut members = workers;
    let mut started = workers;
    let mut faults = Vec::new();
    let mut at = 2 + pick(&mut rng, 3);
    let pair = pick(&mut rng, 8) == 0;
    if pair {
        let what = What::KillPair {
            a: pick(&mut rng, 64) as u32,
            b: pick(&mut rng, 64) as u32,
        };
        faults.push(Fault { at_step: at, what });
        members -= 2;
        at += 4 + pick(&mut rng, 5);
    }
    for _ in 0..1 + pick(&mut rng, 3) {
        let p = pick(&mut rng, 64) as u32;
        let kind = pick(&mut rng, 13);
        // Under UCX, the kinds 0-4: kills, freeze, join, drain.
        let kind = if ucx { kind % 5 } else { kind };
        let what = match kind {
            0 | 1 => What::Kill {
                pick: p,
                during: [During::Anytime, During::Step, During::Backup][pick(&mut rng, 3) as usize],
            },
            2 => What::Freeze { pick: p },
            3 => What::Join {
                count: 1 + pick(&mut rng, 2) as u32,
            },
            4 => What::Drain { pick: p },
            5 => What::Delay {
                pick: p,
                ms: 1 + pick(&mut rng, 20),
                for_ms: 300 + pick(&mut rng, 1200),
            },
            6 | 7 => What::Cut { pick: p },
            8 => What::Blackhole { pick: p },
            9 => What::Partition {
                side: 1 + pick(&mut rng, 14) as u32,
                for_ms: 200 + pick(&mut rng, 1500),
            },
            10 => What::Partition {
                side: 1 + pick(&mut rng, 14) as u32,
                for_ms: 200 + pick(&mut rng, 1500),
            },
            11 => What::KillMidReshard { pick: p },
            _ => What::ControlBlackhole { pick: p },
        };
        let (needs, delta) = what.needs_and_delta();
        if members < needs || started + what.starts() > MAX_WORKERS {
            continue; // a fault this job cannot take now: skip it, as a valid schedule must
        }
        started += what.starts();
        members = (members as i64 + delta) as usize;
        faults.push(Fault { at_step: at, what });
        at += 4 + pick(&mut rng, 5);
    }
    let mut sc = Scenario {
        seed,
        workers,
        transport: match (pick(&mut rng, 3), transport) {
            (_, Some(t)) => t,
            (0, None) => "quic",
            _ => "tcp",
        }
        .into(),
        model: if pick(&mut rng, 4) == 0 { "gpt" } else { "mlp" }.into(),
        stage: 1 + pick(&mut rng, 3) as u8,
        steps: at + 200,
        micro_batches: 4 + pick(&mut rng, 4) as u32,
        backups: true,
        coordinators: 1,
        faults,
    };
    // Once a pair kill is not covered, the run stops there: later faults would never strike.
    if pair && sc.pair_uncovered().is_some() {
        sc.faults.truncate(1);
        sc.steps = sc.faults[0].at_step + 200;
    }
    sc
}

/// The scenario of `seed` with coordinator faults (`CHAOS_PROC_COORDINATORS=1`): the worker
/// faults of [`generate_on`] and one or two faults of the leading coordinator among them, each
/// with a standby to take over. Drawn from a stream of their own, so that the worker faults
/// are those of the seed without coordinators.
pub fn generate_with_coordinators(seed: u64, transport: Option<&str>) -> Scenario {
    let mut sc = generate_on(seed, transport);
    // A documented stop ends the run before any other fault: keep those scenarios as they are.
    if sc.pair_uncovered().is_some() {
        return sc;
    }
    let mut rng = SplitMix64::new(seed ^ 0xC00D_1DA7_E5EE_D000);
    let ucx = sc.transport == "ucx";
    for _ in 0..1 + pick(&mut rng, 2) {
        let what = match pick(&mut rng, if ucx { 4 } else { 5 }) {
            0 => What::KillLeader {
                during: [During::Anytime, During::Step, During::Backup][pick(&mut rng, 3) as usize],
            },
            1 => What::KillLeaderWithWorker {
                pick: pick(&mut rng, 64) as u32,
            },
            2 => What::KillLeaderMidReshard,
            3 => What::StopLeader,
            _ => What::IsolateLeader,
        };
        let at = pick(&mut rng, sc.faults.len() as u64 + 1) as usize;
        let step = sc.faults.get(at).map_or(sc.steps - 200, |f| f.at_step);
        sc.faults.insert(
            at,
            Fault {
                at_step: step,
                what,
            },
        );
        // Later faults strike a few steps after it.
        for f in &mut sc.faults[at + 1..] {
            f.at_step += 4 + pick(&mut rng, 3);
        }
        sc.steps = sc.faults.last().map_or(10, |f| f.at_step) + 200;
        sc.coordinators = 1 + sc
            .faults
            .iter()
            .filter(|f| f.what.loses_the_leader())
            .count();
        if sc.check().is_err() {
            // A fault this schedule cannot take there (too few members left): not drawn.
            sc.faults.remove(at);
            sc.steps = sc.faults.last().map_or(10, |f| f.at_step) + 200;
            sc.coordinators -= 1;
        }
    }
    sc
}

/// How a scenario must end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Exit 0 with the fault-free `param-sha256`.
    Digest,
    /// Exit 1 with the documented error containing this text.
    Stop(&'static str),
}

/// What a run that loses a rank without backups stops with (README, "Losses").
pub const NO_BACKUP: &str = "no in-memory backup exists";
/// What a run whose losses the backups do not cover stops with.
pub const NO_OTHER_COPY: &str = "had no other copy";

impl Scenario {
    /// Refuses what the harness cannot run, saying what is wrong.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_WORKERS).contains(&self.workers) {
            return Err(format!("workers {}: 1 to {MAX_WORKERS}", self.workers));
        }
        if !["tcp", "quic", "ucx"].contains(&self.transport.as_str()) {
            return Err(format!(
                "transport {:?}: \"tcp\", \"quic\" or \"ucx\"",
                self.transport
            ));
        }
        if self.transport == "ucx" {
            if let Some(f) = self.faults.iter().find(|f| !process_fault(&f.what)) {
                return Err(format!(
                    "{:?} under ucx: the harness's proxies cannot reach UCX shared memory (process faults only)",
                    f.what
                ));
            }
        }
        if !["mlp", "gpt"].contains(&self.model.as_str()) {
            return Err(format!("model {:?}: \"mlp\" or \"gpt\"", self.model));
        }
        if self.stage > 3 {
            return Err(format!("stage {}: 0 to 3", self.stage));
        }
        let mut members = self.workers;
        let mut started = self.workers;
        let mut last = 0;
        for (i, f) in self.faults.iter().enumerate() {
            if i > 0 && matches!(f.what, What::KillPair { .. }) {
                return Err(format!(
                    "faults[{i}] (kill_pair): only as the first fault (its cover is judged on \
                     the initial shard map)"
                ));
            }
            if f.at_step < last || f.at_step >= self.steps {
                return Err(format!(
                    "faults[{i}].at_step {}: faults in step order, each before steps ({})",
                    f.at_step, self.steps
                ));
            }
            last = f.at_step;
            let (needs, delta) = f.what.needs_and_delta();
            if members < needs {
                return Err(format!(
                    "faults[{i}] ({}) needs {needs} members; the schedule leaves {members}",
                    f.what.kind()
                ));
            }
            started += f.what.starts();
            if started > MAX_WORKERS {
                return Err(format!(
                    "faults[{i}] starts worker {started}: at most {MAX_WORKERS}"
                ));
            }
            members = (members as i64 + delta) as usize;
        }
        let leaders_lost = self
            .faults
            .iter()
            .filter(|f| f.what.loses_the_leader())
            .count();
        if !(1..=4).contains(&self.coordinators) || self.coordinators <= leaders_lost {
            return Err(format!(
                "coordinators {}: 1 to 4, and more than the {leaders_lost} faults that take the leader away",
                self.coordinators
            ));
        }
        Ok(())
    }

    /// Parses a scenario file (JSON, as the harness writes them).
    pub fn parse(text: &str, source: &str) -> Result<Scenario, String> {
        let s: Scenario = serde_json::from_str(text).map_err(|e| {
            format!(
                "{source}: line {} column {}: {e} (a scenario is the JSON the harness writes \
                 next to a failing seed)",
                e.line(),
                e.column()
            )
        })?;
        s.check().map_err(|e| format!("{source}: {e}"))?;
        Ok(s)
    }

    /// How the run must end: with the fault-free digest, unless a rank is lost without backups
    /// or a pair kill loses chunks' last copies (the planner's `holders` on the initial map
    /// says which), which end with the documented stop.
    pub fn expect(&self) -> Expect {
        if !self.backups && self.faults.iter().any(|f| f.what.loses_a_rank()) {
            return Expect::Stop(NO_BACKUP);
        }
        match self.pair_uncovered() {
            Some(_) => Expect::Stop(NO_OTHER_COPY),
            None => Expect::Digest,
        }
    }

    /// The ranks a first-fault pair kill strikes (initial ranks are 0..workers).
    pub fn pair(&self) -> Option<[u32; 2]> {
        let f = self.faults.first()?;
        let What::KillPair { a, b } = f.what else {
            return None;
        };
        pair_positions(self.workers, a, b).map(|(x, y)| [x as u32, y as u32])
    }

    /// The chunks (unit, index) without a surviving copy after the pair kill, if any.
    pub fn pair_uncovered(&self) -> Option<Vec<(usize, usize)>> {
        let pair = self.pair()?;
        let cfg = TrainConfig {
            model: if self.model == "gpt" {
                ModelKind::Gpt
            } else {
                ModelKind::Mlp
            },
            layers: 2,
            d_model: 32,
            heads: 4,
            seq_len: 16,
            ..TrainConfig::default()
        };
        let numels: Vec<usize> = build_model(&cfg)
            .expect("the harness's model shape is valid")
            .units()
            .iter()
            .map(|u| u.numel())
            .collect();
        let members: Vec<u32> = (0..self.workers as u32).collect();
        // The coordinator's initial map: epoch 1, every worker on one host (id-order ring).
        let map = ShardMap::plan(&numels, &members, CHUNK_ELEMS, 1).expect("a valid map");
        holders(&map, &pair).err()
    }
}

/// `--chunk-elems` of every scenario.
pub const CHUNK_ELEMS: usize = 1000;

/// Positions (among `n` members) a pair kill strikes: two different ones.
pub fn pair_positions(n: usize, a: u32, b: u32) -> Option<(usize, usize)> {
    if n < 2 {
        return None;
    }
    let x = a as usize % n;
    let y = (x + 1 + b as usize % (n - 1)) % n;
    Some((x, y))
}

impl Scenario {}

/// Which seeds to run, from the environment: `CHAOS_PROC_SEED=S` one, `CHAOS_PROC_SEEDS=N`
/// seeds 0..N, `CHAOS_PROC_SEEDS=A..B` a range; `None` when neither is set.
pub fn seeds_from_env(one: Option<&str>, many: Option<&str>) -> Result<Option<Vec<u64>>, String> {
    if let Some(s) = one {
        let seed = s
            .trim()
            .parse()
            .map_err(|_| format!("CHAOS_PROC_SEED={s:?}: expected a seed number, e.g. 17"))?;
        return Ok(Some(vec![seed]));
    }
    let Some(n) = many else {
        return Ok(None);
    };
    let bad = || format!("CHAOS_PROC_SEEDS={n:?}: expected a count (200) or a range (100..300)");
    let range = match n.trim().split_once("..") {
        Some((a, b)) => a.parse().map_err(|_| bad())?..b.parse().map_err(|_| bad())?,
        None => 0..n.trim().parse().map_err(|_| bad())?,
    };
    if range.is_empty() {
        return Err(bad());
    }
    Ok(Some(range.collect()))
}
