//! Background sweeps: retention purge (lease rescue is covered with the lease tests).

use std::time::Duration;

use outboxd::proto::v1::{self, FailOutcome, IntentState};
use tonic::Code;

use crate::helpers::{TestApp, assert_item_error, assert_item_ok, id_of, intent};

#[tokio::test]
async fn purge_deletes_finished_intents_past_retention_and_keeps_everything_else() {
    let app = TestApp::spawn_with(|s| s.maintenance.retention = Duration::from_secs(3600)).await;
    app.enqueue_n("job", 4).await;
    let leases = app.claim_n("w", 3).await;
    app.ack(&[&leases[0]]).await;
    app.fail(&leases[1], FailOutcome::Unknown).await;
    app.fail(&leases[2], FailOutcome::Permanent).await;

    app.advance(Duration::from_secs(3599));
    assert_eq!(app.purge().await, 0, "not yet past retention");
    app.advance(Duration::from_secs(2));
    assert_eq!(app.purge().await, 1);
    let states: Vec<String> =
        sqlx::query_scalar("SELECT state::text FROM outbox.all_intents ORDER BY id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(states, vec!["needs_reconcile", "dead_lettered", "pending"]);
    let _ = IntentState::Delivered;
}

/// Enqueues an intent with a key, claims it and acks it (and the Ack's replay: both OK).
/// Returns the intent as sent and its id.
async fn deliver_with_key(app: &TestApp) -> (v1::NewIntent, String) {
    let mut keyed = intent("job", "{}");
    keyed.idempotency_key = "k-1".into();
    let first = app.enqueue(vec![keyed.clone()]).await.unwrap()[0]
        .id
        .clone();
    let lease = app.claim_n("w", 1).await.remove(0);
    assert_item_ok(&app.ack(&[&lease]).await[0], IntentState::Delivered);
    assert_item_ok(&app.ack(&[&lease]).await[0], IntentState::Delivered);
    (keyed, first)
}

#[tokio::test]
async fn an_idempotency_key_is_remembered_until_its_intent_is_purged_after_the_key_window() {
    let app = TestApp::spawn_with(|s| {
        s.maintenance.retention = Duration::from_secs(60);
        s.maintenance.key_retention = Duration::from_secs(120);
    })
    .await;
    let (keyed, first) = deliver_with_key(&app).await;
    let replay = app.enqueue(vec![keyed.clone()]).await.unwrap().remove(0);
    assert!(replay.deduplicated);
    assert_eq!(replay.state(), IntentState::Delivered);
    assert_eq!(replay.id, first);

    app.advance(Duration::from_secs(61));
    assert_eq!(
        app.purge().await,
        0,
        "the key window is longer than the retention"
    );
    assert!(app.enqueue(vec![keyed.clone()]).await.unwrap()[0].deduplicated);
    app.advance(Duration::from_secs(60));
    assert_eq!(app.purge().await, 1);
    let fresh = app.enqueue(vec![keyed]).await.unwrap().remove(0);
    assert!(!fresh.deduplicated);
    assert_ne!(fresh.id, first);
}

#[tokio::test]
async fn at_zero_retention_an_ack_deletes_an_intent_without_a_key() {
    let app = TestApp::spawn_with(|s| s.maintenance.retention = Duration::ZERO).await;
    let first = app
        .enqueue(vec![intent("job", "{}"), intent("job", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();
    let leases = app.claim_n("w", 2).await;
    let (delivered, unsure) = (&leases[0], &leases[1]);
    assert_eq!(id_of(delivered), first);
    let mut forged = unsure.clone();
    forged.lease_id = uuid::Uuid::new_v4().to_string();
    let rows = || async {
        sqlx::query_scalar::<_, String>("SELECT state::text FROM outbox.all_intents ORDER BY id")
            .fetch_all(&app.pool)
            .await
            .unwrap()
    };

    let results = app.ack(&[delivered, &forged]).await;
    assert_item_ok(&results[0], IntentState::Delivered);
    assert_item_error(&results[1], Code::FailedPrecondition, "LEASE_LOST");
    assert_eq!(
        rows().await,
        vec!["leased"],
        "the delivered row went with its Ack"
    );
    let status = app
        .client()
        .get_intent(outboxd::proto::v1::GetIntentRequest { id: first.clone() })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert_item_error(&app.ack(&[delivered]).await[0], Code::NotFound, "NOT_FOUND");

    // A definite outcome learned after the fact deletes a NEEDS_RECONCILE intent too.
    app.fail(unsure, FailOutcome::Unknown).await;
    assert_item_ok(&app.ack(&[unsure]).await[0], IntentState::Delivered);
    assert!(rows().await.is_empty());
}

/// An ordered intent is deleted by its Ack too (with a priority other than 0 as well, which
/// above retention zero stays in place), and its key moves on to the next one.
#[tokio::test]
async fn at_zero_retention_an_ack_deletes_an_ordered_intent_and_its_key_moves_on() {
    let app = TestApp::spawn_with(|s| s.maintenance.retention = Duration::ZERO).await;
    let ordered = |payload: &str| v1::NewIntent {
        ordering_key: "k".into(),
        priority: 2,
        ..intent("job", payload)
    };
    let ids: Vec<String> = app
        .enqueue(vec![ordered("1"), ordered("2")])
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    let head = app.claim_n("w", 10).await;
    assert_eq!(head.iter().map(id_of).collect::<Vec<_>>(), [&ids[0]]);
    assert_item_ok(&app.ack(&[&head[0]]).await[0], IntentState::Delivered);
    let status = app
        .client()
        .get_intent(v1::GetIntentRequest { id: ids[0].clone() })
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::NotFound,
        "the delivered head went with its Ack"
    );
    let next = app.claim_n("w", 10).await;
    assert_eq!(next.iter().map(id_of).collect::<Vec<_>>(), [&ids[1]]);
}

/// A producer that lost the answer to its Enqueue retries it with the same key: at
/// retention zero the intent may already be delivered, and must not be recorded again.
#[tokio::test]
async fn at_zero_retention_a_delivered_intent_with_a_key_is_kept_for_the_key_window() {
    let app = TestApp::spawn_with(|s| {
        s.maintenance.retention = Duration::ZERO;
        s.maintenance.key_retention = Duration::from_secs(300);
    })
    .await;
    let (keyed, first) = deliver_with_key(&app).await;
    assert_eq!(app.state(&first).await, IntentState::Delivered);
    let replay = app.enqueue(vec![keyed.clone()]).await.unwrap().remove(0);
    assert!(replay.deduplicated, "the key outlives its Ack");
    assert_eq!(
        (replay.id.as_str(), replay.state()),
        (first.as_str(), IntentState::Delivered)
    );
    assert!(
        app.claim_n("w", 1).await.is_empty(),
        "nothing to deliver again"
    );

    app.advance(Duration::from_secs(299));
    assert_eq!(app.purge().await, 0);
    app.advance(Duration::from_secs(2));
    assert_eq!(app.purge().await, 1);
    let fresh = app.enqueue(vec![keyed]).await.unwrap().remove(0);
    assert!(!fresh.deduplicated, "the key window is over");
    assert_ne!(fresh.id, first);
}

#[tokio::test]
async fn delivered_intents_without_a_key_leave_the_live_table_and_stay_readable_until_purged() {
    let app = TestApp::spawn_with(|s| {
        s.maintenance.retention = Duration::from_secs(3600);
        s.maintenance.key_retention = Duration::from_secs(3600);
    })
    .await;
    let mut keyed = intent("job", r#"{"n":0}"#);
    keyed.idempotency_key = "k-1".into();
    let ids: Vec<String> = app
        .enqueue(vec![
            keyed,
            intent("job", r#"{"n":1}"#),
            intent("job", r#"{"n":2}"#),
        ])
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    let leases = app.claim_n("w", 3).await;
    let all: Vec<&v1::Lease> = leases.iter().collect();
    for result in app.ack(&all).await {
        assert_item_ok(&result, IntentState::Delivered);
    }
    let tables = || async {
        sqlx::query_as::<_, (String, String)>(
            "SELECT tableoid::regclass::text, state::text FROM outbox.intent \
             UNION ALL SELECT b.tableoid::regclass::text, x.state::text \
             FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x \
             ORDER BY 1",
        )
        .fetch_all(&app.pool)
        .await
        .unwrap()
    };
    let delivered = |table: &str| (table.to_owned(), "delivered".to_owned());
    assert_eq!(
        tables().await,
        vec![
            delivered("outbox.delivered_batch"),
            delivered("outbox.delivered_batch"),
            delivered("outbox.intent"),
        ],
        "the keyed intent stays where its key is guarded; the others moved"
    );

    for (id, n) in ids.iter().zip(0..) {
        let shown = app.intent(id).await;
        assert_eq!(shown.state(), IntentState::Delivered);
        assert_eq!(shown.payload, format!(r#"{{"n":{n}}}"#).into_bytes());
        assert_eq!(shown.attempts, 1);
    }
    let listed: Vec<String> = app
        .list_all(&[IntentState::Delivered], 2)
        .await
        .into_iter()
        .map(|i| i.id)
        .collect();
    assert_eq!(listed, ids, "listed across both tables, in enqueue order");
    assert_eq!(app.stat(IntentState::Delivered, None).await, 3);

    for result in app.ack(&all).await {
        assert_item_ok(&result, IntentState::Delivered);
    }
    let mut forged = leases[1].clone();
    forged.lease_id = uuid::Uuid::new_v4().to_string();
    assert_item_error(
        &app.ack(&[&forged]).await[0],
        Code::FailedPrecondition,
        "LEASE_LOST",
    );
    let resolved = app
        .reconcile(v1::ReconcileRequest {
            target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
                ids: vec![ids[1].clone()],
                ..Default::default()
            })),
            decision: v1::Decision::Requeue as i32,
            actor: "alice".into(),
            reason: "try again".into(),
            limit: 0,
        })
        .await
        .unwrap();
    let refused = resolved[0]
        .error
        .as_ref()
        .expect("a delivered intent is not requeued");
    assert_eq!(
        (refused.code, refused.reason.as_str()),
        (Code::FailedPrecondition as i32, "INVALID_STATE"),
        "told its state, not that it does not exist"
    );
    assert_eq!(resolved[0].state(), IntentState::Delivered);

    app.advance(Duration::from_secs(3601));
    assert_eq!(app.purge().await, 3);
    assert!(tables().await.is_empty());
}

/// Ids of intents created `at_ms[k]` milliseconds after a fixed instant: UUIDv7s whose
/// buckets (`outbox.history_bucket`: the millisecond timestamp / 100) the test chooses.
fn ids_created_at(at_ms: &[u64]) -> Vec<uuid::Uuid> {
    const BASE_MS: u64 = 1_790_000_000_000;
    at_ms
        .iter()
        .map(|ms| {
            let t = BASE_MS + ms;
            let ts = uuid::Timestamp::from_unix(
                uuid::NoContext,
                t / 1000,
                (t % 1000) as u32 * 1_000_000,
            );
            uuid::Uuid::new_v7(ts)
        })
        .collect()
}

fn bucket_of(id: &uuid::Uuid) -> u64 {
    let b = id.as_bytes();
    u64::from_be_bytes([0, 0, b[0], b[1], b[2], b[3], b[4], b[5]]) / 100
}

#[tokio::test]
async fn delivered_intents_stored_by_batch_are_found_listed_counted_replayed_and_purged_across_buckets()
 {
    let app = TestApp::spawn_with(|s| {
        s.maintenance.retention = Duration::from_secs(3600);
        s.maintenance.batch_size = 4;
    })
    .await;
    // 24 intents, every third of region eu, created over 1.2 s: several to a bucket, a
    // dozen buckets. Their ids are rewritten to chosen UUIDv7s before the claim.
    let mut new_intents = Vec::new();
    for n in 0..24 {
        let mut i = intent("job", &format!(r#"{{"n":{n}}}"#));
        if n % 3 == 0 {
            i.region = "eu".into();
        }
        new_intents.push(i);
    }
    let enqueued: Vec<uuid::Uuid> = app
        .enqueue(new_intents)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id.parse().unwrap())
        .collect();
    let at_ms: Vec<u64> = (0..24).map(|n| (n * 53) % 1200).collect();
    let chosen = ids_created_at(&at_ms);
    sqlx::query(
        "UPDATE outbox.intent i SET id = v.new FROM unnest($1::uuid[], $2::uuid[]) v(old, new) \
         WHERE i.id = v.old",
    )
    .bind(&enqueued)
    .bind(&chosen)
    .execute(&app.pool)
    .await
    .unwrap();
    let payload_of = |id: &str| {
        let n = chosen.iter().position(|c| c.to_string() == id).unwrap();
        format!(r#"{{"n":{n}}}"#).into_bytes()
    };

    let leases = app.claim_n("w", 24).await;
    assert_eq!(leases.len(), 24);
    let first: Vec<&v1::Lease> = leases[..10].iter().collect();
    let second: Vec<&v1::Lease> = leases[10..18].iter().collect();
    let live: Vec<&v1::Lease> = leases[18..].iter().collect();
    for result in app.ack(&first).await.iter().chain(&app.ack(&second).await) {
        assert_item_ok(result, IntentState::Delivered);
    }

    // One row per Ack, bucket and region (one tenant here), holding 18 intents in all.
    let rows_of = |acked: &[&v1::Lease]| {
        let mut keys: Vec<(u64, String)> = acked
            .iter()
            .map(|l| {
                let i = l.intent.as_ref().unwrap();
                (bucket_of(&i.id.parse().unwrap()), i.region.clone())
            })
            .collect();
        keys.sort();
        keys.dedup();
        keys.len() as i64
    };
    let (rows, stored): (i64, i64) = sqlx::query_as(
        "SELECT count(*), sum(cardinality(ids))::bigint FROM outbox.delivered_batch",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(stored, 18);
    assert_eq!(rows, rows_of(&first) + rows_of(&second));
    assert!(
        rows > 2,
        "the Acks spread over several buckets: {rows} rows"
    );

    for lease in &leases {
        let id = id_of(lease);
        let shown = app.intent(id).await;
        let acked = !live.iter().any(|l| id_of(l) == id);
        let state = if acked {
            IntentState::Delivered
        } else {
            IntentState::Leased
        };
        assert_eq!(shown.state(), state, "{id}");
        assert_eq!(shown.payload, payload_of(id), "{id}");
        assert_eq!(shown.attempts, 1);
    }

    let list = |states: &'static [IntentState]| async {
        let listed = app.list_all(states, 5).await;
        for i in &listed {
            assert_eq!(i.payload, payload_of(&i.id), "{}", i.id);
        }
        let ids: Vec<uuid::Uuid> = listed.iter().map(|i| i.id.parse().unwrap()).collect();
        ids
    };
    let mut every = chosen.clone();
    every.sort();
    assert_eq!(list(&[]).await, every, "live and delivered, in id order");
    let mut delivered: Vec<uuid::Uuid> = first
        .iter()
        .chain(&second)
        .map(|l| id_of(l).parse().unwrap())
        .collect();
    delivered.sort();
    assert_eq!(list(&[IntentState::Delivered]).await, delivered);

    let acked_in = |region: &str| {
        first
            .iter()
            .chain(&second)
            .filter(|l| l.intent.as_ref().unwrap().region == region)
            .count() as i64
    };
    for region in ["eu", ""] {
        assert_eq!(
            app.stat(IntentState::Delivered, Some(region)).await,
            acked_in(region)
        );
    }
    assert_eq!(app.stat(IntentState::Leased, None).await, 6);

    for result in app.ack(&first).await {
        assert_item_ok(&result, IntentState::Delivered);
    }

    app.advance(Duration::from_secs(3601));
    assert_eq!(app.purge().await, 18, "every delivered intent, row by row");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.delivered_batch")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    let status = app
        .client()
        .get_intent(v1::GetIntentRequest {
            id: id_of(first[0]).to_owned(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(app.state(id_of(live[0])).await, IntentState::Leased);
}
