//! The managed worker loop: claims only for free handler slots, in full batches while
//! there is a backlog (long-polling, each Claim with a `request_id` its retries reuse),
//! runs one tokio task per leased intent, extends every live lease, settles in batches,
//! and drains on shutdown.

mod job;
mod lease;
mod observer;
mod settle;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use self::job::FailureKind;
pub use self::job::{Failure, Job};
use self::lease::LeaseState;
pub use self::observer::{Answer, ClaimEvent, LeaseCall, LeaseId, WorkerObserver};
use self::settle::{Outcome, Settle, fail_text};
use crate::connection::{Attempts, Backoff, CallOptions, Connection, Retry};
use crate::error::Error;
use crate::proto::{self, FailOutcome};
use crate::proto_duration;

/// Most leases per Claim and items per settle or heartbeat call (the server's default
/// batch limit).
const MAX_BATCH: usize = 1000;

/// Results awaiting their Ack or Fail at which the worker stops claiming: against Acks
/// slower than its handlers it would otherwise pile up leases (each one heartbeated)
/// without bound.
const UNSETTLED_MAX: usize = 4 * MAX_BATCH;

/// How long settles may still take once the shutdown grace is over.
const SETTLE_AFTER_GRACE: Duration = Duration::from_secs(5);

/// Per-item reasons meaning "this lease is not ours any more".
const LOST_REASONS: [&str; 3] = ["LEASE_LOST", "NOT_FOUND", "INVALID_STATE"];

type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), Failure>> + Send>>;
type Handler = Arc<dyn Fn(Job) -> HandlerFuture + Send + Sync>;

/// Counters since the worker was built (a snapshot: [`Worker::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerStats {
    /// Leases received from Claim.
    pub claimed: u64,
    /// Acks the server applied.
    pub acked: u64,
    /// Fails the server applied (any outcome).
    pub failed: u64,
    /// Leases found lost (a heartbeat, MarkSubmitted or settle answered `LEASE_LOST`, or
    /// the lease expired before an extension got through).
    pub lease_lost: u64,
    /// ExtendLease calls that failed as a whole, or items they could not extend.
    pub heartbeat_failures: u64,
    /// Claim attempts retried after a transient failure (with the same `request_id`).
    pub claim_retries: u64,
    /// Settle items refused for another reason than a lost lease, or not answered.
    pub settle_errors: u64,
    /// Times claiming paused because 4,000 results awaited their settle (Acks slower
    /// than the handlers).
    pub claims_paused: u64,
    /// Handlers running now.
    pub running: u64,
}

#[derive(Debug, Default)]
struct Counter(AtomicU64);

impl Counter {
    fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    fn sub(&self, n: u64) {
        self.0.fetch_sub(n, Ordering::Relaxed);
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A handler counted as running while it lives, also when its task is aborted (a dropped
/// `run` future drops its jobs).
struct Running(Arc<Shared>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.stats.running.sub(1);
    }
}

#[derive(Debug, Default)]
struct Counters {
    claimed: Counter,
    acked: Counter,
    failed: Counter,
    lease_lost: Counter,
    heartbeat_failures: Counter,
    claim_retries: Counter,
    settle_errors: Counter,
    claims_paused: Counter,
    running: Counter,
}

#[derive(Debug)]
struct Config {
    worker_id: String,
    region: String,
    /// The Claim filter.
    kinds: Vec<String>,
    concurrency: usize,
    /// Free slots a Claim waits for while there is a backlog (1 to `concurrency`).
    claim_batch: usize,
    /// The longest a free slot waits for that company.
    claim_linger: Duration,
    lease: Duration,
    heartbeat: Duration,
    claim_wait: Duration,
    grace: Duration,
    settle_delay: Duration,
    /// Claims carry a `request_id` (replayed after a lost answer).
    replay_claims: bool,
}

/// What every task of a running worker shares.
struct Shared {
    connection: Connection,
    config: Config,
    handlers: HashMap<String, Handler>,
    /// Live leases by lease id: the heartbeats extend these.
    leases: Mutex<HashMap<String, Arc<LeaseState>>>,
    stats: Counters,
    /// Told when a lease leaves `leases`.
    lease_ended: Notify,
    running: AtomicBool,
    /// None unless set: then no event is built.
    observer: Option<Arc<dyn WorkerObserver>>,
}

/// Builds a [`Worker`]; see [`Worker::builder`].
pub struct WorkerBuilder {
    connection: Connection,
    handlers: HashMap<String, Handler>,
    duplicate: Option<String>,
    worker_id: Option<String>,
    region: String,
    kinds: Option<Vec<String>>,
    concurrency: usize,
    /// None: `concurrency`.
    claim_batch: Option<usize>,
    claim_linger: Duration,
    lease: Duration,
    claim_wait: Duration,
    grace: Duration,
    settle_delay: Duration,
    replay_claims: bool,
    observer: Option<Arc<dyn WorkerObserver>>,
}

impl WorkerBuilder {
    /// Registers the handler of one kind: an async closure (or any function) taking the
    /// [`Job`] and returning `Result<(), Failure>`. `Ok` acks; the [`Failure`] says how it
    /// failed. It runs in a task of its own, so it must be `Send + 'static`.
    ///
    /// ```no_run
    /// # fn f(builder: outboxd_client::WorkerBuilder) -> outboxd_client::WorkerBuilder {
    /// use outboxd_client::{Failure, Job};
    /// builder.handler("email.send", |job: Job| async move {
    ///     let address = std::str::from_utf8(job.payload())?; // any error: a retry
    ///     if address.is_empty() {
    ///         return Err(Failure::permanent("no address")); // dead-lettered
    ///     }
    ///     Ok(()) // acked
    /// })
    /// # }
    /// ```
    pub fn handler<F, Fut>(mut self, kind: impl Into<String>, handler: F) -> Self
    where
        F: Fn(Job) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let kind = kind.into();
        let handler: Handler = Arc::new(move |job| Box::pin(handler(job)));
        if self.handlers.insert(kind.clone(), handler).is_some() {
            self.duplicate.get_or_insert(kind);
        }
        self
    }

    /// Sent as `worker_id` (default `<hostname>-<pid>-<random>`): names the worker in
    /// listings and scopes its Claim replays.
    pub fn worker_id(mut self, worker_id: impl Into<String>) -> Self {
        self.worker_id = Some(worker_id.into());
        self
    }

    /// The worker's region: it gets that region's intents and region-less ones (default:
    /// any region).
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = region.into();
        self
    }

    /// The kinds to claim (default: the kinds with a handler). An intent of a kind without
    /// a handler is then failed `PERMANENT` with a message saying so; an empty list claims
    /// every kind.
    pub fn kinds<I, S>(mut self, kinds: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.kinds = Some(kinds.into_iter().map(Into::into).collect());
        self
    }

    /// Handlers running at once (default 16): a Claim never asks for more leases than
    /// there are free slots.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// How many free slots a Claim waits for while there is a backlog (default: all of
    /// them, `concurrency`; at most `concurrency` and 1,000). Quick handlers then share one
    /// Claim and one Ack per batch instead of one each. It never idles a worker: one with
    /// no handler running has every slot free, a Claim answered with fewer leases than it
    /// asked for (a short queue) is followed at once by the next, and a free slot waits at
    /// most [`claim_linger`](Self::claim_linger). `1` claims as soon as any slot is free.
    pub fn claim_batch(mut self, slots: usize) -> Self {
        self.claim_batch = Some(slots);
        self
    }

    /// The longest a free slot waits for `claim_batch` company before the worker claims
    /// with fewer (default 5 ms): what slow handlers with a backlog may lose per slot and
    /// Claim.
    pub fn claim_linger(mut self, linger: Duration) -> Self {
        self.claim_linger = linger;
        self
    }

    /// The lease asked for with each Claim (default 30 s, at least 1 s); heartbeats extend
    /// live leases every third of it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long a Claim long-polls when there is no work (default 5 s).
    pub fn claim_wait(mut self, wait: Duration) -> Self {
        self.claim_wait = wait;
        self
    }

    /// How long running handlers may finish after shutdown begins (default 30 s).
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// How long an Ack or Fail waits for others to share its call (default 2 ms).
    pub fn settle_delay(mut self, delay: Duration) -> Self {
        self.settle_delay = delay;
        self
    }

    /// Whether each Claim carries a `request_id` (default true). With one, a Claim whose
    /// answer was lost is retried with the same id and the server returns the leases it
    /// took. Without (`false`), Claims are plain long polls: an `Enqueue` of the same
    /// replica may hand its intents straight to a waiting one (the hand-off: lower
    /// latency at a steady rate), but a lost answer's leases are stranded until they
    /// expire.
    pub fn replay_claims(mut self, replay: bool) -> Self {
        self.replay_claims = replay;
        self
    }

    /// Tells `observer` what the worker does with each lease: see [`WorkerObserver`].
    pub fn observer(mut self, observer: impl WorkerObserver) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// The worker.
    ///
    /// # Errors
    /// [`Error::Invalid`]: two handlers for one kind, no handler and no kinds, a
    /// concurrency or a claim batch of 0, or a lease shorter than 1 s.
    pub fn build(self) -> Result<Worker, Error> {
        if let Some(kind) = self.duplicate {
            return Err(Error::Invalid(format!(
                "outboxd worker: two handlers for kind {kind}"
            )));
        }
        if self.handlers.is_empty() && self.kinds.is_none() {
            return Err(Error::Invalid(
                "outboxd worker: no handler registered (WorkerBuilder::handler)".into(),
            ));
        }
        if self.concurrency == 0 {
            return Err(Error::Invalid(
                "outboxd worker: concurrency must be at least 1".into(),
            ));
        }
        if self.claim_batch == Some(0) {
            return Err(Error::Invalid(
                "outboxd worker: claim_batch must be at least 1".into(),
            ));
        }
        if self.lease < Duration::from_secs(1) {
            return Err(Error::Invalid(
                "outboxd worker: the lease must be at least 1 s".into(),
            ));
        }
        // Shorter, an idle worker would claim in a loop, a transaction each time.
        if self.claim_wait < Duration::from_millis(100) {
            return Err(Error::Invalid(
                "outboxd worker: claim_wait must be at least 100 ms".into(),
            ));
        }
        let kinds = self.kinds.unwrap_or_else(|| {
            let mut kinds: Vec<String> = self.handlers.keys().cloned().collect();
            kinds.sort();
            kinds
        });
        let config = Config {
            worker_id: self.worker_id.unwrap_or_else(default_worker_id),
            region: self.region,
            kinds,
            concurrency: self.concurrency,
            // More could never be free at once (nor asked for in one Claim).
            claim_batch: self
                .claim_batch
                .unwrap_or(self.concurrency)
                .min(self.concurrency)
                .min(MAX_BATCH),
            claim_linger: self.claim_linger,
            lease: self.lease,
            heartbeat: self.lease / 3,
            claim_wait: self.claim_wait,
            grace: self.grace,
            settle_delay: self.settle_delay,
            replay_claims: self.replay_claims,
        };
        Ok(Worker {
            shared: Arc::new(Shared {
                connection: self.connection,
                config,
                handlers: self.handlers,
                leases: Mutex::new(HashMap::new()),
                stats: Counters::default(),
                lease_ended: Notify::new(),
                running: AtomicBool::new(false),
                observer: self.observer,
            }),
        })
    }
}

/// Leases intents from outboxd and runs the handler registered for their kind.
///
/// ```no_run
/// # async fn f(connection: outboxd_client::Connection) -> Result<(), outboxd_client::Error> {
/// use outboxd_client::{Failure, Job, Worker};
/// let worker = Worker::builder(connection)
///     .concurrency(16)
///     .handler("email.send", |job: Job| async move {
///         println!("sending {} (attempt {})", job.id(), job.attempt());
///         Ok::<_, Failure>(())
///     })
///     .build()?;
/// worker.run().await // until SIGTERM or Ctrl-C, then drains
/// # }
/// ```
///
/// What it does for you:
/// - **Claims only for free slots**: `max_intents` is the number of idle handler slots
///   (at most 1,000), so it never holds a lease it cannot start. It long-polls. While
///   there is a backlog it waits for [`WorkerBuilder::claim_batch`] free slots (or
///   [`WorkerBuilder::claim_linger`]), so quick handlers share a Claim and an Ack.
/// - **Replays lost claims**: each Claim has a `request_id`; a transient failure is
///   retried with the same id (on the next endpoint), so the leases a lost answer
///   carried are returned instead of stranded until they expire (unless
///   [`WorkerBuilder::replay_claims`] turned it off).
/// - **Heartbeats**: every third of the lease, live leases are extended in one
///   `ExtendLease` call. A lease answered `LEASE_LOST`, or whose local expiry (counted
///   from the Claim's send, or for a late answer from the `ExtendLease` that renewed it)
///   passes without an extension, is lost: its handler is cancelled
///   ([`Job::cancellation_token`] fires, then its task is aborted) and nothing is
///   reported for it.
/// - **Batched settles**: Acks and Fails go out in one call each; each item's result is
///   applied on its own; a call that gets no answer is retried with the same items.
///   While 4,000 results await their settle (Acks slower than the handlers), it claims
///   nothing more.
/// - **Failover**: transient failures move to the next endpoint (see [`Connection`]).
/// - **Drain**: when the shutdown future resolves, it stops claiming (a long poll in
///   flight is cancelled: what it took as the stop came expires with its lease, kept by
///   the server for a retry of its request id), running handlers get the
///   grace, every settle is sent, and handlers still running are aborted and failed
///   `RETRY` (`UNKNOWN` once submitted). Then `run_until` returns.
///
/// Dropping the future of `run_until` instead stops everything at once, like a crash:
/// nothing more is reported, and the leases expire.
#[derive(Clone)]
pub struct Worker {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("worker_id", &self.shared.config.worker_id)
            .field("kinds", &self.shared.config.kinds)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker calling outboxd through `connection`; add handlers, then `build()`.
    pub fn builder(connection: Connection) -> WorkerBuilder {
        WorkerBuilder {
            connection,
            handlers: HashMap::new(),
            duplicate: None,
            worker_id: None,
            region: String::new(),
            kinds: None,
            concurrency: 16,
            claim_batch: None,
            claim_linger: Duration::from_millis(5),
            lease: Duration::from_secs(30),
            claim_wait: Duration::from_secs(5),
            grace: Duration::from_secs(30),
            settle_delay: Duration::from_millis(2),
            replay_claims: true,
            observer: None,
        }
    }

    /// The `worker_id` sent with Claim.
    pub fn worker_id(&self) -> &str {
        &self.shared.config.worker_id
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> WorkerStats {
        let s = &self.shared.stats;
        WorkerStats {
            claimed: s.claimed.get(),
            acked: s.acked.get(),
            failed: s.failed.get(),
            lease_lost: s.lease_lost.get(),
            heartbeat_failures: s.heartbeat_failures.get(),
            claim_retries: s.claim_retries.get(),
            settle_errors: s.settle_errors.get(),
            claims_paused: s.claims_paused.get(),
            running: s.running.get(),
        }
    }

    /// Runs until SIGTERM or SIGINT (Ctrl-C), then drains; see [`Worker::run_until`].
    ///
    /// # Errors
    /// As [`Worker::run_until`].
    pub async fn run(&self) -> Result<(), Error> {
        self.run_until(shutdown_signal()).await
    }

    /// Claims and handles intents until `shutdown` resolves (a signal, a
    /// `CancellationToken::cancelled()`, a channel), then drains: no new claims, running
    /// handlers get the grace, every settle is sent, and the handlers still running are
    /// aborted and failed `RETRY` (`UNKNOWN` once submitted). Returns after the drain.
    ///
    /// # Errors
    /// A Claim refused for a reason a retry cannot cure (`UNAUTHENTICATED`,
    /// `PERMISSION_DENIED`, `INVALID_ARGUMENT`): the worker drains and returns it.
    /// [`Error::Invalid`] if this worker is running already.
    pub async fn run_until<F: Future>(&self, shutdown: F) -> Result<(), Error> {
        if self.shared.running.swap(true, Ordering::AcqRel) {
            return Err(Error::Invalid(
                "outboxd worker: this worker is running already".into(),
            ));
        }
        let _running = ClearOnDrop(&self.shared.running);
        let shared = &self.shared;
        // Leases a crashed (dropped) run left behind are not ours to extend.
        shared
            .leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        let stop = CancellationToken::new();
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        // Owned by this future: dropping it (a crash) stops them too.
        let heartbeats = AbortOnDrop(tokio::spawn(shared.clone().heartbeat_loop()));
        let settler = AbortOnDrop(tokio::spawn(settle::settle_loop(shared.clone(), settle_rx)));
        let mut jobs = JoinSet::new();

        let fatal = {
            let claims = shared.claim_loop(&stop, &mut jobs, &settle_tx);
            tokio::pin!(claims, shutdown);
            let mut shutting_down = false;
            loop {
                tokio::select! {
                    fatal = &mut claims => break fatal,
                    () = async { (&mut shutdown).await; }, if !shutting_down => {
                        shutting_down = true;
                        stop.cancel();
                    }
                }
            }
        };

        // Settles may run past the grace by SETTLE_AFTER_GRACE at most: against a server that
        // does not answer, the exit is bounded (their leases expire instead).
        let settles_end = Instant::now() + shared.config.grace + SETTLE_AFTER_GRACE;
        shared.drain(&mut jobs).await;
        drop(settle_tx);
        let mut settler = settler;
        if tokio::time::timeout_at(settles_end, &mut settler.0)
            .await
            .is_err()
        {
            tracing::warn!(
                worker = %shared.config.worker_id,
                "outboxd settles still unanswered {SETTLE_AFTER_GRACE:?} after the grace; \
                 their leases expire instead"
            );
        }
        drop(heartbeats);
        match fatal {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

impl Shared {
    /// Claims for free slots until `stop`; a refusal no retry can cure ends it (returned).
    async fn claim_loop(
        self: &Arc<Self>,
        stop: &CancellationToken,
        jobs: &mut JoinSet<()>,
        settles: &mpsc::UnboundedSender<Settle>,
    ) -> Option<Error> {
        let slots = Arc::new(Semaphore::new(self.config.concurrency));
        // The last Claim got fewer leases than it asked for: the queue is short, so
        // waiting for company would only add latency.
        let mut short = true;
        loop {
            while jobs.try_join_next().is_some() {}
            if !self.settles_keep_up(stop).await {
                return None;
            }
            let first = tokio::select! {
                biased;
                () = stop.cancelled() => return None,
                permit = slots.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            };
            let mut permits = vec![first];
            while permits.len() < MAX_BATCH {
                match slots.clone().try_acquire_owned() {
                    Ok(permit) => permits.push(permit),
                    Err(_) => break,
                }
            }
            if !short {
                // A backlog: quick handlers free their slots within moments of each
                // other, and one Claim (then one Ack) for all of them costs PostgreSQL
                // one commit instead of one each.
                let linger = tokio::time::sleep(self.config.claim_linger);
                tokio::pin!(linger);
                while permits.len() < self.config.claim_batch {
                    tokio::select! {
                        biased;
                        () = stop.cancelled() => return None,
                        permit = slots.clone().acquire_owned() => {
                            permits.push(permit.expect("the semaphore is never closed"));
                        }
                        () = &mut linger => break,
                    }
                }
            }
            let asked = permits.len();
            let claimed = tokio::select! {
                biased;
                // Leases already taken are run even if a stop came meanwhile: they were
                // claimed before it, and get the grace like any other.
                claimed = self.claim(asked) => claimed,
                // A cancelled long poll gives back whatever it leased.
                () = stop.cancelled() => return None,
            };
            match claimed {
                Ok((leases, first_sent, late)) => {
                    short = leases.len() < asked;
                    // Renewed even if a stop comes meanwhile: these leases are held, and
                    // run like the others, never left to expire unseen.
                    let (leases, leased_at) = if late {
                        self.renew_claimed(leases, first_sent).await
                    } else {
                        (leases, first_sent)
                    };
                    for lease in leases {
                        self.start(lease, leased_at, permits.pop(), jobs, settles);
                    }
                }
                Err(error) => {
                    tracing::error!(worker = %self.config.worker_id, "outboxd Claim refused: {error}");
                    return Some(error);
                }
            }
        }
    }

    /// One logical Claim of up to `n` leases: retried with the same `request_id` until
    /// it is answered, so a lost answer's leases are returned by the replay. Also returns
    /// its first send, on this clock, and whether it was answered late (its leases are
    /// then renewed before they start: [`Self::renew_claimed`]).
    async fn claim(&self, n: usize) -> Result<(Vec<proto::Lease>, Instant, bool), Error> {
        let config = &self.config;
        let request_id = config.replay_claims.then(|| Uuid::new_v4().to_string());
        let request = proto::ClaimRequest {
            worker_id: config.worker_id.clone(),
            region: config.region.clone(),
            kinds: config.kinds.clone(),
            max_intents: i32::try_from(n).unwrap_or(i32::MAX),
            lease_duration: Some(proto_duration(config.lease)),
            wait: Some(proto_duration(config.claim_wait)),
            request_id: request_id.clone().unwrap_or_default(),
        };
        let timeout = self.connection.call_timeout();
        let options = CallOptions::new(config.claim_wait.saturating_add(timeout))
            .budget(config.lease.max(timeout));
        let first_sent = Instant::now();
        let mut attempts = Attempts::default();
        let mut backoff = Backoff::default();
        loop {
            let tried_before = attempts.count;
            let answer = self
                .connection
                .call_traced(options, &mut attempts, |mut client| {
                    let request = request.clone();
                    async move { client.claim(request).await }
                })
                .await;
            self.stats
                .claim_retries
                .add(u64::from((attempts.count - tried_before).saturating_sub(1)));
            match answer {
                Ok(answer) => {
                    self.observe(|o| {
                        o.claimed(&ClaimEvent {
                            request_id: request_id.as_deref(),
                            max_intents: n,
                            lease_duration: config.lease,
                            leases: &answer.leases,
                            attempts: &attempts,
                        });
                    });
                    // Answered within the margin, its leases began after the send, and not
                    // long before the answer. Later (a long poll's wait, a retry, or an
                    // answer held on its way back), they may have begun long before it.
                    let margin = Duration::from_secs(1).min(config.lease / 4);
                    return Ok((answer.leases, first_sent, first_sent.elapsed() > margin));
                }
                Err(Error::Status(status)) if Retry::Transient.allows(&status) => {
                    // The budget is spent: keep the request_id and keep trying, slower.
                    tracing::warn!(worker = %config.worker_id, "outboxd Claim: {status}");
                    self.stats.claim_retries.add(1);
                    attempts.record_retry(*status);
                    tokio::time::sleep(backoff.next()).await;
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Leases of a Claim answered late, which may have begun at any time since its first
    /// send (a long poll's wait, fresh leases of a retry, an answer held on its way back):
    /// one ExtendLease gives every one a known expiry, counted from its send; those it
    /// finds lost are dropped unstarted. If it fails, or fails for one of them without
    /// losing it, they count from the Claim's first send, the earliest they can have begun.
    async fn renew_claimed(
        &self,
        leases: Vec<proto::Lease>,
        first_sent: Instant,
    ) -> (Vec<proto::Lease>, Instant) {
        if leases.is_empty() {
            return (leases, first_sent);
        }
        let states: Vec<Arc<LeaseState>> = leases
            .iter()
            .map(|lease| {
                let intent_id = lease.intent.as_ref().map_or("", |i| i.id.as_str());
                Arc::new(LeaseState::new(
                    intent_id.to_owned(),
                    lease.lease_id.clone(),
                    first_sent + self.config.lease,
                ))
            })
            .collect();
        let sent = Instant::now();
        for chunk in states.chunks(MAX_BATCH) {
            self.extend(chunk).await;
        }
        let unrenewed = first_sent + self.config.lease;
        let mut unsure = false;
        let mut kept = Vec::with_capacity(leases.len());
        for (lease, state) in leases.into_iter().zip(&states) {
            if state.is_lost() {
                // Counted lost by the extension; never started.
                self.stats.claimed.add(1);
                continue;
            }
            unsure |= state.expires() <= unrenewed;
            kept.push(lease);
        }
        (kept, if unsure { first_sent } else { sent })
    }

    /// Tells the observer, if there is one (`event` is not run otherwise).
    fn observe(&self, event: impl FnOnce(&dyn WorkerObserver)) {
        if let Some(observer) = &self.observer {
            event(observer.as_ref());
        }
    }

    fn start(
        self: &Arc<Self>,
        lease: proto::Lease,
        leased_at: Instant,
        permit: Option<OwnedSemaphorePermit>,
        jobs: &mut JoinSet<()>,
        settles: &mpsc::UnboundedSender<Settle>,
    ) {
        self.stats.claimed.add(1);
        let Some(intent) = lease.intent else {
            tracing::error!(lease = %lease.lease_id, "outboxd Claim answered a lease without its intent");
            return;
        };
        let state = Arc::new(LeaseState::new(
            intent.id.clone(),
            lease.lease_id.clone(),
            leased_at + self.config.lease,
        ));
        // Past its local expiry before it started (a late answer whose renewal failed):
        // the lease may be rescued and leased again by now, so the side effect is not
        // begun. The intent comes back after expiry.
        if Instant::now() >= state.expires() {
            self.lose(&state, "it expired before the Claim's answer arrived");
            return;
        }
        self.leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(lease.lease_id.clone(), state.clone());
        let job = Job::new(
            intent,
            lease.lease_id,
            lease.attempt,
            state.clone(),
            self.clone(),
        );
        let shared = self.clone();
        let settles = settles.clone();
        self.stats.running.add(1);
        let running = Running(shared.clone());
        jobs.spawn(async move {
            let outcome = shared.run_handler(job, &state).await;
            drop(running);
            // The slot is free once the handler is done; its settle does not hold one.
            drop(permit);
            match outcome {
                Some(outcome) if !state.is_lost() => {
                    let settle = Settle {
                        lease: state,
                        outcome,
                    };
                    if let Err(unsent) = settles.send(settle) {
                        shared.forget(&unsent.0.lease);
                    }
                }
                _ => shared.forget(&state),
            }
        });
    }

    /// Runs the kind's handler in a task of its own (so a panic or an abort stays there)
    /// and says what to report.
    async fn run_handler(&self, job: Job, lease: &Arc<LeaseState>) -> Option<Outcome> {
        let kind = job.kind().to_owned();
        let Some(handler) = self.handlers.get(&kind).cloned() else {
            let mut known: Vec<&str> = self.handlers.keys().map(String::as_str).collect();
            known.sort_unstable();
            let error = format!(
                "no handler for kind {kind} in worker {} (handlers: {})",
                self.config.worker_id,
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            );
            tracing::error!(intent = %lease.intent_id, "outboxd worker: {error}");
            lease.finish();
            return Some(fail(FailOutcome::Permanent, error, None));
        };
        let span = crate::trace::handler_span(
            &kind,
            job.id(),
            job.attempt(),
            &self.config.worker_id,
            job.headers(),
        );
        let mut task = AbortOnDrop(tokio::spawn(
            async move { handler(job).await }.instrument(span),
        ));
        lease.set_handler(task.0.abort_handle());
        let result = (&mut task.0).await;
        lease.finish();
        let submitted = lease.is_submitted();
        match result {
            Ok(Ok(())) => Some(Outcome::Ack),
            Ok(Err(failure)) => {
                let outcome = match failure.kind() {
                    FailureKind::LeaseLost => return None,
                    FailureKind::Retry(_) => FailOutcome::Retry,
                    FailureKind::Permanent => FailOutcome::Permanent,
                    FailureKind::Unknown => FailOutcome::Unknown,
                    // Once submitted, nobody knows whether the external call happened.
                    FailureKind::Error(_) if submitted => FailOutcome::Unknown,
                    FailureKind::Error(_) => FailOutcome::Retry,
                };
                let retry_after = match failure.kind() {
                    FailureKind::Retry(after) => after,
                    FailureKind::Error(after) if !submitted => after,
                    _ => None,
                };
                tracing::warn!(
                    worker = %self.config.worker_id,
                    intent = %lease.intent_id,
                    kind = %kind,
                    // As cut for the Fail: a handler's message may be of any length.
                    "outboxd handler failed: {}",
                    fail_text(&failure.to_string())
                );
                Some(fail(outcome, failure.message().to_owned(), retry_after))
            }
            Err(error) if error.is_panic() => {
                let panic = error.into_panic();
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-string payload".to_owned());
                tracing::error!(
                    worker = %self.config.worker_id,
                    intent = %lease.intent_id,
                    kind = %kind,
                    "outboxd handler panicked: {}",
                    fail_text(&message)
                );
                let outcome = if submitted {
                    FailOutcome::Unknown
                } else {
                    FailOutcome::Retry
                };
                Some(fail(outcome, format!("handler panicked: {message}"), None))
            }
            // Aborted: its lease was lost (nothing to report), or the grace ended.
            Err(_) if lease.is_abandoned() && !lease.is_lost() => {
                // Give it back now instead of waiting for the lease to expire. Once
                // submitted, nobody knows whether the call happened.
                let outcome = if submitted {
                    FailOutcome::Unknown
                } else {
                    FailOutcome::Retry
                };
                let error = format!(
                    "worker {} shut down before the handler finished",
                    self.config.worker_id
                );
                Some(fail(outcome, error, None))
            }
            Err(_) => None,
        }
    }

    /// `Job::submitting`: MarkSubmitted for one lease.
    async fn mark_submitted(&self, lease: &LeaseState) -> Result<(), Failure> {
        // Lost first: a later submitting() on a lost lease must not start its call either.
        if lease.is_lost() || lease.is_abandoned() {
            return Err(Failure::lease_lost(format!(
                "the lease on {} was lost before MarkSubmitted",
                lease.intent_id
            )));
        }
        if lease.is_submitted() {
            return Ok(());
        }
        // Not marked by this call: an error of no class, which the handler's end makes RETRY,
        // or UNKNOWN if by then a submitting() beside this one marked the lease (its external
        // call may have begun).
        let not_marked = Failure::from;
        // Worth trying while the lease lives.
        let left = lease
            .expires()
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(500));
        let options = CallOptions::new(self.lease_call_timeout().min(left)).budget(left);
        let request = proto::MarkSubmittedRequest {
            leases: vec![lease.reference()],
        };
        self.observe(|o| o.sending(lease.id(), LeaseCall::MarkSubmitted));
        let mut attempts = Attempts::default();
        let answer = self
            .connection
            .call_traced(options, &mut attempts, |mut client| {
                let request = request.clone();
                async move { client.mark_submitted(request).await }
            })
            .await;
        self.observe(|o| {
            let result = answer.as_ref().map(|a| a.results.first());
            if let Some(result) = result.transpose() {
                let answer = Answer {
                    result,
                    attempts: &attempts,
                };
                o.answered(lease.id(), LeaseCall::MarkSubmitted, &answer);
            }
        });
        let answer = match answer {
            Ok(answer) => answer,
            // This call's external call has not started.
            Err(error) => return Err(not_marked(format!("MarkSubmitted failed: {error}"))),
        };
        let Some(result) = answer.results.first() else {
            // Not known to be marked: the external call must not start.
            return Err(not_marked("MarkSubmitted answered without a result".into()));
        };
        match &result.error {
            None => {
                lease.set_submitted();
                Ok(())
            }
            Some(error) if LOST_REASONS.contains(&error.reason.as_str()) => {
                self.lose(lease, "MarkSubmitted refused");
                Err(Failure::lease_lost(format!(
                    "MarkSubmitted refused: {} {}",
                    error.reason, error.message
                )))
            }
            Some(error) => Err(not_marked(format!(
                "MarkSubmitted refused: {} {}",
                error.reason, error.message
            ))),
        }
    }

    /// One try of a settle or MarkSubmitted: short enough that a replica that never answers
    /// leaves time within the lease for a retry on the next one.
    fn lease_call_timeout(&self) -> Duration {
        self.connection
            .call_timeout()
            .min(self.config.heartbeat.max(Duration::from_secs(1)))
    }

    /// Marks a lease lost (its handler is cancelled); counted and logged once.
    fn lose(&self, lease: &LeaseState, why: &str) {
        if lease.lose() {
            self.stats.lease_lost.add(1);
            self.observe(|o| o.lease_lost(lease.id(), why));
            tracing::warn!(
                worker = %self.config.worker_id,
                intent = %lease.intent_id,
                "outboxd lease lost: {why}"
            );
        }
    }

    fn forget(&self, lease: &LeaseState) {
        self.leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&lease.lease_id);
        self.lease_ended.notify_waiters();
    }

    /// Waits while `UNSETTLED_MAX` results await their settle (live leases beyond the
    /// handler slots); false once `stop` comes.
    async fn settles_keep_up(&self, stop: &CancellationToken) -> bool {
        let mut paused = false;
        loop {
            // Made before the count: a lease that ends in between still wakes it.
            let ended = self.lease_ended.notified();
            let live = self.leases.lock().unwrap_or_else(|e| e.into_inner()).len();
            if live < self.config.concurrency + UNSETTLED_MAX {
                return true;
            }
            if !paused {
                paused = true;
                self.stats.claims_paused.add(1);
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => return false,
                () = ended => {}
            }
        }
    }

    /// Extends every live lease each third of the lease; a lease whose local expiry
    /// passes without an extension is lost (it may be rescued and re-leased by now). The
    /// extension runs beside the expiry checks, so a hung call does not hold them back,
    /// and one at a time.
    async fn heartbeat_loop(self: Arc<Self>) {
        let tick = self.config.heartbeat.min(Duration::from_millis(250));
        let mut ticks = tokio::time::interval(tick);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = Instant::now();
        // Dropped with this loop's task: an extension in flight ends with it.
        let mut extending = JoinSet::new();
        loop {
            ticks.tick().await;
            let now = Instant::now();
            let live: Vec<Arc<LeaseState>> = self
                .leases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .filter(|lease| !lease.is_lost())
                .cloned()
                .collect();
            for lease in &live {
                // A lease whose settle is in flight is left to that call's answer.
                if now >= lease.expires() && !lease.is_settling() {
                    self.lose(lease, "it expired before a heartbeat got through");
                }
            }
            while extending.try_join_next().is_some() {}
            if now.duration_since(last) >= self.config.heartbeat && extending.is_empty() {
                last = now;
                // One lease per intent in a call (the server refuses a repeated intent): a
                // lease whose settle is in flight gives way to a newer lease of its intent.
                let mut by_intent: HashMap<&str, &Arc<LeaseState>> = HashMap::new();
                for lease in live.iter().filter(|l| !l.is_lost()) {
                    let kept = by_intent.entry(lease.intent_id.as_str()).or_insert(lease);
                    if kept.is_settling() && !lease.is_settling() {
                        *kept = lease;
                    }
                }
                let live: Vec<Arc<LeaseState>> = by_intent.into_values().cloned().collect();
                let this = self.clone();
                extending.spawn(async move {
                    for chunk in live.chunks(MAX_BATCH) {
                        this.extend(chunk).await;
                    }
                });
            }
        }
    }

    async fn extend(&self, leases: &[Arc<LeaseState>]) {
        let sent = Instant::now();
        let request = proto::ExtendLeaseRequest {
            leases: leases.iter().map(|l| l.reference()).collect(),
            lease_duration: Some(proto_duration(self.config.lease)),
        };
        // A third of the interval a try (at least 0.5 s), so that a replica that never
        // answers (two in a row) leaves time for the next endpoint within the round.
        let heartbeat = self.config.heartbeat;
        let try_timeout = (heartbeat / 3)
            .max(Duration::from_millis(500))
            .min(heartbeat)
            .min(self.connection.call_timeout());
        let options = CallOptions::new(try_timeout).budget(heartbeat);
        self.observe(|o| {
            for lease in leases {
                o.sending(lease.id(), LeaseCall::ExtendLease);
            }
        });
        let mut attempts = Attempts::default();
        let answer = self
            .connection
            .call_traced(options, &mut attempts, |mut client| {
                let request = request.clone();
                async move { client.extend_lease(request).await }
            })
            .await;
        self.observe(|o| {
            for (i, lease) in leases.iter().enumerate() {
                let result = answer.as_ref().map(|a| a.results.get(i));
                if let Some(result) = result.transpose() {
                    let answer = Answer {
                        result,
                        attempts: &attempts,
                    };
                    o.answered(lease.id(), LeaseCall::ExtendLease, &answer);
                }
            }
        });
        let answer = match answer {
            Ok(answer) => answer,
            Err(error) => {
                self.stats.heartbeat_failures.add(1);
                tracing::warn!(worker = %self.config.worker_id, "outboxd ExtendLease: {error}");
                return;
            }
        };
        for (lease, result) in leases.iter().zip(&answer.results) {
            match &result.error {
                None => lease.extend_to(sent + self.config.lease),
                // Settled meanwhile: the settle's answer counts, not this one.
                Some(_) if lease.is_settling() => {}
                Some(error) if LOST_REASONS.contains(&error.reason.as_str()) => {
                    self.lose(lease, "ExtendLease refused");
                }
                Some(error) => {
                    self.stats.heartbeat_failures.add(1);
                    tracing::warn!(
                        worker = %self.config.worker_id,
                        intent = %lease.intent_id,
                        "outboxd ExtendLease refused: {} {}",
                        error.reason,
                        error.message
                    );
                }
            }
        }
    }

    /// After the claim loop stopped: the grace for running handlers, then those still
    /// running are abandoned (their supervisors queue a Fail), and every supervisor ends.
    async fn drain(&self, jobs: &mut JoinSet<()>) {
        let grace = tokio::time::sleep(self.config.grace);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                next = jobs.join_next() => if next.is_none() { return },
                () = &mut grace => break,
            }
        }
        let running: Vec<Arc<LeaseState>> = self
            .leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|lease| !lease.is_finished())
            .cloned()
            .collect();
        if !running.is_empty() {
            tracing::warn!(
                worker = %self.config.worker_id,
                count = running.len(),
                "outboxd handlers did not finish within the grace; giving their intents back"
            );
        }
        for lease in running {
            lease.abandon();
        }
        while jobs.join_next().await.is_some() {}
    }
}

fn fail(outcome: FailOutcome, error: String, retry_after: Option<Duration>) -> Outcome {
    Outcome::Fail {
        outcome,
        error,
        retry_after,
    }
}

/// `<hostname>-<pid>-<random>`.
fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".to_owned());
    let random = Uuid::new_v4().simple().to_string();
    format!("{host}-{}-{}", std::process::id(), &random[..6])
}

/// SIGTERM or SIGINT.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(error) => {
                tracing::warn!("outboxd worker: no SIGTERM handler ({error}); Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Aborts the task when dropped: tasks of a worker end with its `run_until` future.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct ClearOnDrop<'a>(&'a AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
