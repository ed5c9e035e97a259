//! Ordering keys' SQL: the keys' locks, and the advance of a key to its next intent
//! (migration …02_baseline_functions and docs/ordering.md).

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::outbox::Result;

/// Whether the database records commit times (ordered intents need them); if it does, the
/// keys' locks, held to the end of the transaction (`outbox.lock_ordering_keys`).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn lock_ordering_keys(
    conn: &mut PgConnection,
    tenant_id: &str,
    keys: &[Option<&str>],
) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT outbox.lock_ordering_keys($1, $2)")
            .bind(tenant_id)
            .bind(keys)
            .fetch_one(conn)
            .await?,
    )
}

/// Makes the next WAITING intent of each (tenant, key) PENDING where the key has no head
/// (`outbox.advance_keys`), in the caller's transaction; the intents it made PENDING.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn advance_keys(
    conn: &mut PgConnection,
    keys: &[(&str, &str)],
    now: Option<DateTime<Utc>>,
) -> Result<HashSet<Uuid>> {
    if keys.is_empty() {
        return Ok(HashSet::new());
    }
    let (tenants, keys): (Vec<&str>, Vec<&str>) = keys.iter().copied().unzip();
    let heads: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM outbox.advance_keys($1, $2, $3) AS a(id)")
            .bind(&tenants)
            .bind(&keys)
            .bind(now)
            .fetch_all(conn)
            .await?;
    Ok(heads.into_iter().collect())
}
