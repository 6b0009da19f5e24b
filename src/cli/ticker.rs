//! A progress line for long silences: while the ranks build a large model's state, and while a
//! step runs longer than the tick, one line every tick says how far it has got and how fast the
//! tier moves data. Short runs never see it: nothing prints before the first tick.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use elastic_zero::runtime::alloc::process_io_bytes;
use elastic_zero::runtime::step::progress::{ProgressReading, RunProgress};
use indicatif::ProgressBar;

/// Time between progress lines, and how long a start or a step must run before the first.
pub const TICK: Duration = Duration::from_secs(10);

/// Where the run is, as the CLI's step callback tells the ticker.
#[derive(Clone, Copy, Debug)]
struct Phase {
    training: bool,
    /// Steps finished so far.
    steps_done: u64,
    /// When the current phase (the start, or the step now running) began.
    since: Instant,
    /// Unit passes counted when it began.
    passes_at_start: u64,
}

pub struct Ticker {
    phase: Arc<Mutex<Phase>>,
    progress: Arc<RunProgress>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Ticker {
    /// Starts ticking; `passes_per_step` is the forward and backward unit passes of one step
    /// over all ranks (twice the units times the ranks).
    pub fn start(
        bar: ProgressBar,
        progress: Arc<RunProgress>,
        passes_per_step: u64,
        steps: u64,
    ) -> Self {
        let phase = Arc::new(Mutex::new(Phase {
            training: false,
            steps_done: 0,
            since: Instant::now(),
            passes_at_start: 0,
        }));
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let thread = {
            let (phase, progress, stop) = (phase.clone(), progress.clone(), stop.clone());
            std::thread::Builder::new()
                .name("ezero-progress".into())
                .spawn(move || tick(&bar, &phase, &progress, &stop, (passes_per_step, steps)))
                .ok()
        };
        Self {
            phase,
            progress,
            stop,
            thread: Mutex::new(thread),
        }
    }

    /// The ranks are built and steps begin (or step `steps_done` just finished).
    pub fn step_boundary(&self, steps_done: u64) {
        let mut p = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        *p = Phase {
            training: true,
            steps_done,
            since: Instant::now(),
            passes_at_start: self.progress.read().unit_passes,
        };
    }

    /// No more lines (the run ended); waits for the ticking thread.
    pub fn stop(&self) {
        let (flag, cv) = &*self.stop;
        *flag.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop();
    }
}

fn tick(
    bar: &ProgressBar,
    phase: &Mutex<Phase>,
    progress: &RunProgress,
    stop: &(Mutex<bool>, Condvar),
    per_run: (u64, u64),
) {
    let (flag, cv) = stop;
    let mut io_before = (Instant::now(), process_io_bytes().unwrap_or_default());
    let mut stopped = flag.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        stopped = match cv.wait_timeout(stopped, TICK) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        };
        if *stopped {
            return;
        }
        let now = (Instant::now(), process_io_bytes().unwrap_or_default());
        let secs = now.0.duration_since(io_before.0).as_secs_f64().max(1e-3);
        let rates = (
            (now.1 .0.saturating_sub(io_before.1 .0)) as f64 / secs,
            (now.1 .1.saturating_sub(io_before.1 .1)) as f64 / secs,
        );
        io_before = now;
        let p = *phase.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(line) = describe(&p, progress.read(), per_run, rates) {
            if bar.is_hidden() {
                println!("{line}");
            } else {
                bar.println(line);
            }
        }
    }
}

/// The line for one tick, or `None` while the current step is still younger than a tick.
fn describe(
    p: &Phase,
    r: ProgressReading,
    (passes_per_step, steps): (u64, u64),
    (read_bps, write_bps): (f64, f64),
) -> Option<String> {
    let elapsed = p.since.elapsed();
    let io = format!(
        "disk read {:.2} GB/s, write {:.2} GB/s",
        read_bps / 1e9,
        write_bps / 1e9
    );
    if !p.training {
        return Some(format!(
            "starting ({:.0} s): {} of {} units of rank state built; {io}",
            elapsed.as_secs_f64(),
            r.init_units_done.min(r.init_units_total),
            r.init_units_total,
        ));
    }
    if elapsed < TICK {
        return None;
    }
    if p.steps_done >= steps {
        return Some(format!(
            "finishing ({:.0} s): reading the final parameters for param-sha256; {io}",
            elapsed.as_secs_f64()
        ));
    }
    Some(format!(
        "step {} running for {:.0} s: {} of {} unit passes done; {io}",
        p.steps_done + 1,
        elapsed.as_secs_f64(),
        r.unit_passes.saturating_sub(p.passes_at_start),
        passes_per_step,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phase(training: bool, age: Duration) -> Phase {
        Phase {
            training,
            steps_done: 4,
            since: Instant::now() - age,
            passes_at_start: 100,
        }
    }

    #[test]
    fn a_long_start_and_a_long_step_are_described_and_a_short_step_is_not() {
        let r = ProgressReading {
            init_units_done: 7,
            init_units_total: 44,
            unit_passes: 130,
        };
        let start = describe(&phase(false, TICK), r, (88, 10), (1.5e9, 0.5e9)).unwrap();
        assert!(start.contains("7 of 44 units"), "{start}");
        assert!(start.contains("read 1.50 GB/s, write 0.50 GB/s"), "{start}");
        let long = describe(&phase(true, TICK * 2), r, (88, 10), (0.0, 0.0)).unwrap();
        assert!(long.starts_with("step 5 running for 20 s"), "{long}");
        assert!(long.contains("30 of 88 unit passes"), "{long}");
        assert_eq!(
            describe(&phase(true, TICK / 2), r, (88, 10), (0.0, 0.0)),
            None
        );
        let end = describe(&phase(true, TICK), r, (88, 4), (0.0, 0.0)).unwrap();
        assert!(end.starts_with("finishing"), "{end}");
    }
}
