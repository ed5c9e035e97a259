//! A worker process: `outboxd-client`'s managed worker (claims for free slots, heartbeats,
//! batched settles, `submitting`, failover, drain), with handlers that play the targets:
//! for payments MarkSubmitted, then the side effect, then Ack, sometimes Fail (RETRY,
//! PERMANENT, UNKNOWN) instead, and now and then work that outlives the lease (the
//! heartbeats must extend it). "Performing the side effect" is appending a `performed`
//! line to the journal before the handler returns: the journal is the external system
//! whose duplicates the checker counts. Everything else the SDK does is journaled by its
//! observer (`witness`), so the suite that proves the server proves the SDK too.
//!
//! Faults stay outside the SDK: the orchestrator kills and stops this process, and the
//! proxies in front of the replicas lose answers. Half of the processes send plain long
//! polls (no `request_id`), as most workers do: those an enqueue of the same replica may
//! hand intents to (`outboxd::outbox::claim::handoff`), and a lost answer's leases expire
//! instead of being returned to the retry.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outboxd_client::{Connection, Failure, Job, Worker};
use tokio_util::sync::CancellationToken;

use crate::journal::{Event, Journal, now_us};
use crate::rng::Rng;
use crate::rpc::CALL_TIMEOUT;
use crate::witness::Witness;
use crate::{API_KEY_ENV, IDEMPOTENT_KIND, NOTICE_KIND, PAYMENT_KIND};

/// How long a Claim long-polls.
const CLAIM_WAIT: Duration = Duration::from_secs(1);

/// How long handlers may finish after SIGTERM (the orchestrator kills at 5 s).
const GRACE: Duration = Duration::from_secs(3);

/// Command line of `outboxd-faults worker` (started by `run`, not by hand).
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// Worker id sent with Claim; also names the journal.
    #[arg(long)]
    pub name: String,
    /// outboxd endpoints (`host:port`), comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub endpoints: Vec<String>,
    /// Journal file to append to.
    #[arg(long)]
    pub journal: PathBuf,
    /// Seed of this worker's choices.
    #[arg(long)]
    pub seed: u64,
    /// Lease length asked for, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub lease_ms: u64,
    /// A superuser URL of the outbox database: each OK is read back from there at once,
    /// to prove its change was committed when it arrived.
    #[arg(long)]
    pub database_url: Option<String>,
}

/// What the handlers share: the choices and the journal.
struct Target {
    rng: Mutex<Rng>,
    journal: Arc<Journal>,
    lease: Duration,
}

/// Runs until SIGTERM, then drains (the SDK's drain) and exits.
pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let key = std::env::var(API_KEY_ENV)?;
    let stop = crate::stop_on_sigterm()?;
    let mut rng = Rng::new(args.seed.rotate_left(17));
    let journal = Arc::new(Journal::create(&args.journal)?);
    // Each process starts on another replica (the SDK stays on the one that answers), so
    // every replica, the small-pool one too, carries workers.
    let replicas = args.endpoints.len();
    let rotation = rng.below(replicas as u64) as usize;
    let mut endpoints = args.endpoints;
    endpoints.rotate_left(rotation);
    let connection = Connection::builder(endpoints)
        .api_key(key)
        .connect_timeout(Duration::from_secs(1))
        .call_timeout(CALL_TIMEOUT)
        .build()?;
    let reads_done = CancellationToken::new();
    let (read_backs, reader) = match args.database_url {
        Some(url) => {
            let (sender, task) = crate::read_back::spawn(url, journal.clone(), reads_done.clone());
            (Some(sender), Some(task))
        }
        None => (None, None),
    };
    let witness = Witness {
        journal: journal.clone(),
        read_backs,
        rotation,
        replicas,
    };
    let lease = Duration::from_millis(args.lease_ms);
    let replay_claims = rng.chance(0.5);
    let concurrency = 1 + rng.below(3) as usize;
    let target = Arc::new(Target {
        rng: Mutex::new(rng),
        journal,
        lease,
    });
    let mut builder = Worker::builder(connection)
        .worker_id(args.name)
        .kinds(Vec::<String>::new())
        .concurrency(concurrency)
        .lease(lease)
        .claim_wait(CLAIM_WAIT)
        .grace(GRACE)
        .replay_claims(replay_claims)
        .observer(witness);
    for kind in [IDEMPOTENT_KIND, NOTICE_KIND, PAYMENT_KIND] {
        let target = target.clone();
        builder = builder.handler(kind, move |job: Job| {
            let target = target.clone();
            async move { target.handle(job).await }
        });
    }
    let worker = builder.build()?;
    let result = worker.run_until(stop.cancelled()).await;
    // Every settle has been answered: the reader finishes what was queued.
    reads_done.cancel();
    if let Some(reader) = reader {
        let _ = reader.await;
    }
    Ok(result?)
}

impl Target {
    async fn handle(&self, job: Job) -> Result<(), Failure> {
        if job.kind() == PAYMENT_KIND {
            self.payment(&job).await
        } else {
            self.idempotent(&job).await
        }
    }

    /// An idempotent target: no MarkSubmitted; a lost Ack means a retry by someone else.
    async fn idempotent(&self, job: &Job) -> Result<(), Failure> {
        let roll = self.below(100);
        if roll < 3 {
            return Err(Failure::permanent(self.injected("Permanent", job)));
        }
        if roll < 10 {
            return Err(Failure::retry(self.injected("Retry", job)).after(RETRY_AFTER));
        }
        if roll < 12 {
            // Slow work, longer than the lease: only the heartbeats keep it ours.
            tokio::time::sleep(self.lease.mul_f64(1.5)).await;
        } else {
            tokio::time::sleep(self.millis(2, 25)).await;
        }
        self.perform(job);
        // The side effect's own latency: the window in which a kill or stop makes the
        // delivery a duplicate.
        tokio::time::sleep(self.millis(0, 60)).await;
        Ok(())
    }

    /// A non-idempotent target: MarkSubmitted before the call, so a lost outcome goes to
    /// an operator instead of a blind retry.
    async fn payment(&self, job: &Job) -> Result<(), Failure> {
        job.submitting().await?;
        tokio::time::sleep(self.millis(2, 25)).await;
        let roll = self.below(100);
        if roll < 4 {
            // The target refused outright: nothing happened, so a retry is safe.
            return Err(Failure::retry(self.injected("Retry", job)).after(RETRY_AFTER));
        }
        if roll < 8 {
            // The call timed out: it may or may not have happened.
            if self.below(2) == 0 {
                self.perform(job);
            }
            return Err(Failure::unknown(self.injected("Unknown", job)));
        }
        self.perform(job);
        tokio::time::sleep(self.millis(0, 60)).await;
        Ok(())
    }

    fn perform(&self, job: &Job) {
        let (Ok(intent), Ok(lease)) = (job.id().parse(), job.lease_id().parse()) else {
            return;
        };
        self.journal.log(&Event::Performed {
            t: now_us(),
            intent,
            lease,
            attempt: job.attempt() as i32,
        });
    }

    fn injected(&self, kind: &str, job: &Job) -> String {
        format!("injected {kind} by {}", job.worker_id())
    }

    fn below(&self, n: u64) -> u64 {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).below(n)
    }

    fn millis(&self, lo_ms: u64, hi_ms: u64) -> Duration {
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        rng.millis(lo_ms, hi_ms)
    }
}

/// `retry_after` of an injected RETRY.
const RETRY_AFTER: Duration = Duration::from_millis(100);
