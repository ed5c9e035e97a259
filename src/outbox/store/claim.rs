//! Claim: lease a batch of claimable intents in one statement with `FOR UPDATE SKIP LOCKED`,
//! in one round trip; and give back leases that no claimer received.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{Row, ValueRef};
use uuid::Uuid;

use super::access::{Pools, TenantScope, begin, on_live_connection};
use super::flush::{Unflushed, flush};
use super::{INTENT_COLUMNS, intent_at, millis};
use crate::outbox::{Intent, IntentId, LeaseId, Result};

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
    /// The API key claiming: a replay finds only the leases of a claim of the same key
    /// (as well as the same worker id and request id).
    pub key_id: Uuid,
    /// Current time override (tests).
    pub now: Option<DateTime<Utc>>,
    /// In each of these levels, lease only intents available at or after its instant
    /// (a level not listed: all of it); see [`crate::outbox::claim::floor`].
    pub floors: &'a [(QueueLevel, DateTime<Utc>)],
    /// Stop leasing once the intents leased weigh this many bytes (`outbox.reply_weight`,
    /// always at least one intent): the reply's budget, so that intents that would not
    /// be sent are not read.
    pub max_bytes: usize,
}

/// A queue's intents of one priority: a claim takes each level oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct QueueLevel {
    /// The queue's tenant.
    pub tenant: String,
    /// The queue's kind.
    pub kind: String,
    /// The level's priority.
    pub priority: i16,
}

/// One look of a claim: `outbox.claim`, then `outbox.next_due_in` when it ran out.
const CLAIM: &str = include_str!("sql/claim.sql");

/// The claim function's call in `CLAIM` (`$1` tenants, `$2` their proof, `$3` worker,
/// `$4` region, `$5` kinds, `$6` most intents, `$7` lease milliseconds, `$8` request id,
/// `$9` now (or NULL), `$10`-`$13` the levels' floors (tenants, kinds, priorities,
/// instants), `$14` the byte budget), for the benchmark's raw-SQL ceiling: the same call,
/// no service. A test checks that `CLAIM` makes it.
pub const CLAIM_CALL: &str =
    "outbox.claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)";

/// What one look of a claim found.
#[derive(Debug)]
pub struct Claimed {
    /// The leased intents, highest priority first, then oldest `available_at`.
    pub intents: Vec<Intent>,
    /// When it leased fewer than asked: how long until the next PENDING intent matching
    /// the filters becomes due, if one is scheduled in the future, so that a long-polling
    /// claimer (or the next of its group, [`crate::outbox::claim::drained`]) sleeps exactly that
    /// long.
    pub next_due_in: Option<Duration>,
    /// The intents are the live leases of an earlier call with the same request id (a
    /// replay), not a look at the queue: they tell nothing of what is claimable.
    pub replayed: bool,
    /// It leased fewer intents than asked, within the byte budget: the queue has no more
    /// for it now (a claim cut short by the budget may leave more behind).
    pub ran_out: bool,
    /// Leases queue limits refused it while their queues had due intents.
    pub refused_by_limit: u64,
}

/// Leases up to `max_intents` claimable intents of `scope` (`outbox.claim` walks its
/// queues: a batch shared among tenants and kinds, each highest priority, then oldest first),
/// minting a fresh lease id for each and counting the attempt. With a `request_id` that
/// already leased intents for this worker, returns those live leases instead of leasing
/// more. When it leases fewer than asked, the same statement looks up when the next one is
/// due (the claimer, or the next of its group, may then wait that long without looking).
///
/// One round trip: `outbox.claim` (and `outbox.next_due_in`) run in the statement's own
/// transaction, committed before this returns (the functions, and why they are shaped so:
/// migration `…02_baseline_functions`).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn claim_intents(
    pools: &Pools,
    scope: &TenantScope,
    params: ClaimParams<'_>,
) -> Result<Claimed> {
    let pool = pools.for_scope(scope);
    let settings = pools.scope_settings(scope);
    let floor_tenants: Vec<&str> = params
        .floors
        .iter()
        .map(|(l, _)| l.tenant.as_str())
        .collect();
    let floor_kinds: Vec<&str> = params.floors.iter().map(|(l, _)| l.kind.as_str()).collect();
    let floor_priorities: Vec<i16> = params.floors.iter().map(|(l, _)| l.priority).collect();
    let floor_ats: Vec<DateTime<Utc>> = params.floors.iter().map(|(_, at)| *at).collect();
    // Run again when the connection turns out dead. Had the lost call run after all, its
    // leases, never handed to anyone, expire back to PENDING like a crashed worker's (as
    // when the reply to a COMMIT is lost), and a retry with the same request id gets them.
    // The connection is kept for the flush (store::flush): it outlives no crash.
    let (rows, mut conn) = on_live_connection(pool, || async {
        let mut conn = pools.acquire(scope).await?;
        let rows: Vec<PgRow> = sqlx::query(CLAIM)
            .bind(&settings.tenants)
            .bind(&settings.proof)
            .bind(params.worker_id)
            .bind(params.region)
            .bind(params.kinds)
            .bind(params.max_intents)
            .bind(millis(params.lease_duration))
            .bind(params.request_id.map(|r| format!("{}/{r}", params.key_id)))
            .bind(params.now)
            .bind(&floor_tenants)
            .bind(&floor_kinds)
            .bind(&floor_priorities)
            .bind(&floor_ats)
            .bind(i64::try_from(params.max_bytes).unwrap_or(i64::MAX))
            .fetch_all(&mut *conn)
            .await?;
        Ok((rows, conn))
    })
    .await?;
    let mut claimed = Claimed {
        intents: Vec::with_capacity(rows.len()),
        next_due_in: None,
        replayed: false,
        ran_out: false,
        refused_by_limit: 0,
    };
    // After the intent's columns: next_due_in, replayed, ran_out, refused_by_limit,
    // unflushed, incarnation, backend, began.
    let (next_due_in, replayed, ran_out, refused) = (
        INTENT_COLUMNS,
        INTENT_COLUMNS + 1,
        INTENT_COLUMNS + 2,
        INTENT_COLUMNS + 3,
    );
    let (unflushed, incarnation, backend, began) = (
        INTENT_COLUMNS + 4,
        INTENT_COLUMNS + 5,
        INTENT_COLUMNS + 6,
        INTENT_COLUMNS + 7,
    );
    if let Some(row) = rows.first() {
        let leased = !row.try_get_raw(0)?.is_null();
        // A limited queue's claim committed without waiting for its flush (`outbox.queue_allowance`,
        // migration …02_baseline_functions), and a replay may read such a claim's leases before that flush: no lease is
        // answered before it is durable.
        if leased && (row.try_get(unflushed)? || row.try_get(replayed)?) {
            let commit = Unflushed {
                incarnation: row.try_get(incarnation)?,
                backend: row.try_get(backend)?,
                began: row.try_get(began)?,
            };
            flush(&mut conn, commit).await?;
        }
        drop(conn);
        if let Some(seconds) = row.try_get::<Option<f64>, _>(next_due_in)? {
            // Beyond what a Duration holds: as good as never (the recheck comes first).
            claimed.next_due_in =
                Some(Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX));
        }
        claimed.ran_out = row.try_get(ran_out)?;
        claimed.refused_by_limit = u64::try_from(row.try_get::<i32, _>(refused)?).unwrap_or(0);
    }
    for (n, row) in rows.iter().enumerate() {
        // A single row of NULLs when nothing was leased.
        if row.try_get_raw(0)?.is_null() {
            break;
        }
        if n == 0 {
            claimed.replayed = row.try_get(replayed)?;
        }
        claimed.intents.push(intent_at(row, n == 0)?);
    }
    claimed.intents.sort_by_key(Intent::claim_order);
    Ok(claimed)
}

/// Gives back leases no claimer received (`crate::outbox::claim::handoff`): each intent of
/// `scope` still LEASED under its `leases` pair goes back to PENDING, due as it was, with
/// the attempt uncounted (no worker saw it, so none began). A pair whose intent moved on,
/// or whose insert never committed, is skipped. Returns how many went back.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn release_leases(
    pools: &Pools,
    scope: &TenantScope,
    leases: &[(IntentId, LeaseId)],
    now: Option<DateTime<Utc>>,
) -> Result<u64> {
    let (ids, lease_ids): (Vec<Uuid>, Vec<Uuid>) =
        leases.iter().map(|(id, lease)| (id.0, lease.0)).unzip();
    let mut tx = begin(pools, scope).await?;
    let released = sqlx::query(
        r#"
        UPDATE outbox.intent i
        SET state = 'pending',
            attempts = greatest(i.attempts - 1, 0),
            lease_id = NULL,
            lease_expires_at = NULL,
            worker_id = NULL,
            claim_request_id = NULL,
            updated_at = coalesce($3, now())
        FROM unnest($1::uuid[], $2::uuid[]) AS given (id, lease_id)
        WHERE i.id = given.id
          AND i.lease_id = given.lease_id
          AND i.state = 'leased'
        "#,
    )
    .bind(ids)
    .bind(lease_ids)
    .bind(now)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(released)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_claim_statement_makes_the_call_the_benchmark_makes() {
        assert!(super::CLAIM.contains(super::CLAIM_CALL));
    }
}
