//! Long-polling Claim: woken by a committed enqueue, on the same server or on another
//! replica (through its NOTIFY; the test servers never re-check on a timer, so only the
//! wake-up can end the wait), and answering empty when the wait elapses. (On its own
//! server an enqueue may hand intents to a waiting claim instead, tested in `handoff`; the
//! tests of wake-ups on the same server turn that off.)

use std::time::{Duration, Instant};

use outboxd::proto::v1;

use crate::helpers::{TestApp, claim_request, delayed_intent, duration, failure, id_of};

#[tokio::test]
async fn a_waiting_claim_is_woken_by_an_enqueue() {
    let app = TestApp::spawn_with(waking_only).await;
    let mut request = claim_request("w", 10);
    request.wait = Some(duration(Duration::from_secs(60)));
    let mut client = app.client();
    let waiter = tokio::spawn(async move {
        let started = Instant::now();
        let leases = client.claim(request).await.unwrap().into_inner().leases;
        (leases, started.elapsed())
    });
    // Enqueue only once the claim is waiting: its connection is back in the pool and the
    // LISTEN connection is open.
    wait_until_claims_are_waiting(&app, 1, 1).await;
    let id = app.enqueue_one("job", "{}").await;
    let (leases, waited) = woken(waiter).await;
    assert_eq!(
        leases.len(),
        1,
        "woken with the new intent, not by the 60 s deadline"
    );
    assert_eq!(id_of(&leases[0]), id);
    eprintln!("long-poll woke after {waited:?} (includes the wait before the enqueue)");
}

#[tokio::test]
async fn a_waiting_claim_on_another_replica_is_woken_by_an_enqueue() {
    let producer_side = TestApp::spawn().await;
    let worker_side = TestApp::spawn_on(producer_side.url.clone(), |_| {}).await;
    let mut request = claim_request("w", 10);
    request.wait = Some(duration(Duration::from_secs(60)));
    let mut client = worker_side.client();
    let waiter = tokio::spawn(async move { client.claim(request).await });
    wait_until_claims_are_waiting(&worker_side, 1, 2).await;
    let id = producer_side.enqueue_one("job", "{}").await;
    let leases = woken(waiter).await.unwrap().into_inner().leases;
    assert_eq!(
        leases.len(),
        1,
        "woken by the other replica's announcement, not by the 60 s deadline"
    );
    assert_eq!(id_of(&leases[0]), id);
}

#[tokio::test]
async fn a_server_that_was_alone_wakes_a_replica_that_started_listening_since() {
    let producer_side = TestApp::spawn().await;
    // Alone: this enqueue's announcement finds no other listener, and is not sent.
    producer_side.enqueue_one("job", "{}").await;
    let worker_side = TestApp::spawn_on(producer_side.url.clone(), |_| {}).await;
    worker_side.claim_n("drain", 1).await;
    let mut request = claim_request("w", 10);
    request.wait = Some(duration(Duration::from_secs(60)));
    let mut client = worker_side.client();
    let mut waiter = tokio::spawn(async move { client.claim(request).await });
    wait_until_claims_are_waiting(&worker_side, 1, 2).await;
    // The producer's server trusts its last look at who listens for a second; enqueue
    // until it looks again and finds the new replica (each enqueue asks it to announce).
    let deadline = Instant::now() + Duration::from_secs(30);
    let leases = loop {
        producer_side.enqueue_one("job", "{}").await;
        match tokio::time::timeout(Duration::from_millis(100), &mut waiter).await {
            Ok(answer) => break answer.unwrap().unwrap().into_inner().leases,
            Err(_) => assert!(
                Instant::now() < deadline,
                "the new replica's claim was never woken"
            ),
        }
    };
    assert!(!leases.is_empty());
}

#[tokio::test]
async fn a_burst_reaches_every_waiting_claimer_it_needs_one_passing_the_turn_to_the_next() {
    let app = TestApp::spawn_with(waking_only).await;
    let waiters: Vec<_> = (0..3)
        .map(|i| {
            let mut request = claim_request(&format!("w{i}"), 1);
            request.wait = Some(duration(Duration::from_secs(60)));
            let mut client = app.client();
            tokio::spawn(async move { client.claim(request).await.unwrap().into_inner().leases })
        })
        .collect();
    wait_until_claims_are_waiting(&app, 3, 1).await;
    let mut enqueued = app.enqueue_n("job", 3).await;
    let mut claimed = Vec::new();
    for waiter in waiters {
        let leases = woken(waiter).await;
        assert_eq!(leases.len(), 1, "each claimer woken with one intent");
        claimed.push(id_of(&leases[0]).to_owned());
    }
    claimed.sort();
    enqueued.sort();
    assert_eq!(claimed, enqueued);
}

#[tokio::test]
async fn claimers_with_other_filters_are_not_left_waiting_by_one_that_found_nothing() {
    let app = TestApp::spawn_with(waking_only).await;
    let waiter = |kind: &str| {
        let mut request = claim_request(kind, 10);
        request.kinds = vec![kind.to_owned()];
        request.wait = Some(duration(Duration::from_secs(60)));
        let mut client = app.client();
        tokio::spawn(async move { client.claim(request).await.unwrap().into_inner().leases })
    };
    let (emails, sms) = (waiter("email"), waiter("sms"));
    wait_until_claims_are_waiting(&app, 2, 1).await;
    let text = app.enqueue_one("sms", "{}").await;
    let leases = woken(sms).await;
    assert_eq!(leases.len(), 1);
    assert_eq!(id_of(&leases[0]), text);
    assert!(
        !emails.is_finished(),
        "the email claimer had nothing to take"
    );
    let mail = app.enqueue_one("email", "{}").await;
    let leases = woken(emails).await;
    assert_eq!(leases.len(), 1);
    assert_eq!(id_of(&leases[0]), mail);
}

#[tokio::test]
async fn a_waiting_claim_looks_again_when_the_next_delayed_intent_falls_due() {
    let app = TestApp::spawn().await;
    let delayed = delayed_intent("reminder", Duration::from_millis(200));
    let id = app.enqueue(vec![delayed]).await.unwrap()[0].id.clone();
    let mut request = claim_request("w", 10);
    request.wait = Some(duration(Duration::from_secs(60)));
    let mut client = app.client();
    let waiter = tokio::spawn(async move { client.claim(request).await });
    // The first look found it not yet due (test time stands still); by the look its due
    // time brings, it is. Nothing else wakes the claim: no enqueue, no timed re-check.
    wait_until_claims_are_waiting(&app, 1, 1).await;
    app.advance(Duration::from_secs(1));
    let leases = woken(waiter).await.unwrap().into_inner().leases;
    assert_eq!(
        leases.len(),
        1,
        "woken at the intent's due time, not by the 60 s deadline"
    );
    assert_eq!(id_of(&leases[0]), id);
}

// The first claim leases what is due and leaves its group having drained the queue, with a
// delayed intent due in 200 ms; the next claim of the group may begin by waiting, without a
// look of its own (`outbox::claim::drained`), but only until that due time: not until its recheck
// (an hour in tests) nor its 60 s deadline.
#[tokio::test]
async fn a_claim_after_one_that_drained_the_queue_still_wakes_when_a_delayed_intent_falls_due() {
    let app = TestApp::spawn().await;
    let due_now = app.enqueue_one("reminder", "{}").await;
    let delayed = delayed_intent("reminder", Duration::from_millis(200));
    let later = app.enqueue(vec![delayed]).await.unwrap()[0].id.clone();
    let mut request = claim_request("w", 10);
    request.wait = Some(duration(Duration::from_secs(60)));
    let first = app.claim(request.clone()).await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(id_of(&first[0]), due_now);

    let mut client = app.client();
    let waiter = tokio::spawn(async move { client.claim(request).await });
    wait_until_claims_are_waiting(&app, 1, 1).await;
    app.advance(Duration::from_secs(1));
    let leases = woken(waiter).await.unwrap().into_inner().leases;
    assert_eq!(leases.len(), 1, "woken at the intent's due time");
    assert_eq!(id_of(&leases[0]), later);
}

// A replayed Claim answers its first attempt's leases, whatever it asks for now: fewer than
// it asks, which a look would take to mean that the group drained the queue. It looked at
// nothing, so the group's next long poll must still look, and find what is pending.
#[tokio::test]
async fn a_replayed_claim_does_not_leave_its_group_waiting_as_if_the_queue_were_drained() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 4).await;
    let mut first = claim_request("w", 2);
    first.request_id = "req-1".into();
    assert_eq!(app.claim(first.clone()).await.unwrap().len(), 2);
    let mut replay = first;
    replay.max_intents = 10;
    assert_eq!(app.claim(replay).await.unwrap().len(), 2);

    let mut poll = claim_request("w2", 10);
    poll.wait = Some(duration(Duration::from_secs(60)));
    let mut client = app.client();
    let waiter = tokio::spawn(async move { client.claim(poll).await });
    let leases = woken(waiter).await.unwrap().into_inner().leases;
    assert_eq!(leases.len(), 2, "the two still pending");
}

// A Fail that retries makes its intent claimable again (here at once): a waiting claim of
// the group is woken for it, as for an enqueue, instead of finding it at its recheck.
#[tokio::test]
async fn a_retried_intent_wakes_a_waiting_claim() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_one("charge", "{}").await;
    let lease = app.claim_n("first-worker", 10).await.remove(0);
    let mut request = claim_request("second-worker", 10);
    request.wait = Some(duration(Duration::from_secs(60)));
    let mut client = app.client();
    let waiter = tokio::spawn(async move { client.claim(request).await });
    wait_until_claims_are_waiting(&app, 1, 1).await;

    let mut retry = failure(&lease, v1::FailOutcome::Retry);
    retry.retry_after = Some(duration(Duration::ZERO));
    assert_eq!(app.fail_with(retry).await.state(), v1::IntentState::Pending);
    let leases = woken(waiter).await.unwrap().into_inner().leases;
    assert_eq!(leases.len(), 1, "woken by the retry");
    assert_eq!(id_of(&leases[0]), id);
    assert_eq!(leases[0].attempt, 2);
}

#[tokio::test]
async fn a_waiting_claim_answers_empty_when_the_wait_elapses() {
    let app = TestApp::spawn().await;
    let mut request = claim_request("w", 10);
    request.wait = Some(duration(Duration::from_millis(200)));
    let started = Instant::now();
    let leases = app.claim(request).await.unwrap();
    assert!(leases.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(200));
}

#[tokio::test]
async fn a_long_poll_answers_before_the_deadline_its_caller_set() {
    let app = TestApp::spawn().await;
    let mut request = tonic::Request::new(claim_request("w", 10));
    request.get_mut().wait = Some(duration(Duration::from_secs(60)));
    request.set_timeout(Duration::from_millis(500)); // the grpc-timeout header
    let answer = app.client().claim(request).await;
    assert!(
        answer
            .expect("answered, not cut off by the deadline")
            .into_inner()
            .leases
            .is_empty()
    );
}

#[tokio::test]
async fn stopping_the_server_answers_waiting_claims() {
    let app = TestApp::spawn().await;
    let mut request = claim_request("w", 10);
    request.wait = Some(duration(Duration::from_secs(60)));
    let mut client = app.client();
    let waiter = tokio::spawn(async move { client.claim(request).await });
    wait_until_claims_are_waiting(&app, 1, 1).await;
    app.stop().await;
    let leases = waiter.await.unwrap().unwrap().into_inner().leases;
    assert!(leases.is_empty());
}

#[tokio::test]
async fn a_long_poll_woken_by_shutdown_answers_without_leasing_more() {
    let app = TestApp::spawn().await;
    let pool = app.pool.clone();
    let mut request = claim_request("w", 10);
    request.wait = Some(duration(Duration::from_secs(60)));
    let mut client = app.client();
    let waiter = tokio::spawn(async move { client.claim(request).await });
    wait_until_claims_are_waiting(&app, 1, 1).await;
    // Claimable, but behind the server's back: nothing announces it.
    let id = app.insert_by_sql("job").await;
    app.stop().await;
    let leases = waiter.await.unwrap().unwrap().into_inner().leases;
    assert!(leases.is_empty(), "leased while shutting down: {leases:?}");
    let (state, attempts): (String, i32) =
        sqlx::query_as("SELECT state::text, attempts FROM outbox.intent WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), attempts), ("pending", 0));
}

#[tokio::test]
async fn a_listen_connection_that_stops_delivering_is_replaced() {
    let app = TestApp::spawn_tuned(|r| r.listener_probe_every = Duration::from_millis(100)).await;
    let frozen = listen_backends(&app).await[0];
    // Its TCP connection stays open, but nothing comes out of it any more: a connection a
    // network dropped without a reset.
    let thawed_at_the_end = Frozen::new(frozen);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !listen_backends(&app).await.iter().any(|pid| *pid != frozen) {
        assert!(
            Instant::now() < deadline,
            "still waiting on the frozen connection"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Once it can run again, the old session must stop counting as a listener.
    drop(thawed_at_the_end);
    loop {
        let holds_listener_lock: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' \
                            AND classid = x'6f75'::int::oid AND objid = x'74626f78'::bigint::oid)",
        )
        .bind(frozen)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        if !holds_listener_lock {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the old session still holds the listener lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The backends of `app`'s database listening, idle (not still starting to), waits for one.
async fn listen_backends(app: &TestApp) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity \
             WHERE datname = current_database() AND query ILIKE 'LISTEN%' AND state = 'idle' \
             ORDER BY pid",
        )
        .fetch_all(&app.pool)
        .await
        .unwrap();
        if !pids.is_empty() {
            return pids;
        }
        assert!(Instant::now() < deadline, "the server never listened");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A PostgreSQL backend stopped (SIGSTOP) until this is dropped.
struct Frozen(i32);

impl Frozen {
    fn new(pid: i32) -> Self {
        let command = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        assert!(
            command.starts_with("postgres"),
            "backend {pid} is not a process of this machine: this test stops one, so it needs \
             the embedded cluster (or OUTBOX_TEST_DATABASE_URL on this machine)"
        );
        assert!(signal("-STOP", pid), "kill -STOP {pid}");
        Self(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // Not an assert: this may run while a failed test unwinds.
        if !signal("-CONT", self.0) {
            eprintln!("cannot resume backend {}", self.0);
        }
    }
}

fn signal(which: &str, pid: i32) -> bool {
    std::process::Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// A server whose enqueues only wake waiting claims, never hand them intents.
fn waking_only(settings: &mut outboxd::config::Settings) {
    settings.claim.hand_off = false;
}

/// The answer of a claim that waits up to 60 s, which must come well before then: at its
/// deadline a claim looks once more and would find the intent too, so only an answer
/// within half the wait shows that something woke it.
pub(crate) async fn woken<T>(waiter: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the claim was not woken: it would have answered only at its 60 s deadline")
        .unwrap()
}

/// Waits (with a deadline) until `app`'s server has `claims` claims long-polling (each
/// looked once, found nothing, and now waits) and each of the `servers` on its database
/// holds a LISTEN connection. Both, or a test passes without the wake-up it means to show:
/// a claim whose first look comes after the enqueue finds the intent anyway, and a server
/// whose own LISTEN comes up late wakes its claimers when it does.
pub(crate) async fn wait_until_claims_are_waiting(app: &TestApp, claims: i64, servers: i64) {
    app.wait_for_metric(&format!("outbox_claims_waiting {claims}"))
        .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap();
        if listening >= servers {
            return;
        }
        assert!(Instant::now() < deadline, "the servers never all listened");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
