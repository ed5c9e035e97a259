//! Child processes of the suite (outboxd replicas, workers, producers) and their
//! supervision: start a new generation, SIGKILL / SIGSTOP / SIGCONT / SIGTERM it, and
//! restart one that exited without being asked to, as an orchestrator like Kubernetes would.

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::Context;
use rustix::process::{Pid, Signal, kill_process};
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

/// How to start one generation of a process.
#[derive(Debug, Clone)]
pub struct Launch {
    /// Executable.
    pub program: PathBuf,
    /// Arguments.
    pub args: Vec<String>,
    /// Extra environment (every inherited `OUTBOX_*` variable is removed first).
    pub env: Vec<(String, String)>,
    /// File that receives stdout and stderr (appended).
    pub log: PathBuf,
}

/// Builds the launch of generation `name` (e.g. `w2.g3`).
pub type Launcher = Box<dyn Fn(&str) -> Launch + Send + Sync>;

/// A process that exited although nobody stopped it.
#[derive(Debug, Clone)]
pub struct UnexpectedExit {
    /// Generation name.
    pub name: String,
    /// How it ended.
    pub status: String,
    /// When (µs).
    pub at: i64,
}

/// One supervised slot (e.g. worker 2), running one generation at a time.
pub struct Supervised {
    /// Slot name (`r1`, `w2`, `p3`).
    pub slot: String,
    launcher: Launcher,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    child: Option<Child>,
    generation: u32,
    name: String,
    /// Restart it if it exits.
    wanted: bool,
    /// SIGSTOPped right now.
    stopped: bool,
    exits: Vec<UnexpectedExit>,
}

impl Supervised {
    /// A slot that starts nothing until [`Supervised::start`].
    pub fn new(slot: impl Into<String>, launcher: Launcher) -> Self {
        Self {
            slot: slot.into(),
            launcher,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Starts the next generation; returns its name.
    pub async fn start(&self) -> anyhow::Result<String> {
        let mut inner = self.inner.lock().await;
        self.spawn_locked(&mut inner)
    }

    fn spawn_locked(&self, inner: &mut Inner) -> anyhow::Result<String> {
        inner.generation += 1;
        let name = format!("{}.g{}", self.slot, inner.generation);
        let launch = (self.launcher)(&name);
        inner.child = Some(spawn(&launch).with_context(|| format!("starting {name}"))?);
        inner.name = name.clone();
        inner.wanted = true;
        inner.stopped = false;
        Ok(name)
    }

    /// The running generation's name, if one runs.
    pub async fn running(&self) -> Option<String> {
        let mut inner = self.inner.lock().await;
        let alive = match inner.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        };
        alive.then(|| inner.name.clone())
    }

    /// Whether the running generation is SIGSTOPped.
    pub async fn is_stopped(&self) -> bool {
        self.inner.lock().await.stopped
    }

    /// SIGKILLs the running generation and reaps it; it is not restarted until
    /// [`Supervised::start`]. Returns the killed generation's name.
    pub async fn kill(&self) -> Option<String> {
        let mut inner = self.inner.lock().await;
        inner.wanted = false;
        inner.stopped = false;
        let mut child = inner.child.take()?;
        let alive = matches!(child.try_wait(), Ok(None));
        let _ = child.kill().await;
        alive.then(|| inner.name.clone())
    }

    /// Sends SIGSTOP (`true`) or SIGCONT (`false`). Returns the generation signalled.
    pub async fn pause(&self, stop: bool) -> Option<String> {
        let mut inner = self.inner.lock().await;
        let pid = inner.child.as_ref()?.id()?;
        let signal = if stop { Signal::STOP } else { Signal::CONT };
        // Our own unreaped child, so the pid cannot have been recycled.
        kill_process(Pid::from_raw(pid as i32)?, signal).ok()?;
        inner.stopped = stop;
        Some(inner.name.clone())
    }

    /// SIGTERM (after SIGCONT), then SIGKILL if it has not exited within `grace`.
    /// Returns how long it took to exit on SIGTERM (None: nothing ran, or it was killed).
    pub async fn terminate(&self, grace: Duration) -> Option<Duration> {
        let mut inner = self.inner.lock().await;
        inner.wanted = false;
        inner.stopped = false;
        let mut child = inner.child.take()?;
        let sent = std::time::Instant::now();
        if let Some(pid) = child.id().and_then(|pid| Pid::from_raw(pid as i32)) {
            // As in `pause`.
            let _ = kill_process(pid, Signal::CONT);
            let _ = kill_process(pid, Signal::TERM);
        }
        if tokio::time::timeout(grace, child.wait()).await.is_err() {
            let _ = child.kill().await;
            return None;
        }
        Some(sent.elapsed())
    }

    /// Restarts the slot if its generation exited while wanted; records the exit.
    pub async fn supervise(&self) {
        let mut inner = self.inner.lock().await;
        if !inner.wanted {
            return;
        }
        let status: Option<ExitStatus> = match inner.child.as_mut() {
            Some(child) => child.try_wait().ok().flatten(),
            None => None,
        };
        let Some(status) = status else {
            if inner.child.is_some() {
                return;
            }
            let _ = self.spawn_locked(&mut inner);
            return;
        };
        let exit = UnexpectedExit {
            name: inner.name.clone(),
            status: status.to_string(),
            at: crate::journal::now_us(),
        };
        inner.exits.push(exit);
        inner.child = None;
        if let Err(e) = self.spawn_locked(&mut inner) {
            eprintln!("cannot restart {}: {e:#}", self.slot);
        }
    }

    /// Every exit nobody asked for.
    pub async fn unexpected_exits(&self) -> Vec<UnexpectedExit> {
        self.inner.lock().await.exits.clone()
    }
}

/// Starts a child that dies with the suite (PDEATHSIG) and whose output goes to its log.
fn spawn(launch: &Launch) -> anyhow::Result<Child> {
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&launch.log)
        .with_context(|| format!("opening {}", launch.log.display()))?;
    let mut command = Command::new(&launch.program);
    command
        .args(&launch.args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true);
    for (key, _) in std::env::vars() {
        if key.starts_with("OUTBOX_") {
            command.env_remove(key);
        }
    }
    command.envs(launch.env.iter().map(|(k, v)| (k, v)));
    // Own process group: a terminal's Ctrl-C reaches only the suite, which tears down.
    command.process_group(0);
    outboxd::embedded::die_with_parent(command.as_std_mut(), Signal::KILL);
    Ok(command.spawn()?)
}
