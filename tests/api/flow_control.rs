//! Flow control: priorities, tenant fairness, and queue policies (pause, concurrency and
//! rate limits) set over gRPC, held across replicas.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outboxd::proto::v1;
use sqlx::Connection;
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::Code;

use crate::helpers::{
    Client, TestApp, assert_status, claim_request, duration, id_of, intent, lease_ref,
};
use crate::long_poll::{wait_until_claims_are_waiting, woken};
use crate::ordering::{cli, drain_one_by_one};

fn prioritised(kind: &str, priority: i32) -> v1::NewIntent {
    v1::NewIntent {
        priority,
        ..intent(kind, "{}")
    }
}

fn policy(kind: &str) -> v1::SetQueuePolicyRequest {
    v1::SetQueuePolicyRequest {
        kind: kind.to_owned(),
        actor: "ops@example.com".to_owned(),
        reason: "provider limit".to_owned(),
        ..Default::default()
    }
}

async fn set(client: &mut Client, request: v1::SetQueuePolicyRequest) -> v1::QueuePolicy {
    client
        .set_queue_policy(request)
        .await
        .unwrap()
        .into_inner()
        .policy
        .unwrap()
}

#[tokio::test]
async fn higher_priorities_are_claimed_first_and_equal_ones_oldest_first() {
    let app = TestApp::spawn().await;
    let ids = app
        .enqueue_ids(vec![
            prioritised("job", 0),
            prioritised("job", 5),
            prioritised("job", -3),
            prioritised("job", 5),
            prioritised("job", 0),
        ])
        .await;
    assert_eq!(app.intent(&ids[1]).await.priority, 5);
    assert_eq!(
        drain_one_by_one(&app).await,
        [&ids[1], &ids[3], &ids[0], &ids[4], &ids[2]].map(String::clone)
    );
    for (id, priority) in ids.iter().zip([0, 5, -3, 5, 0]) {
        let delivered = app.intent(id).await;
        assert_eq!(
            (delivered.state(), delivered.priority),
            (v1::IntentState::Delivered, priority),
            "the priority given at enqueue, also once delivered"
        );
    }
}

#[tokio::test]
async fn a_claims_reply_lists_higher_priorities_first() {
    let app = TestApp::spawn().await;
    let ids = app
        .enqueue_ids(vec![
            prioritised("job", -1),
            prioritised("job", 3),
            prioritised("job", 0),
            prioritised("job", 3),
        ])
        .await;
    assert_eq!(
        app.claim_ids("w", 10).await,
        [&ids[1], &ids[3], &ids[2], &ids[0]].map(String::clone)
    );
}

#[tokio::test]
async fn a_priority_out_of_range_is_refused_and_nothing_is_enqueued() {
    let app = TestApp::spawn().await;
    for priority in [11, -11, i32::MAX, i32::MIN] {
        let status = app
            .client()
            .enqueue(v1::EnqueueRequest {
                intents: vec![intent("job", "{}"), prioritised("job", priority)],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_status(
            &status,
            Code::InvalidArgument,
            "INVALID_ARGUMENT",
            &["intents[1].priority"],
        );
    }
    assert!(app.claim_n("w", 10).await.is_empty());
}

/// Levels are registered by the Enqueue statements themselves, and by the insert trigger
/// for anything else (an older outboxd during a rolling upgrade, SQL behind its back): an
/// intent of a kind no Enqueue used is claimed all the same.
#[tokio::test]
async fn an_intent_inserted_by_sql_of_a_new_kind_is_claimed() {
    let app = TestApp::spawn().await;
    let id = app.insert_by_sql("by-sql").await;
    assert_eq!(app.claim_ids("w", 10).await, [id]);
}

/// A level is registered with its intents: an Enqueue refused registers nothing, and the
/// next intents of its level are registered and claimed all the same.
#[tokio::test]
async fn an_intent_of_a_level_whose_first_enqueue_was_refused_is_claimed() {
    let app = TestApp::spawn().await;
    let conflicting = app.conflicting_with_a_held_key("order-1").await;
    let refused = app
        .enqueue(vec![prioritised("refund", 3), conflicting])
        .await
        .unwrap_err();
    assert_status(&refused, Code::AlreadyExists, "IDEMPOTENCY_CONFLICT", &[]);
    let levels: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.queue_level WHERE kind = 'refund'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(levels, 0, "the refused Enqueue registered its level");

    let id = app.enqueue(vec![prioritised("refund", 3)]).await.unwrap()[0]
        .id
        .clone();
    let claimed = app.claim_ids("w", 10).await;
    assert!(claimed.contains(&id), "{claimed:?} lacks {id}");
}

#[tokio::test]
async fn a_claim_shares_its_batch_among_tenants_with_claimable_work() {
    let app = TestApp::spawn().await;
    let both = app
        .key(&["big", "small"], &["produce", "consume"], &[])
        .await;
    let mut big = app.client_with(Some(&both), Some("big")).await;
    let mut small = app.client_with(Some(&both), Some("small")).await;
    for _ in 0..4 {
        big.enqueue(v1::EnqueueRequest {
            intents: (0..50).map(|_| intent("job", "{}")).collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let small_ids: HashSet<String> = small
        .enqueue(v1::EnqueueRequest {
            intents: (0..3).map(|_| intent("job", "{}")).collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .results
        .into_iter()
        .map(|r| r.id)
        .collect();
    // Behind 200 older intents of another tenant, a claim of 10 for both tenants takes
    // the small tenant's 3 and 7 of the backlog.
    let mut worker = app.client_with(Some(&both), None).await;
    let leases = worker
        .claim(claim_request("w", 10))
        .await
        .unwrap()
        .into_inner()
        .leases;
    assert_eq!(leases.len(), 10);
    let taken: HashSet<String> = leases.iter().map(|l| id_of(l).to_owned()).collect();
    assert!(small_ids.is_subset(&taken), "{taken:?} lacks {small_ids:?}");
}

#[tokio::test]
async fn a_paused_queue_leases_nothing_until_resumed_and_the_changes_are_recorded() {
    let app = TestApp::spawn().await;
    let mut client = app.client();
    let paused = set(
        &mut client,
        v1::SetQueuePolicyRequest {
            paused: true,
            ..policy("mail")
        },
    )
    .await;
    assert!(paused.paused);
    assert_eq!(paused.actor, "ops@example.com");
    // The caller's word, and the key outboxd authenticated (the test key, "test").
    assert_eq!(paused.api_key, "test");
    let mail = app.enqueue_ids(vec![intent("mail", "{}")]).await;
    let other = app.enqueue_ids(vec![intent("other", "{}")]).await;
    let leases = app.claim_n("w", 10).await;
    assert_eq!(
        leases.iter().map(id_of).collect::<Vec<_>>(),
        [other[0].as_str()],
        "only the other kind"
    );

    // A claim waiting for mail is not handed one enqueued while the queue is paused.
    let mut waiting = app.client();
    let waiter = tokio::spawn(async move {
        waiting
            .claim(v1::ClaimRequest {
                kinds: vec!["mail".to_owned()],
                wait: Some(prost_types::Duration {
                    seconds: 60,
                    nanos: 0,
                }),
                ..claim_request("waiter", 10)
            })
            .await
            .unwrap()
            .into_inner()
            .leases
    });
    wait_until_claims_are_waiting(&app, 1, 1).await;
    let more = app.enqueue_ids(vec![intent("mail", "{}")]).await;
    assert_eq!(
        app.intent(&more[0]).await.state,
        v1::IntentState::Pending as i32
    );

    set(&mut client, policy("mail")).await;
    // Resumed: the waiting claim is woken by the next enqueue, and takes all three.
    let last = app.enqueue_ids(vec![intent("mail", "{}")]).await;
    let mut got: Vec<String> = woken(waiter)
        .await
        .iter()
        .map(|l| id_of(l).to_owned())
        .collect();
    got.extend(
        app.claim_n("w", 10)
            .await
            .iter()
            .map(|l| id_of(l).to_owned()),
    );
    got.sort();
    let mut all = vec![mail[0].clone(), more[0].clone(), last[0].clone()];
    all.sort();
    assert_eq!(got, all);

    let listed = client
        .list_queue_policies(v1::ListQueuePoliciesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .policies;
    assert_eq!(listed.len(), 1);
    assert!(!listed[0].paused);
    let changes: Vec<(bool, String, String, String)> = sqlx::query_as(
        "SELECT paused, actor, api_key, reason FROM outbox.queue_policy_change ORDER BY id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let change = |paused| {
        let (actor, key, reason) = ("ops@example.com", "test", "provider limit");
        (paused, actor.to_owned(), key.to_owned(), reason.to_owned())
    };
    assert_eq!(changes, [change(true), change(false)]);
}

/// Logs every change of an intent of `kind` into or out of LEASED/SUBMITTED, in the
/// database, at the time the statement made it.
async fn log_in_flight_changes(app: &TestApp, kind: &str) {
    for statement in [
        "CREATE TABLE public.in_flight_log (
             seq bigint GENERATED ALWAYS AS IDENTITY, at timestamptz NOT NULL, delta int NOT NULL)",
        &format!(
            "CREATE FUNCTION public.log_in_flight() RETURNS trigger LANGUAGE plpgsql
             SECURITY DEFINER SET search_path = pg_catalog AS $$
             DECLARE
                 before int := CASE WHEN TG_OP <> 'INSERT' AND OLD.kind = '{kind}'
                                     AND OLD.state IN ('leased', 'submitted') THEN 1 ELSE 0 END;
                 after int := CASE WHEN TG_OP <> 'DELETE' AND NEW.kind = '{kind}'
                                    AND NEW.state IN ('leased', 'submitted') THEN 1 ELSE 0 END;
             BEGIN
                 IF after <> before THEN
                     INSERT INTO public.in_flight_log (at, delta)
                     VALUES (clock_timestamp(), after - before);
                 END IF;
                 RETURN NULL;
             END $$"
        ),
        "CREATE TRIGGER log_in_flight AFTER INSERT OR UPDATE OR DELETE ON outbox.intent
             FOR EACH ROW EXECUTE FUNCTION public.log_in_flight()",
    ] {
        sqlx::query(statement).execute(&app.pool).await.unwrap();
    }
}

/// The most intents in flight at once by the log, and how many leases it saw.
async fn most_in_flight(app: &TestApp) -> (i64, i64) {
    sqlx::query_as(
        "SELECT max(running)::int8, count(*) FILTER (WHERE delta > 0)
         FROM (SELECT delta, sum(delta) OVER (ORDER BY at, seq) AS running
               FROM public.in_flight_log) l",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_concurrency_limit_holds_across_two_replicas_and_eight_claimers() {
    const LIMIT: i32 = 3;
    const INTENTS: usize = 60;
    let app = TestApp::spawn().await;
    let other = TestApp::spawn_on(app.url.clone(), |_| {}).await;
    log_in_flight_changes(&app, "pay").await;
    set(
        &mut app.client(),
        v1::SetQueuePolicyRequest {
            max_in_flight: LIMIT,
            ..policy("pay")
        },
    )
    .await;
    for _ in 0..INTENTS / 20 {
        app.enqueue((0..20).map(|_| intent("pay", "{}")).collect())
            .await
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut claimers = Vec::new();
    for c in 0..8 {
        let mut client = if c % 2 == 0 {
            app.client()
        } else {
            other.client()
        };
        claimers.push(tokio::spawn(async move {
            let mut done = 0;
            let mut idle = 0;
            while idle < 50 && Instant::now() < deadline {
                let leases = client
                    .claim(claim_request(&format!("w{c}"), 5))
                    .await
                    .unwrap()
                    .into_inner()
                    .leases;
                if leases.is_empty() {
                    idle += 1;
                    tokio::task::yield_now().await;
                    continue;
                }
                idle = 0;
                assert!(leases.len() <= LIMIT as usize);
                done += leases.len();
                let refs = leases.iter().map(lease_ref).collect();
                client.ack(v1::AckRequest { leases: refs }).await.unwrap();
            }
            done
        }));
    }
    let mut delivered = 0;
    for claimer in claimers {
        delivered += claimer.await.unwrap();
    }
    assert_eq!(delivered, INTENTS);
    let (most, leases) = most_in_flight(&app).await;
    assert_eq!(leases, INTENTS as i64);
    assert_eq!(
        most,
        i64::from(LIMIT),
        "the limit was reached, never passed"
    );
}

/// A pause holds on every replica from its answer: a claim sent after it, on either
/// replica, leases nothing of the queue; and by the database's own log no lease of it
/// began more than a second after the answer.
#[tokio::test]
async fn a_pause_stops_leasing_on_two_replicas_with_eight_claimers_from_its_answer() {
    const LEASED_BEFORE_THE_PAUSE: usize = 100;
    let app = TestApp::spawn().await;
    let other = TestApp::spawn_on(app.url.clone(), |_| {}).await;
    log_in_flight_changes(&app, "mail").await;
    for _ in 0..10 {
        app.enqueue((0..100).map(|_| intent("mail", "{}")).collect())
            .await
            .unwrap();
    }
    let paused = Arc::new(AtomicBool::new(false));
    let (leased, mut leased_so_far) = watch::channel(0_usize);
    let leased = Arc::new(leased);
    let mut claimers = Vec::new();
    for c in 0..8 {
        let mut client = if c % 2 == 0 {
            app.client()
        } else {
            other.client()
        };
        let (paused, leased) = (paused.clone(), leased.clone());
        claimers.push(tokio::spawn(async move {
            let mut claims_after_the_pause = 0;
            while claims_after_the_pause < 20 {
                let after_the_pause = paused.load(Ordering::SeqCst);
                let leases = client
                    .claim(v1::ClaimRequest {
                        kinds: vec!["mail".to_owned()],
                        ..claim_request(&format!("w{c}"), 5)
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .leases;
                if after_the_pause {
                    assert!(leases.is_empty(), "leased after the pause: {leases:?}");
                    claims_after_the_pause += 1;
                    continue;
                }
                leased.send_modify(|n| *n += leases.len());
                if !leases.is_empty() {
                    let refs = leases.iter().map(lease_ref).collect();
                    client.ack(v1::AckRequest { leases: refs }).await.unwrap();
                }
                tokio::task::yield_now().await;
            }
        }));
    }
    leased_so_far
        .wait_for(|n| *n >= LEASED_BEFORE_THE_PAUSE)
        .await
        .unwrap();
    set(
        &mut other.client(),
        v1::SetQueuePolicyRequest {
            paused: true,
            ..policy("mail")
        },
    )
    .await;
    paused.store(true, Ordering::SeqCst);
    let answered: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    for claimer in claimers {
        claimer.await.unwrap();
    }
    let late: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM public.in_flight_log
         WHERE delta > 0 AND at > $1 + interval '1 second'",
    )
    .bind(answered)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(late, 0, "leases began over a second after the pause");
    let pending: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.intent WHERE kind = 'mail' AND state = 'pending'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(pending > 0, "the queue still had intents to lease");
}

#[tokio::test]
async fn a_claim_waits_its_turn_at_a_limited_queue_instead_of_leaving_empty() {
    let app = app_with_a_limited_queue("pay").await;
    let ids = app
        .enqueue_ids((0..5).map(|_| intent("pay", "{}")).collect())
        .await;
    // Another claim of the queue, between its take of the policy and its commit.
    let mut other = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM outbox.queue_policy WHERE kind = 'pay' FOR UPDATE")
        .execute(&mut *other)
        .await
        .unwrap();
    let mut client = app.client();
    let claim = tokio::spawn(async move {
        let reply = client.claim(claim_request("w", 5)).await.unwrap();
        reply.into_inner().leases
    });
    app.wait_for_lock_waiters(1).await;
    other.commit().await.unwrap();
    let leases = claim.await.unwrap();
    let leased: HashSet<String> = leases.iter().map(|l| id_of(l).to_owned()).collect();
    assert_eq!(leased, ids.into_iter().collect::<HashSet<_>>());
}

/// A limited queue's claim commits without waiting for its flush, and is flushed before
/// its answer on the connection that claimed: a pooled one might be a backend younger than
/// the claim, whose flush proves nothing (store::flush). Seen from PostgreSQL: the backend
/// that ran the claim ran the flushing commit after it.
#[tokio::test]
async fn a_limited_claim_is_flushed_on_the_connection_that_claimed() {
    let app = app_with_a_limited_queue("pay").await;
    app.enqueue_ids(vec![intent("pay", "{}")]).await;
    assert_eq!(app.claim_n("w", 10).await.len(), 1);
    // Each backend's last statement: the claim's (known by its first 200 characters:
    // pg_stat_activity keeps the first 1 KB), or a flushing commit (store::flush's, which
    // emits a transactional message).
    let claim: String = include_str!("../../src/outbox/store/sql/claim.sql")
        .chars()
        .take(200)
        .collect();
    let (claims, flushes): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE starts_with(query, $1)), \
                count(*) FILTER (WHERE strpos(query, 'pg_logical_emit_message') > 0) \
         FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .bind(&claim)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(flushes, 1, "one flushing commit after the claim");
    assert_eq!(
        claims, 0,
        "the claim's backend ended on the claim: its flush ran elsewhere"
    );
}

/// A server whose queue `kind` has a concurrency limit (100) no test here reaches.
async fn app_with_a_limited_queue(kind: &str) -> TestApp {
    let app = TestApp::spawn().await;
    set(
        &mut app.client(),
        v1::SetQueuePolicyRequest {
            max_in_flight: 100,
            ..policy(kind)
        },
    )
    .await;
    app
}

#[tokio::test]
async fn a_pause_set_while_a_claim_waits_its_turn_holds_for_that_claim() {
    let app = app_with_a_limited_queue("pay").await;
    app.enqueue_ids(vec![intent("pay", "{}")]).await;
    // A claim walks its queues in an order drawn afresh: over eight rounds it comes to the
    // paused queue after waiting for "pay" in some (before it, it finds the rows locked).
    for round in 0..8 {
        let kind = format!("mail-{round}");
        app.enqueue_ids(vec![intent(&kind, "{}"), intent(&kind, "{}")])
            .await;
        let mut other = app.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM outbox.queue_policy WHERE kind = 'pay' FOR UPDATE")
            .execute(&mut *other)
            .await
            .unwrap();
        sqlx::query("SELECT 1 FROM outbox.intent WHERE kind = $1 FOR UPDATE")
            .bind(&kind)
            .execute(&mut *other)
            .await
            .unwrap();
        let mut client = app.client();
        let kinds = vec!["pay".to_owned(), kind.clone()];
        let claim = tokio::spawn(async move {
            let request = v1::ClaimRequest {
                kinds,
                ..claim_request("w", 10)
            };
            client.claim(request).await.unwrap().into_inner().leases
        });
        app.wait_for_lock_waiters(1).await;
        set(
            &mut app.client(),
            v1::SetQueuePolicyRequest {
                paused: true,
                ..policy(&kind)
            },
        )
        .await;
        other.commit().await.unwrap();
        let leases = claim.await.unwrap();
        let paused: Vec<_> = leases
            .iter()
            .filter(|l| l.intent.as_ref().unwrap().kind == kind)
            .collect();
        assert!(paused.is_empty(), "round {round}: {paused:?}");
    }
}

#[tokio::test]
async fn leases_a_limit_refuses_are_counted_in_the_metrics() {
    let app = TestApp::spawn().await;
    set(
        &mut app.client(),
        v1::SetQueuePolicyRequest {
            max_in_flight: 2,
            ..policy("pay")
        },
    )
    .await;
    app.enqueue((0..5).map(|_| intent("pay", "{}")).collect())
        .await
        .unwrap();
    assert_eq!(app.claim_n("w", 5).await.len(), 2);
    app.wait_for_metric("outbox_leases_refused_by_limit_total 3")
        .await;
    // At its limit the queue refuses every due intent a claim asks for: the other 3, not
    // the 5 it asked for.
    assert!(app.claim_n("w", 5).await.is_empty());
    app.wait_for_metric("outbox_leases_refused_by_limit_total 6")
        .await;
    // A long poll looks again when an intent arrives, and at its deadline: its looks
    // refuse it 3, then 4 of the same intents, counted once as 4 (not 3 + 4 + 4).
    let poll = tokio::spawn({
        let mut client = app.client();
        async move {
            let mut request = claim_request("w", 5);
            request.wait = Some(duration(Duration::from_secs(2)));
            client.claim(request).await.unwrap().into_inner().leases
        }
    });
    wait_until_claims_are_waiting(&app, 1, 1).await;
    app.enqueue(vec![intent("pay", "{}")]).await.unwrap();
    assert!(poll.await.unwrap().is_empty());
    app.wait_for_metric("outbox_leases_refused_by_limit_total 10")
        .await;
}

/// Paused queues and queues at their limit are gauges by kind (those of
/// `OUTBOX_METRICS__KINDS`, the others as `other`), at 0 from the start.
#[tokio::test]
async fn paused_and_throttled_queues_are_gauges_by_kind() {
    let app = TestApp::spawn_with(|s| {
        s.metrics.kinds = "pay".parse().unwrap();
    })
    .await;
    for line in [
        r#"outbox_queues_paused{kind="pay"} 0"#,
        r#"outbox_queues_paused{kind="other"} 0"#,
        r#"outbox_queues_throttled{kind="pay"} 0"#,
        r#"outbox_queues_throttled{kind="other"} 0"#,
    ] {
        app.wait_for_metric(line).await;
    }
    for kind in ["pay", "sms", "push"] {
        let paused = v1::SetQueuePolicyRequest {
            paused: true,
            ..policy(kind)
        };
        set(&mut app.client(), paused).await;
    }
    let limited = v1::SetQueuePolicyRequest {
        max_in_flight: 1,
        ..policy("mail")
    };
    set(&mut app.client(), limited).await;
    app.enqueue(vec![intent("mail", "{}")]).await.unwrap();
    assert_eq!(app.claim_n("w", 5).await.len(), 1);
    for line in [
        r#"outbox_queues_paused{kind="pay"} 1"#,
        r#"outbox_queues_paused{kind="other"} 2"#,
        r#"outbox_queues_throttled{kind="pay"} 0"#,
        r#"outbox_queues_throttled{kind="other"} 1"#,
    ] {
        app.wait_for_metric(line).await;
    }
}

/// The docs' promise: a worker that acks and claims again gets the freed capacity at once,
/// also with a long poll (whose group's last look, held back by the limit, must not count
/// as having drained the queue: nothing would wake it but the recheck).
#[tokio::test]
async fn a_long_poll_after_an_ack_gets_the_slot_the_ack_freed_at_once() {
    let app = TestApp::spawn().await;
    set(
        &mut app.client(),
        v1::SetQueuePolicyRequest {
            max_in_flight: 1,
            ..policy("pay")
        },
    )
    .await;
    let ids = app
        .enqueue(vec![intent("pay", "1"), intent("pay", "2")])
        .await
        .unwrap();
    let mut long_poll = claim_request("w", 10);
    long_poll.wait = Some(duration(Duration::from_secs(60)));
    let first = app.claim(long_poll.clone()).await.unwrap();
    assert_eq!(first.iter().map(id_of).collect::<Vec<_>>(), [&ids[0].id]);
    app.ack(&[&first[0]]).await;
    // The tests' recheck is an hour: only a look of its own finds the freed slot.
    let second = tokio::time::timeout(Duration::from_secs(30), app.claim(long_poll))
        .await
        .expect("the long poll after the Ack waited for its recheck")
        .unwrap();
    assert_eq!(second.iter().map(id_of).collect::<Vec<_>>(), [&ids[1].id]);
}

#[tokio::test]
async fn a_rate_limit_leases_its_burst_then_its_rate() {
    let app = TestApp::spawn().await;
    let mut client = app.client();
    set(
        &mut client,
        v1::SetQueuePolicyRequest {
            rate_per_second: 2.0,
            burst: 5,
            ..policy("sms")
        },
    )
    .await;
    app.enqueue((0..20).map(|_| intent("sms", "{}")).collect())
        .await
        .unwrap();
    assert_eq!(app.claim_n("w", 20).await.len(), 5, "the burst");
    assert!(app.claim_n("w", 20).await.is_empty(), "no token left");
    app.clock.advance(Duration::from_millis(1500));
    assert_eq!(
        app.claim_n("w", 20).await.len(),
        3,
        "2 per second, 3 tokens"
    );
    app.clock.advance(Duration::from_secs(60));
    assert_eq!(
        app.claim_n("w", 20).await.len(),
        5,
        "never more than the burst"
    );
    let listed = client
        .list_queue_policies(v1::ListQueuePoliciesRequest {
            kind: "sms".to_owned(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .policies;
    assert_eq!(listed[0].in_flight, 13);
    assert!(listed[0].tokens < 1.0);
}

/// Claims that waited for a limited queue's turn count time from the turn: one whose
/// transaction began seconds before the turn came refills no bucket for those seconds, and
/// its leases last their full duration from the turn.
#[tokio::test]
async fn claims_that_waited_their_turn_take_no_more_than_the_burst_at_once() {
    const BURST: i64 = 10;
    let app = TestApp::spawn_tuned(|r| r.clock = outboxd::outbox::Clock::Database).await;
    set(
        &mut app.client(),
        v1::SetQueuePolicyRequest {
            rate_per_second: 10.0,
            burst: BURST as i32,
            ..policy("sms")
        },
    )
    .await;
    let mut batch: Vec<v1::NewIntent> = (0..30).map(|_| intent("sms", "{}")).collect();
    batch.extend((0..10).map(|_| intent("mail", "{}")));
    app.enqueue(batch).await.unwrap();

    // Another claim's turn that lasts: the policy row held.
    let mut holder = sqlx::PgConnection::connect(&app.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT 1 FROM outbox.queue_policy WHERE kind = 'sms' FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let lease = Duration::from_secs(30);
    let claim = |worker: &'static str| {
        let mut client = app.client();
        tokio::spawn(async move {
            let mut request = claim_request(worker, 20);
            request.lease_duration = Some(duration(lease));
            client.claim(request).await.unwrap().into_inner().leases
        })
    };
    let first = claim("w1");
    app.wait_for_lock_waiters(1).await;
    // The second claim's transaction begins well after the first's.
    let begun: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    while sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT clock_timestamp()")
        .fetch_one(&app.pool)
        .await
        .unwrap()
        < begun + chrono::Duration::milliseconds(1500)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = claim("w2");
    app.wait_for_lock_waiters(2).await;
    let released: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&mut holder)
        .await
        .unwrap();
    let turn = Instant::now();
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    let mut leases = first.await.unwrap();
    leases.extend(second.await.unwrap());
    let within = turn.elapsed().as_secs_f64();

    let sms = leases
        .iter()
        .filter(|l| l.intent.as_ref().unwrap().kind == "sms")
        .count() as f64;
    assert!(sms >= BURST as f64, "the burst: {sms}");
    assert!(
        sms <= BURST as f64 + 10.0 * within + 1.0,
        "{sms} leases within {within} s of the turn"
    );
    for lease in &leases {
        let intent = lease.intent.as_ref().unwrap();
        let expires: chrono::DateTime<chrono::Utc> =
            sqlx::query_scalar("SELECT lease_expires_at FROM outbox.intent WHERE id = $1::uuid")
                .bind(&intent.id)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        // The limited queue's leases count from the turn; those a claim took before it
        // waited are moved to it only after a wait past the workers' margins (100 ms).
        let slack = if intent.kind == "sms" {
            chrono::TimeDelta::zero()
        } else {
            chrono::TimeDelta::milliseconds(100)
        };
        assert!(
            expires >= released + chrono::TimeDelta::seconds(30) - slack,
            "{} ({}) expires at {expires}, its lease counted from before the turn at {released}",
            intent.id,
            intent.kind
        );
    }
}

#[tokio::test]
async fn bad_policies_are_refused_and_change_nothing() {
    let app = TestApp::spawn().await;
    let mut client = app.client();
    for (request, field) in [
        (
            v1::SetQueuePolicyRequest {
                kind: String::new(),
                ..policy("x")
            },
            "kind",
        ),
        (
            v1::SetQueuePolicyRequest {
                reason: String::new(),
                ..policy("x")
            },
            "reason",
        ),
        (
            v1::SetQueuePolicyRequest {
                actor: String::new(),
                ..policy("x")
            },
            "actor",
        ),
        (
            v1::SetQueuePolicyRequest {
                max_in_flight: -1,
                ..policy("x")
            },
            "max_in_flight",
        ),
        (
            v1::SetQueuePolicyRequest {
                rate_per_second: f64::NAN,
                ..policy("x")
            },
            "rate_per_second",
        ),
        (
            v1::SetQueuePolicyRequest {
                rate_per_second: -1.0,
                ..policy("x")
            },
            "rate_per_second",
        ),
        (
            v1::SetQueuePolicyRequest {
                rate_per_second: 1e9,
                ..policy("x")
            },
            "rate_per_second",
        ),
        (
            // Its next token would be 1e300 s away, more than a wait can be.
            v1::SetQueuePolicyRequest {
                rate_per_second: 1e-300,
                burst: 1,
                ..policy("x")
            },
            "rate_per_second",
        ),
        (
            v1::SetQueuePolicyRequest {
                burst: 3,
                ..policy("x")
            },
            "burst",
        ),
    ] {
        let status = client.set_queue_policy(request).await.unwrap_err();
        assert_status(&status, Code::InvalidArgument, "INVALID_ARGUMENT", &[field]);
    }
    let producer = app.key(&["acme"], &["produce", "consume"], &[]).await;
    let status = app
        .client_with(Some(&producer), None)
        .await
        .set_queue_policy(policy("x"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    let regional = app.key(&["acme"], &["operate"], &["eu"]).await;
    let status = app
        .client_with(Some(&regional), None)
        .await
        .set_queue_policy(policy("x"))
        .await
        .unwrap_err();
    assert_status(&status, Code::PermissionDenied, "REGION_NOT_ALLOWED", &[]);
    for kind in ["bad\u{1}kind".to_owned(), "k".repeat(300)] {
        let status = client
            .list_queue_policies(v1::ListQueuePoliciesRequest {
                kind,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_status(
            &status,
            Code::InvalidArgument,
            "INVALID_ARGUMENT",
            &["kind"],
        );
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.queue_policy_change")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(count, 0);
}

#[tokio::test]
async fn a_rate_limit_holds_across_two_replicas_and_eight_claimers() {
    const BURST: i32 = 5;
    const RATE: f64 = 2.0;
    let app = TestApp::spawn().await;
    let other = TestApp::spawn_on(app.url.clone(), |_| {}).await;
    set(
        &mut app.client(),
        v1::SetQueuePolicyRequest {
            rate_per_second: RATE,
            burst: BURST,
            ..policy("sms")
        },
    )
    .await;
    app.enqueue((0..100).map(|_| intent("sms", "{}")).collect())
        .await
        .unwrap();
    // Each server has its own manual clock, started when it was: they differ by the time
    // between the two starts, which the bucket may refill once.
    let spread = (other.clock.now().unwrap() - app.clock.now().unwrap())
        .abs()
        .to_std()
        .unwrap();
    let leased = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox.intent WHERE kind = 'sms' AND attempts > 0",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap()
    };
    let hammer = |rounds: usize| {
        let clients: Vec<Client> = (0..8)
            .map(|c| {
                if c % 2 == 0 {
                    app.client()
                } else {
                    other.client()
                }
            })
            .collect();
        async move {
            let mut claimers = Vec::new();
            for (c, mut client) in clients.into_iter().enumerate() {
                claimers.push(tokio::spawn(async move {
                    for _ in 0..rounds {
                        client
                            .claim(claim_request(&format!("w{c}"), 10))
                            .await
                            .unwrap();
                    }
                }));
            }
            for claimer in claimers {
                claimer.await.unwrap();
            }
        }
    };
    let bound = |seconds: f64| f64::from(BURST) + RATE * (seconds + spread.as_secs_f64());
    hammer(20).await;
    let first = leased().await;
    assert!(first >= i64::from(BURST), "the burst: {first}");
    assert!(
        first as f64 <= bound(0.0),
        "{first} leases with the clocks still"
    );
    app.clock.advance(Duration::from_secs(1));
    other.clock.advance(Duration::from_secs(1));
    hammer(20).await;
    let second = leased().await;
    assert!(second as f64 <= bound(1.0), "{second} leases after 1 s");
    assert!(second > first, "the bucket refilled");
}

#[tokio::test]
async fn the_cli_sets_lists_and_shows_queue_policies_and_enqueues_with_a_priority() {
    let app = TestApp::spawn().await;
    let key = app.key(&[crate::helpers::TENANT], &["admin"], &[]).await;
    let set = [
        "queues",
        "set",
        "--kind",
        "pay",
        "--max-in-flight",
        "2",
        "--rate",
        "1.5",
        "--actor",
        "alice",
        "--reason",
        "PSP limit",
        "--json",
    ];
    let out = cli(&app, &key, &set).await;
    let set: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(set[0]["max_in_flight"], 2, "{out}");
    assert_eq!(set[0]["burst"], 2, "the rate rounded up: {out}");
    let args = ["enqueue", "--kind", "pay", "--priority", "-3", "--json"];
    let out = cli(&app, &key, &args).await;
    let enqueued: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        app.intent(enqueued[0]["id"].as_str().unwrap())
            .await
            .priority,
        -3
    );
    let out = cli(&app, &key, &["queues", "list"]).await;
    assert!(
        out.contains("pay") && out.contains("0/2") && out.contains("PSP limit"),
        "{out}"
    );
    let out = cli(&app, &key, &["stats", "--json"]).await;
    let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(stats["policies"][0]["kind"], "pay", "{out}");
}

/// Every Claim walks the queues (kinds × priorities) of its scope: a tenant has at most
/// 1,000, and an Enqueue that would add more records nothing.
#[tokio::test]
async fn an_enqueue_past_a_tenants_thousand_queues_is_refused_and_records_nothing() {
    let app = TestApp::spawn().await;
    sqlx::query(
        "INSERT INTO outbox.queue_level (tenant_id, kind, priority)
         SELECT 'acme', 'kind.' || n, 0 FROM generate_series(1, 1000) n",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let status = app
        .client()
        .enqueue(v1::EnqueueRequest {
            intents: vec![intent("kind.1", "{}"), intent("one.too.many", "{}")],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, "TOO_MANY_QUEUES", &[]);
    let recorded: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intent")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(recorded, 0);

    // Its existing queues take intents as before.
    assert_eq!(app.enqueue_n("kind.1", 1).await.len(), 1);
}

/// Statements that bring a tenant new queues take turns on its lock: the second counts
/// the first's levels, so together they never pass the cap.
#[tokio::test]
async fn new_queues_registered_at_once_take_turns_and_never_pass_the_tenants_thousand() {
    let app = TestApp::spawn().await;
    let insert = |from: i32, to: i32| {
        format!(
            "INSERT INTO outbox.queue_level (tenant_id, kind, priority) \
             SELECT 'acme', 'kind.' || n, 0 FROM generate_series({from}, {to}) n"
        )
    };
    let mut first = app.pool.begin().await.unwrap();
    sqlx::query(&insert(1, 600))
        .execute(&mut *first)
        .await
        .unwrap();
    // Meanwhile another statement's new levels wait for the first's commit (here: until
    // its lock_timeout), where without the lock each counted only its own.
    let mut second = app.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '100ms'")
        .execute(&mut *second)
        .await
        .unwrap();
    let waited = sqlx::query(&insert(601, 1100))
        .execute(&mut *second)
        .await
        .unwrap_err();
    assert_eq!(
        waited.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("55P03"),
        "{waited}"
    );
    second.rollback().await.unwrap();
    first.commit().await.unwrap();
    let refused = sqlx::query(&insert(601, 1100))
        .execute(&app.pool)
        .await
        .unwrap_err();
    assert_eq!(
        refused
            .as_database_error()
            .and_then(|e| e.code())
            .as_deref(),
        Some("OBX01"),
        "{refused}"
    );
    let levels: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.queue_level")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(levels, 600);
}

/// Every read of the policies counts each one's live leases: a tenant has at most 1,000
/// (as many as its queues). Past them a new one is refused; those there still change.
#[tokio::test]
async fn a_tenants_thousand_and_first_queue_policy_is_refused_and_its_others_still_change() {
    let app = TestApp::spawn().await;
    sqlx::query(
        "INSERT INTO outbox.queue_policy (tenant_id, kind, updated_by, reason, updated_at)
         SELECT 'acme', 'kind.' || n, 'ops', 'set by SQL', now()
         FROM generate_series(1, 1000) n",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let mut client = app.client();
    let status = client
        .set_queue_policy(policy("one.too.many"))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::ResourceExhausted,
        "TOO_MANY_QUEUES",
        &["kind"],
    );
    let changes: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.queue_policy_change")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(changes, 0, "nothing recorded");

    let paused = set(
        &mut client,
        v1::SetQueuePolicyRequest {
            paused: true,
            ..policy("kind.1")
        },
    )
    .await;
    assert!(paused.paused);
}

/// New policies of one tenant set at once take turns: with room for one, one is set.
#[tokio::test]
async fn new_queue_policies_set_at_once_never_pass_the_tenants_thousand() {
    let app = TestApp::spawn().await;
    sqlx::query(
        "INSERT INTO outbox.queue_policy (tenant_id, kind, updated_by, reason, updated_at)
         SELECT 'acme', 'kind.' || n, 'ops', 'set by SQL', now()
         FROM generate_series(1, 999) n",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let calls = (0..8).map(|n| {
        let mut client = app.client();
        async move { client.set_queue_policy(policy(&format!("new.{n}"))).await }
    });
    let results = futures::future::join_all(calls).await;
    let set = results.iter().filter(|r| r.is_ok()).count();
    for refused in results.iter().filter_map(|r| r.as_ref().err()) {
        assert_status(
            refused,
            Code::ResourceExhausted,
            "TOO_MANY_QUEUES",
            &["kind"],
        );
    }
    assert_eq!(set, 1, "room for one policy: one set");
    let policies: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.queue_policy")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(policies, 1000);
}

/// Rows of `outbox.queue_policy_change`: one per change applied.
async fn policy_changes(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox.queue_policy_change")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn policies(client: &mut Client) -> Vec<v1::QueuePolicy> {
    client
        .list_queue_policies(v1::ListQueuePoliciesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .policies
}

#[tokio::test]
async fn a_policy_change_made_on_a_stale_read_is_refused_with_conflict_and_changes_nothing() {
    let app = TestApp::spawn().await;
    let mut client = app.client();
    let expecting = |at: &Option<prost_types::Timestamp>| v1::SetQueuePolicyRequest {
        paused: true,
        expected_updated_at: *at,
        ..policy("mail")
    };
    // No policy yet: an expected one is not there.
    let never = Some(prost_types::Timestamp {
        seconds: 1_700_000_000,
        nanos: 0,
    });
    let refused = client
        .set_queue_policy(expecting(&never))
        .await
        .unwrap_err();
    assert_status(&refused, Code::Aborted, "CONFLICT", &[]);
    assert!(
        refused.message().contains("changed after it was read")
            && refused.message().contains("no policy"),
        "{refused:?}"
    );
    assert!(policies(&mut client).await.is_empty());
    assert_eq!(policy_changes(&app).await, 0);

    // Unset: the first policy applies; then carol changes it, a second later, on what
    // she read.
    let read = set(&mut client, expecting(&None)).await;
    app.advance(Duration::from_secs(1));
    let carols = set(
        &mut client,
        v1::SetQueuePolicyRequest {
            max_in_flight: 3,
            actor: "carol".to_owned(),
            expected_updated_at: read.updated_at,
            ..policy("mail")
        },
    )
    .await;
    assert!(!carols.paused && carols.max_in_flight == 3);

    // The first read is stale now: refused, and carol's policy stands, not recorded again.
    let refused = client
        .set_queue_policy(expecting(&read.updated_at))
        .await
        .unwrap_err();
    assert_status(&refused, Code::Aborted, "CONFLICT", &[]);
    assert!(
        refused.message().contains("changed after it was read")
            && refused.message().contains("by carol")
            && refused.message().contains("nothing was changed"),
        "{refused:?}"
    );
    let now = policies(&mut client).await;
    assert_eq!(now.len(), 1);
    assert!(!now[0].paused && now[0].max_in_flight == 3 && now[0].actor == "carol");
    assert_eq!(now[0].updated_at, carols.updated_at);
    assert_eq!(policy_changes(&app).await, 2);

    // On a fresh read it applies; and a change at the same instant (the clock did not
    // move) is still a later version, so the read before it is stale.
    let fresh = set(&mut client, expecting(&carols.updated_at)).await;
    assert!(fresh.paused && fresh.max_in_flight == 0);
    let same_instant = set(&mut client, expecting(&fresh.updated_at)).await;
    let instant = |t: &Option<prost_types::Timestamp>| t.as_ref().map(|t| (t.seconds, t.nanos));
    assert!(instant(&same_instant.updated_at) > instant(&fresh.updated_at));
    let refused = client
        .set_queue_policy(expecting(&fresh.updated_at))
        .await
        .unwrap_err();
    assert_status(&refused, Code::Aborted, "CONFLICT", &[]);
    assert_eq!(policy_changes(&app).await, 4);

    // Several at once on the same read: one applies.
    let calls = (0..6).map(|_| {
        let mut client = app.client();
        let request = expecting(&same_instant.updated_at);
        async move { client.set_queue_policy(request).await }
    });
    let results = futures::future::join_all(calls).await;
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1);
    for refused in results.iter().filter_map(|r| r.as_ref().err()) {
        assert_status(refused, Code::Aborted, "CONFLICT", &[]);
    }
    assert_eq!(policy_changes(&app).await, 5);

    let bad = client
        .set_queue_policy(expecting(&Some(prost_types::Timestamp {
            seconds: i64::MAX,
            nanos: 0,
        })))
        .await
        .unwrap_err();
    assert_status(
        &bad,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["expected_updated_at"],
    );
}

#[tokio::test]
async fn the_cli_changes_a_policy_only_as_it_was_listed_with_expected_updated_at() {
    let app = TestApp::spawn().await;
    let key = app.key(&[crate::helpers::TENANT], &["admin"], &[]).await;
    let set = |expected: &str| {
        [
            "queues",
            "set",
            "--kind",
            "pay",
            "--paused",
            "--actor",
            "alice",
            "--reason",
            "PSP incident",
            "--expected-updated-at",
            expected,
            "--json",
        ]
        .map(str::to_owned)
    };
    set_policy_by(&app, "pay", "bob").await;
    let listed = cli(&app, &key, &["queues", "list", "--json"]).await;
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let read = listed[0]["updated_at"].as_str().unwrap().to_owned();
    app.advance(Duration::from_secs(1));
    set_policy_by(&app, "pay", "carol").await;

    let server = format!("http://{}", app.addr);
    let stale = set(&read);
    let args: Vec<&str> = stale.iter().map(String::as_str).collect();
    let args = [&args[..], &["--server", &server, "--api-key", &key]].concat();
    let output = crate::commands::outboxd(&args, &[]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("CONFLICT") && stderr.contains("changed after it was read"),
        "{stderr}"
    );
    assert!(!policies(&mut app.client()).await[0].paused);

    let listed = cli(&app, &key, &["queues", "list", "--json"]).await;
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let fresh = set(listed[0]["updated_at"].as_str().unwrap());
    let args: Vec<&str> = fresh.iter().map(String::as_str).collect();
    let out = cli(&app, &key, &args).await;
    let applied: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(applied[0]["paused"], true, "{out}");
    assert_eq!(applied[0]["actor"], "alice", "{out}");
}

/// A policy of `kind` set through the API, not paused, by `actor`.
async fn set_policy_by(app: &TestApp, kind: &str, actor: &str) {
    set(
        &mut app.client(),
        v1::SetQueuePolicyRequest {
            actor: actor.to_owned(),
            ..policy(kind)
        },
    )
    .await;
}

/// Policies are listed page by page, each page within the reply limit (an all-tenant key's
/// listing grows with the tenants); GetQueueStats shows as many as fit, and says so.
#[tokio::test]
async fn policies_are_listed_in_pages_within_the_reply_limit() {
    use prost::Message as _;
    const REPLY: usize = 20_000;
    let app = TestApp::spawn_with(|s| {
        s.limits.max_payload_bytes = 1024;
        s.limits.max_reply_bytes = REPLY;
    })
    .await;
    let mut client = app.client();
    let mut kinds = app.pause_with_long_reasons(10).await;
    let (mut listed, mut pages, mut page_token) = (Vec::new(), 0, String::new());
    loop {
        let request = v1::ListQueuePoliciesRequest {
            page_token,
            ..Default::default()
        };
        let page = client
            .list_queue_policies(request)
            .await
            .unwrap()
            .into_inner();
        assert!(page.encoded_len() <= REPLY, "{} bytes", page.encoded_len());
        assert!(!page.policies.is_empty());
        listed.extend(page.policies.into_iter().map(|p| p.kind));
        pages += 1;
        page_token = page.next_page_token;
        if page_token.is_empty() {
            break;
        }
    }
    kinds.sort();
    assert_eq!(listed, kinds, "each policy once, by kind");
    assert!(pages >= 3, "{pages} pages");

    let stats = client
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(stats.policies_left_out);
    assert!(!stats.policies.is_empty() && stats.policies.len() < 10);
    assert!(
        stats.encoded_len() <= REPLY,
        "{} bytes",
        stats.encoded_len()
    );
    // `outboxd stats` says so too.
    let key = app.key(&[crate::helpers::TENANT], &["admin"], &[]).await;
    let out = crate::ordering::cli(&app, &key, &["stats"]).await;
    assert!(out.contains("more policies than fit the reply"), "{out}");
    let out = crate::ordering::cli(&app, &key, &["stats", "--json"]).await;
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["policies_left_out"], true, "{out}");

    let request = v1::ListQueuePoliciesRequest {
        page_token: "not a token".to_owned(),
        ..Default::default()
    };
    let refused = client.list_queue_policies(request).await.unwrap_err();
    assert_status(
        &refused,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["page_token"],
    );
}
