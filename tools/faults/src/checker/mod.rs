//! The checks, run after the drain on three sources that do not depend on each other: the
//! database's final state (`outbox.all_intents`, with `pg_xact_status` of every producer
//! transaction), the producers' own tables (which transactions committed), and what every
//! producer and worker journaled (leases, side effects, Acks, Fails).
//!
//! Lease times are compared on the server's clock: a lease's claim instant is its
//! `lease_expires_at` minus the duration asked for (both computed from one `now()`). Client
//! times (when a Fail was sent) come from the same machine clock, compared with a small
//! tolerance.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use uuid::Uuid;

use crate::cluster::Snapshot;
use crate::faults::FaultRecord;
use crate::journal::{self, Event};
use crate::processes::UnexpectedExit;

pub use fairness::FairnessFigures;
pub use limits::{InFlightFigures, RateFigures};

mod duplicates;
mod fairness;
mod leases;
mod limits;
mod ordering;
mod producers;
#[cfg(test)]
mod tests;

/// Slack between a client's clock reading and the server's `now()`, in µs.
const CLOCK_TOLERANCE_US: i64 = 5_000;

/// The guarantee a violation breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Guarantee {
    /// A committed (or acknowledged direct) intent did not end delivered, dead-lettered or
    /// needing reconcile.
    NoneLost,
    /// An intent of an aborted transaction was claimed or performed.
    AbortedNeverClaimed,
    /// Two live leases on one intent.
    NoOverlappingLeases,
    /// A stale lease's Ack or Fail was accepted.
    StaleSettleRejected,
    /// The holder's own Ack was refused LEASE_LOST although it applied, or although the
    /// holder still held the intent (README, "Lost responses" and "Late reports").
    HolderAckRefused,
    /// A SUBMITTED intent was handed to another worker without an operator decision.
    SubmittedNotReHanded,
    /// An ordered intent was first leased before an intent of its key that committed
    /// earlier had finished (delivered, or released by an operator).
    KeyOrder,
    /// Leases of two intents of one ordering key were live at once.
    KeyOneAtATime,
    /// A duplicate side effect that no fault explains.
    DuplicatesExplained,
    /// The three sources disagree in a way no fault explains.
    Consistency,
    /// An OK arrived before its change was committed (read back from another session).
    OkCommittedOnArrival,
    /// More intents of a queue LEASED or SUBMITTED at once than its `max_in_flight`.
    ConcurrencyLimit,
    /// More leases of a queue in a window than its `burst + rate × W`.
    RateLimit,
    /// An intent of the run's tenant first leased after another tenant's older backlog.
    TenantFairness,
}

impl Guarantee {
    /// Every guarantee, in report order.
    pub const ALL: [Guarantee; 14] = [
        Self::NoneLost,
        Self::AbortedNeverClaimed,
        Self::NoOverlappingLeases,
        Self::StaleSettleRejected,
        Self::SubmittedNotReHanded,
        Self::KeyOrder,
        Self::KeyOneAtATime,
        Self::HolderAckRefused,
        Self::DuplicatesExplained,
        Self::Consistency,
        Self::OkCommittedOnArrival,
        Self::ConcurrencyLimit,
        Self::RateLimit,
        Self::TenantFairness,
    ];

    /// Row label in the report.
    pub fn label(self) -> &'static str {
        match self {
            Self::NoneLost => "committed intents lost",
            Self::AbortedNeverClaimed => "aborted intents claimed or performed",
            Self::NoOverlappingLeases => "overlapping live leases",
            Self::StaleSettleRejected => "stale Ack/Fail accepted",
            Self::HolderAckRefused => "holder's own Ack refused LEASE_LOST",
            Self::SubmittedNotReHanded => "SUBMITTED intents re-handed w/o operator",
            Self::KeyOrder => "ordered intents leased before an earlier one finished",
            Self::KeyOneAtATime => "live leases of one ordering key at once",
            Self::DuplicatesExplained => "duplicates no fault explains",
            Self::Consistency => "inconsistent observations",
            Self::OkCommittedOnArrival => "OKs not committed when answered",
            Self::ConcurrencyLimit => "times a queue's concurrency limit was exceeded",
            Self::RateLimit => "windows over a queue's rate limit",
            Self::TenantFairness => "intents served after another tenant's older backlog",
        }
    }
}

/// One broken guarantee, with its evidence.
#[derive(Debug, Clone)]
pub struct Violation {
    /// Which guarantee.
    pub guarantee: Guarantee,
    /// The intent concerned.
    pub intent: Option<Uuid>,
    /// The evidence.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.intent {
            Some(id) => write!(f, "[{:?}] intent {id}: {}", self.guarantee, self.detail),
            None => write!(f, "[{:?}] {}", self.guarantee, self.detail),
        }
    }
}

/// Everything the producers and workers journaled, by process.
#[derive(Debug, Default)]
pub struct Observations {
    /// (process, events) of every producer generation and the idle session.
    pub producers: Vec<(String, Vec<Event>)>,
    /// (worker id, events) of every worker generation.
    pub workers: Vec<(String, Vec<Event>)>,
}

impl Observations {
    /// Reads `dir/producers/*.jsonl` and `dir/workers/*.jsonl`.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            producers: read_dir(&dir.join("producers"))?,
            workers: read_dir(&dir.join("workers"))?,
        })
    }
}

fn read_dir(dir: &Path) -> anyhow::Result<Vec<(String, Vec<Event>)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "jsonl") {
            let name = path
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            out.push((name, journal::read(&path)?));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Numbers for the report.
#[derive(Debug, Default)]
pub struct Counts {
    /// Intents of committed two-phase transactions.
    pub two_phase_committed: u64,
    /// Intents of aborted two-phase transactions (rolled back, killed, crashed).
    pub two_phase_aborted: u64,
    /// Direct intents in the database.
    pub direct: u64,
    /// Direct intents whose Enqueue was acknowledged to the producer.
    pub direct_acknowledged: u64,
    /// Direct enqueues that never got a definite answer.
    pub direct_unknown: u64,
    /// Producer transactions: committed (per the tables), rolled back by choice, died.
    pub txn_committed: u64,
    /// Rolled back by the producer's choice.
    pub txn_rolled_back: u64,
    /// Died: killed producer or backend, crash, or Enqueue never answered.
    pub txn_died: u64,
    /// Final states.
    pub states: BTreeMap<String, u64>,
    /// Leases seen by workers.
    pub leases: u64,
    /// Side effects performed.
    pub performed: u64,
    /// Acks answered OK / LEASE_LOST / without a definite answer.
    pub acks_ok: u64,
    /// Late Acks rejected with LEASE_LOST (each checked to be stale).
    pub acks_lease_lost: u64,
    /// Acks never answered.
    pub acks_unknown: u64,
    /// Fails answered LEASE_LOST.
    pub fails_lease_lost: u64,
    /// Leases the worker found lost (its handler cancelled, nothing reported for them).
    pub lost: u64,
    /// Lease pairs checked for overlap.
    pub lease_pairs: u64,
    /// Calls that succeeded only after retries (lost responses, replicas down), by RPC.
    pub retried: BTreeMap<&'static str, u64>,
    /// Transient errors seen by clients, by code/reason.
    pub transient_errors: BTreeMap<String, u64>,
    /// Retried Enqueues answered "deduplicated": the attempt whose response was lost had
    /// been applied, and the idempotency keys returned its intents.
    pub enqueue_replays: u64,
    /// Leases a retried Claim answered that an earlier attempt had minted: the lost
    /// attempt's leases, returned by its `request_id`.
    pub claim_replays: u64,
    /// Leases an Enqueue minted for a Claim waiting for them (the hand-off).
    pub handed_off: u64,
    /// OKs of MarkSubmitted, Ack and Fail read back from another session at once.
    pub read_back: u64,
    /// Latency (µs) of answered Ack attempts, by replica index.
    pub ack_latency: BTreeMap<usize, Vec<i64>>,
    /// Intents with an ordering key (any state).
    pub ordered: u64,
    /// Ordering keys with committed intents.
    pub ordering_keys: u64,
    /// Pairs of intents of one key whose commit order is certain, checked for order.
    pub order_pairs: u64,
    /// Pairs of leases of different intents of one key, checked for overlap.
    pub key_lease_pairs: u64,
    /// The concurrency-limited queue, per the database's log (None: no limits set).
    pub in_flight: Option<InFlightFigures>,
    /// The rate-limited queue, per the database's log.
    pub rate: Option<RateFigures>,
    /// The run's tenant beside another's backlog, per the database's log.
    pub fairness: Option<FairnessFigures>,
}

/// The outcome of the checks.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Numbers.
    pub counts: Counts,
    /// Broken guarantees.
    pub violations: Vec<Violation>,
    /// Duplicate side effects by cause.
    pub duplicates: BTreeMap<&'static str, u64>,
    /// NEEDS_RECONCILE intents and whether the side-effect log shows them performed.
    pub reconcile: Vec<(Uuid, bool)>,
}

impl Verdict {
    fn violate(&mut self, guarantee: Guarantee, intent: Option<Uuid>, detail: impl Into<String>) {
        self.violations.push(Violation {
            guarantee,
            intent,
            detail: detail.into(),
        });
    }

    /// Total duplicate side effects.
    pub fn duplicate_total(&self) -> u64 {
        self.duplicates.values().sum()
    }
}

/// `HH:MM:SS.mmm` UTC of a µs timestamp.
pub fn clock(us: i64) -> String {
    chrono::DateTime::from_timestamp_micros(us)
        .map(|t| t.format("%H:%M:%S%.3f").to_string())
        .unwrap_or_else(|| us.to_string())
}

/// Whether a committed intent ended where the guarantee allows. A live state (the drain
/// did not finish) is not "lost": the run fails on the drain instead, and the report
/// counts those intents as still live.
fn not_lost(state: &str) -> bool {
    matches!(
        state,
        "delivered"
            | "dead_lettered"
            | "needs_reconcile"
            | "staged"
            | "pending"
            | "leased"
            | "submitted"
            | "waiting"
    )
}

/// Runs every check.
pub fn check(
    snapshot: &Snapshot,
    observations: &Observations,
    faults: &[FaultRecord],
    exits: &[UnexpectedExit],
) -> Verdict {
    let mut verdict = Verdict::default();
    for row in snapshot.intents.values() {
        *verdict.counts.states.entry(row.state.clone()).or_default() += 1;
    }
    let produced = producers::check_producers(snapshot, observations, &mut verdict);
    let leases = leases::collect_leases(observations, &mut verdict);
    leases::check_leases(snapshot, &produced, &leases, faults, exits, &mut verdict);
    leases::check_final_states(snapshot, &leases, &mut verdict);
    ordering::check_ordering(snapshot, observations, &leases, &mut verdict);
    check_read_backs(observations, &mut verdict);
    limits::check_limits(snapshot, observations, &mut verdict);
    fairness::check_fairness(snapshot, faults, &mut verdict);
    verdict
}

/// Every OK a worker read back must show its change already committed.
fn check_read_backs(observations: &Observations, v: &mut Verdict) {
    for (worker, events) in &observations.workers {
        for event in events {
            if let Event::ReadBack {
                t,
                intent,
                call,
                seen,
                committed,
                ..
            } = event
            {
                v.counts.read_back += 1;
                if !committed {
                    let detail = format!(
                        "{worker}'s {call:?} answered OK, yet read back at {} it was still {seen}",
                        clock(*t)
                    );
                    v.violate(Guarantee::OkCommittedOnArrival, Some(*intent), detail);
                }
            }
        }
    }
}

fn count_retry(v: &mut Verdict, rpc: &'static str, tries: u32) {
    if tries > 1 {
        *v.counts.retried.entry(rpc).or_default() += 1;
    }
}

/// Counts errors by `Code/REASON` (the prefix of `rpc::describe`), also when wrapped in
/// "no answer after N tries: …".
fn count_errors(v: &mut Verdict, errors: &[String]) {
    for e in errors {
        let e = e.split_once("tries: ").map_or(e.as_str(), |(_, last)| last);
        let key = e.split(':').next().unwrap_or(e).to_owned();
        *v.counts.transient_errors.entry(key).or_default() += 1;
    }
}
