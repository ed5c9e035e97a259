//! Background sweeps: rescue of expired leases (and their claims' replay records) and
//! purge of finished history. They take their rows with `SKIP LOCKED`, so any number of
//! replicas may run them at once.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::{PENDING_CHANNEL, millis};
use crate::outbox::{IntentState, Result};

/// Exponential backoff between delivery attempts, with jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackoffParams {
    /// Delay after the first attempt; doubles with each further attempt.
    #[serde(with = "humantime_serde")]
    pub base: Duration,
    /// Longest delay.
    #[serde(with = "humantime_serde")]
    pub cap: Duration,
}

impl Default for BackoffParams {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(300),
        }
    }
}

/// Rescues up to `limit` leases that expired before now, across tenants: a LEASED intent
/// goes back to PENDING after the backoff (or DEAD_LETTERED when attempts are used up); a
/// SUBMITTED one goes to NEEDS_RECONCILE, never to a blind retry. Returns the new state of
/// every rescued intent.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn rescue_expired_leases(
    db: impl PgExecutor<'_>,
    backoff: BackoffParams,
    limit: i64,
    now: Option<DateTime<Utc>>,
) -> Result<Vec<IntentState>> {
    let states: Vec<(IntentState,)> = sqlx::query_as(
        r#"
        WITH expired AS (
            SELECT id
            FROM outbox.intent
            WHERE state IN ('leased', 'submitted')
              -- A subquery, not a bare coalesce(…): only then can it bound the index scan
              -- under row-level security (migration …02_baseline_functions says why).
              AND lease_expires_at < (SELECT coalesce($4::timestamptz, now()))
            ORDER BY lease_expires_at
            LIMIT $3
            FOR UPDATE SKIP LOCKED
        ),
        rescued AS (
            UPDATE outbox.intent i
            SET state = CASE
                    WHEN i.state = 'submitted' THEN 'needs_reconcile'
                    WHEN i.attempts >= i.max_attempts THEN 'dead_lettered'
                    ELSE 'pending'
                END::outbox.intent_state,
                -- The holder of a SUBMITTED lease may still learn and report the outcome;
                -- a LEASED holder never started, so its lease is void.
                lease_id = CASE WHEN i.state = 'submitted' THEN i.lease_id END,
                available_at = coalesce($4::timestamptz, now())
                    + least($2, $1 * power(2, least(greatest(i.attempts - 1, 0), 40)))
                        * (0.5 + random() / 2) * interval '1 ms',
                lease_expires_at = NULL,
                claim_request_id = NULL,
                last_error = CASE
                    WHEN i.state = 'submitted'
                        THEN 'lease expired after the external call started'
                    ELSE 'lease expired before the external call started'
                END,
                updated_at = coalesce($4::timestamptz, now())
            FROM expired
            WHERE i.id = expired.id
            RETURNING i.state
        ),
        -- Claimers long-polling right now may take the rescued intents once due.
        woken AS (
            SELECT pg_notify($5, '')
            WHERE EXISTS (SELECT 1 FROM rescued WHERE state = 'pending')
        )
        SELECT state FROM rescued, (SELECT count(*) FROM woken) AS w
        "#,
    )
    .bind(millis(backoff.base) as f64)
    .bind(millis(backoff.cap) as f64)
    .bind(limit)
    .bind(now)
    .bind(PENDING_CHANNEL)
    .fetch_all(db)
    .await?;
    Ok(states.into_iter().map(|(s,)| s).collect())
}

/// Deletes up to `limit` replay records of claims (`outbox.claim_request`) whose lease
/// duration has passed; a retry of such a claim leases anew. Returns how many it deleted.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn forget_claim_requests(
    db: impl PgExecutor<'_>,
    limit: i64,
    now: Option<DateTime<Utc>>,
) -> Result<u64> {
    let done = sqlx::query(
        r#"
        DELETE FROM outbox.claim_request
        WHERE digest IN (
            SELECT digest
            FROM outbox.claim_request
            WHERE expires_at < (SELECT coalesce($2::timestamptz, now()))
            ORDER BY expires_at
            LIMIT $1
            FOR UPDATE SKIP LOCKED
        )
        "#,
    )
    .bind(limit)
    .bind(now)
    .execute(db)
    .await?;
    Ok(done.rows_affected())
}

/// Deletes up to `limit` DELIVERED, DISCARDED and CANCELLED intents (and as many ordered
/// dead letters given up by an operator) that finished before
/// `now - live_retention` from `outbox.intent`, and up to `limit` rows of
/// `outbox.delivered_batch` (where Ack moves delivered intents without an idempotency key)
/// that finished before `now - history_retention`.
/// Returns how many intents it deleted in all.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn purge_finished_intents(
    db: impl PgExecutor<'_>,
    live_retention: Duration,
    history_retention: Duration,
    limit: i64,
    now: Option<DateTime<Utc>>,
) -> Result<u64> {
    let (done,): (i64,) = sqlx::query_as(
        r#"
        WITH hot AS (
            DELETE FROM outbox.intent
            WHERE id IN (
                SELECT id
                FROM outbox.intent
                WHERE state IN ('delivered', 'discarded', 'cancelled')
                  -- A subquery: see rescue_expired_leases.
                  AND finished_at < (SELECT coalesce($3::timestamptz, now()) - $1 * interval '1 ms')
                ORDER BY finished_at
                LIMIT $2
                FOR UPDATE SKIP LOCKED
            )
            RETURNING 1
        ),
        -- Ordered dead letters an operator gave up (DEAD): finished, like the others.
        given_up AS (
            DELETE FROM outbox.intent
            WHERE id IN (
                SELECT id
                FROM outbox.intent
                WHERE state = 'dead_lettered'
                  AND ordering_key IS NOT NULL
                  AND finished_at < (SELECT coalesce($3::timestamptz, now()) - $1 * interval '1 ms')
                ORDER BY finished_at
                LIMIT $2
                FOR UPDATE SKIP LOCKED
            )
            RETURNING 1
        ),
        -- Whole rows of the batch history (each an Ack's intents of one bucket, finished
        -- together): up to $2 rows, counted by their intents.
        batches AS (
            DELETE FROM outbox.delivered_batch
            WHERE id IN (
                SELECT id
                FROM outbox.delivered_batch
                WHERE finished_at < (SELECT coalesce($3::timestamptz, now()) - $4 * interval '1 ms')
                ORDER BY finished_at
                LIMIT $2
                FOR UPDATE SKIP LOCKED
            )
            RETURNING cardinality(ids) AS intents
        )
        SELECT (SELECT count(*) FROM hot) + (SELECT count(*) FROM given_up)
            + (SELECT coalesce(sum(intents), 0) FROM batches)::bigint
        "#,
    )
    .bind(millis(live_retention))
    .bind(limit)
    .bind(now)
    .bind(millis(history_retention))
    .fetch_one(db)
    .await?;
    Ok(done as u64)
}
