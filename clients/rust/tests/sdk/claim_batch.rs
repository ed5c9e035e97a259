//! `claim_batch`: full Claims while there is a backlog, and no waiting for company when the
//! queue is short.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outboxd_client::{
    ClaimEvent, Failure, IntentState, Job, NewIntent, Outbox, Worker, WorkerObserver,
};

use crate::harness::{connection, kind, wait_for, wait_state};
use crate::{Gate, Running, enqueue};

/// An answered Claim: leases asked for, leases got, their intents' ids.
type Claim = (usize, usize, Vec<String>);

/// Every answered Claim.
#[derive(Clone, Default)]
struct Claims(Arc<Mutex<Vec<Claim>>>);

impl Claims {
    fn all(&self) -> Vec<Claim> {
        self.0.lock().unwrap().clone()
    }
}

impl WorkerObserver for Claims {
    fn claimed(&self, claim: &ClaimEvent<'_>) {
        let ids = claim
            .leases
            .iter()
            .filter_map(|l| l.intent.as_ref().map(|i| i.id.clone()))
            .collect();
        self.0
            .lock()
            .unwrap()
            .push((claim.max_intents, claim.leases.len(), ids));
    }
}

/// A linger no test outlasts: a Claim sent with fewer slots than the batch was not waiting.
const FOREVER: Duration = Duration::from_secs(3600);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_backlog_and_quick_handlers_every_claim_asks_for_the_whole_batch() {
    let connection = connection();
    let k = kind("batch");
    enqueue(&Outbox::new(connection.clone()), &k, 400, 0).await;
    let claims = Claims::default();
    let worker = Worker::builder(connection)
        .concurrency(50)
        .claim_batch(50)
        .claim_linger(FOREVER)
        .observer(claims.clone())
        .handler(&k, |_job: Job| async { Ok::<_, Failure>(()) })
        .build()
        .unwrap();
    let running = Running::start(worker);
    running.acked(400, Duration::from_secs(60)).await;
    let stats = running.worker.stats();
    running.stop().await.unwrap();
    assert_eq!((stats.claimed, stats.acked), (400, 400), "{stats:?}");
    let claims = claims.all();
    let full: Vec<_> = claims.iter().filter(|(_, got, _)| *got > 0).collect();
    assert_eq!(full.len(), 8, "{claims:?}");
    assert!(
        claims.iter().all(|(asked, _, _)| *asked == 50),
        "a Claim asked for fewer than the batch: {claims:?}"
    );
    assert!(full.iter().all(|(_, got, _)| *got == 50), "{claims:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_queue_is_claimed_at_once_with_fewer_free_slots_than_the_batch() {
    let connection = connection();
    let outbox = Outbox::new(connection.clone());
    let k = kind("short");
    let claims = Claims::default();
    // "hold" keeps its slot until released: the worker is then never all free again.
    let gate = Gate::default();
    let worker = Worker::builder(connection.clone())
        .concurrency(8)
        .claim_batch(8)
        .claim_linger(FOREVER)
        .observer(claims.clone())
        .handler(&k, {
            let gate = gate.clone();
            move |job: Job| {
                let gate = gate.clone();
                async move {
                    if job.payload() == b"hold" {
                        gate.wait().await;
                    }
                    Ok::<_, Failure>(())
                }
            }
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    // An idle worker claims a single intent (all its slots are free).
    let hold = enqueue_one(&outbox, &k, "hold").await;
    wait_for("the held handler running", Duration::from_secs(30), || {
        (running.worker.stats().running == 1).then_some(())
    })
    .await;
    // 7 free slots of 8, but the last Claim came back short: no waiting for the eighth.
    let quick = enqueue_one(&outbox, &k, "quick").await;
    let delivered = wait_state(&connection, &quick, IntentState::Delivered).await;
    assert_eq!(delivered.attempts, 1);
    gate.open();
    wait_state(&connection, &hold, IntentState::Delivered).await;
    running.stop().await.unwrap();
    let claims = claims.all();
    let of = |id: &str| {
        claims
            .iter()
            .find(|(_, _, ids)| ids.iter().any(|i| i == id))
            .map(|(asked, got, _)| (*asked, *got))
    };
    assert_eq!(of(&hold), Some((8, 1)), "{claims:?}");
    assert_eq!(of(&quick), Some((7, 1)), "{claims:?}");
}

async fn enqueue_one(outbox: &Outbox, kind: &str, payload: &str) -> String {
    let intent = NewIntent::new(kind, payload.as_bytes().to_vec());
    outbox.enqueue_direct(intent).await.expect("enqueue").id
}
