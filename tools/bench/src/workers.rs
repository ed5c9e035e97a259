//! The load generator's workers: `outboxd-client`'s managed worker (claims for free slots,
//! a full batch of them while there is a backlog; batched Acks), timed from outside by its
//! observer, so the bench measures the SDK a user would run rather than a loop of its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::ensure;
use outboxd_client::{
    Answer, ClaimEvent, Connection, Failure, Job, LeaseCall, LeaseId, Worker, WorkerObserver,
    WorkerStats,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::report::Hist;

/// How the workers claim.
pub struct Shape {
    /// Workers, each on its own connection.
    pub workers: usize,
    /// Handler slots of each: its Claims ask for at most this many leases.
    pub concurrency: usize,
    /// Free slots a Claim waits for while there is a backlog (`WorkerBuilder::claim_batch`).
    pub claim_batch: usize,
    /// How long a Claim long-polls.
    pub wait: Duration,
    /// Claims with a `request_id`; without, an Enqueue may hand intents to a waiting one.
    pub replay_claims: bool,
}

/// When each intent was claimed, each Claim + Ack cycle, and how full the Claims were.
struct Timing {
    /// Claims answered with leases: (Claims, leases asked for, leases got).
    fill: Mutex<(u64, u64, u64)>,
    /// Intent id → (Claim sent, Claim answered).
    claimed: Mutex<HashMap<String, (Instant, Instant)>>,
    /// Claim sent → its Ack answered, per intent.
    cycles: Mutex<Hist>,
}

impl WorkerObserver for Timing {
    fn claimed(&self, claim: &ClaimEvent<'_>) {
        let answered = Instant::now();
        let sent = answered - claim.attempts.last_took;
        if !claim.leases.is_empty() {
            let mut fill = lock(&self.fill);
            fill.0 += 1;
            fill.1 += claim.max_intents as u64;
            fill.2 += claim.leases.len() as u64;
        }
        let mut claimed = lock(&self.claimed);
        for lease in claim.leases {
            if let Some(intent) = &lease.intent {
                claimed.insert(intent.id.clone(), (sent, answered));
            }
        }
    }

    fn answered(&self, lease: LeaseId<'_>, call: LeaseCall, answer: &Answer<'_>) {
        if call != LeaseCall::Ack || !answer.is_ok() {
            return;
        }
        let sent = lock(&self.claimed)
            .get(lease.intent_id)
            .map(|(sent, _)| *sent);
        if let Some(sent) = sent {
            lock(&self.cycles).record(sent.elapsed());
        }
    }
}

/// Workers acking every intent of `kind` at once, until `stop`.
pub struct Workers {
    running: Vec<(Worker, JoinHandle<Result<(), outboxd_client::Error>>)>,
    timing: Arc<Timing>,
    stop: CancellationToken,
}

impl Workers {
    /// Starts `shape.workers` workers on `endpoint` with `key`.
    pub fn start(endpoint: &str, key: &str, kind: &str, shape: &Shape) -> anyhow::Result<Self> {
        let timing = Arc::new(Timing {
            fill: Mutex::default(),
            claimed: Mutex::default(),
            cycles: Mutex::new(Hist::new()),
        });
        let stop = CancellationToken::new();
        let mut running = Vec::with_capacity(shape.workers);
        for w in 0..shape.workers {
            let connection = Connection::builder([endpoint]).api_key(key).build()?;
            let worker = Worker::builder(connection)
                .worker_id(format!("bench-worker-{w}"))
                .concurrency(shape.concurrency)
                .claim_batch(shape.claim_batch)
                .claim_wait(shape.wait)
                .replay_claims(shape.replay_claims)
                .observer(timing.clone())
                .handler(kind, |_job: Job| async { Ok::<_, Failure>(()) })
                .build()?;
            let handle = tokio::spawn({
                let (worker, stop) = (worker.clone(), stop.clone());
                async move { worker.run_until(stop.cancelled_owned()).await }
            });
            running.push((worker, handle));
        }
        Ok(Self {
            running,
            timing,
            stop,
        })
    }

    /// Leases acked so far, by all.
    pub fn acked(&self) -> u64 {
        self.running.iter().map(|(w, _)| w.stats().acked).sum()
    }

    /// Intents claimed so far, by all.
    pub fn claimed(&self) -> usize {
        lock(&self.timing.claimed).len()
    }

    /// How many of `ids` have been claimed so far.
    pub fn claimed_of(&self, ids: &[String]) -> usize {
        let claimed = lock(&self.timing.claimed);
        ids.iter().filter(|id| claimed.contains_key(*id)).count()
    }

    /// Claims that got leases, and the average leases each asked for and got.
    pub fn fill(&self) -> (u64, f64, f64) {
        let (claims, asked, got) = *lock(&self.timing.fill);
        let per = |n: u64| n as f64 / claims.max(1) as f64;
        (claims, per(asked), per(got))
    }

    /// Drains them; fails when one stopped with an error or a lease was not acked cleanly.
    /// Returns when each intent was claimed, and the Claim + Ack cycles.
    pub async fn stop(self) -> anyhow::Result<(HashMap<String, Instant>, Hist)> {
        self.stop.cancel();
        for (worker, handle) in self.running {
            handle.await??;
            let stats: WorkerStats = worker.stats();
            ensure!(
                stats.lease_lost + stats.settle_errors + stats.failed == 0,
                "a worker did not ack cleanly: {stats:?}"
            );
        }
        let claimed = std::mem::take(&mut *lock(&self.timing.claimed));
        let cycles = std::mem::replace(&mut *lock(&self.timing.cycles), Hist::new());
        let claimed = claimed.into_iter().map(|(id, (_, at))| (id, at)).collect();
        Ok((claimed, cycles))
    }
}

/// A lock whose holder never panics with it held; poisoning is ignored.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
