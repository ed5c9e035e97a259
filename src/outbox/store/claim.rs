//! Claim: lease a batch of claimable intents in one statement with `FOR UPDATE SKIP LOCKED`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::{intent_columns, millis};
use crate::outbox::{Intent, Result};

/// Inputs of [`claim_intents`].
#[derive(Debug, Clone, Copy)]
pub struct ClaimParams<'a> {
    /// Worker taking the leases.
    pub worker_id: &'a str,
    /// Worker's region ('' = any): it gets that region's intents and region-less ones.
    pub region: &'a str,
    /// Only these kinds (empty = all).
    pub kinds: &'a [String],
    /// Most intents to lease.
    pub max_intents: i32,
    /// Lease length.
    pub lease_duration: Duration,
    /// Client id of this claim, for replays.
    pub request_id: Option<&'a str>,
    /// Current time override (tests).
    pub now: Option<DateTime<Utc>>,
}

/// Leases up to `max_intents` claimable intents of the transaction's tenants, oldest
/// `available_at` first, minting a fresh lease id for each and counting the attempt. With a
/// `request_id` that already leased intents for this worker, returns those live leases
/// instead of leasing more. Runs in the caller's (tenant-scoped) transaction.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn claim_intents(
    conn: &mut PgConnection,
    params: ClaimParams<'_>,
) -> Result<Vec<Intent>> {
    let mut intents = match params.request_id {
        None => lease_next(conn, &params).await?,
        Some(request_id) => {
            // Serialises retries of one request id so two racing retries cannot both lease;
            // held until the caller's transaction ends.
            sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1 || '/' || $2, 0))")
                .bind(params.worker_id)
                .bind(request_id)
                .execute(&mut *conn)
                .await?;
            let earlier = leases_of_request(conn, &params, request_id).await?;
            if earlier.is_empty() {
                lease_next(conn, &params).await?
            } else {
                earlier
            }
        }
    };
    intents.sort_by_key(|i| (i.available_at, i.id));
    Ok(intents)
}

/// The claim's UPDATE without its RETURNING list: `$1` worker, `$2` region, `$3` kinds,
/// `$4` most intents, `$5` lease milliseconds, `$6` request id, `$7` now (or NULL).
macro_rules! claim_update {
    () => {
        r#"
        UPDATE outbox.intent i
        SET state = 'leased',
            attempts = i.attempts + 1,
            lease_id = gen_random_uuid(),
            lease_expires_at = coalesce($7::timestamptz, now()) + $5 * interval '1 ms',
            worker_id = $1,
            claim_request_id = $6,
            updated_at = coalesce($7::timestamptz, now())
        WHERE i.ctid = ANY (ARRAY(
                SELECT ctid
                FROM outbox.intent
                WHERE state = 'pending'
                  AND available_at <= coalesce($7::timestamptz, now())
                  AND ($2 = '' OR region = '' OR region = $2)
                  AND (cardinality($3::text[]) = 0 OR kind = ANY($3))
                ORDER BY available_at, id
                LIMIT $4
                FOR UPDATE SKIP LOCKED
            ))
        "#
    };
}

/// [`claim_update!`], for the benchmark's raw-SQL ceiling (the same statement, no service).
pub const CLAIM_UPDATE: &str = claim_update!();

/// The claim statement. Its shape keeps one plan good for every batch size and table
/// size, so it can be planned once per connection (see `AlsoAtBegin::GenericPlans`):
/// - the rows to lease are picked in an `ARRAY(…)` subquery, not a CTE joined back: a join
///   is planned for a guessed LIMIT (a tenth of the table), and a merge join over the whole
///   primary key was the generic plan of that shape;
/// - they are found again by `ctid`, a direct tuple fetch instead of a primary-key lookup.
///
/// The transition is guarded by the subquery: `FOR UPDATE` locks only rows that are
/// PENDING (rechecked on the newest version of each), and nobody can change a locked row
/// before this statement's UPDATE. A row whose locked version is newer than the
/// statement's snapshot is not visible at that `ctid` and is left alone. No `state` test is
/// repeated on the outer UPDATE on purpose: it would match the claimable index's
/// predicate, and a generic plan made on a small table walked that whole index per claim.
async fn lease_next(conn: &mut PgConnection, params: &ClaimParams<'_>) -> Result<Vec<Intent>> {
    let intents = sqlx::query_as(concat!(
        claim_update!(),
        " RETURNING ",
        intent_columns!("i")
    ))
    .bind(params.worker_id)
    .bind(params.region)
    .bind(params.kinds)
    .bind(params.max_intents)
    .bind(millis(params.lease_duration))
    .bind(params.request_id)
    .bind(params.now)
    .fetch_all(conn)
    .await?;
    Ok(intents)
}

async fn leases_of_request(
    conn: &mut PgConnection,
    params: &ClaimParams<'_>,
    request_id: &str,
) -> Result<Vec<Intent>> {
    let intents = sqlx::query_as(concat!(
        "SELECT ",
        intent_columns!("i"),
        r#"
        FROM outbox.intent i
        WHERE i.worker_id = $1
          AND i.claim_request_id = $2
          AND i.state IN ('leased', 'submitted')
        "#
    ))
    .bind(params.worker_id)
    .bind(request_id)
    .fetch_all(conn)
    .await?;
    Ok(intents)
}

/// How long until the next PENDING intent matching the claim's filters becomes due, if one
/// is scheduled in the future; lets a long-polling claimer sleep exactly that long.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn next_due_in(
    db: impl sqlx::PgExecutor<'_>,
    params: &ClaimParams<'_>,
) -> Result<Option<Duration>> {
    let seconds: Option<f64> = sqlx::query_scalar(
        r#"
        SELECT extract(epoch FROM available_at - coalesce($3::timestamptz, now()))::float8
        FROM outbox.intent
        WHERE state = 'pending'
          AND available_at > coalesce($3::timestamptz, now())
          AND ($1 = '' OR region = '' OR region = $1)
          AND (cardinality($2::text[]) = 0 OR kind = ANY($2))
        ORDER BY available_at
        LIMIT 1
        "#,
    )
    .bind(params.region)
    .bind(params.kinds)
    .bind(params.now)
    .fetch_optional(db)
    .await?;
    Ok(seconds.map(|s| Duration::from_secs_f64(s.max(0.0))))
}
