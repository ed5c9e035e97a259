//! The producer: intents that exist iff the caller's sqlx transaction commits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use outboxd_client::{
    CallOptions, Error, Failure, IntentState, Job, NewIntent, Outbox, TokenSource, Worker, proto,
};
use sqlx::{Connection as _, PgPool};
use tonic::Code;

use crate::harness::{connection, kind, stack, state, wait_for, wait_state};
use crate::{Running, list};

async fn orders(db: &str) -> PgPool {
    let pool = PgPool::connect(&stack().url(db)).await.expect("connect");
    // Tests run at once on one database, and two CREATE TABLE IF NOT EXISTS racing each
    // other fail (a unique violation in pg_type): one at a time.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('sdk tests: orders table'))")
        .execute(&mut *tx)
        .await
        .expect("lock");
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, customer text NOT NULL)",
    )
    .execute(&mut *tx)
    .await
    .expect("orders table");
    tx.commit().await.expect("commit");
    pool
}

/// Places an order and enqueues its intent in one transaction; commits or rolls back.
async fn place(pool: &PgPool, outbox: &Outbox, kind: &str, commit: bool) -> String {
    let mut tx = pool.begin().await.expect("begin");
    let order: i64 =
        sqlx::query_scalar("INSERT INTO orders (customer) VALUES ('ada') RETURNING id")
            .fetch_one(&mut *tx)
            .await
            .expect("insert");
    let intent = NewIntent::new(kind, format!(r#"{{"order_id":{order}}}"#))
        .content_type("application/json")
        .idempotency_key(format!("orders/{kind}/{order}/created"));
    let result = outbox.enqueue(&mut tx, intent).await.expect("enqueue");
    assert_eq!(result.state, IntentState::Staged);
    // Recorded, but invisible to workers while the transaction is open.
    assert_eq!(state(&connection(), &result.id).await, IntentState::Staged);
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    result.id
}

/// `app` holds the outbox schema (its token function, promoted at commit); `shop` does not
/// (the plain-SQL token, promoted by the sweep).
async fn committed_intent_is_delivered_and_rolled_back_one_never(db: &str, source: TokenSource) {
    let connection = connection();
    let pool = orders(db).await;
    let outbox = Outbox::new(connection.clone()).token_source(source);
    let k = kind("order.created");
    let delivered = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    let seen = delivered.clone();
    let worker = Worker::builder(connection.clone())
        .concurrency(2)
        .claim_wait(Duration::from_secs(1))
        .handler(&k, move |job: Job| {
            let seen = seen.clone();
            async move {
                let payload = std::str::from_utf8(job.payload())?;
                assert!(payload.contains("order_id") || payload == "{}", "{payload}");
                *seen.lock().unwrap().entry(job.id().to_owned()).or_default() += 1;
                Ok::<_, Failure>(())
            }
        })
        .build()
        .unwrap();
    let running = Running::start(worker);

    let committed = place(&pool, &outbox, &k, true).await;
    let rolled_back = place(&pool, &outbox, &k, false).await;
    wait_state(&connection, &committed, IntentState::Delivered).await;
    wait_state(&connection, &rolled_back, IntentState::Discarded).await;
    // Once the rolled-back intent is resolved, anything claimable would come next: a
    // sentinel enqueued now proves the worker claimed past it.
    let sentinel = outbox
        .enqueue_direct(NewIntent::new(&k, "{}"))
        .await
        .unwrap()
        .id;
    wait_for("the sentinel", Duration::from_secs(15), || {
        delivered
            .lock()
            .unwrap()
            .contains_key(&sentinel)
            .then_some(())
    })
    .await;
    running.stop().await.unwrap();
    let delivered = delivered.lock().unwrap().clone();
    assert_eq!(delivered, HashMap::from([(committed, 1), (sentinel, 1)]));
    assert!(!delivered.contains_key(&rolled_back));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intent_enqueued_in_the_outbox_database_exists_iff_its_transaction_commits() {
    committed_intent_is_delivered_and_rolled_back_one_never("app", TokenSource::Auto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intent_enqueued_from_another_database_of_the_cluster_exists_iff_it_commits() {
    committed_intent_is_delivered_and_rolled_back_one_never("shop", TokenSource::Auto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_explicit_token_sources_work_where_they_apply() {
    let connection = connection();
    for (db, source) in [("app", TokenSource::Function), ("shop", TokenSource::Plain)] {
        let pool = orders(db).await;
        let k = kind("explicit");
        let outbox = Outbox::new(connection.clone()).token_source(source);
        let id = place(&pool, &outbox, &k, true).await;
        wait_state(&connection, &id, IntentState::Pending).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_savepoint_or_a_failed_transaction_is_refused_and_nothing_is_recorded() {
    let connection = connection();
    let outbox = Outbox::new(connection.clone());
    let pool = orders("app").await;
    let k = kind("refused");

    let mut tx = pool.begin().await.unwrap();
    let mut savepoint = tx.begin().await.unwrap();
    let refused = outbox
        .enqueue(&mut savepoint, NewIntent::new(&k, "x"))
        .await;
    assert!(matches!(refused, Err(Error::Savepoint)), "{refused:?}");
    savepoint.rollback().await.unwrap();
    tx.rollback().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT 1/0")
        .execute(&mut *tx)
        .await
        .unwrap_err();
    let refused = outbox.enqueue(&mut tx, NewIntent::new(&k, "x")).await;
    assert!(matches!(refused, Err(Error::Database(_))), "{refused:?}");
    tx.rollback().await.unwrap();

    assert!(list(&connection, &k).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_idempotency_keys_headers_and_a_delay() {
    let connection = connection();
    let outbox = Outbox::new(connection.clone());
    let pool = orders("app").await;
    let k = kind("batch");

    let mut tx = pool.begin().await.unwrap();
    let results = outbox
        .enqueue_many(
            &mut tx,
            (0..3).map(|n| {
                NewIntent::new(&k, format!("{n}"))
                    .idempotency_key(format!("{k}/{n}"))
                    .header("x-n", n.to_string())
            }),
        )
        .await
        .unwrap();
    // The same key again in the same transaction: the same intent.
    let again = outbox
        .enqueue(
            &mut tx,
            NewIntent::new(&k, "0").idempotency_key(format!("{k}/0")),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(
        results
            .iter()
            .all(|r| r.state == IntentState::Staged && !r.deduplicated)
    );
    assert_eq!(again.id, results[0].id);
    assert!(again.deduplicated);
    for result in &results {
        wait_state(&connection, &result.id, IntentState::Pending).await;
    }
    let third = crate::harness::intent(&connection, &results[2].id).await;
    assert_eq!(third.headers.get("x-n").map(String::as_str), Some("2"));

    let delayed = outbox
        .enqueue_direct(NewIntent::new(&k, "later").delay(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(delayed.state, IntentState::Pending);
    let delayed = crate::harness::intent(&connection, &delayed.id).await;
    let (available, created) = (delayed.available_at.unwrap(), delayed.created_at.unwrap());
    assert!(
        available.seconds >= created.seconds + 59,
        "{available:?} vs {created:?}"
    );
    assert_eq!(delayed.payload, b"later");

    let at = SystemTime::now() + Duration::from_secs(3600);
    let scheduled = outbox
        .enqueue_direct(NewIntent::new(&k, "at").available_at(at))
        .await
        .unwrap();
    let scheduled = crate::harness::intent(&connection, &scheduled.id).await;
    assert!(scheduled.available_at.unwrap().seconds >= created.seconds + 3500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_the_servers_code_and_reason() {
    let outbox = Outbox::new(connection());
    let k = kind("conflict");
    let key = format!("{k}/1");
    let first = outbox
        .enqueue_direct(NewIntent::new(&k, "a").idempotency_key(&key))
        .await
        .unwrap();
    let replay = outbox
        .enqueue_direct(NewIntent::new(&k, "a").idempotency_key(&key))
        .await
        .unwrap();
    assert_eq!(replay.id, first.id);
    assert!(replay.deduplicated);

    let conflict = outbox
        .enqueue_direct(NewIntent::new(&k, "b").idempotency_key(&key))
        .await
        .unwrap_err();
    assert_eq!(conflict.code(), Some(Code::AlreadyExists), "{conflict}");
    assert_eq!(conflict.reason().as_deref(), Some("IDEMPOTENCY_CONFLICT"));

    let invalid = outbox
        .enqueue_direct(NewIntent::new("", "b"))
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Some(Code::InvalidArgument), "{invalid}");

    let empty = outbox.enqueue_direct_many([]).await.unwrap_err();
    assert!(matches!(empty, Error::Invalid(_)), "{empty}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intents_of_one_ordering_key_are_claimable_one_at_a_time_in_request_order() {
    let connection = connection();
    let outbox = Outbox::new(connection.clone());
    let k = kind("ordered");
    let results = outbox
        .enqueue_direct_many(["1", "2"].map(|n| NewIntent::new(&k, n).ordering_key("account/7")))
        .await
        .unwrap();
    let states: Vec<_> = results.iter().map(|r| r.state).collect();
    assert_eq!(states, [IntentState::Pending, IntentState::Waiting]);
    let (first, second) = (&results[0].id, &results[1].id);
    let waiting = crate::harness::intent(&connection, second).await;
    assert_eq!(waiting.ordering_key, "account/7");

    let claim = |wait: Option<Duration>| {
        let connection = connection.clone();
        let request = proto::ClaimRequest {
            worker_id: "ordering-test".into(),
            kinds: vec![k.clone()],
            max_intents: 10,
            wait: wait.map(|w| prost_types::Duration {
                seconds: i64::try_from(w.as_secs()).unwrap(),
                nanos: 0,
            }),
            ..Default::default()
        };
        async move {
            connection
                .call(CallOptions::new(Duration::from_secs(10)), |mut client| {
                    let request = request.clone();
                    async move { client.claim(request).await }
                })
                .await
                .unwrap()
                .leases
        }
    };
    // Ten asked, one leased: the second waits behind the first.
    let leases = claim(None).await;
    assert_eq!(intent_ids(&leases), [first]);
    assert!(claim(None).await.is_empty());
    let ack = proto::AckRequest {
        leases: vec![proto::LeaseRef {
            intent_id: first.clone(),
            lease_id: leases[0].lease_id.clone(),
        }],
    };
    let acked = connection
        .call(CallOptions::new(Duration::from_secs(10)), |mut client| {
            let ack = ack.clone();
            async move { client.ack(ack).await }
        })
        .await
        .unwrap();
    assert_eq!(acked.results[0].error, None, "{acked:?}");
    // The Ack made the second the key's head, in its own transaction: claimable now.
    let leases = claim(Some(Duration::from_secs(5))).await;
    assert_eq!(intent_ids(&leases), [second]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn higher_priorities_are_claimed_first_and_handlers_see_the_priority() {
    let connection = connection();
    let outbox = Outbox::new(connection.clone());
    let k = kind("prioritized");
    let batch = outbox
        .enqueue_direct_many(
            [("a", 0), ("b", 5), ("c", -3), ("d", 10)]
                .map(|(name, priority)| NewIntent::new(&k, name).priority(priority)),
        )
        .await
        .unwrap();
    assert!(
        batch.iter().all(|r| r.state == IntentState::Pending),
        "{batch:?}"
    );
    // Enqueued later: behind the batch's intent of the same priority (oldest first).
    let later = outbox
        .enqueue_direct(NewIntent::new(&k, "e").priority(5))
        .await
        .unwrap();
    assert_eq!(
        crate::harness::intent(&connection, &later.id)
            .await
            .priority,
        5
    );

    // One slot: one intent claimed at a time, the handler called in claim order.
    let seen = Arc::new(Mutex::new(Vec::<(String, i32)>::new()));
    let worker = Worker::builder(connection.clone())
        .concurrency(1)
        .claim_wait(Duration::from_secs(1))
        .handler(&k, {
            let seen = seen.clone();
            move |job: Job| {
                let seen = seen.clone();
                async move {
                    let name = std::str::from_utf8(job.payload())?.to_owned();
                    seen.lock().unwrap().push((name, job.priority()));
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    running.acked(5, Duration::from_secs(20)).await;
    running.stop().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    let expected = [("d", 10), ("b", 5), ("e", 5), ("a", 0), ("c", -3)];
    assert_eq!(seen, expected.map(|(name, p)| (name.to_owned(), p)));

    let invalid = outbox
        .enqueue_direct(NewIntent::new(&k, "f").priority(11))
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Some(Code::InvalidArgument), "{invalid}");
    assert!(
        invalid.to_string().contains("intents[0].priority"),
        "{invalid}"
    );
}

fn intent_ids(leases: &[proto::Lease]) -> Vec<&String> {
    leases
        .iter()
        .map(|l| &l.intent.as_ref().expect("a lease's intent").id)
        .collect()
}
