//! The database gone behind the server: every RPC answers UNAVAILABLE (the code clients
//! retry), never INTERNAL, and the server still stops within its shutdown grace. The
//! server's pool reaches PostgreSQL through a proxy in the test, which a failover's load
//! balancer imitates: it accepts and closes at once, or accepts and never answers.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outboxd::outbox::store::{Unflushed, flush};
use outboxd::proto::v1;
use sqlx::{Connection, PgConnection};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tonic::Code;

use crate::helpers::{
    TestApp, assert_status, claim_request, duration, failure, fresh_database, id_of, intent,
    lease_ref,
};
use crate::two_phase::{app_on_own_cluster_with, stop_own_cluster};

/// What the proxy does with a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Forwards to PostgreSQL.
    Forward,
    /// Accepts and closes at once (a load balancer with no live backend).
    Close,
    /// Accepts and never answers (a backend that vanished without a reset).
    Hang,
}

/// A TCP proxy on loopback in front of the test cluster.
struct Proxy {
    addr: SocketAddr,
    state: Arc<Mutex<(Mode, CancellationToken)>>,
    /// Connections held unanswered (`Mode::Hang`), announced as they come.
    held: tokio::sync::watch::Receiver<usize>,
}

impl Proxy {
    async fn start(backend: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new((Mode::Forward, CancellationToken::new())));
        let shared = state.clone();
        let (holding, held_count) = tokio::sync::watch::channel(0);
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut client, _)) = listener.accept().await {
                let (mode, cut) = shared.lock().unwrap().clone();
                match mode {
                    Mode::Close => drop(client),
                    Mode::Hang => {
                        held.push(client);
                        holding.send_replace(held.len());
                    }
                    Mode::Forward => {
                        tokio::spawn(async move {
                            let Ok(mut server) = TcpStream::connect(backend).await else {
                                return;
                            };
                            tokio::select! {
                                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                                _ = cut.cancelled() => {}
                            }
                        });
                    }
                }
            }
        });
        Self {
            addr,
            state,
            held: held_count,
        }
    }

    /// Waits until the proxy holds `n` connections unanswered.
    async fn holding(&self, n: usize) {
        let mut held = self.held.clone();
        tokio::time::timeout(Duration::from_secs(30), held.wait_for(|held| *held >= n))
            .await
            .expect("nothing asked the proxy for a connection")
            .unwrap();
    }

    /// From now on connections get `mode`; the forwarded ones are cut.
    fn set(&self, mode: Mode) {
        let mut state = self.state.lock().unwrap();
        state.1.cancel();
        *state = (mode, CancellationToken::new());
    }
}

/// A server (and the test's own pool) reaching a fresh database through a proxy.
async fn app_behind_proxy(
    configure: impl FnOnce(&mut outboxd::config::Settings),
) -> (TestApp, Proxy) {
    let url = fresh_database().await;
    let (head, tail) = url.rsplit_once('@').unwrap();
    let (host_port, database) = tail.split_once('/').unwrap();
    let proxy = Proxy::start(host_port.parse().unwrap()).await;
    let proxied = format!("{head}@{}/{database}", proxy.addr);
    (TestApp::spawn_on(proxied, configure).await, proxy)
}

#[tokio::test]
async fn every_rpc_answers_unavailable_when_the_database_address_accepts_and_closes() {
    // No key cache: the key is read from the database on every call, as after its TTL.
    let (app, proxy) = app_behind_proxy(|s| s.auth.cache_ttl = Duration::ZERO).await;
    let ids = app.enqueue_n("outage", 3).await;
    let leases = app.claim_n("w", 2).await;
    let (lease, other) = (&leases[0], &leases[1]);
    let mut producer = app.producer().await;
    let token: String = sqlx::query_scalar("SELECT outbox.txn_token()")
        .fetch_one(&mut producer)
        .await
        .unwrap();

    proxy.set(Mode::Close);
    let client = app.client();
    let mut waiting = claim_request("w", 1);
    waiting.wait = Some(duration(Duration::from_secs(1)));
    let calls: Vec<(&str, Result<(), tonic::Status>)> = vec![
        (
            "Enqueue",
            client
                .clone()
                .enqueue(v1::EnqueueRequest {
                    intents: vec![intent("k", "{}")],
                    txn_token: String::new(),
                })
                .await
                .map(drop),
        ),
        (
            "Enqueue (token)",
            client
                .clone()
                .enqueue(v1::EnqueueRequest {
                    intents: vec![intent("k", "{}")],
                    txn_token: token,
                })
                .await
                .map(drop),
        ),
        (
            "Claim",
            client.clone().claim(claim_request("w", 1)).await.map(drop),
        ),
        (
            "Claim (wait)",
            client.clone().claim(waiting).await.map(drop),
        ),
        (
            "Ack",
            client
                .clone()
                .ack(v1::AckRequest {
                    leases: vec![lease_ref(lease)],
                })
                .await
                .map(drop),
        ),
        (
            "Fail",
            client
                .clone()
                .fail(v1::FailRequest {
                    failures: vec![failure(other, v1::FailOutcome::Retry)],
                })
                .await
                .map(drop),
        ),
        (
            "ExtendLease",
            client
                .clone()
                .extend_lease(v1::ExtendLeaseRequest {
                    leases: vec![lease_ref(lease)],
                    lease_duration: Some(duration(Duration::from_secs(30))),
                })
                .await
                .map(drop),
        ),
        (
            "MarkSubmitted",
            client
                .clone()
                .mark_submitted(v1::MarkSubmittedRequest {
                    leases: vec![lease_ref(lease)],
                })
                .await
                .map(drop),
        ),
        (
            "Reconcile",
            client
                .clone()
                .reconcile(v1::ReconcileRequest {
                    target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
                        ids: vec![id_of(lease).to_owned()],
                        ..Default::default()
                    })),
                    decision: v1::Decision::Delivered as i32,
                    actor: "alice".into(),
                    reason: "outage".into(),
                    limit: 0,
                })
                .await
                .map(drop),
        ),
        (
            "GetIntent",
            client
                .clone()
                .get_intent(v1::GetIntentRequest { id: ids[2].clone() })
                .await
                .map(drop),
        ),
        (
            "ListIntents",
            client
                .clone()
                .list_intents(v1::ListIntentsRequest {
                    page_size: 10,
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "GetQueueStats",
            client
                .clone()
                .get_queue_stats(v1::GetQueueStatsRequest {})
                .await
                .map(drop),
        ),
    ];
    for (rpc, result) in calls {
        let status = result.expect_err(rpc);
        assert_eq!(status.code(), Code::Unavailable, "{rpc}: {status:?}");
        assert_status(&status, Code::Unavailable, "UNAVAILABLE", &[]);
    }

    // The database back: the same calls work again.
    proxy.set(Mode::Forward);
    let deadline = Instant::now() + Duration::from_secs(15);
    while app
        .client()
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the server never recovered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    app.stop().await;
}

#[tokio::test]
async fn the_server_stops_within_its_grace_with_the_database_gone() {
    let grace = Duration::from_secs(1);
    let (mut app, proxy) = app_behind_proxy(|s| s.shutdown.grace = grace).await;
    app.enqueue_n("outage", 1).await;
    // Every new connection now hangs until the pool's acquire timeout (5 s), and the
    // ones open are cut: calls and background sweeps wait for a connection.
    proxy.set(Mode::Hang);
    let client = app.client();
    let calls: Vec<_> = (0..3)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move {
                client
                    .enqueue(v1::EnqueueRequest {
                        intents: vec![intent("k", "{}")],
                        txn_token: String::new(),
                    })
                    .await
            })
        })
        .collect();
    // The calls, or the background sweeps, wait for a connection that never answers.
    proxy.holding(1).await;

    let started = Instant::now();
    app.take_application().stop().await.unwrap();
    let took = started.elapsed();
    assert!(
        took < grace + Duration::from_millis(500),
        "stopped in {took:?}, past its grace of {grace:?}"
    );
    // The calls' own handlers may still wait for the pool (their connection tasks are
    // not the server's); in the binary the process exits with them.
    for call in calls {
        call.abort();
    }
}

/// A commit that did not wait for its flush, as its statement on `conn` would see it.
async fn unflushed_commit_on(conn: &mut PgConnection) -> Unflushed {
    let (incarnation, backend, began) =
        sqlx::query_as("SELECT pg_postmaster_start_time(), pg_backend_pid(), now()")
            .fetch_one(conn)
            .await
            .unwrap();
    Unflushed {
        incarnation,
        backend,
        began,
    }
}

#[tokio::test]
async fn a_flush_proves_a_commit_only_from_a_backend_older_than_it_on_its_server() {
    let app = TestApp::spawn().await;
    let mut older = PgConnection::connect(&app.url).await.unwrap();
    let commit = unflushed_commit_on(&mut older).await;
    flush(&mut older, commit).await.unwrap();
    // Made on a server that has restarted (or failed over) since: a crash may have lost
    // it, whatever the new server flushes.
    let elsewhere = Unflushed {
        incarnation: commit.incarnation - chrono::Duration::seconds(1),
        ..commit
    };
    let error = flush(&mut older, elsewhere).await.unwrap_err();
    assert!(matches!(error, sqlx::Error::Io(_)), "{error:?}");
    // A backend that started after the commit may have started after a crash that lost it.
    let mut younger = PgConnection::connect(&app.url).await.unwrap();
    let error = flush(&mut younger, commit).await.unwrap_err();
    assert!(matches!(error, sqlx::Error::Io(_)), "{error:?}");
    // Behind a pooler, another backend that was there before the commit proves it.
    let mut oldest = PgConnection::connect(&app.url).await.unwrap();
    let mut newer = PgConnection::connect(&app.url).await.unwrap();
    let commit_elsewhere = unflushed_commit_on(&mut newer).await;
    flush(&mut oldest, commit_elsewhere).await.unwrap();
    // Its own later commits it proves.
    let later = unflushed_commit_on(&mut younger).await;
    flush(&mut younger, later).await.unwrap();
}

#[tokio::test]
async fn a_commit_before_a_backend_crash_is_not_proven_by_a_flush_after_it() {
    let (app, cluster) = app_on_own_cluster_with(Vec::new()).await;
    let url = cluster.url("postgres");
    let mut before = PgConnection::connect(&url).await.unwrap();
    let commit = unflushed_commit_on(&mut before).await;
    // A backend killed: PostgreSQL ends every session and recovers from its WAL, keeping
    // its start time. A commit not flushed by then is lost.
    let mut victim = PgConnection::connect(&url).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut victim)
        .await
        .unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    // The sessions of before the crash end as the server reinitializes; sessions are
    // refused until its recovery is done.
    while before.ping().await.is_ok() {
        assert!(Instant::now() < deadline, "the session outlived the crash");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut after = loop {
        if let Ok(mut conn) = PgConnection::connect(&url).await
            && sqlx::query("SELECT 1").execute(&mut conn).await.is_ok()
        {
            break conn;
        }
        assert!(Instant::now() < deadline, "PostgreSQL did not come back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let restarted: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT pg_postmaster_start_time()")
            .fetch_one(&mut after)
            .await
            .unwrap();
    assert_eq!(
        restarted, commit.incarnation,
        "a reinit keeps the start time"
    );
    let error = flush(&mut after, commit).await.unwrap_err();
    assert!(matches!(error, sqlx::Error::Io(_)), "{error:?}");
    drop(before);
    stop_own_cluster(app, cluster).await;
}

/// Backends waiting for a synchronous standby to confirm their commit: pid and role.
async fn waiting_for_the_standby(conn: &mut PgConnection) -> Vec<(i32, String)> {
    sqlx::query_as("SELECT pid, usename::text FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        .fetch_all(conn)
        .await
        .unwrap()
}

/// Names a synchronous standby that never connects (`ghost`): every commit that writes
/// WAL waits; `""` lets them all go. Returns once the postmaster has signalled every
/// session to reload (`admin` sees the setting): a session reloads before its next command,
/// but pg_reload_conf() returns before the postmaster has read the file, and a one-statement
/// call read before then committed without waiting.
async fn synchronous_standby(admin: &mut PgConnection, names: &str) {
    sqlx::raw_sql(&format!(
        "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
    ))
    .execute(&mut *admin)
    .await
    .unwrap();
    sqlx::raw_sql("SELECT pg_reload_conf()")
        .execute(&mut *admin)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now: String = sqlx::query_scalar("SELECT current_setting('synchronous_standby_names')")
            .fetch_one(&mut *admin)
            .await
            .unwrap();
        if now == names {
            return;
        }
        assert!(Instant::now() < deadline, "the reload never came: {now:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Ends the session of the first commit that waits for the standby (its client loses the
/// COMMIT's answer; the commit stays, on the primary only); its pid.
async fn cut_a_commit_waiting_for_the_standby(admin: &mut PgConnection) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid = loop {
        if let Some((pid, _)) = waiting_for_the_standby(admin).await.first() {
            break *pid;
        }
        assert!(
            Instant::now() < deadline,
            "the commit did not wait for the standby"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(admin)
        .await
        .unwrap();
    pid
}

/// Waits until a commit that `is_the_calls` (pid, role) waits for the standby, failing if
/// `call` is answered first (it answered OK before what it reports was durable).
async fn the_call_waits_for_the_standby<T: std::fmt::Debug>(
    admin: &mut PgConnection,
    is_the_calls: impl Fn(i32, &str) -> bool,
    call: &mut tokio::task::JoinHandle<T>,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !waiting_for_the_standby(admin)
        .await
        .iter()
        .any(|(pid, role)| is_the_calls(*pid, role))
    {
        if call.is_finished() {
            panic!(
                "answered before the original reached the standby: {:?}",
                call.await.unwrap()
            );
        }
        assert!(
            Instant::now() < deadline,
            "the call neither waited nor answered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A producer's COMMIT that lost its answer while it waited for a synchronous standby is
/// on the primary only; the retry of its Enqueue, answered from what it staged, must not
/// be answered before that commit reached the standby (a failover meanwhile would roll the
/// producer's transaction back after outboxd said it committed).
#[tokio::test]
async fn a_two_phase_replay_is_answered_once_the_producers_commit_is_durable() {
    let (app, cluster) = app_on_own_cluster_with(Vec::new()).await;
    let mut admin = PgConnection::connect(&cluster.url("postgres"))
        .await
        .unwrap();
    let mut producer = app.producer().await;
    sqlx::Executor::execute(&mut producer, "BEGIN")
        .await
        .unwrap();
    let token = crate::two_phase::token_of(&mut producer).await;
    let mut keyed = intent("order.created", "{}");
    keyed.idempotency_key = "order-1".into();
    crate::two_phase::enqueue_in(&app, &token, vec![keyed.clone()])
        .await
        .unwrap();
    synchronous_standby(&mut admin, "ghost").await;
    let commit = tokio::spawn(async move {
        let _ = sqlx::Executor::execute(&mut producer, "COMMIT").await;
    });
    cut_a_commit_waiting_for_the_standby(&mut admin).await;
    let _ = commit.await;
    let mut client = app.client();
    let mut retry = tokio::spawn(async move {
        client
            .enqueue(v1::EnqueueRequest {
                intents: vec![keyed],
                txn_token: token,
            })
            .await
    });
    // The staged intent's promotion (the fleet role's) waits for the standby too: the
    // retry's own session, the service role's, must be the one waiting.
    let service = |_: i32, role: &str| role == crate::helpers::SERVICE_ROLE;
    the_call_waits_for_the_standby(&mut admin, service, &mut retry).await;
    synchronous_standby(&mut admin, "").await;
    let answered = retry.await.unwrap().unwrap().into_inner();
    assert!(answered.results[0].deduplicated, "{answered:?}");
    stop_own_cluster(app, cluster).await;
}

/// An Enqueue whose COMMIT lost its answer while it waited for a synchronous standby is
/// committed on the primary only; its retry, which deduplicates and writes nothing, must
/// not be answered before that commit reached the standby (a failover meanwhile would lose
/// an intent answered OK).
#[tokio::test]
async fn a_retry_that_deduplicates_is_answered_once_the_original_is_durable() {
    let (app, cluster) = app_on_own_cluster_with(Vec::new()).await;
    let mut admin = PgConnection::connect(&cluster.url("postgres"))
        .await
        .unwrap();
    synchronous_standby(&mut admin, "ghost").await;
    let enqueue = || {
        let mut client = app.client();
        let mut keyed = intent("payment.charge", "{}");
        keyed.idempotency_key = "charge-7".into();
        tokio::spawn(async move {
            client
                .enqueue(v1::EnqueueRequest {
                    intents: vec![keyed],
                    txn_token: String::new(),
                })
                .await
        })
    };

    let first = enqueue();
    let cut = cut_a_commit_waiting_for_the_standby(&mut admin).await;
    let lost = first.await.unwrap().unwrap_err();
    assert_status(&lost, Code::Unavailable, "COMMIT_OUTCOME_UNKNOWN", &[]);

    let mut retry = enqueue();
    the_call_waits_for_the_standby(&mut admin, |pid, _| pid != cut, &mut retry).await;
    synchronous_standby(&mut admin, "").await;
    let answered = retry.await.unwrap().unwrap().into_inner();
    assert!(answered.results[0].deduplicated);
    stop_own_cluster(app, cluster).await;
}

/// The same for a settle: a MarkSubmitted whose COMMIT lost its answer while it waited for
/// the standby is made again on another connection, where it finds its own change and is
/// a replay; it is answered once the original reached the standby (lost in a failover,
/// the intent would go back to PENDING on expiry and to a second worker, though its first
/// worker had been told its external call was on record).
#[tokio::test]
async fn a_replayed_mark_submitted_is_answered_once_the_original_is_durable() {
    let (app, cluster) = app_on_own_cluster_with(Vec::new()).await;
    let mut admin = PgConnection::connect(&cluster.url("postgres"))
        .await
        .unwrap();
    app.enqueue_one("payment.charge", "{}").await;
    let lease = app.claim_n("w", 1).await.remove(0);
    synchronous_standby(&mut admin, "ghost").await;
    let mut client = app.client();
    let leases = vec![lease_ref(&lease)];
    let mut mark = tokio::spawn(async move {
        client
            .mark_submitted(v1::MarkSubmittedRequest { leases })
            .await
    });

    let cut = cut_a_commit_waiting_for_the_standby(&mut admin).await;
    // The call goes on as a replay, which must wait for the standby too.
    the_call_waits_for_the_standby(&mut admin, |pid, _| pid != cut, &mut mark).await;
    synchronous_standby(&mut admin, "").await;
    let answered = mark.await.unwrap().unwrap().into_inner();
    assert!(answered.results[0].error.is_none(), "{answered:?}");
    assert_eq!(answered.results[0].state(), v1::IntentState::Submitted);
    stop_own_cluster(app, cluster).await;
}
