//! An operator's CANCEL: intents not delivered yet (STAGED, WAITING, PENDING) become
//! CANCELLED, recorded with who and why, and no worker ever sees them.

use std::collections::HashSet;
use std::time::Duration;

use outboxd::proto::v1::{self, Decision, IntentState};
use sqlx::Connection;

use crate::helpers::{TestApp, claim_request, id_of, intent};
use crate::two_phase::{enqueue_in, token_of};

fn cancel_ids(ids: &[&str]) -> v1::ReconcileRequest {
    v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
            ids: ids.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })),
        decision: Decision::Cancel as i32,
        actor: "alice".into(),
        reason: "the customer withdrew the order".into(),
        limit: 0,
    }
}

#[tokio::test]
async fn a_cancelled_intent_is_never_claimed_and_the_decision_is_recorded() {
    let app = TestApp::spawn().await;
    let ids = app.enqueue_n("email.send", 3).await;
    let results = app
        .reconcile(cancel_ids(&[&ids[0], &ids[1]]))
        .await
        .unwrap();
    assert!(results.iter().all(|r| r.error.is_none()), "{results:?}");
    assert!(results.iter().all(|r| r.state() == IntentState::Cancelled));

    let claimed: Vec<String> = app.claim_ids("w", 10).await;
    assert_eq!(claimed, [ids[2].clone()]);
    let got = app.get(&ids[0]).await;
    assert_eq!(got.intent.unwrap().state(), IntentState::Cancelled);
    assert_eq!(got.resolutions.len(), 1);
    assert_eq!(got.resolutions[0].decision(), Decision::Cancel);
    assert_eq!(got.resolutions[0].from_state(), IntentState::Pending);
    assert_eq!(got.resolutions[0].actor, "alice");
    assert_eq!(app.stat(IntentState::Cancelled, None).await, 2);

    // Final: the retention purges it with the delivered ones.
    app.advance(Duration::from_secs(60 * 60 * 24 * 30));
    app.purge().await;
    assert_eq!(app.stat(IntentState::Cancelled, None).await, 0);
}

#[tokio::test]
async fn a_leased_intent_cannot_be_cancelled() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("email.send", "{}").await;
    app.claim_n("w", 1).await;
    let results = app.reconcile(cancel_ids(&[&id])).await.unwrap();
    let error = results[0].error.as_ref().expect("refused");
    assert_eq!(error.reason, "INVALID_STATE");
    assert_eq!(results[0].state(), IntentState::Leased);
}

#[tokio::test]
async fn a_cancelled_staged_intent_stays_cancelled_when_its_producer_commits() {
    let app = TestApp::spawn().await;
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    let results = enqueue_in(&app, &token, vec![intent("email.send", "{}")])
        .await
        .unwrap();
    let id = results[0].id.clone();
    app.reconcile(cancel_ids(&[&id])).await.unwrap();
    tx.commit().await.unwrap();
    // A promotion after the commit finds nothing STAGED to promote.
    let report = app.promote().await;
    assert_eq!(report.promoted, 0, "{report:?}");
    assert!(app.claim_n("w", 10).await.is_empty());
    assert_eq!(app.state(&id).await, IntentState::Cancelled);
}

#[tokio::test]
async fn cancelling_by_filter_takes_only_the_matching_intents_up_to_the_limit() {
    let app = TestApp::spawn().await;
    let mails = app.enqueue_n("email.send", 5).await;
    let sms = app.enqueue_n("sms.send", 2).await;
    let request = v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
            states: vec![IntentState::Pending as i32],
            kind: "email.send".into(),
            ..Default::default()
        })),
        decision: Decision::Cancel as i32,
        actor: "alice".into(),
        reason: "campaign stopped".into(),
        limit: 3,
    };
    let results = app.reconcile(request).await.unwrap();
    let cancelled: HashSet<&str> = results.iter().map(|r| r.intent_id.as_str()).collect();
    assert_eq!(cancelled.len(), 3);
    assert!(cancelled.iter().all(|id| mails.iter().any(|m| m == id)));
    let left: HashSet<String> = app.claim_ids("w", 10).await.into_iter().collect();
    assert_eq!(left.len(), 4);
    assert!(sms.iter().all(|s| left.contains(s)));
}

/// Two replicas, eight claimers, and the operator's cancels sent to both: each intent is
/// either leased once or cancelled, never both, never neither; by the database, no
/// cancelled intent was ever leased (its attempts are 0).
#[tokio::test]
async fn a_cancel_racing_eight_claimers_on_two_replicas_loses_nothing_and_cancels_nothing_leased() {
    let app = TestApp::spawn().await;
    let other = TestApp::spawn_on(app.url.clone(), |_| {}).await;
    let ids = app.enqueue_n("job", 400).await;
    let mut claimers = Vec::new();
    for w in 0..8 {
        let mut client = if w % 2 == 0 {
            app.client()
        } else {
            other.client()
        };
        claimers.push(tokio::spawn(async move {
            let mut leased = Vec::new();
            loop {
                let leases = client
                    .claim(claim_request(&format!("w{w}"), 7))
                    .await
                    .unwrap()
                    .into_inner()
                    .leases;
                if leases.is_empty() {
                    return leased;
                }
                leased.extend(leases.iter().map(|l| id_of(l).to_owned()));
            }
        }));
    }
    let mut cancelled = HashSet::new();
    for (n, chunk) in ids.chunks(20).enumerate() {
        let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let replica = if n % 2 == 0 { &app } else { &other };
        for r in replica.reconcile(cancel_ids(&refs)).await.unwrap() {
            if r.error.is_none() {
                assert_eq!(r.state(), IntentState::Cancelled);
                cancelled.insert(r.intent_id.clone());
            } else {
                assert_eq!(r.state(), IntentState::Leased, "{r:?}");
            }
        }
    }
    let mut leased = HashSet::new();
    for c in claimers {
        for id in c.await.unwrap() {
            assert!(leased.insert(id), "leased twice");
        }
    }
    assert!(cancelled.is_disjoint(&leased), "cancelled and leased");
    assert_eq!(
        cancelled.len() + leased.len(),
        ids.len(),
        "every intent one or the other"
    );
    for id in &cancelled {
        assert_eq!(app.state(id).await, IntentState::Cancelled);
    }
    let leased_and_cancelled: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.intent WHERE state = 'cancelled' AND attempts > 0",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(leased_and_cancelled, 0);
}

#[tokio::test]
async fn cancelling_the_first_intent_of_an_ordering_key_moves_the_key_on() {
    let app = TestApp::spawn().await;
    let mut first = intent("order.event", "1");
    first.ordering_key = "order-1".into();
    let mut second = intent("order.event", "2");
    second.ordering_key = "order-1".into();
    let ids = app.enqueue_ids(vec![first, second]).await;
    app.reconcile(cancel_ids(&[&ids[0]])).await.unwrap();
    assert_eq!(app.state(&ids[1]).await, IntentState::Pending);
    assert_eq!(app.claim_ids("w", 10).await, [ids[1].clone()]);
}
