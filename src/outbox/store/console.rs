//! What the operator console reads and writes beyond the gRPC API's statements: its
//! sign-ins, the overview's counts and per-minute figures, lookups by idempotency key and
//! the blocked ordering keys.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, PgPool};
use uuid::Uuid;

use super::ApiKeyRecord;
use crate::outbox::{IntentId, IntentState, Result};

/// Opens a sign-in of the key whose secret is `secret` (live, of scope operate or admin)
/// until `ttl` from now, and removes expired ones; returns that key's id, or None when
/// no such key exists. Through `outbox.open_console_session`: the request-serving role may
/// not insert a session itself, for a key whose secret it was not shown.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn create_console_session(
    pool: &PgPool,
    secret: &str,
    token_hash: &[u8],
    csrf_token: &str,
    ttl: std::time::Duration,
) -> Result<Option<Uuid>> {
    let key_id = sqlx::query_scalar("SELECT outbox.open_console_session($1, $2, $3, $4)")
        .bind(secret)
        .bind(token_hash)
        .bind(csrf_token)
        .bind(ttl.as_secs_f64())
        .fetch_one(pool)
        .await?;
    Ok(key_id)
}

/// The live key and CSRF token of an unexpired sign-in.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn find_console_session(
    db: impl PgExecutor<'_>,
    token_hash: &[u8],
) -> Result<Option<(ApiKeyRecord, String)>> {
    #[derive(sqlx::FromRow)]
    struct Row {
        #[sqlx(flatten)]
        key: ApiKeyRecord,
        csrf_token: String,
    }
    let row: Option<Row> = sqlx::query_as(
        r#"
        SELECT k.id, k.name, k.prefix, k.tenants, k.all_tenants, k.scopes, k.regions,
               k.created_at, k.revoked_at, s.csrf_token
        FROM outbox.console_session s
        JOIN outbox.api_key k ON k.id = s.key_id
        WHERE s.token_hash = $1
          AND s.expires_at > now()
          AND k.revoked_at IS NULL
        "#,
    )
    .bind(token_hash)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|r| (r.key, r.csrf_token)))
}

/// Ends a sign-in.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn delete_console_session(db: impl PgExecutor<'_>, token_hash: &[u8]) -> Result<()> {
    sqlx::query("DELETE FROM outbox.console_session WHERE token_hash = $1")
        .bind(token_hash)
        .execute(db)
        .await?;
    Ok(())
}

/// Revokes one key by id; whether it was live.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn revoke_api_key_by_id(db: impl PgExecutor<'_>, id: Uuid) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE outbox.api_key SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL",
    )
    .bind(id)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Live intents of one state, tenant, kind and region.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct GroupCount {
    /// The state.
    pub state: IntentState,
    /// The tenant.
    pub tenant: String,
    /// The kind.
    pub kind: String,
    /// The region ('' = any).
    pub region: String,
    /// How many.
    pub count: i64,
}

/// Intents enqueued, leased and delivered in one minute.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Minute {
    /// The minute's start.
    pub at: DateTime<Utc>,
    /// Intents enqueued in it.
    pub enqueued: i64,
    /// Intents leased in it (by the replicas that serve the console, `outbox.claim_tally`).
    pub claimed: i64,
    /// Intents delivered (acknowledged) in it.
    pub delivered: i64,
}

/// The console's overview of the transaction's tenants.
#[derive(Debug, Clone, PartialEq)]
pub struct Overview {
    /// Live intents (not final) by state, tenant, kind and region.
    pub counts: Vec<GroupCount>,
    /// States whose count stopped at a cap (shown as "at least").
    pub capped: Vec<IntentState>,
    /// Earliest `available_at` among claimable PENDING intents.
    pub oldest_pending_at: Option<DateTime<Utc>>,
    /// Enqueue time of the oldest STAGED intent.
    pub oldest_staged_at: Option<DateTime<Utc>>,
}

/// Most rows the overview counts in each group of live states: a page must answer fast
/// however deep the backlog (row-level security reads each row), and beyond this a count
/// is shown as "at least"; the metrics have exact depths.
pub const OVERVIEW_COUNT_CAP: i64 = 10_000;

/// Most PENDING rows the overview reads, shared among the queue levels (a tenant's kind at
/// one priority), so that every kind shows its backlog: each level is counted up to
/// `pending_per_level`. Fewer than the other states' cap: the backlog is the deepest
/// state, and its oldest rows, which the count reads, lie a page apart each.
pub const OVERVIEW_PENDING_CAP: i64 = 5_000;

/// PENDING rows counted per level when there are `levels`: the largest round share of
/// [`OVERVIEW_PENDING_CAP`], at least 100 (beyond 50 levels, the last are not read).
fn pending_per_level(levels: i64) -> i64 {
    [5_000, 2_000, 1_000, 500, 200, 100]
        .into_iter()
        .find(|share| share * levels.max(1) <= OVERVIEW_PENDING_CAP)
        .unwrap_or(100)
}

/// Each part is one partial index's predicate (see `queue_depth`), read at most $2 rows:
/// PENDING level by level, $3 rows a level and $4 in all, the others in their index's
/// order (so that the scan stops at the limit, where a bitmap scan would read the whole
/// index first). $1 the API key's regions (empty: any).
const OVERVIEW_COUNTS: &str = r#"
    SELECT p.part, p.state, p.tenant_id AS tenant, p.kind, p.region, count(*) AS count,
           bool_or(p.nth = $3) AS level_full
    FROM (
        -- Level by level (the transaction's tenants' queues): in the index's order, other
        -- tenants' levels would be read and filtered out first. `nth`: a level read to its
        -- share has a row numbered $3.
        (SELECT 1 AS part, i.state, i.tenant_id, i.kind, i.region, i.nth
         FROM outbox.queue_level l
         CROSS JOIN LATERAL (
             SELECT i.state, i.tenant_id, i.kind, i.region, row_number() OVER () AS nth
             FROM outbox.intent i
             WHERE i.level_key = l.level_key AND i.state = 'pending'
               AND (cardinality($1::text[]) = 0 OR i.region = '' OR i.region = ANY($1::text[]))
             LIMIT $3
         ) i
         LIMIT $4)
        UNION ALL
        (SELECT 2, i.state, i.tenant_id, i.kind, i.region, NULL FROM outbox.intent i
         WHERE i.state IN ('leased', 'submitted') AND i.lease_expires_at IS NOT NULL
           AND (cardinality($1::text[]) = 0 OR i.region = '' OR i.region = ANY($1::text[]))
         ORDER BY i.lease_expires_at
         LIMIT $2)
        UNION ALL
        (SELECT 3, i.state, i.tenant_id, i.kind, i.region, NULL FROM outbox.intent i
         WHERE i.state IN ('needs_reconcile', 'dead_lettered', 'staged')
           AND (cardinality($1::text[]) = 0 OR i.region = '' OR i.region = ANY($1::text[]))
         ORDER BY i.tenant_id, i.state, i.id
         LIMIT $2)
        UNION ALL
        (SELECT 4, i.state, i.tenant_id, i.kind, i.region, NULL FROM outbox.intent i
         WHERE i.state = 'waiting' AND i.ordering_key IS NOT NULL
           AND (cardinality($1::text[]) = 0 OR i.region = '' OR i.region = ANY($1::text[]))
         ORDER BY i.tenant_id, i.ordering_key, i.order_ts, i.order_seq
         LIMIT $2)
    ) p
    GROUP BY p.part, p.state, p.tenant_id, p.kind, p.region
    ORDER BY p.state, p.tenant_id, p.kind, p.region
"#;

/// Per minute from $2 to $3 (the last hour): intents enqueued (by their UUIDv7 ids, from the
/// primary key and the history's buckets, $4 the first minute's smallest id), leased (the
/// claim tally) and delivered (by their finish time). $1 the API key's regions. The bounds are parameters, not read
/// from `now()`, so that the planner sees how few rows the hour holds.
const OVERVIEW_MINUTES: &str = r#"
    WITH enqueued AS (
        SELECT date_trunc('minute', e.created_at) AS at, count(*) AS n
        FROM (
            SELECT i.created_at, i.region FROM outbox.intent i WHERE i.id >= $4
            UNION ALL
            SELECT x.created_at, x.region
            FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x
            WHERE b.bucket >= outbox.history_bucket($4) AND x.id >= $4
        ) e
        WHERE cardinality($1::text[]) = 0 OR e.region = '' OR e.region = ANY($1::text[])
        GROUP BY 1
    ), delivered AS (
        SELECT date_trunc('minute', d.finished_at) AS at, sum(d.n)::bigint AS n
        FROM (
            SELECT i.finished_at, i.region, 1 AS n FROM outbox.intent i
            WHERE i.state = 'delivered' AND i.finished_at >= $2
            UNION ALL
            SELECT b.finished_at, b.region, cardinality(b.ids) FROM outbox.delivered_batch b
            WHERE b.finished_at >= $2
        ) d
        WHERE cardinality($1::text[]) = 0 OR d.region = '' OR d.region = ANY($1::text[])
        GROUP BY 1
    ), claimed AS (
        SELECT t.minute AS at, sum(t.claimed)::bigint AS n
        FROM outbox.claim_tally t
        WHERE t.minute >= $2
          AND (cardinality($1::text[]) = 0 OR t.region = '' OR t.region = ANY($1::text[]))
        GROUP BY 1
    )
    SELECT m.at, coalesce(e.n, 0)::bigint AS enqueued, coalesce(c.n, 0)::bigint AS claimed,
           coalesce(d.n, 0)::bigint AS delivered
    FROM generate_series($2::timestamptz, $3::timestamptz, interval '1 minute') m(at)
    LEFT JOIN enqueued e ON e.at = m.at
    LEFT JOIN claimed c ON c.at = m.at
    LEFT JOIN delivered d ON d.at = m.at
    ORDER BY m.at
"#;

/// Intents leased, by minute, tenant and region (`outbox.claim_tally`).
pub type ClaimCounts = std::collections::HashMap<(DateTime<Utc>, String, String), i64>;

/// How long `outbox.claim_tally` keeps a minute: the chart shows the last hour.
pub const CLAIM_TALLY_KEPT: chrono::TimeDelta = chrono::TimeDelta::hours(2);

/// Adds `counts` to `outbox.claim_tally` (as the fleet: every tenant), and drops
/// the minutes older than [`CLAIM_TALLY_KEPT`].
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn add_claim_counts(pools: &super::Pools, counts: &ClaimCounts) -> Result<()> {
    let mut columns = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for ((minute, tenant, region), n) in counts {
        columns.0.push(*minute);
        columns.1.push(tenant.as_str());
        columns.2.push(region.as_str());
        columns.3.push(*n);
    }
    let mut tx = super::begin(pools, &super::TenantScope::All).await?;
    sqlx::query(
        r#"
        INSERT INTO outbox.claim_tally (minute, tenant_id, region, claimed)
        SELECT * FROM unnest($1::timestamptz[], $2::text[], $3::text[], $4::bigint[])
        ON CONFLICT (minute, tenant_id, region)
            DO UPDATE SET claimed = outbox.claim_tally.claimed + excluded.claimed
        "#,
    )
    .bind(&columns.0)
    .bind(&columns.1)
    .bind(&columns.2)
    .bind(&columns.3)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM outbox.claim_tally WHERE minute < now() - $1::interval")
        .bind(CLAIM_TALLY_KEPT)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Reads the [`Overview`] of the transaction's tenants in `regions` (empty: any).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn overview(
    conn: &mut PgConnection,
    regions: &[String],
    now: Option<DateTime<Utc>>,
) -> Result<Overview> {
    #[derive(sqlx::FromRow)]
    struct Row {
        part: i32,
        #[sqlx(flatten)]
        group: GroupCount,
        level_full: Option<bool>,
    }
    bounded_reads(conn).await?;
    let levels: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.queue_level")
        .fetch_one(&mut *conn)
        .await?;
    let per_level = pending_per_level(levels);
    let rows: Vec<Row> = sqlx::query_as(OVERVIEW_COUNTS)
        .bind(regions)
        .bind(OVERVIEW_COUNT_CAP)
        .bind(per_level)
        .bind(OVERVIEW_PENDING_CAP)
        .fetch_all(&mut *conn)
        .await?;
    let mut capped = Vec::new();
    for part in 1..=4 {
        let in_part = || rows.iter().filter(move |r| r.part == part);
        let cap = if part == 1 {
            OVERVIEW_PENDING_CAP
        } else {
            OVERVIEW_COUNT_CAP
        };
        if in_part().map(|r| r.group.count).sum::<i64>() >= cap {
            capped.extend(in_part().map(|r| r.group.state));
        }
    }
    // A level (a tenant's kind at one priority) read up to its share.
    if rows.iter().any(|r| r.level_full == Some(true)) {
        capped.push(IntentState::Pending);
    }
    capped.sort_by_key(|s| *s as i32);
    capped.dedup();
    let (oldest_pending_at, oldest_staged_at) =
        super::inspect::oldest_waiting(conn, regions, now).await?;
    Ok(Overview {
        counts: rows.into_iter().map(|r| r.group).collect(),
        capped,
        oldest_pending_at,
        oldest_staged_at,
    })
}

/// The last hour of the transaction's tenants in `regions` (empty: any), a minute at a
/// time, oldest first: read apart from [`overview`], so that a page may read both at once.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn overview_minutes(
    conn: &mut PgConnection,
    regions: &[String],
    now: Option<DateTime<Utc>>,
) -> Result<Vec<Minute>> {
    bounded_reads(conn).await?;
    let last: DateTime<Utc> =
        sqlx::query_scalar("SELECT date_trunc('minute', coalesce($1::timestamptz, now()))")
            .bind(now)
            .fetch_one(&mut *conn)
            .await?;
    let first = last - chrono::Duration::minutes(59);
    let minutes = sqlx::query_as(OVERVIEW_MINUTES)
        .bind(regions)
        .bind(first)
        .bind(last)
        .bind(first_id_at(first))
        .fetch_all(&mut *conn)
        .await?;
    Ok(minutes)
}

/// The smallest UUIDv7 of `t`'s millisecond: ids above it were minted at `t` or later.
pub fn first_id_at(t: DateTime<Utc>) -> Uuid {
    let ms = u64::try_from(t.timestamp_millis())
        .unwrap_or(0)
        .to_be_bytes();
    let mut bytes = [0u8; 16];
    bytes[..6].copy_from_slice(&ms[2..]);
    bytes[6] = 0x70;
    bytes[8] = 0x80;
    Uuid::from_bytes(bytes)
}

/// Plans the rest of the transaction for reads that an index bounds whatever the table's
/// size (a LIMIT, the last hour's ids, a partial index of few rows). Costing random reads
/// at `random_page_cost`, the planner would rather read a table of a few hundred thousand
/// rows whole, or a whole queue level into a bitmap before the LIMIT; a generic plan would
/// guess a third of the table past a bound. JIT: these reads are costed past
/// `jit_above_cost`, and compiling them took longer than running them (0.1-0.15 s a page
/// at 1M intents).
async fn bounded_reads(conn: &mut PgConnection) -> Result<()> {
    sqlx::query(
        "SELECT set_config('jit', 'off', true), set_config('enable_seqscan', 'off', true), \
         set_config('enable_bitmapscan', 'off', true), \
         set_config('plan_cache_mode', 'force_custom_plan', true)",
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// The intents of the transaction's tenants in `regions` (empty: any) with this idempotency
/// key (one per tenant).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn ids_by_idempotency_key(
    conn: &mut PgConnection,
    key: &str,
    regions: &[String],
) -> Result<Vec<IntentId>> {
    let ids: Vec<Uuid> = sqlx::query_scalar(
        r#"
        SELECT i.id FROM outbox.intent i
        WHERE i.idempotency_key = $1 AND i.state <> 'discarded'
          AND (cardinality($2::text[]) = 0 OR i.region = '' OR i.region = ANY($2::text[]))
        ORDER BY i.id
        LIMIT 100
        "#,
    )
    .bind(key)
    .bind(regions)
    .fetch_all(conn)
    .await?;
    Ok(ids.into_iter().map(IntentId).collect())
}

/// An ordering key held back by its first intent.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct BlockedKey {
    /// The head intent.
    pub id: Uuid,
    /// Its tenant.
    pub tenant: String,
    /// Its kind.
    pub kind: String,
    /// The ordering key.
    pub ordering_key: String,
    /// The head's state.
    pub state: IntentState,
    /// Since when (the head's last state change).
    pub since: DateTime<Utc>,
}

/// The longest-blocked ordering keys first, at most `limit` (see `BLOCKED_HEADS`).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn blocked_keys(
    conn: &mut PgConnection,
    regions: &[String],
    now: Option<DateTime<Utc>>,
    limit: i64,
) -> Result<Vec<BlockedKey>> {
    bounded_reads(conn).await?;
    let keys = sqlx::query_as(&format!(
        "SELECT i.id, i.tenant_id AS tenant, i.kind, i.ordering_key, i.state, \
         i.updated_at AS since {} ORDER BY i.updated_at LIMIT $3",
        super::inspect::BLOCKED_HEADS
    ))
    .bind(regions)
    .bind(now)
    .bind(limit)
    .fetch_all(conn)
    .await?;
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_levels_share_the_cap_in_round_numbers() {
        let shares: Vec<i64> = [0, 1, 2, 3, 6, 11, 26, 1000]
            .into_iter()
            .map(pending_per_level)
            .collect();
        assert_eq!(shares, [5_000, 5_000, 2_000, 1_000, 500, 200, 100, 100]);
    }

    #[test]
    fn the_floor_of_an_instant_is_its_smallest_uuid_v7() {
        let at = DateTime::parse_from_rfc3339("2026-12-05T07:00:00.123Z")
            .unwrap()
            .with_timezone(&Utc);
        let floor = first_id_at(at);
        assert_eq!(floor.to_string(), "01a24500-a5fb-7000-8000-000000000000");
        assert_eq!(floor.get_version_num(), 7);
    }
}
