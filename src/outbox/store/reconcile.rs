//! Operator decisions on intents awaiting one (NEEDS_RECONCILE, DEAD_LETTERED), each
//! recorded in `outbox.resolution` in the same statement that applies it.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::PENDING_CHANNEL;
use super::current::current_intents;
use super::ordering::advance_keys;
use crate::outbox::{Decision, IntentId, IntentState, ItemError, ItemResult, Result};

/// Which intents a decision applies to.
#[derive(Debug, Clone)]
pub enum ReconcileTarget {
    /// These ids, each reported in request order, and (if not empty) each one's
    /// `updated_at` as the caller saw it: one changed since is not decided.
    Ids(Vec<IntentId>, Vec<DateTime<Utc>>),
    /// Every intent matching, oldest first, up to `limit`.
    Filter {
        /// States to match (of those the decision applies to).
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
    /// Who decided, as the caller named them.
    pub actor: &'a str,
    /// The name of the API key that made the call.
    pub api_key: &'a str,
    /// Why.
    pub reason: &'a str,
    /// Current time override (tests).
    pub now: Option<DateTime<Utc>>,
}

/// The states a decision may be applied to: anything awaiting one, except that DEAD on a
/// dead letter would change nothing (but for one holding its ordering key, see the
/// statements); CANCEL, what was never leased or waits to be leased again.
fn from_states(decision: Decision) -> &'static [IntentState] {
    match decision {
        Decision::Delivered | Decision::Requeue => {
            &[IntentState::NeedsReconcile, IntentState::DeadLettered]
        }
        Decision::Dead => &[IntentState::NeedsReconcile],
        Decision::Cancel => &[
            IntentState::Staged,
            IntentState::Waiting,
            IntentState::Pending,
        ],
    }
}

/// A decision on the intents of a list of ids.
const RESOLVE_BY_IDS: &str = include_str!("sql/resolve_by_ids.sql");

/// A CANCEL by filter's ordering keys, locked before its rows ([`lock_keys_of`]).
const FILTER_KEY_LOCKS: &str = include_str!("sql/filter_key_locks.sql");

/// A decision on the intents a filter matches.
const RESOLVE_BY_FILTER: &str = include_str!("sql/resolve_by_filter.sql");

#[derive(sqlx::FromRow)]
struct ResolveRow {
    id: Uuid,
    applied: bool,
    state: Option<IntentState>,
    tenant_id: Option<String>,
    ordering_key: Option<String>,
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
    // When the caller said when it read each intent: the instant, by id.
    let seen: std::collections::HashMap<Uuid, DateTime<Utc>> = match &params.target {
        ReconcileTarget::Ids(ids, seen) => ids
            .iter()
            .map(|id| id.0)
            .zip(seen.iter().copied())
            .collect(),
        ReconcileTarget::Filter { .. } => std::collections::HashMap::new(),
    };
    let query = match params.target.clone() {
        ReconcileTarget::Ids(ids, seen) => {
            let ids: Vec<Uuid> = ids.into_iter().map(|id| id.0).collect();
            if params.decision == Decision::Cancel {
                lock_keys_of(conn, &ids).await?;
            }
            decision_statement(RESOLVE_BY_IDS, allowed, &params)
                .bind(ids)
                .bind(seen)
                .bind(params.api_key)
        }
        ReconcileTarget::Filter {
            states,
            kind,
            region,
            created_before,
            limit,
        } => {
            let locked: Option<Vec<i64>> = if params.decision == Decision::Cancel {
                Some(
                    sqlx::query_scalar(FILTER_KEY_LOCKS)
                        .bind(allowed)
                        .bind(&states)
                        .bind(kind.as_deref())
                        .bind(region.as_deref())
                        .bind(created_before)
                        .bind(params.key_regions)
                        .bind(limit)
                        .fetch_all(&mut *conn)
                        .await?,
                )
            } else {
                None
            };
            decision_statement(RESOLVE_BY_FILTER, allowed, &params)
                .bind(states)
                .bind(kind)
                .bind(region)
                .bind(created_before)
                .bind(limit)
                .bind(locked)
                .bind(params.api_key)
        }
    };
    let rows = query.fetch_all(&mut *conn).await?;
    // A decided ordered intent lets its key move on (DELIVERED, DEAD), or takes its place
    // in it again (REQUEUE: WAITING, PENDING at once if it is the key's first).
    let keys: Vec<(&str, &str)> = rows
        .iter()
        .filter_map(|r| Some((r.tenant_id.as_deref()?, r.ordering_key.as_deref()?)))
        .collect();
    let heads = advance_keys(conn, &keys, params.now).await?;
    // The state of each item not applied, as it is now (`super::current`).
    let unapplied: Vec<Uuid> = rows.iter().filter(|r| !r.applied).map(|r| r.id).collect();
    let current = current_intents(conn, &unapplied, params.key_regions).await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let id = IntentId(row.id);
            let state = match row.state {
                Some(IntentState::Waiting) if heads.contains(&row.id) => Some(IntentState::Pending),
                Some(state) => Some(state),
                None => current.get(&row.id).map(|c| c.state),
            };
            let stale = match (seen.get(&row.id), current.get(&row.id)) {
                (Some(seen), Some(now)) => now.updated_at != *seen,
                _ => false,
            };
            let error = match state {
                _ if row.applied => None,
                None => Some(ItemError::not_found(id)),
                Some(state) if stale => Some(ItemError::changed_since_read(id, state)),
                Some(state) if current.get(&row.id).is_some_and(|c| c.given_up) => {
                    Some(ItemError::invalid_state(
                        id,
                        state,
                        "DEAD was decided on this ordered dead letter and its ordering key \
                         moved on: that decision is final",
                    ))
                }
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

/// The first arguments of a decision statement, `$1`–`$7` (resolve_by_ids.sql).
fn decision_statement<'q>(
    sql: &'q str,
    allowed: &'static [IntentState],
    params: &ReconcileParams<'q>,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, ResolveRow, sqlx::postgres::PgArguments> {
    sqlx::query_as::<_, ResolveRow>(sql)
        .bind(allowed)
        .bind(params.decision.as_str())
        .bind(params.actor)
        .bind(params.reason)
        .bind(params.now)
        .bind(PENDING_CHANNEL)
        .bind(params.key_regions)
}

/// The locks of the ordering keys of these intents, sorted and in one round, taken by a
/// CANCEL before it locks any of their rows: an Ack that delivered a key's head holds the
/// key's lock and then makes the key's next WAITING intent PENDING, so a CANCEL that locked
/// that intent first and then asked for the key (`advance_keys`) deadlocked with it. Of
/// every state (an intent may move into one the CANCEL takes meanwhile); a key's tenant
/// and name never change. By filter, filter_key_locks.sql takes them.
async fn lock_keys_of(conn: &mut PgConnection, ids: &[Uuid]) -> Result<()> {
    // Sorted, then locked: PostgreSQL evaluates a volatile select-list function after the
    // sort below it.
    sqlx::query(
        r#"
        SELECT pg_advisory_xact_lock(k.lock_id)
        FROM (
            SELECT DISTINCT outbox.ordering_lock(i.tenant_id, i.ordering_key) AS lock_id
            FROM outbox.intent i
            WHERE i.id = ANY($1) AND i.ordering_key IS NOT NULL
        ) k
        ORDER BY k.lock_id
        "#,
    )
    .bind(ids)
    .execute(conn)
    .await?;
    Ok(())
}

fn describe(states: &[IntentState]) -> String {
    states
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(" or ")
}
