//! Operator decisions on intents awaiting one (NEEDS_RECONCILE, DEAD_LETTERED), each
//! recorded in `outbox.resolution` in the same statement that applies it.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::current::current_intents;
use super::{PENDING_CHANNEL, in_key_regions};
use crate::outbox::{Decision, IntentId, IntentState, ItemError, ItemResult, Result};

/// Which intents a decision applies to.
#[derive(Debug, Clone)]
pub enum ReconcileTarget {
    /// These ids, each reported in request order.
    Ids(Vec<IntentId>),
    /// Every intent matching, oldest first, up to `limit`.
    Filter {
        /// States to match (subset of NEEDS_RECONCILE, DEAD_LETTERED).
        states: Vec<IntentState>,
        /// Only this kind.
        kind: Option<String>,
        /// Only this region.
        region: Option<String>,
        /// Only intents enqueued before.
        created_before: Option<DateTime<Utc>>,
        /// Most intents to resolve.
        limit: i64,
    },
}

/// Inputs of [`resolve_intents`].
#[derive(Debug, Clone)]
pub struct ReconcileParams<'a> {
    /// What to resolve.
    pub target: ReconcileTarget,
    /// The ruling.
    pub decision: Decision,
    /// Only intents in these regions, the caller's API key's (empty: any); the others are
    /// NOT_FOUND.
    pub key_regions: &'a [String],
    /// Who decided.
    pub actor: &'a str,
    /// Why.
    pub reason: &'a str,
    /// Current time override (tests).
    pub now: Option<DateTime<Utc>>,
}

/// The states a decision may be applied to: anything awaiting one, except that DEAD on a
/// dead letter would change nothing.
fn from_states(decision: Decision) -> &'static [IntentState] {
    match decision {
        Decision::Delivered | Decision::Requeue => {
            &[IntentState::NeedsReconcile, IntentState::DeadLettered]
        }
        Decision::Dead => &[IntentState::NeedsReconcile],
    }
}

/// The transition and its record, shared by both targets; `target(id, state)` must be
/// defined before it and select the rows to change `FOR UPDATE`.
macro_rules! resolve_and_record {
    () => {
        r#"
        resolved AS (
            UPDATE outbox.intent i
            SET state = CASE $2
                    WHEN 'delivered' THEN 'delivered'
                    WHEN 'requeue' THEN 'pending'
                    ELSE 'dead_lettered'
                END::outbox.intent_state,
                attempts = CASE WHEN $2 = 'requeue' THEN 0 ELSE i.attempts END,
                available_at = CASE WHEN $2 = 'requeue' THEN coalesce($5::timestamptz, now())
                                    ELSE i.available_at END,
                finished_at = CASE WHEN $2 = 'delivered' THEN coalesce($5::timestamptz, now()) END,
                lease_id = NULL,
                lease_expires_at = NULL,
                updated_at = coalesce($5::timestamptz, now())
            FROM target
            WHERE i.id = target.id
            RETURNING i.id, i.tenant_id, i.state, target.state AS from_state
        ),
        recorded AS (
            INSERT INTO outbox.resolution (tenant_id, intent_id, from_state, decision, actor, reason,
                                           resolved_at)
            SELECT tenant_id, id, from_state, $2, $3, $4, coalesce($5::timestamptz, now())
            FROM resolved
            RETURNING intent_id
        ),
        woken AS (
            SELECT pg_notify($6, '') WHERE $2 = 'requeue' AND EXISTS (SELECT 1 FROM resolved)
        )
        "#
    };
}

#[derive(sqlx::FromRow)]
struct ResolveRow {
    id: Uuid,
    applied: bool,
    state: Option<IntentState>,
}

/// Applies `decision` to the target intents that await a decision, recording who, when
/// and why for each, on `conn` (in the caller's scoped transaction). By id, an intent in
/// another state is reported `INVALID_STATE` with the state it is in and one that does not
/// exist `NOT_FOUND`; by filter, only intents that were resolved are reported.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn resolve_intents(
    conn: &mut PgConnection,
    params: ReconcileParams<'_>,
) -> Result<Vec<ItemResult>> {
    let allowed = from_states(params.decision);
    let sql = match params.target {
        ReconcileTarget::Ids(_) => RESOLVE_BY_IDS,
        ReconcileTarget::Filter { .. } => RESOLVE_BY_FILTER,
    };
    let query = sqlx::query_as::<_, ResolveRow>(sql)
        .bind(allowed)
        .bind(params.decision.as_str())
        .bind(params.actor)
        .bind(params.reason)
        .bind(params.now)
        .bind(PENDING_CHANNEL)
        .bind(params.key_regions);
    let query = match params.target {
        ReconcileTarget::Ids(ids) => query.bind(ids.into_iter().map(|id| id.0).collect::<Vec<_>>()),
        ReconcileTarget::Filter {
            states,
            kind,
            region,
            created_before,
            limit,
        } => query
            .bind(states)
            .bind(kind)
            .bind(region)
            .bind(created_before)
            .bind(limit),
    };
    let rows = query.fetch_all(&mut *conn).await?;
    // The state of each item not applied, as it is now (`super::current`).
    let unapplied: Vec<Uuid> = rows.iter().filter(|r| !r.applied).map(|r| r.id).collect();
    let current = current_intents(conn, &unapplied, params.key_regions).await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let id = IntentId(row.id);
            let state = row.state.or_else(|| current.get(&row.id).map(|c| c.state));
            let error = match state {
                _ if row.applied => None,
                None => Some(ItemError::not_found(id)),
                // Passed over, then moved where the decision applies (a worker's Fail, say):
                // INVALID_STATE would contradict the state it names.
                Some(state) if allowed.contains(&state) => {
                    Some(ItemError::changed_meanwhile(id, state))
                }
                Some(state) => Some(ItemError::invalid_state(
                    id,
                    state,
                    &format!(
                        "{} applies only to {}",
                        params.decision.as_str(),
                        describe(allowed)
                    ),
                )),
            };
            ItemResult {
                intent_id: id,
                applied: error.is_none(),
                state,
                error,
                lease_expires_at: None,
                traceparent: None,
            }
        })
        .collect())
}

fn describe(states: &[IntentState]) -> String {
    states
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(" or ")
}

const RESOLVE_BY_IDS: &str = concat!(
    r#"
    WITH input AS (
        SELECT * FROM unnest($8::uuid[]) WITH ORDINALITY AS t(id, ord)
    ),
    target AS (
        SELECT i.id, i.state
        FROM outbox.intent i
        JOIN input ON input.id = i.id
        WHERE i.state = ANY($1)
          AND "#,
    in_key_regions!("i", "$7"),
    r#"
        FOR UPDATE OF i
    ),
    "#,
    resolve_and_record!(),
    r#"
    SELECT input.id, resolved.id IS NOT NULL AS applied, resolved.state
    FROM input
    LEFT JOIN resolved ON resolved.id = input.id
    CROSS JOIN (SELECT count(*) FROM recorded) AS r
    CROSS JOIN (SELECT count(*) FROM woken) AS w
    ORDER BY input.ord
    "#
);

const RESOLVE_BY_FILTER: &str = concat!(
    r#"
    WITH target AS (
        SELECT i.id, i.state
        FROM outbox.intent i
        WHERE i.state = ANY($1)
          AND i.state = ANY($8)
          AND ($9::text IS NULL OR i.kind = $9)
          AND ($10::text IS NULL OR i.region = $10)
          AND ($11::timestamptz IS NULL OR i.created_at < $11)
          AND "#,
    in_key_regions!("i", "$7"),
    r#"
        ORDER BY i.id
        LIMIT $12
        FOR UPDATE SKIP LOCKED
    ),
    "#,
    resolve_and_record!(),
    r#"
    SELECT resolved.id, true AS applied, resolved.state
    FROM resolved
    CROSS JOIN (SELECT count(*) FROM recorded) AS r
    CROSS JOIN (SELECT count(*) FROM woken) AS w
    ORDER BY resolved.id
    "#
);
