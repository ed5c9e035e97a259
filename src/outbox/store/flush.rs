//! Making commits that did not wait for their WAL flush durable before they are answered.
//! A limited queue's claim commits so (migration `…17`): its queue's claims take turns on
//! the policy row, and a flush inside the turn made each wait for the last one's disk.
//! Then one commit that does wait, and writes WAL so that it cannot skip the wait, flushes
//! every commit record before its own (and waits for a synchronous standby, if any): the
//! claims that committed while one such flush was on its way share the next.

use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::sync::Mutex;

use super::access::on_live_connection;

/// A commit that waits for its flush (a transactional message gives it WAL to flush), and
/// when the server it ran on started.
const FLUSHING_COMMIT: &str = "SELECT pg_postmaster_start_time() FROM (SELECT pg_logical_emit_message(true, 'outboxd', '')) m";

/// Coalesces the flushes of one server.
#[derive(Debug, Default)]
pub struct Flusher {
    /// Tickets handed out, one per commit to make durable, after that commit.
    issued: AtomicU64,
    /// The last flushing commit: the highest ticket it covers, and its server's start.
    covered: Mutex<(u64, Option<DateTime<Utc>>)>,
}

impl Flusher {
    /// Returns once every commit this connection pool's sessions made before the call, on
    /// the server that started at `incarnation`, is flushed. A flush on a server that
    /// started since (a crash and recovery, a failover) proves nothing about a commit that
    /// did not wait for its flush: such a commit may be lost, and this fails.
    ///
    /// # Errors
    /// The flushing commit failed, or ran on another server than `incarnation`: whether
    /// the earlier commits are durable is not known.
    pub async fn flush(&self, pool: &PgPool, incarnation: DateTime<Utc>) -> sqlx::Result<()> {
        let ticket = self.issued.fetch_add(1, Ordering::SeqCst) + 1;
        let mut covered = self.covered.lock().await;
        if covered.0 >= ticket && covered.1 == Some(incarnation) {
            return Ok(());
        }
        // Every ticket handed out so far belongs to a commit made before this one starts.
        let covers = self.issued.load(Ordering::SeqCst);
        let flushed_on: DateTime<Utc> =
            on_live_connection(pool, || sqlx::query_scalar(FLUSHING_COMMIT).fetch_one(pool))
                .await?;
        *covered = (covered.0.max(covers), Some(flushed_on));
        if flushed_on != incarnation {
            return Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "PostgreSQL restarted or failed over before a commit that did not wait for \
                 its flush was flushed: it may be lost",
            )));
        }
        Ok(())
    }
}
