//! Reconcile: operator decisions by id and by filter, each recorded and readable.

use outboxd::proto::v1::{self, Decision, FailOutcome, IntentState};
use tonic::Code;

use crate::helpers::{TestApp, assert_status, id_of};

fn by_ids(ids: &[&str], decision: Decision) -> v1::ReconcileRequest {
    v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
            ids: ids.iter().map(|s| s.to_string()).collect(),
            updated_at: Vec::new(),
        })),
        decision: decision as i32,
        actor: "alice".into(),
        reason: "checked the PSP dashboard".into(),
        limit: 0,
    }
}

/// Puts `n` intents into NEEDS_RECONCILE (Fail UNKNOWN) and returns their ids.
async fn ambiguous(app: &TestApp, kind: &str, n: i32) -> Vec<String> {
    app.enqueue_n(kind, n as usize).await;
    let leases = app.claim_n("w", n).await;
    for lease in &leases {
        app.fail(lease, FailOutcome::Unknown).await;
    }
    leases.iter().map(|l| id_of(l).to_owned()).collect()
}

#[tokio::test]
async fn each_decision_moves_the_intent_and_records_who_when_and_why() {
    let app = TestApp::spawn().await;
    let ids = ambiguous(&app, "charge", 3).await;
    for (id, decision, state) in [
        (&ids[0], Decision::Delivered, IntentState::Delivered),
        (&ids[1], Decision::Requeue, IntentState::Pending),
        (&ids[2], Decision::Dead, IntentState::DeadLettered),
    ] {
        let results = app.reconcile(by_ids(&[id], decision)).await.unwrap();
        assert!(results[0].error.is_none(), "{results:?}");
        assert_eq!(results[0].state(), state);
        let got = app.get(id).await;
        assert_eq!(got.intent.unwrap().state(), state);
        let r = &got.resolutions[0];
        assert_eq!(r.decision(), decision);
        assert_eq!(r.from_state(), IntentState::NeedsReconcile);
        assert_eq!(r.actor, "alice");
        // The key that made the call, whatever the actor says.
        assert_eq!(r.api_key, "test");
        assert_eq!(r.reason, "checked the PSP dashboard");
        assert!(r.resolved_at.is_some());
    }
    let again = app.claim_n("w2", 10).await;
    assert_eq!(again.len(), 1, "only the requeued intent is claimable");
    assert_eq!(id_of(&again[0]), ids[1]);
    assert_eq!(
        again[0].attempt, 1,
        "a requeue starts a fresh attempt budget"
    );
}

#[tokio::test]
async fn requeue_redrives_a_dead_letter() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    app.fail(&lease, FailOutcome::Permanent).await;
    let results = app
        .reconcile(by_ids(&[&id], Decision::Requeue))
        .await
        .unwrap();
    assert_eq!(results[0].state(), IntentState::Pending);
    assert_eq!(
        app.get(&id).await.resolutions[0].from_state(),
        IntentState::DeadLettered
    );
    assert_eq!(id_of(&app.claim_n("w", 1).await[0]), id);
}

#[tokio::test]
async fn a_decision_on_an_intent_not_awaiting_one_is_refused_per_item() {
    let app = TestApp::spawn().await;
    let waiting = ambiguous(&app, "charge", 1).await;
    let pending = app.enqueue_one("job", "{}").await;
    let missing = uuid::Uuid::new_v4().to_string();
    let results = app
        .reconcile(by_ids(
            &[&waiting[0], &pending, &missing],
            Decision::Delivered,
        ))
        .await
        .unwrap();
    assert!(results[0].error.is_none());
    let e = results[1].error.as_ref().unwrap();
    assert_eq!(
        (e.code, e.reason.as_str()),
        (Code::FailedPrecondition as i32, "INVALID_STATE")
    );
    assert_eq!(results[1].state(), IntentState::Pending);
    let e = results[2].error.as_ref().unwrap();
    assert_eq!(
        (e.code, e.reason.as_str()),
        (Code::NotFound as i32, "NOT_FOUND")
    );
    assert!(app.get(&pending).await.resolutions.is_empty());

    let dead = app
        .reconcile(by_ids(&[&waiting[0]], Decision::Dead))
        .await
        .unwrap();
    assert_eq!(
        dead[0].error.as_ref().unwrap().reason,
        "INVALID_STATE",
        "delivered is final"
    );
}

#[tokio::test]
async fn a_decision_that_waited_on_a_row_lock_reports_the_state_the_intent_was_left_in() {
    let app = TestApp::spawn().await;
    let id = ambiguous(&app, "charge", 1).await.remove(0);
    // Another decision holds the row while this one waits for it, and dead-letters it.
    let mut other = app.producer().await;
    sqlx::raw_sql("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query("UPDATE outbox.intent SET state = 'dead_lettered' WHERE id = $1::uuid")
        .bind(&id)
        .execute(&mut other)
        .await
        .unwrap();
    let mut client = app.client();
    let request = by_ids(&[&id], Decision::Dead);
    let waiting = tokio::spawn(async move { client.reconcile(request).await });
    app.wait_for_lock_waiters(1).await;
    sqlx::raw_sql("COMMIT").execute(&mut other).await.unwrap();

    let results = waiting.await.unwrap().unwrap().into_inner().results;
    let e = results[0].error.as_ref().unwrap();
    assert_eq!(
        (e.code, e.reason.as_str()),
        (Code::FailedPrecondition as i32, "INVALID_STATE")
    );
    assert_eq!(
        results[0].state(),
        IntentState::DeadLettered,
        "the state it was left in, not the one it had before the wait"
    );
}

#[tokio::test]
async fn a_filter_resolves_only_the_matching_intents_up_to_the_limit() {
    let app = TestApp::spawn().await;
    let charges = ambiguous(&app, "charge", 3).await;
    let emails = ambiguous(&app, "email", 1).await;
    let request = v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
            states: vec![IntentState::NeedsReconcile as i32],
            kind: "charge".into(),
            region: String::new(),
            created_before: None,
        })),
        decision: Decision::Dead as i32,
        actor: "bob".into(),
        reason: "provider confirmed none went through".into(),
        limit: 2,
    };
    let first = app.reconcile(request.clone()).await.unwrap();
    assert_eq!(first.len(), 2);
    let second = app.reconcile(request.clone()).await.unwrap();
    assert_eq!(second.len(), 1);
    assert!(app.reconcile(request).await.unwrap().is_empty());
    for id in &charges {
        assert_eq!(app.state(id).await, IntentState::DeadLettered);
        assert_eq!(app.get(id).await.resolutions[0].actor, "bob");
    }
    assert_eq!(app.state(&emails[0]).await, IntentState::NeedsReconcile);
}

#[tokio::test]
async fn reconcile_requests_without_a_decision_actor_reason_or_target_are_invalid() {
    let app = TestApp::spawn().await;
    let ids = ambiguous(&app, "charge", 1).await;
    let before = app.snapshot().await;
    let status = app
        .reconcile(v1::ReconcileRequest {
            target: None,
            decision: 0,
            actor: String::new(),
            reason: String::new(),
            limit: 0,
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["target", "decision", "actor", "reason"],
    );

    let mut bad_filter = by_ids(
        &ids.iter().map(String::as_str).collect::<Vec<_>>(),
        Decision::Dead,
    );
    bad_filter.target = Some(v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
        states: vec![IntentState::Pending as i32, 99],
        ..Default::default()
    }));
    let status = app.reconcile(bad_filter).await.unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["filter.states[0]", "filter.states[1]"],
    );
    let status = app
        .reconcile(by_ids(&["nope"], Decision::Dead))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["ids.ids[0]"],
    );
    assert_eq!(app.snapshot().await, before);
}

#[tokio::test]
async fn a_decision_on_an_intent_changed_since_it_was_read_is_not_taken() {
    let app = TestApp::spawn().await;
    let ids = ambiguous(&app, "charge", 2).await;
    let seen: Vec<_> = [&ids[0], &ids[1]]
        .iter()
        .map(|id| async { app.intent(id).await.updated_at.unwrap() })
        .collect::<futures::future::JoinAll<_>>()
        .await;
    app.advance(std::time::Duration::from_secs(1));
    let first = app
        .reconcile(by_ids(&[&ids[0]], Decision::Dead))
        .await
        .unwrap();
    assert!(first[0].error.is_none());
    let mut request = by_ids(&[&ids[0], &ids[1]], Decision::Requeue);
    if let Some(v1::reconcile_request::Target::Ids(target)) = &mut request.target {
        target.updated_at = seen.clone();
    }
    let results = app.reconcile(request).await.unwrap();
    let error = results[0]
        .error
        .as_ref()
        .expect("changed since it was read");
    assert_eq!(error.reason, "CONFLICT");
    assert!(
        error.message.contains("changed after it was read"),
        "{error:?}"
    );
    assert_eq!(results[0].state(), IntentState::DeadLettered);
    assert!(results[1].error.is_none(), "unchanged: decided");
    assert_eq!(results[1].state(), IntentState::Pending);
    assert_eq!(app.get(&ids[0]).await.resolutions.len(), 1);

    let mut uneven = by_ids(&[&ids[1]], Decision::Dead);
    if let Some(v1::reconcile_request::Target::Ids(target)) = &mut uneven.target {
        target.updated_at = seen;
    }
    let refused = app.reconcile(uneven).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
}
