//! Queues (their levels) without a live intent for an hour are forgotten: claims stop
//! walking them and the tenant's cap of 1,000 counts the queues in use.

use std::time::Duration;

use outboxd::outbox::maintenance::EMPTY_QUEUE_GRACE;
use outboxd::outbox::store::{self, EnqueueParams};
use outboxd::outbox::{NewIntent, Schedule};
use outboxd::proto::v1::{self, FailOutcome, IntentState};

use tonic::Code;

use crate::helpers::{
    TENANT, TestApp, assert_item_ok, assert_status, claim_request, id_of, intent,
};
use crate::two_phase::{enqueue_in, token_of};

/// The registered levels' kinds, and whether each is noted idle.
async fn levels(app: &TestApp) -> Vec<(String, bool)> {
    sqlx::query_as(
        "SELECT l.kind, d.since IS NOT NULL
         FROM outbox.queue_level l
         LEFT JOIN outbox.queue_level_idle d USING (tenant_id, kind, priority)
         ORDER BY l.kind, l.priority",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

async fn claim_kind(app: &TestApp, kind: &str) -> v1::Lease {
    let request = v1::ClaimRequest {
        kinds: vec![kind.into()],
        ..claim_request("w", 1)
    };
    app.claim(request).await.unwrap().remove(0)
}

/// One intent of `kind` delivered, its queue then noted idle and the grace past.
async fn delivered_and_idle_past_the_grace(app: &TestApp, kind: &str) {
    app.enqueue_n(kind, 1).await;
    let lease = claim_kind(app, kind).await;
    app.ack(&[&lease]).await;
    app.forget_empty_queues().await;
    app.advance(EMPTY_QUEUE_GRACE + Duration::from_secs(1));
}

/// Registers `n` queues `kind.1`, … of the tenant, with no intent, as SQL would.
async fn register_kinds(app: &TestApp, n: i32) {
    sqlx::query(
        "INSERT INTO outbox.queue_level (tenant_id, kind, priority)
         SELECT $1, 'kind.' || n, 0 FROM generate_series(1, $2) n",
    )
    .bind(TENANT)
    .bind(n)
    .execute(&app.pool)
    .await
    .unwrap();
}

/// Past the grace, as the sweeps see it: a pass notes the empty levels, a pass an hour
/// later forgets them.
async fn forget_after_the_grace(app: &TestApp) -> u64 {
    app.forget_empty_queues().await;
    app.advance(EMPTY_QUEUE_GRACE + Duration::from_secs(1));
    app.forget_empty_queues().await
}

#[tokio::test]
async fn a_queue_empty_for_an_hour_is_forgotten_and_its_next_intent_registers_it_again() {
    let app = TestApp::spawn().await;
    let mut urgent = intent("mail", "{}");
    urgent.priority = 5;
    app.enqueue(vec![intent("mail", "{}"), urgent])
        .await
        .unwrap();
    let leases = app.claim_n("w", 10).await;
    app.ack(&leases.iter().collect::<Vec<_>>()).await;

    assert_eq!(app.forget_empty_queues().await, 0);
    let idle = vec![("mail".into(), true), ("mail".into(), true)];
    assert_eq!(levels(&app).await, idle);
    app.advance(EMPTY_QUEUE_GRACE - Duration::from_secs(1));
    assert_eq!(
        app.forget_empty_queues().await,
        0,
        "not empty for an hour yet"
    );
    app.advance(Duration::from_secs(2));
    assert_eq!(
        app.forget_empty_queues().await,
        2,
        "both priorities' levels"
    );
    assert!(levels(&app).await.is_empty());

    let id = app.enqueue_one("mail", "{}").await;
    assert_eq!(levels(&app).await, vec![("mail".into(), false)]);
    assert_eq!(app.claim_ids("w", 10).await, vec![id]);
}

/// A level noted idle that holds an intent again at the next look is kept, however long
/// ago it was noted; of a queue's levels only the idle ones go.
#[tokio::test]
async fn a_level_busy_again_is_kept_and_only_a_queues_idle_levels_go() {
    let app = TestApp::spawn().await;
    let mut urgent = intent("mail", "{}");
    urgent.priority = 5;
    app.enqueue(vec![intent("mail", "{}"), urgent.clone()])
        .await
        .unwrap();
    let leases = app.claim_n("w", 10).await;
    app.ack(&leases.iter().collect::<Vec<_>>()).await;
    app.forget_empty_queues().await;
    app.advance(Duration::from_secs(60));
    app.enqueue(vec![urgent]).await.unwrap();

    assert_eq!(forget_after_the_grace(&app).await, 1, "priority 0 alone");
    let urgent_level: Vec<(String, i16, bool)> = sqlx::query_as(
        "SELECT l.kind, l.priority, d.since IS NOT NULL
         FROM outbox.queue_level l
         LEFT JOIN outbox.queue_level_idle d USING (tenant_id, kind, priority)",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(urgent_level, vec![("mail".to_owned(), 5, false)]);
}

#[tokio::test]
async fn a_queue_holding_an_intent_in_any_live_state_is_kept() {
    let app = TestApp::spawn().await;
    for kind in [
        "pending",
        "leased",
        "submitted",
        "reconcile",
        "dead",
        "delivered",
    ] {
        app.enqueue_n(kind, 1).await;
    }
    for kind in ["leased", "submitted", "reconcile", "dead", "delivered"] {
        let lease = claim_kind(&app, kind).await;
        let (result, state) = match kind {
            "submitted" => (
                app.mark_submitted(&[&lease]).await.remove(0),
                IntentState::Submitted,
            ),
            "reconcile" => (
                app.fail(&lease, FailOutcome::Unknown).await,
                IntentState::NeedsReconcile,
            ),
            "dead" => (
                app.fail(&lease, FailOutcome::Permanent).await,
                IntentState::DeadLettered,
            ),
            "delivered" => (app.ack(&[&lease]).await.remove(0), IntentState::Delivered),
            _ => continue,
        };
        assert_item_ok(&result, state);
    }
    // WAITING behind its key's head, of another kind.
    let mut head = intent("head", "{}");
    head.ordering_key = "order-1".into();
    let mut waiting = intent("waiting", "{}");
    waiting.ordering_key = "order-1".into();
    app.enqueue(vec![head, waiting]).await.unwrap();
    // STAGED in a producer's open transaction.
    let mut producer = app.producer().await;
    let mut tx = sqlx::Connection::begin(&mut producer).await.unwrap();
    let token = token_of(&mut tx).await;
    enqueue_in(&app, &token, vec![intent("staged", "{}")])
        .await
        .unwrap();

    assert_eq!(forget_after_the_grace(&app).await, 1);
    let kinds: Vec<String> = levels(&app).await.into_iter().map(|(k, _)| k).collect();
    let kept = [
        "dead",
        "head",
        "leased",
        "pending",
        "reconcile",
        "staged",
        "submitted",
        "waiting",
    ];
    assert_eq!(kinds, kept, "only the delivered queue is forgotten");
    tx.rollback().await.unwrap();
}

/// An insert that has not committed is invisible to the sweep: the queue's lock, held from
/// the insert's level probe to its commit, keeps the sweep from forgetting the level under it.
#[tokio::test]
async fn a_queue_is_not_forgotten_under_an_insert_that_has_not_committed() {
    let app = TestApp::spawn().await;
    delivered_and_idle_past_the_grace(&app, "report").await;

    // SQL behind outboxd's back, registered by the insert trigger.
    let mut producer = app.producer().await;
    let mut tx = sqlx::Connection::begin(&mut producer).await.unwrap();
    let id: String = sqlx::query_scalar(
        "INSERT INTO outbox.intent (id, tenant_id, kind, payload, state, max_attempts, \
                                    available_at, created_at, updated_at, level_key) \
         VALUES (gen_random_uuid(), $1, 'report', '', 'pending', 5, $2, $2, $2, \
                 hashtextextended($1 || '/report', 0)) \
         RETURNING id::text",
    )
    .bind(TENANT)
    .bind(app.clock.now())
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(app.forget_empty_queues().await, 0);
    tx.commit().await.unwrap();
    assert_eq!(app.forget_empty_queues().await, 0);

    assert_eq!(levels(&app).await, vec![("report".into(), false)]);
    let leased = app.claim_n("w", 10).await;
    assert_eq!(leased.iter().map(id_of).collect::<Vec<_>>(), vec![id]);
}

/// The same for an Enqueue's own statements (with and without idempotency keys): the level
/// probed (there), the intent not committed yet when the sweep looks.
#[tokio::test]
async fn a_queue_is_not_forgotten_under_an_enqueue_that_has_not_committed() {
    for key in [None, Some("invoice-1")] {
        an_enqueue_not_committed_keeps_its_queue(key).await;
    }
}

async fn an_enqueue_not_committed_keeps_its_queue(key: Option<&str>) {
    let app = TestApp::spawn().await;
    delivered_and_idle_past_the_grace(&app, "invoice").await;

    let mut producer = app.service_connection().await;
    let mut tx = sqlx::Connection::begin(&mut producer).await.unwrap();
    let scope = app.scope_statement(TENANT).await;
    sqlx::raw_sql(&format!("{scope}; SET LOCAL outbox.levels_registered = on"))
        .execute(&mut *tx)
        .await
        .unwrap();
    let invoice = NewIntent {
        kind: "invoice".into(),
        payload: b"{}".to_vec(),
        content_type: String::new(),
        region: String::new(),
        idempotency_key: key.map(str::to_owned),
        ordering_key: None,
        priority: 0,
        headers: Default::default(),
        max_attempts: 5,
        schedule: Schedule::Now,
    };
    let params = EnqueueParams {
        tenant_id: TENANT,
        intents: std::slice::from_ref(&invoice),
        txn_xid: None,
        now: app.clock.now(),
        leases: &[],
    };
    store::insert_intents(&mut tx, params).await.unwrap();
    assert_eq!(app.forget_empty_queues().await, 0);
    tx.commit().await.unwrap();
    assert_eq!(app.forget_empty_queues().await, 0);

    assert_eq!(
        levels(&app).await,
        vec![("invoice".into(), false)],
        "{key:?}"
    );
    assert_eq!(app.claim_n("w", 10).await.len(), 1, "{key:?}");
}

#[tokio::test]
async fn a_tenants_forgotten_queues_no_longer_count_toward_its_cap() {
    let app = TestApp::spawn().await;
    register_kinds(&app, 1000).await;
    let refused = app.enqueue(vec![intent("new", "{}")]).await.unwrap_err();
    assert_status(&refused, Code::ResourceExhausted, "TOO_MANY_QUEUES", &[]);

    assert_eq!(forget_after_the_grace(&app).await, 100, "100 queues a pass");
    app.enqueue(vec![intent("new", "{}")]).await.unwrap();
}

/// A queue whose lock an Enqueue holds is skipped, and the sweep goes on to the next: held
/// queues of one tenant keep no other tenant's from being forgotten.
#[tokio::test]
async fn queues_held_by_enqueues_keep_no_other_queue_from_being_forgotten() {
    let app = TestApp::spawn().await;
    register_kinds(&app, 150).await;
    app.forget_empty_queues().await;
    // Noted idle a minute after the 150: the sweep comes to it after them.
    app.advance(Duration::from_secs(60));
    sqlx::query(
        "INSERT INTO outbox.queue_level (tenant_id, kind, priority) VALUES ('globex', 'report', 0)",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    app.forget_empty_queues().await;
    app.advance(EMPTY_QUEUE_GRACE + Duration::from_secs(1));

    let mut holder = app.producer().await;
    let mut held = sqlx::Connection::begin(&mut holder).await.unwrap();
    sqlx::query(
        "SELECT pg_advisory_xact_lock_shared(outbox.queue_lock_key($1, 'kind.' || n))
         FROM generate_series(1, 150) n",
    )
    .bind(TENANT)
    .execute(&mut *held)
    .await
    .unwrap();
    assert_eq!(app.forget_empty_queues().await, 1, "globex's queue");
    held.commit().await.unwrap();
    assert_eq!(app.forget_empty_queues().await, 100, "100 queues a pass");
}

/// The server's own sweep, with the purge's: it notes the idle level, forgets it past the
/// hour, and counts it.
#[tokio::test]
async fn the_servers_sweep_forgets_an_idle_queue_and_counts_it() {
    let app = TestApp::spawn_with_tuned(
        |s| s.maintenance.purge_interval = Duration::from_millis(20),
        |r| r.maintenance = true,
    )
    .await;
    app.enqueue_n("mail", 1).await;
    let lease = claim_kind(&app, "mail").await;
    app.ack(&[&lease]).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while levels(&app).await != vec![("mail".to_owned(), true)] {
        assert!(std::time::Instant::now() < deadline, "never noted idle");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    app.advance(EMPTY_QUEUE_GRACE + Duration::from_secs(1));
    app.wait_for_metric("outbox_queue_levels_forgotten_total 1")
        .await;
    assert!(levels(&app).await.is_empty());
}
