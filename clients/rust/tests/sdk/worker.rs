//! The worker loop against real replicas: delivery under concurrency, heartbeats,
//! MarkSubmitted, outcomes, per-item settle results, replays and the drain.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outboxd_client::{
    CallOptions, Failure, IntentState, Job, LeaseCall, NewIntent, Outbox, Worker, proto,
};
use sqlx::Connection as _;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::harness::{connect, connection, intent, kind, stack, state, wait_for, wait_state};
use crate::observer::{Observed, Recorder};
use crate::proxy::{Cuts, Proxy};
use crate::{Gate, Running, enqueue, list};

type Seen = Arc<Mutex<HashMap<String, u32>>>;

fn count(seen: &Seen, id: &str) {
    *seen.lock().unwrap().entry(id.to_owned()).or_default() += 1;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_handle_1500_intents_exactly_once_across_two_replicas() {
    let stack = stack();
    let k = kind("drain");
    let (a, b) = (stack.endpoints[0].clone(), stack.endpoints[1].clone());
    // Half enqueued through each replica; each worker prefers a different one.
    let mut ids = enqueue(&Outbox::new(connect(std::slice::from_ref(&a))), &k, 750, 0).await;
    ids.extend(enqueue(&Outbox::new(connect(std::slice::from_ref(&b))), &k, 750, 0).await);
    let seen: Seen = Arc::default();
    let tenants: Seen = Arc::default();
    let workers: Vec<Running> = [vec![a.clone(), b.clone()], vec![b, a]]
        .into_iter()
        .map(|endpoints| {
            let (seen, tenants) = (seen.clone(), tenants.clone());
            let worker = Worker::builder(connect(&endpoints))
                .concurrency(8)
                .handler(&k, move |job: Job| {
                    let (seen, tenants) = (seen.clone(), tenants.clone());
                    async move {
                        count(&seen, job.id());
                        count(&tenants, job.tenant());
                        Ok::<_, Failure>(())
                    }
                })
                .build()
                .unwrap();
            Running::start(worker)
        })
        .collect();
    wait_for("1500 acks", Duration::from_secs(120), || {
        (workers.iter().map(|w| w.worker.stats().acked).sum::<u64>() >= 1500).then_some(())
    })
    .await;
    let stats: Vec<_> = workers.iter().map(|w| w.worker.stats()).collect();
    for worker in workers {
        worker.stop().await.unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1500);
    assert!(
        ids.iter().all(|id| seen.get(id) == Some(&1)),
        "an intent was handled twice or never"
    );
    let tenants: Vec<String> = tenants.lock().unwrap().keys().cloned().collect();
    assert_eq!(tenants, ["default"], "the key's tenant");
    assert_eq!(
        stats.iter().map(|s| s.claimed).sum::<u64>(),
        1500,
        "{stats:?}"
    );
    assert!(stats.iter().all(|s| s.claimed > 0), "{stats:?}");
    assert!(
        stats.iter().all(|s| s.lease_lost + s.settle_errors == 0),
        "{stats:?}"
    );
    let intents = list(&connection(), &k).await;
    assert_eq!(intents.len(), 1500);
    assert!(
        intents
            .iter()
            .all(|i| i.state() == IntentState::Delivered && i.attempts == 1)
    );
}

/// A long poll answers as it leases: a short lease that arrives at the end of a long wait
/// is still the worker's, not counted from a second before the answer (a 1 s lease was
/// then lost on arrival, its handler never run, again at every claim).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lease_answered_after_a_long_poll_runs_its_handler() {
    let stack = stack();
    let connection = connection();
    let k = kind("short");
    let worker = Worker::builder(connect(&stack.endpoints[..1]))
        .concurrency(1)
        .lease(Duration::from_secs(1))
        .claim_wait(Duration::from_secs(5))
        .handler(&k, |_job: Job| async { Ok::<_, Failure>(()) })
        .build()
        .unwrap();
    let worker = Running::start(worker);
    // Due 1.5 s from now: the worker's Claim, already waiting, is answered then.
    let intent = NewIntent::new(&k, "{}").delay(Duration::from_millis(1500));
    let id = Outbox::new(connection.clone())
        .enqueue_direct(intent)
        .await
        .unwrap()
        .id;
    let delivered = wait_state(&connection, &id, IntentState::Delivered).await;
    let stats = worker.worker.stats();
    worker.stop().await.unwrap();
    assert_eq!(delivered.attempts, 1);
    assert_eq!(stats.lease_lost, 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_a_lease_alive_for_three_times_its_duration() {
    let stack = stack();
    let connection = connection();
    let k = kind("slow");
    let [id]: [String; 1] = enqueue(&Outbox::new(connection.clone()), &k, 1, 0)
        .await
        .try_into()
        .unwrap();
    let lease = Duration::from_secs(2);
    let started = Arc::new(Notify::new());
    let calls = Arc::new(AtomicU32::new(0));
    let slow = Worker::builder(connect(&stack.endpoints[..1]))
        .concurrency(1)
        .lease(lease)
        .handler(&k, {
            let (started, calls) = (started.clone(), calls.clone());
            move |job: Job| {
                let (started, calls) = (started.clone(), calls.clone());
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    started.notify_one();
                    // The work itself: three lease durations.
                    tokio::time::sleep(lease * 3).await;
                    assert!(!job.lease_lost());
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    // A rival on the other replica would get the intent if the lease ever expired.
    let rival_calls = Arc::new(AtomicU32::new(0));
    let rival = Worker::builder(connect(&stack.endpoints[1..]))
        .concurrency(1)
        .lease(lease)
        .claim_wait(Duration::from_secs(1))
        .handler(&k, {
            let rival_calls = rival_calls.clone();
            move |_job: Job| {
                rival_calls.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, Failure>(()) }
            }
        })
        .build()
        .unwrap();
    let slow = Running::start(slow);
    started.notified().await;
    let rival = Running::start(rival);
    wait_for("the slow handler acked", Duration::from_secs(30), || {
        (slow.worker.stats().acked == 1).then_some(())
    })
    .await;
    let stats = slow.worker.stats();
    rival.stop().await.unwrap();
    slow.stop().await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(rival_calls.load(Ordering::SeqCst), 0);
    assert_eq!(
        (stats.heartbeat_failures, stats.lease_lost),
        (0, 0),
        "{stats:?}"
    );
    let delivered = wait_state(&connection, &id, IntentState::Delivered).await;
    assert_eq!(delivered.attempts, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_dies_after_mark_submitted_leaves_its_intent_to_an_operator() {
    let connection = connection();
    let k = kind("payment");
    let [id]: [String; 1] = enqueue(&Outbox::new(connection.clone()), &k, 1, 0)
        .await
        .try_into()
        .unwrap();
    let submitted = Arc::new(Notify::new());
    let worker = Worker::builder(connection.clone())
        .concurrency(1)
        .lease(Duration::from_secs(1))
        .handler(&k, {
            let submitted = submitted.clone();
            move |job: Job| {
                let submitted = submitted.clone();
                async move {
                    job.submitting().await?;
                    assert!(job.is_submitted());
                    submitted.notify_one();
                    // The external call hangs; the worker dies before it returns.
                    std::future::pending::<()>().await;
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    submitted.notified().await;
    assert_eq!(state(&connection, &id).await, IntentState::Submitted);
    running.crash().await;
    // Its lease expires; never handed to another worker without an operator.
    let intent = wait_state(&connection, &id, IntentState::NeedsReconcile).await;
    assert_eq!(intent.attempts, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_results_map_to_ack_retry_dead_letter_and_reconcile() {
    let connection = connection();
    let outbox = Outbox::new(connection.clone());
    let names = [
        "ok",
        "retry",
        "error",
        "panic",
        "permanent",
        "unknown",
        "submit_error",
        "exhausted",
        "orphan",
    ];
    let kinds: HashMap<&str, String> = names.iter().map(|n| (*n, kind(n))).collect();
    let mut ids = HashMap::new();
    for name in names {
        let intent = NewIntent::new(&kinds[name], "{}");
        let intent = if name == "exhausted" {
            intent.max_attempts(2)
        } else {
            intent
        };
        ids.insert(name, outbox.enqueue_direct(intent).await.unwrap().id);
    }
    let attempts: Seen = Arc::default();
    let handler = |name: &'static str| {
        let attempts = attempts.clone();
        move |job: Job| {
            let attempts = attempts.clone();
            async move {
                count(&attempts, name);
                let first = job.attempt() == 1;
                match name {
                    "retry" if first => {
                        Err(Failure::retry("not yet").after(Duration::from_millis(100)))
                    }
                    "error" if first => Err(Failure::from(std::io::Error::other("flaky"))),
                    "panic" if first => panic!("handler bug"),
                    "permanent" => Err(Failure::permanent("bad address")),
                    "unknown" => Err(Failure::unknown("the PSP did not say")),
                    "submit_error" => {
                        job.submitting().await?;
                        Err(std::io::Error::other("PSP timed out").into())
                    }
                    "exhausted" => {
                        Err(Failure::retry("still down").after(Duration::from_millis(50)))
                    }
                    _ => Ok(()),
                }
            }
        }
    };
    // The orphan kind is claimed (kinds lists it) but has no handler.
    let mut builder = Worker::builder(connection.clone())
        .concurrency(4)
        .kinds(kinds.values().cloned());
    for name in names.iter().filter(|n| **n != "orphan") {
        builder = builder.handler(&kinds[name], handler(name));
    }
    let running = Running::start(builder.build().unwrap());
    for name in ["ok", "retry", "error", "panic"] {
        wait_state(&connection, &ids[name], IntentState::Delivered).await;
    }
    let permanent = wait_state(&connection, &ids["permanent"], IntentState::DeadLettered).await;
    assert!(
        permanent.last_error.contains("bad address"),
        "{}",
        permanent.last_error
    );
    let unknown = wait_state(&connection, &ids["unknown"], IntentState::NeedsReconcile).await;
    assert!(
        unknown.last_error.contains("did not say"),
        "{}",
        unknown.last_error
    );
    let submit = wait_state(
        &connection,
        &ids["submit_error"],
        IntentState::NeedsReconcile,
    )
    .await;
    assert!(
        submit.last_error.contains("PSP timed out"),
        "{}",
        submit.last_error
    );
    let exhausted = wait_state(&connection, &ids["exhausted"], IntentState::DeadLettered).await;
    assert_eq!(exhausted.attempts, 2);
    let orphan = wait_state(&connection, &ids["orphan"], IntentState::DeadLettered).await;
    assert!(
        orphan.last_error.contains("no handler for kind"),
        "{}",
        orphan.last_error
    );
    let stats = running.worker.stats();
    running.stop().await.unwrap();
    let attempts = attempts.lock().unwrap().clone();
    let expected: HashMap<String, u32> = [
        ("ok", 1),
        ("retry", 2),
        ("error", 2),
        ("panic", 2),
        ("permanent", 1),
        ("unknown", 1),
        ("submit_error", 1),
        ("exhausted", 2),
    ]
    .into_iter()
    .map(|(n, c)| (n.to_owned(), c))
    .collect();
    assert_eq!(attempts, expected);
    // Acks: ok, retry, error, panic. Fails: retry, error, panic, permanent, unknown,
    // submit_error, exhausted ×2, orphan.
    assert_eq!((stats.acked, stats.failed), (4, 9), "{stats:?}");
    assert_eq!(stats.settle_errors, 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_with_a_newline_and_a_tab_is_failed_at_once_with_spaces_in_their_place() {
    let connection = connection();
    let outbox = Outbox::new(connection.clone());
    let k = kind("multiline");
    let mut ids = Vec::new();
    for payload in ["short", "long"] {
        let intent = NewIntent::new(&k, payload);
        ids.push(outbox.enqueue_direct(intent).await.unwrap().id);
    }
    let [short, long] = <[String; 2]>::try_from(ids).unwrap();
    // Leases far longer than `wait_state`'s 30 s: a refused Fail would leave the intents
    // LEASED until then, so reaching PENDING proves the Fail itself was accepted.
    let worker = Worker::builder(connection.clone())
        .concurrency(2)
        .lease(Duration::from_secs(120))
        .handler(&k, |job: Job| async move {
            let message = if job.payload() == b"long" {
                // Over the server's 4096 characters, two bytes each.
                format!("{}\n", "é".repeat(5000))
            } else {
                "charge failed:\n\tcard declined\r\n".to_owned()
            };
            // Retried much later: the intents stay PENDING while the test looks.
            Err(Failure::from(std::io::Error::other(message)).after(Duration::from_secs(600)))
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    let mut failed = Vec::new();
    for id in [&short, &long] {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let intent = intent(&connection, id).await;
            // PENDING before the claim too: the attempt tells the failed one apart.
            if intent.state() == IntentState::Pending && intent.attempts == 1 {
                failed.push(intent);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{id}'s Fail not applied after 30 s: {intent:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let stats = running.worker.stats();
    running.stop().await.unwrap();
    assert_eq!(failed[0].last_error, "charge failed:  card declined  ");
    assert_eq!(failed[1].last_error, "é".repeat(4096));
    assert_eq!((stats.failed, stats.settle_errors), (2, 0), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_item_of_a_batched_ack_does_not_fail_its_neighbours() {
    let connection = connection();
    let k = kind("batch");
    let ids = enqueue(&Outbox::new(connection.clone()), &k, 2, 0).await;
    let victim = ids[0].clone();
    let both = Arc::new(tokio::sync::Barrier::new(3));
    // A long settle delay: both Acks share one call.
    let worker = Worker::builder(connection.clone())
        .concurrency(2)
        .settle_delay(Duration::from_millis(300))
        .handler(&k, {
            let (both, connection, first) = (both.clone(), connection.clone(), ids.clone());
            move |job: Job| {
                let (both, connection) = (both.clone(), connection.clone());
                let is_victim = job.id() == first[0];
                let is_first = first.iter().any(|id| id == job.id());
                async move {
                    if is_victim {
                        // Someone else settles this lease first (as after a rescue).
                        let request = proto::FailRequest {
                            failures: vec![proto::Failure {
                                lease: Some(proto::LeaseRef {
                                    intent_id: job.id().to_owned(),
                                    lease_id: job.lease_id().to_owned(),
                                }),
                                error: "settled elsewhere".into(),
                                outcome: proto::FailOutcome::Permanent as i32,
                                retry_after: None,
                            }],
                        };
                        connection
                            .call(CallOptions::new(Duration::from_secs(5)), |mut client| {
                                let request = request.clone();
                                async move { client.fail(request).await }
                            })
                            .await
                            .unwrap();
                    }
                    if is_first {
                        both.wait().await;
                    }
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    both.wait().await;
    wait_for("both settled", Duration::from_secs(15), || {
        let s = running.worker.stats();
        (s.acked + s.lease_lost + s.settle_errors == 2).then_some(())
    })
    .await;
    let stats = running.worker.stats();
    // Still working: a later intent is handled.
    let [later]: [String; 1] = enqueue(&Outbox::new(connection.clone()), &k, 1, 0)
        .await
        .try_into()
        .unwrap();
    wait_state(&connection, &later, IntentState::Delivered).await;
    running.stop().await.unwrap();
    assert_eq!(stats.acked, 1, "{stats:?}");
    assert_eq!(stats.lease_lost + stats.settle_errors, 1, "{stats:?}");
    assert_eq!(state(&connection, &victim).await, IntentState::DeadLettered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_answer_is_replayed_with_its_request_id_and_strands_no_lease() {
    let stack = stack();
    let connection = connection();
    let k = kind("lost");
    // Claim answers of 5 KiB payloads are the only large server→client chunks: the proxies
    // drop the first one and reset the connection, after the server committed its leases.
    let ids = enqueue(&Outbox::new(connection.clone()), &k, 5, 5000).await;
    let cuts = Cuts::new(1, 4000);
    let pa = Proxy::start(&stack.endpoints[0], cuts.clone()).await;
    let pb = Proxy::start(&stack.endpoints[1], cuts.clone()).await;
    let seen: Seen = Arc::default();
    let worker = Worker::builder(connect(&[pa.addr.clone(), pb.addr.clone()]))
        .concurrency(8)
        .lease(Duration::from_secs(30))
        .handler(&k, {
            let seen = seen.clone();
            move |job: Job| {
                count(&seen, job.id());
                async { Ok::<_, Failure>(()) }
            }
        })
        .build()
        .unwrap();
    let started = Instant::now();
    let running = Running::start(worker);
    wait_for("5 acks", Duration::from_secs(20), || {
        (running.worker.stats().acked == 5).then_some(())
    })
    .await;
    let took = started.elapsed();
    let stats = running.worker.stats();
    running.stop().await.unwrap();
    assert_eq!(cuts.done(), 1);
    assert!(stats.claim_retries >= 1, "{stats:?}");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, ids.iter().map(|id| (id.clone(), 1)).collect());
    // Not rescued after 30 s of lease (that would be attempt 2): the replay returned them.
    assert!(took < Duration::from_secs(20));
    assert!(list(&connection, &k).await.iter().all(|i| i.attempts == 1));
}

/// Runs `worker` until it acked one intent, then stops it; its stats.
async fn until_one_ack(worker: Worker) -> outboxd_client::WorkerStats {
    let running = Running::start(worker);
    wait_for("an ack", Duration::from_secs(30), || {
        (running.worker.stats().acked == 1).then_some(())
    })
    .await;
    let stats = running.worker.stats();
    running.stop().await.unwrap();
    stats
}

/// `id` was handled once, the only one `seen`, and delivered at its first attempt.
async fn delivered_once_at_first_attempt(seen: &Seen, id: &str) {
    assert_eq!(*seen.lock().unwrap(), HashMap::from([(id.to_owned(), 1)]));
    let delivered = intent(&connection(), id).await;
    assert_eq!(
        (delivered.state(), delivered.attempts),
        (IntentState::Delivered, 1)
    );
}

/// A Claim whose first try spent its whole budget on a frozen replica, longer than a lease,
/// is retried on the next: the leases that retry takes are fresh, renewed before their
/// handlers start, not dropped as expired since the first send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_retried_after_a_frozen_try_runs_the_leases_its_retry_took() {
    let stack = stack();
    let k = kind("retried");
    let ids = enqueue(&Outbox::new(connection()), &k, 1, 0).await;
    let frozen = Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await;
    frozen.freeze(true);
    let endpoints = [frozen.addr.clone(), stack.endpoints[1].clone()];
    let connection = outboxd_client::Connection::builder(endpoints)
        .api_key(&stack.api_key)
        .call_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let seen: Seen = Arc::default();
    let worker = Worker::builder(connection)
        .lease(Duration::from_secs(1))
        .claim_wait(Duration::from_secs(1))
        .handler(&k, {
            let seen = seen.clone();
            move |job: Job| {
                count(&seen, job.id());
                async { Ok::<_, Failure>(()) }
            }
        })
        .build()
        .unwrap();
    let stats = until_one_ack(worker).await;
    assert!(stats.claim_retries >= 1, "{stats:?}");
    assert_eq!(stats.lease_lost, 0, "{stats:?}");
    delivered_once_at_first_attempt(&seen, &ids[0]).await;
}

/// A replica that froze while a handler ran: its Ack tries there for a fraction of the
/// lease, then goes to the next endpoint while the lease lives; never run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_to_a_replica_that_froze_goes_to_the_next_within_a_short_lease() {
    let stack = stack();
    let k = kind("ack-frozen");
    let ids = enqueue(&Outbox::new(connection()), &k, 1, 0).await;
    let proxy = Arc::new(Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await);
    let seen: Seen = Arc::default();
    let worker = Worker::builder(connect(&[proxy.addr.clone(), stack.endpoints[1].clone()]))
        .lease(Duration::from_secs(3))
        .claim_wait(Duration::from_secs(1))
        .handler(&k, {
            let (seen, proxy) = (seen.clone(), proxy.clone());
            move |job: Job| {
                count(&seen, job.id());
                proxy.freeze(true);
                async { Ok::<_, Failure>(()) }
            }
        })
        .build()
        .unwrap();
    let stats = until_one_ack(worker).await;
    assert_eq!((stats.lease_lost, stats.settle_errors), (0, 0), "{stats:?}");
    delivered_once_at_first_attempt(&seen, &ids[0]).await;
}

/// Heartbeats of a long handler whose replica froze, with another that never answers next
/// in line: each round tries the endpoints in turn within its interval, and the lease lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_pass_two_endpoints_that_never_answer_within_one_round() {
    let stack = stack();
    let k = kind("hb-frozen");
    let ids = enqueue(&Outbox::new(connection()), &k, 1, 0).await;
    let first = Arc::new(Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await);
    let hung = Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await;
    hung.freeze(true);
    let endpoints = [
        first.addr.clone(),
        hung.addr.clone(),
        stack.endpoints[1].clone(),
    ];
    let seen: Seen = Arc::default();
    let worker = Worker::builder(connect(&endpoints))
        .lease(Duration::from_secs(3))
        .claim_wait(Duration::from_secs(1))
        .handler(&k, {
            let (seen, first) = (seen.clone(), first.clone());
            move |job: Job| {
                count(&seen, job.id());
                first.freeze(true);
                async {
                    // Past the lease: only heartbeats keep it.
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    let stats = until_one_ack(worker).await;
    assert_eq!(stats.lease_lost, 0, "{stats:?}");
    delivered_once_at_first_attempt(&seen, &ids[0]).await;
}

/// A Claim answer held on its way back past its lease: the intent may have been rescued and
/// leased to another worker meanwhile, so the late answer's lease is renewed before its
/// handler starts, or dropped; never run beside the other worker's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answer_held_past_its_lease_is_not_run_beside_a_rescue() {
    let stack = stack();
    let k = kind("held");
    let ids = enqueue(&Outbox::new(connection()), &k, 1, 0).await;
    let slow = Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await;
    slow.delay_answers(Duration::from_secs(4));
    let runs = Arc::new(AtomicU32::new(0));
    let build = |endpoint: String| {
        let runs = runs.clone();
        Worker::builder(connect(&[endpoint]))
            .lease(Duration::from_secs(2))
            .claim_wait(Duration::from_secs(1))
            .handler(&k, move |_job: Job| {
                runs.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, Failure>(()) }
            })
            .build()
            .unwrap()
    };
    let late = Running::start(build(slow.addr.clone()));
    let direct = connection();
    wait_state(&direct, &ids[0], IntentState::Leased).await;
    // Takes the intent once its lease expired and it was rescued.
    let other = Running::start(build(stack.endpoints[1].clone()));
    wait_state(&direct, &ids[0], IntentState::Delivered).await;
    wait_for("the late answer", Duration::from_secs(20), || {
        (late.worker.stats().claimed >= 1).then_some(())
    })
    .await;
    let late_stats = late.worker.stats();
    late.stop().await.unwrap();
    other.stop().await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{late_stats:?}");
    assert_eq!(late_stats.acked, 0, "{late_stats:?}");
}

/// A stop while a late answer's leases are being renewed: they are still run (with the
/// grace), not left leased until they expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_late_answers_renewal_still_runs_its_leases() {
    let stack = stack();
    let k = kind("renewing");
    let ids = enqueue(&Outbox::new(connection()), &k, 1, 0).await;
    let slow = Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await;
    slow.delay_answers(Duration::from_secs(2));
    let recorder = Recorder::default();
    let worker = Worker::builder(connect(std::slice::from_ref(&slow.addr)))
        .lease(Duration::from_secs(8))
        .observer(recorder.clone())
        .handler(&k, |_job: Job| async { Ok::<_, Failure>(()) })
        .build()
        .unwrap();
    let running = Running::start(worker);
    wait_for("the renewal sent", Duration::from_secs(20), || {
        recorder
            .events()
            .iter()
            .any(|e| matches!(e, Observed::Sending(_, LeaseCall::ExtendLease)))
            .then_some(())
    })
    .await;
    running.stop().await.unwrap();
    assert_eq!(
        state(&connection(), &ids[0]).await,
        IntentState::Delivered,
        "{:?}",
        recorder.events()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_sent_again_with_its_request_id_returns_the_same_leases() {
    let connection = connection();
    let k = kind("replay");
    enqueue(&Outbox::new(connection.clone()), &k, 3, 0).await;
    let claim = |request_id: &str| proto::ClaimRequest {
        worker_id: "replay-test".into(),
        kinds: vec![k.clone()],
        max_intents: 2,
        request_id: request_id.into(),
        ..Default::default()
    };
    let call = |request: proto::ClaimRequest| {
        let connection = connection.clone();
        async move {
            connection
                .call(CallOptions::new(Duration::from_secs(5)), |mut client| {
                    let request = request.clone();
                    async move { client.claim(request).await }
                })
                .await
                .unwrap()
                .leases
                .into_iter()
                .map(|l| l.lease_id)
                .collect::<Vec<_>>()
        }
    };
    let first = call(claim("r-1")).await;
    let again = call(claim("r-1")).await;
    let other = call(claim("r-2")).await;
    assert_eq!(first.len(), 2);
    assert_eq!(again, first);
    assert_eq!(other.len(), 1);
    assert!(!first.contains(&other[0]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_moves_on_when_an_endpoint_is_down_or_dies() {
    let stack = stack();
    let connection = connection();
    let k = kind("failover");
    let (extra, pid) = stack.start_server("outboxd-failover", &[]);
    // Nothing listens on the first endpoint; the second dies mid-run; the third stays.
    let dead = format!("127.0.0.1:{}", crate::harness::free_port());
    let ids = enqueue(&Outbox::new(connection.clone()), &k, 300, 0).await;
    let seen: Seen = Arc::default();
    let worker = Worker::builder(connect(&[dead, extra, stack.endpoints[1].clone()]))
        .concurrency(4)
        .claim_wait(Duration::from_secs(1))
        .handler(&k, {
            let seen = seen.clone();
            move |job: Job| {
                let seen = seen.clone();
                async move {
                    // Slow enough that the server dies with work in flight.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    count(&seen, job.id());
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    running.acked(50, Duration::from_secs(30)).await;
    stack.kill_server(pid);
    running.acked(300, Duration::from_secs(60)).await;
    let stats = running.worker.stats();
    running.stop().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(
        ids.iter().all(|id| seen.get(id) == Some(&1)),
        "handled twice or never"
    );
    assert_eq!(
        (stats.acked, stats.settle_errors, stats.lease_lost),
        (300, 0, 0),
        "{stats:?}"
    );
    assert!(
        list(&connection, &k)
            .await
            .iter()
            .all(|i| i.state() == IntentState::Delivered)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_stops_claiming_lets_handlers_finish_settles_then_returns() {
    let connection = connection();
    let outbox = Outbox::new(connection.clone());
    let k = kind("drain");
    let ids = enqueue(&outbox, &k, 4, 0).await;
    let gate = Gate::default();
    let worker = Worker::builder(connection.clone())
        .concurrency(4)
        .handler(&k, {
            let gate = gate.clone();
            move |_job: Job| {
                let gate = gate.clone();
                async move {
                    gate.wait().await;
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    wait_for("4 running handlers", Duration::from_secs(15), || {
        (running.worker.stats().running == 4).then_some(())
    })
    .await;
    running.begin_stop();
    // Enqueued after the stop: never claimed by this worker.
    let late = enqueue(&outbox, &k, 3, 0).await;
    assert!(
        !running.is_finished(),
        "returned while its handlers were running"
    );
    gate.open();
    running.stop().await.unwrap();
    // Settled before run_until returned: no waiting here.
    for id in &ids {
        assert_eq!(state(&connection, id).await, IntentState::Delivered);
    }
    for id in &late {
        assert_eq!(state(&connection, id).await, IntentState::Pending);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_still_running_after_the_grace_are_given_back() {
    let connection = connection();
    let outbox = Outbox::new(connection.clone());
    let (plain, paying) = (kind("stuck"), kind("stuck-paying"));
    let stuck = outbox
        .enqueue_direct(NewIntent::new(&plain, ""))
        .await
        .unwrap()
        .id;
    let submitted = outbox
        .enqueue_direct(NewIntent::new(&paying, ""))
        .await
        .unwrap()
        .id;
    let worker = Worker::builder(connection.clone())
        .concurrency(2)
        .grace(Duration::from_millis(300))
        .handler(&plain, |_job: Job| async {
            std::future::pending::<()>().await;
            Ok::<_, Failure>(())
        })
        .handler(&paying, |job: Job| async move {
            job.submitting().await?;
            std::future::pending::<()>().await;
            Ok::<_, Failure>(())
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    wait_state(&connection, &submitted, IntentState::Submitted).await;
    wait_for("2 running handlers", Duration::from_secs(15), || {
        (running.worker.stats().running == 2).then_some(())
    })
    .await;
    running.stop().await.unwrap();
    // Failed before run_until returned: RETRY for the one that had not started its call,
    // UNKNOWN (an operator decides) for the one that had.
    let given_back = intent(&connection, &stuck).await;
    assert_eq!(given_back.state(), IntentState::Pending);
    assert!(
        given_back.last_error.contains("shut down"),
        "{}",
        given_back.last_error
    );
    assert_eq!(
        state(&connection, &submitted).await,
        IntentState::NeedsReconcile
    );
}

/// A drain while the only replica answers nothing ends 5 s after the grace: the Ack is
/// given up (its lease expires), not retried for a lease's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_while_the_server_answers_nothing_ends_five_seconds_after_the_grace() {
    let stack = stack();
    let k = kind("drain-frozen");
    enqueue(&Outbox::new(connection()), &k, 1, 0).await;
    let proxy = Arc::new(Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await);
    let release = Arc::new(Notify::new());
    let worker = Worker::builder(connect(std::slice::from_ref(&proxy.addr)))
        .lease(Duration::from_secs(60))
        .grace(Duration::from_millis(500))
        .claim_wait(Duration::from_secs(1))
        .handler(&k, {
            let release = release.clone();
            move |_job: Job| {
                let release = release.clone();
                async move {
                    release.notified().await;
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    wait_for("the handler running", Duration::from_secs(15), || {
        (running.worker.stats().running == 1).then_some(())
    })
    .await;
    proxy.freeze(true);
    let stopped = Instant::now();
    running.begin_stop();
    release.notify_one();
    let stats = running.worker.clone();
    running.stop().await.unwrap();
    let took = stopped.elapsed();
    assert!(
        took < Duration::from_millis(500 + 5_000 + 2_000),
        "run_until returned {took:?} after the stop"
    );
    assert_eq!(stats.stats().acked, 0);
}

#[tokio::test]
async fn a_claim_wait_under_100_ms_is_refused_not_a_claim_loop() {
    let refused = Worker::builder(connect(&["127.0.0.1:1".to_owned()]))
        .claim_wait(Duration::from_millis(99))
        .handler("k", |_job: Job| async { Ok::<_, Failure>(()) })
        .build();
    assert!(
        matches!(&refused, Err(outboxd_client::Error::Invalid(m)) if m.contains("claim_wait")),
        "{:?}",
        refused.err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_heartbeats_cannot_get_through_is_lost_and_never_acked() {
    let stack = stack();
    let connection = connection();
    let k = kind("blocked");
    let [id]: [String; 1] = enqueue(&Outbox::new(connection.clone()), &k, 1, 0)
        .await
        .try_into()
        .unwrap();
    let proxy = Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await;
    let started = Arc::new(Notify::new());
    let token = Arc::new(Mutex::new(None));
    let recorder = Recorder::default();
    let blocked = Worker::builder(connect(std::slice::from_ref(&proxy.addr)))
        .concurrency(1)
        .lease(Duration::from_secs(1))
        .observer(recorder.clone())
        .handler(&k, {
            let (started, token) = (started.clone(), token.clone());
            move |job: Job| {
                let (started, token) = (started.clone(), token.clone());
                async move {
                    *token.lock().unwrap() = Some(job.cancellation_token());
                    started.notify_one();
                    // Would ack if it ever returned.
                    std::future::pending::<()>().await;
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    let blocked = Running::start(blocked);
    started.notified().await;
    proxy.freeze(true);
    wait_for("the lease lost", Duration::from_secs(10), || {
        (blocked.worker.stats().lease_lost == 1).then_some(())
    })
    .await;
    let token = token.lock().unwrap().clone().expect("the handler's token");
    assert!(token.is_cancelled(), "the handler was not told");
    // The server rescues the expired lease; another worker gets the intent.
    let rival = Worker::builder(connect(&stack.endpoints[1..]))
        .concurrency(1)
        .handler(&k, |job: Job| async move {
            assert_eq!(job.attempt(), 2);
            Ok::<_, Failure>(())
        })
        .build()
        .unwrap();
    let rival = Running::start(rival);
    let delivered = wait_state(&connection, &id, IntentState::Delivered).await;
    // The server commits before it answers: the rival counts its Ack a moment later.
    wait_for("the rival's Ack counted", Duration::from_secs(10), || {
        (rival.worker.stats().acked == 1).then_some(())
    })
    .await;
    let rival_stats = rival.worker.stats();
    rival.stop().await.unwrap();
    proxy.freeze(false);
    let stats = blocked.worker.stats();
    blocked.stop().await.unwrap();
    assert_eq!(delivered.attempts, 2);
    assert_eq!(rival_stats.acked, 1);
    assert_eq!((stats.acked, stats.failed), (0, 0), "{stats:?}");
    // The observer was told it was lost, and nothing was sent for it after.
    let events = recorder.events();
    let lost = events.iter().position(|e| matches!(e, Observed::Lost(_)));
    assert!(lost.is_some(), "{events:?}");
    assert!(
        !events.iter().any(|e| matches!(
            e,
            Observed::Sending(
                _,
                LeaseCall::Ack | LeaseCall::Fail(_) | LeaseCall::MarkSubmitted
            )
        )),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_api_key_stops_the_worker_with_the_error() {
    let stack = stack();
    let connection = outboxd_client::Connection::builder(stack.endpoints.clone())
        .api_key("obx_not-a-key")
        .build()
        .unwrap();
    let worker = Worker::builder(connection)
        .handler(kind("x"), |_job: Job| async { Ok::<_, Failure>(()) })
        .build()
        .unwrap();
    let error = tokio::time::timeout(
        Duration::from_secs(30),
        worker.run_until(std::future::pending::<()>()),
    )
    .await
    .expect("returned")
    .unwrap_err();
    assert_eq!(error.code(), Some(tonic::Code::Unauthenticated), "{error}");
}

/// Counts leases claimed and Acks answered, and remembers the most claimed beyond the Acks
/// answered when a Claim's answer arrived.
#[derive(Clone, Default)]
struct Backlog(Arc<Mutex<(usize, usize, usize)>>);

impl Backlog {
    fn most_unacked_at_a_claim(&self) -> usize {
        self.0.lock().unwrap().2
    }
}

impl outboxd_client::WorkerObserver for Backlog {
    fn claimed(&self, claim: &outboxd_client::ClaimEvent<'_>) {
        let mut counts = self.0.lock().unwrap();
        // Before this Claim's leases: what the worker held when it sent it, less what was
        // answered since.
        counts.2 = counts.2.max(counts.0 - counts.1);
        counts.0 += claim.leases.len();
    }

    fn answered(
        &self,
        _lease: outboxd_client::LeaseId<'_>,
        call: LeaseCall,
        answer: &outboxd_client::Answer<'_>,
    ) {
        if call == LeaseCall::Ack && answer.is_ok() {
            self.0.lock().unwrap().1 += 1;
        }
    }
}

/// Acks slower than the handlers: the worker stops claiming once 4,000 results await their
/// settle, instead of piling up leases (each one heartbeated) without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_4000_acks_are_unanswered_the_worker_claims_nothing_more() {
    const UNSETTLED_MAX: usize = 4000;
    const CONCURRENCY: usize = 100;
    let k = kind("settle-backlog");
    let total = UNSETTLED_MAX + 3 * CONCURRENCY + 500;
    enqueue(&Outbox::new(connection()), &k, total, 0).await;

    // Every Ack of this kind waits in PostgreSQL for an advisory lock the test holds.
    let db = stack().url("app");
    let mut owner = sqlx::PgConnection::connect(&db).await.expect("connect");
    let hold = format!("hold_acks_{}", &k[1..11]);
    let lock_key: i64 = rand_key();
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION public.{hold}() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             PERFORM pg_advisory_xact_lock_shared({lock_key});
             RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
         END $$;
         CREATE TRIGGER {hold} BEFORE UPDATE OR DELETE ON outbox.intent FOR EACH ROW
         WHEN (OLD.kind = '{k}' AND OLD.state IN ('leased', 'submitted'))
         EXECUTE FUNCTION public.{hold}();"
    ))
    .execute(&mut owner)
    .await
    .expect("the trigger that holds Acks");
    let mut holder = sqlx::PgConnection::connect(&db).await.expect("connect");
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(lock_key)
        .execute(&mut holder)
        .await
        .expect("lock");

    let backlog = Backlog::default();
    let worker = Worker::builder(connection())
        .concurrency(CONCURRENCY)
        // Heartbeats wait for the lock too: no lease may need one meanwhile.
        .lease(Duration::from_secs(300))
        .observer(backlog.clone())
        .handler(&k, |_job: Job| async { Ok::<_, Failure>(()) })
        .build()
        .unwrap();
    let running = Running::start(worker);
    // Until the worker says it paused, or until a Claim went out past the bound.
    wait_for("claims paused", Duration::from_secs(120), || {
        let paused = running.worker.stats().claims_paused > 0;
        (paused || backlog.most_unacked_at_a_claim() >= UNSETTLED_MAX + CONCURRENCY).then_some(())
    })
    .await;
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(lock_key)
        .execute(&mut holder)
        .await
        .expect("unlock");
    running.acked(total as u64, Duration::from_secs(120)).await;
    running.stop().await.unwrap();
    sqlx::raw_sql(&format!(
        "DROP TRIGGER {hold} ON outbox.intent; DROP FUNCTION public.{hold}();"
    ))
    .execute(&mut owner)
    .await
    .expect("drop the trigger");

    assert!(
        backlog.most_unacked_at_a_claim() < UNSETTLED_MAX + CONCURRENCY,
        "a Claim went out while {} leases awaited their Ack or handler",
        backlog.most_unacked_at_a_claim()
    );
    let intents = list(&connection(), &k).await;
    assert_eq!(intents.len(), total);
    assert!(intents.iter().all(|i| i.state() == IntentState::Delivered));
}

fn rand_key() -> i64 {
    i64::from_le_bytes(uuid::Uuid::new_v4().as_bytes()[..8].try_into().unwrap())
}
