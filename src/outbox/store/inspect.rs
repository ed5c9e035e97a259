//! Read-only inspection for operators: one intent with its history, pages of intents,
//! and queue statistics.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgConnection, Row};
use uuid::Uuid;

use crate::outbox::{Decision, Intent, IntentId, IntentState, Resolution, Result};

/// Loads one intent of the tenant, in `regions` (empty: any), and its recorded decisions,
/// oldest first.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn get_intent(
    conn: &mut PgConnection,
    id: IntentId,
    regions: &[String],
) -> Result<Option<(Intent, Vec<Resolution>)>> {
    let intent: Option<Intent> = sqlx::query_as(
        r#"
        SELECT i.id, i.state, i.kind, i.payload, i.content_type, i.region, i.idempotency_key,
               i.headers, i.attempts, i.max_attempts, i.available_at, i.created_at,
               i.updated_at, i.lease_id, i.lease_expires_at, i.worker_id, i.last_error,
               i.ordering_key, i.priority, i.tenant_id AS tenant
        FROM outbox.intents_by_id(ARRAY[$1]::uuid[]) i
        WHERE (cardinality($2::text[]) = 0 OR i.region = '' OR i.region = ANY($2::text[]))
        "#,
    )
    .bind(id)
    .bind(regions)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(intent) = intent else {
        return Ok(None);
    };
    type Row = (
        String,
        IntentState,
        String,
        Option<String>,
        String,
        DateTime<Utc>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        r#"
        SELECT decision, from_state, actor, api_key, reason, resolved_at
        FROM (
            -- The last ones: a reply of every decision (of reasons of up to 16 KiB) could
            -- pass what a client may receive.
            SELECT id, decision, from_state, actor, api_key, reason, resolved_at
            FROM outbox.resolution
            WHERE intent_id = $1
            ORDER BY id DESC
            LIMIT 100
        ) r
        ORDER BY id
        "#,
    )
    .bind(id)
    .fetch_all(&mut *conn)
    .await?;
    let resolutions = rows
        .into_iter()
        .filter_map(
            |(decision, from_state, actor, api_key, reason, resolved_at)| {
                Some(Resolution {
                    decision: Decision::from_db(&decision)?,
                    from_state,
                    actor,
                    api_key: api_key.unwrap_or_default(),
                    reason,
                    resolved_at,
                })
            },
        )
        .collect();
    Ok(Some((intent, resolutions)))
}

/// Inputs of [`list_intents`].
#[derive(Debug, Clone, Default)]
pub struct ListParams {
    /// Only these states (empty = all).
    pub states: Vec<IntentState>,
    /// Only this kind.
    pub kind: Option<String>,
    /// Only this region.
    pub region: Option<String>,
    /// Only this ordering key.
    pub ordering_key: Option<String>,
    /// Only intents in these regions, the caller's API key's (empty: any).
    pub key_regions: Vec<String>,
    /// Only ids greater than this (keyset paging; ids are time ordered).
    pub after: Option<IntentId>,
    /// Page size.
    pub limit: i64,
    /// Return payload bytes too.
    pub include_payload: bool,
    /// Leave out ordered dead letters given up with DEAD (finished): what an operator can
    /// still decide on.
    pub awaiting_decision: bool,
    /// End the page early once its intents weigh this many bytes (`outbox.reply_weight`,
    /// always at least one intent), so that intents that would not be sent are not read.
    pub max_bytes: usize,
}

/// A page of intents: see the statement.
const LIST_INTENTS: &str = include_str!("sql/list_intents.sql");

/// Lists intents in id (enqueue) order.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn list_intents(conn: &mut PgConnection, params: ListParams) -> Result<Listed> {
    let rows = sqlx::query(LIST_INTENTS)
        .bind(&params.states)
        .bind(&params.kind)
        .bind(&params.region)
        .bind(params.after.map_or(Uuid::nil(), |after| after.0))
        .bind(params.limit)
        .bind(&params.key_regions)
        .bind(i64::try_from(params.max_bytes).unwrap_or(i64::MAX))
        .bind(params.include_payload)
        .bind(&params.ordering_key)
        .bind(params.awaiting_decision)
        .fetch_all(conn)
        .await?;
    let candidates: i64 = match rows.first() {
        Some(row) => row.try_get("candidates")?,
        None => 0,
    };
    let intents = rows
        .iter()
        .map(Intent::from_row)
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Listed {
        cut_short: usize::try_from(candidates).unwrap_or(0) > intents.len(),
        intents,
    })
}

/// A page of [`list_intents`].
#[derive(Debug)]
pub struct Listed {
    /// The intents, in id order.
    pub intents: Vec<Intent>,
    /// The byte budget stopped the page before the page size or the end: more may follow.
    pub cut_short: bool,
}

/// Number of intents in one state and region.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StateCount {
    /// The state.
    pub state: IntentState,
    /// The region ('' = any).
    pub region: String,
    /// How many.
    pub count: i64,
}

/// Queue statistics of the transaction's tenants.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueStats {
    /// Non-zero counts by state and region: of each state the 100 regions with the most
    /// intents.
    pub counts: Vec<StateCount>,
    /// Whether a state had more regions than `counts` shows.
    pub regions_left_out: bool,
    /// NEEDS_RECONCILE and DEAD_LETTERED intents in every region, less the ordered dead
    /// letters an operator gave up (DEAD): they await no decision.
    pub reconcile_backlog: i64,
    /// Earliest `available_at` among claimable PENDING intents.
    pub oldest_pending_at: Option<DateTime<Utc>>,
    /// Enqueue time of the oldest STAGED intent.
    pub oldest_staged_at: Option<DateTime<Utc>>,
    /// Ordering keys whose head (retrying, dead-lettered, NEEDS_RECONCILE) holds the later
    /// intents back.
    pub blocked_keys: i64,
    /// The last state change of the longest-blocked head.
    pub oldest_blocked_at: Option<DateTime<Utc>>,
    /// The queues with a policy, with their live figures, as many as fit the budget.
    pub policies: Vec<super::QueuePolicy>,
    /// Policies did not all fit.
    pub policies_left_out: bool,
}

/// Most regions [`QueueStats::counts`] shows of one state: regions are whatever names
/// producers give, and a reply must stay small however many they make.
const REGIONS_PER_STATE: i64 = 100;

/// The heads of ordering keys that hold their keys back: waiting out a retry's backoff,
/// NEEDS_RECONCILE, or DEAD_LETTERED without an operator's decision, with later intents of
/// their key WAITING behind them. Each is the one head of its key, so they count keys. Read
/// through intent_ordering_head_idx and intent_ordering_waiting_idx. $1 the API key's
/// regions (empty: any), $2 now (or NULL).
pub(super) const BLOCKED_HEADS: &str = r#"
    FROM outbox.intent i
    WHERE i.ordering_key IS NOT NULL
      AND i.state IN ('pending', 'needs_reconcile', 'dead_lettered')
      AND (i.state <> 'dead_lettered' OR i.finished_at IS NULL)
      AND (i.state <> 'pending'
           OR (i.attempts > 0 AND i.available_at > coalesce($2::timestamptz, now())))
      AND (cardinality($1::text[]) = 0 OR i.region = '' OR i.region = ANY($1::text[]))
      AND EXISTS (SELECT 1 FROM outbox.intent w
                  WHERE w.state = 'waiting'
                    AND w.tenant_id = i.tenant_id AND w.ordering_key = i.ordering_key)
"#;

/// Counts the transaction's tenants' intents in `regions` (empty: any) by state and region.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn queue_stats(
    conn: &mut PgConnection,
    regions: &[String],
    policies_budget: usize,
    now: Option<DateTime<Utc>>,
) -> Result<QueueStats> {
    #[derive(sqlx::FromRow)]
    struct Row {
        #[sqlx(flatten)]
        count: StateCount,
        state_total: i64,
        regions_of_state: i64,
    }
    // The batch history is counted by its rows' id arrays, never unnested. Regions are
    // the producers' names, as many as they make: each state keeps its largest counts.
    let rows: Vec<Row> = sqlx::query_as(
        r#"
        SELECT r.state, r.region, r.count, r.state_total, r.regions_of_state
        FROM (
            SELECT g.state, g.region, g.count,
                   sum(g.count) OVER (PARTITION BY g.state)::bigint AS state_total,
                   count(*) OVER (PARTITION BY g.state) AS regions_of_state,
                   row_number() OVER (PARTITION BY g.state ORDER BY g.count DESC, g.region)
                       AS rank
            FROM (
                SELECT c.state, c.region, sum(c.n)::bigint AS count
                FROM (
                    SELECT i.state, i.region, 1 AS n
                    FROM outbox.intent i
                    WHERE (cardinality($1::text[]) = 0 OR i.region = ''
                           OR i.region = ANY($1::text[]))
                    UNION ALL
                    SELECT 'delivered', b.region, cardinality(b.ids)
                    FROM outbox.delivered_batch b
                    WHERE (cardinality($1::text[]) = 0 OR b.region = ''
                           OR b.region = ANY($1::text[]))
                ) c
                GROUP BY c.state, c.region
            ) g
        ) r
        WHERE r.rank <= $2
        ORDER BY r.state, r.region
        "#,
    )
    .bind(regions)
    .bind(REGIONS_PER_STATE)
    .fetch_all(&mut *conn)
    .await?;
    let regions_left_out = rows.iter().any(|r| r.regions_of_state > REGIONS_PER_STATE);
    let mut awaiting_decision = 0;
    let mut totalled = Vec::new();
    for r in &rows {
        if r.count.state.awaits_decision() && !totalled.contains(&r.count.state) {
            totalled.push(r.count.state);
            awaiting_decision += r.state_total;
        }
    }
    let counts = rows.into_iter().map(|r| r.count).collect();
    let (oldest_pending_at, oldest_staged_at) = oldest_waiting(conn, regions, now).await?;
    let (blocked_keys, oldest_blocked_at): (i64, Option<DateTime<Utc>>) = sqlx::query_as(&format!(
        "SELECT count(*), min(i.updated_at) {BLOCKED_HEADS}"
    ))
    .bind(regions)
    .bind(now)
    .fetch_one(&mut *conn)
    .await?;
    let policies = super::list_queue_policies(conn, None, None, policies_budget, now).await?;
    let given_up: i64 = sqlx::query_scalar(
        r#"
        SELECT count(*)
        FROM outbox.intent i
        WHERE i.state = 'dead_lettered'
          AND i.finished_at IS NOT NULL
          AND (cardinality($1::text[]) = 0 OR i.region = '' OR i.region = ANY($1::text[]))
        "#,
    )
    .bind(regions)
    .fetch_one(&mut *conn)
    .await?;
    Ok(QueueStats {
        counts,
        regions_left_out,
        reconcile_backlog: awaiting_decision - given_up,
        oldest_pending_at,
        oldest_staged_at,
        blocked_keys,
        oldest_blocked_at,
        policies: policies.policies,
        policies_left_out: policies.next.is_some(),
    })
}

/// Since when the longest-waiting claimable PENDING intent has been claimable, and the
/// enqueue time of the oldest STAGED one, among the transaction's tenants' intents in
/// `regions` (empty: any).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn oldest_waiting(
    conn: &mut PgConnection,
    regions: &[String],
    now: Option<DateTime<Utc>>,
) -> Result<(Option<DateTime<Utc>>, Option<DateTime<Utc>>)> {
    let oldest = sqlx::query_as(
        r#"
        SELECT
            outbox.oldest_pending($1::timestamptz, $2::text[]),
            (SELECT min(i.created_at) FROM outbox.intent i
             WHERE i.state = 'staged'
               AND (cardinality($2::text[]) = 0 OR i.region = ''
                    OR i.region = ANY($2::text[])))
        "#,
    )
    .bind(now)
    .bind(regions)
    .fetch_one(conn)
    .await?;
    Ok(oldest)
}

/// Live queue depth across the transaction's tenants, for metrics: counts of non-final
/// states (each read through its partial index, never the finished history) and ages.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueDepth {
    /// Counts by live state and region.
    pub counts: Vec<StateCount>,
    /// Seconds the oldest claimable PENDING intent has waited.
    pub oldest_pending_age: Option<f64>,
    /// Seconds the oldest STAGED intent has waited.
    pub oldest_staged_age: Option<f64>,
    /// Ordering keys held back by their head (retrying, dead-lettered, NEEDS_RECONCILE).
    pub blocked_keys: i64,
    /// Queues paused by their policy, and queues at their concurrency or rate limit now:
    /// by kind for the kinds asked for, the others together.
    pub policed_queues: Vec<super::policy::QueuesOfKind>,
}

/// Reads [`QueueDepth`], its queues by kind for `labelled_kinds`.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn queue_depth(conn: &mut PgConnection, labelled_kinds: &[String]) -> Result<QueueDepth> {
    let counts: Vec<StateCount> = sqlx::query_as(
        r#"
        SELECT 'pending'::outbox.intent_state AS state, region, count(*) AS count
        FROM outbox.intent
        WHERE state = 'pending'
        GROUP BY region
        UNION ALL
        -- Each IN list is a partial index's predicate, so that index serves it
        -- (intent_lease_expires_at_idx, intent_tenant_state_idx). Under row-level security
        -- the planner scans a partial index only for a condition on one of its columns,
        -- hence the lease test (always true of a live lease, see its CHECK): without it,
        -- this count read the whole table (0.9 s per refresh at 1M finished rows).
        SELECT state, region, count(*) AS count
        FROM outbox.intent
        WHERE state IN ('leased', 'submitted')
          AND lease_expires_at IS NOT NULL
        GROUP BY state, region
        UNION ALL
        SELECT state, region, count(*) AS count
        FROM outbox.intent
        WHERE state IN ('needs_reconcile', 'dead_lettered', 'staged')
          -- An ordered dead letter given up by an operator is finished.
          AND (state <> 'dead_lettered' OR finished_at IS NULL)
        GROUP BY state, region
        UNION ALL
        SELECT state, region, count(*) AS count
        FROM outbox.intent
        WHERE state = 'waiting'
          AND ordering_key IS NOT NULL
        GROUP BY state, region
        "#,
    )
    .fetch_all(&mut *conn)
    .await?;
    let (oldest_pending_age, oldest_staged_age): (Option<f64>, Option<f64>) = sqlx::query_as(
        r#"
        SELECT
            extract(epoch FROM now() - outbox.oldest_pending(NULL, '{}'))::float8,
            (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM outbox.intent
             WHERE state = 'staged')
        "#,
    )
    .fetch_one(&mut *conn)
    .await?;
    let blocked_keys: i64 = sqlx::query_scalar(&format!("SELECT count(*) {BLOCKED_HEADS}"))
        .bind(Vec::<String>::new())
        .bind(None::<DateTime<Utc>>)
        .fetch_one(&mut *conn)
        .await?;
    let policed_queues = super::policy::paused_and_throttled(conn, labelled_kinds).await?;
    Ok(QueueDepth {
        counts,
        oldest_pending_age,
        oldest_staged_age,
        blocked_keys,
        policed_queues,
    })
}

/// Succeeds when the database answers and the connecting role may read the outbox (the
/// readiness check; `LIMIT 0` reads no row, so no tenant is needed).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn probe(pool: &sqlx::PgPool) -> Result<()> {
    sqlx::query("SELECT 1 FROM outbox.intent LIMIT 0")
        .execute(pool)
        .await?;
    Ok(())
}

/// The region of intent `id` (live or delivered) among the transaction's tenants' intents.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn region_of(conn: &mut PgConnection, id: IntentId) -> Result<Option<String>> {
    let region = sqlx::query_scalar("SELECT region FROM outbox.intents_by_id(ARRAY[$1::uuid])")
        .bind(id.0)
        .fetch_optional(conn)
        .await?;
    Ok(region)
}
