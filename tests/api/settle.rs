//! Ack, Fail, ExtendLease and MarkSubmitted: every transition they make and every one
//! they refuse, fenced by the lease id.

use std::time::Duration;

use outboxd::proto::v1::{self, FailOutcome, IntentState};
use tonic::Code;

use crate::helpers::{
    TestApp, assert_item_error, assert_item_ok, assert_status, duration, failure, id_of, intent,
    lease_ref, secs,
};

#[tokio::test]
async fn ack_delivers_and_repeating_it_with_the_same_lease_is_ok() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 1).await;
    let lease = app.claim_n("w", 1).await.remove(0);

    assert_item_ok(&app.ack(&[&lease]).await[0], IntentState::Delivered);
    assert_item_ok(&app.ack(&[&lease]).await[0], IntentState::Delivered);
    assert_eq!(app.state(id_of(&lease)).await, IntentState::Delivered);
    assert!(app.claim_n("w", 1).await.is_empty(), "delivered is final");
}

#[tokio::test]
async fn a_stale_lease_is_rejected_after_its_intent_was_rescued_and_leased_again() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 1).await;
    let stale = app.claim_n("slow-worker", 1).await.remove(0);
    app.advance(Duration::from_secs(31));
    assert_eq!(app.rescue().await.requeued, 1);
    app.advance(Duration::from_secs(10)); // past the retry backoff
    let fresh = app.claim_n("fast-worker", 1).await.remove(0);
    assert_eq!(id_of(&fresh), id_of(&stale));
    assert_eq!(fresh.attempt, 2);
    assert_ne!(fresh.lease_id, stale.lease_id);

    assert_item_error(
        &app.ack(&[&stale]).await[0],
        Code::FailedPrecondition,
        "LEASE_LOST",
    );
    assert_item_error(
        &app.fail(&stale, FailOutcome::Permanent).await,
        Code::FailedPrecondition,
        "LEASE_LOST",
    );
    assert_item_error(
        &app.extend(&[&stale], Duration::from_secs(30)).await[0],
        Code::FailedPrecondition,
        "LEASE_LOST",
    );
    assert_item_error(
        &app.mark_submitted(&[&stale]).await[0],
        Code::FailedPrecondition,
        "LEASE_LOST",
    );
    assert_eq!(
        app.state(id_of(&fresh)).await,
        IntentState::Leased,
        "the stale calls changed nothing"
    );
    assert_item_ok(&app.ack(&[&fresh]).await[0], IntentState::Delivered);
}

#[tokio::test]
async fn a_lease_rescued_before_the_side_effect_started_cannot_be_acked_late() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 1).await;
    let lease = app.claim_n("w", 1).await.remove(0);
    app.advance(Duration::from_secs(31));
    app.rescue().await;
    let result = &app.ack(&[&lease]).await[0];
    assert_item_error(result, Code::FailedPrecondition, "LEASE_LOST");
    assert_eq!(result.state(), IntentState::Pending);
}

#[tokio::test]
async fn an_expired_lease_not_yet_rescued_can_still_be_acked() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 1).await;
    let lease = app.claim_n("w", 1).await.remove(0);
    app.advance(Duration::from_secs(120));
    assert_item_ok(&app.ack(&[&lease]).await[0], IntentState::Delivered);
    assert_eq!(app.rescue().await.requeued, 0);
}

#[tokio::test]
async fn batch_results_are_per_item_and_a_bad_item_does_not_fail_its_neighbours() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 2).await;
    let leases = app.claim_n("w", 2).await;
    let mut forged = leases[1].clone();
    forged.lease_id = uuid::Uuid::new_v4().to_string();
    let mut unknown = leases[0].clone();
    unknown.intent.as_mut().unwrap().id = uuid::Uuid::new_v4().to_string();

    let results = app.ack(&[&leases[0], &forged, &unknown]).await;
    assert_item_ok(&results[0], IntentState::Delivered);
    assert_item_error(&results[1], Code::FailedPrecondition, "LEASE_LOST");
    assert_eq!(results[1].state(), IntentState::Leased);
    assert_item_error(&results[2], Code::NotFound, "NOT_FOUND");
    assert_eq!(
        results
            .iter()
            .map(|r| r.intent_id.as_str())
            .collect::<Vec<_>>(),
        vec![id_of(&leases[0]), id_of(&forged), id_of(&unknown)]
    );
}

/// `leases` with items `a` and `b` presenting each other's lease id.
fn with_swapped_leases(leases: &[v1::Lease], a: usize, b: usize) -> Vec<v1::Lease> {
    let mut swapped = leases.to_vec();
    let lease_of_a = std::mem::take(&mut swapped[a].lease_id);
    swapped[a].lease_id = std::mem::replace(&mut swapped[b].lease_id, lease_of_a);
    swapped
}

/// Asserts that `results` answer `sent` item by item, in order: LEASE_LOST (intent left
/// in `kept`) for the items at `lost`, `state` for every other.
fn assert_only_lost(
    results: &[v1::LeaseResult],
    sent: &[v1::Lease],
    lost: &[usize],
    state: IntentState,
    kept: IntentState,
) {
    assert_eq!(results.len(), sent.len());
    for (k, (result, lease)) in results.iter().zip(sent).enumerate() {
        assert_eq!(result.intent_id, id_of(lease), "item {k} answered in order");
        if lost.contains(&k) {
            assert_item_error(result, Code::FailedPrecondition, "LEASE_LOST");
            assert_eq!(result.state(), kept, "item {k}");
        } else {
            assert_item_ok(result, state);
        }
    }
}

// The settles join their batch to its intents by hash (see the settle functions in migration
// …02_baseline_functions): each item must still pair one intent with that intent's own
// lease, at the largest batch as at one. Two items presenting each other's (live, real)
// lease ids are refused, both.
#[tokio::test]
async fn a_full_batch_settles_each_intent_only_under_its_own_lease() {
    let app = TestApp::spawn().await;
    let n = app.settings.limits.max_batch;
    app.enqueue_n("job", n).await;
    let leases = app.claim_n("w", n as i32).await;
    assert_eq!(leases.len(), n);

    let sent = with_swapped_leases(&leases, 0, 1);
    let results = app
        .extend(&sent.iter().collect::<Vec<_>>(), Duration::from_secs(60))
        .await;
    assert_only_lost(
        &results,
        &sent,
        &[0, 1],
        IntentState::Leased,
        IntentState::Leased,
    );

    let sent = with_swapped_leases(&leases, 2, n - 1);
    let results = app.mark_submitted(&sent.iter().collect::<Vec<_>>()).await;
    assert_only_lost(
        &results,
        &sent,
        &[2, n - 1],
        IntentState::Submitted,
        IntentState::Leased,
    );

    let (failing, acking) = leases.split_at(n / 2);
    let sent = with_swapped_leases(failing, 3, 4);
    let results = app
        .client()
        .fail(v1::FailRequest {
            failures: sent
                .iter()
                .map(|l| failure(l, FailOutcome::Permanent))
                .collect(),
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_only_lost(
        &results,
        &sent,
        &[3, 4],
        IntentState::DeadLettered,
        IntentState::Submitted,
    );

    let sent = with_swapped_leases(acking, 0, 1);
    let results = app.ack(&sent.iter().collect::<Vec<_>>()).await;
    assert_only_lost(
        &results,
        &sent,
        &[0, 1],
        IntentState::Delivered,
        IntentState::Submitted,
    );
}

#[tokio::test]
async fn malformed_lease_batches_are_invalid_and_change_nothing() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 1).await;
    let lease = app.claim_n("w", 1).await.remove(0);
    let before = app.snapshot().await;
    let mut client = app.client();

    let status = client
        .ack(v1::AckRequest { leases: vec![] })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["leases"],
    );
    let good = crate::helpers::lease_ref(&lease);
    let bad = v1::LeaseRef {
        intent_id: "not-a-uuid".into(),
        lease_id: String::new(),
    };
    let status = client
        .ack(v1::AckRequest {
            leases: vec![good.clone(), bad, good.clone()],
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &[
            "leases[1].intent_id",
            "leases[1].lease_id",
            "leases[2].intent_id",
        ],
    );
    let status = client
        .fail(v1::FailRequest {
            failures: vec![
                v1::Failure {
                    lease: Some(good.clone()),
                    error: String::new(),
                    outcome: 0,
                    retry_after: None,
                },
                v1::Failure {
                    lease: None,
                    error: String::new(),
                    outcome: FailOutcome::Permanent as i32,
                    retry_after: Some(duration(Duration::from_secs(1))),
                },
            ],
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &[
            "failures[0].outcome",
            "failures[1].lease",
            "failures[1].retry_after",
        ],
    );
    let status = client
        .extend_lease(v1::ExtendLeaseRequest {
            leases: vec![good],
            lease_duration: Some(duration(Duration::ZERO)),
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["lease_duration"],
    );
    assert_eq!(app.snapshot().await, before);
}

#[tokio::test]
async fn fail_retry_backs_off_exponentially_then_dead_letters_when_attempts_run_out() {
    let app = TestApp::spawn().await;
    let mut limited = intent("job", "{}");
    limited.max_attempts = 3;
    let id = app.enqueue(vec![limited]).await.unwrap()[0].id.clone();

    // After attempt n the delay is base * 2^(n-1) with jitter in [50 %, 100 %].
    for (attempt, full_delay) in [(1, 1.0), (2, 2.0)] {
        let lease = app.claim_n("w", 1).await.remove(0);
        assert_eq!(lease.attempt, attempt);
        let now = app.clock.now().unwrap().timestamp_micros() as f64 / 1e6;
        let result = app.fail(&lease, FailOutcome::Retry).await;
        assert_item_ok(&result, IntentState::Pending);
        let stored = app.intent(&id).await;
        let delay = secs(&stored.available_at) - now;
        assert!(
            delay >= full_delay / 2.0 - 0.001 && delay <= full_delay + 0.001,
            "attempt {attempt}: delay {delay}"
        );
        assert_eq!(stored.last_error, "boom");
        assert!(
            app.claim_n("w", 1).await.is_empty(),
            "not before the backoff"
        );
        app.advance(Duration::from_secs_f64(full_delay));
    }
    let last = app.claim_n("w", 1).await.remove(0);
    assert_eq!(last.attempt, 3);
    assert_item_ok(
        &app.fail(&last, FailOutcome::Retry).await,
        IntentState::DeadLettered,
    );
    app.advance(Duration::from_secs(3600));
    assert!(app.claim_n("w", 1).await.is_empty());
}

#[tokio::test]
async fn retry_after_replaces_the_backoff() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    let now = app.clock.now().unwrap().timestamp_micros() as f64 / 1e6;
    let mut f = failure(&lease, FailOutcome::Retry);
    f.retry_after = Some(duration(Duration::from_secs(90)));
    assert_item_ok(&app.fail_with(f).await, IntentState::Pending);
    let delay = secs(&app.intent(&id).await.available_at) - now;
    assert!((delay - 90.0).abs() < 0.001, "{delay}");
}

#[tokio::test]
async fn fail_permanent_dead_letters_and_fail_unknown_needs_reconcile() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 2).await;
    let leases = app.claim_n("w", 2).await;
    assert_item_ok(
        &app.fail(&leases[0], FailOutcome::Permanent).await,
        IntentState::DeadLettered,
    );
    assert_item_ok(
        &app.fail(&leases[1], FailOutcome::Unknown).await,
        IntentState::NeedsReconcile,
    );
    // A lost response replayed: same lease, same outcome, still OK.
    assert_item_ok(
        &app.fail(&leases[0], FailOutcome::Permanent).await,
        IntentState::DeadLettered,
    );
    assert_item_ok(
        &app.fail(&leases[1], FailOutcome::Unknown).await,
        IntentState::NeedsReconcile,
    );
    app.advance(Duration::from_secs(3600));
    assert!(app.claim_n("w", 2).await.is_empty());
}

#[tokio::test]
async fn a_submitted_intent_whose_lease_expires_needs_reconcile_and_is_never_leased_again() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("charge", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    assert_item_ok(
        &app.mark_submitted(&[&lease]).await[0],
        IntentState::Submitted,
    );
    assert_item_ok(
        &app.mark_submitted(&[&lease]).await[0],
        IntentState::Submitted,
    );

    app.advance(Duration::from_secs(31));
    let report = app.rescue().await;
    assert_eq!(report.needs_reconcile, 1);
    assert_eq!(report.requeued, 0);
    assert_eq!(app.state(&id).await, IntentState::NeedsReconcile);
    app.advance(Duration::from_secs(24 * 3600));
    app.rescue().await;
    assert!(app.claim_n("other", 10).await.is_empty());
    assert_eq!(app.state(&id).await, IntentState::NeedsReconcile);
}

#[tokio::test]
async fn the_worker_of_a_submitted_intent_may_still_report_what_it_learned() {
    let app = TestApp::spawn().await;
    app.enqueue_n("charge", 3).await;
    let leases = app.claim_n("w", 3).await;
    let refs: Vec<&v1::Lease> = leases.iter().collect();
    app.mark_submitted(&refs).await;

    assert_item_ok(&app.ack(&[&leases[0]]).await[0], IntentState::Delivered);
    assert_item_ok(
        &app.fail(&leases[1], FailOutcome::Permanent).await,
        IntentState::DeadLettered,
    );
    // The lease expired mid-call and the intent went to an operator; then the answer came.
    app.advance(Duration::from_secs(31));
    app.rescue().await;
    assert_eq!(
        app.state(id_of(&leases[2])).await,
        IntentState::NeedsReconcile
    );
    assert_item_ok(&app.ack(&[&leases[2]]).await[0], IntentState::Delivered);
}

#[tokio::test]
async fn mark_submitted_applies_only_to_a_leased_intent() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 1).await;
    let lease = app.claim_n("w", 1).await.remove(0);
    app.ack(&[&lease]).await;
    let result = &app.mark_submitted(&[&lease]).await[0];
    assert_item_error(result, Code::FailedPrecondition, "LEASE_LOST");
    assert_eq!(result.state(), IntentState::Delivered);
}

#[tokio::test]
async fn a_repeated_mark_submitted_tells_the_unchanged_lease_expiry_again() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 1).await;
    let lease = app.claim_n("w", 1).await.remove(0);
    let first = app.mark_submitted(&[&lease]).await.remove(0);
    assert_item_ok(&first, IntentState::Submitted);
    assert!(first.lease_expires_at.is_some());
    let again = app.mark_submitted(&[&lease]).await.remove(0);
    assert_item_ok(&again, IntentState::Submitted);
    assert_eq!(again.lease_expires_at, first.lease_expires_at);
    assert_eq!(again.lease_expires_at, lease.lease_expires_at);
}

#[tokio::test]
async fn extending_a_lease_keeps_the_intent_from_rescue() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    app.advance(Duration::from_secs(20));
    let result = &app.extend(&[&lease], Duration::from_secs(60)).await[0];
    assert_item_ok(result, IntentState::Leased);
    let now = app.clock.now().unwrap().timestamp_micros() as f64 / 1e6;
    assert!((secs(&result.lease_expires_at) - (now + 60.0)).abs() < 0.001);

    app.advance(Duration::from_secs(30)); // past the original expiry, within the extension
    assert_eq!(app.rescue().await.requeued, 0);
    assert_eq!(app.state(&id).await, IntentState::Leased);
    app.advance(Duration::from_secs(31));
    assert_eq!(app.rescue().await.requeued, 1);
}

/// An extension never moves a lease's expiry back: one whose statement waited on a row
/// lock kept its transaction's time, and committed after a later extension it set the
/// expiry into the past; the rescue then leased the intent again while its worker held a
/// lease the server had extended (found by the fault suite). A shorter extension stands
/// for that stale one here.
#[tokio::test]
async fn an_extension_never_moves_a_lease_expiry_back() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    let longer = &app.extend(&[&lease], Duration::from_secs(60)).await[0];
    let shorter = &app.extend(&[&lease], Duration::from_secs(1)).await[0];
    assert_item_ok(shorter, IntentState::Leased);
    assert_eq!(
        secs(&shorter.lease_expires_at),
        secs(&longer.lease_expires_at)
    );
    app.advance(Duration::from_secs(31)); // past the claim's lease and the shorter one
    assert_eq!(app.rescue().await.requeued, 0);
    assert_eq!(app.state(&id).await, IntentState::Leased);
}

#[tokio::test]
async fn an_expired_lease_out_of_attempts_is_dead_lettered_by_the_rescue() {
    let app = TestApp::spawn().await;
    let mut once = intent("job", "{}");
    once.max_attempts = 1;
    let id = app.enqueue(vec![once]).await.unwrap()[0].id.clone();
    app.claim_n("w", 1).await;
    app.advance(Duration::from_secs(31));
    let report = app.rescue().await;
    assert_eq!(report.dead_lettered, 1);
    let stored = app.intent(&id).await;
    assert_eq!(stored.state(), IntentState::DeadLettered);
    assert_eq!(
        stored.last_error,
        "lease expired before the external call started"
    );
}

#[tokio::test]
async fn a_fail_repeated_with_another_outcome_is_refused_not_taken_as_a_replay() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    assert_item_ok(
        &app.fail(&lease, FailOutcome::Retry).await,
        IntentState::Pending,
    );
    assert_item_ok(
        &app.fail(&lease, FailOutcome::Retry).await,
        IntentState::Pending,
    );
    for contradiction in [FailOutcome::Permanent, FailOutcome::Unknown] {
        let result = app.fail(&lease, contradiction).await;
        assert_item_error(&result, Code::FailedPrecondition, "LEASE_LOST");
        assert_eq!(result.state(), IntentState::Pending);
    }
    assert_eq!(app.state(&id).await, IntentState::Pending);
}

#[tokio::test]
async fn a_retry_after_a_permanent_failure_of_its_lease_is_refused_while_attempts_are_left() {
    let app = TestApp::spawn().await;
    let mut last_try = intent("job", "{}");
    last_try.max_attempts = 1;
    app.enqueue(vec![intent("job", "{}")]).await.unwrap();
    let lease = app.claim_n("w", 1).await.remove(0);
    let permanent = app.fail(&lease, FailOutcome::Permanent).await;
    assert_item_ok(&permanent, IntentState::DeadLettered);
    let retry = app.fail(&lease, FailOutcome::Retry).await;
    assert_item_error(&retry, Code::FailedPrecondition, "LEASE_LOST");
    assert_eq!(retry.state(), IntentState::DeadLettered);

    // On its last attempt a RETRY dead-letters as PERMANENT does: the same place, a replay.
    app.enqueue(vec![last_try]).await.unwrap();
    let lease = app.claim_n("w", 1).await.remove(0);
    assert_item_ok(
        &app.fail(&lease, FailOutcome::Permanent).await,
        IntentState::DeadLettered,
    );
    assert_item_ok(
        &app.fail(&lease, FailOutcome::Retry).await,
        IntentState::DeadLettered,
    );
}

/// Sends `call` twice at once while a row lock holds the intent, as a worker does that
/// retries a call stuck behind a lock (or a frozen replica): both attempts queue on the
/// lock, the first through applies, the other finds its work done. Both must answer OK.
async fn call_twice_behind_a_row_lock<F, Fut>(app: &TestApp, id: &str, call: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = v1::LeaseResult> + Send + 'static,
{
    let mut locker = app.lock_intent_row(id).await;
    let first = tokio::spawn(call());
    app.wait_for_lock_waiters(1).await;
    let retry = tokio::spawn(call());
    app.wait_for_lock_waiters(2).await;
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
    for (attempt, handle) in [("first attempt", first), ("retry", retry)] {
        let result = handle.await.unwrap();
        assert!(
            result.error.is_none(),
            "the {attempt} was refused: {:?}",
            result.error
        );
    }
}

#[tokio::test]
async fn an_ack_retried_while_its_first_attempt_waits_on_a_row_lock_is_answered_as_a_replay() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    let client = app.client();
    call_twice_behind_a_row_lock(&app, &id, || {
        let mut client = client.clone();
        let request = v1::AckRequest {
            leases: vec![lease_ref(&lease)],
        };
        async move {
            client
                .ack(request)
                .await
                .unwrap()
                .into_inner()
                .results
                .remove(0)
        }
    })
    .await;
    assert_eq!(app.state(&id).await, IntentState::Delivered);
}

#[tokio::test]
async fn a_mark_submitted_retried_while_its_first_attempt_waits_on_a_row_lock_is_answered_as_a_replay()
 {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    let client = app.client();
    call_twice_behind_a_row_lock(&app, &id, || {
        let mut client = client.clone();
        let request = v1::MarkSubmittedRequest {
            leases: vec![lease_ref(&lease)],
        };
        async move {
            let response = client.mark_submitted(request).await.unwrap();
            response.into_inner().results.remove(0)
        }
    })
    .await;
    assert_eq!(app.state(&id).await, IntentState::Submitted);
}

#[tokio::test]
async fn a_fail_retried_while_its_first_attempt_waits_on_a_row_lock_is_answered_as_a_replay() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    let client = app.client();
    call_twice_behind_a_row_lock(&app, &id, || {
        let mut client = client.clone();
        let request = v1::FailRequest {
            failures: vec![failure(&lease, FailOutcome::Permanent)],
        };
        async move {
            client
                .fail(request)
                .await
                .unwrap()
                .into_inner()
                .results
                .remove(0)
        }
    })
    .await;
    assert_eq!(app.state(&id).await, IntentState::DeadLettered);
}
