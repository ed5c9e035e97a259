//! The two-phase token's SQL: the cluster's identity, a producer transaction's status, and
//! the promotion of STAGED intents once PostgreSQL says how their transaction ended.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::PENDING_CHANNEL;
use super::ordering::advance_keys;
use crate::outbox::{Enqueued, IntentId, IntentState, NewIntent, Result};

/// How PostgreSQL reports a transaction (`pg_xact_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnStatus {
    /// Still open: intents enqueued with it are STAGED.
    InProgress,
    /// Prepared for two-phase commit (`PREPARE TRANSACTION`): in doubt, and past taking
    /// new intents.
    Prepared,
    /// Committed.
    Committed,
    /// Rolled back, or its backend or the server crashed before it committed.
    Aborted,
    /// Too old for the commit log to remember.
    Forgotten,
    /// Not assigned yet: the token was made up, or its id was lost in a crash.
    Future,
}

/// What a token's transaction looks like from here: its status, and the server's current
/// incarnation (`outbox.server_incarnation()`) to compare with the token's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenCheck {
    /// Status of the transaction id, as this server life knows it.
    pub status: TxnStatus,
    /// The incarnation of the server now.
    pub incarnation: u64,
}

/// The cluster's `system_identifier`, which every token must carry.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn cluster_identifier(db: impl PgExecutor<'_>) -> Result<String> {
    let id = sqlx::query_scalar("SELECT system_identifier::text FROM pg_control_system()")
        .fetch_one(db)
        .await?;
    Ok(id)
}

/// Status of transaction `xid` (a full 64-bit id, as `pg_current_xact_id()` gives) and the
/// server's incarnation, in one statement. Run it in the transaction that then stages the
/// intents: if the server crashes in between, that transaction dies with it, so intents are
/// never staged in a server life other than the one checked.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn check_token(conn: &mut PgConnection, xid: u64) -> Result<TokenCheck> {
    let (status, incarnation): (String, i64) = sqlx::query_as(
        "SELECT CASE WHEN s.status = 'in progress'
                      AND EXISTS (SELECT 1 FROM pg_prepared_xacts p
                                  WHERE p.transaction = xid($1::text::xid8))
                     THEN 'prepared' ELSE s.status END,
                outbox.server_incarnation()
         FROM outbox.xact_status($1::text::xid8) AS s (status)",
    )
    .bind(xid.to_string())
    .fetch_one(conn)
    .await?;
    let status = match status.as_str() {
        "in progress" => TxnStatus::InProgress,
        "prepared" => TxnStatus::Prepared,
        "committed" => TxnStatus::Committed,
        "future" => TxnStatus::Future,
        "forgotten" => TxnStatus::Forgotten,
        _ => TxnStatus::Aborted,
    };
    Ok(TokenCheck {
        status,
        incarnation: incarnation as u64,
    })
}

/// When transaction `xid` already committed, an Enqueue naming it is accepted only as a
/// replay: every intent carries an idempotency key already recorded, with the same
/// content, by this transaction or by one that committed (the first try deduplicated it).
/// Returns the recorded intents, or `None` when it is not a replay.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn find_replay(
    conn: &mut PgConnection,
    xid: u64,
    intents: &[NewIntent],
) -> Result<Option<Vec<Enqueued>>> {
    let Some(keys) = intents
        .iter()
        .map(|i| i.idempotency_key.as_deref())
        .collect::<Option<Vec<&str>>>()
    else {
        return Ok(None);
    };
    let kinds: Vec<&str> = intents.iter().map(|i| i.kind.as_str()).collect();
    let payloads: Vec<&[u8]> = intents.iter().map(|i| i.payload.as_slice()).collect();
    let regions: Vec<&str> = intents.iter().map(|i| i.region.as_str()).collect();
    let rows: Vec<(Option<Uuid>, Option<IntentState>)> = sqlx::query_as(
        r#"
        SELECT i.id, i.state
        FROM unnest($1::text[], $2::text[], $3::bytea[], $5::text[])
            WITH ORDINALITY AS t(key, kind, payload, region, ord)
        LEFT JOIN outbox.intent i
            ON i.idempotency_key = t.key
           AND i.kind = t.kind
           AND i.payload = t.payload
           AND i.region = t.region
           -- Recorded with this transaction, or the intent its key was deduplicated
           -- against (committed: not STAGED, not DISCARDED), as the first try answered.
           AND (i.txn_xid = $4::text::xid8 OR i.state NOT IN ('staged', 'discarded'))
        ORDER BY t.ord
        "#,
    )
    .bind(&keys)
    .bind(&kinds)
    .bind(&payloads)
    .bind(xid.to_string())
    .bind(&regions)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, state)| {
            Some(Enqueued {
                id: IntentId(id?),
                state: state?,
                deduplicated: true,
                handed_off: false,
            })
        })
        .collect())
}

/// What one promotion pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromotionReport {
    /// STAGED intents whose transaction committed, now PENDING (WAITING if ordered).
    pub promoted: u64,
    /// STAGED intents whose transaction aborted, now DISCARDED.
    pub discarded: u64,
    /// STAGED intents whose transaction this cluster cannot tell about (too old to look up,
    /// or an id it has not handed out yet), sent to an operator.
    pub forgotten: u64,
}

/// The locks of the keys of finished STAGED ordered intents (at most `$1` keys), sorted and
/// in one round before the promotion locks any row, as a CANCEL takes them: waiting for a
/// key then holds nothing the key's holder may want, and the promotion has its turn in the
/// key's queue (a try alone could find a busy key taken at every sweep). PostgreSQL
/// evaluates a volatile select-list function after the sort below it.
const STAGED_KEY_LOCKS: &str = r#"
    SELECT k.lock_id, pg_advisory_xact_lock(k.lock_id)
    FROM (
        SELECT DISTINCT outbox.ordering_lock(i.tenant_id, i.ordering_key) AS lock_id
        FROM (
            -- Each transaction's status once, as the promotion below reads it.
            SELECT x.txn_xid
            FROM (
                SELECT DISTINCT txn_xid
                FROM outbox.intent
                WHERE state = 'staged' AND ordering_key IS NOT NULL
            ) x
            WHERE outbox.xact_status(x.txn_xid) <> 'in progress'
        ) f
        JOIN outbox.intent i ON i.txn_xid = f.txn_xid
        WHERE i.state = 'staged' AND i.ordering_key IS NOT NULL
        LIMIT $1
    ) k
    ORDER BY k.lock_id
"#;

/// Resolves up to `limit` STAGED intents whose producer transaction has finished, across
/// tenants: committed → PENDING (and claimers are notified), or WAITING for an ordered one
/// (with its transaction's commit time), whose key then advances; aborted → DISCARDED.
/// Intents of transactions still in progress are left alone and cost nothing but an index
/// probe.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn promote_staged_intents(
    conn: &mut PgConnection,
    limit: i64,
    now: Option<DateTime<Utc>>,
) -> Result<PromotionReport> {
    sqlx::query(STAGED_KEY_LOCKS)
        .bind(limit)
        .execute(&mut *conn)
        .await?;
    let rows: Vec<(IntentState, String, Option<String>)> = sqlx::query_as(
        r#"
        WITH staged_xids AS (
            SELECT DISTINCT txn_xid
            FROM outbox.intent
            WHERE state = 'staged'
        ),
        -- Open transactions are skipped before the LIMIT, so a producer holding its
        -- transaction open never starves the promotion of anyone else's intents.
        -- outbox.xact_status, not pg_xact_status: an id this cluster has not handed out
        -- yet (rows restored into another cluster) must not fail the sweep for everyone.
        xid_statuses AS (
            SELECT txn_xid, outbox.xact_status(txn_xid) AS status
            FROM staged_xids
        ),
        finished_xids AS (
            SELECT txn_xid, status
            FROM xid_statuses
            WHERE status <> 'in progress'
        ),
        finished AS (
            SELECT i.id, f.status
            FROM outbox.intent i
            JOIN finished_xids f ON f.txn_xid = i.txn_xid
            WHERE i.state = 'staged'
              -- An ordered intent's key before its row, in the order a CANCEL takes them
              -- (else the two deadlock): held already (STAGED_KEY_LOCKS), or, for one
              -- that finished since, taken now or left to the next sweep. The condition
              -- names f so that it runs after the join, for finished ones only.
              AND (i.ordering_key IS NULL
                   OR (f.status IS NOT NULL
                       AND pg_try_advisory_xact_lock(
                           outbox.ordering_lock(i.tenant_id, i.ordering_key))))
            LIMIT $1
            FOR UPDATE OF i SKIP LOCKED
        ),
        resolved AS (
            UPDATE outbox.intent i
            SET state = CASE finished.status
                    WHEN 'committed'
                        THEN CASE WHEN i.ordering_key IS NULL THEN 'pending' ELSE 'waiting' END
                    WHEN 'aborted' THEN 'discarded'
                    ELSE 'needs_reconcile'
                END::outbox.intent_state,
                finished_at = CASE WHEN finished.status = 'aborted'
                                   THEN coalesce($2::timestamptz, now()) END,
                -- Claimable from now on, not from the Enqueue: claims look from a floor
                -- behind the newest intent taken (outbox::claim::floor), and an intent of a
                -- transaction that stayed open for a while would sort behind it.
                available_at = CASE WHEN finished.status = 'committed'
                                    THEN greatest(i.available_at, coalesce($2::timestamptz, now()))
                                    ELSE i.available_at END,
                last_error = CASE finished.status
                    WHEN 'forgotten'
                        THEN 'producer transaction too old to tell whether it committed'
                    WHEN 'future'
                        THEN 'producer transaction id not handed out by this cluster yet '
                             '(intents restored from another cluster?)'
                    END,
                order_ts = CASE WHEN finished.status = 'committed' AND i.ordering_key IS NOT NULL
                                THEN coalesce(outbox.commit_time(i.txn_xid), '-infinity') END,
                updated_at = coalesce($2::timestamptz, now())
            FROM finished
            WHERE i.id = finished.id
            RETURNING i.state, i.tenant_id, i.ordering_key
        ),
        woken AS (
            SELECT pg_notify($3, '')
            WHERE EXISTS (SELECT 1 FROM resolved WHERE state = 'pending')
        )
        SELECT state, tenant_id, ordering_key FROM resolved, (SELECT count(*) FROM woken) AS w
        "#,
    )
    .bind(limit)
    .bind(now)
    .bind(PENDING_CHANNEL)
    .fetch_all(&mut *conn)
    .await?;
    // Whatever became of a STAGED ordered intent, its key may move on.
    let keys: Vec<(&str, &str)> = rows
        .iter()
        .filter_map(|(_, tenant, key)| Some((tenant.as_str(), key.as_deref()?)))
        .collect();
    advance_keys(conn, &keys, now).await?;
    let mut report = PromotionReport::default();
    for (state, _, _) in rows {
        match state {
            IntentState::Pending | IntentState::Waiting => report.promoted += 1,
            IntentState::Discarded => report.discarded += 1,
            _ => report.forgotten += 1,
        }
    }
    Ok(report)
}
