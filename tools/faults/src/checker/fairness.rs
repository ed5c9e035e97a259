//! Tenant fairness (docs/flow-control.md): a claim shares its batch among the tenants it
//! serves, so the run's tenant is not served after another tenant's older backlog. The run
//! enqueues that backlog (`--backlog`, tenant `backlog`, the unlimited kind) before
//! any producer starts, and the workers' key serves both tenants. Served oldest first
//! across tenants, no intent of the run's tenant would be leased before the whole backlog
//! had been; served fairly, each is leased within moments, faults or not (a fault that
//! stops claims stops the backlog's too).
//!
//! So, from the database's log (`faults.flow_log`: a lease counts when its claim
//! committed, whether or not its answer arrived), with `end` the instant the backlog's
//! last intent was first leased: every intent of the run's tenant of the unlimited kind
//! (no queue limit, no ordering key holds it back) that became claimable more than
//! `SLACK_US` of a running PostgreSQL before `end` (crashes injected meanwhile do not
//! count) must have been first leased before `end`. Claimable: the commit of its
//! producer's transaction (`pg_xact_commit_timestamp`), or its direct Enqueue.

use std::collections::HashMap;

use uuid::Uuid;

use super::{Guarantee, Verdict, clock};
use crate::NOTICE_KIND;
use crate::cluster::{BACKLOG_TENANT, Snapshot, TENANT};
use crate::faults::{FaultKind, FaultRecord};

/// How long before the backlog's end an intent must have become claimable to be checked:
/// far above a fair claim's wait (tens of ms) and the seconds a fault can hold one intent
/// (a frozen replica's promotion), below the backlog's life (about a minute in CI).
pub(super) const SLACK_US: i64 = 10_000_000;

/// Fewest intents the check must see for it to mean anything.
pub(super) const MIN_CHECKED: u64 = 20;

/// Figures of the fairness check, for the report.
#[derive(Debug, Clone, Default)]
pub struct FairnessFigures {
    /// Intents of the backlog.
    pub backlog: u64,
    /// From the backlog's first lease to its last intent's first lease, µs.
    pub backlog_span_us: i64,
    /// Intents of the run's tenant checked (claimable `SLACK_US` before the end).
    pub checked: u64,
    /// Their wait from claimable to first lease, µs: median, 99th percentile, longest.
    pub p50_us: i64,
    pub p99_us: i64,
    pub max_us: i64,
}

pub(super) fn check_fairness(snapshot: &Snapshot, faults: &[FaultRecord], v: &mut Verdict) {
    let Some(flow) = &snapshot.flow else {
        return;
    };
    let backlog: Vec<Uuid> = snapshot
        .intents
        .values()
        .filter(|r| r.tenant_id == BACKLOG_TENANT)
        .map(|r| r.id)
        .collect();
    if backlog.is_empty() {
        return;
    }
    let mut first_lease: HashMap<Uuid, i64> = HashMap::new();
    for change in flow.changes.iter().filter(|c| c.minted) {
        first_lease
            .entry(change.intent_id)
            .and_modify(|t| *t = (*t).min(change.txn_us))
            .or_insert(change.txn_us);
    }
    let backlog_leases: Vec<i64> = backlog
        .iter()
        .filter_map(|id| first_lease.get(id).copied())
        .collect();
    let (Some(&start), Some(&end)) = (backlog_leases.iter().min(), backlog_leases.iter().max())
    else {
        v.violate(
            Guarantee::TenantFairness,
            None,
            "the database logged no lease of the backlog",
        );
        return;
    };
    let mut waits = Vec::new();
    let checked = snapshot
        .intents
        .values()
        .filter(|r| r.tenant_id == TENANT && r.kind == NOTICE_KIND && r.state != "discarded");
    for row in checked {
        let claimable = row.commit_us.unwrap_or(row.created_us);
        if end - claimable - crashed_between(faults, claimable, end) <= SLACK_US {
            continue;
        }
        match first_lease.get(&row.id) {
            Some(&leased) if leased <= end => waits.push((leased - claimable).max(0)),
            leased => v.violate(
                Guarantee::TenantFairness,
                Some(row.id),
                format!(
                    "claimable at {}, first leased {}, after every intent of {BACKLOG_TENANT}'s \
                     older backlog (the last first leased at {})",
                    clock(claimable),
                    leased.map_or("never".to_owned(), |t| format!("at {}", clock(*t))),
                    clock(end)
                ),
            ),
        }
    }
    waits.sort_unstable();
    let at =
        |q: f64| waits.get(((waits.len() as f64 * q) as usize).min(waits.len().saturating_sub(1)));
    let figures = FairnessFigures {
        backlog: backlog.len() as u64,
        backlog_span_us: end - start,
        checked: waits.len() as u64,
        p50_us: at(0.5).copied().unwrap_or(0),
        p99_us: at(0.99).copied().unwrap_or(0),
        max_us: waits.last().copied().unwrap_or(0),
    };
    if figures.checked < MIN_CHECKED {
        // Not a broken guarantee: a check not exercised, as `limits` reports one.
        v.violate(
            Guarantee::Consistency,
            None,
            format!(
                "only {} intents of {TENANT} ({NOTICE_KIND}) were leased while the backlog \
                 lasted ({:.1} s): too few to show fairness (a larger --backlog lasts longer)",
                figures.checked,
                figures.backlog_span_us as f64 / 1e6
            ),
        );
    }
    v.counts.fairness = Some(figures);
}

/// How long PostgreSQL was down (crashes injected, to their recovery) between `from` and
/// `to`, µs: no claim of either tenant can commit then.
fn crashed_between(faults: &[FaultRecord], from: i64, to: i64) -> i64 {
    faults
        .iter()
        .filter(|f| f.kind == FaultKind::PostgresCrash)
        .map(|f| (f.end.min(to) - f.start.max(from)).max(0))
        .sum()
}
