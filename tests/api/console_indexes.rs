//! The console's reads over a large outbox go through indexes: each read runs in a
//! transaction of the service role, scoped to a tenant, and PostgreSQL's own count of that
//! transaction's scans (`pg_stat_xact_user_tables`) shows no sequential scan of
//! `outbox.intent`. The benchmark times the same reads at 1M intents (docs/performance.md).

use chrono::Utc;
use outboxd::outbox::store::{self, ListParams};
use outboxd::outbox::{IntentId, IntentState};
use sqlx::{Connection, PgConnection, Postgres, Transaction};
use uuid::Uuid;

use crate::helpers::TestApp;

/// Large enough that a sequential scan costs more than the reads' index scans, as at 1M.
const SEEDED: i64 = 200_000;

/// Intents over the past day, oldest first, as a busy outbox holds them: 92% PENDING, 6%
/// delivered with an idempotency key, 1% NEEDS_RECONCILE, 1% DEAD_LETTERED (a few of them
/// heading an ordering key); tenants acme 70% and globex, three kinds and regions. Ids are
/// UUIDv7 of the enqueue time, as outboxd mints them.
const SEED: &str = r#"
    INSERT INTO outbox.intent (id, tenant_id, kind, region, payload, content_type, state,
                               attempts, max_attempts, available_at, created_at, updated_at,
                               finished_at, idempotency_key, last_error, ordering_key,
                               txn_xid, order_ts, order_seq, level_key)
    SELECT v.id, v.tenant, v.kind, v.region, convert_to('{"n":' || g || '}', 'UTF8'),
           'application/json', v.state, CASE WHEN v.state = 'pending' THEN 0 ELSE 1 END, 5,
           v.at, v.at, v.at,
           CASE WHEN v.state = 'delivered' THEN v.at + interval '1 second' END,
           CASE WHEN v.state = 'delivered' THEN 'order-' || g END,
           CASE WHEN v.state <> 'pending' THEN 'the provider timed out' END,
           v.ordering_key,
           CASE WHEN v.ordering_key IS NOT NULL THEN pg_current_xact_id() END,
           CASE WHEN v.ordering_key IS NOT NULL THEN v.at END,
           CASE WHEN v.ordering_key IS NOT NULL THEN g END,
           hashtextextended(v.tenant || '/' || v.kind, 0)
    FROM generate_series(1, $1::bigint) AS g,
         LATERAL (SELECT now() - interval '24 hours' * (1 - g::float8 / $1) AS at,
                         CASE WHEN g % 10 < 7 THEN 'acme' ELSE 'globex' END AS tenant,
                         (ARRAY['charge', 'email', 'webhook'])[1 + g % 3] AS kind,
                         (ARRAY['', 'eu', 'us'])[1 + g / 7 % 3] AS region,
                         CASE WHEN g % 100 = 0 THEN 'needs_reconcile'
                              WHEN g % 100 = 1 THEN 'dead_lettered'
                              WHEN g % 100 < 8 THEN 'delivered'
                              ELSE 'pending' END::outbox.intent_state AS state,
                         uuid_send(gen_random_uuid()) AS random) AS v0,
         LATERAL (SELECT v0.*,
                         encode(set_byte(overlay(v0.random PLACING substring(int8send(
                             floor(extract(epoch FROM v0.at) * 1000)::bigint) FROM 3)
                             FROM 1 FOR 6), 6, (get_byte(v0.random, 6) & 15) | 112),
                             'hex')::uuid AS id,
                         CASE WHEN v0.state IN ('needs_reconcile', 'dead_lettered')
                                   AND g % 1000 < 2 THEN 'customer-' || g END AS ordering_key)
                 AS v
"#;

/// An intent WAITING behind each seeded head of an ordering key: the key is blocked.
const SEED_WAITING: &str = r#"
    INSERT INTO outbox.intent (id, tenant_id, kind, region, payload, content_type, state,
                               attempts, max_attempts, available_at, created_at, updated_at,
                               ordering_key, txn_xid, order_ts, order_seq, level_key)
    SELECT gen_random_uuid(), h.tenant_id, h.kind, h.region, '\x'::bytea, '', 'waiting', 0,
           5, h.available_at, h.created_at, h.updated_at, h.ordering_key, h.txn_xid,
           h.order_ts + interval '1 second', h.order_seq + 1, h.level_key
    FROM outbox.intent h
    WHERE h.ordering_key IS NOT NULL
"#;

/// Seeds the outbox, and a delivered history through the API (Acks of claimed batches).
async fn large_outbox() -> TestApp {
    let app = TestApp::spawn().await;
    sqlx::query(SEED)
        .bind(SEEDED)
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query(SEED_WAITING).execute(&app.pool).await.unwrap();
    app.enqueue_n("charge", 300).await;
    for _ in 0..3 {
        let leases = app.claim_n("worker-1", 100).await;
        app.ack(&leases.iter().collect::<Vec<_>>()).await;
    }
    sqlx::query("ANALYZE outbox.intent")
        .execute(&app.pool)
        .await
        .unwrap();
    app
}

/// A transaction of the service role scoped to `tenant`, as the console's reads run.
async fn scoped<'c>(
    app: &TestApp,
    conn: &'c mut PgConnection,
    tenant: &str,
) -> Transaction<'c, Postgres> {
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(&app.scope_statement(tenant).await)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// Asserts that the transaction read `outbox.intent` through indexes only, and ends it.
async fn assert_indexed(mut tx: Transaction<'_, Postgres>, read: &str) {
    let (seq, idx): (i64, i64) = sqlx::query_as(
        "SELECT seq_scan, idx_scan FROM pg_stat_xact_user_tables \
         WHERE relid = 'outbox.intent'::regclass",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(seq, 0, "{read}: {seq} sequential scans of outbox.intent");
    assert!(idx > 0, "{read}: no index scan of outbox.intent");
    tx.rollback().await.unwrap();
}

fn listing(states: Vec<IntentState>) -> ListParams {
    ListParams {
        states,
        limit: 51,
        max_bytes: 4 << 20,
        ..ListParams::default()
    }
}

#[tokio::test]
async fn the_console_reads_a_large_outbox_through_indexes() {
    let app = large_outbox().await;
    let mut owner = PgConnection::connect(&app.url).await.unwrap();
    let (pending, keyed): (Uuid, String) = sqlx::query_as(
        "SELECT (SELECT id FROM outbox.intent WHERE tenant_id = 'acme' AND state = 'pending' \
                 ORDER BY id OFFSET 1000 LIMIT 1), \
                (SELECT idempotency_key FROM outbox.intent \
                 WHERE tenant_id = 'acme' AND idempotency_key IS NOT NULL LIMIT 1)",
    )
    .fetch_one(&mut owner)
    .await
    .unwrap();
    let eu = vec!["eu".to_owned()];
    let mut conn = app.service_connection().await;

    let mut tx = scoped(&app, &mut conn, "acme").await;
    let overview = store::overview(&mut tx, &[], None).await.unwrap();
    assert!(!overview.counts.is_empty());
    assert_indexed(tx, "overview counts").await;

    let mut tx = scoped(&app, &mut conn, "acme").await;
    let minutes = store::overview_minutes(&mut tx, &[], None).await.unwrap();
    assert!(minutes.iter().map(|m| m.enqueued).sum::<i64>() > 0);
    assert_indexed(tx, "overview chart").await;

    for (read, params) in [
        ("intents, newest page", listing(vec![])),
        (
            "intents since an hour ago",
            ListParams {
                after: Some(IntentId(store::first_id_at(
                    Utc::now() - chrono::Duration::hours(1),
                ))),
                ..listing(vec![])
            },
        ),
        (
            "desk",
            listing(vec![IntentState::NeedsReconcile, IntentState::DeadLettered]),
        ),
        (
            "PENDING of a kind",
            ListParams {
                kind: Some("email".to_owned()),
                ..listing(vec![IntentState::Pending])
            },
        ),
        (
            "an EU key's DEAD_LETTERED",
            ListParams {
                key_regions: eu.clone(),
                ..listing(vec![IntentState::DeadLettered])
            },
        ),
    ] {
        let mut tx = scoped(&app, &mut conn, "acme").await;
        assert!(
            !store::list_intents(&mut tx, params)
                .await
                .unwrap()
                .intents
                .is_empty(),
            "{read}"
        );
        assert_indexed(tx, read).await;
    }

    let mut tx = scoped(&app, &mut conn, "acme").await;
    let found = store::get_intent(&mut tx, IntentId(pending), &[])
        .await
        .unwrap();
    assert!(found.is_some());
    assert_indexed(tx, "an intent's page").await;

    let mut tx = scoped(&app, &mut conn, "acme").await;
    let ids = store::ids_by_idempotency_key(&mut tx, &keyed, &[])
        .await
        .unwrap();
    assert_eq!(ids.len(), 1);
    assert_indexed(tx, "search by idempotency key").await;

    let mut tx = scoped(&app, &mut conn, "acme").await;
    let blocked = store::blocked_keys(&mut tx, &[], None, 100).await.unwrap();
    assert!(!blocked.is_empty());
    assert_indexed(tx, "blocked ordering keys").await;
}
