//! Tenancy and authentication: what a key may do, and proof that one tenant can neither
//! see nor change another's intents, through the API and directly in SQL.

use std::time::Duration;

use futures::StreamExt as _;
use outboxd::proto::v1::{self, FailOutcome, IntentState};
use sqlx::Connection;
use tonic::Code;

use crate::helpers::{
    Client, TestApp, assert_item_error, assert_item_ok, assert_status, claim_request, create_key,
    duration, failure, id_of, intent, lease_ref, populate_globex,
};

#[tokio::test]
async fn no_rpc_lets_a_tenant_read_or_change_another_tenants_intents() {
    let app = TestApp::spawn().await;
    let b = populate_globex(&app).await;
    let before = app.snapshot().await;
    let mut a = app.client(); // tenant acme, every scope

    for id in [b.pending.as_str(), b.waiting.as_str(), id_of(&b.leased)] {
        let status = a
            .get_intent(v1::GetIntentRequest { id: id.to_owned() })
            .await
            .unwrap_err();
        assert_status(&status, Code::NotFound, "NOT_FOUND", &[]);
    }
    let listed = a
        .list_intents(v1::ListIntentsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.intents.is_empty());
    let stats = a
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(stats.counts.is_empty());
    assert_eq!(stats.reconcile_backlog, 0);
    assert!(
        app.claim_n("a-worker", 100).await.is_empty(),
        "B's pending intent is not A's to claim"
    );

    let stolen = &b.leased;
    assert_item_error(&app.ack(&[stolen]).await[0], Code::NotFound, "NOT_FOUND");
    assert_item_error(
        &app.fail(stolen, FailOutcome::Permanent).await,
        Code::NotFound,
        "NOT_FOUND",
    );
    assert_item_error(
        &app.extend(&[stolen], Duration::from_secs(60)).await[0],
        Code::NotFound,
        "NOT_FOUND",
    );
    assert_item_error(
        &app.mark_submitted(&[stolen]).await[0],
        Code::NotFound,
        "NOT_FOUND",
    );
    let by_id = app
        .reconcile(v1::ReconcileRequest {
            target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
                ids: vec![b.waiting.clone()],
                ..Default::default()
            })),
            decision: v1::Decision::Delivered as i32,
            actor: "mallory".into(),
            reason: "trying".into(),
            limit: 0,
        })
        .await
        .unwrap();
    assert_eq!(by_id[0].error.as_ref().unwrap().reason, "NOT_FOUND");
    let by_filter = app
        .reconcile(v1::ReconcileRequest {
            target: Some(v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
                states: vec![IntentState::NeedsReconcile as i32],
                ..Default::default()
            })),
            decision: v1::Decision::Dead as i32,
            actor: "mallory".into(),
            reason: "trying".into(),
            limit: 0,
        })
        .await
        .unwrap();
    assert!(by_filter.is_empty());
    assert_eq!(app.snapshot().await, before, "nothing of B's changed");

    // Same key, same idempotency key space? No: keys are per tenant.
    let mut keyed = intent("b", "1");
    keyed.idempotency_key = "shared-key".into();
    app.enqueue(vec![keyed.clone()]).await.unwrap();
    let key = app.key(&["globex"], &["produce"], &[]).await;
    let theirs = app
        .client_with(Some(&key), None)
        .await
        .enqueue(v1::EnqueueRequest {
            intents: vec![keyed],
            txn_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert!(
        !theirs[0].deduplicated,
        "another tenant's key does not collide"
    );
}

#[tokio::test]
async fn the_service_role_sees_and_writes_only_the_tenant_set_in_its_transaction() {
    let app = TestApp::spawn().await;
    populate_globex(&app).await;
    app.enqueue_n("a", 2).await;
    let mut conn = app.service_connection().await;

    let unscoped: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intent")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(unscoped, 0, "no tenant set: nothing visible");

    let mut tx = conn.begin().await.unwrap();
    sqlx::query(&app.scope_statement("acme").await)
        .execute(&mut *tx)
        .await
        .unwrap();
    let tenants: Vec<String> = sqlx::query_scalar("SELECT DISTINCT tenant_id FROM outbox.intent")
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(tenants, vec!["acme"]);
    let touched =
        sqlx::query("UPDATE outbox.intent SET kind = 'hijacked' WHERE tenant_id = 'globex'")
            .execute(&mut *tx)
            .await
            .unwrap();
    assert_eq!(touched.rows_affected(), 0);
    let deleted = sqlx::query("DELETE FROM outbox.intent WHERE tenant_id = 'globex'")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 0);
    let forged = sqlx::query(
        "INSERT INTO outbox.intent (id, tenant_id, kind, payload, state, max_attempts, available_at, created_at, updated_at, level_key)
         VALUES (gen_random_uuid(), 'globex', 'forged', '', 'pending', 5, now(), now(), now(), 0)",
    )
    .execute(&mut *tx)
    .await
    .unwrap_err();
    assert_eq!(
        forged.as_database_error().unwrap().code().as_deref(),
        Some("42501"),
        "{forged}"
    );
    tx.rollback().await.unwrap();

    // The setting ended with the transaction; the pooled connection carries nothing over.
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intent")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(after, 0);
    // The service may read keys, never mint them.
    let minted = sqlx::query("INSERT INTO outbox.api_key (id, name, prefix, key_hash, tenants, scopes) VALUES (gen_random_uuid(), 'x', 'x', 'x', '{acme}', '{admin}')")
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_eq!(
        minted.as_database_error().unwrap().code().as_deref(),
        Some("42501")
    );
    // Nor open a console session of a key whose secret it was not given (an all-tenant
    // admin key's, say: every key's id is readable).
    let admin = app.key(&["*"], &["admin"], &[]).await;
    let session = sqlx::query(
        "INSERT INTO outbox.console_session (token_hash, key_id, csrf_token, created_at, expires_at)
         SELECT 'x', id, 'c', now(), now() + interval '1 hour' FROM outbox.api_key LIMIT 1",
    )
    .execute(&mut conn)
    .await
    .unwrap_err();
    assert_eq!(
        session.as_database_error().unwrap().code().as_deref(),
        Some("42501"),
        "{session}"
    );
    let opened: Option<uuid::Uuid> =
        sqlx::query_scalar("SELECT outbox.open_console_session('obx_guessed', 'x', 'c', 60)")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(opened, None);
    let opened: Option<uuid::Uuid> =
        sqlx::query_scalar("SELECT outbox.open_console_session($1, 'x', 'c', 60)")
            .bind(&admin)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(opened.is_some(), "with the key's secret");
    let kinds: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT kind FROM outbox.intent WHERE tenant_id = 'globex'")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        kinds,
        vec!["b"],
        "the superuser view confirms B is untouched"
    );
}

#[tokio::test]
async fn delivered_history_is_isolated_by_tenant_as_live_intents_are() {
    let app = TestApp::spawn().await;
    let b = populate_globex(&app).await;
    let key = app.key(&["globex"], &["consume"], &[]).await;
    app.client_with(Some(&key), None)
        .await
        .ack(v1::AckRequest {
            leases: vec![lease_ref(&b.leased)],
        })
        .await
        .unwrap();
    app.enqueue_n("a", 1).await;
    let lease = app.claim_n("w", 1).await.remove(0);
    app.ack(&[&lease]).await;
    let mut conn = app.service_connection().await;

    for table in ["outbox.delivered_batch", "outbox.all_intents"] {
        let unscoped: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(unscoped, 0, "no tenant set: nothing visible in {table}");
    }
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(&app.scope_statement("acme").await)
        .execute(&mut *tx)
        .await
        .unwrap();
    for table in ["outbox.delivered_batch", "outbox.all_intents"] {
        let tenants: Vec<String> =
            sqlx::query_scalar(&format!("SELECT DISTINCT tenant_id FROM {table}"))
                .fetch_all(&mut *tx)
                .await
                .unwrap();
        assert_eq!(tenants, vec!["acme"], "{table}");
    }
    let deleted = sqlx::query("DELETE FROM outbox.delivered_batch WHERE tenant_id = 'globex'")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 0);
    let mut savepoint = tx.begin().await.unwrap();
    let forged = sqlx::query(
        "INSERT INTO outbox.delivered_batch (bucket, tenant_id, region, finished_at, ids, items)
         VALUES (0, 'globex', '', now(), '{}', '{}')",
    )
    .execute(&mut *savepoint)
    .await
    .unwrap_err();
    assert_eq!(
        forged.as_database_error().unwrap().code().as_deref(),
        Some("42501"),
        "{forged}"
    );
    savepoint.rollback().await.unwrap();
    tx.rollback().await.unwrap();

    let status = app
        .client()
        .get_intent(v1::GetIntentRequest {
            id: id_of(&b.leased).to_owned(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::NotFound,
        "another tenant's delivered intent"
    );
    let theirs: Vec<String> = sqlx::query_scalar(
        "SELECT x.state::text FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x \
         WHERE b.tenant_id = 'globex'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(theirs, vec!["delivered"], "the superuser view: still there");
}

#[tokio::test]
async fn calls_without_a_valid_key_are_unauthenticated_and_health_needs_none() {
    let app = TestApp::spawn_with(|s| s.auth.cache_ttl = Duration::ZERO).await;
    let mut anonymous = app.client_with(None, None).await;
    let status = anonymous
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, "UNAUTHENTICATED", &[]);
    let status = anonymous
        .enqueue(v1::EnqueueRequest {
            intents: vec![intent("k", "{}")],
            txn_token: String::new(),
        })
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, "UNAUTHENTICATED", &[]);
    let status = anonymous.claim(claim_request("w", 1)).await.unwrap_err();
    assert_status(&status, Code::Unauthenticated, "UNAUTHENTICATED", &[]);

    for bad in ["obx_0000", "not-a-key", "obx_"] {
        let status = app
            .client_with(Some(bad), None)
            .await
            .claim(claim_request("w", 1))
            .await
            .unwrap_err();
        assert_status(&status, Code::Unauthenticated, "UNAUTHENTICATED", &[]);
    }

    let key = app.key(&["acme"], &["operate"], &[]).await;
    let mut operator = app.client_with(Some(&key), None).await;
    operator
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap();
    app.revoke(&key).await;
    let status = operator
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, "UNAUTHENTICATED", &[]);

    let mut health = tonic_health::pb::health_client::HealthClient::new(app.client_channel().await);
    let serving = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(
        serving.into_inner().status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    assert!(app.snapshot().await.is_empty());
}

#[tokio::test]
async fn a_key_may_only_do_what_its_scopes_tenants_and_regions_allow() {
    let app = TestApp::spawn().await;
    let producer = app.key(&["acme"], &["produce"], &[]).await;
    let consumer = app.key(&["acme"], &["consume"], &["eu"]).await;
    let operator = app.key(&["acme"], &["operate"], &[]).await;

    let mut p = app.client_with(Some(&producer), None).await;
    let status = p.claim(claim_request("w", 1)).await.unwrap_err();
    assert_status(&status, Code::PermissionDenied, "MISSING_SCOPE", &[]);
    let status = p
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap_err();
    assert_status(&status, Code::PermissionDenied, "MISSING_SCOPE", &[]);
    let mut eu = intent("k", "{}");
    eu.region = "eu".into();
    p.enqueue(v1::EnqueueRequest {
        intents: vec![eu],
        txn_token: String::new(),
    })
    .await
    .unwrap();

    let mut c = app.client_with(Some(&consumer), None).await;
    let status = c
        .enqueue(v1::EnqueueRequest {
            intents: vec![intent("k", "{}")],
            txn_token: String::new(),
        })
        .await
        .unwrap_err();
    assert_status(&status, Code::PermissionDenied, "MISSING_SCOPE", &[]);
    let mut us = claim_request("w", 1);
    us.region = "us".into();
    let status = c.claim(us).await.unwrap_err();
    assert_status(&status, Code::PermissionDenied, "REGION_NOT_ALLOWED", &[]);
    let status = c.claim(claim_request("w", 1)).await.unwrap_err();
    assert_status(&status, Code::PermissionDenied, "REGION_NOT_ALLOWED", &[]);
    let mut in_eu = claim_request("w", 1);
    in_eu.region = "eu".into();
    let leases = c.claim(in_eu).await.unwrap().into_inner().leases;
    assert_eq!(leases.len(), 1);
    let status = c
        .reconcile(v1::ReconcileRequest {
            decision: v1::Decision::Dead as i32,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(&status, Code::PermissionDenied, "MISSING_SCOPE", &[]);

    let mut o = app.client_with(Some(&operator), None).await;
    o.get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap();
    let status = o
        .ack(v1::AckRequest {
            leases: vec![lease_ref(&leases[0])],
        })
        .await
        .unwrap_err();
    assert_status(&status, Code::PermissionDenied, "MISSING_SCOPE", &[]);

    let mut elsewhere = app.client_with(Some(&operator), Some("globex")).await;
    let status = elsewhere
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap_err();
    assert_status(&status, Code::PermissionDenied, "TENANT_NOT_ALLOWED", &[]);

    let regional_producer = app.key(&["acme"], &["produce"], &["eu"]).await;
    let status = app
        .client_with(Some(&regional_producer), None)
        .await
        .enqueue(v1::EnqueueRequest {
            intents: vec![intent("k", "{}")],
            txn_token: String::new(),
        })
        .await
        .unwrap_err();
    assert_status(&status, Code::PermissionDenied, "REGION_NOT_ALLOWED", &[]);
}

#[tokio::test]
async fn a_fleet_key_works_across_its_tenants_and_names_one_to_enqueue() {
    let app = TestApp::spawn().await;
    let fleet = app
        .key(&["acme", "globex"], &["produce", "consume"], &[])
        .await;
    let mut both = app.client_with(Some(&fleet), None).await;
    let status = both
        .enqueue(v1::EnqueueRequest {
            intents: vec![intent("k", "{}")],
            txn_token: String::new(),
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["x-outbox-tenant"],
    );

    for tenant in ["acme", "globex"] {
        app.client_with(Some(&fleet), Some(tenant))
            .await
            .enqueue(v1::EnqueueRequest {
                intents: vec![intent(tenant, "{}")],
                txn_token: String::new(),
            })
            .await
            .unwrap();
    }
    let owners: Vec<String> =
        sqlx::query_scalar("SELECT tenant_id FROM outbox.intent ORDER BY tenant_id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(owners, vec!["acme", "globex"]);
    let mut request = claim_request("fleet", 10);
    request.wait = Some(duration(Duration::ZERO));
    let kinds: Vec<String> = both
        .claim(request)
        .await
        .unwrap()
        .into_inner()
        .leases
        .iter()
        .map(|l| l.intent.as_ref().unwrap().kind.clone())
        .collect();
    assert_eq!(kinds.len(), 2, "{kinds:?}");

    let everyone = app.key(&["*"], &["operate"], &[]).await;
    let stats = app
        .client_with(Some(&everyone), None)
        .await
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap();
    assert_eq!(
        stats
            .into_inner()
            .counts
            .iter()
            .map(|c| c.count)
            .sum::<i64>(),
        2
    );
}

#[tokio::test]
async fn a_key_bound_to_a_region_cannot_take_another_regions_leases_by_replaying_their_claim() {
    let app = TestApp::spawn().await;
    let mut us = intent("k", "{}");
    us.region = "us".into();
    app.enqueue(vec![us]).await.unwrap();
    let mut in_us = claim_request("w", 1);
    in_us.region = "us".into();
    in_us.request_id = "r1".into();
    let theirs = app.claim(in_us.clone()).await.unwrap();
    assert_eq!(theirs.len(), 1);

    // Same worker id and request id, from a key of region eu.
    let eu_key = app.key(&["acme"], &["consume"], &["eu"]).await;
    let mut eu = app.client_with(Some(&eu_key), None).await;
    let mut replay = in_us.clone();
    replay.region = "eu".into();
    let leases = eu.claim(replay).await.unwrap().into_inner().leases;
    assert!(leases.is_empty(), "got another region's leases: {leases:?}");
    assert_eq!(
        app.claim(in_us).await.unwrap()[0].lease_id,
        theirs[0].lease_id,
        "the worker's own replay still answers them"
    );

    // A settle of another region's intent under a made-up lease learns nothing of it.
    let mut guessed = lease_ref(&theirs[0]);
    guessed.lease_id = uuid::Uuid::new_v4().to_string();
    let results = eu
        .ack(v1::AckRequest {
            leases: vec![guessed],
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_item_error(&results[0], Code::NotFound, "NOT_FOUND");
}

/// A lease is not a pass across regions: a key bound to region eu that presents the live
/// lease of an intent of region us (leaked from that region's worker) settles nothing of
/// it, by any settle, while the eu intent beside it in the same batch is settled; the
/// us intent stays as its worker left it, and that worker's lease still works.
#[tokio::test]
async fn a_key_bound_to_a_region_cannot_settle_another_regions_intent_even_with_its_live_lease() {
    let app = TestApp::spawn().await;
    let in_region = |region: &str| {
        let mut i = intent("charge", "{}");
        i.region = region.into();
        i
    };
    app.enqueue(vec![in_region("us"), in_region("eu")])
        .await
        .unwrap();
    let leases = app.claim_n("w", 10).await;
    let region_of = |l: &v1::Lease| l.intent.as_ref().unwrap().region.clone();
    let us = leases
        .iter()
        .find(|l| region_of(l) == "us")
        .unwrap()
        .clone();
    let eu = leases
        .iter()
        .find(|l| region_of(l) == "eu")
        .unwrap()
        .clone();
    let us_before: String = sqlx::query_scalar(
        "SELECT row_to_json(i)::text FROM outbox.intent i WHERE i.id = $1::uuid",
    )
    .bind(id_of(&us))
    .fetch_one(&app.pool)
    .await
    .unwrap();

    let eu_key = app.key(&["acme"], &["consume"], &["eu"]).await;
    let mut eu_worker = app.client_with(Some(&eu_key), None).await;
    let extended = eu_worker
        .extend_lease(v1::ExtendLeaseRequest {
            leases: vec![lease_ref(&us), lease_ref(&eu)],
            lease_duration: Some(duration(Duration::from_secs(600))),
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_item_error(&extended[0], Code::NotFound, "NOT_FOUND");
    assert_item_ok(&extended[1], IntentState::Leased);
    let submitted = eu_worker
        .mark_submitted(v1::MarkSubmittedRequest {
            leases: vec![lease_ref(&us)],
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_item_error(&submitted[0], Code::NotFound, "NOT_FOUND");
    // The us item first, so that the eu item's outcome is read from the second place of
    // the failures.
    let failed = eu_worker
        .fail(v1::FailRequest {
            failures: vec![
                failure(&us, FailOutcome::Permanent),
                failure(&eu, FailOutcome::Unknown),
            ],
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_item_error(&failed[0], Code::NotFound, "NOT_FOUND");
    assert_item_ok(&failed[1], IntentState::NeedsReconcile);
    let ack = || v1::AckRequest {
        leases: vec![lease_ref(&us), lease_ref(&eu)],
    };
    let acked = eu_worker.ack(ack()).await.unwrap().into_inner().results;
    assert_item_error(&acked[0], Code::NotFound, "NOT_FOUND");
    assert_item_ok(&acked[1], IntentState::Delivered);
    // Replayed: the eu intent, moved to the history, is answered as a replay.
    let replayed = eu_worker.ack(ack()).await.unwrap().into_inner().results;
    assert_item_error(&replayed[0], Code::NotFound, "NOT_FOUND");
    assert_item_ok(&replayed[1], IntentState::Delivered);

    let us_after: String = sqlx::query_scalar(
        "SELECT row_to_json(i)::text FROM outbox.intent i WHERE i.id = $1::uuid",
    )
    .bind(id_of(&us))
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(us_after, us_before, "the us intent was changed");
    assert_item_ok(&app.ack(&[&us]).await[0], IntentState::Delivered);
}

/// Data residency: an operator key bound to region eu reads, counts and resolves the
/// intents of eu and those of no region (which any region's workers claim), and no other
/// region's: those are NOT_FOUND, as another tenant's are.
#[tokio::test]
async fn an_operator_key_bound_to_a_region_sees_and_resolves_only_that_regions_intents() {
    let app = TestApp::spawn().await;
    let in_region = |region: &str| {
        let mut i = intent("charge", "{}");
        i.region = region.into();
        i
    };
    let ids: Vec<String> = app
        .enqueue(vec![in_region("eu"), in_region("us"), in_region("")])
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    let (eu, us, anywhere) = (&ids[0], &ids[1], &ids[2]);
    for region in ["eu", "us"] {
        let mut claim = claim_request("w", 10);
        claim.region = region.into();
        for lease in app.claim(claim).await.unwrap() {
            app.fail(&lease, FailOutcome::Unknown).await;
        }
    }
    // And one of us left pending: the oldest pending intent of eu is none.
    app.enqueue(vec![in_region("us")]).await.unwrap();
    let key = app.key(&["acme"], &["operate"], &["eu"]).await;
    let mut eu_operator = app.client_with(Some(&key), None).await;

    for id in [eu, anywhere] {
        let request = v1::GetIntentRequest { id: id.clone() };
        assert!(eu_operator.get_intent(request).await.is_ok(), "{id}");
    }
    let request = v1::GetIntentRequest { id: us.clone() };
    let status = eu_operator.get_intent(request).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);

    let listed: Vec<String> = eu_operator
        .list_intents(v1::ListIntentsRequest {
            page_size: 10,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .intents
        .into_iter()
        .map(|i| i.id)
        .collect();
    assert_eq!(listed, vec![eu.clone(), anywhere.clone()]);
    let stats = eu_operator
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.counts.iter().map(|c| c.count).sum::<i64>(), 2);
    assert_eq!(stats.oldest_pending_at, None, "the pending intent is of us");
    let outside = eu_operator
        .list_intents(v1::ListIntentsRequest {
            region: "us".into(),
            page_size: 10,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(&outside, Code::PermissionDenied, "REGION_NOT_ALLOWED", &[]);

    let requeue = |ids: Vec<String>| v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
            ids,
            ..Default::default()
        })),
        decision: v1::Decision::Requeue as i32,
        actor: "alice".into(),
        reason: "checked".into(),
        limit: 0,
    };
    let results = eu_operator
        .reconcile(requeue(vec![eu.clone(), us.clone()]))
        .await
        .unwrap()
        .into_inner()
        .results;
    assert!(results[0].error.is_none(), "{results:?}");
    assert_eq!(results[1].error.as_ref().unwrap().reason, "NOT_FOUND");
    let by_filter = eu_operator
        .reconcile(v1::ReconcileRequest {
            target: Some(v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
                states: vec![IntentState::NeedsReconcile as i32],
                ..Default::default()
            })),
            decision: v1::Decision::Dead as i32,
            actor: "alice".into(),
            reason: "checked".into(),
            limit: 10,
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    let resolved: Vec<&str> = by_filter.iter().map(|r| r.intent_id.as_str()).collect();
    assert_eq!(resolved, vec![anywhere.as_str()], "not the us intent");
    assert_eq!(app.state(us).await, IntentState::NeedsReconcile);
}

/// A key names one intent: the same key with the same kind and payload but another region
/// is not that intent (its producer would be told an intent of its region was recorded).
#[tokio::test]
async fn an_idempotency_key_held_by_another_regions_intent_is_a_conflict_not_a_replay() {
    let app = TestApp::spawn().await;
    let in_region = |region: &str| {
        let mut i = intent("charge", "{}");
        i.region = region.into();
        i.idempotency_key = "k-1".into();
        i
    };
    let us = app.enqueue(vec![in_region("us")]).await.unwrap().remove(0);
    let replay = app.enqueue(vec![in_region("us")]).await.unwrap().remove(0);
    assert!(replay.deduplicated);
    assert_eq!(replay.id, us.id);
    let status = app.enqueue(vec![in_region("eu")]).await.unwrap_err();
    assert_status(&status, Code::AlreadyExists, "IDEMPOTENCY_CONFLICT", &[]);
}

/// A server whose key cache keeps lookups for `ttl`, and a client of an operate key of
/// tenant `acme` that has made one call (its lookup is cached).
async fn app_with_a_known_operator(ttl: Duration) -> (TestApp, Client) {
    let app = TestApp::spawn_with(|s| s.auth.cache_ttl = ttl).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let mut operator = app.client_with(Some(&key), None).await;
    operator
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap();
    (app, operator)
}

/// Names are labels, not unique: a rotation stores the new key under the old one's name.
/// Revoking by a name two active keys share revokes neither; by id, the one named.
#[tokio::test]
async fn a_name_two_active_keys_share_revokes_neither_and_an_id_revokes_one() {
    let app = TestApp::spawn().await;
    let old = create_key(&app.pool, "rotated", &["acme"], &["operate"], &[]).await;
    let new = create_key(&app.pool, "rotated", &["acme"], &["operate"], &[]).await;

    let matched = outboxd::outbox::store::revoke_api_key(&app.pool, "rotated")
        .await
        .unwrap();
    assert_eq!(matched, 2);
    for key in [&old, &new] {
        let mut operator = app.client_with(Some(key), None).await;
        operator
            .get_queue_stats(v1::GetQueueStatsRequest {})
            .await
            .expect("neither key was revoked");
    }

    app.revoke(&old).await;
    for (key, active) in [(&old, false), (&new, true)] {
        let found: bool =
            sqlx::query_scalar("SELECT revoked_at IS NULL FROM outbox.api_key WHERE key_hash = $1")
                .bind(&outboxd::auth::hash_key(key)[..])
                .fetch_one(&app.pool)
                .await
                .unwrap();
        assert_eq!(found, active);
    }
}

/// The key cache holds at most 10,000 lookups. A flood of made-up keys fills it with
/// unknown ones; making room drops those, not the real keys cached beside them. Probe: a
/// revoked key still answers within the cache's TTL only while its lookup stays cached.
#[tokio::test]
async fn a_flood_of_unknown_keys_does_not_evict_the_real_ones_from_the_key_cache() {
    let (app, mut operator) = app_with_a_known_operator(Duration::from_secs(3600)).await;
    outboxd::outbox::store::revoke_api_key(&app.pool, "test")
        .await
        .unwrap();

    let channel = app.client_channel().await;
    let flood = (0..10_050).map(|n| {
        let mut client = v1::outbox_service_client::OutboxServiceClient::new(channel.clone());
        async move {
            let mut request = tonic::Request::new(v1::GetQueueStatsRequest {});
            let bearer = format!("Bearer obx_made_up_{n}").parse().unwrap();
            request.metadata_mut().insert("authorization", bearer);
            let status = client.get_queue_stats(request).await.unwrap_err();
            assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        }
    });
    futures::stream::iter(flood)
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;

    operator
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .expect("the real key's lookup is still cached");
}

#[tokio::test]
async fn a_key_whose_tenant_name_has_a_comma_cannot_be_stored() {
    let app = TestApp::spawn().await;
    for tenants in [vec!["acme,globex"], vec!["acme", ""]] {
        let tenants: Vec<String> = tenants.into_iter().map(str::to_owned).collect();
        // By hand, as the schema owner: the constraint holds whoever writes.
        let error = sqlx::query(
            "INSERT INTO outbox.api_key (id, name, prefix, key_hash, tenants, scopes)
             VALUES (gen_random_uuid(), 'by-hand', 'obx_0000', $1, $2, '{consume}')",
        )
        .bind(uuid::Uuid::new_v4().as_bytes().to_vec())
        .bind(&tenants)
        .execute(&app.pool)
        .await
        .unwrap_err();
        let constraint = error
            .as_database_error()
            .and_then(|e| e.constraint())
            .map(str::to_owned);
        assert_eq!(
            constraint.as_deref(),
            Some("api_key_tenants_are_single_names"),
            "{tenants:?}: {error}"
        );
    }
    // A name without a comma still goes in.
    app.key(&["acme", "globex"], &["consume"], &[]).await;
}

/// `n` calls with made-up keys while a transaction holds the key table locked, so that their
/// lookups wait on it: the lock (roll it back to let them go on) and the calls' codes.
async fn made_up_keys_on_a_locked_key_table(
    app: &TestApp,
    n: usize,
) -> (
    sqlx::Transaction<'static, sqlx::Postgres>,
    Vec<tokio::task::JoinHandle<Code>>,
) {
    let mut lock = app.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox.api_key IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let channel = app.client_channel().await;
    let flood = (0..n)
        .map(|n| {
            let mut client = v1::outbox_service_client::OutboxServiceClient::new(channel.clone());
            tokio::spawn(async move {
                let mut request = tonic::Request::new(v1::GetQueueStatsRequest {});
                let bearer = format!("Bearer obx_made_up_{n}").parse().unwrap();
                request.metadata_mut().insert("authorization", bearer);
                client.get_queue_stats(request).await.unwrap_err().code()
            })
        })
        .collect();
    (lock, flood)
}

/// A key that was valid is looked up again once its cache entry is stale (here at every
/// call); that refresh has permits of its own, so it does not queue behind a flood of
/// made-up keys holding the lookups' permits: it reaches the database beside them.
#[tokio::test]
async fn a_known_keys_refresh_does_not_queue_behind_a_flood_of_unknown_keys() {
    let (app, mut operator) = app_with_a_known_operator(Duration::ZERO).await;

    let (lock, flood) = made_up_keys_on_a_locked_key_table(&app, 20).await;
    let flooding = outboxd::auth::CONCURRENT_LOOKUPS as i64;
    app.wait_for_lock_waiters(flooding).await;
    let known =
        tokio::spawn(async move { operator.get_queue_stats(v1::GetQueueStatsRequest {}).await });
    app.wait_for_lock_waiters(flooding + 1).await;
    lock.rollback().await.unwrap();
    known.await.unwrap().expect("the known key answers");
    for call in flood {
        assert_eq!(call.await.unwrap(), Code::Unauthenticated);
    }
}

#[tokio::test]
async fn lookups_of_unknown_keys_hold_at_most_a_few_connections() {
    let (app, mut operator) = app_with_a_known_operator(Duration::from_secs(3600)).await;

    // Lookups wait on the key table while 40 calls with made-up keys arrive: more than
    // the server's pool (20 connections).
    let (lock, flood) = made_up_keys_on_a_locked_key_table(&app, 40).await;
    let waiting = outboxd::auth::CONCURRENT_LOOKUPS as i64;
    app.wait_for_lock_waiters(waiting).await;
    // The rest wait for a permit, not a connection: a known key's call still gets one.
    tokio::time::timeout(
        Duration::from_secs(5),
        operator.get_queue_stats(v1::GetQueueStatsRequest {}),
    )
    .await
    .expect("the made-up keys' lookups took every connection")
    .unwrap();
    let on_the_lock: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(on_the_lock, waiting);
    lock.rollback().await.unwrap();
    for call in flood {
        assert_eq!(call.await.unwrap(), Code::Unauthenticated);
    }
}

/// A Claim that long-polls under a key revoked meanwhile stops within the key cache's TTL
/// and a second, answered UNAUTHENTICATED, and leases nothing after.
#[tokio::test]
async fn a_long_poll_ends_when_its_key_is_revoked() {
    let app = TestApp::spawn_with(|s| s.auth.cache_ttl = Duration::from_millis(200)).await;
    let key = app.key(&[crate::helpers::TENANT], &["consume"], &[]).await;
    let mut worker = app.client_with(Some(&key), None).await;
    let waiting = tokio::spawn(async move {
        let mut request = claim_request("w", 1);
        request.wait = Some(crate::helpers::duration(Duration::from_secs(30)));
        worker.claim(request).await
    });
    crate::long_poll::wait_until_claims_are_waiting(&app, 1, 1).await;
    app.revoke(&key).await;
    let status = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the long poll outlived its key")
        .unwrap()
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, "UNAUTHENTICATED", &[]);
    let id = app.enqueue_one("job", "{}").await;
    assert_eq!(app.state(&id).await, IntentState::Pending);
}

/// Idempotency keys belong to the tenant, across its regions; a region-bound producer
/// whose key another region's intent holds is refused, without that intent's id.
#[tokio::test]
async fn an_idempotency_conflict_names_no_intent_of_another_region() {
    let app = TestApp::spawn().await;
    let us = app
        .key(&[crate::helpers::TENANT], &["produce"], &["us"])
        .await;
    let eu = app
        .key(&[crate::helpers::TENANT], &["produce"], &["eu"])
        .await;
    let keyed = |region: &str, payload: &str| {
        let mut i = intent("invoice.send", payload);
        i.region = region.to_owned();
        i.idempotency_key = "invoice-42".to_owned();
        i
    };
    let enqueue = |key: String, intent: v1::NewIntent| {
        let app = &app;
        async move {
            app.client_with(Some(&key), None)
                .await
                .enqueue(v1::EnqueueRequest {
                    intents: vec![intent],
                    txn_token: String::new(),
                })
                .await
        }
    };
    let held = enqueue(us.clone(), keyed("us", "{}"))
        .await
        .unwrap()
        .into_inner()
        .results[0]
        .id
        .clone();

    let elsewhere = enqueue(eu, keyed("eu", "{}")).await.unwrap_err();
    assert_status(&elsewhere, Code::AlreadyExists, "IDEMPOTENCY_CONFLICT", &[]);
    assert!(!elsewhere.message().contains(&held), "{elsewhere:?}");
    assert!(!format!("{:?}", elsewhere.details()).contains(&held));

    // Its own region's holder it is told of.
    let own = enqueue(us, keyed("us", "{\"other\":1}")).await.unwrap_err();
    assert_status(&own, Code::AlreadyExists, "IDEMPOTENCY_CONFLICT", &[]);
    assert!(own.message().contains(&held), "{own:?}");
}
