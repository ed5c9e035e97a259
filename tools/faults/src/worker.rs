//! A worker process: Claim → for payments MarkSubmitted → perform the
//! side effect → Ack, sometimes Fail (RETRY, PERMANENT, UNKNOWN) or ExtendLease instead,
//! journaling every step. "Performing the side effect" is appending a `performed` line to
//! the journal before the Ack is sent: the journal is the external system whose duplicates
//! the checker counts.
//!
//! It behaves as a careful worker should: it retries a lost response with the same request
//! (same `request_id`, same lease), and it does not start a side effect on a lease that is
//! about to expire. Kills and stops by the orchestrator make it late anyway. Half of its
//! Claims carry no `request_id`, as a plain long poll does: those an enqueue of the same
//! replica may hand intents to (`outboxd::outbox::claim::handoff`), and a lost answer's leases
//! expire instead of being returned to the retry.

use std::path::PathBuf;
use std::time::Duration;

use outboxd::proto::v1;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::journal::{Event, FailKind, Journal, LeaseSeen, Outcome, Settle, now_us, timestamp_us};
use crate::read_back::CommitReader;
use crate::rng::Rng;
use crate::rpc::{CALL_TIMEOUT, CallError, Called, Rpc, request};
use crate::{API_KEY_ENV, PAYMENT_KIND};

/// How long a Claim long-polls.
const CLAIM_WAIT: Duration = Duration::from_secs(1);

/// Retry budget of one logical call (Claim, Ack, Fail, …): longer than a PostgreSQL crash
/// and restart, so most calls get through, short enough that some leases expire first.
const CALL_BUDGET: Duration = Duration::from_secs(10);

/// A side effect is started only if the lease has at least this much left.
const SAFETY_MARGIN_US: i64 = 300_000;

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

struct Worker {
    name: String,
    rpc: Rpc,
    rng: Rng,
    journal: Journal,
    lease: Duration,
    reader: Option<CommitReader>,
}

/// Runs until SIGTERM, then finishes the batch in hand and exits.
pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let key = std::env::var(API_KEY_ENV)?;
    let stop = crate::stop_on_sigterm()?;
    let mut worker = Worker {
        rpc: Rpc::new(&args.endpoints, &key, args.seed)?,
        rng: Rng::new(args.seed.rotate_left(17)),
        journal: Journal::create(&args.journal)?,
        lease: Duration::from_millis(args.lease_ms),
        reader: args.database_url.map(CommitReader::new),
        name: args.name,
    };
    while !stop.is_cancelled() {
        let leases = worker.claim(&stop).await;
        for lease in leases {
            worker.handle(&lease).await;
        }
    }
    Ok(())
}

impl Worker {
    async fn claim(&mut self, stop: &CancellationToken) -> Vec<LeaseSeen> {
        let request_id = self.rng.chance(0.5).then(Uuid::new_v4);
        let message = v1::ClaimRequest {
            worker_id: self.name.clone(),
            region: String::new(),
            kinds: vec![],
            max_intents: 1 + self.rng.below(3) as i32,
            lease_duration: Some(duration(self.lease)),
            wait: Some(duration(CLAIM_WAIT)),
            request_id: request_id.map(|id| id.to_string()).unwrap_or_default(),
        };
        let called = tokio::select! {
            called = self.rpc.call(CALL_BUDGET, |mut client| {
                let request = request(message.clone(), CLAIM_WAIT + CALL_TIMEOUT);
                async move { client.claim(request).await }
            }) => called,
            // A long-poll may hold the shutdown; nothing was taken if we drop it here, and
            // if something was, its lease expires like a killed worker's.
            _ = stop.cancelled() => return vec![],
        };
        let duration_ms = self.lease.as_millis() as i64;
        match called {
            Ok(Called {
                value,
                tries,
                errors,
                last_try,
                ..
            }) => {
                let leases: Vec<LeaseSeen> = value.leases.iter().filter_map(seen).collect();
                if !leases.is_empty() || tries > 1 {
                    self.journal.log(&Event::Claimed {
                        t: now_us(),
                        request: request_id,
                        duration_ms,
                        tries,
                        errors,
                        last_try,
                        leases: leases.clone(),
                    });
                }
                leases
            }
            Err(error) => {
                let tries = match &error {
                    CallError::Definite { tries, .. } | CallError::Exhausted { tries, .. } => {
                        *tries
                    }
                };
                self.journal.log(&Event::Claimed {
                    t: now_us(),
                    request: request_id,
                    duration_ms,
                    tries,
                    errors: vec![error.describe()],
                    last_try: now_us(),
                    leases: vec![],
                });
                tokio::time::sleep(Duration::from_millis(100)).await;
                vec![]
            }
        }
    }

    async fn handle(&mut self, lease: &LeaseSeen) {
        if lease.kind == PAYMENT_KIND {
            self.handle_payment(lease).await;
        } else {
            self.handle_idempotent(lease).await;
        }
    }

    /// An idempotent target: no MarkSubmitted; a lost Ack means a retry by someone else.
    async fn handle_idempotent(&mut self, lease: &LeaseSeen) {
        let roll = self.rng.below(100);
        if roll < 3 {
            self.fail(lease, FailKind::Permanent).await;
            return;
        }
        if roll < 10 {
            self.fail(lease, FailKind::Retry).await;
            return;
        }
        let mut expires = lease.expires;
        if roll < 12 {
            // Slow work: extend the lease half way through, as a long handler would.
            tokio::time::sleep(self.lease.mul_f64(0.6)).await;
            match self.extend(lease).await {
                Some(extended) => expires = extended,
                None => return,
            }
            tokio::time::sleep(self.lease.mul_f64(0.3)).await;
        } else {
            tokio::time::sleep(self.rng.millis(2, 25)).await;
        }
        if !self.still_mine(lease, expires) {
            return;
        }
        self.perform(lease);
        // The side effect's own latency: the window in which a kill or stop makes the
        // delivery a duplicate.
        tokio::time::sleep(self.rng.millis(0, 60)).await;
        self.ack(lease).await;
    }

    /// A non-idempotent target: MarkSubmitted before the call, so a lost outcome goes to an
    /// operator instead of a blind retry.
    async fn handle_payment(&mut self, lease: &LeaseSeen) {
        if !self.still_mine(lease, lease.expires) {
            return;
        }
        if !self.mark_submitted(lease).await {
            return;
        }
        tokio::time::sleep(self.rng.millis(2, 25)).await;
        let roll = self.rng.below(100);
        if roll < 4 {
            // The target refused outright: nothing happened, so a retry is safe.
            self.fail(lease, FailKind::Retry).await;
            return;
        }
        if roll < 8 {
            // The call timed out: it may or may not have happened.
            if self.rng.chance(0.5) {
                self.perform(lease);
            }
            self.fail(lease, FailKind::Unknown).await;
            return;
        }
        self.perform(lease);
        tokio::time::sleep(self.rng.millis(0, 60)).await;
        self.ack(lease).await;
    }

    fn still_mine(&self, lease: &LeaseSeen, expires: i64) -> bool {
        if now_us() + SAFETY_MARGIN_US < expires {
            return true;
        }
        self.journal.log(&Event::Skipped {
            t: now_us(),
            intent: lease.intent,
            lease: lease.lease,
            why: "lease about to expire".into(),
        });
        false
    }

    fn perform(&self, lease: &LeaseSeen) {
        self.journal.log(&Event::Performed {
            t: now_us(),
            intent: lease.intent,
            lease: lease.lease,
            attempt: lease.attempt,
        });
    }

    async fn mark_submitted(&mut self, lease: &LeaseSeen) -> bool {
        self.journal.log(&Event::MarkSent {
            t: now_us(),
            intent: lease.intent,
            lease: lease.lease,
        });
        let message = v1::MarkSubmittedRequest {
            leases: vec![lease_ref(lease)],
        };
        let called = self
            .rpc
            .call(CALL_BUDGET, |mut client| {
                let request = request(message.clone(), CALL_TIMEOUT);
                async move { client.mark_submitted(request).await }
            })
            .await;
        let tries = tries_of(&called);
        let result = outcome(called.map(|c| first(c.value.results)));
        let ok = result == Outcome::Ok;
        self.journal.log(&Event::Marked {
            t: now_us(),
            intent: lease.intent,
            lease: lease.lease,
            result,
            tries,
        });
        if ok {
            self.read_back(Settle::MarkSubmitted, lease).await;
        }
        ok
    }

    /// Extends the lease; the new expiry, or None when the lease is not ours any more.
    async fn extend(&mut self, lease: &LeaseSeen) -> Option<i64> {
        let message = v1::ExtendLeaseRequest {
            leases: vec![lease_ref(lease)],
            lease_duration: Some(duration(self.lease)),
        };
        let journal = &self.journal;
        let duration_ms = self.lease.as_millis() as i64;
        let called = self
            .rpc
            .call(CALL_BUDGET, |mut client| {
                // Logged per attempt, so the journal shows every try a lost response caused.
                journal.log(&Event::ExtendSent {
                    t: now_us(),
                    intent: lease.intent,
                    lease: lease.lease,
                    duration_ms,
                });
                let request = request(message.clone(), CALL_TIMEOUT);
                async move { client.extend_lease(request).await }
            })
            .await;
        let item = called.map(|c| first(c.value.results));
        let expires = item
            .as_ref()
            .ok()
            .and_then(|i| i.lease_expires_at.as_ref())
            .map(timestamp_us);
        let result = outcome(item);
        self.journal.log(&Event::Extended {
            t: now_us(),
            intent: lease.intent,
            lease: lease.lease,
            expires: expires.filter(|_| result == Outcome::Ok),
            result: result.clone(),
        });
        expires.filter(|_| result == Outcome::Ok)
    }

    async fn ack(&mut self, lease: &LeaseSeen) {
        self.journal.log(&Event::AckSent {
            t: now_us(),
            intent: lease.intent,
            lease: lease.lease,
        });
        let message = v1::AckRequest {
            leases: vec![lease_ref(lease)],
        };
        let called = self
            .rpc
            .call(CALL_BUDGET, |mut client| {
                let request = request(message.clone(), CALL_TIMEOUT);
                async move { client.ack(request).await }
            })
            .await;
        let tries = tries_of(&called);
        let (errors, via) = match &called {
            Ok(c) => (c.errors.clone(), Some((c.via, c.took_us))),
            Err(e) => (vec![e.describe()], None),
        };
        let result = outcome(called.map(|c| first(c.value.results)));
        let ok = result == Outcome::Ok;
        self.journal.log(&Event::Acked {
            t: now_us(),
            intent: lease.intent,
            lease: lease.lease,
            result,
            tries,
            errors,
            via,
        });
        if ok {
            self.read_back(Settle::Ack, lease).await;
        }
    }

    async fn fail(&mut self, lease: &LeaseSeen, kind: FailKind) {
        self.journal.log(&Event::FailSent {
            t: now_us(),
            intent: lease.intent,
            lease: lease.lease,
            outcome: kind,
        });
        let outcome_wire = match kind {
            FailKind::Retry => v1::FailOutcome::Retry,
            FailKind::Permanent => v1::FailOutcome::Permanent,
            FailKind::Unknown => v1::FailOutcome::Unknown,
        };
        let message = v1::FailRequest {
            failures: vec![v1::Failure {
                lease: Some(lease_ref(lease)),
                error: format!("injected {kind:?} by {}", self.name),
                outcome: outcome_wire as i32,
                retry_after: (kind == FailKind::Retry)
                    .then(|| duration(Duration::from_millis(100))),
            }],
        };
        let called = self
            .rpc
            .call(CALL_BUDGET, |mut client| {
                let request = request(message.clone(), CALL_TIMEOUT);
                async move { client.fail(request).await }
            })
            .await;
        let tries = tries_of(&called);
        let result = outcome(called.map(|c| first(c.value.results)));
        let ok = result == Outcome::Ok;
        self.journal.log(&Event::Failed {
            t: now_us(),
            intent: lease.intent,
            lease: lease.lease,
            outcome: kind,
            result,
            tries,
        });
        if ok {
            self.read_back(Settle::Fail, lease).await;
        }
    }

    /// Reads the intent back from another session right after `call` was answered OK
    /// for `lease`, and journals whether its change was already committed.
    async fn read_back(&mut self, call: Settle, lease: &LeaseSeen) {
        let Some(reader) = &mut self.reader else {
            return;
        };
        // Unreadable (PostgreSQL down): nothing to judge.
        if let Some(seen) = reader.read(lease.intent).await {
            self.journal.log(&Event::ReadBack {
                t: now_us(),
                intent: lease.intent,
                lease: lease.lease,
                call,
                committed: call.committed(&seen, lease.lease),
                seen: seen.state,
            });
        }
    }
}

fn seen(lease: &v1::Lease) -> Option<LeaseSeen> {
    let intent = lease.intent.as_ref()?;
    Some(LeaseSeen {
        intent: intent.id.parse().ok()?,
        lease: lease.lease_id.parse().ok()?,
        kind: intent.kind.clone(),
        attempt: lease.attempt,
        expires: timestamp_us(lease.lease_expires_at.as_ref()?),
        state: intent.state().as_str_name().to_owned(),
        handed_off: lease.attempt == 1
            && intent.created_at.is_some()
            && intent.updated_at == intent.created_at,
    })
}

fn lease_ref(lease: &LeaseSeen) -> v1::LeaseRef {
    v1::LeaseRef {
        intent_id: lease.intent.to_string(),
        lease_id: lease.lease.to_string(),
    }
}

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

fn first(mut results: Vec<v1::LeaseResult>) -> v1::LeaseResult {
    if results.is_empty() {
        v1::LeaseResult::default()
    } else {
        results.swap_remove(0)
    }
}

fn tries_of<T>(called: &Result<Called<T>, CallError>) -> u32 {
    match called {
        Ok(c) => c.tries,
        Err(CallError::Definite { tries, .. } | CallError::Exhausted { tries, .. }) => *tries,
    }
}

/// The per-item outcome of a one-lease settle call.
fn outcome(item: Result<v1::LeaseResult, CallError>) -> Outcome {
    match item {
        Ok(v1::LeaseResult { error: None, .. }) => Outcome::Ok,
        Ok(v1::LeaseResult {
            error: Some(error), ..
        }) if error.reason == "LEASE_LOST" => Outcome::LeaseLost,
        Ok(v1::LeaseResult {
            error: Some(error), ..
        }) => Outcome::Rejected(error.reason),
        Err(e @ CallError::Definite { .. }) => {
            Outcome::Rejected(e.reason().unwrap_or_else(|| e.describe()))
        }
        Err(e @ CallError::Exhausted { .. }) => Outcome::Unknown(e.describe()),
    }
}
