//! outboxd in a child process, so that its CPU is its own and not the load generator's:
//! the bench binary re-runs itself with the hidden `serve-child` subcommand, which serves
//! exactly as `outboxd serve` does (same `Application`, production runtime) on a free port,
//! prints that port (and the console's, when `OUTBOX_CONSOLE__LISTEN_ADDR` asks for one),
//! and stops gracefully when its stdin closes.

use std::io::Read;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use outboxd::config::Settings;
use outboxd::startup::{self, Application, Runtime};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::meter;

#[derive(Debug, Args)]
pub struct ServeChildArgs {
    /// URL of the service role on the (migrated) outbox database.
    #[arg(long, value_name = "URL")]
    pub service_url: String,
    /// URL of the fleet role (a member of outboxd_fleet) on that database.
    #[arg(long, value_name = "URL")]
    pub fleet_url: String,
}

/// The child's side: serve until stdin reaches end of file.
pub async fn serve_child(args: &ServeChildArgs, settings: Settings) -> anyhow::Result<()> {
    let pools = startup::connect_pools(
        &startup::Database {
            service_url: args.service_url.clone(),
            fleet_url: Some(args.fleet_url.clone()),
            embedded: None,
        },
        settings.database.max_connections,
    )
    .await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let mut settings = settings;
    settings.metrics.listen_addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let server = Application::start(&settings, pools.clone(), listener, Runtime::default()).await?;
    match server.console_addr() {
        Some(console) => println!("listening {} console {console}", server.local_addr()),
        None => println!("listening {}", server.local_addr()),
    }
    tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        std::io::stdin().read_to_end(&mut sink)
    })
    .await??;
    server.stop().await?;
    pools.close().await;
    Ok(())
}

/// The parent's handle on a serving child.
pub struct ServerProcess {
    child: Child,
    pid: u32,
    pub endpoint: String,
    /// The console's base URL, when `env` set `OUTBOX_CONSOLE__LISTEN_ADDR`
    /// (`127.0.0.1:0`: a free port).
    pub console: Option<String>,
}

impl ServerProcess {
    /// Serves on `service_url` (and `fleet_url` for work across tenants) with the settings of this process's environment, plus
    /// `env` (`OUTBOX_…` variables, as `outboxd serve` reads them).
    pub async fn spawn(
        service_url: &str,
        fleet_url: &str,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("cannot find the bench binary")?;
        let mut child = Command::new(exe)
            .args(["serve-child", "--service-url", service_url])
            .args(["--fleet-url", fleet_url])
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start the outboxd child process")?;
        let pid = child.id().context("child exited at once")?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .context("outboxd child did not start within 60 s")??;
        let Some(addr) = line.as_deref().and_then(|l| l.strip_prefix("listening ")) else {
            bail!("outboxd child said {line:?} instead of its address");
        };
        let (addr, console) = match addr.split_once(" console ") {
            Some((addr, console)) => (addr, Some(format!("http://{console}"))),
            None => (addr, None),
        };
        Ok(Self {
            endpoint: format!("http://{addr}"),
            console,
            child,
            pid,
        })
    }

    /// CPU seconds the server has used so far.
    pub fn cpu(&self) -> Option<f64> {
        meter::process_cpu(self.pid)
    }

    /// Graceful stop: close stdin, wait for the child to drain and exit.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        drop(self.child.stdin.take());
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .context("outboxd child did not stop within 60 s")??;
        anyhow::ensure!(status.success(), "outboxd child exited with {status}");
        Ok(())
    }
}
