//! Callers that go away mid-call (a deadline of a few milliseconds, a reset stream) leave
//! nothing half done: no transaction left open in the pool, no lease taken and not
//! answered, and every OK that does arrive is committed when it arrives.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outboxd::proto::v1;
use sqlx::PgPool;

use crate::helpers::*;

/// Runs `call` and drops it after 1 to 4 ms (by `n`), as a client whose deadline passes.
async fn cancelled_after_a_few_ms<T>(n: usize, call: impl Future<Output = T>) {
    let _ = tokio::time::timeout(Duration::from_millis(1 + (n % 4) as u64), call).await;
}

/// The state of intent `id` as another session sees it right now.
async fn committed_state(pool: &PgPool, id: &str) -> String {
    sqlx::query_scalar("SELECT state::text FROM outbox.all_intents WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// How many of the server's connections sit inside a transaction between statements.
async fn idle_in_transaction(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND application_name = 'outboxd' AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The server log written since `from` bytes (empty when the tests use a cluster of yours).
fn log_since(from: u64) -> String {
    let Some(path) = cluster_log() else {
        return String::new();
    };
    let log = std::fs::read(path).unwrap_or_default();
    String::from_utf8_lossy(log.get(from as usize..).unwrap_or_default()).into_owned()
}

fn log_len() -> u64 {
    cluster_log()
        .and_then(|p| std::fs::metadata(p).ok())
        .map_or(0, |m| m.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_cancelled_after_a_few_milliseconds_leave_no_transaction_open_and_every_ok_is_committed_on_arrival()
 {
    let app = TestApp::spawn().await;
    let log_from = log_len();
    let ids = app.enqueue_n("storm", 600).await;
    let settled: Arc<Mutex<Vec<v1::Lease>>> = Arc::default();
    let storming = Arc::new(AtomicBool::new(true));

    // Cancelled calls of every kind, most of them on leases already settled (their re-read
    // of items that did not apply runs in a transaction of its own).
    // On connections of their own: hyper closes a connection whose client resets streams
    // this fast (its guard against rapid-reset floods).
    let key = app.key(&[TENANT], &["admin"], &[]).await;
    let mut storm = Vec::new();
    for s in 0..4 {
        let client = app.client_with(Some(&key), None).await;
        let (settled, storming, ids) = (settled.clone(), storming.clone(), ids.clone());
        storm.push(tokio::spawn(async move {
            let mut n = s;
            while storming.load(Ordering::Relaxed) {
                n += 1;
                let stale = settled.lock().unwrap().last().cloned();
                let mut client = client.clone();
                match (n % 6, stale) {
                    (0 | 1, Some(lease)) => {
                        let leases = vec![lease_ref(&lease)];
                        cancelled_after_a_few_ms(n, client.ack(v1::AckRequest { leases })).await;
                    }
                    (2, Some(lease)) => {
                        let leases = vec![lease_ref(&lease)];
                        let request = v1::MarkSubmittedRequest { leases };
                        cancelled_after_a_few_ms(n, client.mark_submitted(request)).await;
                    }
                    (3, _) => {
                        let id = ids[n % ids.len()].clone();
                        let request = v1::GetIntentRequest { id };
                        cancelled_after_a_few_ms(n, client.get_intent(request)).await;
                    }
                    (4, _) => {
                        let request = v1::GetQueueStatsRequest::default();
                        cancelled_after_a_few_ms(n, client.get_queue_stats(request)).await;
                    }
                    _ => {
                        let request = claim_request(&format!("storm-{s}"), 1);
                        cancelled_after_a_few_ms(n, client.claim(request)).await;
                    }
                }
            }
        }));
    }

    // Workers that are not cancelled: each OK is read back at once from another session.
    let not_committed = Arc::new(Mutex::new(Vec::<String>::new()));
    let oks = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..3 {
        let (mut client, pool, settled, not_committed, oks) = (
            app.client(),
            app.pool.clone(),
            settled.clone(),
            not_committed.clone(),
            oks.clone(),
        );
        workers.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(8);
            while Instant::now() < deadline {
                let request = claim_request(&format!("worker-{w}"), 4);
                let leases = client.claim(request).await.unwrap().into_inner().leases;
                if leases.is_empty() {
                    tokio::task::yield_now().await;
                    continue;
                }
                for lease in leases {
                    let id = id_of(&lease).to_owned();
                    let leases = vec![lease_ref(&lease)];
                    let request = v1::MarkSubmittedRequest {
                        leases: leases.clone(),
                    };
                    let marked = client.mark_submitted(request).await.unwrap().into_inner();
                    if marked.results[0].error.is_none() {
                        oks.fetch_add(1, Ordering::Relaxed);
                        let state = committed_state(&pool, &id).await;
                        if state != "submitted" {
                            not_committed
                                .lock()
                                .unwrap()
                                .push(format!("MarkSubmitted {id}: {state}"));
                        }
                    }
                    let acked = client
                        .ack(v1::AckRequest { leases })
                        .await
                        .unwrap()
                        .into_inner();
                    if acked.results[0].error.is_none() {
                        oks.fetch_add(1, Ordering::Relaxed);
                        let state = committed_state(&pool, &id).await;
                        if state != "delivered" {
                            not_committed
                                .lock()
                                .unwrap()
                                .push(format!("Ack {id}: {state}"));
                        }
                    }
                    settled.lock().unwrap().push(lease);
                }
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    storming.store(false, Ordering::Relaxed);
    for s in storm {
        s.await.unwrap();
    }

    let not_committed = not_committed.lock().unwrap().clone();
    assert!(
        oks.load(Ordering::Relaxed) > 100,
        "too few calls answered to judge"
    );
    assert!(
        not_committed.is_empty(),
        "{} of {} OKs were not committed when they arrived: {not_committed:?}",
        not_committed.len(),
        oks.load(Ordering::Relaxed)
    );
    // Work still finishing for callers that went away ends; then no connection of the
    // server is left inside a transaction.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let open = idle_in_transaction(&app.pool).await;
        if open == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{open} pooled connections stayed inside a transaction"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = log_since(log_from);
    let warnings = log
        .matches("there is already a transaction in progress")
        .count();
    assert_eq!(
        warnings, 0,
        "PostgreSQL saw BEGIN inside an open transaction"
    );
}

#[tokio::test]
async fn a_claim_whose_caller_went_away_gives_its_leases_back_uncounted() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("email.send", "{}").await;
    // The claim's statement waits behind this lock while its caller gives up.
    let mut locker = app.lock_intent_table().await;
    let mut client = app.client();
    let claim = tokio::spawn(async move {
        let mut request = tonic::Request::new(claim_request("gone", 1));
        request.set_timeout(Duration::from_millis(300));
        client.claim(request).await
    });
    app.wait_for_lock_waiters(1).await;
    let answer = claim.await.unwrap();
    assert!(answer.is_err(), "the caller gave up before any answer");
    sqlx::query("COMMIT").execute(&mut locker).await.unwrap();

    // The claim finishes without its caller, and gives back what it leased.
    app.wait_for_metric("outbox_intents_given_back_total 1")
        .await;
    let (state, attempts): (String, i32) =
        sqlx::query_as("SELECT state::text, attempts FROM outbox.intent WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), attempts), ("pending", 0));
    let leases = app.claim_n("next", 1).await;
    assert_eq!(leases.len(), 1, "the next worker gets it at once");
    assert_eq!(
        leases[0].attempt, 1,
        "the attempt nobody saw is not counted"
    );
}

/// A statement still running when its server process is gone (a call cut at the end of
/// the shutdown grace, waiting on a lock) is rolled back by PostgreSQL, not committed for
/// nobody once the lock is free.
#[tokio::test]
async fn a_statement_left_waiting_by_a_server_process_that_is_gone_is_rolled_back() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("job", "{}").await;
    let leases = app.claim_n("w", 1).await;
    let mut locker = app.lock_intent_row(&id).await;

    let server = crate::memory::Server::start(&app.url).await;
    let key = app.key(&[TENANT], &["consume"], &[]).await;
    let credentials = outboxd::client::Credentials::new(Some(&key), None).unwrap();
    let mut client = outboxd::client::client(server.channel().await, credentials);
    let lease = lease_ref(&leases[0]);
    let ack = tokio::spawn(async move {
        let request = v1::AckRequest {
            leases: vec![lease],
        };
        client.ack(request).await
    });
    app.wait_for_lock_waiters(1).await;
    drop(server); // killed, as a server is that exits with the call cut
    assert!(ack.await.unwrap().is_err());

    let deadline = Instant::now() + Duration::from_secs(10);
    while app.lock_waiters().await > 0 {
        assert!(
            Instant::now() < deadline,
            "the gone server's Ack still waits for the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
    assert_eq!(committed_state(&app.pool, &id).await, "leased");
}
