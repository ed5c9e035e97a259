//! Intents as they are now, read in a statement of their own, for the items a batch
//! statement (a settle, a decision) did not apply. Not joined in that statement: it reads
//! under the snapshot it started with, so after waiting on a row lock (its own first
//! attempt's, a worker's Ack, another operator's decision) it would still see the intent
//! as it was before, and report that. A new statement (READ COMMITTED) sees the committed
//! outcome.

use std::collections::HashMap;

use sqlx::PgConnection;
use uuid::Uuid;

use crate::outbox::{IntentState, Result};

/// An intent as it is now.
#[derive(sqlx::FromRow, Debug, Clone, Copy)]
pub struct Current {
    /// The intent.
    pub id: Uuid,
    /// Its state.
    pub state: IntentState,
    /// Its live or last lease.
    pub lease_id: Option<Uuid>,
    /// Its last claim took its last attempt: a RETRY from that lease dead-letters it.
    pub attempts_used_up: bool,
    /// Its last state change.
    pub updated_at: chrono::DateTime<chrono::Utc>,
    /// Its lease's expiry, while it has one.
    pub lease_expires_at: Option<chrono::DateTime<chrono::Utc>>,
    /// An ordered dead letter an operator gave up (DEAD): its key has moved on.
    pub given_up: bool,
}

/// The intents of `ids` the transaction's tenants see, within `key_regions` (the caller's
/// API key's; empty: any): an intent outside them is not found, as another tenant's is.
/// Delivered intents moved to the history are found too. No round trip for no ids.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn current_intents(
    conn: &mut PgConnection,
    ids: &[Uuid],
    key_regions: &[String],
) -> Result<HashMap<Uuid, Current>> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let current = sqlx::query_as::<_, Current>(
        r#"
        SELECT i.id, i.state, i.lease_id, i.attempts >= i.max_attempts AS attempts_used_up,
               i.updated_at, i.lease_expires_at,
               (i.state = 'dead_lettered' AND i.ordering_key IS NOT NULL
                AND i.finished_at IS NOT NULL) AS given_up
        FROM outbox.intents_by_id($1) i
        WHERE (cardinality($2::text[]) = 0 OR i.region = '' OR i.region = ANY($2::text[]))
        "#,
    )
    .bind(ids)
    .bind(key_regions)
    .fetch_all(conn)
    .await?;
    Ok(current.into_iter().map(|c| (c.id, c)).collect())
}
