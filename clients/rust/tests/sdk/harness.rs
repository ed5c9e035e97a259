//! A throwaway PostgreSQL cluster and real outboxd servers on it, shared by every test of
//! this binary (tests stay apart by kind: each makes kinds of its own).
//!
//! PostgreSQL refuses to run as root: as root the cluster is created and started as the
//! `postgres` user (runuser); otherwise as the current user. outboxd runs as the login role
//! `outboxd` (not a superuser: it refuses one) and migrates as the cluster's superuser.
//! The servers come from `OUTBOXD_BIN` (default `<repo>/target/debug/outboxd`, built with
//! cargo when missing). A reaper process, holding a pipe this process never closes, stops
//! the servers and the cluster and removes the directory when this process exits, however
//! it exits.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use outboxd_client::{Connection, IntentState, proto};
use tokio::time::Instant;

/// The repository's root (this crate is `clients/rust`).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Polls `check` every 20 ms until it returns `Some`, or panics after `timeout`.
pub async fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The state of an intent, from GetIntent.
pub async fn state(connection: &Connection, id: &str) -> IntentState {
    intent(connection, id).await.state()
}

/// The intent, from GetIntent.
pub async fn intent(connection: &Connection, id: &str) -> proto::Intent {
    connection
        .get_intent(id)
        .await
        .expect("GetIntent")
        .intent
        .expect("an intent")
}

/// Polls GetIntent until the intent is in `want`; returns it.
pub async fn wait_state(connection: &Connection, id: &str, want: IntentState) -> proto::Intent {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let intent = intent(connection, id).await;
        if intent.state() == want {
            return intent;
        }
        assert!(
            Instant::now() < deadline,
            "intent {id} is {:?} after 30 s, not {want:?} (last error: {})",
            intent.state(),
            intent.last_error
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A free TCP port on 127.0.0.1 (for the cluster; outboxd binds port 0 and logs its own).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The cluster, two outboxd replicas and an admin key.
pub struct Stack {
    pub root: PathBuf,
    pub pg_port: u16,
    pub pg_user: String,
    pub endpoints: Vec<String>,
    pub api_key: String,
    servers: Mutex<Vec<Child>>,
    /// Never waited for: it ends with this process (its stdin closes).
    reaper: Mutex<Child>,
}

/// The stack of this test process, started by the first test that asks.
pub fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(Stack::start)
}

/// A connection to both replicas with the admin key.
pub fn connection() -> Connection {
    connect(&stack().endpoints)
}

/// A connection to `endpoints` with the admin key.
pub fn connect(endpoints: &[String]) -> Connection {
    Connection::builder(endpoints.iter().cloned())
        .api_key(&stack().api_key)
        .connect_timeout(Duration::from_millis(500))
        .build()
        .expect("a connection")
}

/// A kind no other test uses: `<test tag>.<name>`.
pub fn kind(name: &str) -> String {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    format!("t{}.{name}", &tag[..10])
}

fn as_root() -> bool {
    // The effective uid, without libc: /proc/self/status "Uid: real effective …".
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|uid| uid == "0"))
        })
        .unwrap_or(false)
}

fn pg_bindir() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return bin;
    }
    let found = Command::new("sh")
        .args(["-c", "command -v initdb"])
        .output()
        .expect("sh");
    let path = String::from_utf8_lossy(&found.stdout).trim().to_owned();
    assert!(
        !path.is_empty(),
        "PostgreSQL server binaries not found (apt-get install postgresql)"
    );
    Path::new(&path).parent().unwrap().to_path_buf()
}

fn outboxd_bin() -> PathBuf {
    if let Ok(path) = std::env::var("OUTBOXD_BIN") {
        return PathBuf::from(path);
    }
    let path = repo().join("target/debug/outboxd");
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--bin", "outboxd"])
            .current_dir(repo())
            .status()
            .expect("cargo build --bin outboxd");
        assert!(status.success(), "cargo build --bin outboxd failed");
    }
    path
}

impl Stack {
    fn start() -> Self {
        let as_root = as_root();
        let pg_user = if as_root {
            "postgres".to_owned()
        } else {
            std::env::var("USER").unwrap_or_else(|_| "postgres".into())
        };
        let root = std::env::temp_dir().join(format!(
            "outboxd-rust-sdk-{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        ));
        std::fs::create_dir_all(&root).expect("work dir");
        let bindir = pg_bindir();
        let data = root.join("pgdata");
        let pg = |program: &str| {
            let mut command = if as_root {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(bindir.join(program));
                c
            } else {
                Command::new(bindir.join(program))
            };
            command.current_dir("/");
            command
        };
        if as_root {
            let status = Command::new("chown")
                .args(["postgres"])
                .arg(&root)
                .status()
                .expect("chown");
            assert!(status.success(), "chown postgres {}", root.display());
        }

        // The reaper first, so nothing started below outlives this process.
        let keep = std::env::var_os("KEEP_WORK").is_some();
        let stop_pg = format!(
            "{}{} stop -D '{}' -m immediate -w",
            if as_root {
                "runuser -u postgres -- "
            } else {
                ""
            },
            bindir.join("pg_ctl").display(),
            data.display()
        );
        let script = format!(
            "read _; for pid in $(cat '{pids}' 2>/dev/null); do kill -9 \"$pid\" 2>/dev/null; done; \
             {stop_pg} >/dev/null 2>&1; {remove}",
            pids = root.join("pids").display(),
            remove = if keep {
                String::new()
            } else {
                format!("rm -rf '{}'", root.display())
            },
        );
        let reaper = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the reaper");

        let run = |mut command: Command, what: &str| {
            let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(
                out.status.success(),
                "{what} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let mut initdb = pg("initdb");
        initdb.arg("-D").arg(&data).args([
            "-U",
            &pg_user,
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]);
        run(initdb, "initdb");
        let pg_port = free_port();
        let mut start = pg("pg_ctl");
        start
            .args(["start", "-w", "-t", "60", "-D"])
            .arg(&data)
            .arg("-l")
            .arg(root.join("postgres.log"))
            .arg("-o")
            .arg(format!(
                // track_commit_timestamp: commit times order an ordering key's intents.
                "-p {pg_port} -c listen_addresses=127.0.0.1 -k {} -c fsync=off \
                 -c full_page_writes=off -c max_connections=300 -c track_commit_timestamp=on",
                root.display()
            ));
        run(start, "pg_ctl start");

        let mut stack = Self {
            root,
            pg_port,
            pg_user,
            endpoints: Vec::new(),
            api_key: String::new(),
            servers: Mutex::new(Vec::new()),
            reaper: Mutex::new(reaper),
        };
        for sql in [
            "CREATE ROLE outboxd LOGIN",
            // Work across tenants runs as a member of outboxd_fleet (the migrations
            // creates it and grants it to the login of OUTBOX_DATABASE__FLEET_URL).
            "CREATE ROLE outboxd_fleet_login LOGIN",
            "CREATE DATABASE app",
            "CREATE DATABASE shop",
        ] {
            let mut psql = pg("psql");
            psql.args([
                "-h",
                "127.0.0.1",
                "-p",
                &pg_port.to_string(),
                "-U",
                &stack.pg_user,
            ])
            .args(["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c", sql]);
            run(psql, sql);
        }
        // The first replica migrates; the second starts on the migrated schema.
        let a = stack.start_server("outboxd-a", &[]).0;
        let b = stack.start_server("outboxd-b", &[]).0;
        stack.endpoints = vec![a, b];
        stack.api_key = stack.create_key("sdk-tests", &["admin"]);
        stack
    }

    /// A superuser URL of a database of the cluster.
    pub fn url(&self, db: &str) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{db}",
            self.pg_user, self.pg_port
        )
    }

    fn env(&self) -> Vec<(String, String)> {
        let url =
            |db: &str, user: &str| format!("postgres://{user}@127.0.0.1:{}/{db}", self.pg_port);
        vec![
            ("NO_COLOR".into(), "1".into()),
            ("OUTBOX_LOG__FORMAT".into(), "json".into()),
            ("OUTBOX_DATABASE__URL".into(), url("app", "outboxd")),
            (
                "OUTBOX_DATABASE__FLEET_URL".into(),
                url("app", "outboxd_fleet_login"),
            ),
            (
                "OUTBOX_DATABASE__MIGRATION_URL".into(),
                url("app", &self.pg_user),
            ),
            ("OUTBOX_METRICS__LISTEN_ADDR".into(), String::new()),
            ("OUTBOX_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
        ]
    }

    fn command(&self, env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(outboxd_bin());
        for (key, _) in std::env::vars() {
            if key.starts_with("OUTBOX_") {
                command.env_remove(key);
            }
        }
        command.envs(self.env());
        command.envs(env.iter().map(|(k, v)| (*k, *v)));
        command
    }

    /// Starts one more outboxd on the cluster (`env` added to its environment); returns
    /// its address and pid. It is killed with the others when the tests end.
    pub fn start_server(&self, name: &str, env: &[(&str, &str)]) -> (String, u32) {
        let log_path = self.root.join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).expect("server log");
        let mut child = self
            .command(env)
            .arg("serve")
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("outboxd serve");
        let pid = child.id();
        let mut pids = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join("pids"))
            .expect("pids file");
        writeln!(pids, "{pid}").expect("pids file");
        let started = std::time::Instant::now();
        let addr = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                panic!(
                    "outboxd {name} exited ({status}): {}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
            let file = std::fs::File::open(&log_path).expect("server log");
            let found = BufReader::new(file)
                .lines()
                .map_while(Result::ok)
                .filter(|line| line.contains("outboxd serving gRPC"))
                .find_map(|line| listen_addr(&line));
            if let Some(addr) = found {
                break addr;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "outboxd {name} not serving after 120 s: {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        self.servers.lock().unwrap().push(child);
        (addr, pid)
    }

    /// SIGKILLs the server with this pid.
    pub fn kill_server(&self, pid: u32) {
        let mut servers = self.servers.lock().unwrap();
        if let Some(child) = servers.iter_mut().find(|c| c.id() == pid) {
            child.kill().expect("kill");
            child.wait().expect("wait");
        }
    }

    /// `outboxd keys create` for the default tenant; returns the secret.
    pub fn create_key(&self, name: &str, scopes: &[&str]) -> String {
        let mut command = self.command(&[]);
        command.args(["keys", "create", "--name", name, "--tenant", "default"]);
        for scope in scopes {
            command.args(["--scope", scope]);
        }
        let out = command.output().expect("outboxd keys create");
        assert!(
            out.status.success(),
            "keys create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .expect("a key")
            .trim()
            .to_owned()
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // Statics are not dropped; kept for a Stack made by hand. The reaper does the rest.
        if let Ok(mut reaper) = self.reaper.lock() {
            drop(reaper.stdin.take());
            let _ = reaper.wait();
        }
    }
}

/// `listen.addr` of the JSON log line (`"listen.addr":"127.0.0.1:43210"`).
fn listen_addr(line: &str) -> Option<String> {
    let start = line.find("\"listen.addr\":\"")? + "\"listen.addr\":\"".len();
    let end = line[start..].find('"')?;
    Some(line[start..start + end].to_owned())
}
