//! Making commits that did not wait for their WAL flush durable before they are answered.
//! A limited queue's claim commits so (`outbox.queue_allowance`, migration `…02_baseline_functions`): its queue's claims take turns on
//! the policy row, and a flush inside the turn made each wait for the last one's disk.
//! Then one commit that does wait, and writes WAL so that it cannot skip the wait, flushes
//! every commit record before its own (and waits for a synchronous standby, if any);
//! concurrent ones share PostgreSQL's group commit.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

/// A commit that waits for its flush (a transactional message gives it WAL to flush), when
/// the server it ran on started, its backend, and when that backend started.
const FLUSHING_COMMIT: &str = "SELECT pg_postmaster_start_time(), pg_backend_pid(), \
     (SELECT backend_start FROM pg_stat_get_activity(pg_backend_pid())) \
     FROM (SELECT pg_logical_emit_message(true, 'outboxd', '')) m";

/// Gives the transaction WAL of its own, so that its COMMIT waits for the flush (and a
/// synchronous standby) like any that wrote: one that only read, as an Enqueue that only
/// deduplicated, commits at once, and its answer could come before the original's commit,
/// whose own answer was lost, is durable.
pub async fn commit_waits_for_flush(conn: &mut PgConnection) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_logical_emit_message(true, 'outboxd', '')")
        .execute(conn)
        .await?;
    Ok(())
}

/// A commit that did not wait for its flush, as its statement saw the server.
#[derive(Debug, Clone, Copy)]
pub struct Unflushed {
    /// `pg_postmaster_start_time()` of the server it committed on.
    pub incarnation: DateTime<Utc>,
    /// `pg_backend_pid()` of its session.
    pub backend: i32,
    /// `now()` of its statement: the commit came after.
    pub began: DateTime<Utc>,
}

/// Returns once `commit` is flushed, by a flushing commit on `conn`. Proven only by a
/// backend of the same server that was there when `commit` began (its own, or, behind a
/// pooler, one that started before): a backend lives through no restart and no crash of
/// another backend (PostgreSQL then ends every session, and recovers without a new start
/// time), either of which may have lost the commit. Pass the claim's own connection.
///
/// # Errors
/// The flushing commit failed, or the check failed: whether `commit` is durable is not
/// known.
pub async fn flush(conn: &mut PgConnection, commit: Unflushed) -> sqlx::Result<()> {
    let (incarnation, backend, backend_start): (DateTime<Utc>, i32, Option<DateTime<Utc>>) =
        sqlx::query_as(FLUSHING_COMMIT).fetch_one(conn).await?;
    // The same backend needs no clock (one stepped back would fail every comparison).
    let there_before =
        backend == commit.backend || backend_start.is_some_and(|s| s <= commit.began);
    if incarnation != commit.incarnation || !there_before {
        return Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "PostgreSQL restarted, failed over or reinitialized before a commit that did \
             not wait for its flush was flushed: it may be lost",
        )));
    }
    Ok(())
}
