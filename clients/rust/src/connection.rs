//! Channels to every outboxd endpoint, the API key (and tenant) on every call, per-attempt
//! deadlines, and retries of transient failures with jittered backoff, moving to the next
//! endpoint each time.
//!
//! A retry sends the *same* request: the same idempotency keys, Claim `request_id` or
//! leases, which is what the server's replay rules are for.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

use crate::error::{self, Error};
use crate::proto::outbox_service_client::OutboxServiceClient;
use crate::proto::{GetIntentRequest, GetIntentResponse};

/// The generated client of `outbox.v1.OutboxService` on one endpoint, sending the
/// connection's credentials and an attempt deadline with every request.
pub type Client = OutboxServiceClient<InterceptedService<Channel, Credentials>>;

/// Sent as the tenant header: needed by `Enqueue` when the key has several tenants.
const TENANT_HEADER: &str = "x-outbox-tenant";

/// Backoff between attempts: uniform in `[ceiling / 4, ceiling]`, the ceiling doubling from
/// 50 ms to 2 s.
const BACKOFF_BASE: Duration = Duration::from_millis(50);
const BACKOFF_CAP: Duration = Duration::from_secs(2);

/// Adds `authorization: Bearer <key>`, the tenant, `grpc-timeout` and (with the `otel`
/// feature) the caller's trace context to each request.
///
/// Part of the [`Client`] type; made by [`Connection`], not by hand.
#[derive(Clone, Debug)]
pub struct Credentials {
    authorization: AsciiMetadataValue,
    tenant: Option<AsciiMetadataValue>,
    timeout: Option<Duration>,
}

impl Interceptor for Credentials {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let metadata = request.metadata_mut();
        metadata.insert("authorization", self.authorization.clone());
        if let Some(tenant) = &self.tenant {
            metadata.insert(TENANT_HEADER, tenant.clone());
        }
        // Runs in the caller's poll: its span is current, and outboxd's span of the call
        // becomes that span's child.
        for (name, value) in crate::trace::current_context() {
            if let (Ok(name), Ok(value)) = (
                tonic::metadata::AsciiMetadataKey::from_bytes(name.as_bytes()),
                AsciiMetadataValue::try_from(value),
            ) && !metadata.contains_key(&name)
            {
                metadata.insert(name, value);
            }
        }
        // A deadline the caller set on the request wins; tonic enforces it on this side
        // too, and the server answers before it.
        if let Some(timeout) = self.timeout
            && !request.metadata().contains_key("grpc-timeout")
        {
            request.set_timeout(timeout);
        }
        Ok(request)
    }
}

/// When a failed call is sent again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retry {
    /// Never: the first answer is final.
    Never,
    /// Only when the server cannot have acted: the connection could not be made, or
    /// outboxd said nothing was written (`UNAVAILABLE`/`UNAVAILABLE`,
    /// `ABORTED`/`CONFLICT`). For requests whose repeat could act twice (an `Enqueue` of
    /// intents without idempotency keys).
    IfNotApplied,
    /// Every transient failure: `UNAVAILABLE`, `DEADLINE_EXCEEDED`, `ABORTED`/`CONFLICT`,
    /// a broken connection. For requests whose repeat is a replay (a Claim with its
    /// `request_id`, settles with their leases, an `Enqueue` whose intents all have keys).
    Transient,
}

impl Retry {
    pub(crate) fn allows(self, status: &Status) -> bool {
        match self {
            Self::Never => false,
            Self::IfNotApplied => {
                let reason = error::reason(status);
                error::never_sent(status)
                    || (status.code() == Code::Unavailable
                        && reason.as_deref() == Some("UNAVAILABLE"))
                    || (status.code() == Code::Aborted && reason.as_deref() == Some("CONFLICT"))
            }
            Self::Transient => error::is_transient(status) || error::never_sent(status),
        }
    }
}

/// How one logical call is made: the deadline of each attempt, how long to keep retrying,
/// and which failures to retry.
#[derive(Clone, Copy, Debug)]
pub struct CallOptions {
    attempt_timeout: Duration,
    budget: Duration,
    retry: Retry,
    bounded: bool,
}

impl CallOptions {
    /// Attempts of `attempt_timeout` each (sent as `grpc-timeout` and enforced here),
    /// transient failures retried for as long again.
    pub fn new(attempt_timeout: Duration) -> Self {
        Self {
            attempt_timeout,
            budget: attempt_timeout,
            retry: Retry::Transient,
            bounded: false,
        }
    }

    /// Stops retrying once this long has passed since the first attempt (no new attempt
    /// starts after it; the last error is returned).
    pub fn budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// A retry's deadline ends with the budget too, so that the budget bounds the whole
    /// call (not for a long poll, whose retry must wait as long as its first attempt).
    pub fn bounded(mut self) -> Self {
        self.bounded = true;
        self
    }

    /// Which failures are sent again (default [`Retry::Transient`]).
    pub fn retry(mut self, retry: Retry) -> Self {
        self.retry = retry;
        self
    }

    /// The deadline of each attempt.
    pub fn attempt_timeout(&self) -> Duration {
        self.attempt_timeout
    }
}

/// Builds a [`Connection`]; see [`Connection::builder`].
#[derive(Debug)]
pub struct ConnectionBuilder {
    endpoints: Vec<String>,
    api_key: Option<String>,
    tenant: Option<String>,
    connect_timeout: Duration,
    call_timeout: Duration,
    #[cfg(feature = "tls")]
    tls: Option<tonic::transport::ClientTlsConfig>,
}

impl ConnectionBuilder {
    /// The `obx_…` key from `outboxd keys create`, sent as `authorization: Bearer …`.
    pub fn api_key(mut self, api_key: impl Into<String>) -> Self {
        self.api_key = Some(api_key.into());
        self
    }

    /// Sent as `x-outbox-tenant`: needed when the key is bound to several tenants.
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// How long connecting to an endpoint may take before the call moves on (default 2 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The deadline of each attempt of a call that does not long-poll (default 10 s);
    /// a Claim's is its `wait` plus this.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// TLS for every endpoint (CA, client identity for mTLS, domain name): `host:port`
    /// endpoints are dialled as `https://`, and `http://` ones are refused by `build`.
    /// `https://` endpoints without it use the roots tonic was built with.
    #[cfg(feature = "tls")]
    pub fn tls(mut self, tls: tonic::transport::ClientTlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The connection, with lazy channels: nothing is dialled until the first call.
    ///
    /// # Errors
    /// [`Error::Invalid`] without endpoints or API key, or with an endpoint that is not a
    /// URI or a key that cannot be a header; [`Error::Transport`] for a TLS configuration
    /// tonic refuses.
    pub fn build(self) -> Result<Connection, Error> {
        if self.endpoints.is_empty() {
            return Err(Error::Invalid(
                "outboxd: at least one endpoint is needed".into(),
            ));
        }
        let api_key = self.api_key.filter(|k| !k.is_empty()).ok_or_else(|| {
            Error::Invalid("outboxd: an API key is needed (outboxd keys create …)".into())
        })?;
        let header = |value: String, what: &str| {
            AsciiMetadataValue::try_from(value)
                .map_err(|_| Error::Invalid(format!("outboxd: the {what} must be ASCII")))
        };
        let credentials = Credentials {
            authorization: header(format!("Bearer {api_key}"), "API key")?,
            tenant: self
                .tenant
                .filter(|t| !t.is_empty())
                .map(|t| header(t, "tenant"))
                .transpose()?,
            timeout: None,
        };
        // A bare `host:port` is https when TLS is configured: tonic dials TLS only for it.
        #[cfg(feature = "tls")]
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        #[cfg(not(feature = "tls"))]
        let scheme = "http";
        let mut channels = Vec::with_capacity(self.endpoints.len());
        for endpoint in &self.endpoints {
            let uri = if endpoint.contains("://") {
                endpoint.clone()
            } else {
                format!("{scheme}://{endpoint}")
            };
            #[cfg(feature = "tls")]
            if self.tls.is_some() && uri.starts_with("http://") {
                return Err(Error::Invalid(format!(
                    "outboxd: endpoint {endpoint} is plaintext, and TLS is configured: use \
                     https:// (or host:port)"
                )));
            }
            #[cfg(not(feature = "tls"))]
            if uri.starts_with("https://") {
                return Err(Error::Invalid(format!(
                    "outboxd: {endpoint} needs TLS: enable the crate's `tls` feature"
                )));
            }
            #[cfg(feature = "tls")]
            let https = uri.starts_with("https://");
            #[cfg_attr(
                not(feature = "tls"),
                expect(unused_mut, reason = "set up again for TLS")
            )]
            let mut channel = Endpoint::from_shared(uri)
                .map_err(|e| Error::Invalid(format!("outboxd: endpoint {endpoint}: {e}")))?
                .connect_timeout(self.connect_timeout)
                .tcp_nodelay(true);
            #[cfg(feature = "tls")]
            {
                // `from_shared` sets up no TLS of its own, even for https.
                let tls = match &self.tls {
                    Some(tls) => Some(tls.clone()),
                    None if https => {
                        Some(tonic::transport::ClientTlsConfig::new().with_enabled_roots())
                    }
                    None => None,
                };
                if let Some(tls) = tls {
                    channel = channel.tls_config(tls)?;
                }
            }
            channels.push(channel.connect_lazy());
        }
        Ok(Connection {
            inner: Arc::new(Inner {
                endpoints: self.endpoints,
                channels,
                credentials,
                call_timeout: self.call_timeout,
                current: AtomicUsize::new(0),
            }),
        })
    }
}

/// Channels to one or several outboxd replicas, sharing an API key. Cheap to clone: clones
/// share the channels and the endpoint in use.
///
/// Calls go to the first endpoint and stay on the one that answers; an endpoint that fails
/// with `UNAVAILABLE` or a transport error is left for the next.
#[derive(Clone, Debug)]
pub struct Connection {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    endpoints: Vec<String>,
    channels: Vec<Channel>,
    credentials: Credentials,
    call_timeout: Duration,
    current: AtomicUsize,
}

impl Connection {
    /// Starts a connection to `endpoints`: `host:port` (plaintext), `http://host:port` or
    /// `https://host:port` (TLS).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), outboxd_client::Error> {
    /// let connection = outboxd_client::Connection::builder(["outboxd-0:50051", "outboxd-1:50051"])
    ///     .api_key("obx_…")
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn builder<I, S>(endpoints: I) -> ConnectionBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ConnectionBuilder {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            api_key: None,
            tenant: None,
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(10),
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// The endpoints, in the order they are tried.
    pub fn endpoints(&self) -> &[String] {
        &self.inner.endpoints
    }

    /// The deadline of each attempt of a call that does not long-poll.
    pub fn call_timeout(&self) -> Duration {
        self.inner.call_timeout
    }

    /// The generated client on the endpoint in use, for calls this crate does not wrap
    /// (each request gets the call timeout unless it sets its own). No retries: use
    /// [`Connection::call`] for those.
    pub fn client(&self) -> Client {
        self.client_at(
            self.inner.current.load(Ordering::Relaxed),
            self.inner.call_timeout,
        )
    }

    fn client_at(&self, index: usize, timeout: Duration) -> Client {
        let index = index % self.inner.channels.len();
        let credentials = Credentials {
            timeout: Some(timeout),
            ..self.inner.credentials.clone()
        };
        // Replies of any size: the server bounds them (OUTBOX_LIMITS__MAX_REPLY_BYTES), and
        // tonic's 4 MiB default would refuse a Claim of an intent the server accepted.
        OutboxServiceClient::with_interceptor(self.inner.channels[index].clone(), credentials)
            .max_decoding_message_size(usize::MAX)
    }

    /// One logical call: `attempt` is given a client (on the endpoint in use, with the
    /// attempt deadline) and must send the same request each time. Failures that
    /// `options` retries are retried with backoff on the next endpoint until its budget
    /// is spent.
    ///
    /// ```no_run
    /// # async fn f(connection: outboxd_client::Connection) -> Result<(), outboxd_client::Error> {
    /// use std::time::Duration;
    /// use outboxd_client::{CallOptions, proto};
    /// let stats = connection
    ///     .call(CallOptions::new(Duration::from_secs(5)), |mut client| async move {
    ///         client.get_queue_stats(proto::GetQueueStatsRequest {}).await
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The first failure `options` does not retry, or the last one once the budget is spent.
    pub async fn call<T, F, Fut>(&self, options: CallOptions, attempt: F) -> Result<T, Error>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_traced(options, &mut Attempts::default(), attempt)
            .await
    }

    /// [`Connection::call`], recording each attempt in `attempts` (a logical call that
    /// spans several of these, like a Claim retried past its budget, shares one record).
    pub(crate) async fn call_traced<T, F, Fut>(
        &self,
        options: CallOptions,
        attempts: &mut Attempts,
        mut attempt: F,
    ) -> Result<T, Error>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let started = Instant::now();
        let mut backoff = Backoff::default();
        let mut first = true;
        loop {
            let index = self.inner.current.load(Ordering::Relaxed) % self.inner.channels.len();
            let timeout = if first || !options.bounded {
                options.attempt_timeout
            } else {
                let left = options.budget.saturating_sub(started.elapsed());
                options
                    .attempt_timeout
                    .min(left)
                    .max(Duration::from_millis(1))
            };
            first = false;
            let client = self.client_at(index, timeout);
            attempts.begin(index);
            let sent = Instant::now();
            // tonic enforces the grpc-timeout it sends; this is the backstop for an answer
            // whose headers came but whose body never does.
            let backstop = timeout.saturating_add(Duration::from_secs(1));
            let answer = tokio::time::timeout(backstop, attempt(client)).await;
            attempts.last_took = sent.elapsed();
            let status = match answer {
                Ok(Ok(response)) => return Ok(response.into_inner()),
                Ok(Err(status)) => local_deadline(status, timeout),
                Err(_) => Status::deadline_exceeded(format!("no answer within {timeout:?}")),
            };
            // Another replica may answer while this one recovers: the next try, or the
            // caller's next call once the budget is spent or when this failure is not
            // tried again (a hung replica times out every try, and must not keep every
            // later call). Only the caller that saw the failure moves on: concurrent
            // failures on one endpoint move once.
            if Retry::Transient.allows(&status) {
                let next = (index + 1) % self.inner.channels.len();
                let _ = self.inner.current.compare_exchange(
                    index,
                    next,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            if !options.retry.allows(&status) {
                return Err(status.into());
            }
            let pause = backoff.next();
            if started.elapsed() + pause >= options.budget {
                return Err(status.into());
            }
            tracing::debug!(
                endpoint = %self.inner.endpoints[index],
                code = ?status.code(),
                message = status.message(),
                "outboxd call failed; retrying on the next endpoint in {pause:?}"
            );
            attempts.record_retry(status);
            tokio::time::sleep(pause).await;
        }
    }

    /// The intent with its payload and resolution history (the key needs the `operate`
    /// scope, or `admin`).
    ///
    /// # Errors
    /// outboxd's refusal (`NOT_FOUND`, `PERMISSION_DENIED`, …) or no answer.
    pub async fn get_intent(&self, id: &str) -> Result<GetIntentResponse, Error> {
        let request = GetIntentRequest { id: id.to_owned() };
        self.call(CallOptions::new(self.inner.call_timeout), |mut client| {
            let request = request.clone();
            async move { client.get_intent(request).await }
        })
        .await
    }
}

/// How one logical call went, attempt by attempt: what a
/// [`WorkerObserver`](crate::WorkerObserver) is told with each answer.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Attempts {
    /// Attempts sent (1 when nothing was retried).
    pub count: u32,
    /// The failures that were retried, in order (empty when the first attempt answered);
    /// the last [`Attempts::KEPT`] of them when there were more (`count` says how many).
    pub retried: Vec<Status>,
    /// Index in [`Connection::endpoints`] of the endpoint the last attempt went to.
    pub endpoint: usize,
    /// When the last attempt was sent (the one that answered, if any): whatever the
    /// answer holds that the server made before this was made by an earlier attempt.
    pub last_sent: SystemTime,
    /// How long the last attempt took.
    pub last_took: Duration,
}

impl Default for Attempts {
    fn default() -> Self {
        Self {
            count: 0,
            retried: Vec::new(),
            endpoint: 0,
            last_sent: SystemTime::UNIX_EPOCH,
            last_took: Duration::ZERO,
        }
    }
}

impl Attempts {
    /// The most failures [`Attempts::retried`] keeps: a Claim retried through a long outage
    /// would otherwise keep one a second, for ever.
    pub const KEPT: usize = 32;

    /// Records a failure that is retried, keeping the last [`Attempts::KEPT`].
    pub(crate) fn record_retry(&mut self, status: Status) {
        if self.retried.len() >= Self::KEPT {
            self.retried.remove(0);
        }
        self.retried.push(status);
    }

    fn begin(&mut self, endpoint: usize) {
        self.count += 1;
        self.endpoint = endpoint;
        self.last_sent = SystemTime::now();
    }
}

/// tonic reports its own deadline as CANCELLED "Timeout expired": say DEADLINE_EXCEEDED.
fn local_deadline(status: Status, timeout: Duration) -> Status {
    if status.code() != Code::Cancelled {
        return status;
    }
    let mut source = std::error::Error::source(&status);
    while let Some(error) = source {
        if error.is::<tonic::TimeoutExpired>() {
            return Status::deadline_exceeded(format!("no answer within {timeout:?}"));
        }
        source = error.source();
    }
    status
}

/// Full-jitter exponential backoff.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    tries: u32,
}

impl Backoff {
    /// The next pause: uniform in `[ceiling / 4, ceiling]`, the ceiling doubling from
    /// 50 ms up to 2 s.
    pub(crate) fn next(&mut self) -> Duration {
        let ceiling = BACKOFF_BASE
            .saturating_mul(1 << self.tries.min(16))
            .min(BACKOFF_CAP);
        self.tries += 1;
        ceiling.mul_f64(0.25 + 0.75 * random_unit())
    }
}

/// A uniform number in `[0, 1)`, from the operating system's randomness (via `uuid`).
pub(crate) fn random_unit() -> f64 {
    // The first 48 bits of a v4 UUID are random (its version nibble comes after them).
    (uuid::Uuid::new_v4().as_u128() >> 80) as f64 / (1u64 << 48) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unavailable(reason: &str) -> Status {
        // As outboxd sends it: UNAVAILABLE with an ErrorInfo reason.
        #[derive(Clone, PartialEq, prost::Message)]
        struct Info {
            #[prost(string, tag = "1")]
            reason: String,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        struct Rpc {
            #[prost(int32, tag = "1")]
            code: i32,
            #[prost(string, tag = "2")]
            message: String,
            #[prost(message, repeated, tag = "3")]
            details: Vec<prost_types::Any>,
        }
        let any = prost_types::Any {
            type_url: "type.googleapis.com/google.rpc.ErrorInfo".into(),
            value: prost::Message::encode_to_vec(&Info {
                reason: reason.into(),
            }),
        };
        let details = Rpc {
            code: Code::Unavailable as i32,
            message: String::new(),
            details: vec![any],
        };
        Status::with_details(
            Code::Unavailable,
            "",
            prost::Message::encode_to_vec(&details).into(),
        )
    }

    #[test]
    fn a_request_that_may_have_been_applied_is_retried_only_when_a_repeat_is_a_replay() {
        let lost_commit = unavailable("COMMIT_OUTCOME_UNKNOWN");
        assert!(Retry::Transient.allows(&lost_commit));
        assert!(!Retry::IfNotApplied.allows(&lost_commit));
        assert!(Retry::IfNotApplied.allows(&unavailable("UNAVAILABLE")));
        assert!(!Retry::IfNotApplied.allows(&Status::deadline_exceeded("")));
        assert!(!Retry::Never.allows(&unavailable("UNAVAILABLE")));
    }

    #[test]
    fn backoff_pauses_grow_from_a_quarter_of_50_ms_to_at_most_2_s() {
        let mut backoff = Backoff::default();
        let first = backoff.next();
        assert!(
            first >= BACKOFF_BASE / 4 && first <= BACKOFF_BASE,
            "{first:?}"
        );
        for _ in 0..40 {
            let pause = backoff.next();
            assert!(pause <= BACKOFF_CAP, "{pause:?}");
        }
        assert!(backoff.next() >= BACKOFF_CAP / 4);
    }

    #[test]
    fn a_connection_needs_an_endpoint_and_a_key() {
        let none: [&str; 0] = [];
        assert!(matches!(
            Connection::builder(none).api_key("k").build(),
            Err(Error::Invalid(_))
        ));
        assert!(matches!(
            Connection::builder(["127.0.0.1:1"]).build(),
            Err(Error::Invalid(_))
        ));
    }
}
