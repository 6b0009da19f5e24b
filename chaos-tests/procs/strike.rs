//! Striking a fault: what the harness does to the job for each kind, and what it waits to see
//! before the next one.

use std::time::Duration;

use serde_json::Value;

use super::job::{CoordEnd, End, Run, CHANGE_DEADLINE};
use super::net::{Link, LinkState};
use super::scenario::{pair_positions, During, What};
use crate::common::procs::try_http;

impl Run<'_> {
    /// The member a pick strikes now, and its worker.
    fn victim(&mut self, pick: u32) -> Option<(u32, usize)> {
        let s = self.status()?;
        let members = Self::members(&s);
        if members.len() < 2 {
            return None;
        }
        let rank = members[pick as usize % members.len()];
        Some((rank, self.worker_of(rank)?))
    }

    /// Waits until `rank` is out of the members; `None` if the job ended first.
    fn gone(&mut self, rank: u32) -> Option<Value> {
        self.until(CHANGE_DEADLINE, |s| !Self::members(s).contains(&rank))
    }

    /// Strikes one fault and waits for what it must cause (a loss seen, a join or drain done, a
    /// window of network trouble over); `false` when it could not be struck (too few members,
    /// a refused request, the job ended).
    pub(crate) fn strike(&mut self, what: &What) -> Result<bool, String> {
        Ok(match *what {
            What::Kill { pick, during } => self.kill_one(pick, during),
            What::KillPair { a, b } => self.kill_two_at_once(a, b),
            What::Freeze { pick } => self.freeze(pick),
            What::ControlBlackhole { pick } => self.darken_control(pick),
            What::Join { count } => self.join_standbys(count)?,
            What::KillMidReshard { pick } => self.kill_mid_reshard(pick)?,
            What::Drain { pick } => self.drain(pick),
            What::Delay { pick, ms, for_ms } => self.delay_data(pick, ms, for_ms),
            What::Cut { pick } => self.cut_data(pick),
            What::Blackhole { pick } => self.drop_off_network(pick),
            What::Partition { side, for_ms } => self.partition(side, for_ms),
            What::KillLeader { during } => self.kill_leader(during),
            What::KillLeaderWithWorker { pick } => self.kill_leader_with_worker(pick),
            What::KillLeaderMidReshard => self.kill_leader_mid_reshard()?,
            What::StopLeader => self.stop_leader(),
            What::IsolateLeader => self.isolate_leader(),
        })
    }

    /// `kill -9` a member, at any moment or while a step or a backup waits for it.
    fn kill_one(&mut self, pick: u32, during: During) -> bool {
        let Some((rank, w)) = self.victim(pick) else {
            return false;
        };
        let phase = match during {
            During::Anytime => None,
            During::Step => Some("running"),
            During::Backup => Some("replicating"),
        };
        let landed = match phase {
            None => {
                self.workers[w].proc.signal(libc::SIGKILL);
                "anytime".to_string()
            }
            Some(p) => self.kill_during(rank, w, p),
        };
        self.workers[w].end = End::Killed;
        self.note(format!("kill -9 worker {w} (rank {rank}), {landed}"));
        if self.gone(rank).is_some() {
            self.note(format!("rank {rank} is out of the members"));
        }
        true
    }

    /// `kill -9` two members at once.
    fn kill_two_at_once(&mut self, a: u32, b: u32) -> bool {
        let Some(s) = self.status() else {
            return false;
        };
        let members = Self::members(&s);
        let Some((x, y)) = pair_positions(members.len(), a, b) else {
            return false;
        };
        let ranks = [members[x], members[y]];
        let mut hit = Vec::new();
        for r in ranks {
            let Some(w) = self.worker_of(r) else {
                return false;
            };
            hit.push(w);
        }
        for &w in &hit {
            self.workers[w].proc.signal(libc::SIGKILL);
            self.workers[w].end = End::Killed;
        }
        self.note(format!("kill -9 workers {hit:?} (ranks {ranks:?}) at once"));
        let out = self.until(CHANGE_DEADLINE, |s| {
            let m = Self::members(s);
            !m.contains(&ranks[0]) && !m.contains(&ranks[1])
        });
        if out.is_some() {
            self.note(format!("ranks {ranks:?} are out of the members"));
        }
        true
    }

    /// SIGSTOP a member until it is out of the members (or the deadline passes), then SIGCONT.
    fn freeze(&mut self, pick: u32) -> bool {
        let Some((rank, w)) = self.victim(pick) else {
            return false;
        };
        self.workers[w].proc.signal(libc::SIGSTOP);
        self.workers[w].end = End::Refused;
        self.note(format!("SIGSTOP worker {w} (rank {rank})"));
        let out = self.gone(rank);
        self.note(format!(
            "rank {rank} {} the members; SIGCONT",
            if out.is_some() { "left" } else { "never left" }
        ));
        self.workers[w].proc.signal(libc::SIGCONT);
        true
    }

    /// Drops everything on a member's control link.
    fn darken_control(&mut self, pick: u32) -> bool {
        let Some((rank, w)) = self.victim(pick) else {
            return false;
        };
        self.net.set(None, Link::Control(w), LinkState::Blackhole);
        self.workers[w].end = End::Refused;
        self.note(format!(
            "control link of worker {w} (rank {rank}) goes dark"
        ));
        if self.gone(rank).is_some() {
            self.note(format!("rank {rank} is out of the members"));
        }
        true
    }

    /// Starts `count` standbys, asks the job to take them, and waits until it has.
    fn join_standbys(&mut self, count: u32) -> Result<bool, String> {
        let before = match self.status() {
            Some(s) => Self::members(&s).len(),
            None => return Ok(false),
        };
        let Some(spawned) = self.start_standbys(count)? else {
            return Ok(false);
        };
        if !self.post_join(count) {
            return Ok(false);
        }
        let want = before + count as usize;
        if self
            .until(CHANGE_DEADLINE, |s| Self::members(s).len() >= want)
            .is_some()
        {
            self.note(format!("{count} joined"));
            for w in spawned {
                self.workers[w].end = End::WithJob;
            }
        }
        Ok(true)
    }

    /// `kill -9` a member while the reshard admitting a slowed joiner runs.
    fn kill_mid_reshard(&mut self, pick: u32) -> Result<bool, String> {
        let Some((rank, w)) = self.victim(pick) else {
            return Ok(false);
        };
        let Some(spawned) = self.start_standbys(1)? else {
            return Ok(false);
        };
        let joiner = spawned[0];
        // What the joiner receives is held (TCP) or slowed (QUIC: held datagrams are
        // lost, and the joiner could not even connect), so the reshard admitting it
        // lasts while the victim is struck.
        let slow = if self.sc.transport == "quic" {
            LinkState::Delay(Duration::from_millis(3))
        } else {
            LinkState::Hold
        };
        self.net.set(None, Link::Data(joiner), slow);
        if !self.post_join(1) {
            self.net.set(None, Link::Data(joiner), LinkState::Pass);
            return Ok(false);
        }
        let seen = self.until(Duration::from_secs(10), |s| {
            s["activity"]["phase"] == "resharding"
        });
        self.workers[w].proc.signal(libc::SIGKILL);
        self.workers[w].end = End::Killed;
        self.note(format!(
            "kill -9 worker {w} (rank {rank}) {}",
            if seen.is_some() {
                "during the reshard admitting a joiner"
            } else {
                "(no reshard seen: struck anytime)"
            }
        ));
        std::thread::sleep(Duration::from_millis(100));
        self.net.set(None, Link::Data(joiner), LinkState::Pass);
        if let Some(s) = self.gone(rank) {
            self.note(format!("rank {rank} is out of the members"));
            // A joiner that survives still joins (README, "Losses between steps").
            let members = Self::members(&s);
            let joined = members.iter().any(|&r| self.worker_of(r) == Some(joiner));
            if joined {
                self.workers[joiner].end = End::WithJob;
            }
        }
        Ok(true)
    }

    /// `POST /ranks/{rank}/drain` and waits until the rank has left.
    fn drain(&mut self, pick: u32) -> bool {
        let Some((rank, w)) = self.victim(pick) else {
            return false;
        };
        let Ok((code, body)) = try_http(&self.control(), "POST", &format!("/ranks/{rank}/drain"))
        else {
            return false; // the job ended
        };
        self.note(format!("POST /ranks/{rank}/drain: {code} {body}"));
        if code != 202 {
            return false;
        }
        self.workers[w].end = End::Left;
        if self.gone(rank).is_some() {
            self.note(format!("rank {rank} left"));
        }
        true
    }

    /// Delays the data into a member by `ms` for `for_ms`.
    fn delay_data(&mut self, pick: u32, ms: u64, for_ms: u64) -> bool {
        let Some((rank, w)) = self.victim(pick) else {
            return false;
        };
        let link = Link::Data(w);
        self.net
            .set(None, link, LinkState::Delay(Duration::from_millis(ms)));
        self.note(format!(
            "data into rank {rank} delayed {ms} ms for {for_ms} ms"
        ));
        std::thread::sleep(Duration::from_millis(for_ms));
        self.net.set(None, link, LinkState::Pass);
        true
    }

    /// Cuts the data connections into a member.
    fn cut_data(&mut self, pick: u32) -> bool {
        let Some((rank, w)) = self.victim(pick) else {
            return false;
        };
        self.net.cut(Link::Data(w));
        self.note(format!("data connections into rank {rank} cut"));
        true
    }

    /// Drops everything to and from a member, data and control.
    fn drop_off_network(&mut self, pick: u32) -> bool {
        let Some((rank, w)) = self.victim(pick) else {
            return false;
        };
        self.net.set(None, Link::Data(w), LinkState::Blackhole);
        self.net.set(None, Link::Control(w), LinkState::Blackhole);
        for other in (0..self.workers.len()).filter(|&o| o != w) {
            self.net
                .set(Some(w), Link::Data(other), LinkState::Blackhole);
        }
        self.workers[w].end = End::Refused;
        self.note(format!("worker {w} (rank {rank}) drops off the network"));
        if self.gone(rank).is_some() {
            self.note(format!("rank {rank} is out of the members"));
        }
        true
    }

    /// Holds the data between two sides of the members (bit `i % 32` of `side` puts member `i`
    /// on one side) for `for_ms`.
    fn partition(&mut self, side: u32, for_ms: u64) -> bool {
        let Some(s) = self.status() else {
            return false;
        };
        let members = Self::members(&s);
        let mut a = Vec::new();
        let mut b = Vec::new();
        for (i, &r) in members.iter().enumerate() {
            let Some(w) = self.worker_of(r) else { continue };
            if side >> (i % 32) & 1 == 1 {
                a.push(w)
            } else {
                b.push(w)
            }
        }
        if a.is_empty() || b.is_empty() {
            return false;
        }
        let pairs: Vec<(usize, usize)> = a
            .iter()
            .flat_map(|&x| b.iter().flat_map(move |&y| [(x, y), (y, x)]))
            .collect();
        for &(from, to) in &pairs {
            self.net.set(Some(from), Link::Data(to), LinkState::Hold);
        }
        self.note(format!("partition workers {a:?} | {b:?} for {for_ms} ms"));
        std::thread::sleep(Duration::from_millis(for_ms));
        for &(from, to) in &pairs {
            self.net.set(Some(from), Link::Data(to), LinkState::Pass);
        }
        self.note("partition healed".into());
        true
    }

    /// Starts `count` standby workers and waits until the coordinator holds them; `None` if it
    /// never did (the job ended).
    fn start_standbys(&mut self, count: u32) -> Result<Option<Vec<usize>>, String> {
        let mut spawned = Vec::new();
        for _ in 0..count {
            let w = self.spawn_worker(None, true)?;
            self.workers[w].end = End::Standby;
            spawned.push(w);
        }
        let c = u64::from(count);
        let held = self.until(CHANGE_DEADLINE, |s| s["standbys"].as_u64() >= Some(c));
        Ok(held.map(|_| spawned))
    }

    /// `POST /join?count=N`; whether it was accepted.
    fn post_join(&mut self, count: u32) -> bool {
        let Ok((code, body)) = try_http(&self.control(), "POST", &format!("/join?count={count}"))
        else {
            return false; // the job ended
        };
        self.note(format!("POST /join?count={count}: {code} {body}"));
        code == 202
    }

    /// Freezes the victim until `/status` shows `phase` waiting for it, then `kill -9`; thaws
    /// and tries a later moment otherwise. Falls back to a kill wherever it is after 30 tries.
    fn kill_during(&mut self, rank: u32, w: usize, phase: &str) -> String {
        for attempt in 0..30 {
            self.workers[w].proc.signal(libc::SIGSTOP);
            // Frozen, the victim sends nothing more: two equal answers mean its last words
            // have arrived.
            let mut seen = self.status();
            loop {
                std::thread::sleep(Duration::from_millis(60));
                let again = self.status();
                let same = |a: &Option<Value>, b: &Option<Value>| match (a, b) {
                    (Some(a), Some(b)) => {
                        a["activity"] == b["activity"] && a["awaiting"] == b["awaiting"]
                    }
                    _ => true,
                };
                if same(&seen, &again) {
                    break;
                }
                seen = again;
            }
            let Some(s) = seen else { break };
            let waits = s["awaiting"]
                .as_array()
                .is_some_and(|a| a.iter().any(|r| r.as_u64() == Some(rank.into())));
            if s["activity"]["phase"] == phase && waits {
                self.workers[w].proc.signal(libc::SIGKILL);
                return format!("during {phase} {} (try {attempt})", s["activity"]["step"]);
            }
            self.workers[w].proc.signal(libc::SIGCONT);
            let step = s["step"].as_u64();
            let _ = self.until(Duration::from_secs(10), |s| s["step"].as_u64() != step);
            std::thread::sleep(Duration::from_millis(attempt * 7 % 40));
        }
        self.workers[w].proc.signal(libc::SIGKILL);
        format!("not caught during {phase} in 30 tries: struck anytime")
    }

    /// The coordinator leading now (it answers `/status`), if any.
    fn leading(&mut self) -> Option<usize> {
        self.status()?;
        Some(self.leader.get())
    }

    /// Waits until a coordinator other than `old` leads and the job has stepped on under it;
    /// notes who.
    fn taken_over(&mut self, old: usize) {
        let step = |s: &Value| s["step"].as_u64();
        let seen = self.until(CHANGE_DEADLINE, |s| step(s).is_some());
        match seen {
            Some(s) if self.leader.get() != old => {
                let now = self.leader.get();
                let after = step(&s);
                let on = self.until(CHANGE_DEADLINE, |s| step(s) > after);
                self.note(format!(
                    "coordinator {now} leads{}",
                    if on.is_some() { "; steps go on" } else { "" }
                ));
            }
            _ => self.note("no other coordinator took over (the job ended?)".into()),
        }
    }

    /// `kill -9` of the leading coordinator, anytime or once `/status` shows a step or a
    /// backup running.
    fn kill_leader(&mut self, during: During) -> bool {
        let Some(c) = self.leading() else {
            return false;
        };
        let phase = match during {
            During::Anytime => None,
            During::Step => Some("running"),
            During::Backup => Some("replicating"),
        };
        let caught = phase.map(|p| {
            self.until(Duration::from_secs(10), |s| s["activity"]["phase"] == p)
                .is_some()
        });
        self.coords[c].proc.signal(libc::SIGKILL);
        self.coords[c].end = CoordEnd::Killed;
        self.note(format!(
            "kill -9 coordinator {c} (the leader){}",
            match (phase, caught) {
                (Some(p), Some(true)) => format!(" during {p}"),
                (Some(p), _) => format!(" ({p} not seen: anytime)"),
                _ => String::new(),
            }
        ));
        self.taken_over(c);
        true
    }

    /// `kill -9` of the leading coordinator and a member at once.
    fn kill_leader_with_worker(&mut self, pick: u32) -> bool {
        let Some((rank, w)) = self.victim(pick) else {
            return false;
        };
        let c = self.leader.get();
        self.coords[c].proc.signal(libc::SIGKILL);
        self.workers[w].proc.signal(libc::SIGKILL);
        self.coords[c].end = CoordEnd::Killed;
        self.workers[w].end = End::Killed;
        self.note(format!(
            "kill -9 coordinator {c} (the leader) and worker {w} (rank {rank}) at once"
        ));
        self.taken_over(c);
        if self.gone(rank).is_some() {
            self.note(format!("rank {rank} is out of the members"));
        }
        true
    }

    /// A standby joins; the leader is killed as soon as the reshard admitting it shows (or
    /// right after the join was accepted).
    fn kill_leader_mid_reshard(&mut self) -> Result<bool, String> {
        let Some(spawned) = self.start_standbys(1)? else {
            return Ok(false);
        };
        let c = self.leader.get();
        if !self.post_join(1) {
            return Ok(false);
        }
        let seen = self.until(Duration::from_secs(5), |s| {
            s["activity"]["phase"] == "resharding"
        });
        self.coords[c].proc.signal(libc::SIGKILL);
        self.coords[c].end = CoordEnd::Killed;
        self.note(format!(
            "kill -9 coordinator {c} (the leader) {}",
            if seen.is_some() {
                "during the reshard admitting a joiner"
            } else {
                "after the join was accepted"
            }
        ));
        self.taken_over(c);
        // Whether the joiner joined depends on whether the change was committed: either way
        // it must exit (a standby's end).
        let _ = spawned;
        Ok(true)
    }

    /// SIGSTOP of the leader until another coordinator leads, then SIGCONT: it must exit,
    /// deposed.
    fn stop_leader(&mut self) -> bool {
        let Some(c) = self.leading() else {
            return false;
        };
        self.coords[c].proc.signal(libc::SIGSTOP);
        self.coords[c].frozen = true;
        self.coords[c].end = CoordEnd::Deposed;
        self.note(format!("SIGSTOP coordinator {c} (the leader)"));
        self.taken_over(c);
        self.coords[c].proc.signal(libc::SIGCONT);
        self.coords[c].frozen = false;
        self.note(format!("SIGCONT coordinator {c}"));
        true
    }

    /// Everything between the leader and etcd is swallowed: its lease lapses, it exits, a
    /// standby leads.
    fn isolate_leader(&mut self) -> bool {
        let Some(c) = self.leading() else {
            return false;
        };
        self.net.set(None, Link::Meta(c), LinkState::Blackhole);
        self.coords[c].end = CoordEnd::Deposed;
        self.note(format!("coordinator {c} (the leader) cut off from etcd"));
        self.taken_over(c);
        true
    }
}
