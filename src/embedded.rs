//! Embedded PostgreSQL: owns finding the machine's PostgreSQL binaries and running a private
//! cluster as a child process (initdb, start, stop, crash, restart) for `outboxd serve` without a
//! database URL and for the integration-test harness.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, chown};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};
use std::{env, thread};

use rustix::process::{Pid, Signal};

const READY_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(25);
const TAIL_BYTES: u64 = 4096;

/// Why the embedded cluster could not be set up, started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// No candidate directory holds both `initdb` and `postgres`.
    #[error(
        "PostgreSQL server binaries (initdb, postgres) not found; looked in: {searched}. \
         Install them (Debian: `apt-get install postgresql`) or configure the binary directory"
    )]
    BinariesNotFound { searched: String },
    /// Running as root, but there is no `postgres` user to run the server as.
    #[error(
        "running as root but /etc/passwd has no `postgres` user; PostgreSQL refuses to run as \
         root, so create that user (e.g. install the postgresql package) or run as a normal user"
    )]
    NoPostgresUser,
    /// Running as root, and the `postgres` user cannot traverse the path to the data dir.
    #[error(
        "the `postgres` user cannot reach data directory {} because it may not search {}; choose \
         a data directory elsewhere, e.g. set OUTBOX_EMBEDDED__DATA_DIR=/var/lib/outboxd/pgdata \
         or /tmp/outboxd-pgdata", .data_dir.display(), .blocker.display()
    )]
    DataDirUnreachable { data_dir: PathBuf, blocker: PathBuf },
    /// A live postmaster already owns the data dir.
    #[error(
        "data directory {} is in use by running postmaster pid {pid}; stop that server or choose \
         another data directory", .data_dir.display()
    )]
    AlreadyRunning { data_dir: PathBuf, pid: i32 },
    /// `initdb` exited unsuccessfully; `output` is its stdout and stderr.
    #[error("initdb failed ({status}):\n{output}")]
    InitdbFailed { status: ExitStatus, output: String },
    /// `pg_basebackup` exited unsuccessfully; `output` is its stdout and stderr.
    #[error("pg_basebackup failed ({status}):\n{output}")]
    BaseBackupFailed { status: ExitStatus, output: String },
    /// The postmaster exited before it accepted connections; `log` is the log path and tail.
    #[error("postgres exited during startup ({status}); end of {log}")]
    ServerExited { status: ExitStatus, log: String },
    /// The postmaster was not ready within 60 s and has been killed.
    #[error("postgres was not ready on 127.0.0.1:{port} within 60 s (killed it); end of {log}")]
    Timeout { port: u16, log: String },
    /// An operating-system call failed; the cause is the error's `source`, which `{:#}` and
    /// anyhow's chain print (repeating it in the message would show it twice).
    #[error("{context}")]
    Io { context: String, source: io::Error },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> EmbeddedError {
    let context = context.into();
    move |source| EmbeddedError::Io { context, source }
}

/// Where and how to run the embedded cluster.
#[derive(Debug, Clone)]
pub struct EmbeddedConfig {
    /// Cluster data directory; created and initdb'd if empty/missing, reused if it already holds
    /// a cluster.
    pub data_dir: PathBuf,
    /// TCP port on 127.0.0.1; None picks a free port.
    pub port: Option<u16>,
    /// Directory with initdb/postgres; None searches PATH, `pg_config --bindir`, then
    /// /usr/lib/postgresql/*/bin (highest version first).
    pub bin_dir: Option<PathBuf>,
    /// Extra `-c name=value` server settings (e.g. the test harness may pass fsync=off).
    pub settings: Vec<(String, String)>,
}

impl EmbeddedConfig {
    /// A config for `data_dir` with a free port, found binaries and no extra settings.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        let data_dir = data_dir.into();
        Self {
            data_dir,
            port: None,
            bin_dir: None,
            settings: Vec::new(),
        }
    }
}

/// A private PostgreSQL cluster whose postmaster is a child of this process.
///
/// Every run appends the server's stdout and stderr to [`log_path`](Self::log_path),
/// `<data_dir>/log/postgres.log` (`log` is PostgreSQL's own default `log_directory`).
/// The server is stopped on drop, and gets SIGQUIT from the kernel if this process dies.
#[derive(Debug)]
pub struct EmbeddedPostgres {
    data_dir: PathBuf,
    port: u16,
    bin_dir: PathBuf,
    settings: Vec<(String, String)>,
    /// uid/gid of the `postgres` user when we are root, because PostgreSQL refuses to run as root.
    run_as: Option<(u32, u32)>,
    child: Option<Child>,
}

impl EmbeddedPostgres {
    /// Blocking: finds the binaries, runs initdb if the data dir holds no cluster (superuser
    /// `postgres`, trust auth, UTF8, C locale), starts the server and waits until it accepts
    /// connections (up to 60 s).
    pub fn start(config: EmbeddedConfig) -> Result<Self, EmbeddedError> {
        let bin_dir = find_bin_dir(config.bin_dir.as_deref())?;
        let run_as = match rustix::process::geteuid().is_root() {
            true => Some(passwd_ids("postgres").ok_or(EmbeddedError::NoPostgresUser)?),
            false => None,
        };
        let shown = config.data_dir.display().to_string();
        fs::create_dir_all(&config.data_dir).map_err(io_err(format!("creating {shown}")))?;
        // Absolute, because the server runs with the data dir as its working directory.
        let data_dir = fs::canonicalize(&config.data_dir);
        let data_dir = data_dir.map_err(io_err(format!("resolving {shown}")))?;
        if let Some((uid, gid)) = run_as {
            check_reachable(&data_dir, uid, gid)?;
        }
        let port = match config.port {
            Some(port) => port,
            None => free_port().map_err(io_err("picking a free port"))?,
        };
        let settings = config.settings;
        let mut pg = Self {
            data_dir,
            port,
            bin_dir,
            settings,
            run_as,
            child: None,
        };
        if !pg.data_dir.join("PG_VERSION").exists() {
            pg.initdb()?;
        }
        pg.spawn_server()?;
        Ok(pg)
    }

    /// Connection URL for `database` as the `postgres` superuser:
    /// `postgres://postgres@127.0.0.1:{port}/{database}`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// The TCP port on 127.0.0.1 (kept across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The data directory, as an absolute path.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The server log file, `<data_dir>/log/postgres.log`.
    pub fn log_path(&self) -> PathBuf {
        self.data_dir.join("log/postgres.log")
    }

    /// Fast shutdown (SIGINT to the postmaster: abort sessions, checkpoint) and wait for exit;
    /// SIGKILLs the postmaster if it is still alive after 30 s. No-op when stopped.
    pub fn stop(&mut self) -> Result<(), EmbeddedError> {
        self.shutdown(Signal::INT)
    }

    /// Simulates a crash: SIGQUIT to the postmaster (immediate shutdown without a checkpoint,
    /// like `pg_ctl stop -m immediate`) and wait for exit. No-op when stopped.
    pub fn crash(&mut self) -> Result<(), EmbeddedError> {
        self.shutdown(Signal::QUIT)
    }

    /// Starts again on the same data dir and port (stopping first if running); after
    /// [`crash`](Self::crash) this runs crash recovery. Waits until the server accepts connections.
    pub fn restart(&mut self) -> Result<(), EmbeddedError> {
        self.stop()?;
        self.spawn_server()
    }

    fn initdb(&self) -> Result<(), EmbeddedError> {
        let data_dir = self.data_dir.display();
        tracing::info!(%data_dir, "initializing embedded PostgreSQL cluster");
        self.give_to_server(&self.data_dir)?;
        let mut cmd = Command::new(self.bin_dir.join("initdb"));
        // C locale: byte-order collation, independent of the host's locales and glibc version.
        let args = "-U postgres --auth=trust -E UTF8 --locale=C --no-instructions -D".split(' ');
        cmd.args(args).arg(&self.data_dir);
        let out = self.as_server_user(&mut cmd).output();
        let out = out.map_err(io_err("running initdb"))?;
        if out.status.success() {
            return Ok(());
        }
        let output = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        let (status, output) = (out.status, output.trim_end().to_owned());
        Err(EmbeddedError::InitdbFailed { status, output })
    }

    fn as_server_user<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        // The inherited working directory may be unreadable for the `postgres` user.
        cmd.current_dir(&self.data_dir);
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        cmd
    }

    fn give_to_server(&self, path: &Path) -> Result<(), EmbeddedError> {
        let Some((uid, gid)) = self.run_as else {
            return Ok(());
        };
        chown(path, Some(uid), Some(gid)).map_err(io_err(format!("chown {}", path.display())))
    }

    fn spawn_server(&mut self) -> Result<(), EmbeddedError> {
        self.clear_stale_pidfile()?;
        let (log_path, log_dir) = (self.log_path(), self.data_dir.join("log"));
        fs::create_dir_all(&log_dir).map_err(io_err(format!("creating {}", log_dir.display())))?;
        // Append, so the output of earlier runs (e.g. before a crash) is kept.
        let log = OpenOptions::new().create(true).append(true).open(&log_path);
        let log = log.map_err(io_err(format!("opening {}", log_path.display())))?;
        self.give_to_server(&log_dir)?;
        self.give_to_server(&log_path)?;
        let run_start = fs::metadata(&log_path).map_or(0, |meta| meta.len());
        let log_err = log.try_clone().map_err(io_err("dup of log"))?;
        let mut cmd = Command::new(self.bin_dir.join("postgres"));
        let (port, port_arg) = (self.port, self.port.to_string());
        cmd.arg("-D").arg(&self.data_dir).args(["-p", &port_arg]);
        let args = "-h 127.0.0.1 -c unix_socket_directories= -c listen_addresses=127.0.0.1";
        cmd.args(args.split(' '));
        // Ordering keys order intents by their transactions' commit times (docs/ordering.md).
        cmd.args(["-c", "track_commit_timestamp=on"]);
        for (name, value) in &self.settings {
            cmd.arg("-c").arg(format!("{name}={value}"));
        }
        // Own process group: a terminal Ctrl-C reaches only us, and we decide the shutdown order.
        cmd.stdin(Stdio::null()).stdout(log).stderr(log_err);
        self.as_server_user(&mut cmd).process_group(0);
        die_with_parent(&mut cmd, Signal::QUIT);
        let mut child = spawn_on_keeper(cmd).map_err(io_err("spawning postgres"))?;
        let deadline = Instant::now() + READY_TIMEOUT;
        while !self.is_ready(child.id()) {
            if let Some(status) = exit_status(&mut child)? {
                let log = log_excerpt(&log_path, run_start);
                return Err(EmbeddedError::ServerExited { status, log });
            }
            if Instant::now() >= deadline {
                kill_hard(&mut child);
                let log = log_excerpt(&log_path, run_start);
                return Err(EmbeddedError::Timeout { port, log });
            }
            thread::sleep(POLL);
        }
        let (data_dir, pid) = (self.data_dir.display(), child.id());
        tracing::info!(%data_dir, port, pid, "embedded PostgreSQL started");
        self.child = Some(child);
        Ok(())
    }

    /// pg_ctl's own test (PostgreSQL 10+): postmaster.pid names our child and says "ready" once
    /// startup and crash recovery are done ("standby" for a hot standby accepting read-only
    /// sessions). A bare TCP connect would also succeed during recovery (sessions are then
    /// refused) or against another server holding the port ours failed to bind.
    fn is_ready(&self, pid: u32) -> bool {
        let pidfile = fs::read_to_string(self.data_dir.join("postmaster.pid")).unwrap_or_default();
        let lines: Vec<&str> = pidfile.lines().map(str::trim).collect();
        lines.first() == Some(&pid.to_string().as_str())
            && matches!(lines.get(7), Some(&"ready" | &"standby"))
            && TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).is_ok()
    }

    /// Takes a base backup of this running cluster into `data_dir` (created, and owned by
    /// the server's user) set up as its streaming standby (`pg_basebackup -R`), whose
    /// walreceiver names itself `application_name` (what `synchronous_standby_names`
    /// lists); `extra_config` lines are appended to its `postgresql.auto.conf`. Start it
    /// with [`EmbeddedPostgres::start`]. For failover tests: needs `max_wal_senders` > 0
    /// and a `replication` line in `pg_hba.conf` (initdb's defaults have both).
    pub fn base_backup_standby(
        &self,
        data_dir: &Path,
        application_name: &str,
        extra_config: &[String],
    ) -> Result<(), EmbeddedError> {
        let shown = data_dir.display().to_string();
        fs::create_dir_all(data_dir).map_err(io_err(format!("creating {shown}")))?;
        let data_dir = fs::canonicalize(data_dir).map_err(io_err(format!("resolving {shown}")))?;
        self.give_to_server(&data_dir)?;
        // pg_basebackup keeps the mode of a directory that exists; PostgreSQL wants 0700.
        fs::set_permissions(
            &data_dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .map_err(io_err(format!("chmod {shown}")))?;
        // Beside the server binary it runs (PATH may link only initdb and postgres).
        let program = [
            self.bin_dir.clone(),
            fs::canonicalize(self.bin_dir.join("postgres"))
                .ok()
                .and_then(|p| p.parent().map(Path::to_path_buf))
                .unwrap_or_default(),
        ]
        .into_iter()
        .map(|dir| dir.join("pg_basebackup"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("pg_basebackup"));
        let mut cmd = Command::new(program);
        let port = self.port.to_string();
        cmd.arg("-D").arg(&data_dir);
        cmd.args([
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "postgres",
            "-X",
            "stream",
            "-R",
            // A fast checkpoint: the default, spread, one takes minutes.
            "-c",
            "fast",
        ]);
        let out = self.as_server_user(&mut cmd).output();
        let out = out.map_err(io_err("running pg_basebackup"))?;
        if !out.status.success() {
            let output =
                String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
            let (status, output) = (out.status, output.trim_end().to_owned());
            return Err(EmbeddedError::BaseBackupFailed { status, output });
        }
        let conf = data_dir.join("postgresql.auto.conf");
        let mut lines = vec![format!(
            "primary_conninfo = 'host=127.0.0.1 port={port} user=postgres \
             application_name={application_name}'"
        )];
        lines.extend(extra_config.iter().cloned());
        let text = format!("\n{}\n", lines.join("\n"));
        OpenOptions::new()
            .append(true)
            .open(&conf)
            .and_then(|mut file| io::Write::write_all(&mut file, text.as_bytes()))
            .map_err(io_err(format!("appending to {}", conf.display())))
    }

    /// A `postmaster.pid` left by a killed run would otherwise need manual cleanup.
    fn clear_stale_pidfile(&self) -> Result<(), EmbeddedError> {
        let path = self.data_dir.join("postmaster.pid");
        let Ok(text) = fs::read_to_string(&path) else {
            return Ok(());
        };
        // Standalone backends write their pid negated.
        let first_line = text.lines().next().unwrap_or("");
        if let Ok(pid) = first_line.trim().trim_start_matches('-').parse::<i32>()
            && pid > 0
            && postmaster_alive(pid)
        {
            let data_dir = self.data_dir.clone();
            return Err(EmbeddedError::AlreadyRunning { data_dir, pid });
        }
        tracing::info!(path = %path.display(), "removing stale postmaster.pid");
        fs::remove_file(&path).map_err(io_err(format!("removing {}", path.display())))
    }

    fn shutdown(&mut self, signal: Signal) -> Result<(), EmbeddedError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // The pid is our unreaped child, so it cannot have been recycled.
        let _ = rustix::process::kill_process(Pid::from_child(&child), signal);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while exit_status(&mut child)?.is_none() {
            if Instant::now() >= deadline {
                tracing::warn!(pid = child.id(), "postgres ignored shutdown; killing it");
                kill_hard(&mut child);
                break;
            }
            thread::sleep(POLL);
        }
        Ok(())
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn exit_status(child: &mut Child) -> Result<Option<ExitStatus>, EmbeddedError> {
    child.try_wait().map_err(io_err("waiting for postgres"))
}

/// SIGKILLs the postmaster and reaps it. Its backends (each in its own session) notice the
/// postmaster's death through their postmaster-alive pipe and exit by themselves.
fn kill_hard(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Makes the child of `cmd` receive `signal` when this process dies, so that nothing outlives
/// it; the child exits at once if this process died before that took effect.
#[allow(
    unsafe_code,
    reason = "`pre_exec`, the one unsafe call of the project: no safe API sets PR_SET_PDEATHSIG \
              in the child, after std's setuid (which would clear a signal set earlier)"
)]
pub fn die_with_parent(cmd: &mut Command, signal: Signal) {
    let parent = rustix::process::getpid();
    // SAFETY: the closure runs between fork and exec. It makes only raw system calls (prctl,
    // getppid) and builds its error from an errno, without allocating: async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(signal))?;
            // The parent died before prctl: nobody would ever stop this child. The error
            // makes the child exit before exec.
            if rustix::process::getppid() != Some(parent) {
                return Err(rustix::io::Errno::SRCH.into());
            }
            Ok(())
        });
    }
}

/// Spawns `cmd` on a module-owned thread that never exits: PR_SET_PDEATHSIG fires when the
/// *thread* that forked dies, and callers (test threads, spawn_blocking) may be short-lived.
fn spawn_on_keeper(cmd: Command) -> io::Result<Child> {
    type Request = (Command, mpsc::Sender<io::Result<Child>>);
    static KEEPER: Mutex<Option<mpsc::Sender<Request>>> = Mutex::new(None);
    let mut keeper = KEEPER.lock().unwrap_or_else(PoisonError::into_inner);
    if keeper.is_none() {
        let (requests, incoming) = mpsc::channel::<Request>();
        let thread = thread::Builder::new().name("embedded-pg-spawner".into());
        thread.spawn(move || {
            for (mut cmd, reply) in incoming {
                let _ = reply.send(cmd.spawn());
            }
        })?;
        *keeper = Some(requests);
    }
    let (reply, response) = mpsc::channel();
    if let Some(requests) = &*keeper {
        // A failed send drops `reply`, which `recv` below reports.
        let _ = requests.send((cmd, reply));
    }
    drop(keeper);
    response.recv().map_err(io::Error::other)?
}

/// The log path and the last few KiB this run wrote to it, for error messages.
fn log_excerpt(path: &Path, run_start: u64) -> String {
    let len = fs::metadata(path).map_or(0, |meta| meta.len());
    let from = SeekFrom::Start(run_start.max(len.saturating_sub(TAIL_BYTES)));
    let mut tail = Vec::new();
    if let Ok(mut file) = File::open(path)
        && file.seek(from).is_ok()
    {
        let _ = file.read_to_end(&mut tail);
    }
    let tail = String::from_utf8_lossy(&tail);
    format!("{}:\n{}", path.display(), tail.trim_end())
}

/// Someone may take the port before postgres binds it; postgres then exits at once with
/// "Address already in use", which start reports as [`EmbeddedError::ServerExited`].
fn free_port() -> io::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

/// The URL of a cluster already running on `data_dir` (started by another outboxd process),
/// read from its `postmaster.pid`; lets operator commands reach the embedded cluster of a
/// running server instead of trying to start a second one.
pub fn running_url(data_dir: &Path, database: &str) -> Option<String> {
    let pidfile = fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
    let lines: Vec<&str> = pidfile.lines().map(str::trim).collect();
    let pid: i32 = lines.first()?.parse().ok()?;
    let port: u16 = lines.get(3)?.parse().ok()?;
    (pid > 0 && postmaster_alive(pid) && lines.get(7) == Some(&"ready"))
        .then(|| format!("postgres://postgres@127.0.0.1:{port}/{database}"))
}

/// Checking the process name stops a recycled pid (common in containers) passing for a server.
fn postmaster_alive(pid: i32) -> bool {
    // Signal 0 delivers nothing; it only probes for existence (EPERM: someone else's process).
    let probe = match pid {
        1.. => Pid::from_raw(pid).map(rustix::process::test_kill_process),
        _ => None,
    };
    let exists = matches!(probe, Some(Ok(()) | Err(rustix::io::Errno::PERM)));
    let comm = fs::read_to_string(format!("/proc/{pid}/comm"));
    exists && comm.map_or(true, |comm| comm.trim_end() == "postgres")
}

/// Mirrors the kernel's owner/group/other choice; std drops supplementary groups on uid switch.
fn check_reachable(data_dir: &Path, uid: u32, gid: u32) -> Result<(), EmbeddedError> {
    for dir in data_dir.ancestors().skip(1) {
        let meta = fs::metadata(dir).map_err(io_err(format!("inspecting {}", dir.display())))?;
        let search_bit = match (meta.uid() == uid, meta.gid() == gid) {
            (true, _) => 0o100,
            (false, true) => 0o010,
            (false, false) => 0o001,
        };
        if meta.mode() & search_bit == 0 {
            let (data_dir, blocker) = (data_dir.to_path_buf(), dir.to_path_buf());
            return Err(EmbeddedError::DataDirUnreachable { data_dir, blocker });
        }
    }
    Ok(())
}

/// uid and gid of `name` from /etc/passwd (`name:password:uid:gid:...`).
fn passwd_ids(name: &str) -> Option<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        match fields[..] {
            [user, _, uid, gid, ..] if user == name => Some((uid.parse().ok()?, gid.parse().ok()?)),
            _ => None,
        }
    })
}

fn find_bin_dir(explicit: Option<&Path>) -> Result<PathBuf, EmbeddedError> {
    let stages: [fn() -> Vec<PathBuf>; 3] = [path_dirs, pg_config_bindir, versioned_bin_dirs];
    let candidates: Box<dyn Iterator<Item = PathBuf>> = match explicit {
        Some(dir) => Box::new(std::iter::once(dir.to_path_buf())),
        // Lazily, so pg_config only runs when PATH has no server binaries.
        None => Box::new(stages.into_iter().flat_map(|stage| stage())),
    };
    let mut searched = Vec::new();
    for dir in candidates {
        if is_executable(&dir.join("initdb")) && is_executable(&dir.join("postgres")) {
            return Ok(dir);
        }
        searched.push(dir.display().to_string());
    }
    if explicit.is_none() {
        searched.push("/usr/lib/postgresql/*/bin".into());
    }
    let searched = searched.join(", ");
    Err(EmbeddedError::BinariesNotFound { searched })
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
}

fn path_dirs() -> Vec<PathBuf> {
    env::split_paths(&env::var_os("PATH").unwrap_or_default()).collect()
}

fn pg_config_bindir() -> Vec<PathBuf> {
    match Command::new("pg_config").arg("--bindir").output() {
        Ok(out) if out.status.success() => {
            vec![PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())]
        }
        _ => vec![],
    }
}

/// Debian's layout, highest version first.
fn versioned_bin_dirs() -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir("/usr/lib/postgresql") else {
        return vec![];
    };
    let mut dirs: Vec<(Vec<u32>, PathBuf)> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(version) = name.split('.').map(|part| part.parse().ok()).collect() {
            dirs.push((version, entry.path().join("bin")));
        }
    }
    dirs.sort_by(|a, b| b.0.cmp(&a.0));
    dirs.into_iter().map(|(_, dir)| dir).collect()
}
