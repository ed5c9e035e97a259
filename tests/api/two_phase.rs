//! The two-phase token: intents enqueued inside a producer's transaction exist if and only
//! if it commits, whatever the producer, its backend or PostgreSQL does.

use std::time::Duration;

use outboxd::embedded::{EmbeddedConfig, EmbeddedPostgres};
use outboxd::proto::v1::{self, IntentState};
use rustix::process::{Pid, Signal, kill_process};
use sqlx::{Connection, PgConnection};
use tonic::{Code, Status};

use crate::helpers::{
    TENANT, TestApp, assert_status, claim_request, duration, id_of, intent, other_database, secs,
};

use outboxd::outbox::token::PLAIN_TOKEN_SQL;

pub(crate) async fn enqueue_in(
    app: &TestApp,
    token: &str,
    intents: Vec<v1::NewIntent>,
) -> Result<Vec<v1::EnqueueResult>, Status> {
    app.client()
        .enqueue(v1::EnqueueRequest {
            intents,
            txn_token: token.to_owned(),
        })
        .await
        .map(|r| r.into_inner().results)
}

pub(crate) async fn token_of(conn: &mut PgConnection) -> String {
    sqlx::query_scalar("SELECT outbox.txn_token()")
        .fetch_one(conn)
        .await
        .unwrap()
}

async fn business_table(conn: &mut PgConnection) {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, customer text NOT NULL)",
    )
    .execute(conn)
    .await
    .unwrap();
}

/// Claims with a long-poll; returns the ids leased.
async fn claim_waiting(app: &TestApp, wait: Duration) -> Vec<String> {
    let mut request = claim_request("w", 100);
    request.wait = Some(duration(wait));
    app.claim(request)
        .await
        .unwrap()
        .iter()
        .map(|l| id_of(l).to_owned())
        .collect()
}

#[tokio::test]
async fn intents_of_a_committed_producer_transaction_become_claimable() {
    let app = TestApp::spawn().await;
    let mut producer = app.producer().await;
    business_table(&mut producer).await;
    let mut tx = producer.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (customer) VALUES ('ada')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let token = token_of(&mut tx).await;
    let results = enqueue_in(
        &app,
        &token,
        vec![intent("order.created", "{}"), intent("email.send", "{}")],
    )
    .await
    .unwrap();
    assert!(
        results
            .iter()
            .all(|r| r.state() == IntentState::Staged && !r.deduplicated)
    );
    let id = results[0].id.clone();

    assert!(
        app.claim_n("w", 10).await.is_empty(),
        "staged intents are not claimable"
    );
    assert_eq!(
        app.state(&id).await,
        IntentState::Staged,
        "but visible to inspection"
    );
    let stats = app
        .client()
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(stats.oldest_staged_at.is_some());
    assert!(
        stats
            .counts
            .iter()
            .any(|c| c.state() == IntentState::Staged && c.count == 2)
    );

    tx.commit().await.unwrap();
    let mut claimed = claim_waiting(&app, Duration::from_secs(10)).await;
    if claimed.len() < 2 {
        claimed.extend(claim_waiting(&app, Duration::from_secs(10)).await);
    }
    claimed.sort();
    let mut expected: Vec<String> = results.iter().map(|r| r.id.clone()).collect();
    expected.sort();
    assert_eq!(claimed, expected);
}

#[tokio::test]
async fn intents_of_a_rolled_back_transaction_are_discarded_and_never_claimable() {
    let app = TestApp::spawn().await;
    let mut producer = app.producer().await;
    business_table(&mut producer).await;
    let mut tx = producer.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (customer) VALUES ('bob')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let token = token_of(&mut tx).await;
    let id = enqueue_in(&app, &token, vec![intent("order.created", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();
    tx.rollback().await.unwrap();

    app.wait_for_state(&id, IntentState::Discarded).await;
    assert!(app.claim_n("w", 10).await.is_empty());
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&mut producer)
        .await
        .unwrap();
    assert_eq!(orders, 0);
}

#[tokio::test]
async fn a_producer_in_another_database_of_the_cluster_joins_with_plain_sql() {
    let app = TestApp::spawn().await;
    let mut producer = PgConnection::connect(&other_database().await)
        .await
        .unwrap();
    business_table(&mut producer).await;

    let mut tx = producer.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (customer) VALUES ('cy')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let token: String = sqlx::query_scalar(PLAIN_TOKEN_SQL)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let committed = enqueue_in(&app, &token, vec![intent("order.created", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();
    tx.commit().await.unwrap();

    let mut tx = producer.begin().await.unwrap();
    let token: String = sqlx::query_scalar(PLAIN_TOKEN_SQL)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let aborted = enqueue_in(&app, &token, vec![intent("order.created", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();
    tx.rollback().await.unwrap();

    assert_eq!(
        claim_waiting(&app, Duration::from_secs(10)).await,
        vec![committed]
    );
    app.wait_for_state(&aborted, IntentState::Discarded).await;
}

#[tokio::test]
async fn a_producer_backend_killed_mid_transaction_discards_its_intents() {
    let app = TestApp::spawn().await;
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let token = token_of(&mut tx).await;
    let id = enqueue_in(&app, &token, vec![intent("order.created", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();

    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(killed);
    app.wait_for_state(&id, IntentState::Discarded).await;
    assert!(app.claim_n("w", 10).await.is_empty());
    drop(tx);
}

#[tokio::test]
async fn a_producer_holding_its_transaction_open_delays_nobody_else() {
    let app = TestApp::spawn().await;
    let mut idle = app.producer().await;
    let mut open = idle.begin().await.unwrap();
    let token = token_of(&mut open).await;
    let held = enqueue_in(&app, &token, vec![intent("slow", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();

    let mut other = app.producer().await;
    let mut tx = other.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    let prompt = enqueue_in(&app, &token, vec![intent("fast", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();
    tx.commit().await.unwrap();
    let direct = app.enqueue_one("direct", "{}").await;

    let mut claimed = claim_waiting(&app, Duration::from_secs(10)).await;
    if claimed.len() < 2 {
        claimed.extend(claim_waiting(&app, Duration::from_secs(10)).await);
    }
    claimed.sort();
    let mut expected = vec![prompt, direct];
    expected.sort();
    assert_eq!(claimed, expected);
    assert_eq!(app.state(&held).await, IntentState::Staged);
    open.commit().await.unwrap();
    assert_eq!(
        claim_waiting(&app, Duration::from_secs(10)).await,
        vec![held]
    );
}

#[tokio::test]
async fn several_enqueues_with_one_token_all_join_the_transaction() {
    let app = TestApp::spawn().await;
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    let a = enqueue_in(&app, &token, vec![intent("a", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();
    // A savepoint does not change the transaction the token names.
    let mut nested = tx.begin().await.unwrap();
    let b = enqueue_in(&app, &token_of(&mut nested).await, vec![intent("b", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();
    nested.commit().await.unwrap();
    tx.rollback().await.unwrap();
    app.wait_for_state(&a, IntentState::Discarded).await;
    app.wait_for_state(&b, IntentState::Discarded).await;
}

#[tokio::test]
async fn tokens_that_name_no_open_transaction_of_this_cluster_are_refused() {
    let app = TestApp::spawn().await;
    let one = || vec![intent("k", "{}")];
    for garbage in [
        "garbage",
        "v2.1",
        "v2.1.2",
        "v2.x.2.3",
        "v2.1.2.3.4",
        "v1.1.2",
    ] {
        let status = enqueue_in(&app, garbage, one()).await.unwrap_err();
        assert_status(
            &status,
            Code::InvalidArgument,
            "INVALID_ARGUMENT",
            &["txn_token"],
        );
    }
    let mut producer = app.producer().await;
    let real = token_of(&mut producer).await; // autocommit: this transaction already committed
    let [_, system, life, xid] = real.split('.').collect::<Vec<_>>()[..] else {
        panic!("not a v2 token: {real}")
    };
    let other_cluster = format!("v2.{}.{life}.{xid}", system.parse::<i64>().unwrap() ^ 1);
    let status = enqueue_in(&app, &other_cluster, one()).await.unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["txn_token"],
    );
    let future = format!(
        "v2.{system}.{life}.{}",
        xid.parse::<u64>().unwrap() + 1_000_000
    );
    let status = enqueue_in(&app, &future, one()).await.unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["txn_token"],
    );

    let status = enqueue_in(&app, &real, one()).await.unwrap_err();
    assert_status(&status, Code::FailedPrecondition, "TXN_COMMITTED", &[]);

    let mut tx = producer.begin().await.unwrap();
    let aborted = token_of(&mut tx).await;
    tx.rollback().await.unwrap();
    let status = enqueue_in(&app, &aborted, one()).await.unwrap_err();
    assert_status(&status, Code::Aborted, "TXN_ABORTED", &[]);
    assert!(
        app.snapshot().await.is_empty(),
        "no refused token stored anything"
    );
}

#[tokio::test]
async fn replaying_an_enqueue_after_commit_returns_the_recorded_intents() {
    let app = TestApp::spawn().await;
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    let mut keyed = intent("order.created", r#"{"order":7}"#);
    keyed.idempotency_key = "order-7".into();
    let first = enqueue_in(&app, &token, vec![keyed.clone()]).await.unwrap();
    let replay_open = enqueue_in(&app, &token, vec![keyed.clone()]).await.unwrap();
    assert_eq!(replay_open[0].id, first[0].id);
    assert!(replay_open[0].deduplicated);
    tx.commit().await.unwrap();

    // The response of the first call was lost, the producer committed anyway and retries.
    let replay = enqueue_in(&app, &token, vec![keyed.clone()]).await.unwrap();
    assert_eq!(replay[0].id, first[0].id);
    assert!(replay[0].deduplicated);
    let mut other_payload = keyed;
    other_payload.payload = br#"{"order":8}"#.to_vec();
    let status = enqueue_in(&app, &token, vec![other_payload])
        .await
        .unwrap_err();
    assert_status(&status, Code::FailedPrecondition, "TXN_COMMITTED", &[]);
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intent")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
}

/// A first try that deduplicated one of its keys against an intent recorded earlier (by a
/// direct Enqueue) is replayed whole after the commit: that key's intent is the earlier one.
#[tokio::test]
async fn replaying_after_commit_an_enqueue_that_deduplicated_a_key_returns_its_intents() {
    let app = TestApp::spawn().await;
    let mut earlier = intent("order.created", r#"{"order":6}"#);
    earlier.idempotency_key = "order-6".into();
    let recorded = app.enqueue(vec![earlier.clone()]).await.unwrap();
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    let mut fresh = intent("order.created", r#"{"order":7}"#);
    fresh.idempotency_key = "order-7".into();
    let first = enqueue_in(&app, &token, vec![fresh.clone(), earlier.clone()])
        .await
        .unwrap();
    assert!(!first[0].deduplicated && first[1].deduplicated);
    assert_eq!(first[1].id, recorded[0].id);
    tx.commit().await.unwrap();

    // The first answer was lost; the producer committed anyway and retries.
    let replay = enqueue_in(&app, &token, vec![fresh, earlier])
        .await
        .unwrap();
    let ids: Vec<&str> = replay.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, [first[0].id.as_str(), first[1].id.as_str()]);
    assert!(replay.iter().all(|r| r.deduplicated));
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intent")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(count, 2);
}

/// A server on a PostgreSQL cluster of its own, for tests that crash it: crashing the
/// shared one would break every other test.
async fn app_on_own_cluster() -> (TestApp, EmbeddedPostgres) {
    app_on_own_cluster_with(Vec::new()).await
}

/// [`app_on_own_cluster`] with extra server settings.
pub(crate) async fn app_on_own_cluster_with(
    settings: Vec<(String, String)>,
) -> (TestApp, EmbeddedPostgres) {
    let dir =
        crate::helpers::scratch_dir().join(format!("crash-{}", uuid::Uuid::new_v4().simple()));
    let mut config = EmbeddedConfig::new(dir);
    config.settings = settings;
    let cluster = tokio::task::spawn_blocking(move || EmbeddedPostgres::start(config))
        .await
        .unwrap()
        .unwrap();
    let url = cluster.url("postgres");
    let pool = outboxd::startup::connect(&url, 4).await.unwrap();
    outboxd::startup::migrate(&pool).await.unwrap();
    outboxd::startup::grant_service_role(&pool, crate::helpers::SERVICE_ROLE, true)
        .await
        .unwrap();
    outboxd::startup::grant_fleet_role(&pool, crate::helpers::FLEET_ROLE, true)
        .await
        .unwrap();
    pool.close().await;
    (TestApp::spawn_on(url, |_| {}).await, cluster)
}

/// A cluster that records no commit times (a standby promoted without
/// track_commit_timestamp): a commit time reads as unknown, as one too old to tell, where
/// PostgreSQL raises an error, which failed every promotion that held an ordered intent.
#[tokio::test]
async fn without_commit_times_a_commit_time_is_unknown_not_an_error() {
    let (app, cluster) =
        app_on_own_cluster_with(vec![("track_commit_timestamp".into(), "off".into())]).await;
    let time: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT outbox.commit_time(pg_current_xact_id())")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(time, None);
    stop_own_cluster(app, cluster).await;
}

/// `pg_ctl stop -m immediate`, then a start: crash recovery.
async fn crash_and_restart(mut cluster: EmbeddedPostgres) -> EmbeddedPostgres {
    tokio::task::spawn_blocking(move || {
        cluster.crash().unwrap();
        cluster.restart().unwrap();
        cluster
    })
    .await
    .unwrap()
}

pub(crate) async fn stop_own_cluster(app: TestApp, mut cluster: EmbeddedPostgres) {
    app.stop().await;
    tokio::task::spawn_blocking(move || {
        cluster.stop().unwrap();
        let _ = std::fs::remove_dir_all(cluster.data_dir());
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_postgres_crash_discards_open_transactions_and_keeps_committed_intents() {
    let (app, cluster) = app_on_own_cluster().await;

    let committed_direct = app.enqueue_one("direct", "{}").await;
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    let committed_staged = enqueue_in(&app, &token, vec![intent("staged", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();
    tx.commit().await.unwrap();
    let mut open = app.producer().await;
    let mut open_tx = open.begin().await.unwrap();
    let token = token_of(&mut open_tx).await;
    let in_flight = enqueue_in(&app, &token, vec![intent("lost", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();

    let cluster = crash_and_restart(cluster).await;
    drop(open_tx);
    drop(open);

    app.wait_for_state(&in_flight, IntentState::Discarded).await;
    app.wait_for_state(&committed_staged, IntentState::Pending)
        .await;
    let mut claimed = claim_waiting(&app, Duration::from_secs(10)).await;
    claimed.sort();
    let mut expected = vec![committed_direct, committed_staged];
    expected.sort();
    assert_eq!(claimed, expected);
    stop_own_cluster(app, cluster).await;
}

/// The plain-SQL token as it was before it wrote WAL (a producer on the older README's
/// SQL): its transaction id reaches the disk only with the transaction's first write, so
/// crash recovery may hand it out again.
const TOKEN_WRITING_NO_WAL: &str = "SELECT 'v2.' || system_identifier || '.' || \
     outbox.server_incarnation() || '.' || pg_current_xact_id() FROM pg_control_system()";

#[tokio::test]
async fn a_commit_of_a_transaction_that_wrote_nothing_but_its_token_survives_a_postgres_crash() {
    // No autovacuum: its commits, flushing the WAL, would flush the producer's too.
    let settings = vec![("autovacuum".to_owned(), "off".to_owned())];
    let (app, mut cluster) = app_on_own_cluster_with(settings).await;
    let url = app.url.clone();
    app.stop().await;
    // One crash each: a flushed commit flushes every commit record before its own.
    for (sql, how) in [
        (PLAIN_TOKEN_SQL, "the plain-SQL token"),
        ("SELECT outbox.txn_token()", "outbox.txn_token()"),
    ] {
        let app = TestApp::spawn_on(url.clone(), |_| {}).await;
        // A producer that writes no row: a notification from a read-only flow.
        let mut producer = app.producer().await;
        let mut tx = producer.begin().await.unwrap();
        let token: String = sqlx::query_scalar(sql).fetch_one(&mut *tx).await.unwrap();
        let id = enqueue_in(&app, &token, vec![intent("read.only", "{}")])
            .await
            .unwrap()[0]
            .id
            .clone();
        // outboxd must not promote (its own commit would flush the producer's): its
        // server stops before the producer's COMMIT.
        let pool = app.pool.clone();
        app.stop().await;
        // The WAL writer flushes what commits left unflushed within wal_writer_delay
        // (200 ms), or at once when it was idle: stopped, it cannot, so the crash finds
        // only what the COMMIT flushed itself, as a crash right after it would.
        let wal_writer = stop_wal_writer(&pool).await;
        tx.commit().await.unwrap();
        // PostgreSQL crashes right after acknowledging the COMMIT (the WAL writer killed
        // first, or the immediate stop would wait for it).
        // A server process this test stopped: it cannot exit meanwhile.
        kill_process(wal_writer, Signal::KILL).unwrap();
        cluster = crash_and_restart(cluster).await;
        drop(producer);

        let state: String =
            sqlx::query_scalar("SELECT state::text FROM outbox.intent WHERE id = $1::uuid")
                .bind(&id)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(state, "staged", "nothing promoted it before the crash");
        let app = TestApp::spawn_on(url.clone(), |_| {}).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let now = app.state(&id).await;
            assert_ne!(
                now,
                IntentState::Discarded,
                "the acknowledged COMMIT of a transaction that took its token with {how} (and \
                 wrote nothing else) was lost in the crash"
            );
            if now == IntentState::Pending {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{id} stayed {now:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        app.stop().await;
        pool.close().await;
    }
    tokio::task::spawn_blocking(move || {
        cluster.stop().unwrap();
        let _ = std::fs::remove_dir_all(cluster.data_dir());
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_limited_queues_leases_survive_a_postgres_crash_right_after_the_claims_answer() {
    // No autovacuum: its commits, flushing the WAL, would flush the claim's too.
    let settings = vec![("autovacuum".to_owned(), "off".to_owned())];
    let (app, cluster) = app_on_own_cluster_with(settings).await;
    app.client()
        .set_queue_policy(v1::SetQueuePolicyRequest {
            kind: "pay".to_owned(),
            max_in_flight: 10,
            actor: "ops".to_owned(),
            reason: "provider limit".to_owned(),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = app.enqueue_one("pay", "{}").await;
    // The claim of a limited queue commits without waiting for its flush (the queue's
    // claims take turns); the WAL writer would flush it within 200 ms, the crash first.
    let pool = app.pool.clone();
    let wal_writer = stop_wal_writer(&pool).await;
    let leases = app.claim_n("w", 1).await;
    assert_eq!(id_of(&leases[0]), id);
    // A server process this test stopped: it cannot exit meanwhile.
    kill_process(wal_writer, Signal::KILL).unwrap();
    let cluster = crash_and_restart(cluster).await;

    let (state, lease): (String, Option<uuid::Uuid>) =
        sqlx::query_as("SELECT state::text, lease_id FROM outbox.intent WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), lease.map(|l| l.to_string())),
        ("leased", Some(leases[0].lease_id.clone())),
        "a lease answered before the crash was lost in it"
    );
    stop_own_cluster(app, cluster).await;
}

/// SIGSTOPs the cluster's WAL writer; returns its pid.
async fn stop_wal_writer(pool: &sqlx::PgPool) -> Pid {
    let pid: i32 =
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
            .fetch_one(pool)
            .await
            .unwrap();
    // The live server process just read from pg_stat_activity.
    let pid = Pid::from_raw(pid).expect("a walwriter pid");
    kill_process(pid, Signal::STOP).unwrap();
    pid
}

/// A token taken in a transaction that PostgreSQL's crash ended before anything of it
/// reached the disk, and a stranger's connection whose open transaction crash recovery
/// gave the same transaction id.
async fn token_whose_xid_a_stranger_holds() -> (TestApp, EmbeddedPostgres, String, PgConnection) {
    let (app, cluster) = app_on_own_cluster().await;
    // The producer takes its token (assigning its xid, which nothing writes to disk)...
    let mut producer = app.producer().await;
    sqlx::raw_sql("BEGIN").execute(&mut producer).await.unwrap();
    let token: String = sqlx::query_scalar(TOKEN_WRITING_NO_WAL)
        .fetch_one(&mut producer)
        .await
        .unwrap();
    let xid: u64 = token.rsplit('.').next().unwrap().parse().unwrap();
    // ...and PostgreSQL crashes before its Enqueue gets through.
    let cluster = crash_and_restart(cluster).await;
    drop(producer);

    // Crash recovery hands the producer's xid out again, here to a stranger.
    let mut stranger = app.producer().await;
    let next: u64 =
        sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
            .fetch_one(&mut stranger)
            .await
            .map(|n: i64| n as u64)
            .unwrap();
    assert!(
        next <= xid,
        "xid {xid} reached the disk before the crash (next xid {next}): the reuse this test \
         needs did not happen"
    );
    for _ in next..xid {
        sqlx::query("SELECT pg_current_xact_id()")
            .execute(&mut stranger)
            .await
            .unwrap();
    }
    sqlx::raw_sql("BEGIN").execute(&mut stranger).await.unwrap();
    let stranger_xid: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
        .fetch_one(&mut stranger)
        .await
        .unwrap();
    assert_eq!(stranger_xid, xid.to_string());
    (app, cluster, token, stranger)
}

#[tokio::test]
async fn a_token_from_before_a_postgres_crash_is_refused_though_its_xid_now_names_another_transaction()
 {
    let (app, cluster, token, mut stranger) = token_whose_xid_a_stranger_holds().await;

    // The producer's Enqueue, retried now, must not join the stranger's transaction.
    let status = enqueue_in(&app, &token, vec![intent("of.the.dead", "{}")])
        .await
        .unwrap_err();
    assert_status(&status, Code::Aborted, "TXN_ABORTED", &[]);
    assert!(
        status.message().contains("crash"),
        "the reason names the crash: {}",
        status.message()
    );
    sqlx::raw_sql("COMMIT")
        .execute(&mut stranger)
        .await
        .unwrap();
    assert_eq!(
        app.snapshot().await,
        Vec::<String>::new(),
        "nothing was stored"
    );
    stop_own_cluster(app, cluster).await;
}

#[tokio::test]
async fn a_token_from_before_a_postgres_crash_is_aborted_though_a_stranger_committed_its_xid() {
    let (app, cluster, token, mut stranger) = token_whose_xid_a_stranger_holds().await;
    business_table(&mut stranger).await;
    sqlx::raw_sql("INSERT INTO orders (customer) VALUES ('stranger'); COMMIT")
        .execute(&mut stranger)
        .await
        .unwrap();

    // The producer's transaction never committed: its retry is told so, not that it
    // already committed (which would tell it to do the wrong thing).
    let mut keyed = intent("of.the.dead", "{}");
    keyed.idempotency_key = "orders/1/created".to_owned();
    for intents in [vec![intent("of.the.dead", "{}")], vec![keyed]] {
        let status = enqueue_in(&app, &token, intents).await.unwrap_err();
        assert_status(&status, Code::Aborted, "TXN_ABORTED", &[]);
        assert!(
            status.message().contains("crash"),
            "the reason names the crash: {}",
            status.message()
        );
    }
    assert_eq!(
        app.snapshot().await,
        Vec::<String>::new(),
        "nothing was stored"
    );
    stop_own_cluster(app, cluster).await;
}

#[tokio::test]
async fn an_idempotency_key_held_by_another_open_transaction_is_not_deduplicated_onto_it() {
    let app = TestApp::spawn().await;
    let mut keyed = intent("order.created", "{}");
    keyed.idempotency_key = "order-9".into();

    let mut first = app.producer().await;
    let mut t1 = first.begin().await.unwrap();
    let token = token_of(&mut t1).await;
    let held = enqueue_in(&app, &token, vec![keyed.clone()]).await.unwrap()[0]
        .id
        .clone();

    // A second attempt at the same operation, while the first is still open.
    let status = app.enqueue(vec![keyed.clone()]).await.unwrap_err();
    assert_status(&status, Code::Aborted, "IDEMPOTENCY_KEY_IN_USE", &[]);

    // The first rolls back: its intent never existed and the key is free again.
    t1.rollback().await.unwrap();
    app.wait_for_state(&held, IntentState::Discarded).await;
    let retried = app.enqueue(vec![keyed]).await.unwrap().remove(0);
    assert!(!retried.deduplicated);
    assert_ne!(retried.id, held);
    assert_eq!(
        claim_waiting(&app, Duration::from_secs(10)).await,
        vec![retried.id]
    );
}

/// A transaction redone at once after a rollback: the rolled-back intent still holds its
/// key until the promotion discards it, and the retry is told it may go ahead (CONFLICT,
/// retried by the SDKs), not that another open transaction holds it.
#[tokio::test]
async fn a_key_held_by_a_rolled_back_transaction_is_retryable_before_the_sweep() {
    let app = TestApp::spawn_with(|s| s.txn.resolve_interval = Duration::from_secs(3600)).await;
    let mut keyed = intent("order.created", "{}");
    keyed.idempotency_key = "order-10".into();
    let mut first = app.producer().await;
    let mut t1 = first.begin().await.unwrap();
    let token = token_of(&mut t1).await;
    enqueue_in(&app, &token, vec![keyed.clone()]).await.unwrap();
    t1.rollback().await.unwrap();

    // Redone with the same content, or another (a new timestamp): retryable either way.
    let mut changed = keyed.clone();
    changed.payload = br#"{"at":2}"#.to_vec();
    for intents in [vec![keyed], vec![changed]] {
        let mut t2 = first.begin().await.unwrap();
        let token = token_of(&mut t2).await;
        let status = enqueue_in(&app, &token, intents).await.unwrap_err();
        assert_status(&status, Code::Aborted, "CONFLICT", &[]);
        assert!(
            status.message().contains("rolled back"),
            "{}",
            status.message()
        );
        t2.rollback().await.unwrap();
    }
}

/// A retry right after the producer committed, before the promotion ran: the intent
/// exists, so the retry is told to come back (CONFLICT, retried by the SDKs) and is then
/// its replay, not told that a transaction still open holds the key.
#[tokio::test]
async fn a_key_held_by_a_committed_transaction_not_yet_promoted_is_retryable_then_replayed() {
    let app = TestApp::spawn_with(|s| s.txn.resolve_interval = Duration::from_secs(3600)).await;
    let mut keyed = intent("order.created", "{}");
    keyed.idempotency_key = "order-11".into();
    let mut first = app.producer().await;
    let mut t1 = first.begin().await.unwrap();
    // The plain token: no NOTIFY, so nothing promotes it until asked.
    let token: String = sqlx::query_scalar(PLAIN_TOKEN_SQL)
        .fetch_one(&mut *t1)
        .await
        .unwrap();
    let held = enqueue_in(&app, &token, vec![keyed.clone()]).await.unwrap()[0]
        .id
        .clone();
    t1.commit().await.unwrap();

    let status = app.enqueue(vec![keyed.clone()]).await.unwrap_err();
    assert_status(&status, Code::Aborted, "CONFLICT", &[]);
    assert!(
        status.message().contains("committed"),
        "{}",
        status.message()
    );
    // Another content is a conflict whatever the holder's state.
    let mut changed = keyed.clone();
    changed.payload = br#"{"at":2}"#.to_vec();
    let status = app.enqueue(vec![changed]).await.unwrap_err();
    assert_status(&status, Code::AlreadyExists, "IDEMPOTENCY_CONFLICT", &[]);

    app.promote().await;
    let replayed = app.enqueue(vec![keyed]).await.unwrap().remove(0);
    assert!(replayed.deduplicated);
    assert_eq!(replayed.id, held);
    assert_eq!(replayed.state(), IntentState::Pending);
}

#[tokio::test]
async fn an_intent_of_a_transaction_held_open_is_available_from_its_commit_and_claimed_at_once() {
    // Claims look from a floor behind the newest intent their group took: an intent that
    // kept its Enqueue's time would sort behind an hour of newer intents and wait for a
    // look at the whole queue (at the claim's deadline here).
    let app = TestApp::spawn().await;
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    let staged = enqueue_in(&app, &token, vec![intent("order.created", "{}")])
        .await
        .unwrap()[0]
        .id
        .clone();

    app.advance(Duration::from_secs(3600));
    let newer = app.enqueue_one("order.created", "{}").await;
    let taken = app.claim_ids("w", 100).await;
    assert_eq!(taken, vec![newer]);

    tx.commit().await.unwrap();
    let claim = tokio::spawn({
        let app_client = app.client();
        async move {
            let mut client = app_client;
            let mut request = claim_request("w", 100);
            request.wait = Some(duration(Duration::from_secs(60)));
            client.claim(request).await.unwrap().into_inner().leases
        }
    });
    let leases = tokio::time::timeout(Duration::from_secs(30), claim)
        .await
        .expect("the committed intent was found only at the claim's 60 s deadline")
        .unwrap();
    assert_eq!(
        leases.iter().map(id_of).collect::<Vec<_>>(),
        vec![staged.as_str()]
    );
    let committed_at = app.clock.now().unwrap();
    let available = secs(&leases[0].intent.as_ref().unwrap().available_at);
    assert!((available - committed_at.timestamp_micros() as f64 / 1e6).abs() < 0.001);
}

#[tokio::test]
async fn an_intent_staged_under_a_transaction_id_this_cluster_never_handed_out_goes_to_reconcile_and_holds_up_no_one()
 {
    let app = TestApp::spawn().await;
    // As if restored from another cluster, whose transaction ids had run ahead of this one's.
    let restored: String = sqlx::query_scalar(
        "INSERT INTO outbox.intent (id, tenant_id, kind, payload, state, max_attempts, \
                                    available_at, created_at, updated_at, txn_xid, level_key) \
         VALUES (gen_random_uuid(), $1, 'restored', '', 'staged', 5, now(), now(), now(), \
                 (pg_current_xact_id()::text::bigint + 1000000000)::text::xid8, \
                 hashtextextended($1 || '/restored', 0)) \
         RETURNING id::text",
    )
    .bind(TENANT)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    let results = enqueue_in(&app, &token, vec![intent("order.created", "{}")])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    assert_eq!(
        claim_waiting(&app, Duration::from_secs(10)).await,
        [results[0].id.clone()],
        "promoted although the sweep also met an id it cannot look up"
    );
    app.wait_for_state(&restored, IntentState::NeedsReconcile)
        .await;
    assert!(
        app.intent(&restored)
            .await
            .last_error
            .contains("not handed out by this cluster"),
        "the operator is told why"
    );
}

/// A cluster setting that allows two-phase commit.
fn prepared_transactions() -> Vec<(String, String)> {
    vec![("max_prepared_transactions".to_owned(), "4".to_owned())]
}

/// A ledger posting with idempotency key `key`.
fn keyed(key: &str) -> v1::NewIntent {
    let mut i = intent("ledger.post", "{}");
    i.idempotency_key = key.to_owned();
    i
}

/// A producer transaction that staged `keyed("post-1")`, then was prepared as `gid`: the
/// producer's connection, its token and the staged intent's id.
async fn prepared_with_one_intent(app: &TestApp, gid: &str) -> (PgConnection, String, String) {
    let mut producer = app.producer().await;
    sqlx::raw_sql("BEGIN").execute(&mut producer).await.unwrap();
    // A transaction to be prepared takes the plain-SQL token (outbox.txn_token() notifies).
    let token: String = sqlx::query_scalar(PLAIN_TOKEN_SQL)
        .fetch_one(&mut producer)
        .await
        .unwrap();
    let staged = enqueue_in(app, &token, vec![keyed("post-1")])
        .await
        .unwrap()[0]
        .id
        .clone();
    sqlx::raw_sql(&format!("PREPARE TRANSACTION '{gid}'"))
        .execute(&mut producer)
        .await
        .unwrap();
    (producer, token, staged)
}

/// A prepared transaction (two-phase commit) is past taking intents: the retry of an
/// Enqueue it staged is answered with them, a new intent is refused (it would join a
/// transaction its manager may have voted on), and COMMIT PREPARED delivers what was staged.
#[tokio::test]
async fn a_prepared_transaction_takes_only_replays() {
    let (app, cluster) = app_on_own_cluster_with(prepared_transactions()).await;
    let (mut producer, token, staged) = prepared_with_one_intent(&app, "posting-2").await;

    let replayed = enqueue_in(&app, &token, vec![keyed("post-1")])
        .await
        .unwrap();
    assert_eq!(replayed[0].id, staged);
    assert!(replayed[0].deduplicated);
    for late in [keyed("post-2"), intent("ledger.post", "{}")] {
        let refused = enqueue_in(&app, &token, vec![late]).await.unwrap_err();
        assert_status(&refused, Code::FailedPrecondition, "TXN_COMMITTED", &[]);
        assert!(refused.message().contains("prepared"), "{refused:?}");
    }

    sqlx::raw_sql("COMMIT PREPARED 'posting-2'")
        .execute(&mut producer)
        .await
        .unwrap();
    app.promote().await;
    assert_eq!(app.state(&staged).await, IntentState::Pending);
    assert_eq!(
        app.snapshot().await.len(),
        1,
        "only the staged intent exists"
    );
    stop_own_cluster(app, cluster).await;
}

/// A prepared transaction (two-phase commit) outlives a crash: the retry of an Enqueue
/// whose intents it staged before the crash is answered with them, intents it would add
/// are refused as for any transaction of an earlier server life, and COMMIT PREPARED
/// delivers what was staged.
#[tokio::test]
async fn a_prepared_transaction_that_outlives_a_crash_keeps_what_it_staged() {
    let (app, cluster) = app_on_own_cluster_with(prepared_transactions()).await;
    let (producer, token, staged) = prepared_with_one_intent(&app, "posting-1").await;

    let cluster = crash_and_restart(cluster).await;
    drop(producer);

    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let replayed = loop {
        match enqueue_in(&app, &token, vec![keyed("post-1")]).await {
            Ok(results) => break results,
            // The server's connections died with the crash.
            Err(status) if status.code() == tonic::Code::Unavailable => {
                assert!(std::time::Instant::now() < deadline, "{status:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("the retry was refused: {status:?}"),
        }
    };
    assert_eq!(replayed[0].id, staged);
    assert!(replayed[0].deduplicated);
    let refused = enqueue_in(&app, &token, vec![keyed("post-2")])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Aborted, "{refused:?}");

    let mut owner = sqlx::PgConnection::connect(&app.url).await.unwrap();
    sqlx::raw_sql("COMMIT PREPARED 'posting-1'")
        .execute(&mut owner)
        .await
        .unwrap();
    app.promote().await;
    assert_eq!(app.state(&staged).await, IntentState::Pending);
    stop_own_cluster(app, cluster).await;
}
