//! The gRPC service: `OutboxHandler` implements `outbox.v1.OutboxService`. Each method
//! validates (`crate::validate`), calls the store, and maps the result to the response;
//! errors become a `Status` here and nowhere else.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::auth::{Authenticator, Caller, Permission, TENANT_HEADER};
use crate::codec::{ClientFaults, ClientFaultsLayer};
use crate::config::{Limits, Settings};
use crate::deadline::{bounded_wait, caller_timeout};
use crate::gate::{Authenticated, Gate, GateLayer};
use crate::metrics::{Metrics, OutcomeLabels};
use crate::outbox::claim::tally::ClaimTally;
use crate::outbox::claim::{ClaimAnswer, ClaimCall, ClaimCounters, ClaimSettings, Claims, handoff};
use crate::outbox::enqueue::DirectEnqueues;
use crate::outbox::notify::PendingSignal;
use crate::outbox::store::{self, BackoffParams, ClaimParams, DeliveredRows, Pools, TenantScope};
use crate::outbox::{self, Clock, Error, FieldViolation, Intent, IntentState};
use crate::proto::v1::outbox_service_server::{OutboxService, OutboxServiceServer};
use crate::proto::v1::{self};
use crate::telemetry::messaging::{self, ACK, CLAIM, ENQUEUE, FAIL};
use crate::telemetry::{self, TRACEPARENT, TRACESTATE, TraceContext};
use crate::validate;

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
    metrics: Arc<Metrics>,
    direct_enqueues: Arc<DirectEnqueues>,
    claim_settings: ClaimSettings,
    claims: Arc<Claims>,
    /// Leases counted for the console's chart, when this server serves the console.
    claim_tally: Option<Arc<ClaimTally>>,
    delivered_rows: DeliveredRows,
}

impl OutboxHandler {
    /// Enqueue inside its span. Each intent carries the trace context it was produced in
    /// (its own `traceparent` header, else this span's, else the caller's metadata, each
    /// with its `tracestate`), so the worker's spans can link back to the producer's trace.
    async fn enqueue_work(
        self,
        request: Request<v1::EnqueueRequest>,
        caller_trace: Option<TraceContext>,
    ) -> RpcResult<v1::EnqueueResponse> {
        let span = tracing::Span::current();
        // Before validation: a refused call's span says how many it was given.
        span.record(
            "messaging.batch.message_count",
            batch_count(request.get_ref().intents.len()),
        );
        let (caller, scope) = self.access(&request, Permission::Produce).await?;
        let tenant = one_tenant(&scope, "enqueue for")?;
        let (mut intents, token) = validate::enqueue(request.into_inner(), &self.limits)?;
        for (i, intent) in intents.iter().enumerate() {
            caller.require_region(&format!("intents[{i}].region"), &intent.region)?;
        }
        if let Some(kind) = messaging::single(intents.iter().map(|i| i.kind.as_str())) {
            ENQUEUE.record_destination(&span, kind);
        }
        if let Some(tc) = TraceContext::of(&span).or(caller_trace) {
            for intent in &mut intents {
                // A producer's own traceparent wins, and a tracestate goes only with its own
                // traceparent: never pair one context's state with another's.
                if intent.headers.contains_key(TRACEPARENT) {
                    continue;
                }
                intent
                    .headers
                    .insert(TRACEPARENT.to_owned(), tc.traceparent.clone());
                match &tc.tracestate {
                    Some(ts) => intent.headers.insert(TRACESTATE.to_owned(), ts.clone()),
                    // The producer's own tracestate, without its traceparent, is no one's.
                    None => intent.headers.remove(TRACESTATE),
                };
            }
        }
        let direct = token.is_none();
        // Labels now, before the intents move: results come back in the intents' order.
        let kind_labels: Vec<&str> = intents
            .iter()
            .map(|i| self.metrics.kind_label(&i.kind))
            .collect();
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
        });
        let results = match results {
            Ok(results) => results,
            Err(e) => return Err(self.hide_holder_elsewhere(&caller, &scope, e).await.into()),
        };
        if let [one] = results.as_slice() {
            span.record("messaging.message.id", one.id.to_string());
        }
        let recorded = results.iter().filter(|r| !r.deduplicated).count();
        let handed_off = results.iter().filter(|r| r.handed_off).count();
        // Committed: wake claimers (delayed intents too, so a claimer's sleep is cut to the
        // earliest due), unless every intent was handed to a waiting claim already
        // (`outbox::claim::handoff`). Staged intents are announced by their promotion.
        if direct && recorded > handed_off {
            self.pending.announce();
        }
        self.metrics.record_enqueued(
            results
                .iter()
                .zip(&kind_labels)
                .filter(|(r, _)| !r.deduplicated)
                .map(|(_, kind)| *kind),
        );
        Ok(Response::new(v1::EnqueueResponse {
            results: results.into_iter().map(Into::into).collect(),
        }))
    }

    /// `error` with the id of an idempotency key's holder left out when the holder is not
    /// of `caller`'s regions (a region-bound key sees nothing of other regions).
    async fn hide_holder_elsewhere(
        &self,
        caller: &Caller,
        scope: &TenantScope,
        error: Error,
    ) -> Error {
        let (key, existing, reason) = match &error {
            Error::IdempotencyConflict { key, existing } => {
                (key, existing, outbox::Reason::IdempotencyConflict)
            }
            Error::IdempotencyKeyInUse { key, existing } => {
                (key, existing, outbox::Reason::IdempotencyKeyInUse)
            }
            _ => return error,
        };
        if caller.regions.is_empty() {
            return error;
        }
        let region = async {
            let mut tx = store::begin(&self.pools, scope).await?;
            let region = store::region_of(&mut tx, *existing).await?;
            tx.commit().await?;
            Ok::<_, Error>(region)
        };
        match region.await {
            Ok(Some(region)) if region.is_empty() || caller.regions.contains(&region) => error,
            _ => Error::KeyHeldElsewhere {
                key: key.clone(),
                reason,
            },
        }
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
        // Before the checks: a refused call's span names the key it was refused to.
        tracing::Span::current().record("auth.key", caller.key_name.as_str());
        caller.require(permission)?;
        let scope = caller.scope(request.metadata())?;
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
        let claim_settings = ClaimSettings {
            recheck: Duration::from_secs(2),
            hand_off: settings.claim.hand_off,
        };
        let metrics = Arc::<Metrics>::default();
        let claim_tally = settings
            .console
            .listen_addr
            .is_some()
            .then(Arc::<ClaimTally>::default);
        let (direct_enqueues, claims) = Self::use_cases(
            &pools,
            &pending,
            &clock,
            &shutdown,
            &metrics,
            claim_settings,
            claim_tally.clone(),
        );
        Self {
            pools,
            auth,
            cluster_id: cluster_id.into(),
            limits: settings.limits.clone(),
            backoff: settings.backoff(),
            clock,
            pending,
            shutdown,
            metrics,
            direct_enqueues,
            claim_settings,
            claims,
            claim_tally,
            delivered_rows: DeliveredRows::for_retention(settings.maintenance.retention),
        }
    }

    /// Records into `metrics` (by default into a private registry nobody reads).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self.rebuild_use_cases()
    }

    /// How often a long-polling Claim looks again without a notification (a safety net
    /// for notifications lost while the LISTEN connection was down).
    pub fn with_long_poll_recheck(mut self, every: Duration) -> Self {
        self.claim_settings.recheck = every;
        self.rebuild_use_cases()
    }

    fn rebuild_use_cases(mut self) -> Self {
        (self.direct_enqueues, self.claims) = Self::use_cases(
            &self.pools,
            &self.pending,
            &self.clock,
            &self.shutdown,
            &self.metrics,
            self.claim_settings,
            self.claim_tally.clone(),
        );
        self
    }

    /// The leases counted for the console's chart, when this server serves the console:
    /// someone must add them to the table (`outbox::claim::tally::add_until_stopped`).
    pub fn claim_tally(&self) -> Option<&Arc<ClaimTally>> {
        self.claim_tally.as_ref()
    }

    /// Direct enqueues and claims, counted into `metrics` (and their leases into `tally`),
    /// sharing the hand-off: leases no claimer received go back through `pools`
    /// (`outbox::claim::handoff`).
    fn use_cases(
        pools: &Pools,
        pending: &PendingSignal,
        clock: &Clock,
        shutdown: &CancellationToken,
        metrics: &Metrics,
        settings: ClaimSettings,
        tally: Option<Arc<ClaimTally>>,
    ) -> (Arc<DirectEnqueues>, Arc<Claims>) {
        let release = handoff::give_back(
            pools.clone(),
            pending.clone(),
            clock.clone(),
            metrics.given_back.clone(),
        );
        let enqueues = DirectEnqueues::new(metrics.enqueue_counters(), release, tally.clone());
        let claims = Claims::new(
            pools.clone(),
            clock.clone(),
            pending.clone(),
            shutdown.clone(),
            enqueues.handoffs().clone(),
            settings,
            ClaimCounters {
                tally,
                ..metrics.claim_counters()
            },
        );
        (Arc::new(enqueues), Arc::new(claims))
    }

    /// Wraps the handler in the generated tonic server, behind the [`Gate`] that
    /// authenticates each call and refuses request messages over their method's limit
    /// before decoding them (RESOURCE_EXHAUSTED, see `crate::gate` and `crate::codec`).
    pub fn into_server(
        self,
        max_message_bytes: usize,
    ) -> Gate<ClientFaults<OutboxServiceServer<Self>>> {
        tower::ServiceBuilder::new()
            .layer(GateLayer::new(self.auth.clone(), self.limits.clone()))
            .layer(ClientFaultsLayer)
            .service(OutboxServiceServer::new(self).max_decoding_message_size(max_message_bytes))
    }
}

/// At most what a `GetQueueStatsResponse` takes besides its policies: 100 regions of each
/// state, a region's name at most 256 bytes.
const STATS_COUNTS_BYTES: usize = 10 * 100 * 300 + 1024;

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

type RpcResult<T> = Result<Response<T>, Status>;

/// Runs an RPC's work in a task of its own. tonic drops a handler's future when its caller
/// goes away (a deadline, a reset stream), and every await would then be a place to stop
/// half way: a transaction begun and never ended, leases taken and never answered or given
/// back. In its own task the work always finishes, and an answer nobody waits for is
/// dropped; Claim alone stops early, told by its `gone` token.
async fn to_completion<T: Send + 'static>(
    work: impl Future<Output = RpcResult<T>> + Send + 'static,
) -> RpcResult<T> {
    let answer = match tokio::spawn(work.in_current_span()).await {
        Ok(answer) => answer,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(Status::unavailable("the server is shutting down; retry")),
    };
    answer.inspect_err(log_refusal)
}

/// The level a call answered with `code` is logged at: the caller's mistakes and the
/// protocol's ordinary refusals (a bad request or key, a lease lost, not found) at DEBUG,
/// since anyone who can reach the port can cause them by the thousand (a port scan filled
/// the error log); a server that cannot answer now (UNAVAILABLE, DEADLINE_EXCEEDED) at INFO,
/// its cause logged where it happened (a database error at ERROR); only a fault of outboxd
/// itself (INTERNAL, UNKNOWN, DATA_LOSS) at ERROR, which also marks the call's span failed.
fn refusal_level(code: tonic::Code) -> tracing::Level {
    use tonic::Code::*;
    match code {
        Internal | Unknown | DataLoss => tracing::Level::ERROR,
        Unavailable | DeadlineExceeded => tracing::Level::INFO,
        _ => tracing::Level::DEBUG,
    }
}

/// Logs a call's error status at its [`refusal_level`], in the call's span.
fn log_refusal(status: &Status) {
    let (code, message) = (status.code(), status.message());
    // The messaging spans' `error.type` (a no-op in spans without the field), and the
    // status that marks a span failed in a trace's view.
    let span = tracing::Span::current();
    span.record("error.type", format!("{code:?}"));
    span.set_status(opentelemetry::trace::Status::error(message.to_owned()));
    match refusal_level(code) {
        tracing::Level::ERROR => {
            tracing::error!(rpc.grpc.status_code = ?code, rpc.grpc.status_message = message, "call failed")
        }
        tracing::Level::INFO => {
            tracing::info!(rpc.grpc.status_code = ?code, rpc.grpc.status_message = message, "call failed")
        }
        _ => tracing::debug!(
            rpc.grpc.status_code = ?code,
            rpc.grpc.status_message = message,
            "call refused"
        ),
    }
}

/// `messaging.batch.message_count` as the integer the conventions make it: an `i64`, since
/// tracing-opentelemetry exports a `u64` or `usize` as its text.
fn batch_count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The caller's trace context: its `traceparent` and `tracestate` metadata, if valid.
fn caller_trace(metadata: &tonic::metadata::MetadataMap) -> Option<TraceContext> {
    let get = |name| metadata.get(name).and_then(|v| v.to_str().ok());
    TraceContext::parse(get(TRACEPARENT)?, get(TRACESTATE))
}

/// Records, on the current settle span, how many intents it settles (and which, if one).
fn record_settling(mut leases: impl ExactSizeIterator<Item = outbox::IntentId>) {
    let span = tracing::Span::current();
    let count = leases.len();
    span.record("messaging.batch.message_count", batch_count(count));
    if let (1, Some(id)) = (count, leases.next()) {
        span.record("messaging.message.id", id.to_string());
    }
}

/// Links the current settle span to the producers of the intents it settled (their
/// `traceparent`: the settle statements return no `tracestate`).
fn link_settled(results: &[outbox::ItemResult]) {
    telemetry::link_to(
        &tracing::Span::current(),
        results
            .iter()
            .filter_map(|r| r.traceparent.as_deref())
            .map(|tp| (tp, None)),
    );
}

/// The RPCs' work, each run to completion by [`to_completion`].
impl OutboxHandler {
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
        let (metadata, _, message) = request.into_parts();
        let claim = validate::claim(message, &self.limits)?;
        caller.require_region("region", &claim.region)?;
        let span = tracing::Span::current();
        span.record("claim.worker", claim.worker_id.as_str());
        span.record("messaging.client.id", claim.worker_id.as_str());
        if let [kind] = claim.kinds.as_slice() {
            CLAIM.record_destination(&span, kind);
        }
        let params = ClaimParams {
            worker_id: &claim.worker_id,
            region: &claim.region,
            kinds: &claim.kinds,
            max_intents: claim.max_intents,
            lease_duration: claim.lease_duration,
            request_id: claim.request_id.as_deref(),
            key_id: caller.key_id,
            now: self.clock.now(),
            floors: &[],
            max_bytes: self.limits.max_reply_bytes,
        };
        // Before the caller's own deadline, if it set one: an answer it no longer waits for
        // would take its leases with it.
        let deadline = received + bounded_wait(claim.wait, caller_timeout);
        let call = ClaimCall {
            scope: &scope,
            params,
            wait: claim.wait,
            deadline,
        };
        // A long poll stops, as for a caller gone, when its key is revoked meanwhile.
        let stop = gone.child_token();
        let long_poll = !claim.wait.is_zero();
        let answer = {
            let claiming = self.claims.claim(call, &stop);
            tokio::pin!(claiming);
            let revoked = async {
                if !long_poll {
                    std::future::pending::<()>().await;
                }
                until_revoked(&self.auth, &metadata).await;
                stop.cancel();
            };
            tokio::select! {
                answer = &mut claiming => answer,
                () = revoked => claiming.await,
            }
        };
        let (intents, replayed) = match answer? {
            ClaimAnswer::Leased { intents, replayed } => (intents, replayed),
            ClaimAnswer::CallerGone if gone.is_cancelled() => {
                return Err(Status::cancelled("the caller went away before its answer"));
            }
            ClaimAnswer::CallerGone => {
                return Err(Error::Unauthenticated(
                    "the API key was revoked while the Claim waited".to_owned(),
                )
                .into());
            }
        };
        // A reply larger than the worker's client accepts would be refused after its leases
        // committed, costing each intent an attempt unseen: answer with those that fit and
        // give the rest back. Not a replay's: an earlier reply may have delivered them.
        let (intents, over_budget) = split_at_reply_budget(intents, self.limits.max_reply_bytes);
        if !over_budget.is_empty() && !replayed {
            self.claims.give_back(&scope, over_budget);
        }
        span.record("messaging.batch.message_count", batch_count(intents.len()));
        if let [one] = intents.as_slice() {
            span.record("messaging.message.id", one.id.to_string());
        }
        // The receive span's parent is the worker's call; each intent's producer is a link.
        telemetry::link_to(
            &span,
            intents.iter().filter_map(|i| {
                let headers = &i.headers.0;
                let tp = headers.get(TRACEPARENT)?;
                Some((tp.as_str(), headers.get(TRACESTATE).map(String::as_str)))
            }),
        );
        if !replayed {
            let now = self.clock.now().unwrap_or_else(chrono::Utc::now);
            self.metrics.record_claimed(intents.iter().map(|i| {
                let waited = (now - i.available_at).to_std().unwrap_or_default();
                (i.kind.as_str(), waited)
            }));
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
        record_settling(leases.iter().map(|l| l.intent_id));
        let store::Settled { results, released } = store::ack_intents(
            &self.pools,
            caller.settling(&scope),
            &leases,
            self.delivered_rows,
            self.clock.now(),
        )
        .await
        // It may have committed, releasing the next intents of ordering keys.
        .inspect_err(|_| self.pending.announce())?;
        // The next intents of the ordering keys it finished (committed already); a replay
        // cannot tell whether the attempt that applied it announced them.
        if released > 0 || results.iter().any(|r| !r.applied && r.error.is_none()) {
            self.pending.announce();
        }
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
        record_settling(failures.iter().map(|f| f.lease.intent_id));
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
            // until its recheck, `outbox::claim::drained`).
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

    /// Most items a request may carry (`OUTBOX_LIMITS__MAX_BATCH`): the console's pages
    /// and selections stay within it.
    pub(crate) fn max_batch(&self) -> usize {
        self.limits.max_batch
    }

    /// Longest text a request may carry (`OUTBOX_LIMITS__MAX_TEXT_LENGTH`): the console's
    /// reason boxes take as much.
    pub(crate) fn max_text_length(&self) -> usize {
        self.limits.max_text_length
    }

    /// An operator call's transaction: its statements end at the operator timeout.
    pub(crate) async fn begin_operator(
        &self,
        scope: &TenantScope,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, Error> {
        store::begin_with(
            &self.pools,
            scope,
            &[store::AlsoAtBegin::StatementTimeout(
                self.limits.operator_timeout,
            )],
        )
        .await
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
        let mut tx = self.begin_operator(&scope).await?;
        let results = store::resolve_intents(
            &mut tx,
            store::ReconcileParams {
                target: r.target,
                decision: r.decision,
                key_regions: &caller.regions,
                actor: &r.actor,
                api_key: &caller.key_name,
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
        let mut tx = self.begin_operator(&scope).await?;
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
        let mut tx = self.begin_operator(&scope).await?;
        let listed = store::list_intents(
            &mut tx,
            store::ListParams {
                states: list.states,
                kind: list.kind,
                region: list.region,
                ordering_key: list.ordering_key,
                key_regions: caller.regions,
                after: list.after,
                // One more than the page: whether there is a next page, without asking.
                limit: list.limit + 1,
                include_payload: list.include_payload,
                awaiting_decision: list.awaiting_decision,
                max_bytes: self.limits.max_reply_bytes,
            },
        )
        .await?;
        tx.commit().await.map_err(Error::from)?;
        let mut intents = listed.intents;
        let beyond = intents.len() as i64 > list.limit;
        intents.truncate(usize::try_from(list.limit).unwrap_or(0));
        // A page the client could not receive would stop the listing: it ends early instead.
        let (intents, next_pages) = split_at_reply_budget(intents, self.limits.max_reply_bytes);
        let more = beyond || listed.cut_short || !next_pages.is_empty();
        let next_page_token = match intents.last() {
            Some(last) if more => last.id.to_string(),
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
        let mut tx = self.begin_operator(&scope).await?;
        // What the counts take (at most 100 regions of each state) is left out of the
        // policies' share of the reply.
        let policies_budget = self
            .limits
            .max_reply_bytes
            .saturating_sub(STATS_COUNTS_BYTES);
        let stats =
            store::queue_stats(&mut tx, &caller.regions, policies_budget, self.clock.now()).await?;
        tx.commit().await.map_err(Error::from)?;
        Ok(Response::new(stats.into()))
    }

    async fn set_queue_policy_work(
        self,
        request: Request<v1::SetQueuePolicyRequest>,
    ) -> RpcResult<v1::SetQueuePolicyResponse> {
        let (caller, scope) = self.access(&request, Permission::Operate).await?;
        let tenant = one_tenant(&scope, "set a policy of")?;
        // A policy holds for the queue's intents of every region.
        if !caller.regions.is_empty() {
            return Err(Error::PermissionDenied(
                outbox::Reason::RegionNotAllowed,
                format!(
                    "API key {:?} is limited to regions ({}), and a queue policy applies to \
                     every region",
                    caller.key_name,
                    caller.regions.join(", ")
                ),
            )
            .into());
        }
        let change = validate::queue_policy(request.into_inner(), &self.limits)?;
        let mut tx = self.begin_operator(&scope).await?;
        let policy = store::set_queue_policy(
            &mut tx,
            store::PolicyParams {
                tenant: &tenant,
                kind: &change.kind,
                paused: change.paused,
                max_in_flight: change.max_in_flight,
                rate: change.rate,
                actor: &change.actor,
                api_key: &caller.key_name,
                reason: &change.reason,
                expected_updated_at: change.expected_updated_at,
                now: self.clock.now(),
            },
        )
        .await?;
        tx.commit().await.map_err(Error::from)?;
        // Not the policy the caller read: nothing was changed (as a Reconcile by ids on an
        // intent changed since it was read).
        let policy = policy.map_err(|current| {
            let now = match &current {
                Some(p) => format!(
                    "it was set at {} by {}",
                    p.updated_at
                        .to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
                    p.updated_by
                ),
                None => "the queue has no policy".to_owned(),
            };
            crate::status::refusal(
                outbox::Reason::Conflict,
                format!(
                    "the policy of queue {tenant}/{} changed after it was read ({now}); read it \
                     again before changing it; nothing was changed",
                    change.kind
                ),
            )
        })?;
        // A pause or a limit lifted makes intents claimable: claims waiting here and on
        // the other replicas look again.
        self.pending.announce();
        tracing::info!(
            queue.tenant = %tenant,
            queue.kind = %change.kind,
            queue.paused = change.paused,
            queue.max_in_flight = change.max_in_flight,
            queue.rate_per_second = change.rate.map(|(rate, _)| rate),
            queue.burst = change.rate.map(|(_, burst)| burst),
            policy.actor = %change.actor,
            policy.reason = %change.reason,
            auth.key = %caller.key_name,
            "operator set a queue policy"
        );
        Ok(Response::new(v1::SetQueuePolicyResponse {
            policy: Some(policy.into()),
        }))
    }

    async fn list_queue_policies_work(
        self,
        request: Request<v1::ListQueuePoliciesRequest>,
    ) -> RpcResult<v1::ListQueuePoliciesResponse> {
        let (_, scope) = self.access(&request, Permission::Operate).await?;
        let (kind, after) = validate::queue_policies(request.into_inner(), &self.limits)?;
        let mut tx = self.begin_operator(&scope).await?;
        let page = store::list_queue_policies(
            &mut tx,
            kind.as_deref(),
            after.as_ref(),
            self.limits.max_reply_bytes,
            self.clock.now(),
        )
        .await?;
        tx.commit().await.map_err(Error::from)?;
        Ok(Response::new(v1::ListQueuePoliciesResponse {
            policies: page.policies.into_iter().map(Into::into).collect(),
            next_page_token: page.next.map(|c| c.token()).unwrap_or_default(),
        }))
    }
}

/// The one tenant a call that writes acts for: the key's only tenant, or the one named in
/// the tenant header.
fn one_tenant(scope: &TenantScope, to: &str) -> Result<String, Error> {
    scope.single().map(str::to_owned).ok_or_else(|| {
        Error::InvalidArgument(vec![FieldViolation::new(
            TENANT_HEADER,
            format!(
                "this API key acts for several tenants: name the one to {to} in the \
                 x-outbox-tenant metadata"
            ),
        )])
    })
}

/// Returns once the key presented in `metadata` no longer authenticates (revoked), read
/// through the key cache every second (or its TTL, at least 100 ms): a long poll learns of
/// it within the cache's TTL and a second, as a new call would.
async fn until_revoked(auth: &Authenticator, metadata: &tonic::metadata::MetadataMap) {
    let every = auth
        .ttl()
        .clamp(Duration::from_millis(100), Duration::from_secs(1));
    loop {
        tokio::time::sleep(every).await;
        if let Err(Error::Unauthenticated(_)) = auth.authenticate(metadata).await {
            return;
        }
    }
}

#[tonic::async_trait]
impl OutboxService for OutboxHandler {
    async fn enqueue(
        &self,
        request: Request<v1::EnqueueRequest>,
    ) -> RpcResult<v1::EnqueueResponse> {
        let caller = caller_trace(request.metadata());
        let span = ENQUEUE.span(caller.as_ref(), request.local_addr());
        to_completion(self.clone().enqueue_work(request, caller))
            .instrument(span)
            .await
    }

    async fn claim(&self, request: Request<v1::ClaimRequest>) -> RpcResult<v1::ClaimResponse> {
        let gone = CancellationToken::new();
        let _gone_when_dropped = gone.clone().drop_guard();
        // Built by hand rather than with #[instrument], as the other messaging spans: the
        // caller's trace context must become the parent before the span starts.
        let span = CLAIM.span(
            caller_trace(request.metadata()).as_ref(),
            request.local_addr(),
        );
        to_completion(self.clone().claim_work(request, gone))
            .instrument(span)
            .await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "ExtendLease", auth.key))]
    async fn extend_lease(
        &self,
        request: Request<v1::ExtendLeaseRequest>,
    ) -> RpcResult<v1::ExtendLeaseResponse> {
        to_completion(self.clone().extend_lease_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "MarkSubmitted", auth.key))]
    async fn mark_submitted(
        &self,
        request: Request<v1::MarkSubmittedRequest>,
    ) -> RpcResult<v1::MarkSubmittedResponse> {
        to_completion(self.clone().mark_submitted_work(request)).await
    }

    async fn ack(&self, request: Request<v1::AckRequest>) -> RpcResult<v1::AckResponse> {
        let span = ACK.span(
            caller_trace(request.metadata()).as_ref(),
            request.local_addr(),
        );
        to_completion(self.clone().ack_work(request))
            .instrument(span)
            .await
    }

    async fn fail(&self, request: Request<v1::FailRequest>) -> RpcResult<v1::FailResponse> {
        let span = FAIL.span(
            caller_trace(request.metadata()).as_ref(),
            request.local_addr(),
        );
        to_completion(self.clone().fail_work(request))
            .instrument(span)
            .await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "Reconcile", auth.key))]
    async fn reconcile(
        &self,
        request: Request<v1::ReconcileRequest>,
    ) -> RpcResult<v1::ReconcileResponse> {
        to_completion(self.clone().reconcile_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "GetIntent", auth.key))]
    async fn get_intent(
        &self,
        request: Request<v1::GetIntentRequest>,
    ) -> RpcResult<v1::GetIntentResponse> {
        to_completion(self.clone().get_intent_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "ListIntents", auth.key))]
    async fn list_intents(
        &self,
        request: Request<v1::ListIntentsRequest>,
    ) -> RpcResult<v1::ListIntentsResponse> {
        to_completion(self.clone().list_intents_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "GetQueueStats", auth.key))]
    async fn get_queue_stats(
        &self,
        request: Request<v1::GetQueueStatsRequest>,
    ) -> RpcResult<v1::GetQueueStatsResponse> {
        to_completion(self.clone().get_queue_stats_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "SetQueuePolicy", auth.key))]
    async fn set_queue_policy(
        &self,
        request: Request<v1::SetQueuePolicyRequest>,
    ) -> RpcResult<v1::SetQueuePolicyResponse> {
        to_completion(self.clone().set_queue_policy_work(request)).await
    }

    #[tracing::instrument(skip_all, fields(rpc.method = "ListQueuePolicies", auth.key))]
    async fn list_queue_policies(
        &self,
        request: Request<v1::ListQueuePoliciesRequest>,
    ) -> RpcResult<v1::ListQueuePoliciesResponse> {
        to_completion(self.clone().list_queue_policies_work(request)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::{IntentId, leased_intent};

    #[test]
    fn client_errors_are_logged_below_warn_and_only_server_faults_at_error() {
        use tonic::Code::*;
        for code in [
            InvalidArgument,
            Unauthenticated,
            PermissionDenied,
            NotFound,
            AlreadyExists,
            FailedPrecondition,
            Aborted,
            OutOfRange,
            ResourceExhausted,
            Cancelled,
            Unimplemented,
        ] {
            assert_eq!(refusal_level(code), tracing::Level::DEBUG, "{code:?}");
        }
        assert_eq!(refusal_level(Unavailable), tracing::Level::INFO);
        assert_eq!(refusal_level(DeadlineExceeded), tracing::Level::INFO);
        for code in [Internal, Unknown, DataLoss] {
            assert_eq!(refusal_level(code), tracing::Level::ERROR, "{code:?}");
        }
    }

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
}
