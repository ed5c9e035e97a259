//! Hand-off: an intent enqueued while a Claim of this server waits for one it matches is
//! inserted already LEASED to that claimer, and the Claim answers with it once the enqueue
//! has committed. No claim statement, no wake-up, no look: at a steady rate (the queue
//! drained, each intent taken as it comes) that is one statement per intent less, and the
//! claimer has the intent when its producer has the Enqueue's answer.
//!
//! Only what a look would have leased at that instant is handed off: intents due now (no
//! delay, no `available_at`), without an idempotency key (a key may deduplicate to an
//! intent that already exists), enqueued directly (two-phase ones are STAGED until their
//! producer commits), to a claimer whose tenants, region and kinds take them, up to its
//! `max_intents`. A claimer waits only after a look found nothing (or when its group had
//! just drained the queue, `outbox::drained`), so what it is handed comes after everything
//! it could have leased; the rest of the batch stays PENDING and is announced
//! as before. Claims of other replicas are woken by the announcement, as before.
//!
//! A claimer is taken out of the registry by the enqueue that hands it intents, before
//! the insert, so no two enqueues lease to one call; a claimer whose wait ends meanwhile
//! waits for that enqueue's outcome (it has the intents if it committed, and looks again if
//! not). A claimer whose call is cancelled after it was taken, or whose enqueue lost the
//! answer to its COMMIT, leaves its intents leased to nobody until the lease expires, as
//! with a Claim cancelled while its statement ran, or whose answer was lost.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;

use super::store::TenantScope;
use super::{Intent, IntentId, NewIntent, Schedule};

/// What a waiting claimer takes: its filters and the lease it asked for.
#[derive(Debug, Clone)]
pub struct Wanted {
    /// Tenants it may lease for.
    pub scope: TenantScope,
    /// Its region ('' = any).
    pub region: String,
    /// Its kinds (empty = all).
    pub kinds: Vec<String>,
    /// Worker the leases are for.
    pub worker_id: String,
    /// Lease length.
    pub lease_duration: Duration,
    /// Most intents it takes.
    pub max_intents: usize,
}

impl Wanted {
    /// Whether a look by this claimer would lease `intent` of `tenant` (the filters of
    /// `outbox.claim`).
    fn takes(&self, tenant: &str, intent: &NewIntent) -> bool {
        let tenant_ok = match &self.scope {
            TenantScope::All => true,
            TenantScope::Tenants(tenants) => tenants.iter().any(|t| t == tenant),
        };
        tenant_ok
            && (self.region.is_empty() || intent.region.is_empty() || intent.region == self.region)
            && (self.kinds.is_empty() || self.kinds.contains(&intent.kind))
    }
}

#[derive(Debug)]
struct Waiting {
    id: u64,
    wanted: Wanted,
    answer: oneshot::Sender<Vec<Intent>>,
}

/// The claims of this server waiting for intents, in the order they began waiting.
#[derive(Debug, Default)]
pub struct Handoffs {
    next_id: AtomicU64,
    waiting: Mutex<Vec<Waiting>>,
}

impl Handoffs {
    /// Registers a claimer for the length of one wait; it leaves when the [`Waiter`] is
    /// withdrawn or dropped.
    pub fn wait(&self, wanted: Wanted) -> Waiter<'_> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (answer, handed) = oneshot::channel();
        self.lock().push(Waiting { id, wanted, answer });
        Waiter {
            handoffs: self,
            id,
            handed: Some(handed),
        }
    }

    /// Takes the waiting claimers `intents` of `tenant` go to, in order: each intent that
    /// may be handed off goes to the longest-waiting claimer that takes it and has room.
    /// `None` when nothing is handed off.
    pub fn take(&self, tenant: &str, intents: &[NewIntent]) -> Option<Taken> {
        if intents.iter().any(|i| i.idempotency_key.is_some()) {
            return None;
        }
        let mut waiting = self.lock();
        if waiting.is_empty() {
            return None;
        }
        // First each intent's claimer, by its place in the list; then the claimers given
        // any leave the list.
        let mut counts = vec![0usize; waiting.len()];
        let mut room: usize = waiting.iter().map(|w| w.wanted.max_intents).sum();
        let lease_of: Vec<Option<usize>> = intents
            .iter()
            .map(|intent| {
                if room == 0 || !matches!(intent.schedule, Schedule::Now) {
                    return None;
                }
                // (A claimer whose call is gone has left the list: its Waiter was dropped.)
                let at = waiting.iter().zip(&counts).position(|(w, n)| {
                    *n < w.wanted.max_intents && w.wanted.takes(tenant, intent)
                })?;
                counts[at] += 1;
                room -= 1;
                Some(at)
            })
            .collect();
        if counts.iter().all(|n| *n == 0) {
            return None;
        }
        // Place in the list -> place among the claimers taken.
        let mut taken_at = vec![None; waiting.len()];
        let mut claimers = Vec::new();
        let mut kept = Vec::with_capacity(waiting.len());
        for (at, (w, n)) in waiting.drain(..).zip(&counts).enumerate() {
            if *n > 0 {
                taken_at[at] = Some(claimers.len());
                claimers.push(w);
            } else {
                kept.push(w);
            }
        }
        *waiting = kept;
        let lease_of = lease_of
            .into_iter()
            .map(|to| to.and_then(|at| taken_at[at]))
            .collect();
        Some(Taken { claimers, lease_of })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waiting>> {
        // The list stays consistent whatever panicked while it was held.
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Claimers taken by one enqueue, and which of its intents each is handed.
#[derive(Debug)]
pub struct Taken {
    claimers: Vec<Waiting>,
    lease_of: Vec<Option<usize>>,
}

impl Taken {
    /// The lease of each intent of the batch, in order: `None` for those left PENDING.
    pub fn leases(&self) -> impl Iterator<Item = Option<(&str, Duration)>> {
        self.lease_of.iter().map(|to| {
            to.map(|c| {
                let wanted = &self.claimers[c].wanted;
                (wanted.worker_id.as_str(), wanted.lease_duration)
            })
        })
    }

    /// Answers each claimer with its leased intents, once the enqueue has committed; `ids`
    /// are the batch's intent ids in order, `leased` the rows inserted LEASED. Returns how
    /// many intents reached a claimer still waiting for them. (Dropping the `Taken`
    /// instead, when the enqueue failed, sends each claimer back to looking.)
    pub fn hand_over(self, ids: &[IntentId], leased: Vec<Intent>) -> usize {
        let claimer_of: HashMap<IntentId, usize> = ids
            .iter()
            .zip(&self.lease_of)
            .filter_map(|(id, to)| to.map(|to| (*id, to)))
            .collect();
        let mut handed: Vec<Vec<Intent>> = self.claimers.iter().map(|_| Vec::new()).collect();
        for intent in leased {
            if let Some(to) = claimer_of.get(&intent.id) {
                handed[*to].push(intent);
            }
        }
        let mut delivered = 0;
        for (claimer, intents) in self.claimers.into_iter().zip(handed) {
            let n = intents.len();
            // A claimer gone since it was taken: its leases expire (see the module note).
            if claimer.answer.send(intents).is_ok() {
                delivered += n;
            }
        }
        delivered
    }
}

/// One claimer's registration, for one wait.
#[derive(Debug)]
pub struct Waiter<'a> {
    handoffs: &'a Handoffs,
    id: u64,
    /// `None` once [`Self::handed`] has had the answer (a receiver answers only once).
    handed: Option<oneshot::Receiver<Vec<Intent>>>,
}

impl Waiter<'_> {
    /// The intents an enqueue handed over; `None` when the enqueue that took this claimer
    /// failed (nothing was leased to it: look again). Pending for ever once answered.
    pub async fn handed(&mut self) -> Option<Vec<Intent>> {
        let Some(handed) = self.handed.as_mut() else {
            return std::future::pending().await;
        };
        let answer = handed.await.ok();
        self.handed = None;
        answer
    }

    /// Ends the wait: `None` when no enqueue had taken this claimer; else what that enqueue
    /// hands over, waited for (empty if it failed, or if [`Self::handed`] had the answer).
    pub async fn withdraw(mut self) -> Option<Vec<Intent>> {
        if self.leave() {
            return None;
        }
        match self.handed.take() {
            Some(handed) => Some(handed.await.unwrap_or_default()),
            None => Some(Vec::new()),
        }
    }

    /// Leaves the registry; false when an enqueue has taken this claimer already.
    fn leave(&self) -> bool {
        let mut waiting = self.handoffs.lock();
        match waiting.iter().position(|w| w.id == self.id) {
            Some(at) => {
                waiting.remove(at);
                true
            }
            None => false,
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn wanted(worker: &str, kinds: &[&str], max_intents: usize) -> Wanted {
        Wanted {
            scope: TenantScope::one("t"),
            region: String::new(),
            kinds: kinds.iter().map(|k| (*k).to_owned()).collect(),
            worker_id: worker.to_owned(),
            lease_duration: Duration::from_secs(30),
            max_intents,
        }
    }

    fn intent(kind: &str) -> NewIntent {
        NewIntent {
            kind: kind.to_owned(),
            payload: Vec::new(),
            content_type: String::new(),
            region: String::new(),
            idempotency_key: None,
            headers: BTreeMap::new(),
            max_attempts: 5,
            schedule: Schedule::Now,
        }
    }

    fn workers(taken: &Taken) -> Vec<Option<&str>> {
        taken.leases().map(|l| l.map(|(w, _)| w)).collect()
    }

    #[test]
    fn intents_go_to_the_longest_waiting_claimer_that_takes_them_up_to_its_room() {
        let handoffs = Handoffs::default();
        let _a = handoffs.wait(wanted("a", &["sms"], 1));
        let _b = handoffs.wait(wanted("b", &[], 2));
        let batch = [intent("email"), intent("sms"), intent("sms"), intent("x")];
        let taken = handoffs.take("t", &batch).unwrap();
        assert_eq!(
            workers(&taken),
            [Some("b"), Some("a"), Some("b"), None],
            "b takes any kind but only two; a only sms, and one"
        );
        assert_eq!(taken.leases().flatten().count(), 3);
        assert!(handoffs.take("t", &batch).is_none(), "both were taken");
    }

    #[test]
    fn nothing_is_handed_off_for_another_tenant_a_delay_or_an_idempotency_key() {
        let handoffs = Handoffs::default();
        let _a = handoffs.wait(wanted("a", &[], 10));
        assert!(handoffs.take("other", &[intent("x")]).is_none());
        let mut delayed = intent("x");
        delayed.schedule = Schedule::Delay(Duration::from_secs(1));
        assert!(handoffs.take("t", &[delayed]).is_none());
        let mut keyed = intent("x");
        keyed.idempotency_key = Some("k".to_owned());
        assert!(handoffs.take("t", &[keyed, intent("x")]).is_none());
        assert!(
            handoffs.take("t", &[intent("x")]).is_some(),
            "still waiting"
        );
    }

    #[tokio::test]
    async fn a_claimer_taken_before_it_withdraws_gets_what_the_enqueue_hands_over() {
        let handoffs = Handoffs::default();
        let waiter = handoffs.wait(wanted("a", &[], 10));
        let taken = handoffs.take("t", &[intent("x")]).unwrap();
        drop(taken); // the enqueue failed
        assert_eq!(waiter.withdraw().await, Some(Vec::new()));
        let waiter = handoffs.wait(wanted("a", &[], 10));
        assert_eq!(waiter.withdraw().await, None, "never taken");
        assert!(handoffs.take("t", &[intent("x")]).is_none(), "withdrawn");
    }

    #[tokio::test]
    async fn a_claimer_told_its_enqueue_failed_withdraws_without_waiting_again() {
        let handoffs = Handoffs::default();
        let mut waiter = handoffs.wait(wanted("a", &[], 10));
        drop(handoffs.take("t", &[intent("x")]).unwrap());
        assert_eq!(waiter.handed().await, None, "the enqueue failed");
        assert_eq!(waiter.withdraw().await, Some(Vec::new()));
    }

    #[test]
    fn a_dropped_claimer_is_never_taken() {
        let handoffs = Handoffs::default();
        drop(handoffs.wait(wanted("a", &[], 10)));
        assert!(handoffs.take("t", &[intent("x")]).is_none());
    }
}
