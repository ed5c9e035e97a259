//! Enqueue in direct mode: batches, idempotency keys, scheduling and rejections.

use std::time::Duration;

use outboxd::proto::v1;
use tonic::Code;

use crate::helpers::{
    TestApp, assert_item_ok, assert_status, claim_request, delayed_intent, intent, secs,
};

#[tokio::test]
async fn enqueue_stores_a_batch_as_pending_in_request_order() {
    let app = TestApp::spawn().await;
    let mut second = intent("email.send", r#"{"to":"b@example.com"}"#);
    second.region = "eu".into();
    second.headers.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );
    second.max_attempts = 3;
    let results = app
        .enqueue(vec![
            intent("email.send", r#"{"to":"a@example.com"}"#),
            second,
        ])
        .await
        .unwrap();

    assert_eq!(results.len(), 2);
    assert!(
        results
            .iter()
            .all(|r| r.state() == v1::IntentState::Pending && !r.deduplicated)
    );
    assert!(results[0].id < results[1].id, "ids are time ordered");
    let stored = app.intent(&results[1].id).await;
    assert_eq!(stored.kind, "email.send");
    assert_eq!(stored.payload, br#"{"to":"b@example.com"}"#);
    assert_eq!(stored.content_type, "application/json");
    assert_eq!(stored.region, "eu");
    assert_eq!(stored.max_attempts, 3);
    assert_eq!(stored.attempts, 0);
    assert_eq!(
        stored.headers.get("traceparent").map(String::as_str),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(
        app.intent(&results[0].id).await.max_attempts,
        5,
        "server default"
    );
}

#[tokio::test]
async fn repeating_an_idempotency_key_returns_the_existing_intent_as_deduplicated() {
    let app = TestApp::spawn().await;
    let mut keyed = intent("charge", r#"{"cents":100}"#);
    keyed.idempotency_key = "order-42".into();
    let first = app.enqueue(vec![keyed.clone()]).await.unwrap();
    let again = app
        .enqueue(vec![keyed, intent("other", "{}")])
        .await
        .unwrap();

    assert!(!first[0].deduplicated);
    assert_eq!(again[0].id, first[0].id);
    assert!(again[0].deduplicated);
    assert_eq!(again[0].state(), v1::IntentState::Pending);
    assert!(!again[1].deduplicated);
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intent")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(count, 2);
}

#[tokio::test]
async fn reusing_an_idempotency_key_with_another_payload_is_already_exists_and_stores_nothing() {
    let app = TestApp::spawn().await;
    let changed = app.conflicting_with_a_held_key("order-42").await;
    let before = app.snapshot().await;

    let status = app
        .enqueue(vec![intent("innocent", "{}"), changed])
        .await
        .unwrap_err();

    assert_status(&status, Code::AlreadyExists, "IDEMPOTENCY_CONFLICT", &[]);
    assert_eq!(
        app.snapshot().await,
        before,
        "the whole batch was rolled back"
    );
}

#[tokio::test]
async fn invalid_intents_are_rejected_with_every_field_named_and_nothing_stored() {
    let app = TestApp::spawn().await;
    let empty = app.enqueue(vec![]).await.unwrap_err();
    assert_status(
        &empty,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["intents"],
    );

    let mut bad_kind = intent("has space", "{}");
    bad_kind.max_attempts = -1;
    let no_kind = intent("", "{}");
    let mut dup_a = intent("k", "{}");
    dup_a.idempotency_key = "same".into();
    let dup_b = dup_a.clone();
    let mut bad_region = intent("k", "{}");
    bad_region.region = "eu west".into();
    let mut nul_header = intent("k", "{}");
    nul_header.headers.insert("x-note".into(), "a\0b".into());
    let mut negative_delay = intent("k", "{}");
    negative_delay.schedule = Some(v1::new_intent::Schedule::Delay(prost_types::Duration {
        seconds: -5,
        nanos: 0,
    }));
    let status = app
        .enqueue(vec![
            bad_kind,
            no_kind,
            dup_a,
            dup_b,
            bad_region,
            nul_header,
            negative_delay,
        ])
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &[
            "intents[0].kind",
            "intents[0].max_attempts",
            "intents[1].kind",
            "intents[3].idempotency_key",
            "intents[4].region",
            "intents[5].headers[\"x-note\"]",
            "intents[6].delay",
        ],
    );
    assert!(app.snapshot().await.is_empty());
}

#[tokio::test]
async fn oversized_payloads_and_batches_are_resource_exhausted() {
    let app = TestApp::spawn_with(|s| {
        s.limits.max_payload_bytes = 16;
        s.limits.max_batch = 3;
    })
    .await;
    let status = app
        .enqueue(vec![intent(
            "k",
            "this payload is longer than sixteen bytes",
        )])
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::ResourceExhausted,
        "PAYLOAD_TOO_LARGE",
        &["intents[0].payload"],
    );

    let status = app.enqueue(vec![intent("k", "{}"); 4]).await.unwrap_err();
    assert_status(
        &status,
        Code::ResourceExhausted,
        "BATCH_TOO_LARGE",
        &["intents"],
    );
    assert!(app.snapshot().await.is_empty());
}

#[tokio::test]
async fn a_delayed_intent_is_claimable_only_once_its_time_has_come() {
    let app = TestApp::spawn().await;
    let delayed = delayed_intent("reminder", Duration::from_secs(60));
    let id = app.enqueue(vec![delayed]).await.unwrap()[0].id.clone();
    let stored = app.intent(&id).await;
    assert_eq!(secs(&stored.available_at) - secs(&stored.created_at), 60.0);

    assert!(app.claim_n("w", 10).await.is_empty());
    app.advance(Duration::from_secs(59));
    assert!(app.claim_n("w", 10).await.is_empty());
    app.advance(Duration::from_secs(1));
    let leases = app.claim(claim_request("w", 10)).await.unwrap();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].intent.as_ref().unwrap().id, id);
}

#[tokio::test]
async fn an_intent_scheduled_at_an_instant_waits_for_it() {
    let app = TestApp::spawn().await;
    let now = app.clock.now().unwrap();
    let mut later = intent("reminder", "{}");
    later.schedule = Some(v1::new_intent::Schedule::AvailableAt(
        outboxd::proto::timestamp(now + chrono::Duration::seconds(30)),
    ));
    app.enqueue(vec![later]).await.unwrap();
    assert!(app.claim_n("w", 10).await.is_empty());
    app.advance(Duration::from_secs(30));
    assert_eq!(app.claim_n("w", 10).await.len(), 1);
}

/// An instant in the past is now: the intent is claimable at once, and takes its place
/// among its queue's intents by when it was enqueued, not before older ones.
#[tokio::test]
async fn an_intent_scheduled_in_the_past_is_due_from_its_enqueue() {
    let app = TestApp::spawn().await;
    let first = app.enqueue_one("job", "{}").await;
    app.advance(Duration::from_secs(5));
    let now = app.clock.now().unwrap();
    let mut past = intent("job", "{}");
    past.schedule = Some(v1::new_intent::Schedule::AvailableAt(
        outboxd::proto::timestamp(now - chrono::Duration::hours(1)),
    ));
    let past = app.enqueue(vec![past]).await.unwrap()[0].id.clone();

    let got = app.intent(&past).await;
    // PostgreSQL keeps microseconds.
    use chrono::SubsecRound;
    assert_eq!(
        got.available_at,
        Some(outboxd::proto::timestamp(now.trunc_subsecs(6)))
    );
    let claimed: Vec<String> = app
        .claim_n("w", 10)
        .await
        .iter()
        .map(|l| l.intent.as_ref().unwrap().id.clone())
        .collect();
    assert_eq!(claimed, vec![first, past]);
}

#[tokio::test]
async fn calls_made_on_pooled_connections_that_died_while_idle_are_made_again_on_live_ones() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 1).await;
    let lease = app.claim_n("w", 1).await.remove(0);
    // As a PostgreSQL restart or an idle-session timeout would: every idle connection of
    // the server's pool dies.
    let killed: i64 = sqlx::query_scalar(
        "WITH server AS MATERIALIZED (
             SELECT pid FROM pg_stat_activity
             WHERE datname = current_database() AND usename <> current_user
         )
         SELECT count(*) FROM server WHERE pg_terminate_backend(pid)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(killed > 0);

    let ids = app.enqueue_n("job", 3).await;
    assert_item_ok(&app.ack(&[&lease]).await[0], v1::IntentState::Delivered);
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.intent WHERE id = ANY($1::uuid[])")
            .bind(&ids)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(stored, 3, "each intent recorded once");
}

/// A rejection travels in HTTP/2 headers, which clients cap (16 KiB in tonic and hyper):
/// `grpc-message` percent-encodes every non-ASCII byte as three, and the details are base64.
/// One naming many non-ASCII header names must still arrive as INVALID_ARGUMENT, not as a
/// protocol error.
#[tokio::test]
async fn a_rejection_naming_many_non_ascii_fields_still_reaches_the_client() {
    let app = TestApp::spawn().await;
    let intents = (0..1000)
        .map(|_| v1::NewIntent {
            headers: [("😀".repeat(40), "v".to_owned())].into(),
            ..intent("job", "{}")
        })
        .collect();
    let status = app.enqueue(intents).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
}
