//! Operability: Prometheus metrics after a known workload, in the format the scraper asks
//! for, with every series there before it counts anything; health (gRPC and the admin
//! listener's HTTP) turning NOT_SERVING while the server drains; reflection serving the
//! error details' types.

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
        (r#"outbox_intents_enqueued_total{kind="other"}"#, 4.0),
        (r#"outbox_intents_claimed_total{kind="other"}"#, 3.0),
        ("outbox_intents_acked_total", 1.0),
        (r#"outbox_intents_failed_total{outcome="unknown"}"#, 1.0),
        (r#"outbox_intents_failed_total{outcome="permanent"}"#, 1.0),
        ("outbox_intents_dead_lettered_total", 1.0),
        (r#"outbox_intents{state="needs_reconcile",region=""}"#, 1.0),
        (r#"outbox_intents{state="dead_lettered",region=""}"#, 1.0),
        (r#"outbox_intents{state="pending",region="eu"}"#, 1.0),
        (
            r#"outbox_rpc_requests_total{method="/outbox.v1.OutboxService/Enqueue",code="OK"}"#,
            1.0,
        ),
        (
            r#"outbox_rpc_requests_total{method="/outbox.v1.OutboxService/Fail",code="OK"}"#,
            3.0,
        ),
        (
            r#"outbox_rpc_requests_total{method="/outbox.v1.OutboxService/GetIntent",code="NOT_FOUND"}"#,
            1.0,
        ),
        (
            r#"outbox_enqueue_to_claim_seconds_count{method="/outbox.v1.OutboxService/Claim"}"#,
            3.0,
        ),
    ] {
        assert_eq!(sample(&text, series), Some(value), "{series} in\n{text}");
    }
    assert!(sample(&text, "outbox_oldest_pending_age_seconds").is_some());
    assert!(!text.contains("acme"), "no tenant ids in labels");
}

#[tokio::test]
async fn calls_cut_by_their_deadline_or_by_their_caller_are_counted_with_that_code() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 2).await;
    // Claims wait on the lock, past their caller's patience.
    let locker = app.lock_intent_table().await;

    let mut request = tonic::Request::new(claim_request("w", 1));
    request.set_timeout(Duration::from_millis(300));
    let status = app.client().claim(request).await.unwrap_err();
    // tonic answers a call it cut at its grpc-timeout CANCELLED (a client enforcing its
    // own deadline reports DEADLINE_EXCEEDED); the metric names what happened.
    assert_eq!(status.code(), tonic::Code::Cancelled, "{status:?}");
    app.wait_for_metric(
        r#"outbox_rpc_requests_total{method="/outbox.v1.OutboxService/Claim",code="DEADLINE_EXCEEDED"} 1"#,
    )
    .await;

    let mut client = app.client();
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        client.claim(claim_request("w", 1)),
    )
    .await;
    assert!(gave_up.is_err(), "the claim waited on the lock");
    drop(client);
    app.wait_for_metric(
        r#"outbox_rpc_requests_total{method="/outbox.v1.OutboxService/Claim",code="CANCELLED"} 1"#,
    )
    .await;
    drop(locker);
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

/// The value of every sample named `name` (any labels), by its label text.
fn samples<'a>(text: &'a str, name: &str) -> Vec<(&'a str, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| {
            series
                .strip_prefix(name)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('{'))
        })
        .filter_map(|(series, v)| Some((&series[name.len()..], v.parse().ok()?)))
        .collect()
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_default()
}

#[tokio::test]
async fn metrics_are_prometheus_text_unless_the_scraper_asks_for_openmetrics() {
    let app = TestApp::spawn().await;
    app.enqueue(vec![intent("job", "{}")]).await.unwrap();

    // What promtool, prometheus_client's text parser and a bare curl read: text 0.0.4, where
    // a counter's HELP and TYPE name its `_total` samples, with no OpenMetrics EOF.
    for accept in [None, Some("*/*"), Some("text/plain;version=0.0.4")] {
        let (status, headers, body) = app.admin_get("/metrics", accept).await;
        assert_eq!(status, 200);
        assert_eq!(
            header(&headers, "content-type"),
            "text/plain; version=0.0.4; charset=utf-8",
            "{accept:?}"
        );
        assert!(
            body.contains("# TYPE outbox_intents_enqueued_total counter\n"),
            "{body}"
        );
        assert!(
            body.contains("# HELP outbox_intents_enqueued_total "),
            "{body}"
        );
        assert!(
            body.contains("# TYPE process_cpu_seconds_total counter\n"),
            "{body}"
        );
        assert!(!body.contains("# EOF"), "{body}");
        // Every sample belongs to a family with HELP and TYPE ("no help text" otherwise).
        let families: std::collections::BTreeSet<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("# HELP "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        for line in body.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| families.contains(f)))
                .unwrap_or(name);
            assert!(families.contains(family), "{name} has no HELP in\n{body}");
        }
    }

    // Prometheus asks for OpenMetrics first, with text as a fallback: OpenMetrics it gets.
    let prometheus = "application/openmetrics-text;version=1.0.0;q=0.5,\
                      application/openmetrics-text;version=0.0.1;q=0.4,\
                      text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
    let (status, headers, body) = app.admin_get("/metrics", Some(prometheus)).await;
    assert_eq!(status, 200);
    assert_eq!(
        header(&headers, "content-type"),
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert!(
        body.contains("# TYPE outbox_intents_enqueued counter\n"),
        "{body}"
    );
    assert!(
        body.contains("outbox_intents_enqueued_total{kind=\"other\"} 1\n"),
        "{body}"
    );

    // Preferring text, or refusing OpenMetrics (q=0), gets text.
    for accept in [
        "text/plain;q=1,application/openmetrics-text;q=0.5",
        "application/openmetrics-text;q=0",
    ] {
        let (_, headers, _) = app.admin_get("/metrics", Some(accept)).await;
        assert!(
            header(&headers, "content-type").starts_with("text/plain"),
            "{accept}"
        );
    }
}

#[tokio::test]
async fn every_live_state_of_every_region_seen_reads_zero_rather_than_vanishing() {
    let app = TestApp::spawn_with(|s| s.metrics.refresh_interval = Duration::from_millis(20)).await;
    let states = [
        "staged",
        "pending",
        "leased",
        "submitted",
        "needs_reconcile",
        "dead_lettered",
    ];
    // Before anything was enqueued, every state of the region '' is there, at 0.
    let text = app.scrape().await;
    for state in states {
        let series = format!(r#"outbox_intents{{state="{state}",region=""}}"#);
        assert_eq!(sample(&text, &series), Some(0.0), "{series} in\n{text}");
    }
    for outcome in ["retry", "permanent", "unknown"] {
        let series = format!(r#"outbox_intents_failed_total{{outcome="{outcome}"}}"#);
        assert_eq!(sample(&text, &series), Some(0.0), "{series} in\n{text}");
    }

    let mut eu = intent("job", "{}");
    eu.region = "eu".into();
    app.enqueue(vec![eu]).await.unwrap();
    app.wait_for_metric(r#"outbox_intents{state="pending",region="eu"} 1"#)
        .await;
    let text = app.scrape().await;
    for state in states.iter().filter(|s| **s != "pending") {
        let series = format!(r#"outbox_intents{{state="{state}",region="eu"}}"#);
        assert_eq!(sample(&text, &series), Some(0.0), "{series} in\n{text}");
    }

    // Delivered: the region's states stay, at 0.
    let leases = app.claim_n("w", 1).await;
    app.wait_for_metric(r#"outbox_intents{state="leased",region="eu"} 1"#)
        .await;
    app.ack(&[&leases[0]]).await;
    app.wait_for_metric(r#"outbox_intents{state="leased",region="eu"} 0"#)
        .await;
    let text = app.scrape().await;
    for state in states {
        for region in ["", "eu"] {
            let series = format!(r#"outbox_intents{{state="{state}",region="{region}"}}"#);
            assert_eq!(sample(&text, &series), Some(0.0), "{series} in\n{text}");
        }
    }
}

#[tokio::test]
async fn process_build_and_connection_pool_metrics_are_exported() {
    let app = TestApp::spawn().await;
    app.enqueue(vec![intent("job", "{}")]).await.unwrap();
    let text = app.scrape().await;
    let one = |name: &str| {
        let found = samples(&text, name);
        assert_eq!(found.len(), 1, "{name} in\n{text}");
        found[0].1
    };
    assert!(one("process_cpu_seconds_total") > 0.0);
    assert!(one("process_resident_memory_bytes") > 1_000_000.0);
    assert!(one("process_open_fds") > 0.0);
    assert!(one("process_max_fds") >= one("process_open_fds"));
    assert!(one("process_threads") >= 1.0);
    let started = one("process_start_time_seconds");
    let now = chrono::Utc::now().timestamp() as f64;
    assert!(started <= now + 1.0 && started > now - 3600.0, "{started}");

    let build = samples(&text, "outbox_build_info");
    assert_eq!(build.len(), 1, "{text}");
    let (labels, value) = build[0];
    assert_eq!(value, 1.0);
    let version = format!(r#"version="{}""#, env!("CARGO_PKG_VERSION"));
    assert!(labels.contains(&version), "{labels}");
    assert!(labels.contains(r#"commit=""#), "{labels}");
    assert!(!labels.contains(r#"commit="""#), "{labels}");

    for pool in ["tenant", "fleet"] {
        let labels = format!(r#"{{pool="{pool}"}}"#);
        let of = |name: &str| {
            samples(&text, name)
                .into_iter()
                .find(|(l, _)| *l == labels)
                .map(|(_, v)| v)
        };
        // TestApp's pools hold 20 connections each.
        assert_eq!(
            of("outbox_db_pool_max_connections"),
            Some(20.0),
            "{pool}\n{text}"
        );
        let open = of("outbox_db_pool_connections").unwrap();
        let idle = of("outbox_db_pool_idle_connections").unwrap();
        assert!(
            open >= 1.0 && idle <= open,
            "{pool}: {open} open, {idle} idle"
        );
        assert_eq!(of("outbox_db_pool_acquires_waiting"), Some(0.0), "{pool}");
    }
    // The Enqueue's transaction acquired from the tenant pool, and it was timed.
    let acquired = samples(&text, "outbox_db_pool_acquire_seconds_count");
    let tenant = acquired.iter().find(|(l, _)| *l == r#"{pool="tenant"}"#);
    assert!(tenant.is_some_and(|(_, n)| *n >= 1.0), "{text}");
}

/// The pools' acquire figures count the calls that are one statement (a Claim, an Ack), not
/// only transactions: a pool too small for a load of workers alone shows there too.
#[tokio::test]
async fn a_claim_and_an_ack_are_counted_in_the_pools_acquires() {
    let app = TestApp::spawn().await;
    app.enqueue(vec![intent("job", "{}")]).await.unwrap();
    let acquires = |text: &str| {
        samples(text, "outbox_db_pool_acquire_seconds_count")
            .into_iter()
            .find(|(l, _)| *l == r#"{pool="tenant"}"#)
            .map_or(0.0, |(_, n)| n)
    };
    let before = acquires(&app.scrape().await);
    let leases = app.claim_n("w", 10).await;
    let claimed = acquires(&app.scrape().await);
    assert!(claimed > before, "{before} → {claimed}");
    let results = app.ack(&leases.iter().collect::<Vec<_>>()).await;
    assert!(results.iter().all(|r| r.error.is_none()), "{results:?}");
    let acked = acquires(&app.scrape().await);
    assert!(acked > claimed, "{claimed} → {acked}");
}

#[tokio::test]
async fn every_method_label_is_the_full_grpc_method_name() {
    let app = TestApp::spawn().await;
    app.enqueue(vec![intent("job", "{}")]).await.unwrap();
    let mut health = HealthClient::new(app.client_channel().await);
    health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    let no_key = app.client_with(None, None).await;
    assert!(
        no_key
            .clone()
            .get_queue_stats(outboxd::proto::v1::GetQueueStatsRequest {})
            .await
            .is_err()
    );
    let text = app.scrape().await;
    let mut methods = std::collections::BTreeSet::new();
    for name in [
        "outbox_rpc_requests_total",
        "outbox_rpc_duration_seconds_count",
    ] {
        for (labels, _) in samples(&text, name) {
            let method = labels
                .split("method=\"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap();
            methods.insert(method.to_owned());
        }
    }
    assert_eq!(
        methods.into_iter().collect::<Vec<_>>(),
        [
            "/grpc.health.v1.Health/Check",
            "/outbox.v1.OutboxService/Enqueue",
            "/outbox.v1.OutboxService/GetQueueStats",
        ],
        "{text}"
    );
}

#[tokio::test]
async fn kinds_listed_get_a_label_of_their_own_and_the_rest_count_as_other() {
    let app = TestApp::spawn_with(|s| {
        s.metrics.kinds = "email, webhook".parse().unwrap();
    })
    .await;
    app.enqueue(vec![
        intent("email", "{}"),
        intent("email", "{}"),
        intent("sms", "{}"),
        intent("push", "{}"),
    ])
    .await
    .unwrap();
    app.claim_n("w", 10).await;
    let text = app.scrape().await;
    for (series, value) in [
        (r#"outbox_intents_enqueued_total{kind="email"}"#, 2.0),
        (r#"outbox_intents_enqueued_total{kind="webhook"}"#, 0.0),
        (r#"outbox_intents_enqueued_total{kind="other"}"#, 2.0),
        (r#"outbox_intents_claimed_total{kind="email"}"#, 2.0),
        (r#"outbox_intents_claimed_total{kind="other"}"#, 2.0),
    ] {
        assert_eq!(sample(&text, series), Some(value), "{series} in\n{text}");
    }
    assert!(!text.contains("kind=\"sms\""), "{text}");
}

#[test]
fn a_kind_list_that_would_break_the_page_or_grow_without_bound_is_refused() {
    use outboxd::config::KindList;
    assert_eq!(
        "a, b,,c".parse::<KindList>().unwrap(),
        KindList(vec!["a".into(), "b".into(), "c".into()])
    );
    for bad in ["a\"b", "a\\b", &"k".repeat(201)] {
        let e = bad.parse::<KindList>().unwrap_err();
        assert!(e.contains("at most 200 bytes"), "{e}");
    }
    let many = (0..101)
        .map(|i| format!("k{i}"))
        .collect::<Vec<_>>()
        .join(",");
    assert!(
        many.parse::<KindList>()
            .unwrap_err()
            .contains("at most 100")
    );
}

/// Polls `GET /readyz` until it answers `want`, with a deadline.
async fn wait_for_readyz(app: &TestApp, want: u16) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, _, body) = app.admin_get("/readyz", None).await;
        if status == want {
            return;
        }
        assert!(Instant::now() < deadline, "/readyz stayed {status} {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn readyz_turns_unavailable_while_the_server_drains_and_livez_stays_ok() {
    let mut app = TestApp::spawn_with(|s| s.shutdown.drain_delay = Duration::from_secs(3)).await;
    assert_eq!(app.admin_get("/readyz", None).await.0, 200);
    assert_eq!(app.admin_get("/livez", None).await.0, 200);

    let stopping = tokio::spawn(app.take_application().stop());
    wait_for_readyz(&app, 503).await;
    let (_, _, why) = app.admin_get("/readyz", None).await;
    assert!(why.contains("draining"), "{why}");
    // Alive and still answering calls while draining: no restart, no refused call.
    assert_eq!(app.admin_get("/livez", None).await.0, 200);
    assert!(
        app.client()
            .get_queue_stats(outboxd::proto::v1::GetQueueStatsRequest {})
            .await
            .is_ok()
    );
    stopping.await.unwrap().unwrap();
}

#[tokio::test]
async fn livez_and_readyz_answer_until_the_last_call_of_the_grace_has_finished() {
    let mut app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let leases = app.claim_n("w", 1).await;
    // An Ack held on a row lock keeps the server in its grace.
    let mut locker = app.lock_intent_row(&id).await;
    let lease = crate::helpers::lease_ref(&leases[0]);
    let mut client = app.client();
    let ack = tokio::spawn(async move {
        let request = outboxd::proto::v1::AckRequest {
            leases: vec![lease],
        };
        client.ack(request).await
    });
    app.wait_for_lock_waiters(1).await;

    let stopping = tokio::spawn(app.take_application().stop());
    // Past the drain delay: the gRPC listener takes no new connection.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(app.addr).await.is_ok() {
        assert!(Instant::now() < deadline, "the gRPC listener stayed open");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(app.admin_get("/readyz", None).await.0, 503);
    assert_eq!(app.admin_get("/livez", None).await.0, 200);
    assert!(!stopping.is_finished(), "the Ack holds the grace");
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
    assert!(ack.await.unwrap().is_ok());
    stopping.await.unwrap().unwrap();
}

#[tokio::test]
async fn readyz_follows_whether_the_service_role_can_use_the_database() {
    let app = TestApp::spawn().await;
    wait_for_readyz(&app, 200).await;
    let role = crate::helpers::SERVICE_ROLE;
    sqlx::query(&format!("REVOKE SELECT ON outbox.intent FROM {role}"))
        .execute(&app.pool)
        .await
        .unwrap();
    wait_for_readyz(&app, 503).await;
    let (_, _, why) = app.admin_get("/readyz", None).await;
    assert!(why.contains("database"), "{why}");
    sqlx::query(&format!("GRANT SELECT ON outbox.intent TO {role}"))
        .execute(&app.pool)
        .await
        .unwrap();
    wait_for_readyz(&app, 200).await;
}

#[tokio::test]
async fn reflection_serves_the_error_detail_types_the_api_depends_on() {
    use prost::Message;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let app = TestApp::spawn().await;
    let mut reflection = ServerReflectionClient::new(app.client_channel().await);
    let ask = |request: MessageRequest| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    };
    let files = |response: Option<MessageResponse>| match response {
        Some(MessageResponse::FileDescriptorResponse(f)) => f
            .file_descriptor_proto
            .iter()
            .map(|b| prost_types::FileDescriptorProto::decode(&b[..]).unwrap())
            .collect::<Vec<_>>(),
        other => panic!("no file descriptor: {other:?}"),
    };
    let requests = tokio_stream::iter([
        ask(MessageRequest::FileContainingSymbol(
            "outbox.v1.OutboxService".into(),
        )),
        ask(MessageRequest::FileContainingSymbol(
            "google.rpc.BadRequest".into(),
        )),
        ask(MessageRequest::FileByFilename(
            "google/rpc/error_details.proto".into(),
        )),
    ]);
    let mut responses = reflection
        .server_reflection_info(requests)
        .await
        .unwrap()
        .into_inner();
    let mut next = async || files(responses.message().await.unwrap().unwrap().message_response);

    // The service's file names the details' file among its dependencies, so that a client
    // fetching the service's schema fetches them too.
    let api = next().await;
    let outbox = api.iter().find(|f| f.package() == "outbox.v1").unwrap();
    assert!(
        outbox
            .dependency
            .iter()
            .any(|d| d == "google/rpc/error_details.proto"),
        "{:?}",
        outbox.dependency
    );
    for _ in 0..2 {
        let details = next().await;
        let file = details
            .iter()
            .find(|f| f.name() == "google/rpc/error_details.proto")
            .unwrap();
        let messages: Vec<&str> = file.message_type.iter().map(|m| m.name()).collect();
        for wanted in ["ErrorInfo", "BadRequest", "RetryInfo"] {
            assert!(messages.contains(&wanted), "{messages:?}");
        }
    }
}

/// Regions are the producers' names: the first 64 get a label of their own, besides
/// intents of no region, and the rest share `(other)`, which no region can be called.
#[tokio::test]
async fn the_region_label_takes_64_regions_then_other() {
    let app = TestApp::spawn().await;
    let in_region = |n: usize| {
        let mut i = intent("job", "{}");
        i.region = format!("r{n:02}");
        i
    };
    let mut batch: Vec<_> = (0..70).map(in_region).collect();
    batch.push(intent("job", "{}"));
    app.enqueue(batch).await.unwrap();
    app.wait_for_metric(r#"outbox_intents{state="pending",region="(other)"} 6"#)
        .await;
    let text = app.scrape().await;
    let labelled: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with(r#"outbox_intents{state="pending",region=""#))
        .filter(|l| !l.ends_with(" 0"))
        .filter_map(|l| l.split("region=\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!(labelled.len(), 64 + 2, "{labelled:?}");
    assert!(labelled.contains("") && labelled.contains("(other)"));
}
