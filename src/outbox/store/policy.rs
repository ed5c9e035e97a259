//! Queue policies (docs/flow-control.md): set by operators, with every change recorded;
//! applied by `outbox.claim` in the claim's own transaction, so a change holds from the
//! next claim of every replica.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::outbox::{Error, FieldViolation, Reason, Result};

/// Most queue policies of one tenant, as many as its queues may be: every read of the
/// policies counts each one's live leases.
const MAX_POLICIES: i64 = 1_000;

/// What an operator sets: the whole policy of one queue (a tenant's kind).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyParams<'a> {
    /// The queue's tenant.
    pub tenant: &'a str,
    /// The queue's kind.
    pub kind: &'a str,
    /// No leases while set.
    pub paused: bool,
    /// Most intents LEASED or SUBMITTED at once.
    pub max_in_flight: Option<i32>,
    /// Leases per second and the bucket's size.
    pub rate: Option<(f64, i32)>,
    /// Who, as the caller named them.
    pub actor: &'a str,
    /// The name of the API key that made the call.
    pub api_key: &'a str,
    /// Why.
    pub reason: &'a str,
    /// The `updated_at` of the policy the caller read: the change applies only while the
    /// queue's policy is that one (None: whatever it is, or none).
    pub expected_updated_at: Option<DateTime<Utc>>,
    /// Current time override (tests).
    pub now: Option<DateTime<Utc>>,
}

/// A queue's policy and its live figures.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct QueuePolicy {
    /// The queue's tenant.
    pub tenant_id: String,
    /// The queue's kind.
    pub kind: String,
    /// No leases while set.
    pub paused: bool,
    /// Most intents in flight.
    pub max_in_flight: Option<i32>,
    /// Leases per second.
    pub rate_per_second: Option<f64>,
    /// The bucket's size.
    pub burst: Option<i32>,
    /// Who set it last, as the caller named them.
    pub updated_by: String,
    /// The name of the API key that set it last (NULL for policies set before outboxd kept it).
    pub updated_by_key: Option<String>,
    /// Why.
    pub reason: String,
    /// When.
    pub updated_at: DateTime<Utc>,
    /// Intents of the queue LEASED or SUBMITTED now.
    pub in_flight: i64,
    /// Leases the bucket allows now (with a rate).
    pub tokens: Option<f64>,
}

/// The policies of the transaction's tenants with their live figures; `$1` a kind or NULL.
const POLICIES: &str = r#"
    SELECT p.tenant_id, p.kind, p.paused, p.max_in_flight, p.rate_per_second, p.burst,
           p.updated_by, p.updated_by_key, p.reason, p.updated_at,
           outbox.queue_in_flight(p.tenant_id, p.kind) AS in_flight,
           outbox.bucket_tokens(p, coalesce($2, now())) AS tokens
    FROM outbox.queue_policy p
    WHERE ($1::text IS NULL OR p.kind = $1)
"#;

/// Which of [`POLICIES`] make a page, by tenant and kind (`$3`, `$4`: the tenant and kind it
/// begins after, or NULL; `$5` the reply's budget in bytes): up to the policy whose weight
/// (its texts and 512 bytes for the rest, more than it takes on the wire) would pass the
/// budget, at least one. Weighed before the live figures are read, for the page alone.
const PAGE_OF_POLICIES: &str = r#"
    weighed AS (
        SELECT p.tenant_id, p.kind,
               sum(512 + octet_length(p.tenant_id) + octet_length(p.kind)
                   + octet_length(p.updated_by) + coalesce(octet_length(p.updated_by_key), 0)
                   + octet_length(p.reason))
                   OVER (ORDER BY p.tenant_id, p.kind ROWS UNBOUNDED PRECEDING) AS through,
               row_number() OVER (ORDER BY p.tenant_id, p.kind) AS n
        FROM outbox.queue_policy p
        WHERE ($1::text IS NULL OR p.kind = $1)
          AND ($3::text IS NULL OR (p.tenant_id, p.kind) > ($3::text, $4::text))
    ),
    kept AS (
        SELECT tenant_id, kind FROM weighed WHERE n = 1 OR through <= $5
    )
"#;

/// Replaces the policy of a queue and records the change; returns the policy now in force
/// (`Ok(Ok(policy))`). With `expected_updated_at`, only if the queue's policy is still the
/// one last updated then, checked by the upsert itself: otherwise nothing is changed nor
/// recorded, and the answer is `Ok(Err(current))`, the policy in force (None: the queue
/// has none). Each change's `updated_at` is later than the one before (by a microsecond
/// at least, whatever the clock says), so an instant names one version of the policy.
/// The bucket keeps its tokens (at most the new burst), so that setting a policy again
/// grants no burst.
///
/// # Errors
/// [`Error::LimitExceeded`] (`TOO_MANY_QUEUES`) for a new policy of a tenant that has
/// `MAX_POLICIES` (1,000); [`Error::Database`].
pub async fn set_queue_policy(
    conn: &mut PgConnection,
    p: PolicyParams<'_>,
) -> Result<std::result::Result<QueuePolicy, Option<QueuePolicy>>> {
    // New policies of one tenant take turns to the commit, and the count below, a statement
    // after the lock, sees the last one's: two at once could both find room for one.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('outbox.queue_policy/' || $1, 0))")
        .bind(p.tenant)
        .execute(&mut *conn)
        .await?;
    let (policies, this_one): (i64, bool) = sqlx::query_as(
        "SELECT count(*), coalesce(bool_or(kind = $2), false)
         FROM outbox.queue_policy WHERE tenant_id = $1",
    )
    .bind(p.tenant)
    .bind(p.kind)
    .fetch_one(&mut *conn)
    .await?;
    // A change expecting a policy the queue does not have is refused below, not counted.
    if policies >= MAX_POLICIES && !this_one && p.expected_updated_at.is_none() {
        return Err(Error::LimitExceeded(
            Reason::TooManyQueues,
            vec![FieldViolation::new(
                "kind",
                format!(
                    "tenant {:?} has {MAX_POLICIES} queue policies, the most it may have (as \
                     many as its queues); its policies may still be changed",
                    p.tenant
                ),
            )],
        ));
    }
    let (rate, burst) = p.rate.unzip();
    // With $11, a queue without a policy inserts nothing, and an update applies only to
    // the version last updated at $11 (the row as it is now, locked: a change committed
    // since is seen). No row changed: nothing is recorded.
    let changed = sqlx::query(
        r#"
        WITH clock AS (SELECT coalesce($8::timestamptz, now()) AS now),
        changed AS (
            INSERT INTO outbox.queue_policy AS q
                (tenant_id, kind, paused, max_in_flight, rate_per_second, burst,
                 updated_by, updated_by_key, reason, updated_at)
            SELECT $1, $2, $3, $4, $5, $6, $7, $10, $9, clock.now FROM clock
            WHERE $11::timestamptz IS NULL
               OR EXISTS (SELECT 1 FROM outbox.queue_policy e
                          WHERE e.tenant_id = $1 AND e.kind = $2)
            ON CONFLICT (tenant_id, kind) DO UPDATE
            SET paused = excluded.paused,
                max_in_flight = excluded.max_in_flight,
                rate_per_second = excluded.rate_per_second,
                burst = excluded.burst,
                tokens = CASE WHEN excluded.rate_per_second IS NULL THEN NULL ELSE q.tokens END,
                tokens_at = CASE WHEN excluded.rate_per_second IS NULL THEN NULL
                                 ELSE q.tokens_at END,
                updated_by = excluded.updated_by,
                updated_by_key = excluded.updated_by_key,
                reason = excluded.reason,
                updated_at = greatest(excluded.updated_at, q.updated_at + interval '1 microsecond')
            WHERE $11::timestamptz IS NULL OR q.updated_at = $11
            RETURNING q.*
        )
        INSERT INTO outbox.queue_policy_change
            (tenant_id, kind, paused, max_in_flight, rate_per_second, burst, actor, reason,
             changed_at, api_key)
        SELECT tenant_id, kind, paused, max_in_flight, rate_per_second, burst, updated_by,
               reason, updated_at, updated_by_key
        FROM changed
        "#,
    )
    .bind(p.tenant)
    .bind(p.kind)
    .bind(p.paused)
    .bind(p.max_in_flight)
    .bind(rate)
    .bind(burst)
    .bind(p.actor)
    .bind(p.now)
    .bind(p.reason)
    .bind(p.api_key)
    .bind(p.expected_updated_at)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    let policy: Option<QueuePolicy> = sqlx::query_as(&format!("{POLICIES} AND p.tenant_id = $3"))
        .bind(p.kind)
        .bind(p.now)
        .bind(p.tenant)
        .fetch_optional(&mut *conn)
        .await?;
    match policy {
        Some(policy) if changed => Ok(Ok(policy)),
        current => Ok(Err(current)),
    }
}

/// Where a page of policies begins: after this tenant's queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyCursor {
    /// The tenant of the last policy of the previous page.
    pub tenant: String,
    /// Its kind.
    pub kind: String,
}

impl PolicyCursor {
    /// The page token naming it: its tenant and kind, which hold no comma.
    pub fn token(&self) -> String {
        format!("{},{}", self.tenant, self.kind)
    }

    /// The cursor a [`Self::token`] names, if `token` is one.
    pub fn from_token(token: &str) -> Option<Self> {
        let (tenant, kind) = token.split_once(',')?;
        let names = crate::outbox::is_name(tenant, 64) && crate::outbox::is_name(kind, 256);
        names.then(|| Self {
            tenant: tenant.to_owned(),
            kind: kind.to_owned(),
        })
    }
}

/// One page of [`list_queue_policies`].
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyPage {
    /// The policies, by tenant and kind.
    pub policies: Vec<QueuePolicy>,
    /// Where the next page begins, when more policies follow.
    pub next: Option<PolicyCursor>,
}

/// The policies of the transaction's tenants (of `kind`, if given) after `after`, by tenant
/// and kind, as many as weigh at most `budget` bytes of a reply (at least one): an
/// all-tenant key's listing grows with the tenants.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn list_queue_policies(
    conn: &mut PgConnection,
    kind: Option<&str>,
    after: Option<&PolicyCursor>,
    budget: usize,
    now: Option<DateTime<Utc>>,
) -> Result<PolicyPage> {
    use sqlx::{FromRow, Row};
    let page = format!(
        "WITH {PAGE_OF_POLICIES}
         SELECT q.*, (SELECT count(*) FROM weighed) > (SELECT count(*) FROM kept) AS more
         FROM ({POLICIES}) q
         JOIN kept USING (tenant_id, kind)
         ORDER BY q.tenant_id, q.kind"
    );
    let rows = sqlx::query(&page)
        .bind(kind)
        .bind(now)
        .bind(after.map(|a| a.tenant.as_str()))
        .bind(after.map(|a| a.kind.as_str()))
        .bind(i64::try_from(budget).unwrap_or(i64::MAX))
        .fetch_all(&mut *conn)
        .await?;
    let more = match rows.first() {
        Some(row) => row.try_get("more")?,
        None => false,
    };
    let policies: Vec<QueuePolicy> = rows
        .iter()
        .map(QueuePolicy::from_row)
        .collect::<sqlx::Result<_>>()?;
    let next = policies.last().filter(|_| more).map(|last| PolicyCursor {
        tenant: last.tenant_id.clone(),
        kind: last.kind.clone(),
    });
    Ok(PolicyPage { policies, next })
}

/// How many queues are paused, and how many are at their limit now (in flight at the
/// maximum, or less than one token), across the transaction's tenants, for the gauges: by
/// kind for `labelled_kinds`, the other kinds together.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn paused_and_throttled(
    conn: &mut PgConnection,
    labelled_kinds: &[String],
) -> Result<Vec<QueuesOfKind>> {
    let counts = sqlx::query_as(&format!(
        "SELECT CASE WHEN p.kind = ANY ($3) THEN p.kind END AS kind,
                count(*) FILTER (WHERE p.paused) AS paused,
                count(*) FILTER (WHERE NOT p.paused
                                   AND (p.in_flight >= p.max_in_flight OR p.tokens < 1))
                    AS throttled
         FROM ({POLICIES}) p
         GROUP BY 1"
    ))
    .bind(None::<&str>)
    .bind(None::<DateTime<Utc>>)
    .bind(labelled_kinds)
    .fetch_all(&mut *conn)
    .await?;
    Ok(counts)
}

/// Queues paused and queues at their limit, of one kind (`None`: every kind not named).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct QueuesOfKind {
    pub kind: Option<String>,
    pub paused: i64,
    pub throttled: i64,
}
