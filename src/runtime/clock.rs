//! The one injected clock. Engines take the time as an argument; the runtime reads it here, so a
//! simulation can substitute its own.
//!
//! Whatever decides something by the time (a collective's deadline, when a delayed frame is
//! due) reads a [`Clock`] and waits on it ([`Clock::sleep`]), never on the wall: under a
//! [`ManualClock`] time moves only when told, or, simulated, to the next deadline once every
//! sleeper has gone quiet, so a seeded run's schedule replays. Durations that only feed reports
//! use a [`Stopwatch`]. This file and the I/O threads of the real transports are the only places
//! that read the wall (the tidy rule in `tests/tidy/clock.rs` lists them).

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since an arbitrary fixed origin; never decreases.
    fn now_ms(&self) -> u64;

    /// Blocks until `bell` rings past `seen` (a [`Bell::ticket`] taken before the caller last
    /// looked for what it waits for) or the clock reaches `deadline_ms` (never, for `None`).
    /// May return early; callers look again and sleep again.
    fn sleep(&self, bell: &Arc<Bell>, seen: u64, deadline_ms: Option<u64>);

    /// Whether time moves only as the threads sleeping on this clock let it (a simulation):
    /// then periodic work (the coordinator's tick) must sleep on it too, not on the wall.
    fn simulated(&self) -> bool {
        false
    }
}

/// Calls `tick` every `every_ms` on `clock`, on a thread of its own, until it returns false.
pub fn every(
    clock: Arc<dyn Clock>,
    every_ms: u64,
    mut tick: impl FnMut() -> bool + Send + 'static,
) {
    let run = move || {
        let bell = Bell::new();
        loop {
            let at = clock.now_ms() + every_ms;
            while clock.now_ms() < at {
                clock.sleep(&bell, bell.ticket(), Some(at));
            }
            if !tick() {
                return;
            }
        }
    };
    std::thread::Builder::new()
        .name("ezero-clock-tick".into())
        .spawn(run)
        .expect("spawn a clock's ticker");
}

/// A moment on a [`Clock`] (milliseconds since its origin) by which a wait gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline(pub u64);

impl Deadline {
    /// `ms` from now on `clock`.
    pub fn after(clock: &dyn Clock, ms: u64) -> Self {
        Self(clock.now_ms().saturating_add(ms))
    }

    /// Milliseconds left on `clock` (0 once passed).
    pub fn left_ms(self, clock: &dyn Clock) -> u64 {
        self.0.saturating_sub(clock.now_ms())
    }
}

/// What a sleeping thread waits to hear: whoever hands it something rings, and so does a
/// manual clock whose time passes the sleeper's deadline.
#[derive(Default)]
pub struct Bell {
    rung: Mutex<u64>,
    cv: Condvar,
    /// Rung for a courier: a thread that only serves others' waits (the in-process network's
    /// postman), whose own deadline alone never moves a simulated clock.
    courier: bool,
}

impl Bell {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// The bell of a courier thread (see the field).
    pub fn courier() -> Arc<Self> {
        Arc::new(Self {
            courier: true,
            ..Self::default()
        })
    }

    /// How often the bell has rung; take it before looking, sleep with it after.
    pub fn ticket(&self) -> u64 {
        *lock(&self.rung)
    }

    pub fn ring(&self) {
        *lock(&self.rung) += 1;
        self.cv.notify_all();
    }

    /// Wakes the sleepers without a ring, so that they look at the clock again.
    fn nudge(&self) {
        let _held = lock(&self.rung);
        self.cv.notify_all();
    }
}

/// A poisoned lock only means a thread panicked while holding it; the counters stay valid.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wall-clock time since construction.
pub struct SystemClock {
    origin: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl SystemClock {
    /// A shared wall clock, the one a run that is not simulated gets.
    pub fn shared() -> Arc<dyn Clock> {
        Arc::new(Self::default())
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    fn sleep(&self, bell: &Arc<Bell>, seen: u64, deadline_ms: Option<u64>) {
        let at = deadline_ms.map(|ms| self.origin + Duration::from_millis(ms));
        let mut rung = lock(&bell.rung);
        while *rung == seen {
            rung = match at {
                None => bell.cv.wait(rung).unwrap_or_else(|e| e.into_inner()),
                Some(at) => {
                    let left = at.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return;
                    }
                    let woke = bell.cv.wait_timeout(rung, left);
                    woke.unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
    }
}

/// Times a piece of work for a report. Never decides anything: what decides reads a [`Clock`].
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch(Instant);

impl Stopwatch {
    pub fn start() -> Self {
        Self(Instant::now())
    }

    pub fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }

    pub fn secs(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

/// The wall date (since the Unix epoch; zero before it), for what records when it was made (a
/// checkpoint's creation, a unique name). Never for deciding: that reads a [`Clock`].
pub fn unix_time() -> Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

/// A clock that moves only when told ([`ManualClock::advance`]), or, made with
/// [`ManualClock::simulated`], by itself to the earliest sleeper's deadline once the threads
/// that sleep on it have been still for a while (as a discrete-event simulation moves to its
/// next event). Deadlines and delays then cost no wall time, and a run whose threads only wait
/// on this clock sees the same times on every replay.
///
/// Time moves only while some thread other than a courier sleeps (someone waits for
/// something): to a courier's deadline (a late frame falls due) after `quiet`, to another
/// sleeper's (a wait gives up) only after [`PATIENCE`] quiet spells, so that a thread the OS
/// set aside briefly does not see its peers time out.
/// How many quiet spells a simulated clock waits before it lets a wait give up.
pub const PATIENCE: u32 = 25;

pub struct ManualClock {
    state: Mutex<Manual>,
    /// Wakes the simulation's driver when a thread falls asleep.
    stirred: Condvar,
}

#[derive(Default)]
struct Manual {
    now_ms: u64,
    sleepers: BTreeMap<u64, Sleeper>,
    next_id: u64,
    /// Bumped whenever a thread falls asleep or wakes, or time moves: the driver moves time
    /// only across a quiet spell in which this stayed put.
    activity: u64,
}

struct Sleeper {
    deadline_ms: Option<u64>,
    bell: Arc<Bell>,
}

impl ManualClock {
    /// At time 0; moves only when told.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::default(),
            stirred: Condvar::new(),
        })
    }

    /// At time 0; moves to the earliest deadline whenever every sleeper has been still for
    /// `quiet` of wall time. A thread that computes (rather than sleeps) for longer than that
    /// while others sleep lets time jump under it, so `quiet` must exceed the longest stretch
    /// of work between two waits.
    pub fn simulated(quiet: Duration) -> Arc<Self> {
        let clock = Self::new();
        let weak = Arc::downgrade(&clock);
        std::thread::Builder::new()
            .name("ezero-sim-clock".into())
            .spawn(move || drive(weak, quiet))
            .expect("spawn the simulated clock's driver");
        clock
    }

    /// Moves time forward by `ms`, waking whoever's deadline it passes.
    pub fn advance(&self, ms: u64) {
        let at = self.now_ms() + ms;
        self.advance_to(at);
    }

    /// Moves time to `at_ms` (never backwards) and wakes the sleepers whose deadline it
    /// reached: the couriers first, alone, so that what falls due at a moment is delivered
    /// before any wait gives up at that moment; the others on a later call.
    pub fn advance_to(&self, at_ms: u64) {
        let due: Vec<Arc<Bell>> = {
            let mut st = lock(&self.state);
            st.now_ms = st.now_ms.max(at_ms);
            st.activity += 1;
            let now = st.now_ms;
            let overdue = |s: &&Sleeper| s.deadline_ms.is_some_and(|d| d <= now);
            let couriers = st.sleepers.values().any(|s| s.bell.courier && overdue(&s));
            st.sleepers
                .values()
                .filter(overdue)
                .filter(|s| s.bell.courier == couriers)
                .map(|s| Arc::clone(&s.bell))
                .collect()
        };
        // Outside the clock's lock: a sleeper holds its bell's lock while it reads the time.
        for bell in due {
            bell.nudge();
        }
    }

    /// How many threads sleep on this clock now.
    pub fn sleepers(&self) -> usize {
        lock(&self.state).sleepers.len()
    }

    /// The earliest deadline of any sleeper, if one has a deadline.
    pub fn next_deadline(&self) -> Option<u64> {
        let st = lock(&self.state);
        st.sleepers.values().filter_map(|s| s.deadline_ms).min()
    }

    fn fall_asleep(&self, bell: &Arc<Bell>, deadline_ms: Option<u64>) -> u64 {
        let mut st = lock(&self.state);
        let id = st.next_id;
        st.next_id += 1;
        st.activity += 1;
        let bell = Arc::clone(bell);
        st.sleepers.insert(id, Sleeper { deadline_ms, bell });
        self.stirred.notify_all();
        id
    }

    fn wake(&self, id: u64) {
        let mut st = lock(&self.state);
        st.sleepers.remove(&id);
        st.activity += 1;
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        lock(&self.state).now_ms
    }

    fn simulated(&self) -> bool {
        true
    }

    fn sleep(&self, bell: &Arc<Bell>, seen: u64, deadline_ms: Option<u64>) {
        if deadline_ms.is_some_and(|d| self.now_ms() >= d) {
            return;
        }
        let id = self.fall_asleep(bell, deadline_ms);
        let mut rung = lock(&bell.rung);
        // Once asleep, only a ring or the clock's wake-up ends the sleep: a deadline reached
        // while a courier still delivers what fell due with it waits for the clock's word.
        while *rung == seen {
            rung = bell.cv.wait(rung).unwrap_or_else(|e| e.into_inner());
            if deadline_ms.is_some_and(|d| self.now_ms() >= d) {
                break;
            }
        }
        drop(rung);
        self.wake(id);
    }
}

/// The simulated clock's driver: once the sleepers have been still long enough for the
/// earliest deadline among them (see [`ManualClock`]), time jumps to it. Ends when the clock is
/// dropped.
fn drive(clock: Weak<ManualClock>, quiet: Duration) {
    let mut still = (u64::MAX, 0u32);
    loop {
        let Some(c) = clock.upgrade() else { return };
        let st = lock(&c.state);
        if !st.sleepers.values().any(|s| !s.bell.courier) {
            // Nobody waits; looks again now and then, to notice the clock being dropped.
            let idle = c.stirred.wait_timeout(st, Duration::from_millis(100));
            drop(idle);
            continue;
        }
        let (activity, next) = (st.activity, earliest(&st));
        drop(st);
        still = if still.0 == activity {
            (activity, still.1 + 1)
        } else {
            (activity, 0)
        };
        let due = next.filter(|&(_, courier)| still.1 >= if courier { 1 } else { PATIENCE });
        if let Some((at, _)) = due {
            c.advance_to(at);
            continue;
        }
        drop(c);
        std::thread::sleep(quiet);
    }
}

/// The earliest deadline of any sleeper, and whether a courier's (the earliest kind wins ties).
fn earliest(st: &Manual) -> Option<(u64, bool)> {
    st.sleepers
        .values()
        .filter_map(|s| s.deadline_ms.map(|d| (d, !s.bell.courier)))
        .min()
        .map(|(d, waiter)| (d, !waiter))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_wakes_a_sleeper_only_when_told() {
        let clock = ManualClock::new();
        let bell = Bell::new();
        let (c, b) = (Arc::clone(&clock), Arc::clone(&bell));
        let sleeper = std::thread::spawn(move || {
            let seen = b.ticket();
            c.sleep(&b, seen, Some(50));
            c.now_ms()
        });
        while clock.sleepers() == 0 {
            std::thread::yield_now();
        }
        clock.advance(20);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!sleeper.is_finished(), "20 ms of 50 wake nobody");
        clock.advance(30);
        assert_eq!(sleeper.join().unwrap(), 50);
        assert_eq!(clock.sleepers(), 0);
    }

    #[test]
    fn a_bell_wakes_a_sleeper_before_its_deadline() {
        for clock in [SystemClock::shared(), ManualClock::new() as Arc<dyn Clock>] {
            let bell = Bell::new();
            let seen = bell.ticket();
            let b = Arc::clone(&bell);
            let ringer = std::thread::spawn(move || b.ring());
            clock.sleep(&bell, seen, Some(clock.now_ms() + 60_000));
            ringer.join().unwrap();
            assert_eq!(bell.ticket(), seen + 1);
        }
    }

    #[test]
    fn a_simulated_clock_jumps_to_the_earliest_deadline_when_all_sleep() {
        let clock = ManualClock::simulated(Duration::from_millis(2));
        let sleepers: Vec<_> = [10_000u64, 3_000]
            .into_iter()
            .map(|d| {
                let c = Arc::clone(&clock);
                std::thread::spawn(move || {
                    let bell = Bell::new();
                    c.sleep(&bell, bell.ticket(), Some(d));
                    c.now_ms()
                })
            })
            .collect();
        let woke: Vec<u64> = sleepers.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(woke, [10_000, 3_000], "each wakes at its own deadline");
    }

    #[test]
    fn the_system_clock_sleeps_until_the_deadline() {
        let clock = SystemClock::default();
        let bell = Bell::new();
        let at = clock.now_ms() + 15;
        clock.sleep(&bell, bell.ticket(), Some(at));
        assert!(clock.now_ms() >= at);
    }
}
