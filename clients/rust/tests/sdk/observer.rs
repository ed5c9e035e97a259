//! The `WorkerObserver` hook: what it is told about each lease, and in which order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outboxd_client::proto::FailOutcome;
use outboxd_client::{
    Answer, ClaimEvent, Failure, IntentState, Job, LeaseCall, LeaseId, NewIntent, Outbox, Worker,
    WorkerObserver,
};

use crate::Running;
use crate::harness::{connection, kind, wait_for, wait_state};

/// One event as the recorder keeps it.
#[derive(Clone, Debug, PartialEq)]
pub enum Observed {
    /// A Claim's `request_id` and leases (intent id, lease id).
    Claimed(Option<String>, Vec<(String, String)>),
    Sending(String, LeaseCall),
    /// Lease, call, applied, and (ExtendLease) the new expiry was given.
    Answered(String, LeaseCall, bool, bool),
    Lost(String),
}

/// Keeps every event it is told, in order.
#[derive(Clone, Default)]
pub struct Recorder(Arc<Mutex<Vec<Observed>>>);

impl Recorder {
    pub fn events(&self) -> Vec<Observed> {
        self.0.lock().unwrap().clone()
    }

    /// The events naming `lease` after its Claim, ExtendLease left out unless `extends`.
    fn of(&self, lease: &str, extends: bool) -> Vec<Observed> {
        self.events()
            .into_iter()
            .filter(|e| match e {
                Observed::Sending(l, call) | Observed::Answered(l, call, ..) => {
                    l == lease && (extends || *call != LeaseCall::ExtendLease)
                }
                Observed::Lost(l) => l == lease,
                Observed::Claimed(..) => false,
            })
            .collect()
    }

    fn push(&self, event: Observed) {
        self.0.lock().unwrap().push(event);
    }
}

impl WorkerObserver for Recorder {
    fn claimed(&self, claim: &ClaimEvent<'_>) {
        assert!(claim.attempts.count >= 1);
        let leases = claim
            .leases
            .iter()
            .map(|l| (l.intent.as_ref().unwrap().id.clone(), l.lease_id.clone()))
            .collect();
        self.push(Observed::Claimed(
            claim.request_id.map(str::to_owned),
            leases,
        ));
    }

    fn sending(&self, lease: LeaseId<'_>, call: LeaseCall) {
        self.push(Observed::Sending(lease.lease_id.to_owned(), call));
    }

    fn answered(&self, lease: LeaseId<'_>, call: LeaseCall, answer: &Answer<'_>) {
        // ExtendLease's new expiry (other calls may carry one too; not asserted here).
        let expiry = call == LeaseCall::ExtendLease
            && answer.result.is_ok_and(|r| r.lease_expires_at.is_some());
        self.push(Observed::Answered(
            lease.lease_id.to_owned(),
            call,
            answer.is_ok(),
            expiry,
        ));
    }

    fn lease_lost(&self, lease: LeaseId<'_>, _why: &str) {
        self.push(Observed::Lost(lease.lease_id.to_owned()));
    }
}

/// The handler of the test kind: the payload says what to do.
async fn act(job: Job, recorder: Recorder) -> Result<(), Failure> {
    match job.payload() {
        b"submit" => job.submitting().await,
        b"permanent" => Err(Failure::permanent("no such address")),
        b"slow" => {
            // Outlives a heartbeat: returns once one extended this lease.
            let lease = job.lease_id().to_owned();
            wait_for("an extension", Duration::from_secs(10), || {
                let extended =
                    Observed::Answered(lease.clone(), LeaseCall::ExtendLease, true, true);
                recorder.events().contains(&extended).then_some(())
            })
            .await;
            Ok(())
        }
        _ => Ok(()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_is_told_each_leases_claim_then_each_call_as_sent_and_as_answered() {
    let connection = connection();
    let k = kind("observed");
    let outbox = Outbox::new(connection.clone());
    let mut ids = Vec::new();
    for what in ["ack", "submit", "permanent", "slow"] {
        let intent = NewIntent::new(&k, what.as_bytes().to_vec());
        ids.push(outbox.enqueue_direct(intent).await.unwrap().id);
    }
    let recorder = Recorder::default();
    let worker = Worker::builder(connection.clone())
        .concurrency(4)
        .lease(Duration::from_secs(1))
        .observer(recorder.clone())
        .handler(&k, {
            let recorder = recorder.clone();
            move |job: Job| act(job, recorder.clone())
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    for (id, want) in ids.iter().zip([
        IntentState::Delivered,
        IntentState::Delivered,
        IntentState::DeadLettered,
        IntentState::Delivered,
    ]) {
        wait_state(&connection, id, want).await;
    }
    running.stop().await.unwrap();

    let events = recorder.events();
    let mut leases = Vec::new();
    for id in &ids {
        let (at, request_id, lease) = events
            .iter()
            .enumerate()
            .find_map(|(at, e)| match e {
                Observed::Claimed(request, leases) => leases
                    .iter()
                    .find(|(intent, _)| intent == id)
                    .map(|(_, lease)| (at, request.clone(), lease.clone())),
                _ => None,
            })
            .expect("a Claim returned it");
        assert!(request_id.is_some(), "claims carry a request_id by default");
        // Nothing names a lease before its Claim is told.
        let first = events.iter().position(|e| match e {
            Observed::Sending(l, _) | Observed::Answered(l, ..) | Observed::Lost(l) => *l == lease,
            Observed::Claimed(..) => false,
        });
        assert!(first.is_some_and(|first| first > at), "{events:?}");
        leases.push(lease);
    }
    let sent_and_answered = |lease: &str, call: LeaseCall| {
        vec![
            Observed::Sending(lease.to_owned(), call),
            Observed::Answered(lease.to_owned(), call, true, false),
        ]
    };
    let ack = sent_and_answered(&leases[0], LeaseCall::Ack);
    assert_eq!(recorder.of(&leases[0], false), ack);
    let mut submit = sent_and_answered(&leases[1], LeaseCall::MarkSubmitted);
    submit.extend(sent_and_answered(&leases[1], LeaseCall::Ack));
    assert_eq!(recorder.of(&leases[1], false), submit);
    let fail = LeaseCall::Fail(FailOutcome::Permanent);
    assert_eq!(
        recorder.of(&leases[2], false),
        sent_and_answered(&leases[2], fail)
    );
    // The slow one: extended (sent, then answered with the new expiry) before its Ack.
    let slow = recorder.of(&leases[3], true);
    let sent = Observed::Sending(leases[3].clone(), LeaseCall::ExtendLease);
    let extended = Observed::Answered(leases[3].clone(), LeaseCall::ExtendLease, true, true);
    let ack_sent = Observed::Sending(leases[3].clone(), LeaseCall::Ack);
    let position = |e: &Observed| slow.iter().position(|x| x == e);
    assert!(position(&sent) < position(&extended), "{slow:?}");
    assert!(position(&extended) < position(&ack_sent), "{slow:?}");
    assert_eq!(
        slow.last(),
        Some(&Observed::Answered(
            leases[3].clone(),
            LeaseCall::Ack,
            true,
            false
        ))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_claim_replays_the_claims_are_plain_long_polls() {
    let connection = connection();
    let k = kind("plain");
    let recorder = Recorder::default();
    let worker = Worker::builder(connection.clone())
        .replay_claims(false)
        .claim_wait(Duration::from_secs(1))
        .observer(recorder.clone())
        .handler(&k, |_job: Job| async { Ok::<_, Failure>(()) })
        .build()
        .unwrap();
    let running = Running::start(worker);
    let outbox = Outbox::new(connection.clone());
    let intent = NewIntent::new(&k, b"x".to_vec());
    let id = outbox.enqueue_direct(intent).await.unwrap().id;
    wait_state(&connection, &id, IntentState::Delivered).await;
    running.stop().await.unwrap();
    let claims: Vec<Observed> = recorder
        .events()
        .into_iter()
        .filter(|e| matches!(e, Observed::Claimed(..)))
        .collect();
    assert!(
        claims.iter().any(|c| match c {
            Observed::Claimed(_, leases) => leases.iter().any(|(intent, _)| *intent == id),
            _ => false,
        }),
        "{claims:?}"
    );
    assert!(
        claims
            .iter()
            .all(|c| matches!(c, Observed::Claimed(None, _))),
        "{claims:?}"
    );
}
