//! Making commits that did not wait for their WAL flush durable before they are answered.
//! A limited queue's claim commits so (migration `…17`): its queue's claims take turns on
//! the policy row, and a flush inside the turn made each wait for the last one's disk.
//! Then one commit that does wait, and writes WAL so that it cannot skip the wait, flushes
//! every commit record before its own (and waits for a synchronous standby, if any): the
//! claims that committed while one such flush was on its way share the next.

use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::PgPool;
use tokio::sync::Mutex;

use super::access::on_live_connection;

/// A commit that waits for its flush: a transactional message gives it WAL to flush.
const FLUSHING_COMMIT: &str = "SELECT pg_logical_emit_message(true, 'outboxd', '')";

/// Coalesces the flushes of one server.
#[derive(Debug, Default)]
pub struct Flusher {
    /// Tickets handed out, one per commit to make durable, after that commit.
    issued: AtomicU64,
    /// The highest ticket a flushing commit is known to cover.
    covered: Mutex<u64>,
}

impl Flusher {
    /// Returns once every commit this connection pool's sessions made before the call is
    /// flushed.
    ///
    /// # Errors
    /// The flushing commit failed: whether the earlier commits are durable is not known.
    pub async fn flush(&self, pool: &PgPool) -> sqlx::Result<()> {
        let ticket = self.issued.fetch_add(1, Ordering::SeqCst) + 1;
        let mut covered = self.covered.lock().await;
        if *covered >= ticket {
            return Ok(());
        }
        // Every ticket handed out so far belongs to a commit made before this one starts.
        let covers = self.issued.load(Ordering::SeqCst);
        on_live_connection(pool, || sqlx::query(FLUSHING_COMMIT).execute(pool)).await?;
        *covered = (*covered).max(covers);
        Ok(())
    }
}
