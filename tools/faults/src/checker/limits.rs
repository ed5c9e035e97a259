//! Queue limits (docs/flow-control.md): the run sets a concurrency limit on one kind and a
//! rate limit on another before any replica starts (`Cluster::limit_queues`), and checks
//! them here from `faults.flow_log`, which a trigger on `outbox.intent` writes in the very
//! transaction that changes an intent. Not the server's counters, not the journals: a
//! claim rolled back (a replica killed before its commit, a terminated session, a crashed
//! PostgreSQL) leaves neither leases nor log rows, and one committed leaves both, so a
//! replica killed while holding the queue's tokens can neither hide a lease nor free one.
//!
//! - concurrency: the running sum of the moves into (+1) and out of (-1) LEASED/SUBMITTED,
//!   in the order the statements made them (`clock_timestamp()`, then the log's sequence),
//!   never exceeds `max_in_flight`. A claim counts the queue's intents in flight after
//!   locking its policy row and writes its +1s after that, so each -1 it saw committed
//!   precedes them; a -1 it did not see can only lower the sum: no false alarm;
//! - rate: over every window that starts at a lease, the leases minted in it number at
//!   most `burst + rate × W (+ tolerance)`, W the window's length, each lease timed by its
//!   transaction's `now()`, the instant the claim counts the bucket's tokens at.
//!
//! The checks are worth something only if the log saw the leases: every lease of a limited
//! kind a worker journaled must be in it, and it must hold leases of both kinds.

use std::collections::{BTreeMap, HashSet};

use uuid::Uuid;

use super::{Guarantee, Observations, Verdict, clock};
use crate::cluster::{FlowChange, FlowLog, Snapshot};
use crate::journal::Event;

/// Slack of the rate check, in seconds of refill (`rate × RATE_TOLERANCE_S` leases). A
/// lease is timed by its claim's `now()`, its transaction's start, the time the claim
/// refills the bucket to; but claims reach the policy row in lock order, not start order.
/// One that began a little before the bucket's time (set by a claim that locked the row
/// first) gets no refill and leaves the time where it is: it spends tokens counted as of
/// that later time, so timed by its own start its leases look early by that lag, and a
/// window can seem to hold up to `rate × lag` more than the bound. The lag is what a claim
/// takes from its transaction's start to the queue (ms); the log measures its maximum
/// (`lag_us`), and the slack is that lag (plus 10 ms) where it exceeds 100 ms; tokens leaked
/// by a crashed claim or a double spend come in leases (up to the burst), well above it.
pub(super) const RATE_TOLERANCE_S: f64 = 0.1;

/// Figures of the concurrency check, for the report.
#[derive(Debug, Clone, Default)]
pub struct InFlightFigures {
    /// The limited kind.
    pub kind: String,
    /// Its `max_in_flight`.
    pub limit: i64,
    /// The most intents of it LEASED or SUBMITTED at once, per the log.
    pub most: i64,
    /// Moves logged.
    pub moves: u64,
}

/// Figures of the rate check, for the report.
#[derive(Debug, Clone, Default)]
pub struct RateFigures {
    /// The rate-limited kind.
    pub kind: String,
    /// Its `rate_per_second` and `burst`.
    pub rate: f64,
    pub burst: i64,
    /// Leases allowed over the bound (`rate ×` the larger of `RATE_TOLERANCE_S` and the
    /// measured lag plus 10 ms).
    pub tolerance: f64,
    /// Leases minted, per the log.
    pub leases: u64,
    /// From the first lease to the last, µs.
    pub span_us: i64,
    /// The most leases in a 1 s window starting at a lease.
    pub most_in_second: u64,
    /// The largest excess over `burst + rate × W` of any window (negative: under it).
    pub worst_excess: f64,
    /// The longest a claim began before one that locked the bucket ahead of it (see
    /// `RATE_TOLERANCE_S`), µs.
    pub lag_us: i64,
}

impl RateFigures {
    /// `burst + rate × W`.
    pub fn bound(&self, window_us: i64) -> f64 {
        self.burst as f64 + self.rate * window_us as f64 / 1e6
    }
}

/// Runs both checks when the run set limits.
pub(super) fn check_limits(snapshot: &Snapshot, observations: &Observations, v: &mut Verdict) {
    let Some(flow) = &snapshot.flow else {
        return;
    };
    check_log_complete(flow, observations, v);
    let limits = flow.limits;
    let moves: Vec<&FlowChange> = flow
        .changes
        .iter()
        .filter(|c| c.kind == limits.concurrency_kind && c.delta != 0)
        .collect();
    v.counts.in_flight = Some(check_in_flight(
        limits.concurrency_kind,
        limits.max_in_flight,
        &moves,
        v,
    ));
    let leases: Vec<&FlowChange> = flow
        .changes
        .iter()
        .filter(|c| c.kind == limits.rate_kind && c.minted)
        .collect();
    v.counts.rate = Some(check_rate(
        limits.rate_kind,
        limits.rate_per_second,
        limits.burst,
        &leases,
        v,
    ));
}

/// Every lease of a limited kind a worker journaled is in the log, and the log has leases
/// of both kinds: else the checks could pass on a log that missed what they check.
fn check_log_complete(flow: &FlowLog, observations: &Observations, v: &mut Verdict) {
    let limits = flow.limits;
    let logged: HashSet<Uuid> = flow.changes.iter().filter_map(|c| c.lease_id).collect();
    for (worker, events) in &observations.workers {
        for event in events {
            let Event::Claimed { leases, .. } = event else {
                continue;
            };
            for s in leases {
                let limited = s.kind == limits.concurrency_kind || s.kind == limits.rate_kind;
                if limited && !logged.contains(&s.lease) {
                    v.violate(
                        Guarantee::Consistency,
                        Some(s.intent),
                        format!(
                            "lease {} of {} journaled by {worker} is not in the database's \
                             flow log: the limit checks did not see it",
                            s.lease, s.kind
                        ),
                    );
                }
            }
        }
    }
    for kind in [limits.concurrency_kind, limits.rate_kind] {
        if !flow.changes.iter().any(|c| c.kind == kind && c.minted) {
            v.violate(
                Guarantee::Consistency,
                None,
                format!("the flow log has no lease of {kind}: its limit was not exercised"),
            );
        }
    }
}

/// The running sum of the moves into and out of LEASED/SUBMITTED, in the order the
/// statements made them: a violation each time it rises above `limit`.
fn check_in_flight(
    kind: &str,
    limit: i64,
    moves: &[&FlowChange],
    v: &mut Verdict,
) -> InFlightFigures {
    let mut ordered = moves.to_vec();
    ordered.sort_by_key(|c| (c.at_us, c.seq));
    let (mut running, mut most, mut over, mut negative) = (0i64, 0i64, false, false);
    for c in &ordered {
        running += i64::from(c.delta);
        most = most.max(running);
        if running > limit && !over {
            let lease = c
                .lease_id
                .map(|l| format!(" (lease {l})"))
                .unwrap_or_default();
            v.violate(
                Guarantee::ConcurrencyLimit,
                None,
                format!(
                    "{running} intents of {kind} LEASED or SUBMITTED at {}{lease}, over its \
                     max_in_flight {limit}",
                    clock(c.at_us)
                ),
            );
        }
        over = running > limit;
        if running < 0 && !negative {
            negative = true;
            v.violate(
                Guarantee::Consistency,
                None,
                format!(
                    "the flow log's count of {kind} in flight went below 0 at {}: it missed a move",
                    clock(c.at_us)
                ),
            );
        }
    }
    InFlightFigures {
        kind: kind.to_owned(),
        limit,
        most,
        moves: ordered.len() as u64,
    }
}

/// Leases per window against `burst + rate × W`: a violation for each lease time that
/// starts a window over the bound by more than the tolerance.
fn check_rate(
    kind: &str,
    rate: f64,
    burst: i64,
    leases: &[&FlowChange],
    v: &mut Verdict,
) -> RateFigures {
    let mut ordered = leases.to_vec();
    ordered.sort_by_key(|c| (c.txn_us, c.seq));
    let times: Vec<i64> = ordered.iter().map(|c| c.txn_us).collect();
    let lag_us = lag(leases);
    let mut figures = RateFigures {
        kind: kind.to_owned(),
        rate,
        burst,
        // The measured lag widens it when a loaded machine made it longer than assumed.
        tolerance: rate * RATE_TOLERANCE_S.max(lag_us as f64 / 1e6 + 0.01),
        leases: times.len() as u64,
        span_us: match (times.first(), times.last()) {
            (Some(first), Some(last)) => last - first,
            _ => 0,
        },
        most_in_second: most_within(&times, 1_000_000),
        worst_excess: f64::NEG_INFINITY,
        lag_us,
    };
    for w in over_bound(&times, rate, burst) {
        figures.worst_excess = figures.worst_excess.max(w.excess);
        if w.excess > figures.tolerance {
            v.violate(
                Guarantee::RateLimit,
                None,
                format!(
                    "{} leases of {kind} from {} to {} ({:.3} s), over burst + rate × W = {:.1} \
                     (tolerance {:.1}; claims began up to {:.1} ms before the bucket's time)",
                    w.count,
                    clock(w.start),
                    clock(w.end),
                    (w.end - w.start) as f64 / 1e6,
                    w.count as f64 - w.excess,
                    figures.tolerance,
                    figures.lag_us as f64 / 1e3
                ),
            );
        }
    }
    figures
}

/// The window starting at one lease time that is furthest over its bound.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Window {
    pub(super) start: i64,
    pub(super) end: i64,
    pub(super) count: u64,
    /// `count - (burst + rate × (end - start))`.
    pub(super) excess: f64,
}

/// For each distinct time in `times` (sorted, µs), the window starting there that exceeds
/// `burst + rate × W` the most: with `g(k) = k - rate × t_k`, the window from lease `i` to
/// lease `j` holds `j - i + 1` leases and is over its bound by `g(j) - g(i) + 1 - burst`,
/// so the best `j` is where `g` is largest from `i` on (a suffix maximum): O(n).
pub(super) fn over_bound(times: &[i64], rate: f64, burst: i64) -> Vec<Window> {
    let Some(&origin) = times.first() else {
        return vec![];
    };
    let g = |k: usize| k as f64 - rate * (times[k] - origin) as f64 / 1e6;
    let n = times.len();
    let mut best_from = vec![n - 1; n];
    for k in (0..n - 1).rev() {
        let next = best_from[k + 1];
        best_from[k] = if g(next) >= g(k) { next } else { k };
    }
    let mut out = Vec::new();
    for i in 0..times.len() {
        if i > 0 && times[i - 1] == times[i] {
            continue;
        }
        let j = best_from[i];
        out.push(Window {
            start: times[i],
            end: times[j],
            count: (j - i + 1) as u64,
            excess: g(j) - g(i) + 1.0 - burst as f64,
        });
    }
    out
}

/// The most of `times` (sorted) within `window` µs of one of them, counted from it.
pub(super) fn most_within(times: &[i64], window: i64) -> u64 {
    let (mut most, mut end) = (0, 0);
    for (i, &start) in times.iter().enumerate() {
        while end < times.len() && times[end] <= start + window {
            end += 1;
        }
        most = most.max(end - i);
    }
    most as u64
}

/// The longest a claim that minted `leases` began before a claim that locked the queue's
/// policy row ahead of it: in lock order (the log's sequence; each claim of the queue
/// holds the row to its commit), each claim's start against the latest start before it.
fn lag(leases: &[&FlowChange]) -> i64 {
    let mut claims: BTreeMap<i64, (i64, i64)> = BTreeMap::new();
    for c in leases {
        let entry = claims.entry(c.txid).or_insert((c.seq, c.txn_us));
        entry.0 = entry.0.min(c.seq);
    }
    let mut starts: Vec<(i64, i64)> = claims.into_values().collect();
    starts.sort_unstable();
    let (mut latest, mut most) = (i64::MIN, 0);
    for (_, start) in starts {
        most = most.max(latest.saturating_sub(start));
        latest = latest.max(start);
    }
    most
}
