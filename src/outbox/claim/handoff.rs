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
//! `max_intents`, higher priorities first. A claimer waits only after a look found nothing
//! (or when its group had just drained the queue, `outbox::claim::drained`), so what it is
//! handed comes after everything it could have leased; the rest of the batch stays PENDING
//! and is announced as before. Claims of other replicas are woken by the announcement, as
//! before.
//!
//! A claimer is taken out of the registry by the enqueue that hands it intents, before
//! the insert, so no two enqueues lease to one call; a claimer whose wait ends meanwhile
//! waits for that enqueue's outcome (it has the intents if it committed, and looks again if
//! not). Leases no claimer received are given back (`store::release_leases`: PENDING again,
//! the attempt uncounted) and announced: those of a claimer whose call ended after it was
//! taken (cancelled, or tired of waiting for the enqueue's outcome, [`WITHDRAW_WAIT`]), and
//! those of an enqueue that lost the answer to its COMMIT. Only a call cancelled between
//! receiving its intents and answering loses them to lease expiry, as a Claim cancelled
//! after its statement committed does.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::oneshot;

use crate::outbox::clock::Clock;
use crate::outbox::notify::PendingSignal;
use crate::outbox::store::{self, Pools, TenantScope};
use crate::outbox::{Intent, IntentId, NewIntent, Schedule};

/// How long a claimer whose wait ended waits for the outcome of an enqueue that had taken
/// it. An insert and commit take milliseconds; past this the database is stalled, and the
/// claim answers without the intents, which are given back once that enqueue commits.
pub const WITHDRAW_WAIT: Duration = Duration::from_secs(1);

/// What becomes of leased intents no claimer received: given back (see the module note).
/// Called with the claimer's tenants and the intents, from synchronous code.
pub type Release = Arc<dyn Fn(&TenantScope, Vec<Intent>) + Send + Sync>;

/// The [`Release`] of a server: gives the leases back in a task of their own, counts them
/// into `given_back` and announces them as claimable. Where that fails they stay leased
/// until they expire.
pub fn give_back(
    pools: Pools,
    pending: PendingSignal,
    clock: Clock,
    given_back: Counter,
) -> Release {
    Arc::new(move |scope, intents| {
        let leases: Vec<_> = intents
            .iter()
            .filter_map(|i| i.lease_id.map(|lease| (i.id, lease)))
            .collect();
        if leases.is_empty() {
            return;
        }
        // Outside a runtime (it is shutting down) nobody would run the task: let them expire.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (pools, pending, clock, scope, given_back) = (
            pools.clone(),
            pending.clone(),
            clock.clone(),
            scope.clone(),
            given_back.clone(),
        );
        runtime.spawn(async move {
            match store::release_leases(&pools, &scope, &leases, clock.now()).await {
                Ok(0) => {}
                Ok(released) => {
                    tracing::debug!(released, "gave back leases no claimer received");
                    given_back.inc_by(released);
                    pending.announce();
                }
                Err(e) => tracing::warn!(
                    error.message = %e,
                    "cannot give back leases no claimer received; they expire instead"
                ),
            }
        });
    })
}

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
pub struct Handoffs {
    next_id: AtomicU64,
    waiting: Mutex<Vec<Waiting>>,
    release: Release,
}

impl std::fmt::Debug for Handoffs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoffs")
            .field("waiting", &self.lock().len())
            .finish_non_exhaustive()
    }
}

impl Handoffs {
    /// No claimer waiting yet; leases none received go to `release`.
    pub fn new(release: Release) -> Self {
        Self {
            next_id: AtomicU64::new(0),
            waiting: Mutex::default(),
            release,
        }
    }

    /// Registers a claimer for the length of one wait; it leaves when the [`Waiter`] is
    /// withdrawn or dropped.
    pub fn wait(&self, wanted: Wanted) -> Waiter<'_> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (answer, handed) = oneshot::channel();
        let scope = wanted.scope.clone();
        self.lock().push(Waiting { id, wanted, answer });
        Waiter {
            handoffs: self,
            id,
            scope,
            handed: Some(handed),
        }
    }

    /// Takes the waiting claimers `intents` of `tenant` go to, in order: each intent that
    /// may be handed off goes to the longest-waiting claimer that takes it and has room.
    /// `None` when nothing is handed off: nor is any of a batch with an idempotency key (a
    /// keyed insert may find its key held) or an ordering key (an ordered intent is PENDING
    /// only once it is its key's head).
    pub fn take(&self, tenant: &str, intents: &[NewIntent]) -> Option<Taken> {
        if intents
            .iter()
            .any(|i| i.idempotency_key.is_some() || i.ordering_key.is_some())
        {
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
        // Where the search for each (kind, region) resumes: a claimer passed over for one
        // (full, or not taking it) never takes it later in the batch, so the list is walked
        // at most once per (kind, region), not once per intent, while it is locked.
        let mut resume_at: HashMap<(&str, &str), usize> = HashMap::new();
        // Higher priorities first, as a claim takes them; equal ones in request order.
        let mut by_priority: Vec<usize> = (0..intents.len()).collect();
        by_priority.sort_by_key(|at| std::cmp::Reverse(intents[*at].priority));
        let mut lease_of: Vec<Option<usize>> = vec![None; intents.len()];
        for at in by_priority {
            let intent = &intents[at];
            if room == 0 || !matches!(intent.schedule, Schedule::Now) {
                continue;
            }
            let from = resume_at
                .entry((intent.kind.as_str(), intent.region.as_str()))
                .or_insert(0);
            // (A claimer whose call is gone has left the list: its Waiter was dropped.)
            let found = waiting[*from..]
                .iter()
                .zip(&counts[*from..])
                .position(|(w, n)| *n < w.wanted.max_intents && w.wanted.takes(tenant, intent));
            let Some(claimer) = found.map(|skipped| *from + skipped) else {
                *from = waiting.len();
                continue;
            };
            *from = claimer;
            counts[claimer] += 1;
            room -= 1;
            lease_of[at] = Some(claimer);
        }
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
        Some(Taken {
            claimers,
            lease_of,
            release: Arc::clone(&self.release),
        })
    }

    /// Gives back `intents` of `scope`, which no claimer received (those an enqueue
    /// whose COMMIT failed did not commit are left alone).
    pub fn release(&self, scope: &TenantScope, intents: Vec<Intent>) {
        (self.release)(scope, intents);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waiting>> {
        // The list stays consistent whatever panicked while it was held.
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Claimers taken by one enqueue, and which of its intents each is handed.
pub struct Taken {
    claimers: Vec<Waiting>,
    lease_of: Vec<Option<usize>>,
    release: Release,
}

impl std::fmt::Debug for Taken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taken")
            .field("claimers", &self.claimers)
            .field("lease_of", &self.lease_of)
            .finish_non_exhaustive()
    }
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
    /// are the batch's intent ids in order, `leased` the rows inserted LEASED; those of a
    /// claimer gone meanwhile are given back. (Dropping the `Taken` instead, when the
    /// enqueue failed, sends each claimer back to looking.)
    pub fn hand_over(self, ids: &[IntentId], leased: Vec<Intent>) {
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
        for (claimer, mut intents) in self.claimers.into_iter().zip(handed) {
            intents.sort_by_key(Intent::claim_order);
            // A claimer gone since it was taken: nobody has these leases.
            if let Err(intents) = claimer.answer.send(intents) {
                (self.release)(&claimer.wanted.scope, intents);
            }
        }
    }
}

/// One claimer's registration, for one wait.
#[derive(Debug)]
pub struct Waiter<'a> {
    handoffs: &'a Handoffs,
    id: u64,
    /// The claimer's tenants, to give back what it did not receive.
    scope: TenantScope,
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
    /// hands over, waited for up to [`WITHDRAW_WAIT`] (empty if it failed, if it took
    /// longer, or if [`Self::handed`] had the answer).
    pub async fn withdraw(mut self) -> Option<Vec<Intent>> {
        if self.leave() {
            return None;
        }
        // Left in `self` while waiting: a call cancelled now gives them back on drop.
        let Some(handed) = self.handed.as_mut() else {
            return Some(Vec::new());
        };
        let answer = match tokio::time::timeout(WITHDRAW_WAIT, &mut *handed).await {
            Ok(answer) => answer.unwrap_or_default(),
            // Closed first, so that the enqueue either handed them over already or gives
            // them back itself.
            Err(_) => {
                handed.close();
                handed.try_recv().unwrap_or_default()
            }
        };
        self.handed = None;
        Some(answer)
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
    /// A call that ends while it waits (cancelled, or its task dropped) leaves the
    /// registry, and gives back what an enqueue had handed it meanwhile.
    fn drop(&mut self) {
        if self.leave() {
            return;
        }
        if let Some(mut handed) = self.handed.take() {
            handed.close();
            if let Ok(intents) = handed.try_recv() {
                self.handoffs.release(&self.scope, intents);
            }
        }
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
            ordering_key: None,
            priority: 0,
            headers: BTreeMap::new(),
            max_attempts: 5,
            schedule: Schedule::Now,
        }
    }

    /// Registry whose given-back intents are dropped.
    fn handoffs() -> Handoffs {
        Handoffs::new(Arc::new(|_, _| {}))
    }

    /// Registry recording the ids it gives back.
    fn recording() -> (Handoffs, Arc<Mutex<Vec<IntentId>>>) {
        let given_back: Arc<Mutex<Vec<IntentId>>> = Arc::default();
        let record = Arc::clone(&given_back);
        let handoffs = Handoffs::new(Arc::new(move |scope, intents| {
            assert_eq!(scope, &TenantScope::one("t"), "the claimer's tenants");
            let mut record = record.lock().unwrap();
            record.extend(intents.iter().map(|i| i.id));
        }));
        (handoffs, given_back)
    }

    fn workers(taken: &Taken) -> Vec<Option<&str>> {
        taken.leases().map(|l| l.map(|(w, _)| w)).collect()
    }

    #[test]
    fn intents_go_to_the_longest_waiting_claimer_that_takes_them_up_to_its_room() {
        let handoffs = handoffs();
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
    fn higher_priorities_are_handed_off_first_as_a_claim_would_take_them() {
        let handoffs = handoffs();
        let _a = handoffs.wait(wanted("a", &[], 2));
        let prioritised = |priority: i16| NewIntent {
            priority,
            ..intent("x")
        };
        let batch = [
            prioritised(-10),
            prioritised(0),
            prioritised(10),
            prioritised(0),
        ];
        let taken = handoffs.take("t", &batch).unwrap();
        assert_eq!(
            workers(&taken),
            [None, Some("a"), Some("a"), None],
            "the highest, then the first of the next priority in request order"
        );
    }

    #[test]
    fn interleaved_kinds_and_regions_each_go_to_their_longest_waiting_claimer_with_room() {
        let handoffs = handoffs();
        let mut eu = wanted("eu", &["sms"], 2);
        eu.region = "eu".to_owned();
        let _eu = handoffs.wait(eu);
        let _sms = handoffs.wait(wanted("sms", &["sms"], 1));
        let _any = handoffs.wait(wanted("any", &[], 2));
        let in_region = |kind: &str, region: &str| {
            let mut i = intent(kind);
            region.clone_into(&mut i.region);
            i
        };
        let batch = [
            in_region("sms", "us"),
            intent("sms"),
            in_region("sms", "us"),
            intent("push"),
            intent("push"),
            in_region("sms", "us"),
            intent("sms"),
            intent("push"),
        ];
        let taken = handoffs.take("t", &batch).unwrap();
        assert_eq!(
            workers(&taken),
            [
                Some("sms"), // eu does not take region us
                Some("eu"),
                Some("any"), // sms is full
                Some("any"),
                None, // any is full, and the others take only sms
                None, // any and sms full, eu not in us: eu keeps its room for the next
                Some("eu"),
                None, // nobody has room
            ]
        );
    }

    #[test]
    fn nothing_is_handed_off_for_another_tenant_a_delay_or_an_idempotency_key() {
        let handoffs = handoffs();
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
        let handoffs = handoffs();
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
        let handoffs = handoffs();
        let mut waiter = handoffs.wait(wanted("a", &[], 10));
        drop(handoffs.take("t", &[intent("x")]).unwrap());
        assert_eq!(waiter.handed().await, None, "the enqueue failed");
        assert_eq!(waiter.withdraw().await, Some(Vec::new()));
    }

    #[test]
    fn a_dropped_claimer_is_never_taken() {
        let handoffs = handoffs();
        drop(handoffs.wait(wanted("a", &[], 10)));
        assert!(handoffs.take("t", &[intent("x")]).is_none());
    }

    #[test]
    fn leases_for_a_claimer_whose_call_ended_before_the_commit_are_given_back() {
        let (handoffs, given_back) = recording();
        let waiter = handoffs.wait(wanted("a", &[], 10));
        let taken = handoffs.take("t", &[intent("x")]).unwrap();
        drop(waiter); // the Claim was cancelled while the enqueue ran
        let id = IntentId(uuid::Uuid::now_v7());
        taken.hand_over(&[id], vec![crate::outbox::leased_intent(id)]);
        assert_eq!(*given_back.lock().unwrap(), [id], "nobody received it");
    }

    #[test]
    fn leases_handed_to_a_call_that_ends_before_it_reads_them_are_given_back() {
        let (handoffs, given_back) = recording();
        let waiter = handoffs.wait(wanted("a", &[], 10));
        let taken = handoffs.take("t", &[intent("x")]).unwrap();
        let id = IntentId(uuid::Uuid::now_v7());
        taken.hand_over(&[id], vec![crate::outbox::leased_intent(id)]);
        assert!(given_back.lock().unwrap().is_empty(), "the claimer has it");
        drop(waiter); // cancelled between the hand-over and its next poll
        assert_eq!(*given_back.lock().unwrap(), [id]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_claimer_stops_waiting_for_a_stalled_enqueue_which_then_gives_its_leases_back() {
        let (handoffs, given_back) = recording();
        let waiter = handoffs.wait(wanted("a", &[], 10));
        let taken = handoffs.take("t", &[intent("x")]).unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(
            waiter.withdraw().await,
            Some(Vec::new()),
            "answers without them"
        );
        assert_eq!(started.elapsed(), WITHDRAW_WAIT);
        let id = IntentId(uuid::Uuid::now_v7());
        taken.hand_over(&[id], vec![crate::outbox::leased_intent(id)]);
        assert_eq!(*given_back.lock().unwrap(), [id]);
    }
}
