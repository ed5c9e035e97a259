//! What a measured section cost: CPU of the application process (outboxd, pgbench or the
//! Node peer) and of the whole PostgreSQL cluster, commits of the database, WAL written.
//!
//! PostgreSQL CPU is read from /proc: the postmaster and every live child (backends,
//! WAL writer, checkpointer, autovacuum), each with the CPU of its own reaped children, so
//! a backend that exits during the section is still counted (the postmaster reaps it).
//! Write transactions are the transaction ids assigned. Commits come from `pg_stat_database.xact_commit`, which backends publish lazily (up to
//! 10 s after going idle) but always when they exit: a section therefore ends with the
//! application's connections closed ([`Meter::quiesce`]) before the last snapshot.

use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::{Connection, PgConnection};

/// The cost of one measured section; `None` where it could not be measured.
#[derive(Debug, Clone, Default)]
pub struct Cost {
    /// CPU seconds of the application: the outboxd server process, pgbench, or Node.
    pub app_cpu: Option<f64>,
    /// CPU seconds of every PostgreSQL process of the cluster.
    pub pg_cpu: Option<f64>,
    /// Committed transactions in the database, read-only ones included.
    pub commits: Option<f64>,
    /// Transaction ids assigned in the cluster: the transactions that wrote, each of which
    /// flushes WAL at commit (with synchronous_commit on).
    pub writes: Option<f64>,
    /// WAL bytes written by the cluster.
    pub wal_bytes: Option<f64>,
}

/// Database-side counters at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pg_cpu: Option<f64>,
    commits: f64,
    next_xid: f64,
    wal: f64,
}

impl Snapshot {
    /// The cost from `self` to `end`, with the application's CPU measured by the caller.
    pub fn cost_to(&self, end: &Self, app_cpu: Option<f64>) -> Cost {
        Cost {
            app_cpu,
            pg_cpu: self.pg_cpu.zip(end.pg_cpu).map(|(a, b)| b - a),
            commits: Some(end.commits - self.commits),
            writes: Some(end.next_xid - self.next_xid),
            wal_bytes: Some(end.wal - self.wal),
        }
    }
}

/// application_name of the bench's own sessions that stay open through a section (the
/// xmin pin): [`Meter::quiesce`] does not wait for them.
pub const OWN_SESSIONS: &str = "outboxd-bench-pin";

/// Reads the cluster's counters through a superuser URL.
pub struct Meter {
    admin_url: String,
    /// The postmaster's pid, when the cluster runs on this machine and /proc shows it.
    postmaster: Option<i32>,
}

impl Meter {
    pub async fn new(admin_url: &str) -> anyhow::Result<Self> {
        let mut conn = PgConnection::connect(admin_url).await?;
        let data_dir: String = sqlx::query_scalar("SHOW data_directory")
            .fetch_one(&mut conn)
            .await?;
        conn.close().await?;
        // First line of postmaster.pid; unreadable for a remote cluster, which is fine:
        // the PostgreSQL CPU column then says n/a.
        let postmaster = std::fs::read_to_string(format!("{data_dir}/postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()))
            .filter(|pid| stat(*pid).is_some());
        Ok(Self {
            admin_url: admin_url.to_owned(),
            postmaster,
        })
    }

    /// Flushes dirty pages so that every section starts right after a checkpoint: each
    /// then pays the full-page images of its first writes alike, instead of whichever
    /// section a timed checkpoint happens to land in.
    pub async fn checkpoint(&self) -> anyhow::Result<()> {
        let mut conn = PgConnection::connect(&self.admin_url).await?;
        sqlx::query("CHECKPOINT").execute(&mut conn).await?;
        conn.close().await?;
        Ok(())
    }

    /// Waits (up to 10 s) until no session but ours (and [`OWN_SESSIONS`]) is connected to
    /// `database`, so that
    /// every backend that worked there has exited and published its counters.
    pub async fn quiesce(&self, database: &str) -> anyhow::Result<()> {
        let mut conn = PgConnection::connect(&self.admin_url).await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let others: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name <> $2",
            )
            .bind(database)
            .bind(OWN_SESSIONS)
            .fetch_one(&mut conn)
            .await?;
            if others == 0 || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        conn.close().await?;
        Ok(())
    }

    pub async fn snapshot(&self, database: &str) -> anyhow::Result<Snapshot> {
        let mut conn = PgConnection::connect(&self.admin_url).await?;
        // The snapshot's xmax is the next transaction id to be assigned; reading it, unlike
        // pg_current_xact_id(), assigns none.
        let (commits, next_xid, wal): (f64, f64, f64) = sqlx::query_as(
            "SELECT xact_commit::float8, \
                    pg_snapshot_xmax(pg_current_snapshot())::text::float8, \
                    pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 \
             FROM pg_stat_database WHERE datname = $1",
        )
        .bind(database)
        .fetch_one(&mut conn)
        .await
        .with_context(|| format!("pg_stat_database has no row for {database}"))?;
        conn.close().await?;
        Ok(Snapshot {
            pg_cpu: self.postmaster.and_then(cluster_cpu),
            commits,
            next_xid,
            wal,
        })
    }

    /// Checkpoint, then the counters at the start of a section.
    pub async fn begin(&self, database: &str) -> anyhow::Result<Snapshot> {
        self.checkpoint().await?;
        self.snapshot(database).await
    }

    /// The counters at the end of a section whose application has closed its connections.
    pub async fn end(&self, database: &str) -> anyhow::Result<Snapshot> {
        self.quiesce(database).await?;
        self.snapshot(database).await
    }
}

/// Seconds per clock tick of `/proc/<pid>/stat`.
fn tick() -> f64 {
    1.0 / rustix::param::clock_ticks_per_second().max(1) as f64
}

/// (parent pid, own user+system ticks, reaped children's user+system ticks) of `pid`.
fn stat(pid: i32) -> Option<(i32, u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields start after the last ')'.
    let fields: Vec<&str> = s.get(s.rfind(')')? + 2..)?.split_whitespace().collect();
    let n = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    // After the name: state (3), ppid (4), …, utime (14), stime (15), cutime (16), cstime (17).
    let ppid = fields.get(1)?.parse().ok()?;
    Some((ppid, n(11)? + n(12)?, n(13)? + n(14)?))
}

/// CPU seconds used so far by process `pid` itself.
pub fn process_cpu(pid: u32) -> Option<f64> {
    let (_, own, _) = stat(i32::try_from(pid).ok()?)?;
    Some(own as f64 * tick())
}

/// CPU seconds of an exited child not yet reaped: its own and those of the children it
/// reaped (what wait4 reports).
pub fn exited_cpu(pid: u32) -> Option<f64> {
    let (_, own, reaped) = stat(i32::try_from(pid).ok()?)?;
    Some((own + reaped) as f64 * tick())
}

/// CPU seconds used so far by the postmaster, its live children and every child reaped.
fn cluster_cpu(postmaster: i32) -> Option<f64> {
    let (_, own, reaped) = stat(postmaster)?;
    let mut ticks = own + reaped;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some((ppid, own, reaped)) = stat(pid)
            && ppid == postmaster
        {
            ticks += own + reaped;
        }
    }
    Some(ticks as f64 * tick())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_is_readable_and_grows() {
        let pid = std::process::id();
        let before = process_cpu(pid).expect("/proc/self/stat");
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed() < Duration::from_millis(50) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(process_cpu(pid).unwrap() >= before);
    }
}
