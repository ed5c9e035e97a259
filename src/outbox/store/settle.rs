//! Lease-fenced transitions: ExtendLease, MarkSubmitted, Ack and Fail. Each is one
//! statement over the whole batch that reports, per item, whether it applied; the items
//! that did not are then looked up afresh: does the intent exist, and does it still carry
//! the presented lease (lost-response replays)?

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::Postgres;
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;
use uuid::Uuid;

use super::access::{Pools, ScopeSettings, TenantScope, begin, on_live_connection};
use super::current::{Current, current_intents};
use super::{BackoffParams, millis};
use crate::outbox::{
    FailOutcome, Failure, IntentId, IntentState, ItemError, ItemResult, LeaseRef, Result,
};

/// Whose settle it is: the caller's tenants, and the regions of its API key (empty: any).
#[derive(Debug, Clone, Copy)]
pub struct SettleScope<'a> {
    /// The caller's tenants.
    pub tenants: &'a TenantScope,
    /// The regions of the caller's API key (empty: any).
    pub key_regions: &'a [String],
}

/// One item as the settle statement left it: `state` is set only when it applied.
#[derive(Clone)]
struct SettleRow {
    id: Uuid,
    state: Option<IntentState>,
    lease_expires_at: Option<DateTime<Utc>>,
    traceparent: Option<String>,
}

/// By position, as every settle function returns them (an Ack reads a thousand rows; by
/// name each value would cost a hash lookup of its column).
impl<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> for SettleRow {
    fn from_row(row: &'r sqlx::postgres::PgRow) -> sqlx::Result<Self> {
        use sqlx::Row as _;
        Ok(Self {
            id: row.try_get(0)?,
            state: row.try_get(1)?,
            lease_expires_at: row.try_get(2)?,
            traceparent: row.try_get(3)?,
        })
    }
}

impl SettleRow {
    /// An item that did not apply.
    fn missed(id: Uuid) -> Self {
        Self {
            id,
            state: None,
            lease_expires_at: None,
            traceparent: None,
        }
    }
}

/// The per-item results ([`item_results`]), each intent whose item did not apply read as
/// it is now ([`super::current`]) in a scoped transaction of its own; no round trip when
/// every item applied.
///
/// A replay answers OK from what an earlier call committed, maybe one whose COMMIT lost
/// its answer before it was flushed or reached a synchronous standby: the transaction
/// that read it then ends with a commit that waits for its flush, which covers that one.
async fn results_of(
    pools: &Pools,
    scope: &TenantScope,
    key_regions: &[String],
    leases: &[(Uuid, Uuid)],
    rows: Vec<SettleRow>,
    is_replay: impl Fn(usize, &Current) -> bool,
) -> Result<Vec<ItemResult>> {
    let missed: Vec<Uuid> = rows
        .iter()
        .filter(|r| r.state.is_none())
        .map(|r| r.id)
        .collect();
    if missed.is_empty() {
        return Ok(item_results(leases, rows, &HashMap::new(), is_replay));
    }
    let mut tx = begin(pools, scope).await?;
    let current = current_intents(&mut tx, &missed, key_regions).await?;
    let results = item_results(leases, rows, &current, is_replay);
    if results.iter().any(|r| !r.applied && r.error.is_none()) {
        super::flush::commit_waits_for_flush(&mut tx).await?;
    }
    tx.commit().await?;
    Ok(results)
}

/// Per-item results from the statement's `rows` and, for items that did not apply, the
/// `current` state of their intents. An item that did not apply is still OK when the
/// intent carries the presented lease and already is where this call would have put it:
/// the caller is replaying a call whose response it lost. `is_replay(i, state)` says
/// whether item `i` finding the intent in `state` is where that item's call would have put
/// it.
fn item_results(
    leases: &[(Uuid, Uuid)],
    rows: Vec<SettleRow>,
    current: &HashMap<Uuid, Current>,
    is_replay: impl Fn(usize, &Current) -> bool,
) -> Vec<ItemResult> {
    rows.into_iter()
        .zip(leases)
        .enumerate()
        .map(|(i, (row, &(_, presented)))| {
            let id = IntentId(row.id);
            let mut lease_expires_at = row.lease_expires_at;
            let (state, error) = match (row.state, current.get(&row.id)) {
                (Some(applied), _) => (Some(applied), None),
                (None, None) => (None, Some(ItemError::not_found(id))),
                (None, Some(found)) => {
                    let replay = found.lease_id == Some(presented) && is_replay(i, found);
                    // A replayed MarkSubmitted tells the lease's expiry, as the first did.
                    if replay && found.state.is_live_lease() {
                        lease_expires_at = found.lease_expires_at;
                    }
                    (
                        Some(found.state),
                        (!replay).then(|| ItemError::lease_lost(id, found.state)),
                    )
                }
            };
            ItemResult {
                intent_id: id,
                applied: row.state.is_some(),
                state,
                error,
                lease_expires_at,
                traceparent: row.traceparent,
            }
        })
        .collect()
}

/// (intent id, lease id) of each item, in request order.
fn pairs(leases: impl Iterator<Item = LeaseRef>) -> Vec<(Uuid, Uuid)> {
    leases.map(|l| (l.intent_id.0, l.lease_id.0)).collect()
}

fn split(pairs: &[(Uuid, Uuid)]) -> (Vec<Uuid>, Vec<Uuid>) {
    pairs.iter().copied().unzip()
}

/// Pushes the expiry of live (LEASED or SUBMITTED) leases to `now + lease_duration`.
///
/// One round trip: `outbox.extend_leases` (migration `…02_baseline_functions`, as every
/// settle function) runs in its own transaction, committed before this returns; only items
/// that did not apply cost another.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn extend_leases(
    pools: &Pools,
    scope: SettleScope<'_>,
    leases: &[LeaseRef],
    lease_duration: Duration,
    now: Option<DateTime<Utc>>,
) -> Result<Vec<ItemResult>> {
    let lease_ms = millis(lease_duration);
    settle_in_one_call(
        pools,
        scope,
        leases,
        "SELECT * FROM outbox.extend_leases($1, $2, $3, $4, $5, $6)",
        |call| call.bind(lease_ms).bind(now),
        |_, _| false,
        None,
    )
    .await
    .map(|settled| settled.results)
}

/// Moves LEASED intents to SUBMITTED: from now on a lost outcome needs an operator.
///
/// One round trip, as [`extend_leases`] (`outbox.mark_submitted`).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn mark_intents_submitted(
    pools: &Pools,
    scope: SettleScope<'_>,
    leases: &[LeaseRef],
    now: Option<DateTime<Utc>>,
) -> Result<Vec<ItemResult>> {
    settle_in_one_call(
        pools,
        scope,
        leases,
        "SELECT * FROM outbox.mark_submitted($1, $2, $3, $4, $5)",
        |call| call.bind(now),
        |_, found| found.state == IntentState::Submitted,
        None,
    )
    .await
    .map(|settled| settled.results)
}

/// A settle function's call as a query, with its first four arguments bound.
type SettleCall<'q> = QueryAs<'q, Postgres, SettleRow, PgArguments>;

/// Runs `call`, a settle function taking the tenants, their proof, intent ids and lease
/// ids as `$1`–`$4` and whatever `bind_rest` binds after them, in its own transaction on
/// the pool: one round trip, retried on a dead pooled connection (a settle that committed
/// unseen is then answered as a replay). The function returns the intents it changed;
/// the items it did not change are read afresh ([`results_of`]), a round trip paid
/// only when there are some. Rows in `released` (the next intents of ordering keys an Ack
/// let move on) are counted, not taken as items.
async fn settle_in_one_call(
    pools: &Pools,
    scope: SettleScope<'_>,
    leases: &[LeaseRef],
    call: &'static str,
    bind_rest: impl for<'q> Fn(SettleCall<'q>) -> SettleCall<'q>,
    is_replay: impl Fn(usize, &Current) -> bool,
    released: Option<IntentState>,
) -> Result<Settled> {
    let pool = pools.for_scope(scope.tenants);
    let pairs = pairs(leases.iter().copied());
    let settings = pools.scope_settings(scope.tenants);
    let (ids, mut lease_ids) = split(&pairs);
    if !scope.key_regions.is_empty() {
        keep_to_key_regions(
            pools,
            scope.tenants,
            &settings,
            scope.key_regions,
            &ids,
            &mut lease_ids,
        )
        .await?;
    }
    let changed: Vec<SettleRow> = on_live_connection(pool, || async {
        let mut conn = pools.acquire(scope.tenants).await?;
        bind_rest(
            sqlx::query_as(call)
                .bind(&settings.tenants)
                .bind(&settings.proof)
                .bind(&ids)
                .bind(&lease_ids),
        )
        .fetch_all(&mut *conn)
        .await
    })
    .await?;
    let (released, changed): (Vec<SettleRow>, Vec<SettleRow>) = changed
        .into_iter()
        .partition(|r| released.is_some() && r.state == released);
    let changed: HashMap<Uuid, SettleRow> = changed.into_iter().map(|r| (r.id, r)).collect();
    let rows: Vec<SettleRow> = pairs
        .iter()
        .map(|&(id, _)| {
            changed
                .get(&id)
                .cloned()
                .unwrap_or_else(|| SettleRow::missed(id))
        })
        .collect();
    let results = results_of(
        pools,
        scope.tenants,
        scope.key_regions,
        &pairs,
        rows,
        is_replay,
    )
    .await?;
    Ok(Settled {
        results,
        released: released.len(),
    })
}

/// What a settle call did.
#[derive(Debug)]
pub struct Settled {
    /// One per item, in request order.
    pub results: Vec<ItemResult>,
    /// Intents it made claimable besides its items: the next intent of each ordering key
    /// an Ack let move on. The caller wakes claimers for them (the Ack did not NOTIFY).
    pub released: usize,
}

/// Replaces the presented lease of each item that is not an intent of the caller's
/// tenants in `key_regions` (or in no region) with the nil UUID, a lease no intent carries
/// (lease ids are random v4 UUIDs): the settle cannot apply it, and the lookup of missed
/// items, filtered by the same regions, answers it NOT_FOUND. The items keep their places,
/// as the settle functions' parallel arrays (Fail's outcomes, errors, retry delays) need.
/// One round trip (`outbox.settleable_in_regions`); a region never changes after Enqueue,
/// so the answer holds until the settle runs.
async fn keep_to_key_regions(
    pools: &Pools,
    tenants: &TenantScope,
    scope: &ScopeSettings,
    key_regions: &[String],
    ids: &[Uuid],
    lease_ids: &mut [Uuid],
) -> Result<()> {
    let settleable: Vec<Uuid> = on_live_connection(pools.for_scope(tenants), || async {
        let mut conn = pools.acquire(tenants).await?;
        sqlx::query_scalar("SELECT * FROM outbox.settleable_in_regions($1, $2, $3, $4)")
            .bind(&scope.tenants)
            .bind(&scope.proof)
            .bind(ids)
            .bind(key_regions)
            .fetch_all(&mut *conn)
            .await
    })
    .await?;
    let settleable: std::collections::HashSet<Uuid> = settleable.into_iter().collect();
    for (id, lease) in ids.iter().zip(lease_ids.iter_mut()) {
        if !settleable.contains(id) {
            *lease = Uuid::nil();
        }
    }
    Ok(())
}

/// Ack ([`DeliveredRows::Batched`]): `$1` tenants, `$2` their proof, `$3` intent ids,
/// `$4` lease ids, `$5` now (or NULL).
const ACK: &str = "SELECT * FROM outbox.ack_into_batches($1, $2, $3, $4, $5)";

/// Ack at retention zero ([`DeliveredRows::Deleted`]), the same arguments.
const ACK_AND_DELETE: &str = "SELECT * FROM outbox.ack_and_delete($1, $2, $3, $4, $5)";

/// The function call of `ACK`, for the benchmark's raw-SQL ceiling (the same call, no
/// service); a test checks that `ACK` makes it.
pub const ACK_CALL: &str = "outbox.ack_into_batches($1, $2, $3, $4, $5)";

/// The function call of `ACK_AND_DELETE`, for the benchmark's raw-SQL ceiling at zero
/// retention.
pub const ACK_AND_DELETE_CALL: &str = "outbox.ack_and_delete($1, $2, $3, $4, $5)";

/// What Ack does with the row of an intent it delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveredRows {
    /// Kept, DELIVERED, until the retention purge: GetIntent shows it, its idempotency
    /// key is remembered, and a replayed Ack is answered OK. An intent without a key is
    /// moved out of the table claims and settles read, into a row of
    /// `outbox.delivered_batch` that holds the Ack's intents of its tenant, region and
    /// bucket (see `outbox.delivered_batch` in migration `…01_baseline_tables`); one with
    /// a key stays where its unique index guards the key.
    Batched,
    /// Deleted by the Ack itself (retention zero, when the purge would delete it next
    /// anyway): per intent, no new row version and none of its index entries (primary
    /// key, finished_at), which the purge would delete again. A replayed Ack then finds
    /// nothing and answers NOT_FOUND, as it would after the purge. An intent with an
    /// idempotency key is kept as [`Self::Batched`] keeps it, for its key's window
    /// (`outbox.ack_and_delete`).
    Deleted,
}

impl DeliveredRows {
    /// Deleted when finished intents are retained for no time at all; otherwise kept, a
    /// batch to a row.
    pub fn for_retention(retention: Duration) -> Self {
        if retention.is_zero() {
            Self::Deleted
        } else {
            Self::Batched
        }
    }
}

/// Marks intents DELIVERED (and, per `rows`, deletes them). Accepted from the live lease
/// (LEASED, SUBMITTED, even if expired but not yet rescued) and from the last lease of a
/// NEEDS_RECONCILE intent: the worker has learned the outcome, and no other worker was
/// given the intent meanwhile.
///
/// One round trip: `outbox.ack_into_batches` (or `outbox.ack_and_delete`) runs in its own
/// transaction, committed before this returns; only items that did not apply cost another.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn ack_intents(
    pools: &Pools,
    scope: SettleScope<'_>,
    leases: &[LeaseRef],
    rows: DeliveredRows,
    now: Option<DateTime<Utc>>,
) -> Result<Settled> {
    let call = match rows {
        DeliveredRows::Batched => ACK,
        DeliveredRows::Deleted => ACK_AND_DELETE,
    };
    settle_in_one_call(
        pools,
        scope,
        leases,
        call,
        |call| call.bind(now),
        |_, found| found.state == IntentState::Delivered,
        // The Ack's own items are DELIVERED; its PENDING rows are the intents it released.
        Some(IntentState::Pending),
    )
    .await
}

/// Records failures. RETRY → PENDING after the backoff (or `retry_after`), or
/// DEAD_LETTERED when attempts are used up; PERMANENT → DEAD_LETTERED; UNKNOWN →
/// NEEDS_RECONCILE. A definite outcome (RETRY, PERMANENT) is also accepted from the last
/// lease of a NEEDS_RECONCILE intent.
///
/// One round trip, as [`ack_intents`] (`outbox.fail`).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn fail_intents(
    pools: &Pools,
    scope: SettleScope<'_>,
    failures: &[Failure],
    backoff: BackoffParams,
    now: Option<DateTime<Utc>>,
) -> Result<Vec<ItemResult>> {
    let leases: Vec<LeaseRef> = failures.iter().map(|f| f.lease).collect();
    let outcomes: Vec<&'static str> = failures.iter().map(|f| f.outcome.as_str()).collect();
    let errors: Vec<String> = failures.iter().map(|f| f.error.clone()).collect();
    let retry_after: Vec<Option<i64>> =
        failures.iter().map(|f| f.retry_after.map(millis)).collect();
    // Bound by value: the call's arguments must outlive any borrow (it may be made twice,
    // see `settle_in_one_call`).
    settle_in_one_call(
        pools,
        scope,
        &leases,
        "SELECT * FROM outbox.fail($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        |call| {
            call.bind(outcomes.clone())
                .bind(errors.clone())
                .bind(retry_after.clone())
                .bind(millis(backoff.base) as f64)
                .bind(millis(backoff.cap) as f64)
                .bind(now)
        },
        // A replay must name the outcome that put the intent where it is: a contradicting
        // report from the same lease (RETRY, then PERMANENT; PERMANENT, then a RETRY that
        // would have left attempts) is refused, not silently ignored.
        |i, found| match failures[i].outcome {
            FailOutcome::Retry => match found.state {
                IntentState::Pending => true,
                IntentState::DeadLettered => found.attempts_used_up,
                _ => false,
            },
            FailOutcome::Permanent => found.state == IntentState::DeadLettered,
            FailOutcome::Unknown => found.state == IntentState::NeedsReconcile,
        },
        None,
    )
    .await
    .map(|settled| settled.results)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_ack_statements_make_the_calls_the_benchmark_makes() {
        assert!(super::ACK.ends_with(super::ACK_CALL));
        assert!(super::ACK_AND_DELETE.ends_with(super::ACK_AND_DELETE_CALL));
    }
}
