//! The gRPC service: `OutboxHandler` implements `outbox.v1.OutboxService`. Each method
//! validates (`crate::validate`), calls the store, and maps the result to the response;
//! errors become a `Status` here and nowhere else.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Response, Status};
use tonic_types::{ErrorDetails, StatusExt};
use tracing::Instrument;

use crate::auth::{Authenticator, Caller, Permission, TENANT_HEADER};
use crate::config::{Limits, Settings};
use crate::deadline::{bounded_wait, caller_timeout};
use crate::gate::{Authenticated, Gate};
use crate::metrics::{Metrics, OutcomeLabels};
use crate::outbox::claim_floor::{ClaimFloors, Leased};
use crate::outbox::drained::{DrainedGroups, Seen};
use crate::outbox::enqueue::DirectEnqueues;
use crate::outbox::handoff::{self, Wanted};
use crate::outbox::notify::PendingSignal;
use crate::outbox::store::{self, BackoffParams, ClaimParams, DeliveredRows, Pools, TenantScope};
use crate::outbox::{self, Clock, Error, FieldViolation, Intent, IntentId, IntentState, Reason};
use crate::proto::v1::outbox_service_server::{OutboxService, OutboxServiceServer};
use crate::proto::v1::{self};
use crate::telemetry::{self, TRACEPARENT};
use crate::validate;

/// Domain of every `ErrorInfo` outboxd sends.
pub const ERROR_DOMAIN: &str = "outboxd";

/// Serves `OutboxService` over the tenant and fleet pools (`store::Pools`).
#[derive(Debug, Clone)]
pub struct OutboxHandler {
    pools: Pools,
    auth: Arc<Authenticator>,
    cluster_id: Arc<str>,
    limits: Limits,
    backoff: BackoffParams,
    clock: Clock,
    pending: PendingSignal,
    shutdown: CancellationToken,
    long_poll_recheck: Duration,
    metrics: Arc<Metrics>,
    direct_enqueues: Arc<DirectEnqueues>,
    claim_floors: Arc<ClaimFloors>,
    drained: Arc<DrainedGroups>,
    /// Whether waiting claims may be handed intents by enqueues (`outbox::handoff`).
    hand_off: bool,
    delivered_rows: DeliveredRows,
}

/// Direct enqueues counted into `metrics`, giving the leases no claimer received back
/// through `pools` (`outbox::handoff`).
fn direct_enqueues(
    pools: &Pools,
    pending: &PendingSignal,
    clock: &Clock,
    metrics: &Metrics,
) -> Arc<DirectEnqueues> {
    let release = handoff::give_back(
        pools.clone(),
        pending.clone(),
        clock.clone(),
        metrics.given_back.clone(),
    );
    Arc::new(DirectEnqueues::new(metrics, release))
}

impl OutboxHandler {
    /// Enqueue inside its "send" span. Each intent carries the trace context it was produced
    /// in (its own `traceparent` header, else this span's, else the caller's metadata), so
    /// the worker's spans can link back to the producer's trace.
    async fn enqueue_traced(
        &self,
        request: Request<v1::EnqueueRequest>,
        remote_traceparent: Option<String>,
    ) -> RpcResult<v1::EnqueueResponse> {
        let (caller, scope) = self.access(&request, Permission::Produce).await?;
        let tenant = scope
            .single()
            .ok_or_else(|| {
                Error::InvalidArgument(vec![FieldViolation::new(
                    TENANT_HEADER,
                    "this API key acts for several tenants: name the one to enqueue for in the \
                     x-outbox-tenant metadata",
                )])
            })?
            .to_owned();
        let (mut intents, token) = validate::enqueue(request.into_inner(), &self.limits)?;
        for (i, intent) in intents.iter().enumerate() {
            caller.require_region(&format!("intents[{i}].region"), &intent.region)?;
        }
        let span = tracing::Span::current();
        span.record("messaging.batch.message_count", intents.len());
        if let Some(tp) = telemetry::traceparent_of(&span).or(remote_traceparent) {
            for intent in &mut intents {
                intent
                    .headers
                    .entry(TRACEPARENT.to_owned())
                    .or_insert_with(|| tp.clone());
            }
        }
        let direct = token.is_none();
        let results = outbox::enqueue::enqueue(
            &self.pools,
            &self.direct_enqueues,
            &self.cluster_id,
            &tenant,
            intents,
            token,
            self.clock.now(),
        )
        .await
        .inspect_err(|e| {
            // They may be PENDING: claimers look rather than wait for their recheck.
            if direct && matches!(e, Error::CommitOutcomeUnknown) {
                self.pending.announce();
            }
        })?;
        let recorded = results.iter().filter(|r| !r.deduplicated).count();
        let handed_off = results.iter().filter(|r| r.handed_off).count();
        // Committed: wake claimers (delayed intents too, so a claimer's sleep is cut to the
        // earliest due), unless every intent was handed to a waiting claim already
        // (`outbox::handoff`). Staged intents are announced by their promotion.
        if direct && recorded > handed_off {
            self.pending.announce();
        }
        self.metrics.enqueued.inc_by(recorded as u64);
        Ok(Response::new(v1::EnqueueResponse {
            results: results.into_iter().map(Into::into).collect(),
        }))
    }

    /// The caller (authenticated by the [`Gate`] before the body was decoded, or here
    /// when the handler is served without it), checked to hold `permission`, and the
    /// tenants this request acts for.
    async fn access<T>(
        &self,
        request: &Request<T>,
        permission: Permission,
    ) -> Result<(Caller, TenantScope), Error> {
        let caller = match request.extensions().get::<Authenticated>() {
            Some(Authenticated(caller)) => caller.clone(),
            None => self.auth.authenticate(request.metadata()).await?,
        };
        caller.require(permission)?;
        let scope = caller.scope(request.metadata())?;
        tracing::Span::current().record("auth.key", caller.key_name.as_str());
        Ok((caller, scope))
    }

    /// A handler for the cluster whose `system_identifier` is `cluster_id` (tokens must
    /// name it); `shutdown` ends waiting long-polls early (they answer with no leases).
    pub fn new(
        pools: Pools,
        auth: Arc<Authenticator>,
        cluster_id: String,
        settings: &Settings,
        clock: Clock,
        pending: PendingSignal,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            direct_enqueues: direct_enqueues(&pools, &pending, &clock, &Metrics::default()),
            pools,
            auth,
            cluster_id: cluster_id.into(),
            limits: settings.limits.clone(),
            backoff: settings.backoff(),
            clock,
            pending,
            shutdown,
            long_poll_recheck: Duration::from_secs(2),
            metrics: Arc::default(),
            claim_floors: Arc::default(),
            drained: Arc::default(),
            hand_off: settings.claim.hand_off,
            delivered_rows: DeliveredRows::for_retention(
                settings.maintenance.retention,
                settings.retention.history_by_batch,
            ),
        }
    }

    /// Records into `metrics` (by default into a private registry nobody reads).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.direct_enqueues = direct_enqueues(&self.pools, &self.pending, &self.clock, &metrics);
        self.metrics = metrics;
        self
    }

    /// How often a long-polling Claim looks again without a notification (a safety net
    /// for notifications lost while the LISTEN connection was down).
    pub fn with_long_poll_recheck(mut self, every: Duration) -> Self {
        self.long_poll_recheck = every;
        self
    }

    /// Wraps the handler in the generated tonic server, behind the [`Gate`] that
    /// authenticates each call and refuses request messages over their method's limit
    /// before decoding them (RESOURCE_EXHAUSTED, see `crate::gate` and `crate::codec`).
    pub fn into_server(
        self,
        max_message_bytes: usize,
    ) -> Gate<crate::codec::ClientFaults<OutboxServiceServer<Self>>> {
        let (auth, limits) = (self.auth.clone(), self.limits.clone());
        let server = crate::codec::ClientFaults::new(
            OutboxServiceServer::new(self).max_decoding_message_size(max_message_bytes),
        );
        Gate::new(server, auth, limits)
    }

    /// One look for intents of `group` (the whole queue, or from the group's floor), which
    /// began having seen `seen`; notes what it found for the group's floor and drained state
    /// (a replay, which did not look at the queue, notes nothing).
    async fn look(
        &self,
        scope: &TenantScope,
        group: &str,
        params: ClaimParams<'_>,
        whole_look: bool,
        seen: Seen,
    ) -> outbox::Result<Look> {
        let look_from = if whole_look {
            None
        } else {
            self.claim_floors.look_from(group, Instant::now())
        };
        let params = ClaimParams {
            now: self.clock.now(),
            look_back_to: look_from,
            ..params
        };
        let store::Claimed {
            intents,
            next_due_in,
            replayed,
            ran_out,
        } = store::claim_intents(&self.pools, scope, params).await?;
        let again_in = next_due_in.map_or(self.long_poll_recheck, |due| {
            due.min(self.long_poll_recheck)
        });
        let filled = !ran_out;
        if !replayed {
            let now = Instant::now();
            let leased = Leased::of(&intents);
            self.claim_floors.record(group, look_from, leased, now);
            self.drained.record(group, seen, !filled, again_in, now);
        }
        Ok(Look {
            intents,
            filled,
            again_in,
            replayed,
        })
    }

    /// Intents an enqueue handed this claim, counted as they reach it (not as they are
    /// sent: a claim cancelled before reading them has them given back instead).
    fn received_handed_off(&self, intents: Vec<Intent>) -> Vec<Intent> {
        self.metrics.handed_off.inc_by(intents.len() as u64);
        intents
    }
}

/// Splits intents, in the order of their reply, where they would make it more than
/// `budget` bytes: those that fit (at least one, whatever its size) and the rest.
fn split_at_reply_budget(mut intents: Vec<Intent>, budget: usize) -> (Vec<Intent>, Vec<Intent>) {
    let mut bytes = 0usize;
    let fit = intents
        .iter()
        .position(|i| {
            bytes = bytes.saturating_add(crate::proto::reply_bytes_at_most(i));
            bytes > budget
        })
        .map_or(intents.len(), |n| n.max(1));
    let rest = intents.split_off(fit);
    (intents, rest)
}

/// The gRPC code for a reason, for whole-call and per-item errors alike.
pub fn code_of(reason: Reason) -> Code {
    match reason {
        Reason::InvalidArgument => Code::InvalidArgument,
        Reason::Unauthenticated => Code::Unauthenticated,
        Reason::MissingScope | Reason::TenantNotAllowed | Reason::RegionNotAllowed => {
            Code::PermissionDenied
        }
        Reason::PayloadTooLarge | Reason::BatchTooLarge => Code::ResourceExhausted,
        Reason::NotFound => Code::NotFound,
        Reason::LeaseLost | Reason::InvalidState => Code::FailedPrecondition,
        Reason::IdempotencyConflict => Code::AlreadyExists,
        Reason::TxnAborted | Reason::IdempotencyKeyInUse => Code::Aborted,
        Reason::TxnCommitted => Code::FailedPrecondition,
        Reason::Unavailable | Reason::CommitOutcomeUnknown => Code::Unavailable,
        Reason::Conflict => Code::Aborted,
        Reason::Internal => Code::Internal,
    }
}

fn error_info(reason: Reason, metadata: HashMap<String, String>) -> ErrorDetails {
    ErrorDetails::with_error_info(reason.as_str(), ERROR_DOMAIN, metadata)
}

fn key_holder(reason: Reason, key: String, holder: IntentId) -> ErrorDetails {
    error_info(
        reason,
        HashMap::from([
            ("idempotency_key".to_owned(), key),
            ("intent_id".to_owned(), holder.to_string()),
        ]),
    )
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let message = e.to_string();
        let (reason, details) = match e {
            Error::InvalidArgument(violations) => {
                let mut d = error_info(Reason::InvalidArgument, HashMap::new());
                for v in violations {
                    d.add_bad_request_violation(v.field, v.description);
                }
                (Reason::InvalidArgument, d)
            }
            Error::LimitExceeded(reason, violations) => {
                let mut d = error_info(reason, HashMap::new());
                for v in violations {
                    d.add_bad_request_violation(v.field, v.description);
                }
                (reason, d)
            }
            Error::NotFound(id) => (
                Reason::NotFound,
                error_info(
                    Reason::NotFound,
                    HashMap::from([("intent_id".to_owned(), id.to_string())]),
                ),
            ),
            Error::IdempotencyConflict { key, existing } => (
                Reason::IdempotencyConflict,
                key_holder(Reason::IdempotencyConflict, key, existing),
            ),
            Error::IdempotencyKeyInUse { key, existing } => (
                Reason::IdempotencyKeyInUse,
                key_holder(Reason::IdempotencyKeyInUse, key, existing),
            ),
            Error::Unauthenticated(_) => (
                Reason::Unauthenticated,
                error_info(Reason::Unauthenticated, HashMap::new()),
            ),
            Error::PermissionDenied(reason, _) => (reason, error_info(reason, HashMap::new())),
            Error::TxnAborted(_) => (
                Reason::TxnAborted,
                error_info(Reason::TxnAborted, HashMap::new()),
            ),
            Error::TxnFinished(_) => (
                Reason::TxnCommitted,
                error_info(Reason::TxnCommitted, HashMap::new()),
            ),
            Error::KeyHolderGone { key } => (
                Reason::Conflict,
                error_info(
                    Reason::Conflict,
                    HashMap::from([("idempotency_key".to_owned(), key)]),
                ),
            ),
            Error::CommitOutcomeUnknown => (
                Reason::CommitOutcomeUnknown,
                error_info(Reason::CommitOutcomeUnknown, HashMap::new()),
            ),
            Error::Database(db) => {
                let reason = database_reason(&db);
                // The chain goes to the log; the client gets no SQL text.
                tracing::error!(error.cause_chain = ?db, error.message = %db, "database error");
                let message = match reason {
                    Reason::Unavailable => "the database is unavailable; retry with backoff",
                    Reason::Conflict => "a concurrent change conflicted; retry",
                    _ => "internal error; see the server log",
                };
                return Status::with_error_details(
                    code_of(reason),
                    message,
                    error_info(reason, HashMap::new()),
                );
            }
        };
        Status::with_error_details(code_of(reason), message, details)
    }
}

/// Classifies database failures: transient conflicts may be retried at once, outages with
/// backoff, anything else is a bug.
fn database_reason(e: &sqlx::Error) -> Reason {
    if is_outage(e) {
        return Reason::Unavailable;
    }
    match e {
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40001" | "40P01")) => {
            Reason::Conflict
        }
        _ => Reason::Internal,
    }
}

/// Whether the database could not be reached or used, rather than refused the statement:
/// every connection-level failure (refused, reset, closed mid-handshake or mid-statement,
/// as by a proxy or load balancer with no live backend during a failover; TLS; a garbled
/// or truncated reply; the pool's timeout or closing; its connection task gone), and what
/// PostgreSQL says while it cannot serve (connection errors, shutdown, crash recovery, too
/// many connections, a server still in recovery or demoted to a standby).
fn is_outage(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // 08: connection exception; 57P: operator intervention (shutdown, crash,
            // cannot connect now); 53300: too many connections; 25006: read-only
            // transaction (the address still leads to a standby, or a demoted primary).
            Some(c) => c.starts_with("08") || c.starts_with("57P") || c == "53300" || c == "25006",
            None => false,
        },
        _ => false,
    }
}

type RpcResult<T> = Result<Response<T>, Status>;

/// Runs an RPC's work in a task of its own. tonic drops a handler's future when its caller
/// goes away (a deadline, a reset stream), and every await would then be a place to stop
/// half way: a transaction begun and never ended, leases taken and never answered or given
/// back. In its own task the work always finishes, and an answer nobody waits for is
/// dropped; Claim alone stops early, told by its `gone` token.
async fn to_completion<T: Send + 'static>(
    work: impl Future<Output = RpcResult<T>> + Send + 'static,
) -> RpcResult<T> {
    match tokio::spawn(work.in_current_span()).await {
        Ok(answer) => answer,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(Status::unavailable("the server is shutting down; retry")),
    }
}

/// `messaging.system` of every span (OpenTelemetry messaging conventions).
const MESSAGING_SYSTEM: &str = "outboxd";

/// Links the current settle span to the producers of the intents it settled.
fn link_settled(results: &[outbox::ItemResult]) {
    telemetry::link_to(
        &tracing::Span::current(),
        results.iter().filter_map(|r| r.traceparent.as_deref()),
    );
}

/// What one look of a Claim call found.
struct Look {
    intents: Vec<outbox::Intent>,
    /// Whether it leased as many as asked (there may be more).
    filled: bool,
    /// How long its claimer (or the next of its group) may wait before looking again: the
    /// recheck, or the next delayed intent's due time if sooner.
    again_in: Duration,
    /// Its intents are an earlier call's leases (same request id), not newly claimed.
    replayed: bool,
}

/// The RPCs' work, each run to completion by [`to_completion`].
impl OutboxHandler {
    async fn enqueue_work(
        self,
        request: Request<v1::EnqueueRequest>,
    ) -> RpcResult<v1::EnqueueResponse> {
        // Built by hand rather than with #[instrument]: the producer's trace context must
        // become its parent before the span starts.
        let span = tracing::info_span!(
            "send",
            otel.name = "send",
            otel.kind = "producer",
            messaging.system = MESSAGING_SYSTEM,
            messaging.operation.type = "send",
            messaging.batch.message_count = tracing::field::Empty,
            rpc.method = "Enqueue",
            auth.key = tracing::field::Empty,
        );
        // Stored with each intent that has none of its own, so only a valid context, in
        // canonical form: the metadata is outside the limits the intents' headers are held to.
        let remote = request
            .metadata()
            .get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(telemetry::canonical_traceparent);
        if let Some(tp) = &remote {
            telemetry::set_remote_parent(&span, tp);
        }
        self.enqueue_traced(request, remote)
            .instrument(span)
            .await
            .inspect_err(|status| tracing::debug!(error = %status, "Enqueue refused"))
    }

    async fn claim_work(
        self,
        request: Request<v1::ClaimRequest>,
        gone: CancellationToken,
    ) -> RpcResult<v1::ClaimResponse> {
        // The caller's timeout runs from here (tonic's from a little before), not from
        // after the key lookup.
        let received = Instant::now();
        let (caller, scope) = self.access(&request, Permission::Consume).await?;
        let caller_timeout = caller_timeout(request.metadata());
        let claim = validate::claim(request.into_inner(), &self.limits)?;
        caller.require_region("region", &claim.region)?;
        tracing::Span::current().record("claim.worker", claim.worker_id.as_str());
        let params = ClaimParams {
            worker_id: &claim.worker_id,
            region: &claim.region,
            kinds: &claim.kinds,
            max_intents: claim.max_intents,
            lease_duration: claim.lease_duration,
            request_id: claim.request_id.as_deref(),
            key_id: caller.key_id,
            now: self.clock.now(),
            look_back_to: None,
            max_bytes: self.limits.max_reply_bytes,
        };
        // Before the caller's own deadline, if it set one: an answer it no longer waits for
        // would take its leases with it.
        let deadline = received + bounded_wait(claim.wait, caller_timeout);
        let mut woken = self.pending.subscribe();
        let group = format!("{scope:?} {:?} {:?}", claim.region, claim.kinds);
        let turn = self.pending.turn(group.clone());
        // A look after a wait that no wake-up ended (a recheck, the due time, the deadline)
        // is of the whole queue: a waiting claimer finds intents behind the floor by then.
        let mut whole_look = false;
        // A long poll that is not a replay (which must find its first attempt's leases) may
        // begin by waiting, without a look of its own, while its group is known to have
        // drained the queue (`outbox::drained`); while it waits, an enqueue of this server
        // may hand it intents (`outbox::handoff`).
        let long_poll = !claim.wait.is_zero() && claim.request_id.is_none();
        let mut may_skip_look = long_poll;
        let wanted = (self.hand_off && long_poll).then(|| Wanted {
            scope: scope.clone(),
            region: claim.region.clone(),
            kinds: claim.kinds.clone(),
            worker_id: claim.worker_id.clone(),
            lease_duration: claim.lease_duration,
            max_intents: usize::try_from(claim.max_intents).unwrap_or(0),
        });
        // Answering an earlier call's leases again (same request id): not claimed anew.
        let mut replayed = false;
        let intents = loop {
            // Mark the signal and the turns seen before looking, so a commit landing in
            // between still wakes us.
            let seen = Seen {
                signal: *woken.borrow_and_update(),
                turns: turn.mark(),
            };
            let skipped_until = if may_skip_look && !self.shutdown.is_cancelled() {
                self.drained.wait_until(&group, seen, Instant::now())
            } else {
                None
            };
            may_skip_look = false;
            let until = match skipped_until {
                Some(until) => until,
                None => {
                    let look = self.look(&scope, &group, params, whole_look, seen).await?;
                    let now = Instant::now();
                    if !look.intents.is_empty()
                        || now >= deadline
                        || self.shutdown.is_cancelled()
                        || gone.is_cancelled()
                    {
                        replayed = look.replayed;
                        if look.filled && !replayed {
                            // There may be more: the next waiting claimer of the group looks too.
                            turn.pass();
                        }
                        break look.intents;
                    }
                    now + look.again_in
                }
            };
            let until = deadline.min(until);
            // Registered before it counts as waiting: whoever sees it waiting may hand it
            // intents.
            let mut waiter = wanted
                .clone()
                .map(|w| self.direct_enqueues.handoffs().wait(w));
            let _waiting = self.metrics.claim_waiting();
            let handed = async {
                match &mut waiter {
                    Some(waiter) => waiter.handed().await,
                    None => std::future::pending().await,
                }
            };
            whole_look = tokio::select! {
                handed = handed => match handed {
                    Some(intents) => break self.received_handed_off(intents),
                    // The enqueue that took this claim failed: look again.
                    None => false,
                },
                _ = woken.changed() => false,
                _ = turn.given_since(seen.turns) => false,
                () = tokio::time::sleep_until(until) => true,
                () = self.shutdown.cancelled() => false,
                () = gone.cancelled() => false,
            };
            // An enqueue may have taken this claim just now: then its intents are ours, and
            // the turn that may have woken it goes to the next claimer of the group (it was
            // given for other intents).
            if let Some(waiter) = waiter
                && let Some(intents) = waiter.withdraw().await
                && !intents.is_empty()
            {
                turn.pass();
                break self.received_handed_off(intents);
            }
            // Shutting down: answer without leasing more, as the README promises. Or nobody
            // waits for an answer any more.
            if self.shutdown.is_cancelled() || gone.is_cancelled() {
                break Vec::new();
            }
        };
        // The caller went away (while we looked, or as an enqueue handed it intents): nobody
        // receives these leases, so they go back at once, attempts uncounted, instead of
        // waiting out their expiry. A replay's belong to an earlier call that may have had
        // its answer.
        if gone.is_cancelled() {
            if !replayed {
                self.direct_enqueues.handoffs().release(&scope, intents);
            }
            return Err(Status::cancelled("the caller went away before its answer"));
        }
        // A reply larger than the worker's client accepts would be refused after its leases
        // committed, costing each intent an attempt unseen: answer with those that fit and
        // give the rest back. Not a replay's: an earlier reply may have delivered them.
        let (intents, over_budget) = split_at_reply_budget(intents, self.limits.max_reply_bytes);
        if !over_budget.is_empty() && !replayed {
            self.direct_enqueues.handoffs().release(&scope, over_budget);
        }
        let span = tracing::Span::current();
        span.record("messaging.batch.message_count", intents.len());
        telemetry::link_to(
            &span,
            intents
                .iter()
                .filter_map(|i| i.headers.0.get(TRACEPARENT).map(String::as_str)),
        );
        if !replayed {
            let now = self.clock.now().unwrap_or_else(chrono::Utc::now);
            self.metrics.record_claimed(
                intents
                    .iter()
                    .map(|i| (now - i.available_at).to_std().unwrap_or_default()),
            );
        }
        Ok(Response::new(v1::ClaimResponse {
            leases: intents.into_iter().map(Into::into).collect(),
        }))
    }

    async fn extend_lease_work(
        self,
        request: Request<v1::ExtendLeaseRequest>,
    ) -> RpcResult<v1::ExtendLeaseResponse> {
        let (caller, scope) = self.access(&request, Permission::Consume).await?;
        let (leases, duration) = validate::extend(request.get_ref(), &self.limits)?;
        let scope = caller.settling(&scope);
        let results =
            store::extend_leases(&self.pools, scope, &leases, duration, self.clock.now()).await?;
        Ok(Response::new(v1::ExtendLeaseResponse {
            results: results.into_iter().map(Into::into).collect(),
        }))
    }

    async fn mark_submitted_work(
        self,
        request: Request<v1::MarkSubmittedRequest>,
    ) -> RpcResult<v1::MarkSubmittedResponse> {
        let (caller, scope) = self.access(&request, Permission::Consume).await?;
        let leases = validate::leases(&request.get_ref().leases, &self.limits)?;
        let scope = caller.settling(&scope);
        let results =
            store::mark_intents_submitted(&self.pools, scope, &leases, self.clock.now()).await?;
        Ok(Response::new(v1::MarkSubmittedResponse {
            results: results.into_iter().map(Into::into).collect(),
        }))
    }

    async fn ack_work(self, request: Request<v1::AckRequest>) -> RpcResult<v1::AckResponse> {
        let (caller, scope) = self.access(&request, Permission::Consume).await?;
        let leases = validate::leases(&request.get_ref().leases, &self.limits)?;
        let results = store::ack_intents(
            &self.pools,
            caller.settling(&scope),
            &leases,
            self.delivered_rows,
            self.clock.now(),
        )
        .await?;
        link_settled(&results);
        let acked = results.iter().filter(|r| r.applied).count();
        self.metrics.acked.inc_by(acked as u64);
        Ok(Response::new(v1::AckResponse {
            results: results.into_iter().map(Into::into).collect(),
        }))
    }

    async fn fail_work(self, request: Request<v1::FailRequest>) -> RpcResult<v1::FailResponse> {
        let (caller, scope) = self.access(&request, Permission::Consume).await?;
        let failures = validate::fail(request.into_inner(), &self.limits)?;
        let results = store::fail_intents(
            &self.pools,
            caller.settling(&scope),
            &failures,
            self.backoff,
            self.clock.now(),
        )
        .await?;
        link_settled(&results);
        if results
            .iter()
            .any(|r| r.applied && r.state == Some(IntentState::Pending))
        {
            // A retry is claimable again after its backoff: a claimer of each group looks
            // and learns its due time (a group that drained the queue would otherwise wait
            // until its recheck, `outbox::drained`).
            self.pending.announce();
        }
        for (failure, result) in failures.iter().zip(&results) {
            if !result.applied {
                continue;
            }
            let outcome = OutcomeLabels {
                outcome: failure.outcome.as_str().to_owned(),
            };
            self.metrics.failed.get_or_create(&outcome).inc();
            if result.state == Some(IntentState::DeadLettered) {
                self.metrics.dead_lettered.inc();
            }
        }
        Ok(Response::new(v1::FailResponse {
            results: results.into_iter().map(Into::into).collect(),
        }))
    }

    async fn reconcile_work(
        self,
        request: Request<v1::ReconcileRequest>,
    ) -> RpcResult<v1::ReconcileResponse> {
        let (caller, scope) = self.access(&request, Permission::Operate).await?;
        let r = validate::reconcile(request.into_inner(), &self.limits)?;
        if let store::ReconcileTarget::Filter {
            region: Some(region),
            ..
        } = &r.target
        {
            caller.require_region("filter.region", region)?;
        }
        let mut tx = store::begin(&self.pools, &scope).await?;
        let results = store::resolve_intents(
            &mut tx,
            store::ReconcileParams {
                target: r.target,
                decision: r.decision,
                key_regions: &caller.regions,
                actor: &r.actor,
                reason: &r.reason,
                now: self.clock.now(),
            },
        )
        .await?;
        tx.commit().await.map_err(Error::from)?;
        let applied = results.iter().filter(|r| r.error.is_none()).count();
        tracing::info!(
            reconcile.decision = r.decision.as_str(),
            reconcile.actor = %r.actor,
            reconcile.reason = %r.reason,
            auth.key = %caller.key_name,
            intents.count = applied,
            "operator resolved intents"
        );
        Ok(Response::new(v1::ReconcileResponse {
            results: results.into_iter().map(Into::into).collect(),
        }))
    }

    async fn get_intent_work(
        self,
        request: Request<v1::GetIntentRequest>,
    ) -> RpcResult<v1::GetIntentResponse> {
        let (caller, scope) = self.access(&request, Permission::Operate).await?;
        let id = validate::intent_id("id", &request.get_ref().id)?;
        let mut tx = store::begin(&self.pools, &scope).await?;
        let found = store::get_intent(&mut tx, id, &caller.regions).await?;
        tx.commit().await.map_err(Error::from)?;
        let (intent, resolutions) = found.ok_or(Error::NotFound(id))?;
        Ok(Response::new(v1::GetIntentResponse {
            intent: Some(intent.into()),
            resolutions: resolutions.into_iter().map(Into::into).collect(),
        }))
    }

    async fn list_intents_work(
        self,
        request: Request<v1::ListIntentsRequest>,
    ) -> RpcResult<v1::ListIntentsResponse> {
        let (caller, scope) = self.access(&request, Permission::Operate).await?;
        let list = validate::list(request.into_inner(), &self.limits)?;
        if let Some(region) = &list.region {
            caller.require_region("region", region)?;
        }
        let mut tx = store::begin(&self.pools, &scope).await?;
        let intents = store::list_intents(
            &mut tx,
            store::ListParams {
                states: list.states,
                kind: list.kind,
                region: list.region,
                key_regions: caller.regions,
                after: list.after,
                limit: list.limit,
                include_payload: list.include_payload,
                max_bytes: self.limits.max_reply_bytes,
            },
        )
        .await?;
        tx.commit().await.map_err(Error::from)?;
        // A page the client could not receive would stop the listing: it ends early instead.
        let (intents, next_pages) = split_at_reply_budget(intents, self.limits.max_reply_bytes);
        let next_page_token = match intents.last() {
            Some(last) if !next_pages.is_empty() || intents.len() as i64 == list.limit => {
                last.id.to_string()
            }
            _ => String::new(),
        };
        Ok(Response::new(v1::ListIntentsResponse {
            intents: intents.into_iter().map(Into::into).collect(),
            next_page_token,
        }))
    }

    async fn get_queue_stats_work(
        self,
        request: Request<v1::GetQueueStatsRequest>,
    ) -> RpcResult<v1::GetQueueStatsResponse> {
        let (caller, scope) = self.access(&request, Permission::Operate).await?;
        let mut tx = store::begin(&self.pools, &scope).await?;
        let stats = store::queue_stats(&mut tx, &caller.regions, self.clock.now()).await?;
        tx.commit().await.map_err(Error::from)?;
        Ok(Response::new(stats.into()))
    }
}

#[tonic::async_trait]
impl OutboxService for OutboxHandler {
    async fn enqueue(
        &self,
        request: Request<v1::EnqueueRequest>,
    ) -> RpcResult<v1::EnqueueResponse> {
        to_completion(self.clone().enqueue_work(request)).await
    }

    #[tracing::instrument(
        skip_all,
        fields(
            otel.name = "receive",
            otel.kind = "consumer",
            messaging.system = MESSAGING_SYSTEM,
            messaging.operation.type = "receive",
            messaging.batch.message_count,
            rpc.method = "Claim",
            auth.key,
            claim.worker,
        ),
        err
    )]
    async fn claim(&self, request: Request<v1::ClaimRequest>) -> RpcResult<v1::ClaimResponse> {
        let gone = CancellationToken::new();
        let _gone_when_dropped = gone.clone().drop_guard();
        to_completion(self.clone().claim_work(request, gone)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "ExtendLease", auth.key), err)]
    async fn extend_lease(
        &self,
        request: Request<v1::ExtendLeaseRequest>,
    ) -> RpcResult<v1::ExtendLeaseResponse> {
        to_completion(self.clone().extend_lease_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "MarkSubmitted", auth.key), err)]
    async fn mark_submitted(
        &self,
        request: Request<v1::MarkSubmittedRequest>,
    ) -> RpcResult<v1::MarkSubmittedResponse> {
        to_completion(self.clone().mark_submitted_work(request)).await
    }

    #[tracing::instrument(
        skip_all,
        fields(otel.name = "settle", otel.kind = "client", messaging.system = MESSAGING_SYSTEM,
               messaging.operation.type = "settle", rpc.method = "Ack", auth.key),
        err
    )]
    async fn ack(&self, request: Request<v1::AckRequest>) -> RpcResult<v1::AckResponse> {
        to_completion(self.clone().ack_work(request)).await
    }

    #[tracing::instrument(
        skip_all,
        fields(otel.name = "settle", otel.kind = "client", messaging.system = MESSAGING_SYSTEM,
               messaging.operation.type = "settle", rpc.method = "Fail", auth.key),
        err
    )]
    async fn fail(&self, request: Request<v1::FailRequest>) -> RpcResult<v1::FailResponse> {
        to_completion(self.clone().fail_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "Reconcile", auth.key), err)]
    async fn reconcile(
        &self,
        request: Request<v1::ReconcileRequest>,
    ) -> RpcResult<v1::ReconcileResponse> {
        to_completion(self.clone().reconcile_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "GetIntent", auth.key), err)]
    async fn get_intent(
        &self,
        request: Request<v1::GetIntentRequest>,
    ) -> RpcResult<v1::GetIntentResponse> {
        to_completion(self.clone().get_intent_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "ListIntents", auth.key), err)]
    async fn list_intents(
        &self,
        request: Request<v1::ListIntentsRequest>,
    ) -> RpcResult<v1::ListIntentsResponse> {
        to_completion(self.clone().list_intents_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "GetQueueStats", auth.key), err)]
    async fn get_queue_stats(
        &self,
        request: Request<v1::GetQueueStatsRequest>,
    ) -> RpcResult<v1::GetQueueStatsResponse> {
        to_completion(self.clone().get_queue_stats_work(request)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::leased_intent;

    #[test]
    fn a_reply_budget_keeps_the_oldest_that_fit_and_always_one() {
        let intents = |n: usize| -> Vec<Intent> {
            (0..n)
                .map(|_| {
                    let mut i = leased_intent(IntentId(uuid::Uuid::new_v4()));
                    i.payload = vec![0; 1000];
                    i
                })
                .collect()
        };
        let one = crate::proto::reply_bytes_at_most(&intents(1)[0]);
        let all = intents(5);
        let order: Vec<IntentId> = all.iter().map(|i| i.id).collect();
        let (fit, rest) = split_at_reply_budget(all, 3 * one + one / 2);
        assert_eq!(fit.iter().map(|i| i.id).collect::<Vec<_>>(), order[..3]);
        assert_eq!(rest.iter().map(|i| i.id).collect::<Vec<_>>(), order[3..]);

        let (fit, rest) = split_at_reply_budget(intents(2), 10);
        assert_eq!((fit.len(), rest.len()), (1, 1), "one goes, however large");

        let (fit, rest) = split_at_reply_budget(intents(4), usize::MAX);
        assert_eq!((fit.len(), rest.len()), (4, 0));
    }

    #[test]
    fn every_connection_level_failure_is_unavailable() {
        let eof = || std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        for e in [
            sqlx::Error::Io(eof()),
            sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
            sqlx::Error::Tls(Box::new(eof())),
            sqlx::Error::Protocol("unexpected end of file".into()),
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::WorkerCrashed,
        ] {
            assert_eq!(database_reason(&e), Reason::Unavailable, "{e:?}");
        }
        assert_eq!(database_reason(&sqlx::Error::RowNotFound), Reason::Internal);
        assert_eq!(
            database_reason(&sqlx::Error::ColumnNotFound("x".into())),
            Reason::Internal
        );
    }
}
