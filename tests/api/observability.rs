//! Operability: Prometheus metrics after a known workload, and health turning
//! NOT_SERVING while the server drains.

use std::time::{Duration, Instant};

use outboxd::proto::v1::FailOutcome;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use crate::helpers::{TestApp, claim_request, intent};

/// The value of the sample whose name and labels are exactly `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test]
async fn metrics_show_the_queue_and_the_traffic_of_a_known_workload() {
    let app = TestApp::spawn_with(|s| s.metrics.refresh_interval = Duration::from_millis(20)).await;
    let mut eu = intent("job", "{}");
    eu.region = "eu".into();
    app.enqueue(vec![
        intent("job", "{}"),
        intent("job", "{}"),
        intent("job", "{}"),
        eu,
    ])
    .await
    .unwrap();
    let mut claim = claim_request("w", 3);
    claim.request_id = "req-1".into();
    let leases = app.claim(claim.clone()).await.unwrap();
    // A replayed Claim: answered the same leases, counted once.
    assert_eq!(app.claim(claim).await.unwrap(), leases);
    app.ack(&[&leases[0]]).await;
    app.fail(&leases[1], FailOutcome::Unknown).await;
    app.fail(&leases[2], FailOutcome::Permanent).await;
    // Replays of calls whose response was lost: answered OK, counted once.
    assert!(app.ack(&[&leases[0]]).await[0].error.is_none());
    let replay = app.fail(&leases[2], FailOutcome::Permanent).await;
    assert!(replay.error.is_none());
    let missing = outboxd::proto::v1::GetIntentRequest {
        id: uuid::Uuid::new_v4().to_string(),
    };
    assert!(app.client().get_intent(missing).await.is_err());

    // Gauges come from the database on the refresh interval: wait for them, with a deadline.
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = app.scrape().await;
        // A refresh after the last Fail sees the whole backlog.
        if sample(&text, "outbox_reconcile_backlog") == Some(2.0) {
            break text;
        }
        assert!(Instant::now() < deadline, "gauges never refreshed:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for (series, value) in [
        ("outbox_intents_enqueued_total", 4.0),
        ("outbox_intents_claimed_total", 3.0),
        ("outbox_intents_acked_total", 1.0),
        (r#"outbox_intents_failed_total{outcome="unknown"}"#, 1.0),
        (r#"outbox_intents_failed_total{outcome="permanent"}"#, 1.0),
        ("outbox_intents_dead_lettered_total", 1.0),
        (r#"outbox_intents{state="needs_reconcile",region=""}"#, 1.0),
        (r#"outbox_intents{state="dead_lettered",region=""}"#, 1.0),
        (r#"outbox_intents{state="pending",region="eu"}"#, 1.0),
        (
            r#"outbox_rpc_requests_total{method="Enqueue",code="OK"}"#,
            1.0,
        ),
        (r#"outbox_rpc_requests_total{method="Fail",code="OK"}"#, 3.0),
        (
            r#"outbox_rpc_requests_total{method="GetIntent",code="NOT_FOUND"}"#,
            1.0,
        ),
        (
            r#"outbox_enqueue_to_claim_seconds_count{method="Claim"}"#,
            3.0,
        ),
    ] {
        assert_eq!(sample(&text, series), Some(value), "{series} in\n{text}");
    }
    assert!(sample(&text, "outbox_oldest_pending_age_seconds").is_some());
    assert!(!text.contains("acme"), "no tenant ids in labels");
}

#[tokio::test]
async fn health_turns_not_serving_while_the_server_drains() {
    let mut app = TestApp::spawn_with(|s| s.shutdown.drain_delay = Duration::from_secs(3)).await;
    let mut health = HealthClient::new(app.client_channel().await);
    let status = |service: &str| HealthCheckRequest {
        service: service.to_owned(),
    };
    let serving = health
        .check(status("outbox.v1.OutboxService"))
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(serving, ServingStatus::Serving as i32);

    let stopping = tokio::spawn(app.take_application().stop());
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let overall = health.check(status("")).await.unwrap().into_inner().status;
        let service = health
            .check(status("outbox.v1.OutboxService"))
            .await
            .unwrap()
            .into_inner()
            .status;
        if overall == ServingStatus::NotServing as i32
            && service == ServingStatus::NotServing as i32
        {
            break;
        }
        assert!(Instant::now() < deadline, "health never turned NOT_SERVING");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Still answering calls while draining.
    assert!(
        app.client()
            .get_queue_stats(outboxd::proto::v1::GetQueueStatsRequest {})
            .await
            .is_ok()
    );
    stopping.await.unwrap().unwrap();
}

/// Polls the overall health status until it is `want`, with a deadline.
async fn wait_for_health(
    health: &mut HealthClient<tonic::transport::Channel>,
    want: ServingStatus,
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let request = HealthCheckRequest {
            service: String::new(),
        };
        if health.check(request).await.unwrap().into_inner().status == want as i32 {
            return;
        }
        assert!(Instant::now() < deadline, "health never became {want:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn readiness_follows_whether_the_service_role_can_use_the_database() {
    let app = TestApp::spawn().await;
    let mut health = HealthClient::new(app.client_channel().await);
    wait_for_health(&mut health, ServingStatus::Serving).await;
    let role = crate::helpers::SERVICE_ROLE;
    sqlx::query(&format!("REVOKE SELECT ON outbox.intent FROM {role}"))
        .execute(&app.pool)
        .await
        .unwrap();
    wait_for_health(&mut health, ServingStatus::NotServing).await;
    sqlx::query(&format!("GRANT SELECT ON outbox.intent TO {role}"))
        .execute(&app.pool)
        .await
        .unwrap();
    wait_for_health(&mut health, ServingStatus::Serving).await;
}

#[tokio::test]
async fn an_open_health_watch_does_not_hold_the_shutdown_for_its_grace() {
    let mut app = TestApp::spawn_with(|s| s.shutdown.grace = Duration::from_secs(60)).await;
    let mut health = HealthClient::new(app.client_channel().await);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);

    let started = Instant::now();
    let stopping = tokio::spawn(app.take_application().stop());
    let mut statuses = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match watch.message().await {
                Ok(Some(update)) => statuses.push(update.status),
                Ok(None) => return None,
                Err(status) => return Some(status.code()),
            }
        }
    })
    .await
    .expect("the watch stayed open through the shutdown");
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("the shutdown waited for the watch")
        .unwrap()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(statuses, [ServingStatus::NotServing as i32]);
    assert_eq!(end, Some(tonic::Code::Unavailable));
}
