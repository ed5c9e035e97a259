//! Forgetting the queue levels (`outbox.queue_level`) that no longer hold a live intent,
//! so that claims stop walking them and a tenant's cap counts the queues in use.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::millis;
use crate::outbox::Result;

/// Notes which levels hold no live intent (`outbox.queue_level_idle`: since when, as far as
/// the sweeps saw) and forgets those found so for `grace`, of up to `limit` queues. Returns
/// how many levels it forgot. Runs in the caller's transaction, cross-tenant; does nothing
/// when another replica's sweep holds the turn, and skips a queue whose lock (one of 16 a
/// tenant's queues share) an Enqueue holds.
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
    // it), the oldest idle first until `limit` are held; then a second look at those queues
    // alone, a statement of its own and so a snapshot taken after the locks, which sees
    // every intent of theirs: any later one's Enqueue probes its level after this commit.
    let locked: Vec<(String, String)> = sqlx::query_as(
        r#"
        SELECT q.tenant_id, q.kind
        FROM (
            SELECT d.tenant_id, d.kind, min(d.since) AS since
            FROM outbox.queue_level_idle d
            WHERE d.since < (SELECT coalesce($1::timestamptz, now()) - $2 * interval '1 ms')
            GROUP BY d.tenant_id, d.kind
            ORDER BY 3
        ) AS q
        WHERE pg_try_advisory_xact_lock(outbox.queue_lock_key(q.tenant_id, q.kind))
        LIMIT $3
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
    let (forgotten,): (i64,) = sqlx::query_as(
        r#"
        WITH idle AS (
            DELETE FROM outbox.queue_level_idle d
            USING unnest($1::text[], $2::text[]) AS q (tenant_id, kind)
            WHERE d.tenant_id = q.tenant_id AND d.kind = q.kind
              AND d.since < (SELECT coalesce($3::timestamptz, now()) - $4 * interval '1 ms')
            RETURNING d.tenant_id, d.kind, d.priority
        ),
        forgotten AS (
            DELETE FROM outbox.queue_level l
            USING idle
            WHERE l.tenant_id = idle.tenant_id AND l.kind = idle.kind
              AND l.priority = idle.priority
            RETURNING 1
        )
        SELECT count(*) FROM forgotten
        "#,
    )
    .bind(&queues.0)
    .bind(&queues.1)
    .bind(now)
    .bind(millis(grace))
    .fetch_one(&mut *conn)
    .await?;
    Ok(forgotten as u64)
}

/// Notes the levels of `queues` (tenants and kinds; `None`: every queue) without a live
/// intent as idle since now, unless they already are, and those with one as not idle.
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

/// Records the levels (of the queues $2, $3: tenants and kinds; NULL: every queue) that
/// have no live intent in `outbox.queue_level_idle`, since now unless already there, and
/// removes those that have one, and those no longer registered. Live: PENDING (the
/// claimable index), LEASED or SUBMITTED (the leases' index, read once), STAGED, WAITING,
/// NEEDS_RECONCILE or DEAD_LETTERED (`intent_level_parked_idx`). $1 now (or NULL).
const LOOK_FOR_LIVE_INTENTS: &str = r#"
    WITH queues AS MATERIALIZED (
        SELECT l.tenant_id, l.kind, l.priority, l.level_key
        FROM outbox.queue_level l
        WHERE $2::text[] IS NULL
           OR (l.tenant_id, l.kind) IN (SELECT * FROM unnest($2::text[], $3::text[]))
    ),
    in_flight AS MATERIALIZED (
        SELECT DISTINCT i.tenant_id, i.kind, i.priority
        FROM outbox.intent i
        WHERE i.state IN ('leased', 'submitted') AND i.lease_expires_at IS NOT NULL
          AND ($2::text[] IS NULL
               OR (i.tenant_id, i.kind) IN (SELECT * FROM unnest($2::text[], $3::text[])))
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
        FROM queues l
    ),
    busy AS (
        DELETE FROM outbox.queue_level_idle d
        WHERE ($2::text[] IS NULL
               OR (d.tenant_id, d.kind) IN (SELECT * FROM unnest($2::text[], $3::text[])))
          AND NOT EXISTS (
              SELECT 1 FROM looked k
              WHERE k.tenant_id = d.tenant_id AND k.kind = d.kind
                AND k.priority = d.priority AND NOT k.live
          )
    )
    INSERT INTO outbox.queue_level_idle (tenant_id, kind, priority, since)
    SELECT k.tenant_id, k.kind, k.priority, coalesce($1::timestamptz, now())
    FROM looked k
    WHERE NOT k.live
    ON CONFLICT DO NOTHING
"#;
