//! The run's operator for ordering keys: an ordered intent that is DEAD_LETTERED or
//! NEEDS_RECONCILE holds its key (every later intent of the key stays WAITING) until an
//! operator decides. Workers dead-letter a few percent of intents and leave some payments
//! NEEDS_RECONCILE, so without one most keys would be blocked for most of the run and the
//! drain would never finish. While the load runs and during the drain this task does what
//! an operator watching blocked keys would: DEAD for a dead letter (which releases its
//! key), and for NEEDS_RECONCILE what the side-effect log (the workers' `performed` lines)
//! says, DELIVERED or DEAD, once it has been waiting longer than a stopped worker can
//! stay stopped. Every decision is in `outbox.resolution`; the checker reads them there.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use outboxd::proto::v1;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::Suite;
use crate::rpc::{CALL_TIMEOUT, Rpc, request};

/// Who the decisions are recorded as.
pub const ACTOR: &str = "outboxd-faults operator";

/// How often blocked keys are looked for.
const EVERY: Duration = Duration::from_millis(500);

/// How long a NEEDS_RECONCILE head waits for its last holder (who may still Ack it) before
/// the operator decides: longer than a worker stays SIGSTOPped (2 leases + 1.5 s).
const RECONCILE_AFTER_MS: i64 = 6_000;

/// How long a dead letter waits before it is released.
const RELEASE_AFTER_MS: i64 = 300;

/// What the operator decided during the run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Released {
    /// DEAD_LETTERED heads released with DEAD.
    pub dead_letters: u64,
    /// NEEDS_RECONCILE heads decided DELIVERED (the log shows the side effect).
    pub delivered: u64,
    /// NEEDS_RECONCILE heads decided DEAD (the log shows none).
    pub dead: u64,
    /// Decisions refused: the intent moved meanwhile (its holder's Ack, say), or no answer.
    pub refused: u64,
}

impl Suite {
    /// Releases blocked ordering keys until `stop`; what it decided.
    pub(super) async fn release_keys(
        self: Arc<Self>,
        dir: PathBuf,
        stop: CancellationToken,
    ) -> Released {
        let mut released = Released::default();
        let Ok(mut rpc) = Rpc::new(&self.direct_endpoints(), &self.cluster.keys.operator, 7) else {
            return released;
        };
        while !stop.is_cancelled() {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(EVERY) => {}
            }
            // PostgreSQL may be down (a crash fault): the next round tries again.
            let Ok(heads) = self.cluster.blocked_heads().await else {
                continue;
            };
            let dead_letters: Vec<Uuid> = heads
                .iter()
                .filter(|h| h.state == "dead_lettered" && h.age_ms >= RELEASE_AFTER_MS)
                .map(|h| h.id)
                .collect();
            let (applied, refused) = decide(
                &mut rpc,
                &dead_letters,
                v1::Decision::Dead,
                "dead letter released: it held its ordering key",
            )
            .await;
            released.dead_letters += applied;
            released.refused += refused;
            let undecided: HashSet<Uuid> = heads
                .iter()
                .filter(|h| h.state == "needs_reconcile" && h.age_ms >= RECONCILE_AFTER_MS)
                .map(|h| h.id)
                .collect();
            if undecided.is_empty() {
                continue;
            }
            let performed = performed_of(&dir.join("workers"), &undecided);
            let (delivered, dead): (Vec<Uuid>, Vec<Uuid>) =
                undecided.into_iter().partition(|id| performed.contains(id));
            let (applied, refused) = decide(
                &mut rpc,
                &delivered,
                v1::Decision::Delivered,
                "the side-effect log shows it performed; it held its ordering key",
            )
            .await;
            released.delivered += applied;
            released.refused += refused;
            let (applied, refused) = decide(
                &mut rpc,
                &dead,
                v1::Decision::Dead,
                "the side-effect log shows it never performed; it held its ordering key",
            )
            .await;
            released.dead += applied;
            released.refused += refused;
        }
        released
    }
}

/// Reconcile by ids; (applied, refused or unanswered).
async fn decide(rpc: &mut Rpc, ids: &[Uuid], decision: v1::Decision, reason: &str) -> (u64, u64) {
    if ids.is_empty() {
        return (0, 0);
    }
    let message = v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
            ids: ids.iter().map(Uuid::to_string).collect(),
            ..Default::default()
        })),
        decision: decision as i32,
        actor: ACTOR.to_owned(),
        reason: reason.to_owned(),
        limit: 0,
    };
    let called = rpc
        .call(Duration::from_secs(5), |mut client| {
            let request = request(message.clone(), CALL_TIMEOUT);
            async move { client.reconcile(request).await }
        })
        .await;
    match called {
        Ok(called) => {
            let applied = called
                .value
                .results
                .iter()
                .filter(|r| r.error.is_none())
                .count() as u64;
            (applied, ids.len() as u64 - applied)
        }
        Err(_) => (0, ids.len() as u64),
    }
}

/// Which of `wanted` some worker journaled as performed (the side-effect log). Reads only
/// the `performed` lines; a torn last line is skipped.
fn performed_of(workers: &Path, wanted: &HashSet<Uuid>) -> HashSet<Uuid> {
    let mut found = HashSet::new();
    let Ok(entries) = std::fs::read_dir(workers) else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        for line in text.lines().filter(|l| l.contains(r#""ev":"performed""#)) {
            if let Ok(crate::journal::Event::Performed { intent, .. }) = serde_json::from_str(line)
                && wanted.contains(&intent)
            {
                found.insert(intent);
            }
        }
    }
    found
}
