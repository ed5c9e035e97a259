//! The producers' side: which intents had to be delivered (committed transactions, per
//! the producers' own rows, and acknowledged direct enqueues) and which never may be
//! (aborted transactions), checked against the database's final state.

use std::collections::{HashMap, HashSet};

use uuid::Uuid;

use super::{Guarantee, Observations, Verdict, count_retry, not_lost};
use crate::cluster::Snapshot;
use crate::journal::Event;

/// What the producers' side establishes about the intents that must not be delivered.
pub(super) struct Produced {
    /// Intents of transactions that aborted.
    pub(super) aborted: HashSet<Uuid>,
}

pub(super) fn check_producers(
    snapshot: &Snapshot,
    obs: &Observations,
    v: &mut Verdict,
) -> Produced {
    let mut staged: HashMap<i64, Vec<Uuid>> = HashMap::new();
    let mut committed_logged = Vec::new();
    let mut chosen_rollbacks = HashSet::new();
    let mut direct_ok = HashSet::new();
    for (_, events) in &obs.producers {
        for event in events {
            match event {
                Event::Staged {
                    order,
                    intents,
                    tries,
                    deduplicated,
                    ..
                } => {
                    staged.insert(*order, intents.clone());
                    count_retry(v, "Enqueue (two-phase)", *tries);
                    if *tries > 1 && *deduplicated > 0 {
                        v.counts.enqueue_replays += 1;
                    }
                }
                Event::Committed { order, .. } => committed_logged.push(*order),
                Event::RolledBack {
                    order: Some(order),
                    reason,
                    ..
                } if reason == "chosen" => {
                    chosen_rollbacks.insert(*order);
                }
                Event::DirectEnqueued {
                    intents,
                    tries,
                    deduplicated,
                    ..
                } => {
                    direct_ok.extend(intents.iter().copied());
                    count_retry(v, "Enqueue (direct)", *tries);
                    if *tries > 1 && *deduplicated > 0 {
                        v.counts.enqueue_replays += 1;
                    }
                }
                Event::DirectUnknown { .. } => v.counts.direct_unknown += 1,
                _ => {}
            }
        }
    }
    v.counts.txn_committed = snapshot
        .committed_orders
        .values()
        .filter(|ids| !ids.is_empty())
        .count() as u64;
    v.counts.txn_rolled_back = chosen_rollbacks.len() as u64;
    // Staged, then neither committed nor rolled back by choice: killed, terminated, crashed.
    v.counts.txn_died = staged
        .keys()
        .filter(|o| !snapshot.committed_orders.contains_key(o) && !chosen_rollbacks.contains(o))
        .count() as u64;
    v.counts.direct_acknowledged = direct_ok.len() as u64;

    // Acknowledged COMMITs are PostgreSQL's promise; the producer's rows prove it held.
    for order in &committed_logged {
        if !snapshot.committed_orders.contains_key(order) {
            v.violate(
                Guarantee::NoneLost,
                None,
                format!("producer order {order}: COMMIT answered OK, but its rows are gone"),
            );
        }
    }
    let committed: HashSet<Uuid> = snapshot
        .committed_orders
        .values()
        .flatten()
        .copied()
        .collect();
    for (order, ids) in &staged {
        if let Some(linked) = snapshot.committed_orders.get(order) {
            let (a, b): (HashSet<_>, HashSet<_>) = (ids.iter().collect(), linked.iter().collect());
            if a != b {
                v.violate(
                    Guarantee::Consistency,
                    None,
                    format!("order {order}: Enqueue returned {ids:?} but the transaction linked {linked:?}"),
                );
            }
        }
    }
    let mut aborted: HashSet<Uuid> = staged
        .iter()
        .filter(|(order, _)| !snapshot.committed_orders.contains_key(order))
        .flat_map(|(_, ids)| ids.iter().copied())
        .collect();

    let mut must_deliver: HashSet<Uuid> = committed.clone();
    must_deliver.extend(direct_ok.iter().copied());
    for id in &must_deliver {
        match snapshot.intents.get(id) {
            None => v.violate(
                Guarantee::NoneLost,
                Some(*id),
                "enqueue acknowledged (or its transaction committed) but the intent does not exist",
            ),
            Some(row) if !not_lost(&row.state) => v.violate(
                Guarantee::NoneLost,
                Some(*id),
                format!(
                    "committed, but ended {} after the drain (attempts {}, last error {:?})",
                    row.state, row.attempts, row.last_error
                ),
            ),
            Some(_) => {}
        }
    }
    // The database's own view, independent of the journals.
    for row in snapshot.intents.values() {
        if !row.two_phase {
            v.counts.direct += 1;
            if !not_lost(&row.state) && !must_deliver.contains(&row.id) {
                v.violate(
                    Guarantee::NoneLost,
                    Some(row.id),
                    format!("direct intent ended {} after the drain", row.state),
                );
            }
            continue;
        }
        match row.xact.as_deref() {
            Some("committed") => {
                v.counts.two_phase_committed += 1;
                // Journaled as staged in a transaction that did not commit: reported once,
                // with its diagnosis, by the aborted-intents check below.
                if !committed.contains(&row.id) && !aborted.contains(&row.id) {
                    v.violate(
                        Guarantee::Consistency,
                        Some(row.id),
                        "its producer transaction committed, but did not link it (unknown intent)",
                    );
                }
                if !not_lost(&row.state) && !must_deliver.contains(&row.id) {
                    v.violate(
                        Guarantee::NoneLost,
                        Some(row.id),
                        format!("transaction committed, but ended {}", row.state),
                    );
                }
            }
            Some("aborted") => {
                v.counts.two_phase_aborted += 1;
                aborted.insert(row.id);
                if committed.contains(&row.id) {
                    v.violate(
                        Guarantee::Consistency,
                        Some(row.id),
                        "pg_xact_status says aborted, but the producer's rows committed",
                    );
                }
            }
            other => v.violate(
                Guarantee::Consistency,
                Some(row.id),
                format!(
                    "producer transaction status {other:?} after the drain (state {})",
                    row.state
                ),
            ),
        }
    }
    for id in &aborted {
        match snapshot.intents.get(id) {
            Some(row) if row.state != "discarded" || row.attempts != 0 => {
                let diagnosis = if row.xact.as_deref() == Some("committed") {
                    format!(
                        " pg_xact_status({}) says committed, yet the producer's rows of that \
                         transaction never committed: another transaction was given the same \
                         xid (PostgreSQL reassigns, after crash recovery, xids whose WAL was \
                         lost in the crash), and the intent followed that transaction",
                        row.txn_xid.as_deref().unwrap_or("?")
                    )
                } else {
                    String::new()
                };
                v.violate(
                    Guarantee::AbortedNeverClaimed,
                    Some(*id),
                    format!(
                        "its transaction aborted, but it is {} with {} attempts.{diagnosis}",
                        row.state, row.attempts
                    ),
                );
            }
            Some(_) => {}
            None => v.violate(
                Guarantee::Consistency,
                Some(*id),
                "staged (Enqueue answered OK), then vanished from outbox.all_intents",
            ),
        }
    }
    Produced { aborted }
}
