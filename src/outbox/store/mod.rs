//! Every SQL statement of outboxd, and nothing else. Each transition is one guarded
//! statement (`UPDATE … WHERE state = ANY(…) AND lease_id = … RETURNING`), so a caller that
//! lost a race gets no row back instead of forcing a write.
//!
//! Time is `coalesce($now, now())`: `None` in production, a manual instant in tests.
//!
//! The statements are plain SQL, each written out whole: short ones as string literals,
//! long ones as files in `sql/` (`include_str!`), each opening with what its parameters
//! are. Two fragments recur. An intent's columns, in the order of `INTENT_COLUMN_NAMES`
//! (a claim decodes them by position). And an API key's regions, a `text[]` parameter
//! (empty: any region): `(cardinality($n::text[]) = 0 OR i.region = '' OR i.region =
//! ANY($n::text[]))`. A region-less intent is any region's, as a Claim in one of them takes
//! it; the operator calls of a region-bound key see and resolve only such intents, and
//! another region's are NOT_FOUND, as another tenant's.

mod access;
mod api_keys;
mod claim;
mod console;
mod current;
mod enqueue;
mod flush;
mod inspect;
mod listeners;
mod maintenance;
mod ordering;
mod policy;
mod queue_levels;
mod reconcile;
mod settle;
mod staged;

pub use access::{AcquireCounters, AlsoAtBegin, Pools, ScopeKey, TenantScope, begin, begin_with};
pub use api_keys::{
    ApiKeyRecord, find_api_key, insert_api_key, insert_api_key_unless_stored, list_api_keys,
    lookup_api_key, revoke_api_key,
};
pub use claim::{CLAIM_CALL, ClaimParams, Claimed, QueueLevel, claim_intents, release_leases};
pub use console::{
    BlockedKey, CLAIM_TALLY_KEPT, ClaimCounts, GroupCount, Minute, OVERVIEW_COUNT_CAP,
    OVERVIEW_PENDING_CAP, Overview, add_claim_counts, blocked_keys, create_console_session,
    delete_console_session, find_console_session, first_id_at, ids_by_idempotency_key, overview,
    overview_minutes, revoke_api_key_by_id,
};
pub use enqueue::{EnqueueParams, Inserted, insert_intents};
pub use flush::{Unflushed, commit_waits_for_flush, flush};
pub use inspect::{
    ListParams, Listed, QueueDepth, QueueStats, StateCount, get_intent, list_intents, probe,
    queue_depth, queue_stats, region_of,
};
pub use listeners::{hold_listener_lock, others_listen};
pub use maintenance::{
    BackoffParams, forget_claim_requests, purge_finished_intents, rescue_expired_leases,
};
pub use ordering::{advance_keys, lock_ordering_keys};
pub use policy::{
    PolicyCursor, PolicyPage, PolicyParams, QueuePolicy, QueuesOfKind, list_queue_policies,
    set_queue_policy,
};
pub use queue_levels::forget_empty_queues;
pub use reconcile::{ReconcileParams, ReconcileTarget, resolve_intents};
pub use settle::{
    ACK_AND_DELETE_CALL, ACK_CALL, DeliveredRows, SettleScope, Settled, ack_intents, extend_leases,
    fail_intents, mark_intents_submitted,
};
pub use staged::{
    PromotionReport, TokenCheck, TxnStatus, check_token, cluster_identifier, find_replay,
    promote_staged_intents,
};

/// The NOTIFY channel that wakes long-polling claimers when intents become claimable.
pub const PENDING_CHANNEL: &str = "outbox_intent_pending";

/// Tells every server listening on [`PENDING_CHANNEL`] that intents became claimable,
/// with `from` as the payload (the sender skips its own). Its own short transaction (see
/// `crate::outbox::notify` for why not the enqueue's), committed without waiting for the
/// disk: a NOTIFY needs a transaction id, hence a commit record, but nothing in it needs to
/// survive a crash. One round trip: one statement in its own implicit transaction, whose
/// transaction-local setting is still in force when it commits.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn announce_pending(pool: &sqlx::PgPool, from: &str) -> crate::outbox::Result<()> {
    sqlx::query("SELECT set_config('synchronous_commit', 'off', true), pg_notify($1, $2)")
        .bind(PENDING_CHANNEL)
        .bind(from)
        .execute(pool)
        .await?;
    Ok(())
}

/// The NOTIFY channel `outbox.txn_token()` uses; delivered only when a producer commits.
pub const TXN_COMMITTED_CHANNEL: &str = "outbox_txn_committed";

/// The NOTIFY channel a server's LISTEN connection proves it still delivers on: each
/// server sends its own id there and waits for it to come back (`super::notify`).
pub const LISTENER_PROBE_CHANNEL: &str = "outbox_listener_probe";

/// Ends the session of backend `pid` (one of this role's own: a LISTEN connection that
/// stopped delivering); whether it was there to end.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn terminate_backend(pool: &sqlx::PgPool, pid: i32) -> crate::outbox::Result<bool> {
    Ok(sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(pool)
        .await?)
}

/// Sends a probe of a server's own LISTEN connection (`payload` names the server).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn probe_listener(pool: &sqlx::PgPool, payload: &str) -> crate::outbox::Result<()> {
    sqlx::query("SELECT set_config('synchronous_commit', 'off', true), pg_notify($1, $2)")
        .bind(LISTENER_PROBE_CHANNEL)
        .bind(payload)
        .execute(pool)
        .await?;
    Ok(())
}

/// The columns of `crate::outbox::Intent`, in the order in which every statement that
/// returns intents selects them (`i.id, i.state, …, i.tenant_id AS tenant`).
pub(crate) const INTENT_COLUMN_NAMES: [&str; INTENT_COLUMNS] = [
    "id",
    "state",
    "kind",
    "payload",
    "content_type",
    "region",
    "idempotency_key",
    "headers",
    "attempts",
    "max_attempts",
    "available_at",
    "created_at",
    "updated_at",
    "lease_id",
    "lease_expires_at",
    "worker_id",
    "last_error",
    "ordering_key",
    "priority",
    "tenant",
];

/// How many columns of an intent a claim selects ([`INTENT_COLUMN_NAMES`]); the
/// statement's own columns follow them.
pub(crate) const INTENT_COLUMNS: usize = 20;

/// Decodes the [`Intent`](crate::outbox::Intent) in the first [`INTENT_COLUMNS`] columns of
/// `row`, in the order of [`INTENT_COLUMN_NAMES`], by position. A claim decodes up to a thousand
/// rows: by name (`FromRow`) every value costs a hash lookup of its column's name and a
/// check of its type against the column's, about 2% of the machine in a burn-down.
/// `checked` does both checks (the names in debug builds): for the first row of a result,
/// whose columns every later row shares.
pub(crate) fn intent_at(
    row: &sqlx::postgres::PgRow,
    checked: bool,
) -> sqlx::Result<crate::outbox::Intent> {
    use sqlx::Row as _;
    if checked && cfg!(debug_assertions) {
        for (i, name) in INTENT_COLUMN_NAMES.iter().enumerate() {
            debug_assert_eq!(sqlx::Column::name(&row.columns()[i]), *name);
        }
    }
    fn get<'r, T>(row: &'r sqlx::postgres::PgRow, i: usize, checked: bool) -> sqlx::Result<T>
    where
        T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        if checked {
            row.try_get(i)
        } else {
            row.try_get_unchecked(i)
        }
    }
    Ok(crate::outbox::Intent {
        id: get(row, 0, checked)?,
        state: get(row, 1, checked)?,
        kind: get(row, 2, checked)?,
        payload: get(row, 3, checked)?,
        content_type: get(row, 4, checked)?,
        region: get(row, 5, checked)?,
        idempotency_key: get(row, 6, checked)?,
        headers: get(row, 7, checked)?,
        attempts: get(row, 8, checked)?,
        max_attempts: get(row, 9, checked)?,
        available_at: get(row, 10, checked)?,
        created_at: get(row, 11, checked)?,
        updated_at: get(row, 12, checked)?,
        lease_id: get(row, 13, checked)?,
        lease_expires_at: get(row, 14, checked)?,
        worker_id: get(row, 15, checked)?,
        last_error: get(row, 16, checked)?,
        ordering_key: get(row, 17, checked)?,
        priority: get(row, 18, checked)?,
        tenant: get(row, 19, checked)?,
    })
}

fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
