//! GetIntent, ListIntents and GetQueueStats, and the health and reflection services.

use std::collections::HashMap;

use outboxd::proto::v1::{self, FailOutcome, IntentState};
use tonic::Code;

use crate::helpers::{LARGEST_PAYLOAD, TestApp, assert_status, id_of, intent};

#[tokio::test]
async fn get_intent_of_an_unknown_or_malformed_id_is_an_error() {
    let app = TestApp::spawn().await;
    let mut client = app.client();
    let status = client
        .get_intent(v1::GetIntentRequest {
            id: uuid::Uuid::new_v4().to_string(),
        })
        .await
        .unwrap_err();
    assert_status(&status, Code::NotFound, "NOT_FOUND", &[]);
    let status = client
        .get_intent(v1::GetIntentRequest { id: "42".into() })
        .await
        .unwrap_err();
    assert_status(&status, Code::InvalidArgument, "INVALID_ARGUMENT", &["id"]);
}

#[tokio::test]
async fn list_intents_filters_and_pages_in_enqueue_order() {
    let app = TestApp::spawn().await;
    let ids = app.enqueue_n("job", 5).await;
    app.enqueue_n("other", 2).await;
    let mut client = app.client();
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = client
            .list_intents(v1::ListIntentsRequest {
                kind: "job".into(),
                page_size: 2,
                page_token: token,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            page.intents.iter().all(|i| i.payload.is_empty()),
            "payloads only on request"
        );
        seen.extend(page.intents.into_iter().map(|i| i.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(seen, ids);

    let lease = app.claim_n("w", 1).await.remove(0);
    app.fail(&lease, FailOutcome::Unknown).await;
    let waiting = client
        .list_intents(v1::ListIntentsRequest {
            states: vec![IntentState::NeedsReconcile as i32],
            include_payload: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(waiting.intents.len(), 1);
    assert_eq!(waiting.intents[0].id, id_of(&lease));
    assert!(!waiting.intents[0].payload.is_empty());

    let status = client
        .list_intents(v1::ListIntentsRequest {
            page_token: "garbage".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["page_token"],
    );
}

#[tokio::test]
async fn queue_stats_count_intents_by_state_and_region() {
    let app = TestApp::spawn().await;
    let mut eu = intent("job", "{}");
    eu.region = "eu".into();
    app.enqueue(vec![
        eu.clone(),
        eu,
        intent("job", "{}"),
        intent("job", "{}"),
    ])
    .await
    .unwrap();
    let mut request = crate::helpers::claim_request("w", 1);
    request.region = "eu".into();
    request.kinds = vec!["job".into()];
    let lease = app.claim(request).await.unwrap().remove(0);
    app.fail(&lease, FailOutcome::Unknown).await;

    let stats = app
        .client()
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    let counts: HashMap<(IntentState, String), i64> = stats
        .counts
        .iter()
        .map(|c| ((c.state(), c.region.clone()), c.count))
        .collect();
    let created = lease.intent.as_ref().unwrap().created_at;
    assert_eq!(
        counts,
        HashMap::from([
            ((IntentState::Pending, String::new()), 2),
            ((IntentState::Pending, "eu".to_owned()), 1),
            ((IntentState::NeedsReconcile, "eu".to_owned()), 1),
        ])
    );
    assert_eq!(stats.reconcile_backlog, 1);
    assert!(!stats.regions_left_out);
    assert_eq!(
        stats.oldest_pending_at, created,
        "all enqueued at the same manual instant"
    );
    assert_eq!(stats.oldest_staged_at, None);
}

/// Regions are the producers' names: however many there are, a state shows the 100 with
/// the most intents, says that it left some out, and its backlog still counts them all.
#[tokio::test]
async fn queue_stats_show_a_state_s_largest_regions_and_say_when_some_are_left_out() {
    let app = TestApp::spawn().await;
    let in_region = |region: String| {
        let mut i = intent("job", "{}");
        i.region = region;
        i.max_attempts = 1;
        i
    };
    let mut intents: Vec<v1::NewIntent> = (0..150).map(|n| in_region(format!("r{n:03}"))).collect();
    intents.push(in_region("r149".into()));
    app.enqueue(intents).await.unwrap();
    let stats = || async {
        app.client()
            .get_queue_stats(v1::GetQueueStatsRequest {})
            .await
            .unwrap()
            .into_inner()
    };

    let shown = stats().await;
    assert!(shown.regions_left_out);
    assert_eq!(shown.counts.len(), 100);
    assert_eq!(
        shown
            .counts
            .iter()
            .find(|c| c.region == "r149")
            .map(|c| c.count),
        Some(2),
        "the largest region is shown first of all"
    );

    let mut leases = Vec::new();
    for region in ["r000", "r001"] {
        let mut request = crate::helpers::claim_request("w", 10);
        request.region = region.into();
        leases.extend(app.claim(request).await.unwrap());
    }
    for lease in &leases {
        app.fail(lease, FailOutcome::Permanent).await;
    }
    let shown = stats().await;
    assert_eq!(shown.reconcile_backlog, 2);
    assert!(shown.regions_left_out, "still 148 regions PENDING");
}

#[tokio::test]
async fn health_reports_the_outbox_service_as_serving() {
    let app = TestApp::spawn().await;
    let channel = app.client_channel().await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "outbox.v1.OutboxService".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    app.stop().await;
}

/// The database stops a page by its own weight of each intent (`outbox.reply_weight`, a
/// little more than the server's estimate of the reply): at this payload it stops at four
/// intents of five, which the server's estimate lets through whole. The page must still
/// say there is more; it came back without a next_page_token, and the fifth was never
/// listed.
#[tokio::test]
async fn a_page_the_database_cut_short_by_its_weight_still_names_the_next() {
    let app = TestApp::spawn().await;
    let intents = (0..5)
        .map(|_| v1::NewIntent {
            payload: vec![b'x'; 1_048_100],
            ..intent("big", "")
        })
        .collect();
    let ids = app.enqueue_ids(intents).await;
    let listed = app.list_all(&[], 5).await;
    assert_eq!(
        listed.iter().map(|i| &i.id).collect::<Vec<_>>(),
        ids.iter().collect::<Vec<_>>()
    );
}

/// A page of intents with payloads that would pass the reply limit (gRPC clients' 4 MiB
/// receive limit by default) ends early with a next_page_token, so the listing goes on.
#[tokio::test]
async fn a_listing_with_payloads_too_large_for_one_page_goes_on_to_the_next() {
    let app = TestApp::spawn().await;
    let ids = app.enqueue_largest_payloads(5).await;

    let first = app
        .client()
        .list_intents(v1::ListIntentsRequest {
            page_size: 5,
            include_payload: true,
            ..Default::default()
        })
        .await
        .expect("a page the default client accepts")
        .into_inner();
    assert_eq!(first.intents.len(), 3, "three of 1 MiB fit in 4 MiB");
    assert!(!first.next_page_token.is_empty());

    let listed = app.list_all(&[], 5).await;
    assert_eq!(
        listed.iter().map(|i| &i.id).collect::<Vec<_>>(),
        ids.iter().collect::<Vec<_>>()
    );
    assert!(
        listed
            .iter()
            .all(|i| i.payload == vec![b'x'; LARGEST_PAYLOAD])
    );
}

/// An operator timeout past PostgreSQL's largest `statement_timeout` (as a server built
/// into another program may set, past the configuration's check) is held to that largest:
/// the call's BEGIN does not fail, and no connection goes back to the pool inside a failed
/// transaction for later calls to trip on.
#[tokio::test]
async fn an_operator_timeout_past_postgresqls_largest_leaves_the_pool_sound() {
    let app = TestApp::spawn_with(|s| {
        s.limits.operator_timeout = std::time::Duration::from_secs(30 * 86_400);
    })
    .await;
    app.enqueue_n("charge", 1).await;
    for _ in 0..3 {
        app.client()
            .get_queue_stats(v1::GetQueueStatsRequest {})
            .await
            .unwrap();
    }
    assert_eq!(app.claim_n("w", 1).await.len(), 1);
}

/// An operator call's statement runs at most `OUTBOX_LIMITS__OPERATOR_TIMEOUT`: a filter
/// that matches nothing of a large table is cancelled by PostgreSQL and answered
/// `STATEMENT_TIMEOUT`, rather than scanning on after its caller gave up; other calls go
/// on as before.
#[tokio::test]
async fn an_operator_call_past_its_statement_timeout_is_refused_and_the_server_goes_on() {
    let app = TestApp::spawn_with(|s| {
        s.limits.operator_timeout = std::time::Duration::from_millis(1);
    })
    .await;
    app.enqueue_n("charge", 1).await;
    // 50,000 copies of it: more than a millisecond to scan.
    sqlx::query(
        "INSERT INTO outbox.intent
         SELECT (jsonb_populate_record(i, jsonb_build_object('id', gen_random_uuid()))).*
         FROM outbox.intent i, generate_series(1, 50000)",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let mut client = app.client();

    let status = client
        .list_intents(v1::ListIntentsRequest {
            kind: "no.such.kind".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, "STATEMENT_TIMEOUT", &[]);
    let status = client
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, "STATEMENT_TIMEOUT", &[]);

    let ids = app.enqueue_n("charge", 1).await;
    assert_eq!(ids.len(), 1, "Enqueue is not an operator call");
}

#[tokio::test]
async fn awaiting_decision_lists_only_states_an_operator_decides_on() {
    let app = TestApp::spawn().await;
    let status = app
        .client()
        .list_intents(v1::ListIntentsRequest {
            states: vec![IntentState::Pending as i32],
            awaiting_decision: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["states"],
    );

    let ids = app.enqueue_n("charge", 2).await;
    let leases = app.claim_n("w", 2).await;
    app.fail(&leases[0], FailOutcome::Unknown).await;
    let page = app
        .client()
        .list_intents(v1::ListIntentsRequest {
            awaiting_decision: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let listed: Vec<_> = page.intents.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(listed, [id_of(&leases[0])]);
    assert!(ids.contains(&listed[0].to_owned()));
}
