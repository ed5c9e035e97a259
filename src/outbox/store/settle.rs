//! Lease-fenced transitions: ExtendLease, MarkSubmitted, Ack and Fail. Each is one
//! statement over the whole batch that reports, per item, whether it applied and, if not,
//! whether the intent exists and still carries the presented lease (lost-response replays).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use uuid::Uuid;

use super::{BackoffParams, millis};
use crate::outbox::{
    FailOutcome, Failure, IntentId, IntentState, ItemError, ItemResult, LeaseRef, Result,
};

/// The leases of a batch, in request order: `$1` intent ids, `$2` lease ids.
macro_rules! lease_input {
    () => {
        r#"
        WITH input AS (
            SELECT * FROM unnest($1::uuid[], $2::uuid[]) WITH ORDINALITY AS t(id, lease_id, ord)
        ),
        "#
    };
}

/// The shared tail of every settle statement: joins the input with what the `changed` CTE
/// updated and with the row as it was, in request order.
macro_rules! settle_report {
    () => {
        r#"
        SELECT input.id,
               changed.id IS NOT NULL AS applied,
               coalesce(changed.state, cur.state) AS state,
               coalesce(cur.lease_id = input.lease_id, false) AS lease_matches,
               changed.lease_expires_at,
               changed.traceparent
        FROM input
        LEFT JOIN changed ON changed.id = input.id
        LEFT JOIN outbox.intent cur ON cur.id = input.id
        ORDER BY input.ord
        "#
    };
}

#[derive(sqlx::FromRow)]
struct SettleRow {
    id: Uuid,
    applied: bool,
    state: Option<IntentState>,
    lease_matches: bool,
    lease_expires_at: Option<DateTime<Utc>>,
    traceparent: Option<String>,
}

/// Turns statement rows into per-item results. An item that did not apply is still OK when
/// the intent carries the presented lease and already is where this call would have put it:
/// the caller is replaying a call whose response it lost.
/// `is_replay(i, state)` says whether item `i` finding the intent in `state` is where that
/// item's call would have put it.
fn report(rows: Vec<SettleRow>, is_replay: impl Fn(usize, IntentState) -> bool) -> Vec<ItemResult> {
    rows.into_iter()
        .enumerate()
        .map(|(i, row)| {
            let id = IntentId(row.id);
            let error = match row.state {
                _ if row.applied => None,
                None => Some(ItemError::not_found(id)),
                Some(state) if row.lease_matches && is_replay(i, state) => None,
                Some(state) => Some(ItemError::lease_lost(id, state)),
            };
            ItemResult {
                intent_id: id,
                state: row.state,
                error,
                lease_expires_at: row.lease_expires_at,
                traceparent: row.traceparent,
            }
        })
        .collect()
}

fn split(leases: &[LeaseRef]) -> (Vec<Uuid>, Vec<Uuid>) {
    leases.iter().map(|l| (l.intent_id.0, l.lease_id.0)).unzip()
}

/// Pushes the expiry of live (LEASED or SUBMITTED) leases to `now + lease_duration`.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn extend_leases(
    db: impl PgExecutor<'_>,
    leases: &[LeaseRef],
    lease_duration: Duration,
    now: Option<DateTime<Utc>>,
) -> Result<Vec<ItemResult>> {
    let (ids, lease_ids) = split(leases);
    let rows = sqlx::query_as(concat!(
        lease_input!(),
        r#"
        changed AS (
            UPDATE outbox.intent i
            SET lease_expires_at = coalesce($4::timestamptz, now()) + $3 * interval '1 ms',
                updated_at = coalesce($4::timestamptz, now())
            FROM input
            WHERE i.id = input.id
              AND i.lease_id = input.lease_id
              AND i.state IN ('leased', 'submitted')
            RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent' AS traceparent
        )
        "#,
        settle_report!()
    ))
    .bind(&ids)
    .bind(&lease_ids)
    .bind(millis(lease_duration))
    .bind(now)
    .fetch_all(db)
    .await?;
    Ok(report(rows, |_, _| false))
}

/// Moves LEASED intents to SUBMITTED: from now on a lost outcome needs an operator.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn mark_intents_submitted(
    db: impl PgExecutor<'_>,
    leases: &[LeaseRef],
    now: Option<DateTime<Utc>>,
) -> Result<Vec<ItemResult>> {
    let (ids, lease_ids) = split(leases);
    let rows = sqlx::query_as(concat!(
        lease_input!(),
        r#"
        changed AS (
            UPDATE outbox.intent i
            SET state = 'submitted',
                updated_at = coalesce($3::timestamptz, now())
            FROM input
            WHERE i.id = input.id
              AND i.lease_id = input.lease_id
              AND i.state = 'leased'
            RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent' AS traceparent
        )
        "#,
        settle_report!()
    ))
    .bind(&ids)
    .bind(&lease_ids)
    .bind(now)
    .fetch_all(db)
    .await?;
    Ok(report(rows, |_, s| s == IntentState::Submitted))
}

/// Marks intents DELIVERED. Accepted from the live lease (LEASED, SUBMITTED, even if
/// expired but not yet rescued) and from the last lease of a NEEDS_RECONCILE intent: the
/// worker has learned the outcome, and no other worker was given the intent meanwhile.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn ack_intents(
    db: impl PgExecutor<'_>,
    leases: &[LeaseRef],
    now: Option<DateTime<Utc>>,
) -> Result<Vec<ItemResult>> {
    let (ids, lease_ids) = split(leases);
    let rows = sqlx::query_as(concat!(
        lease_input!(),
        r#"
        changed AS (
            UPDATE outbox.intent i
            SET state = 'delivered',
                lease_expires_at = NULL,
                claim_request_id = NULL,
                finished_at = coalesce($3::timestamptz, now()),
                updated_at = coalesce($3::timestamptz, now())
            FROM input
            WHERE i.id = input.id
              AND i.lease_id = input.lease_id
              AND i.state IN ('leased', 'submitted', 'needs_reconcile')
            RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent' AS traceparent
        )
        "#,
        settle_report!()
    ))
    .bind(&ids)
    .bind(&lease_ids)
    .bind(now)
    .fetch_all(db)
    .await?;
    Ok(report(rows, |_, s| s == IntentState::Delivered))
}

/// Records failures. RETRY → PENDING after the backoff (or `retry_after`), or
/// DEAD_LETTERED when attempts are used up; PERMANENT → DEAD_LETTERED; UNKNOWN →
/// NEEDS_RECONCILE. A definite outcome (RETRY, PERMANENT) is also accepted from the last
/// lease of a NEEDS_RECONCILE intent.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn fail_intents(
    db: impl PgExecutor<'_>,
    failures: &[Failure],
    backoff: BackoffParams,
    now: Option<DateTime<Utc>>,
) -> Result<Vec<ItemResult>> {
    let ids: Vec<Uuid> = failures.iter().map(|f| f.lease.intent_id.0).collect();
    let lease_ids: Vec<Uuid> = failures.iter().map(|f| f.lease.lease_id.0).collect();
    let outcomes: Vec<&str> = failures.iter().map(|f| f.outcome.as_str()).collect();
    let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
    let retry_after: Vec<Option<i64>> =
        failures.iter().map(|f| f.retry_after.map(millis)).collect();
    let rows = sqlx::query_as(concat!(
        r#"
        WITH input AS (
            SELECT *
            FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::bigint[])
                WITH ORDINALITY AS t(id, lease_id, outcome, error, retry_after_ms, ord)
        ),
        changed AS (
            UPDATE outbox.intent i
            SET state = CASE
                    WHEN input.outcome = 'unknown' THEN 'needs_reconcile'
                    WHEN input.outcome = 'permanent' THEN 'dead_lettered'
                    WHEN i.attempts >= i.max_attempts THEN 'dead_lettered'
                    ELSE 'pending'
                END::outbox.intent_state,
                available_at = CASE
                    WHEN input.outcome = 'retry' THEN coalesce($8::timestamptz, now())
                        + coalesce(
                            input.retry_after_ms,
                            least($7, $6 * power(2, least(greatest(i.attempts - 1, 0), 40)))
                                * (0.5 + random() / 2)
                        ) * interval '1 ms'
                    ELSE i.available_at
                END,
                lease_expires_at = NULL,
                claim_request_id = NULL,
                last_error = input.error,
                updated_at = coalesce($8::timestamptz, now())
            FROM input
            WHERE i.id = input.id
              AND i.lease_id = input.lease_id
              AND (i.state IN ('leased', 'submitted')
                   OR (i.state = 'needs_reconcile' AND input.outcome <> 'unknown'))
            RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent' AS traceparent
        )
        "#,
        settle_report!()
    ))
    .bind(&ids)
    .bind(&lease_ids)
    .bind(&outcomes)
    .bind(&errors)
    .bind(&retry_after)
    .bind(millis(backoff.base) as f64)
    .bind(millis(backoff.cap) as f64)
    .bind(now)
    .fetch_all(db)
    .await?;
    // A replay must name the outcome that put the intent where it is: a contradicting
    // report from the same lease (RETRY, then PERMANENT) is refused, not silently ignored.
    Ok(report(rows, |i, s| match failures[i].outcome {
        FailOutcome::Retry => matches!(s, IntentState::Pending | IntentState::DeadLettered),
        FailOutcome::Permanent => s == IntentState::DeadLettered,
        FailOutcome::Unknown => s == IntentState::NeedsReconcile,
    }))
}
