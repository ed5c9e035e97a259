//! Hand-off: a direct Enqueue leases what a waiting Claim of its server would take to
//! that claim, which answers with it once the enqueue has committed; everything else stays
//! PENDING and wakes claimers as before.

use std::time::Duration;

use outboxd::proto::v1;

use crate::helpers::{
    SERVICE_ROLE, TestApp, claim_request, delayed_intent, duration, id_of, intent, secs,
};

/// A Claim of `worker` for up to `n` intents (of `kinds`, any when empty) through
/// `client`, waiting up to 60 s, running in the background; returned once `app`'s server
/// counts it waiting (it looked, found nothing, and may be handed intents).
pub(crate) async fn waiting_claim(
    app: &TestApp,
    mut client: outboxd::client::Client,
    worker: &str,
    n: i32,
    kinds: &[&str],
) -> tokio::task::JoinHandle<Vec<v1::Lease>> {
    let mut request = claim_request(worker, n);
    request.kinds = kinds.iter().map(|k| (*k).to_owned()).collect();
    request.wait = Some(duration(Duration::from_secs(60)));
    let claim =
        tokio::spawn(async move { client.claim(request).await.unwrap().into_inner().leases });
    app.wait_for_metric("outbox_claims_waiting 1").await;
    claim
}

/// The claim's answer, which must come long before its 60 s deadline.
pub(crate) async fn answered(claim: tokio::task::JoinHandle<Vec<v1::Lease>>) -> Vec<v1::Lease> {
    tokio::time::timeout(Duration::from_secs(30), claim)
        .await
        .expect("the waiting claim was never answered")
        .unwrap()
}

fn state_of(result: &v1::EnqueueResult) -> v1::IntentState {
    v1::IntentState::try_from(result.state).unwrap()
}

#[tokio::test]
async fn a_waiting_claim_is_handed_the_intent_enqueued_for_it_and_acks_it_under_that_lease() {
    let app = TestApp::spawn().await;
    let claim = waiting_claim(&app, app.client(), "w", 10, &[]).await;
    let results = app.enqueue(vec![intent("job", "{}")]).await.unwrap();
    assert_eq!(
        state_of(&results[0]),
        v1::IntentState::Pending,
        "direct mode answers PENDING, as the design says, though a claim has it already"
    );
    let leases = answered(claim).await;
    assert_eq!(leases.len(), 1);
    let lease = &leases[0];
    assert_eq!(id_of(lease), results[0].id);
    assert_eq!(
        lease.attempt, 1,
        "the hand-off counts the attempt as a claim does"
    );
    let intent = lease.intent.as_ref().unwrap();
    assert_eq!(intent.state, v1::IntentState::Leased as i32);
    assert_eq!(intent.tenant, crate::helpers::TENANT);
    assert!(
        secs(&lease.lease_expires_at) > secs(&intent.available_at) + 20.0,
        "the 30 s lease the claim asked for (by default)"
    );
    app.wait_for_metric("outbox_intents_handed_off_total 1")
        .await;
    app.wait_for_metric(r#"outbox_intents_claimed_total{kind="other"} 1"#)
        .await;
    let stored = app.intent(&results[0].id).await;
    assert_eq!(stored.state, v1::IntentState::Leased as i32);
    assert_eq!(stored.attempts, 1);
    assert_eq!(stored.worker_id, "w");
    let acked = app.ack(&[lease]).await;
    assert_eq!(
        acked[0].state,
        v1::IntentState::Delivered as i32,
        "{acked:?}"
    );
    assert!(app.claim_n("w", 10).await.is_empty(), "delivered, once");
}

#[tokio::test]
async fn only_what_a_waiting_claim_would_lease_is_handed_to_it_the_rest_stays_pending() {
    let app = TestApp::spawn().await;
    let claim = waiting_claim(&app, app.client(), "texter", 2, &["sms"]).await;
    let results = app
        .enqueue(vec![
            intent("email", "{}"),
            delayed_intent("sms", Duration::from_secs(3600)),
            intent("sms", "1"),
            intent("sms", "2"),
            intent("sms", "3"),
        ])
        .await
        .unwrap();
    assert!(
        results
            .iter()
            .all(|r| state_of(r) == v1::IntentState::Pending)
    );
    let mut states = Vec::new();
    for r in &results {
        states.push(app.state(&r.id).await);
    }
    use v1::IntentState::{Leased, Pending};
    assert_eq!(
        states,
        [Pending, Pending, Leased, Leased, Pending],
        "another kind, a delayed one, and one more than the claim asked for stay PENDING"
    );
    let mut handed: Vec<_> = answered(claim)
        .await
        .iter()
        .map(|l| id_of(l).to_owned())
        .collect();
    handed.sort();
    let mut expected = vec![results[2].id.clone(), results[3].id.clone()];
    expected.sort();
    assert_eq!(handed, expected);
    app.wait_for_metric("outbox_intents_handed_off_total 2")
        .await;
    let mut rest = app.claim_ids("any", 10).await;
    rest.sort();
    let mut expected = vec![results[0].id.clone(), results[4].id.clone()];
    expected.sort();
    assert_eq!(rest, expected, "the rest is claimable as ever");
}

#[tokio::test]
async fn a_waiting_claim_is_handed_the_highest_priorities_of_an_enqueue_first() {
    let app = TestApp::spawn().await;
    let claim = waiting_claim(&app, app.client(), "w", 2, &[]).await;
    let prioritised = |priority: i32, payload: &str| v1::NewIntent {
        priority,
        ..intent("job", payload)
    };
    let results = app
        .enqueue(vec![
            prioritised(-10, "low"),
            prioritised(0, "middle"),
            prioritised(10, "high"),
        ])
        .await
        .unwrap();
    let handed: Vec<_> = answered(claim)
        .await
        .iter()
        .map(|l| id_of(l).to_owned())
        .collect();
    assert_eq!(
        handed,
        [results[2].id.clone(), results[1].id.clone()],
        "as a claim takes them, and listed so"
    );
    assert_eq!(app.state(&results[0].id).await, v1::IntentState::Pending);
}

#[tokio::test]
async fn a_waiting_claim_of_another_tenant_is_never_handed_an_intent() {
    let app = TestApp::spawn().await;
    let key = app.key(&["globex"], &["consume"], &[]).await;
    let other = app.client_with(Some(&key), None).await;
    let claim = waiting_claim(&app, other, "globex-worker", 10, &[]).await;
    let results = app.enqueue(vec![intent("job", "{}")]).await.unwrap();
    assert_eq!(app.state(&results[0].id).await, v1::IntentState::Pending);
    assert_eq!(app.claim_n("mine", 10).await.len(), 1);
    assert!(
        !claim.is_finished(),
        "the other tenant's claim still waits: it was handed nothing"
    );
    app.wait_for_metric("outbox_intents_handed_off_total 0")
        .await;
    claim.abort();
}

#[tokio::test]
async fn an_intent_with_an_idempotency_key_wakes_a_waiting_claim_instead() {
    let app = TestApp::spawn().await;
    let claim = waiting_claim(&app, app.client(), "w", 10, &[]).await;
    let keyed = v1::NewIntent {
        idempotency_key: "welcome-ada".to_owned(),
        ..intent("email", "{}")
    };
    let results = app.enqueue(vec![keyed]).await.unwrap();
    let leases = answered(claim).await;
    assert_eq!(leases.len(), 1, "woken, it looked and leased the intent");
    assert_eq!(id_of(&leases[0]), results[0].id);
    app.wait_for_metric("outbox_intents_handed_off_total 0")
        .await;
}

#[tokio::test]
async fn a_claim_whose_wait_has_ended_is_handed_nothing() {
    let app = TestApp::spawn().await;
    let mut request = claim_request("w", 10);
    request.wait = Some(duration(Duration::from_millis(20)));
    assert!(app.claim(request).await.unwrap().is_empty());
    let results = app.enqueue(vec![intent("job", "{}")]).await.unwrap();
    assert_eq!(app.state(&results[0].id).await, v1::IntentState::Pending);
    app.wait_for_metric("outbox_intents_handed_off_total 0")
        .await;
}

#[tokio::test]
async fn with_hand_off_disabled_a_waiting_claim_is_woken_to_look() {
    let app = TestApp::spawn_with(|s| s.claim.hand_off = false).await;
    let claim = waiting_claim(&app, app.client(), "w", 10, &[]).await;
    let results = app.enqueue(vec![intent("job", "{}")]).await.unwrap();
    let leases = answered(claim).await;
    assert_eq!(id_of(&leases[0]), results[0].id);
    app.wait_for_metric("outbox_intents_handed_off_total 0")
        .await;
}

#[tokio::test]
async fn a_waiting_claim_whose_enqueue_failed_looks_again_and_gets_the_next_intent() {
    let app = TestApp::spawn().await;
    let claim = waiting_claim(&app, app.client(), "w", 10, &[]).await;
    // The enqueue takes the claim, then its insert fails.
    let revoke = format!("REVOKE INSERT ON outbox.intent FROM {SERVICE_ROLE}");
    sqlx::query(&revoke).execute(&app.pool).await.unwrap();
    assert!(app.enqueue(vec![intent("job", "{}")]).await.is_err());
    let grant = format!("GRANT INSERT ON outbox.intent TO {SERVICE_ROLE}");
    sqlx::query(&grant).execute(&app.pool).await.unwrap();
    assert!(
        !claim.is_finished(),
        "nothing was leased to it: it waits on"
    );
    let results = app.enqueue(vec![intent("job", "{}")]).await.unwrap();
    let leases = answered(claim).await;
    assert_eq!(leases.len(), 1);
    assert_eq!(id_of(&leases[0]), results[0].id);
}

#[tokio::test]
async fn an_intent_handed_to_a_claim_cancelled_before_the_enqueue_committed_is_claimable_again_with_its_attempt_uncounted()
 {
    let app = TestApp::spawn().await;
    let claim = waiting_claim(&app, app.client(), "gone", 10, &[]).await;
    // The enqueue takes the claim, then waits behind a lock for the table.
    let mut locker = app.lock_intent_table().await;
    let enqueue = app.spawn_enqueue(vec![intent("job", "{}")]);
    app.wait_for_lock_waiters(1).await;
    claim.abort(); // the worker gives up its long poll
    app.wait_for_metric("outbox_claims_waiting 0").await;
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
    let results = enqueue.await.unwrap().unwrap();
    let id = &results[0].id;

    // Leased to a claim that never answered: given back instead of held until it expires.
    app.wait_for_state(id, v1::IntentState::Pending).await;
    let leases = app.claim_n("next", 10).await;
    assert_eq!(leases.len(), 1, "claimable at once");
    assert_eq!(id_of(&leases[0]), id);
    assert_eq!(
        leases[0].attempt, 1,
        "no worker received it, so its first lease is no attempt"
    );
    app.wait_for_metric("outbox_intents_handed_off_total 0")
        .await;
    app.wait_for_metric("outbox_intents_given_back_total 1")
        .await;
}
