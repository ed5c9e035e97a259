//! Forgetting the queue levels (`outbox.queue_level`) that no longer hold a live intent,
//! so that claims stop walking them and a tenant's cap counts the queues in use.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::millis;
use crate::outbox::Result;

/// Notes which levels hold no live intent (`empty_since`: since when, as far as the sweeps
/// saw) and forgets those found so for `grace`, of up to `limit` queues. Returns how many
/// levels it forgot. Runs in the caller's transaction, cross-tenant; does nothing when
/// another replica's sweep holds the turn, and skips a queue whose lock (one of 16 a tenant's
/// queues share) an Enqueue holds.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn forget_empty_queues(
    conn: &mut PgConnection,
    grace: Duration,
    limit: i64,
    now: Option<DateTime<Utc>>,
) -> Result<u64> {
    let turn: bool = sqlx::query_scalar(
        "SELECT pg_try_advisory_xact_lock(hashtextextended('outbox.forget_empty_queues', 0))",
    )
    .fetch_one(&mut *conn)
    .await?;
    if !turn {
        return Ok(0);
    }
    look_for_live_intents(conn, None, now).await?;
    // The queues' locks, without waiting (an Enqueue holding one shared is using a queue of
    // it); then a second look at those queues alone, a statement of its own and so a
    // snapshot taken after the locks, which sees every intent of theirs: any later one's
    // Enqueue probes its level after this commit.
    let locked: Vec<(String, String)> = sqlx::query_as(
        r#"
        SELECT q.tenant_id, q.kind
        FROM (
            SELECT l.tenant_id, l.kind
            FROM outbox.queue_level l
            WHERE l.empty_since < (SELECT coalesce($1::timestamptz, now()) - $2 * interval '1 ms')
            GROUP BY l.tenant_id, l.kind
            ORDER BY min(l.empty_since)
            LIMIT $3
        ) AS q
        WHERE pg_try_advisory_xact_lock(outbox.queue_lock_key(q.tenant_id, q.kind))
        "#,
    )
    .bind(now)
    .bind(millis(grace))
    .bind(limit)
    .fetch_all(&mut *conn)
    .await?;
    if locked.is_empty() {
        return Ok(0);
    }
    let queues: (Vec<String>, Vec<String>) = locked.into_iter().unzip();
    look_for_live_intents(conn, Some(&queues), now).await?;
    let forgotten = sqlx::query(
        r#"
        DELETE FROM outbox.queue_level l
        USING unnest($1::text[], $2::text[]) AS q (tenant_id, kind)
        WHERE l.tenant_id = q.tenant_id AND l.kind = q.kind
          AND l.empty_since < (SELECT coalesce($3::timestamptz, now()) - $4 * interval '1 ms')
        "#,
    )
    .bind(&queues.0)
    .bind(&queues.1)
    .bind(now)
    .bind(millis(grace))
    .execute(&mut *conn)
    .await?;
    Ok(forgotten.rows_affected())
}

/// Notes the levels of `queues` (tenants and kinds; `None`: every queue) without a live
/// intent as empty since now, unless they already are, and those with one as not empty.
async fn look_for_live_intents(
    conn: &mut PgConnection,
    queues: Option<&(Vec<String>, Vec<String>)>,
    now: Option<DateTime<Utc>>,
) -> Result<()> {
    sqlx::query(LOOK_FOR_LIVE_INTENTS)
        .bind(now)
        .bind(queues.map(|q| &q.0))
        .bind(queues.map(|q| &q.1))
        .execute(conn)
        .await?;
    Ok(())
}

/// Sets `empty_since` (to now) of the levels that have no live intent and none set, and
/// clears it on those that have one. Live: PENDING (the claimable index), LEASED or
/// SUBMITTED (the leases' index, read once), STAGED, WAITING, NEEDS_RECONCILE or
/// DEAD_LETTERED (`intent_level_parked_idx`). $1 now (or NULL); $2, $3 the queues' tenants
/// and kinds (NULL: every queue).
const LOOK_FOR_LIVE_INTENTS: &str = r#"
    WITH in_flight AS MATERIALIZED (
        SELECT DISTINCT i.tenant_id, i.kind, i.priority
        FROM outbox.intent i
        WHERE i.state IN ('leased', 'submitted') AND i.lease_expires_at IS NOT NULL
    ),
    looked AS MATERIALIZED (
        SELECT l.tenant_id, l.kind, l.priority,
               EXISTS (
                   SELECT 1 FROM outbox.intent i
                   WHERE i.state = 'pending' AND i.level_key = l.level_key
                     AND i.tenant_id = l.tenant_id AND i.kind = l.kind
                     AND i.priority = l.priority
               )
               OR EXISTS (
                   SELECT 1 FROM outbox.intent i
                   WHERE i.state IN ('staged', 'waiting', 'needs_reconcile', 'dead_lettered')
                     AND i.level_key = l.level_key
                     AND i.tenant_id = l.tenant_id AND i.kind = l.kind
                     AND i.priority = l.priority
               )
               OR EXISTS (
                   SELECT 1 FROM in_flight f
                   WHERE f.tenant_id = l.tenant_id AND f.kind = l.kind
                     AND f.priority = l.priority
               ) AS live
        FROM outbox.queue_level l
        WHERE $2::text[] IS NULL
           OR (l.tenant_id, l.kind) IN (SELECT * FROM unnest($2::text[], $3::text[]))
    )
    UPDATE outbox.queue_level l
    SET empty_since = CASE WHEN k.live THEN NULL ELSE coalesce($1::timestamptz, now()) END
    FROM looked k
    WHERE l.tenant_id = k.tenant_id AND l.kind = k.kind AND l.priority = k.priority
      AND k.live = (l.empty_since IS NOT NULL)
"#;
