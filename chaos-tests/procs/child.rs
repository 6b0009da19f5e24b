//! A process the harness started: its output collected as it comes, signals, a bounded wait,
//! and a kill and reap when it is dropped, so a failing scenario leaves nothing running.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::procs::EZERO;

/// A child process whose output is collected as it comes; dropping it kills and reaps it.
pub struct Child {
    child: std::process::Child,
    out: Arc<Mutex<Vec<String>>>,
    err: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
    status: Option<ExitStatus>,
}

impl Child {
    pub fn spawn(cmd: &mut Command) -> Result<Child, String> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {EZERO}: {e}"))?;
        let out: Arc<Mutex<Vec<String>>> = Arc::default();
        let err: Arc<Mutex<String>> = Arc::default();
        let (o, stdout) = (out.clone(), child.stdout.take().unwrap());
        let (e, mut stderr) = (err.clone(), child.stderr.take().unwrap());
        let readers = vec![
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    o.lock().unwrap().push(line);
                }
            }),
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = stderr.read_to_string(&mut s);
                *e.lock().unwrap() = s;
            }),
        ];
        Ok(Child {
            child,
            out,
            err,
            readers,
            status: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stdout(&self) -> Vec<String> {
        self.out.lock().unwrap().clone()
    }

    pub fn stderr(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    /// The first stdout line starting with `prefix`, waiting until `deadline`.
    pub fn line(&mut self, prefix: &str, deadline: Instant) -> Option<String> {
        loop {
            if let Some(l) = self.stdout().into_iter().find(|l| l.starts_with(prefix)) {
                return Some(l);
            }
            if Instant::now() >= deadline || self.exited().is_some() {
                return self.stdout().into_iter().find(|l| l.starts_with(prefix));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Waits for the exit until `deadline`; `None` if it was still running (it is then
    /// thawed and killed).
    pub fn wait(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if let Some(s) = self.exited() {
                self.join_readers();
                return Some(s);
            }
            if Instant::now() >= deadline {
                self.reap();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: i32) {
        // Invariant: the pid is our child's and it has not been reaped yet.
        unsafe { libc::kill(self.pid() as i32, sig) };
    }

    pub fn reap(&mut self) {
        if self.exited().is_none() {
            self.signal(libc::SIGCONT);
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
        self.join_readers();
    }

    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.reap();
    }
}
