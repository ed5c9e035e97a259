//! Claim: lease a batch of claimable intents in one statement with `FOR UPDATE SKIP LOCKED`,
//! in one round trip.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::access::{TenantScope, on_live_connection, scope_settings};
use super::{intent_columns, millis};
use crate::outbox::{Intent, Result};

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
    /// Current time override (tests).
    pub now: Option<DateTime<Utc>>,
}

/// The claim function's call: `$1` tenants, `$2` cross-tenant, `$3` worker, `$4` region,
/// `$5` kinds, `$6` most intents, `$7` lease milliseconds, `$8` request id, `$9` now (or
/// NULL).
macro_rules! claim_call {
    () => {
        "outbox.claim($1, $2, $3, $4, $5, $6, $7, $8, $9)"
    };
}

/// [`claim_call!`], for the benchmark's raw-SQL ceiling (the same call, no service).
pub const CLAIM_CALL: &str = claim_call!();

/// Leases up to `max_intents` claimable intents of `scope`, oldest `available_at` first,
/// minting a fresh lease id for each and counting the attempt. With a `request_id` that
/// already leased intents for this worker, returns those live leases instead of leasing
/// more. One round trip: `outbox.claim` runs in its own transaction, committed before this
/// returns (the statement and why it is shaped so: migration
/// `20261201000007_claim_and_ack_in_one_round_trip`).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn claim_intents(
    pool: &PgPool,
    scope: &TenantScope,
    params: ClaimParams<'_>,
) -> Result<Vec<Intent>> {
    let (tenants, cross) = scope_settings(scope);
    // Run again when the connection turns out dead. Had the lost call run after all, its
    // leases, never handed to anyone, expire back to PENDING like a crashed worker's (as
    // when the reply to a COMMIT is lost), and a retry with the same request id gets them.
    let mut intents: Vec<Intent> = on_live_connection(pool, || {
        sqlx::query_as(concat!(
            "SELECT ",
            intent_columns!("i"),
            " FROM ",
            claim_call!(),
            " i"
        ))
        .bind(&tenants)
        .bind(cross)
        .bind(params.worker_id)
        .bind(params.region)
        .bind(params.kinds)
        .bind(params.max_intents)
        .bind(millis(params.lease_duration))
        .bind(params.request_id)
        .bind(params.now)
        .fetch_all(pool)
    })
    .await?;
    intents.sort_by_key(|i| (i.available_at, i.id));
    Ok(intents)
}

/// How long until the next PENDING intent of `scope` matching the claim's filters becomes
/// due, if one is scheduled in the future; lets a long-polling claimer sleep exactly that
/// long. One round trip (`outbox.next_due_in`).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn next_due_in(
    pool: &PgPool,
    scope: &TenantScope,
    params: &ClaimParams<'_>,
) -> Result<Option<Duration>> {
    let (tenants, cross) = scope_settings(scope);
    let seconds: Option<f64> = on_live_connection(pool, || {
        sqlx::query_scalar("SELECT outbox.next_due_in($1, $2, $3, $4, $5)")
            .bind(&tenants)
            .bind(cross)
            .bind(params.region)
            .bind(params.kinds)
            .bind(params.now)
            .fetch_one(pool)
    })
    .await?;
    Ok(seconds.map(|s| Duration::from_secs_f64(s.max(0.0))))
}
