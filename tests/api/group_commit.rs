//! Group commit of direct-mode Enqueue: calls that arrive while another is committing share
//! the next transaction, and each still gets the answer it would have got alone.

use outboxd::proto::v1;
use tokio::task::JoinHandle;
use tonic::{Code, Status};

use crate::helpers::{TestApp, assert_status, intent};

type Call = JoinHandle<Result<Vec<v1::EnqueueResult>, Status>>;

/// Holds the first Enqueue inside its transaction (behind a SHARE lock on the table) while
/// `later` are sent, waits until all of them wait for that transaction, then lets it go.
/// Returns the first call's answer and the later calls' answers, in order.
async fn behind_a_transaction_in_flight(
    app: &TestApp,
    later: Vec<Vec<v1::NewIntent>>,
) -> (
    Result<Vec<v1::EnqueueResult>, Status>,
    Vec<Result<Vec<v1::EnqueueResult>, Status>>,
) {
    let mut locker = app.lock_intent_table().await;
    let first = app.spawn_enqueue(vec![intent("first", "{}")]);
    app.wait_for_lock_waiters(1).await;
    let n = later.len();
    let calls: Vec<Call> = later.into_iter().map(|i| app.spawn_enqueue(i)).collect();
    app.wait_for_metric(&format!("outbox_enqueue_calls_waiting {n}"))
        .await;
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
    let first = first.await.unwrap();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap());
    }
    (first, answers)
}

/// Transactions that inserted the intents (rows of one transaction share `xmin`).
async fn inserting_transactions(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM outbox.intent")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn enqueues_arriving_while_one_commits_share_the_next_transaction_and_each_gets_its_own_ids()
{
    let app = TestApp::spawn().await;
    let later = (0..5)
        .map(|i| vec![intent("later", &format!(r#"{{"n":{i}}}"#)); 2])
        .collect();
    let (first, later) = behind_a_transaction_in_flight(&app, later).await;

    assert_eq!(first.unwrap().len(), 1);
    let mut ids = Vec::new();
    for (i, answer) in later.into_iter().enumerate() {
        let results = answer.unwrap();
        assert_eq!(results.len(), 2, "call {i} got its own two results");
        for r in results {
            assert_eq!(r.state(), v1::IntentState::Pending);
            assert!(!r.deduplicated);
            assert_eq!(
                app.intent(&r.id).await.payload,
                format!(r#"{{"n":{i}}}"#).into_bytes(),
                "call {i}'s id names call {i}'s intent"
            );
            ids.push(r.id);
        }
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 10);
    assert_eq!(
        inserting_transactions(&app).await,
        2,
        "the first call's transaction, then one for the five that waited"
    );
    app.wait_for_metric("outbox_enqueue_transactions_total 2")
        .await;
}

#[tokio::test]
async fn an_idempotency_conflict_in_a_shared_transaction_fails_only_its_own_call() {
    let app = TestApp::spawn().await;
    let conflicting = app.conflicting_with_a_held_key("order-1").await;
    let later = vec![
        vec![intent("ok", "{}")],
        vec![conflicting, intent("same-call", "{}")],
        vec![intent("ok", "{}")],
    ];
    let (first, later) = behind_a_transaction_in_flight(&app, later).await;

    first.unwrap();
    later[0].as_ref().unwrap();
    assert_status(
        later[1].as_ref().unwrap_err(),
        Code::AlreadyExists,
        "IDEMPOTENCY_CONFLICT",
        &[],
    );
    later[2].as_ref().unwrap();
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intent")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        count, 4,
        "the held one, the first, the two good calls; nothing of the refused call"
    );
}

#[tokio::test]
async fn calls_waiting_with_one_idempotency_key_are_answered_as_if_one_ran_after_the_other() {
    let app = TestApp::spawn().await;
    let mut keyed = intent("charge", r#"{"cents":100}"#);
    keyed.idempotency_key = "order-2".into();
    let (first, later) =
        behind_a_transaction_in_flight(&app, vec![vec![keyed.clone()], vec![keyed]]).await;

    first.unwrap();
    let a = later[0].as_ref().unwrap()[0].clone();
    let b = later[1].as_ref().unwrap()[0].clone();
    assert_eq!(a.id, b.id, "one intent holds the key");
    assert!(
        a.deduplicated != b.deduplicated,
        "exactly one of the two recorded it: {a:?} {b:?}"
    );
}

#[tokio::test]
async fn a_call_of_more_than_a_hundred_intents_does_not_wait_for_a_transaction_in_flight() {
    let app = TestApp::spawn().await;
    let mut locker = app.lock_intent_table().await;
    let first = app.spawn_enqueue(vec![intent("first", "{}")]);
    app.wait_for_lock_waiters(1).await;
    let large = app.spawn_enqueue(vec![intent("large", "{}"); 101]);
    // Both reach PostgreSQL: the large call did not queue behind the first.
    app.wait_for_lock_waiters(2).await;
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();

    assert_eq!(first.await.unwrap().unwrap().len(), 1);
    assert_eq!(large.await.unwrap().unwrap().len(), 101);
    assert_eq!(inserting_transactions(&app).await, 2);
}
