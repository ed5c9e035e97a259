//! Ordering keys: one tenant's intents of one key are leased one at a time, in the order
//! their transactions committed, and a head that cannot be delivered holds its key.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outboxd::proto::v1::{self, Decision, FailOutcome, IntentState};
use sqlx::{Connection, PgConnection};
use tonic::Code;

use crate::helpers::{
    TENANT, TestApp, assert_item_ok, assert_status, claim_request, id_of, intent, lease_ref,
};
use crate::long_poll::{wait_until_claims_are_waiting, woken};
use crate::two_phase::{app_on_own_cluster_with, enqueue_in, stop_own_cluster, token_of};

fn ordered(key: &str, payload: &str) -> v1::NewIntent {
    v1::NewIntent {
        ordering_key: key.to_owned(),
        ..intent("order.event", payload)
    }
}

fn decide(id: &str, decision: Decision) -> v1::ReconcileRequest {
    v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
            ids: vec![id.to_owned()],
            ..Default::default()
        })),
        decision: decision as i32,
        actor: "alice".into(),
        reason: "looked at it".into(),
        limit: 0,
    }
}

async fn stats(app: &TestApp) -> v1::GetQueueStatsResponse {
    app.client()
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// Claims and acks one intent at a time until none is left; the ids in delivery order.
pub(crate) async fn drain_one_by_one(app: &TestApp) -> Vec<String> {
    let mut delivered = Vec::new();
    loop {
        let leases = app.claim_n("w", 1).await;
        let Some(lease) = leases.first() else {
            return delivered;
        };
        delivered.push(id_of(lease).to_owned());
        app.ack(&[lease]).await;
    }
}

#[tokio::test]
async fn a_key_is_leased_one_intent_at_a_time_in_request_order() {
    let app = TestApp::spawn().await;
    let results = app
        .enqueue(vec![
            ordered("order-1", "created"),
            ordered("order-1", "paid"),
            ordered("order-2", "created"),
            intent("email.send", "{}"),
            ordered("order-1", "shipped"),
        ])
        .await
        .unwrap();
    let states: Vec<IntentState> = results.iter().map(|r| r.state()).collect();
    assert_eq!(
        states,
        [
            IntentState::Pending,
            IntentState::Waiting,
            IntentState::Pending,
            IntentState::Pending,
            IntentState::Waiting
        ]
    );
    let ids: Vec<&str> = results.iter().map(|r| r.id.as_str()).collect();

    // Each key's first, and the unordered one alongside, in one claim.
    let leases = app.claim_n("w", 10).await;
    let mut claimed: Vec<&str> = leases.iter().map(id_of).collect();
    claimed.sort();
    let mut heads = vec![ids[0], ids[2], ids[3]];
    heads.sort();
    assert_eq!(claimed, heads);
    assert_eq!(app.intent(ids[1]).await.ordering_key, "order-1");
    assert_eq!(app.state(ids[4]).await, IntentState::Waiting);
    assert!(
        app.claim_n("w", 10).await.is_empty(),
        "a key's second waits"
    );

    let refs: Vec<&v1::Lease> = leases.iter().collect();
    app.ack(&refs).await;
    assert_eq!(drain_one_by_one(&app).await, [ids[1], ids[4]]);
}

#[tokio::test]
async fn producers_committing_out_of_enqueue_order_are_delivered_in_commit_order() {
    let app = TestApp::spawn().await;
    let mut producers = Vec::new();
    let mut ids = Vec::new();
    // Three producer transactions enqueue, in this order, to one key…
    for name in ["a", "b", "c"] {
        let mut conn = app.producer().await;
        sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        let token = token_of(&mut conn).await;
        let results = enqueue_in(&app, &token, vec![ordered("account-7", name)])
            .await
            .unwrap();
        assert_eq!(results[0].state(), IntentState::Staged);
        ids.push(results[0].id.clone());
        producers.push(conn);
    }
    // …a direct Enqueue of the key commits while they are open…
    let direct = app
        .enqueue(vec![ordered("account-7", "direct")])
        .await
        .unwrap();
    assert_eq!(
        direct[0].state(),
        IntentState::Waiting,
        "an open producer transaction of the key may still commit first"
    );
    // …and they commit c, a, b.
    for i in [2, 0, 1] {
        sqlx::query("COMMIT")
            .execute(&mut producers[i])
            .await
            .unwrap();
    }
    app.wait_for_state(&direct[0].id, IntentState::Pending)
        .await;
    assert_eq!(
        drain_one_by_one(&app).await,
        [
            direct[0].id.clone(),
            ids[2].clone(),
            ids[0].clone(),
            ids[1].clone()
        ]
    );
}

#[tokio::test]
async fn a_rolled_back_producer_releases_the_key_it_held() {
    let app = TestApp::spawn().await;
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    enqueue_in(&app, &token, vec![ordered("k", "rolled back")])
        .await
        .unwrap();
    let direct = app.enqueue(vec![ordered("k", "direct")]).await.unwrap();
    assert_eq!(direct[0].state(), IntentState::Waiting);
    tx.rollback().await.unwrap();
    // An abort sends no NOTIFY: the promotion's polling sweep finds it.
    app.wait_for_state(&direct[0].id, IntentState::Pending)
        .await;
}

#[tokio::test]
async fn a_retried_head_keeps_the_later_intents_of_its_key_waiting() {
    let app = TestApp::spawn().await;
    let ids = app
        .enqueue_ids(vec![ordered("k", "first"), ordered("k", "second")])
        .await;
    let leases = app.claim_n("w", 10).await;
    assert_eq!(leases.len(), 1);
    app.fail(&leases[0], FailOutcome::Retry).await;

    assert!(app.claim_n("w", 10).await.is_empty());
    assert_eq!(app.state(&ids[1]).await, IntentState::Waiting);
    let s = stats(&app).await;
    assert_eq!(s.blocked_keys, 1);
    assert!(s.oldest_blocked_at.is_some());

    app.advance(Duration::from_secs(3600));
    let again = app.claim_n("w", 10).await;
    assert_eq!(again.iter().map(id_of).collect::<Vec<_>>(), [&ids[0]]);
    assert_eq!(again[0].attempt, 2);
    app.ack(&[&again[0]]).await;
    assert_eq!(drain_one_by_one(&app).await, [ids[1].clone()]);
    assert_eq!(stats(&app).await.blocked_keys, 0);
}

/// Three intents of key "k" whose head (one attempt) failed with `outcome`: dead-lettered.
async fn three_behind_a_dead_lettered_head(app: &TestApp, outcome: FailOutcome) -> Vec<String> {
    let mut head = ordered("k", "head");
    head.max_attempts = 1;
    let ids = app
        .enqueue_ids(vec![head, ordered("k", "next"), ordered("k", "last")])
        .await;
    let leases = app.claim_n("w", 10).await;
    app.fail(&leases[0], outcome).await;
    ids
}

#[tokio::test]
async fn a_dead_lettered_head_blocks_its_key_until_an_operator_decides() {
    let app = TestApp::spawn().await;
    let ids = three_behind_a_dead_lettered_head(&app, FailOutcome::Retry).await;
    assert_eq!(app.state(&ids[0]).await, IntentState::DeadLettered);

    app.advance(Duration::from_secs(3600));
    assert!(app.claim_n("w", 10).await.is_empty(), "the key is blocked");
    assert_eq!(stats(&app).await.blocked_keys, 1);
    app.wait_for_metric("outbox_blocked_ordering_keys 1").await;
    app.wait_for_metric("outbox_intents{state=\"waiting\",region=\"\"} 2")
        .await;

    // REQUEUE runs the head again, still before the others.
    let r = app
        .reconcile(decide(&ids[0], Decision::Requeue))
        .await
        .unwrap();
    assert_eq!(r[0].state(), IntentState::Pending);
    let again = app.claim_n("w", 10).await;
    assert_eq!(again.iter().map(id_of).collect::<Vec<_>>(), [&ids[0]]);
    app.fail(&again[0], FailOutcome::Permanent).await;
    assert!(app.claim_n("w", 10).await.is_empty());

    // DEAD gives it up and releases the key.
    let r = app
        .reconcile(decide(&ids[0], Decision::Dead))
        .await
        .unwrap();
    assert!(r[0].error.is_none(), "{:?}", r[0].error);
    assert_eq!(r[0].state(), IntentState::DeadLettered);
    assert_eq!(app.state(&ids[1]).await, IntentState::Pending);
    assert_eq!(stats(&app).await.blocked_keys, 0);
    assert_eq!(drain_one_by_one(&app).await, ids[1..]);
    assert_eq!(app.get(&ids[0]).await.resolutions.len(), 2);
}

#[tokio::test]
async fn a_dead_letter_given_up_after_its_key_moved_on_is_not_requeued_behind_it() {
    let app = TestApp::spawn().await;
    let ids = three_behind_a_dead_lettered_head(&app, FailOutcome::Permanent).await;
    app.reconcile(decide(&ids[0], Decision::Dead))
        .await
        .unwrap();
    let next = app.claim_n("w", 10).await;
    assert_eq!(next.iter().map(id_of).collect::<Vec<_>>(), [&ids[1]]);

    // Run again now it would come after "next", or be recorded delivered after its key
    // went on without it: both refused, nothing changed.
    for decision in [Decision::Requeue, Decision::Delivered, Decision::Dead] {
        let r = app.reconcile(decide(&ids[0], decision)).await.unwrap();
        let e = r[0].error.as_ref().expect("refused");
        assert_eq!(
            (e.code, e.reason.as_str()),
            (Code::FailedPrecondition as i32, "INVALID_STATE"),
            "{decision:?}: {}",
            e.message
        );
        assert_eq!(r[0].state(), IntentState::DeadLettered);
    }
    let by_filter = app
        .reconcile(v1::ReconcileRequest {
            target: Some(v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
                states: vec![IntentState::DeadLettered as i32],
                ..Default::default()
            })),
            decision: Decision::Requeue as i32,
            actor: "alice".into(),
            reason: "requeue every dead letter".into(),
            limit: 100,
        })
        .await
        .unwrap();
    assert!(by_filter.is_empty(), "{by_filter:?}");
    assert_eq!(app.state(&ids[0]).await, IntentState::DeadLettered);
    assert_eq!(app.get(&ids[0]).await.resolutions.len(), 1);

    // Listed as DEAD_LETTERED, but no longer among what awaits a decision (the desk, the
    // CLI's reconcile list).
    let listed = |awaiting_decision: bool| {
        let mut client = app.client();
        async move {
            let page = client
                .list_intents(v1::ListIntentsRequest {
                    states: vec![IntentState::DeadLettered as i32],
                    awaiting_decision,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            page.intents.into_iter().map(|i| i.id).collect::<Vec<_>>()
        }
    };
    assert_eq!(listed(false).await, [ids[0].clone()]);
    assert_eq!(listed(true).await, Vec::<String>::new());
    let key = app.key(&[TENANT], &["operate"], &[]).await;
    let out = cli(&app, &key, &["reconcile", "list"]).await;
    assert!(!out.contains(&ids[0]), "{out}");
    app.ack(&[&next[0]]).await;
    assert_eq!(drain_one_by_one(&app).await, [ids[2].clone()]);

    // Finished: no operator's work left, and purged with the resolved intents.
    assert_eq!(stats(&app).await.reconcile_backlog, 0);
    app.wait_for_metric("outbox_reconcile_backlog 0").await;
    app.advance(Duration::from_secs(3 * 86_400));
    assert_eq!(app.purge().await, 3);
    assert_eq!(
        app.client()
            .get_intent(v1::GetIntentRequest { id: ids[0].clone() })
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
}

#[tokio::test]
async fn a_head_needing_reconcile_holds_its_key_until_it_is_decided_delivered() {
    let app = TestApp::spawn().await;
    let ids = app
        .enqueue_ids(vec![ordered("k", "charge"), ordered("k", "receipt")])
        .await;
    let leases = app.claim_n("w", 10).await;
    app.fail(&leases[0], FailOutcome::Unknown).await;
    assert_eq!(app.state(&ids[0]).await, IntentState::NeedsReconcile);
    assert!(app.claim_n("w", 10).await.is_empty());

    app.reconcile(decide(&ids[0], Decision::Delivered))
        .await
        .unwrap();
    assert_eq!(drain_one_by_one(&app).await, [ids[1].clone()]);
}

#[tokio::test]
async fn an_ack_of_a_head_and_a_cancel_of_the_next_intent_meeting_on_their_key_both_apply() {
    ack_and_cancel_meet_on_their_key(|ids| decide(&ids[1], Decision::Cancel)).await;
}

#[tokio::test]
async fn an_ack_of_a_head_and_a_cancel_by_filter_meeting_on_their_key_both_apply() {
    ack_and_cancel_meet_on_their_key(|_| v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
            states: vec![IntentState::Waiting as i32],
            ..Default::default()
        })),
        limit: 1,
        ..decide("", Decision::Cancel)
    })
    .await;
}

/// Keys `x` and `y`, the one whose advisory lock comes first in lock order first.
async fn x_and_y_in_lock_order(app: &TestApp) -> (&'static str, &'static str) {
    let lock_of = |key: &'static str| {
        sqlx::query_scalar::<_, i64>("SELECT outbox.ordering_lock($1, $2)")
            .bind(TENANT)
            .bind(key)
            .fetch_one(&app.pool)
    };
    if lock_of("x").await.unwrap() < lock_of("y").await.unwrap() {
        ("x", "y")
    } else {
        ("y", "x")
    }
}

/// Takes `key`'s advisory lock in `tx`, as an Enqueue of the key does.
async fn take_key(tx: &mut PgConnection, key: &str) {
    sqlx::query("SELECT pg_advisory_xact_lock(outbox.ordering_lock($1, $2))")
        .bind(TENANT)
        .bind(key)
        .execute(tx)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_cancel_of_intents_of_two_keys_takes_both_keys_before_either_row() {
    let app = TestApp::spawn().await;
    // Two keys: the WAITING target's comes after the PENDING target's in lock order.
    let (pending_key, waiting_key) = x_and_y_in_lock_order(&app).await;
    let ids = app
        .enqueue_ids(vec![
            ordered(waiting_key, "head"),
            ordered(waiting_key, "next"),
            ordered(pending_key, "only"),
        ])
        .await;
    // A transaction that takes the two keys in lock order, as an Enqueue of both does.
    let mut holder = PgConnection::connect(&app.url).await.unwrap();
    let mut held = holder.begin().await.unwrap();
    take_key(&mut held, pending_key).await;
    let cancel = {
        let mut client = app.client();
        let mut request = decide(&ids[1], Decision::Cancel);
        if let Some(v1::reconcile_request::Target::Ids(target)) = &mut request.target {
            target.ids.push(ids[2].clone());
        }
        tokio::spawn(async move { client.reconcile(request).await })
    };
    app.wait_for_lock_waiters(1).await;
    // Had the CANCEL taken the WAITING target's key first, this would deadlock with it.
    take_key(&mut held, waiting_key).await;
    held.rollback().await.unwrap();

    let results = cancel.await.unwrap().unwrap().into_inner().results;
    for r in &results {
        assert!(r.error.is_none(), "{:?}", r.error);
        assert_eq!(r.state(), IntentState::Cancelled);
    }
    assert_eq!(drain_one_by_one(&app).await, [ids[0].clone()]);
}

/// An Ack takes the keys of all its heads in one round, in lock order, whether a head
/// leaves the live table (to the history) or stays (an idempotency key keeps it in place):
/// taken a round each, an Enqueue of both keys could hold one and wait for the other.
#[tokio::test]
async fn an_ack_of_heads_of_two_keys_takes_both_keys_in_one_round() {
    let app = TestApp::spawn().await;
    let (first, second) = x_and_y_in_lock_order(&app).await;
    let ids = app
        .enqueue_ids(vec![
            v1::NewIntent {
                idempotency_key: "stays-in-place".into(),
                ..ordered(first, "head")
            },
            ordered(second, "head"),
            ordered(first, "next"),
            ordered(second, "next"),
        ])
        .await;
    let leases = app.claim_n("w", 10).await;
    assert_eq!(leases.len(), 2);
    // A transaction that takes the two keys in lock order, as an Enqueue of both does.
    let mut holder = PgConnection::connect(&app.url).await.unwrap();
    let mut held = holder.begin().await.unwrap();
    take_key(&mut held, first).await;
    let ack = {
        let mut client = app.client();
        let leases = leases.iter().map(lease_ref).collect();
        tokio::spawn(async move { client.ack(v1::AckRequest { leases }).await })
    };
    app.wait_for_lock_waiters(1).await;
    // Had the Ack taken the second key first, this would deadlock with it.
    take_key(&mut held, second).await;
    held.rollback().await.unwrap();

    let results = ack.await.unwrap().unwrap().into_inner().results;
    assert_eq!(results.len(), 2);
    for r in &results {
        assert_item_ok(r, IntentState::Delivered);
    }
    let mut next = app.claim_ids("w", 10).await;
    next.sort();
    let mut expected = vec![ids[2].clone(), ids[3].clone()];
    expected.sort();
    assert_eq!(next, expected);
}

/// A CANCEL takes an ordered intent's key before its row. The promotion of a STAGED one
/// took the row first and then waited for the key: with a CANCEL of it in between, each
/// waited for the other (a deadlock, the CANCEL answered ABORTED). It now waits for the key
/// holding no row, and promotes the intent once it has the key.
#[tokio::test]
async fn the_promotion_waits_for_a_staged_intents_key_before_locking_its_row() {
    let app = TestApp::spawn().await;
    let mut producer = app.producer().await;
    let mut tx = producer.begin().await.unwrap();
    let token = token_of(&mut tx).await;
    let staged = enqueue_in(&app, &token, vec![ordered("k", "staged")])
        .await
        .unwrap();
    let id = staged[0].id.clone();
    // The key held as a CANCEL of the intent holds it before it locks the row.
    let mut holder = PgConnection::connect(&app.url).await.unwrap();
    let mut held = holder.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(outbox.ordering_lock($1, 'k'))")
        .bind(TENANT)
        .execute(&mut *held)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let cancel = async {
        // This promotion, or the one the commit kicked, waits for the key…
        app.wait_for_lock_waiters(1).await;
        // …holding no row: the CANCEL's next step gets it.
        sqlx::query("SELECT 1 FROM outbox.intent WHERE id = $1::uuid FOR UPDATE NOWAIT")
            .bind(&id)
            .execute(&mut *held)
            .await
            .expect("no promotion holds the row while it waits for the key");
        held.rollback().await.unwrap();
    };
    tokio::join!(app.promote(), cancel);
    app.wait_for_state(&id, IntentState::Pending).await;
}

/// Key "k" of three intents, the head leased: its Ack and a CANCEL of one behind it (the
/// `cancel` request, given the ids) reach the key's lock in that order, the order in which
/// they deadlocked; both must apply, and the intent left is delivered next.
async fn ack_and_cancel_meet_on_their_key(cancel: impl FnOnce(&[String]) -> v1::ReconcileRequest) {
    let app = TestApp::spawn().await;
    let ids = app
        .enqueue_ids(vec![
            ordered("k", "head"),
            ordered("k", "next"),
            ordered("k", "last"),
        ])
        .await;
    let leases = app.claim_n("w", 10).await;
    // The key's lock held from outside until both wait for it.
    let mut holder = PgConnection::connect(&app.url).await.unwrap();
    let mut held = holder.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(outbox.ordering_lock($1, 'k'))")
        .bind(TENANT)
        .execute(&mut *held)
        .await
        .unwrap();
    let ack = {
        let mut client = app.client();
        let leases = vec![lease_ref(&leases[0])];
        tokio::spawn(async move { client.ack(v1::AckRequest { leases }).await })
    };
    app.wait_for_lock_waiters(1).await;
    let cancel = {
        let mut client = app.client();
        let request = cancel(&ids);
        tokio::spawn(async move { client.reconcile(request).await })
    };
    app.wait_for_lock_waiters(2).await;
    held.rollback().await.unwrap();

    let acked = ack.await.unwrap().unwrap().into_inner().results;
    assert_item_ok(&acked[0], IntentState::Delivered);
    let cancelled = cancel.await.unwrap().unwrap().into_inner().results;
    assert!(cancelled[0].error.is_none(), "{:?}", cancelled[0].error);
    assert_eq!(cancelled[0].state(), IntentState::Cancelled);
    // By filter, the one WAITING when the CANCEL ran: the Ack had made the next PENDING.
    let rest: Vec<String> = ids[1..]
        .iter()
        .filter(|id| **id != cancelled[0].intent_id)
        .cloned()
        .collect();
    assert_eq!(rest.len(), 1);
    assert_eq!(drain_one_by_one(&app).await, rest);
}

#[tokio::test]
async fn a_key_never_has_two_live_leases_across_replicas_and_concurrent_claimers() {
    const KEYS: usize = 12;
    const PER_KEY: usize = 10;
    let app = TestApp::spawn().await;
    let other = TestApp::spawn_on(app.url.clone(), |_| {}).await;
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for round in 0..PER_KEY {
        let intents = (0..KEYS)
            .map(|k| ordered(&format!("key-{k}"), &format!("{round}")))
            .chain([intent("unordered", "{}")])
            .collect();
        let results = app.enqueue(intents).await.unwrap();
        for (k, r) in results.iter().take(KEYS).enumerate() {
            expected
                .entry(format!("key-{k}"))
                .or_default()
                .push(r.id.clone());
        }
    }

    log_key_leases(&app).await;
    let delivered: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut claimers = Vec::new();
    for c in 0..8 {
        let server = if c % 2 == 0 {
            app.client()
        } else {
            other.client()
        };
        let delivered = delivered.clone();
        claimers.push(tokio::spawn(async move {
            let mut client = server;
            let mut idle = 0;
            while idle < 20 && Instant::now() < deadline {
                let leases = client
                    .claim(claim_request(&format!("w{c}"), 4))
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
                {
                    let mut delivered = delivered.lock().unwrap();
                    for lease in &leases {
                        let key = &lease.intent.as_ref().unwrap().ordering_key;
                        if !key.is_empty() {
                            delivered
                                .entry(key.clone())
                                .or_default()
                                .push(id_of(lease).to_owned());
                        }
                    }
                }
                let refs = leases.iter().map(crate::helpers::lease_ref).collect();
                client.ack(v1::AckRequest { leases: refs }).await.unwrap();
            }
        }));
    }
    for c in claimers {
        c.await.unwrap();
    }
    assert_eq!(*delivered.lock().unwrap(), expected);
    let (most, leases): (i64, i64) = sqlx::query_as(
        "SELECT coalesce(max(running), 0)::int8, count(*) FILTER (WHERE delta > 0)
         FROM (SELECT delta,
                      sum(delta) OVER (PARTITION BY ordering_key ORDER BY at, seq) AS running
               FROM public.key_lease_log) l",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        leases,
        (KEYS * PER_KEY) as i64,
        "every ordered intent leased once"
    );
    assert_eq!(most, 1, "two live leases of one key at once");
    other.stop().await;
}

/// Logs every ordered intent's change into or out of LEASED/SUBMITTED, per key, in the
/// database, at the time the statement made it (before its commit): a lease of a key taken
/// while another is live shows as a running count of 2.
async fn log_key_leases(app: &TestApp) {
    for statement in [
        "CREATE TABLE public.key_lease_log (
             seq bigint GENERATED ALWAYS AS IDENTITY, at timestamptz NOT NULL,
             ordering_key text NOT NULL, delta int NOT NULL)",
        "CREATE FUNCTION public.log_key_lease() RETURNS trigger LANGUAGE plpgsql
         SECURITY DEFINER SET search_path = pg_catalog AS $$
         DECLARE
             before int := CASE WHEN TG_OP <> 'INSERT' AND OLD.ordering_key IS NOT NULL
                                 AND OLD.state IN ('leased', 'submitted') THEN 1 ELSE 0 END;
             after int := CASE WHEN TG_OP <> 'DELETE' AND NEW.ordering_key IS NOT NULL
                                AND NEW.state IN ('leased', 'submitted') THEN 1 ELSE 0 END;
         BEGIN
             IF after <> before THEN
                 INSERT INTO public.key_lease_log (at, ordering_key, delta)
                 VALUES (clock_timestamp(),
                         CASE WHEN TG_OP = 'DELETE' THEN OLD.ordering_key
                              ELSE NEW.ordering_key END,
                         after - before);
             END IF;
             RETURN NULL;
         END $$",
        "CREATE TRIGGER log_key_lease AFTER INSERT OR UPDATE OR DELETE ON outbox.intent
             FOR EACH ROW EXECUTE FUNCTION public.log_key_lease()",
    ] {
        sqlx::query(statement).execute(&app.pool).await.unwrap();
    }
}

#[tokio::test]
async fn intents_of_a_key_are_listed_by_their_ordering_key() {
    let app = TestApp::spawn().await;
    let ids = app
        .enqueue_ids(vec![
            ordered("a", "1"),
            ordered("b", "1"),
            ordered("a", "2"),
        ])
        .await;
    let page = app
        .client()
        .list_intents(v1::ListIntentsRequest {
            ordering_key: "a".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let listed: Vec<&str> = page.intents.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(listed, [&ids[0], &ids[2]]);
    assert_eq!(page.intents[1].state(), IntentState::Waiting);
    assert_eq!(app.stat(IntentState::Waiting, None).await, 1);
}

/// An Ack moves delivered ordered intents out of the live table into the batch history,
/// with their keys: read back by id, by key, or by a replayed Ack, they are as before.
#[tokio::test]
async fn an_acked_ordered_intent_keeps_its_key_in_the_history() {
    let app = TestApp::spawn().await;
    let ids = app
        .enqueue_ids(vec![
            ordered("a", "1"),
            ordered("b", "1"),
            ordered("a", "2"),
            intent("plain", "1"),
        ])
        .await;
    let leases = app.claim_n("w", 10).await;
    let leased: Vec<&str> = leases.iter().map(id_of).collect();
    assert_eq!(leased, [&ids[0], &ids[1], &ids[3]]);
    let refs: Vec<&v1::Lease> = leases.iter().collect();
    for (pass, results) in [app.ack(&refs).await, app.ack(&refs).await]
        .iter()
        .enumerate()
    {
        assert_eq!(results.len(), 3, "pass {pass}: {results:?}");
        for result in results {
            assert_item_ok(result, IntentState::Delivered);
        }
    }
    let mut conn = PgConnection::connect(&app.url).await.unwrap();
    let live: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.intent WHERE id = ANY ($1::uuid[])")
            .bind(&leased)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(live, 0, "delivered intents left the live table");
    let first = app.intent(&ids[0]).await;
    assert_eq!(
        (
            first.state(),
            first.ordering_key.as_str(),
            first.payload.as_slice()
        ),
        (IntentState::Delivered, "a", b"1".as_slice())
    );
    assert_eq!(app.intent(&ids[3]).await.ordering_key, "");
    for (key, expected) in [("a", vec![&ids[0], &ids[2]]), ("b", vec![&ids[1]])] {
        let page = app
            .client()
            .list_intents(v1::ListIntentsRequest {
                ordering_key: key.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let listed: Vec<(&str, IntentState, &str)> = page
            .intents
            .iter()
            .map(|i| (i.id.as_str(), i.state(), i.ordering_key.as_str()))
            .collect();
        let states = [IntentState::Delivered, IntentState::Pending];
        let wanted: Vec<(&str, IntentState, &str)> = expected
            .iter()
            .zip(states)
            .map(|(id, state)| (id.as_str(), state, key))
            .collect();
        assert_eq!(listed, wanted);
    }
}

#[tokio::test]
async fn ordered_intents_are_refused_where_postgres_records_no_commit_times() {
    let (app, cluster) =
        app_on_own_cluster_with(vec![("track_commit_timestamp".into(), "off".into())]).await;
    let before = app.snapshot().await;
    let status = app
        .enqueue(vec![intent("x", "{}"), ordered("k", "1")])
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::FailedPrecondition,
        "ORDERING_UNAVAILABLE",
        &[],
    );
    assert!(status.message().contains("track_commit_timestamp"));
    assert_eq!(app.snapshot().await, before, "nothing was written");
    // Unordered intents are unaffected.
    app.enqueue(vec![intent("x", "{}")]).await.unwrap();
    stop_own_cluster(app, cluster).await;
}

#[tokio::test]
async fn a_producer_connection_sees_the_head_move_in_the_ack_that_delivered_it() {
    // The advance is part of the Ack's transaction: read from another session right
    // after the answer, the next intent is already PENDING.
    let app = TestApp::spawn().await;
    let ids = app
        .enqueue_ids(vec![ordered("k", "1"), ordered("k", "2")])
        .await;
    let lease = app.claim_n("w", 1).await;
    app.ack(&[&lease[0]]).await;
    let mut conn = PgConnection::connect(&app.url).await.unwrap();
    let state: String =
        sqlx::query_scalar("SELECT state::text FROM outbox.intent WHERE id = $1::uuid")
            .bind(&ids[1])
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(state, "pending");
}

/// `outboxd <args>` against `app` as an operator would run it.
pub(crate) async fn cli(app: &TestApp, key: &str, args: &[&str]) -> String {
    let server = format!("http://{}", app.addr);
    let args = [args, &["--server", &server, "--api-key", key]].concat();
    let output = crate::commands::outboxd(&args, &[]).await;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{args:?}: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test]
async fn the_cli_enqueues_with_an_ordering_key_and_shows_why_a_key_waits() {
    let app = TestApp::spawn().await;
    let key = app.key(&[TENANT], &["admin"], &[]).await;
    let mut ids = Vec::new();
    for payload in ["{\"n\":1}", "{\"n\":2}"] {
        let args = ["enqueue", "--kind", "order.event", "--payload", payload];
        let out = cli(
            &app,
            &key,
            &[&args[..], &["--ordering-key", "order-9", "--json"]].concat(),
        )
        .await;
        let results: serde_json::Value = serde_json::from_str(&out).unwrap();
        ids.push(results[0]["id"].as_str().unwrap().to_owned());
    }
    let leases = app.claim_n("w", 10).await;
    app.fail(&leases[0], FailOutcome::Permanent).await;

    let out = cli(&app, &key, &["intents", "key", "order-9"]).await;
    assert!(
        out.contains(&format!("first: {} DEAD_LETTERED: blocks the key", ids[0])),
        "{out}"
    );
    assert!(out.contains("1 waiting behind it"), "{out}");
    let out = cli(&app, &key, &["stats", "--json"]).await;
    let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(stats["blocked_keys"], 1, "{out}");

    // Given up, the first no longer holds the key: the second, dead-lettered in turn, does.
    app.reconcile(decide(&ids[0], Decision::Dead))
        .await
        .unwrap();
    let leases = app.claim_n("w", 10).await;
    app.fail(&leases[0], FailOutcome::Permanent).await;
    let out = cli(&app, &key, &["intents", "key", "order-9"]).await;
    assert!(
        out.contains(&format!("first: {} DEAD_LETTERED: blocks the key", ids[1])),
        "{out}"
    );
    assert!(out.contains("0 waiting behind it"), "{out}");
}

/// A first intent PENDING but not leased says why: not due yet, or its queue paused.
#[tokio::test]
async fn the_cli_says_when_a_keys_first_intent_is_not_due_or_its_queue_is_paused() {
    let app = TestApp::spawn().await;
    let key = app.key(&[TENANT], &["admin"], &[]).await;
    let delayed = v1::NewIntent {
        schedule: Some(v1::new_intent::Schedule::Delay(crate::helpers::duration(
            Duration::from_secs(600),
        ))),
        ..ordered("later", "1")
    };
    let later = app.enqueue_ids(vec![delayed, ordered("later", "2")]).await;
    let out = cli(&app, &key, &["intents", "key", "later"]).await;
    assert!(
        out.contains(&format!("first: {} PENDING: not due until ", later[0])),
        "{out}"
    );

    let paused = app
        .enqueue_ids(vec![ordered("paused", "1"), ordered("paused", "2")])
        .await;
    app.client()
        .set_queue_policy(v1::SetQueuePolicyRequest {
            kind: "order.event".to_owned(),
            paused: true,
            actor: "ops".to_owned(),
            reason: "provider down".to_owned(),
            ..Default::default()
        })
        .await
        .unwrap();
    let out = cli(&app, &key, &["intents", "key", "paused"]).await;
    assert!(
        out.contains(&format!(
            "first: {} PENDING: its queue \"order.event\" is paused",
            paused[0]
        )),
        "{out}"
    );
    assert!(out.contains("1 waiting behind it"), "{out}");
}

/// An ordering key is a tenant's: given a key of several tenants, `intents key` asks which
/// one when the key is used in more than one, and reads only that tenant's queue.
#[tokio::test]
async fn the_cli_asks_which_tenants_key_to_show_when_several_use_it() {
    let app = TestApp::spawn().await;
    let both = app.key(&[TENANT, "globex"], &["admin"], &[]).await;
    let acme = app
        .enqueue_ids(vec![ordered("shared", "1"), ordered("shared", "2")])
        .await;
    let mut globex = app.client_with(Some(&both), Some("globex")).await;
    globex
        .enqueue(v1::EnqueueRequest {
            intents: vec![ordered("shared", "1"), ordered("shared", "2")],
            txn_token: String::new(),
        })
        .await
        .unwrap();
    globex
        .set_queue_policy(v1::SetQueuePolicyRequest {
            kind: "order.event".to_owned(),
            paused: true,
            actor: "ops".to_owned(),
            reason: "globex's provider is down".to_owned(),
            ..Default::default()
        })
        .await
        .unwrap();

    let server = format!("http://{}", app.addr);
    let args = [
        "intents",
        "key",
        "shared",
        "--server",
        &server,
        "--api-key",
        &both,
    ];
    let output = crate::commands::outboxd(&args, &[]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("ordering key \"shared\" has intents in the tenants acme, globex: name one with --tenant"),
        "{stderr}"
    );

    let out = cli(
        &app,
        &both,
        &["intents", "key", "shared", "--tenant", TENANT],
    )
    .await;
    assert!(
        out.contains(&format!("first: {} PENDING: claimable", acme[0])),
        "globex's pause is not acme's: {out}"
    );
    let out = cli(
        &app,
        &both,
        &["intents", "key", "shared", "--tenant", "globex"],
    )
    .await;
    assert!(
        out.contains("PENDING: its queue \"order.event\" is paused"),
        "{out}"
    );
}

#[tokio::test]
async fn the_cli_names_a_keys_first_intent_behind_pages_of_waiting_ones() {
    let app = TestApp::spawn().await;
    let key = app.key(&[TENANT], &["admin"], &[]).await;
    let ids = three_behind_a_dead_lettered_head(&app, FailOutcome::Permanent).await;

    let out = cli(&app, &key, &["intents", "key", "k", "--limit", "1"]).await;
    let first = format!("first: {} DEAD_LETTERED: blocks the key", ids[0]);
    assert!(out.contains(&first), "{out}");
    assert!(out.contains("more than 1 waiting behind it"), "{out}");
    assert!(out.contains(&ids[1]) && !out.contains(&ids[2]), "{out}");
    let token = out
        .lines()
        .find_map(|l| l.strip_prefix("more: --page-token "))
        .unwrap_or_else(|| panic!("no page token: {out}"));

    let args = ["intents", "key", "k", "--limit", "1", "--page-token", token];
    let out = cli(&app, &key, &args).await;
    assert!(out.contains(&first), "{out}");
    assert!(
        out.contains("1 (after the page token) waiting behind it"),
        "{out}"
    );
    assert!(out.contains(&ids[2]) && !out.contains(&ids[1]), "{out}");
}

#[tokio::test]
async fn a_long_polling_claim_gets_the_next_intent_of_a_key_as_soon_as_its_head_is_acked() {
    let app = TestApp::spawn().await;
    let ids = app
        .enqueue_ids(vec![ordered("k", "1"), ordered("k", "2")])
        .await;
    let head = app.claim_n("w", 10).await;
    let mut waiting = claim_request("w2", 10);
    waiting.wait = Some(crate::helpers::duration(Duration::from_secs(60)));
    let mut client = app.client();
    let claim = tokio::spawn(async move { client.claim(waiting).await.unwrap().into_inner() });
    wait_until_claims_are_waiting(&app, 1, 1).await;
    app.ack(&[&head[0]]).await;
    let leases = woken(claim).await.leases;
    assert_eq!(leases.iter().map(id_of).collect::<Vec<_>>(), [&ids[1]]);
}

#[tokio::test]
async fn a_long_polling_claim_on_another_replica_gets_the_next_intent_when_the_head_is_acked() {
    let app = TestApp::spawn().await;
    let other = TestApp::spawn_on(app.url.clone(), |_| {}).await;
    let ids = app
        .enqueue_ids(vec![ordered("k", "1"), ordered("k", "2")])
        .await;
    let head = app.claim_n("w", 10).await;
    let mut waiting = claim_request("w2", 10);
    waiting.wait = Some(crate::helpers::duration(Duration::from_secs(60)));
    let mut client = other.client();
    let claim = tokio::spawn(async move { client.claim(waiting).await.unwrap().into_inner() });
    wait_until_claims_are_waiting(&other, 1, 2).await;
    // The Ack sends no NOTIFY of its own: its server announces the released intent.
    app.ack(&[&head[0]]).await;
    let leases = woken(claim).await.leases;
    assert_eq!(leases.iter().map(id_of).collect::<Vec<_>>(), [&ids[1]]);
}
