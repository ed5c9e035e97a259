//! Which servers listen on the pending channel: each one's LISTEN connection holds a
//! shared advisory lock, which PostgreSQL releases when that session ends, however it ends
//! (a crash, a kill, a lost network), so the lock table is the list of live listeners.

use sqlx::{PgExecutor, PgPool};

use crate::outbox::Result;

/// The advisory lock key (one bigint) that LISTEN connections hold shared: "outbox" in
/// ASCII, so that `pg_locks` shows it as `classid` 0x6f75, `objid` 0x74626f78.
const LISTENER_LOCK: i64 = 0x6f75_7462_6f78;

/// Takes the listener lock on `conn`'s session (shared) and returns its backend pid,
/// so that [`others_listen`] can leave it out.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn hold_listener_lock(conn: impl PgExecutor<'_>) -> Result<i32> {
    let pid = sqlx::query_scalar(
        "SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock_shared($1)) AS held",
    )
    .bind(LISTENER_LOCK)
    .fetch_one(conn)
    .await?;
    Ok(pid)
}

/// Whether a session other than `own_pid` (this server's listener; 0 for none) holds the
/// listener lock in this database: another server is listening.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn others_listen(pool: &PgPool, own_pid: i32) -> Result<bool> {
    let others = sqlx::query_scalar(
        r#"
        SELECT EXISTS (
            SELECT 1
            FROM pg_locks
            WHERE locktype = 'advisory'
              AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND classid = ($1 >> 32)::oid
              AND objid = ($1 & 4294967295)::oid
              AND objsubid = 1
              AND granted
              AND pid <> $2
        )
        "#,
    )
    .bind(LISTENER_LOCK)
    .bind(own_pid)
    .fetch_one(pool)
    .await?;
    Ok(others)
}
